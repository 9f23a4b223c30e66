"""Fault injection: which fault fires when, and what it does to the wire. Pure.

Each kind of fault has its own option (`--fault-crash`, `--fault-hang`, ...),
whose value is a small spec of space-separated `key=value` words:

* the trigger, exactly one of
  - `rate=P`: each occasion fires it with probability P (seeded by --seed
    and the rank, so a run can be repeated);
  - `every=N`: every N-th occasion;
  - `at=T`: once, T after the engine joined the frontend (`90`, `90s`,
    `500ms`, `2m`, `1h`). Engine faults fire at T on a timer; request and
    utility faults on the first occasion after T.
* `ranks=0,2,4-7`: only these engine ranks (default: every engine);
* `limit=N`: fire at most N times (default: once for `at`, else no limit);
* what the kind needs: `duration=`, `factor=`, `delay=`, `method=`.

An occasion is a request (ADD) reaching the engine, for `fail-utility`
a utility call, for the event-plane faults (`kv-*`, with
`--kv-events-config`) a batch of KV events being published, and for
`kv-transfer-*` a consumer's request that loads its KV from a prefill
engine (`do_remote_prefill`, kv/transfer.py). What each kind does, and how the real frontends react, is
in docs/faults.md.

`Faults` decides (per engine); `rewrite` applies the wire faults to the
messages the engine built; runtime/fault_injection.py does the rest of what a fired
fault does to a running engine. The request ledger sees the messages before
`rewrite`: it keeps the books of what a correct engine sends, and the
injected faults are counted beside it, so a soak with faults still expects
0 ledger violations.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from gmock_engine.wire.outputs import engine_core_outputs

#: Exit status of a process whose last engine crashed by --fault-crash
#: (the supervisor of --processes tells it from a real failure by this).
CRASH_EXIT_STATUS = 70
#: Methods fail-utility never fails unless `method=` names them: the
#: mock's own introspection, which soak runners and tests depend on.
PROTECTED_METHODS = frozenset({"gmock_stats"})
UTILITY_FAILURE_MESSAGE = "injected failure (gmock_engine --fault-fail-utility)"

ENGINE, REQUEST, UTILITY, KV_EVENTS = "engine", "request", "utility", "kv-events"
#: P/D: a consumer request's KV transfer (kv/transfer.py).
TRANSFER = "transfer"
_REQUIRED = object()


@dataclass(frozen=True)
class Kind:
    """One kind of fault: what it acts on and the parameters it takes."""

    scope: str  # ENGINE (the whole engine), REQUEST (one request), UTILITY (one call), KV_EVENTS (one event batch) or TRANSFER (one KV load)
    params: Tuple[Tuple[str, Any], ...]  # (name, default); _REQUIRED: must be given
    help: str


#: Every kind, by option name (`--fault-<name>`).
KINDS: Dict[str, Kind] = {
    "crash": Kind(ENGINE, (), "the engine vanishes: its sockets close with no ENGINE_CORE_DEAD; "
                  f"a process whose last engine crashed exits with status {CRASH_EXIT_STATUS}"),
    "hang": Kind(ENGINE, (("duration", None),), "the engine stops reading, stepping and sending; its sockets "
                 "stay open (duration=: then it goes on; default: for ever)"),
    "stall-outputs": Kind(ENGINE, (("duration", 10.0),), "no output leaves for duration= (default 10s); "
                          "requests are still read and stepped until the output queue is full"),
    "slow-steps": Kind(ENGINE, (("factor", _REQUIRED), ("duration", None)), "every step takes factor= times "
                       "as long (paced or not) for duration= (default: for ever)"),
    "error-mid-stream": Kind(REQUEST, (), "the request ends with finish reason ERROR after half its tokens"),
    "drop-finish": Kind(REQUEST, (), "the request's terminal output is never sent (its stream never ends)"),
    "duplicate-finish": Kind(REQUEST, (), "the request's terminal output is sent twice (two messages)"),
    "late-finish": Kind(REQUEST, (("delay", 2.0),), "the request's terminal output is held back delay= "
                        "(default 2s), also past an ABORT of that request"),
    # P/D disaggregation (kv/transfer.py): they act on a consumer's KV load
    "kv-transfer-fail": Kind(TRANSFER, (), "the request's KV transfer fails: the decode engine ends it with finish "
                             "reason ERROR and no tokens (kv_load_failure_policy fail, vLLM's default)"),
    "kv-transfer-slow": Kind(TRANSFER, (("delay", 2.0),), "the request's KV transfer takes delay= (default 2s) longer"),
    "fail-utility": Kind(UTILITY, (("method", None),), "the utility call is answered with a failure_message "
                         "(method=: only calls of that method; default: any but gmock_stats)"),
    # The event plane (runtime/kv_publisher.py, docs/protocol.md Appendix D): the occasion is a KV event batch.
    "kv-drop-batch": Kind(KV_EVENTS, (), "the KV event batch is not published (a seq gap; replay still has it)"),
    "kv-duplicate-batch": Kind(KV_EVENTS, (), "the KV event batch is published twice (the same seq)"),
    "kv-reorder-batches": Kind(KV_EVENTS, (), "the KV event batch is published after the next one (seq n+1 before n)"),
    "kv-reset-seq": Kind(KV_EVENTS, (), "the KV event sequence restarts at 0 with an empty replay buffer "
                         "(an engine restart as a router sees it; the cache itself is kept)"),
    "kv-stall-replay": Kind(KV_EVENTS, (("duration", 10.0),), "the replay socket answers nothing for duration= "
                            "(default 10s), then answers what waited"),
    "kv-clear-storm": Kind(KV_EVENTS, (("count", 10),), "after the batch, count= (default 10) batches of one "
                           "AllBlocksCleared each, though nothing was cleared"),
}

_TRIGGERS = ("rate", "every", "at")
_DURATION_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_seconds(text: str) -> float:
    """`90`, `90s`, `1.5s`, `500ms`, `2m`, `1h` -> seconds (ValueError otherwise)."""
    match = _DURATION_RE.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a duration like 90, 90s, 500ms, 2m or 1h")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _ranks(text: str) -> FrozenSet[int]:
    ranks = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"ranks={text!r}: expected ranks like 0,2,4-7")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"ranks={text!r}: {part.strip()} is an empty range")
        if last > 0xFFFF:  # a 2-byte engine identity (docs/protocol.md §1)
            raise ValueError(f"ranks={text!r}: {last} is not an engine rank (at most 65535)")
        ranks.update(range(first, last + 1))
    return frozenset(ranks)


@dataclass(frozen=True)
class FaultSpec:
    """One configured fault: its kind, trigger, engine ranks and parameters."""

    kind: str
    text: str
    rate: Optional[float] = None
    every: Optional[int] = None
    at: Optional[float] = None
    ranks: Optional[FrozenSet[int]] = None
    limit: Optional[int] = None
    duration: Optional[float] = None
    factor: Optional[float] = None
    delay: Optional[float] = None
    method: Optional[str] = None
    count: Optional[int] = None

    def __str__(self) -> str:  # as written: --print-config and all-options.ini show it so
        return self.text

    @property
    def scope(self) -> str:
        return KINDS[self.kind].scope

    def applies_to(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    @property
    def max_fires(self) -> Optional[int]:
        return self.limit if self.limit is not None else (1 if self.at is not None else None)


def _number(key: str, value: str, convert: Any, low: float, high: float) -> Any:
    try:
        parsed = convert(value)
    except ValueError:
        raise ValueError(f"{key}={value} is not {'an integer' if convert is int else 'a number'}") from None
    if not parsed >= low:  # also rejects nan
        raise ValueError(f"{key}={value} is less than {low}")
    if parsed > high:
        raise ValueError(f"{key}={value} is more than {high}")
    return parsed


def _parse_value(key: str, value: str) -> Any:
    if key == "rate":
        rate = _number(key, value, float, 0.0, 1.0)
        if rate == 0.0:
            raise ValueError("rate=0 never fires; leave the fault out instead")
        return rate
    if key == "count":
        return _number(key, value, int, 1, 100_000)
    if key in ("every", "limit"):
        return _number(key, value, int, 1, 1 << 62)
    if key == "factor":
        return _number(key, value, float, 1.0, 1000.0)
    if key in ("at", "duration", "delay"):
        try:
            return parse_seconds(value)
        except ValueError as exc:
            raise ValueError(f"{key}={exc}") from None
    if key == "ranks":
        return _ranks(value)
    return value  # method


def parse_spec(kind: str, text: str) -> FaultSpec:
    """Parse `--fault-<kind>`'s value; ValueError names the bad word."""
    spec_kind = KINDS[kind]
    allowed = dict(spec_kind.params)
    values: Dict[str, Any] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if not sep or not value:
            raise ValueError(f"{word!r} is not key=value")
        if key in values:
            raise ValueError(f"{key}= given twice")
        known = (*_TRIGGERS, "ranks", "limit", *allowed)
        if key not in known:
            raise ValueError(f"unknown key {key!r}; {kind} takes {', '.join(f'{k}=' for k in known)}")
        values[key] = _parse_value(key, value)
    triggers = [t for t in _TRIGGERS if t in values]
    if len(triggers) != 1:
        raise ValueError(f"{kind} needs exactly one trigger of rate=P, every=N or at=T (got {len(triggers)})")
    for name, default in spec_kind.params:
        if name not in values:
            if default is _REQUIRED:
                raise ValueError(f"{kind} needs {name}=")
            values[name] = default
    return FaultSpec(kind=kind, text=" ".join(text.split()), **values)


class Faults:
    """One engine's faults: decides on each occasion which of them fire, and
    counts what was injected. The caller applies them (runtime/fault_injection.py).

    After a reload (SIGHUP) the engine gets a new `Faults` built with the
    `previous` one: a spec that did not change goes on where it was (its
    random sequence, its every= count, its limit= used, its at= clock); a
    new or changed spec starts afresh at `now` (its at= counts from the
    reload); the injected totals carry over, so counters never go back."""

    def __init__(
        self, specs: Sequence[FaultSpec], rank: int, seed: int, previous: Optional["Faults"] = None, now: float = 0.0
    ) -> None:
        self.specs = [s for s in specs if s.applies_to(rank)]
        self._rngs = {s.kind: random.Random(f"{seed}/{rank}/fault/{s.kind}") for s in self.specs}
        self._occasions: Counter = Counter()
        #: Fired faults by kind (what the summary, gmock_stats and /metrics show).
        self.injected: Counter = Counter()
        #: Firings of the current spec of each kind (what limit= counts).
        self._fired: Counter = Counter()
        #: Where each spec's at= counts from: the join (or the reload that brought it).
        self._since: Dict[str, float] = {s.kind: now for s in self.specs}
        if previous is not None:
            self.injected.update(previous.injected)
            for kind in [s.kind for s in self.specs if s in previous.specs]:
                self._rngs[kind] = previous._rngs[kind]
                self._occasions[kind] = previous._occasions[kind]
                self._fired[kind] = previous._fired[kind]
                self._since[kind] = previous._since[kind]
        self._on_request = [s for s in self.specs if s.scope == REQUEST or (s.scope == ENGINE and s.at is None)]
        self._on_utility = [s for s in self.specs if s.scope == UTILITY]
        self._on_kv_batch = [s for s in self.specs if s.scope == KV_EVENTS]
        self._on_transfer = [s for s in self.specs if s.scope == TRANSFER]

    def __bool__(self) -> bool:
        return bool(self.specs)

    def joined(self, now: float) -> None:
        """The engine joined its frontend: `at=` counts from here."""
        self._since = {s.kind: now for s in self.specs}

    def timed(self) -> List[Tuple[float, FaultSpec]]:
        """Engine faults with `at=`: (engine clock when due, spec), in order."""
        return sorted(((self._since[s.kind] + s.at, s) for s in self.specs if s.scope == ENGINE and s.at is not None), key=lambda t: t[0])

    def on_request(self, now: float) -> List[FaultSpec]:
        """A request arrived: the faults that fire for it (engine faults
        triggered by requests, and at most one of each request fault)."""
        return [s for s in self._on_request if self._fires(s, now)] if self._on_request else []

    def on_transfer(self, now: float) -> List[FaultSpec]:
        """A request that loads its KV from a prefill engine arrived: the
        kv-transfer-* faults that fire for it."""
        return [s for s in self._on_transfer if self._fires(s, now)] if self._on_transfer else []

    def on_utility(self, method: str, now: float) -> Optional[FaultSpec]:
        """A utility call arrived: the fail-utility fault, if it fires."""
        for spec in self._on_utility:
            wanted = method == spec.method if spec.method is not None else method not in PROTECTED_METHODS
            if wanted and self._fires(spec, now):
                return spec
        return None

    def on_kv_batch(self, now: float) -> List[FaultSpec]:
        """A KV event batch is being published: the event-plane faults that fire."""
        return [s for s in self._on_kv_batch if self._fires(s, now)] if self._on_kv_batch else []

    def _fires(self, spec: FaultSpec, now: float) -> bool:
        if spec.at is not None:
            fires = now - self._since[spec.kind] >= spec.at
        elif spec.every is not None:
            self._occasions[spec.kind] += 1
            fires = self._occasions[spec.kind] % spec.every == 0
        else:
            fires = self._rngs[spec.kind].random() < spec.rate
        return fires and self.fire(spec)

    def fire(self, spec: FaultSpec) -> bool:
        """Count one firing of `spec` (e.g. a timed fault that is due); False
        when its limit is used up."""
        limit = spec.max_fires
        if limit is not None and self._fired[spec.kind] >= limit:
            return False
        self._fired[spec.kind] += 1
        self.injected[spec.kind] += 1
        return True

    def summary(self) -> Dict[str, int]:
        """Fired faults as `fault_<kind>` counters: the kinds configured here,
        and those a reload turned off after they fired."""
        shown = {s.kind for s in self.specs} | {kind for kind, n in self.injected.items() if n}
        return {"fault_" + kind.replace("-", "_"): self.injected[kind] for kind in KINDS if kind in shown}


def fail_after(max_tokens: Optional[int]) -> int:
    """error-mid-stream: how many tokens the request gets before its ERROR."""
    return (max_tokens or 0) // 2


def rewrite(
    message: List[Any], marked: Dict[str, FaultSpec]
) -> Tuple[List[List[Any]], List[Tuple[float, List[Any]]]]:
    """Apply the wire faults of the requests in `marked` whose terminal output
    is in this EngineCoreOutputs (§4.2); each mark is used up (popped).

    Returns (messages to send now, in order; (delay, message) to send later).
    drop-finish removes the terminal output and the id from
    finished_requests; duplicate-finish sends them again in a second
    message; late-finish moves them to a message sent `delay` later. A
    message left with nothing in it is not sent (§4.2: never empty).
    """
    outputs = message[1]
    hits = [o for o in outputs if len(o) > 5 and o[5] is not None and o[0] in marked]
    if not hits:
        return [message], []
    engine_index, stats, timestamp = message[0], message[2], message[3]
    finished = list(message[5]) if len(message) > 5 and message[5] else []
    kept_outputs = list(outputs)
    now: List[List[Any]] = []
    later: List[Tuple[float, List[Any]]] = []
    for output in hits:
        spec = marked.pop(output[0])
        if spec.kind == "duplicate-finish":
            now.append(engine_core_outputs(engine_index, [output], timestamp, [output[0]]))
            continue
        kept_outputs.remove(output)
        if output[0] in finished:
            finished.remove(output[0])
        if spec.kind == "late-finish":
            later.append((spec.delay or 0.0, engine_core_outputs(engine_index, [output], timestamp, [output[0]])))
    if kept_outputs or finished or stats is not None:
        now.insert(0, engine_core_outputs(engine_index, kept_outputs, timestamp, finished or None, stats))
    return now, later
