"""Replay (`--replay TRACE`): a recorded run served back, pure.

`load` reads a record tap's trace (trace.py, docs/record.md) into
`ReplayTrace`: per recorded ADD, a `RecordedRequest` with its outputs as
(offset, token count, token ids if recorded), its finish reason and
stop_reason. An offset is seconds from the ADD's receive time at the tap
(`t`) to the output's, so the first one is the request's TTFT as the
frontend's side of the engine saw it. The trace has no scheduling time;
the ADD's arrival is the only reference both runs share.

`ReplaySettings.take` matches an ADD the engine gets to a recorded request
(`--replay-match`): `arrival`, the k-th ADD takes the k-th recorded one (per
rank when the trace's ranks are the deployment's, else one sequence over
this process's engines); `id`, by request id. `follow` then makes the
planned request (request.plan) end as the recording did and gives it a
`Replaying`, which the output processor asks for each output's token count
and the earliest time it may come (the request's arrival in the engine plus
the recorded offset). Recorded ids come out of the request's token source
(tokens.RecordedTokens), the one place tokens are made.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from gmock_engine.content.sampler import Sampler
from gmock_engine.content.tokens import RecordedTokens
from gmock_engine.timing.trace import parse_lines
from gmock_engine.wire.types import FinishReason

#: --replay-match values.
MATCH_MODES = ("arrival", "id")
#: finish_reason wire values (§4.4) a replay reproduces; another value (a
#: newer vLLM's) counts as no end recorded
_FINISHES = {int(reason): reason for reason in FinishReason}


@dataclass(frozen=True)
class RecordedOutput:
    """One EngineCoreOutput of a recorded request."""

    #: seconds from the request's ADD to this output, both as the tap received them
    offset: float
    count: int
    #: the ids (--record-token-ids), None when not recorded
    token_ids: Optional[Tuple[int, ...]]


@dataclass(frozen=True)
class RecordedRequest:
    """One recorded ADD and what the engine answered it with."""

    request_id: str
    rank: int
    client: int
    #: the tap's receive time of the ADD (the trace's `t`)
    arrival: float
    prompt_len: Optional[int]
    max_tokens: Optional[int]
    #: its outputs with tokens, in order (a zero-token output only when it
    #: is the request's one output: an end without tokens)
    outputs: Tuple[RecordedOutput, ...]
    #: the wire value (§4.4); None: no end recorded (aborted by the client, or the trace stops)
    finish_reason: Optional[int]
    stop_reason: Any = None

    @property
    def num_tokens(self) -> int:
        """Tokens over all its outputs."""
        return sum(output.count for output in self.outputs)

    @property
    def token_ids(self) -> Optional[Tuple[int, ...]]:
        """Every id it got, in order; None unless every output recorded its ids."""
        if any(output.token_ids is None for output in self.outputs):
            return None
        return tuple(token for output in self.outputs for token in output.token_ids or ())

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from its ADD to its first output; None without outputs."""
        return self.outputs[0].offset if self.outputs else None


class _Builder:
    """A recorded request while its outputs are being read."""

    def __init__(self, add: Dict[str, Any]) -> None:
        self.add = add
        self.outputs: List[RecordedOutput] = []
        self.finish: Optional[int] = None
        self.stop_reason: Any = None

    def output(self, t: float, entry: Dict[str, Any]) -> None:
        ids = entry.get("token_ids")
        count = len(ids) if isinstance(ids, list) else int(entry.get("tokens") or 0)
        self.outputs.append(RecordedOutput(t - self.add["t"], count, tuple(ids) if isinstance(ids, list) else None))
        if entry.get("finish_reason") is not None:
            self.finish = int(entry["finish_reason"])
            self.stop_reason = entry.get("stop_reason")

    def build(self) -> RecordedRequest:
        outputs = tuple(o for o in self.outputs if o.count) or tuple(self.outputs[-1:])
        add = self.add
        return RecordedRequest(
            str(add["request_id"]),
            int(add.get("rank", 0)),
            int(add.get("client", 0)),
            float(add["t"]),
            add.get("prompt_len"),
            add.get("max_tokens"),
            outputs,
            self.finish,
            self.stop_reason,
        )


def recorded_requests(records: Iterable[Dict[str, Any]]) -> List[RecordedRequest]:
    """The recorded requests of a trace's records, in the order of their ADDs.

    Outputs go to the request of that id open on that rank (an id may come
    back once its request ended); an ABORT from the client closes it
    unfinished; outputs of ids never added are left out."""
    builders: List[_Builder] = []
    open_: Dict[Tuple[int, str], _Builder] = {}
    for record in records:
        kind = record.get("kind")
        rank = record.get("rank", 0)
        if kind == "add" and "request_id" in record and "t" in record:
            builder = _Builder(record)
            builders.append(builder)
            open_[rank, str(record["request_id"])] = builder
        elif kind == "output":
            for entry in record.get("requests") or ():
                builder = open_.get((rank, str(entry.get("id"))))
                if builder is None:
                    continue
                builder.output(float(record["t"]), entry)
                if builder.finish is not None:
                    del open_[rank, str(entry.get("id"))]
        elif kind == "abort":
            for rid in record.get("request_ids") or ():
                open_.pop((rank, str(rid)), None)
    return [builder.build() for builder in builders]


class ReplayTrace:
    """The recorded requests of one trace file and the cursors of
    `--replay-match arrival`. The configuration holds one per process, so
    its engines share the cursors (the k-th ADD over them when matching
    across ranks). Equal to another read of the same file with the same
    content (a reload that finds it unchanged sees no change)."""

    def __init__(self, path: str, requests: Sequence[RecordedRequest], digest: str = "") -> None:
        self.path = path
        self.digest = digest
        self.requests: Tuple[RecordedRequest, ...] = tuple(requests)
        self.ranks = frozenset(r.rank for r in self.requests)
        self.by_rank: Dict[int, List[RecordedRequest]] = {}
        self.by_id: Dict[str, RecordedRequest] = {}
        for request in self.requests:
            self.by_rank.setdefault(request.rank, []).append(request)
            self.by_id.setdefault(request.request_id, request)  # a repeated id: its first recording
        #: next index per sequence: a rank, or None for all of them
        self._cursors: Dict[Optional[int], int] = {}

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"ReplayTrace({self.path!r}, {len(self.requests)} requests)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplayTrace) and (self.path, self.digest) == (other.path, other.digest)

    def __hash__(self) -> int:
        return hash((self.path, self.digest))

    def next_in(self, rank: Optional[int]) -> Optional[RecordedRequest]:
        """The next recorded request of rank `rank` (None: of every rank, in
        ADD order), or None once they are used up."""
        sequence = self.requests if rank is None else self.by_rank.get(rank, ())
        index = self._cursors.get(rank, 0)
        self._cursors[rank] = index + 1
        return sequence[index] if index < len(sequence) else None


def load(path: str) -> ReplayTrace:
    """The trace at `path`; OSError if it cannot be read, ValueError
    (trace.TraceFormatError among them) if it is no trace or records no request."""
    with open(path, "rb") as stream:
        data = stream.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not a UTF-8 text file") from None
    head, records = parse_lines(text.splitlines(keepends=True))
    requests = recorded_requests(records)
    if not requests:
        raise ValueError("the trace records no request (no ADD)")
    return ReplayTrace(path, requests, hashlib.blake2b(data, digest_size=16).hexdigest())


@dataclass(frozen=True)
class ReplaySettings:
    """One engine's replay: the trace, how ADDs are matched, and whether
    `arrival` counts per rank."""

    trace: ReplayTrace
    match: str = "arrival"
    per_rank: bool = False

    def take(self, rank: int, request_id: str) -> Optional[RecordedRequest]:
        """The recorded request an ADD to engine `rank` replays (None: the
        trace does not cover it; the engine's model serves it)."""
        if self.match == "id":
            return self.trace.by_id.get(request_id)
        return self.trace.next_in(rank if self.per_rank else None)


def settings_from(trace: Optional[ReplayTrace], match: str, ranks: Iterable[int], data_parallel_size: int) -> Optional[ReplaySettings]:
    """--replay / --replay-match for engines `ranks` of a deployment of
    `data_parallel_size` ranks: `arrival` counts per rank when the trace's
    ranks are as many as the deployment's and include these engines' (the
    frontend balances over the same ranks as when it was recorded), else
    over every engine of the process. None without a trace."""
    if trace is None:
        return None
    per_rank = len(trace.ranks) > 1 and len(trace.ranks) == data_parallel_size and set(ranks) <= trace.ranks
    return ReplaySettings(trace, match, per_rank)


class Replaying:
    """A request that follows a recording: its next output's token count and
    the earliest engine time it may come (arrival + recorded offset)."""

    __slots__ = ("outputs", "start", "index")

    def __init__(self, outputs: Sequence[RecordedOutput], start: float) -> None:
        self.outputs = outputs
        #: the engine clock at its ADD
        self.start = start
        self.index = 0

    def due(self) -> Optional[float]:
        """When its next recorded output is due; None past the recording."""
        if self.index < len(self.outputs):
            return self.start + self.outputs[self.index].offset
        return None

    def next_count(self, remaining: int, chunk: int) -> int:
        """Tokens in its next output: the recorded count (past the recording,
        `chunk`), never more than `remaining`."""
        n = self.outputs[self.index].count if self.index < len(self.outputs) else chunk
        return n if n < remaining else remaining

    def advance(self) -> Optional[float]:
        """An output was made: when the one after is due (None: past the recording)."""
        self.index += 1
        return self.due()


def follow(request: Any, recorded: RecordedRequest, eos_token_id: Optional[int], cap: int) -> None:
    """Make a planned request (request.plan) end as `recorded` did: its
    token count, finish reason and stop_reason, unless the client's limit
    `cap` (max_tokens, max_model_len) comes first (then LENGTH there). With
    recorded ids it draws them (tokens.RecordedTokens) and nothing reshapes
    them (stop ids, allowed ids, the planned last token); without, its
    source's ids end on the stop id or EOS a STOP needs. A recording with
    no end (or a finish_reason this engine does not know) keeps the planned
    end; its outputs past the recording are the engine's. Its timing: `Replaying`, from its arrival (`queued_at`)."""
    total = recorded.num_tokens
    ids = recorded.token_ids
    finish = _FINISHES.get(recorded.finish_reason) if recorded.finish_reason is not None else None
    if finish is not None:
        if total <= cap:
            request.max_tokens, request.finish = total, finish
            stop = recorded.stop_reason if finish is FinishReason.STOP else None
            request.stop_reason = stop
            if finish is FinishReason.STOP and ids is None:
                request.last_token = stop if isinstance(stop, int) else eos_token_id
            else:
                request.last_token = None
        else:
            request.max_tokens, request.finish = cap, FinishReason.LENGTH
            request.stop_reason = request.last_token = None
    if ids is not None:
        sampler = request.sampler
        source = RecordedTokens(ids, sampler.tokens)
        request.sampler = Sampler(source, sampler.logprobs)
        request.rng_state = (0, request.rng_state)
        request.stop_ids = request.pool = request.alternatives = request.banned = None
        request.forced = request.shaped = False
    request.replay = Replaying(recorded.outputs, request.queued_at)
