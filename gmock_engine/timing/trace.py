"""The record tap's trace file (docs/record.md): versioned JSON lines, pure.

Line 1 is the header `{"format": "gmock-trace", "version": 1, ...}`; every
further line is one record with a `kind`:

* `add`: an ADD the frontend sent (§3.2): request id, arrival time, prompt
  length, max_tokens and the sampling parameters that change timing;
* `abort`, `utility`: the other input messages (§3.4, §3.5);
* `output`: one EngineCoreOutputs (§4.2) with its receive time, the engine
  rank and client it came through, per request the token count and finish
  reason, `finished_requests` and a summary of the SchedulerStats (§7.1);
* `dead`: the ENGINE_CORE_DEAD sentinel (§4.1);
* `undecodable`: a frame the writer could not read (relayed all the same).

`t` is the tap's wall clock (time.time()) when the frame arrived, so it
compares with an ADD's `arrival_time`; `engine_timestamp` is the engine's
own clock (§4.2), only meaningful in differences.

The writer only reads frames: it is handed the bytes the tap already
relayed and never changes what goes on the wire.
"""

from __future__ import annotations

import json
from typing import IO, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from gmock_engine.wire.eras import DEFAULT_LAYOUT, fingerprint
from gmock_engine.wire.inputs import unpack
from gmock_engine.wire.types import ENGINE_CORE_DEAD

FORMAT = "gmock-trace"
VERSION = 1

#: Request type bytes (§3.1).
_ADD, _ABORT, _UTILITY = b"\x00", b"\x01", b"\x03"

#: SamplingParams keys that change how long a request runs or what the
#: engine computes per step (§3.3); absent keys keep vLLM's defaults and are
#: left out of the trace too, except max_tokens (always given, default 16).
TIMING_SAMPLING_KEYS = (
    "min_tokens",
    "ignore_eos",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "stop_token_ids",
    "_eos_token_id",
)

#: SchedulerStats keys kept from each output (§7.1).
STATS_KEYS = ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "step_counter", "current_wave")
PREFIX_CACHE_KEYS = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")


class TraceFormatError(ValueError):
    """A file that is not a gmock trace of a version this code reads."""


def header(**meta: Any) -> Dict[str, Any]:
    """The header record: format, version, then the recorder's own fields."""
    return {"format": FORMAT, "version": VERSION, **meta}


def _field(array: Sequence[Any], index: int) -> Any:
    return array[index] if 0 <= index < len(array) else None


def input_record(t: float, rank: int, client: int, frames: Sequence[bytes], token_ids: bool = False) -> Dict[str, Any]:
    """The record of one input message `frames` (type byte, payload, aux...)
    sent to engine `rank` on client `client`'s socket."""
    base: Dict[str, Any] = {"t": t, "rank": rank, "client": client}
    try:
        kind = frames[0] if frames else b""
        payload = unpack(frames[1]) if len(frames) > 1 else None
        if kind == _ADD:
            return {"kind": "add", **base, **_add_fields(payload, token_ids)}
        if kind == _ABORT:
            return {"kind": "abort", **base, "request_ids": list(payload)}
        if kind == _UTILITY:
            return {"kind": "utility", **base, "call_id": payload[1], "method": payload[2]}
        return {"kind": "undecodable", **base, "direction": "input", "error": f"type byte {bytes(kind)!r}"}
    except Exception as exc:  # a trace line, never a crash: the frame was relayed already
        return {"kind": "undecodable", **base, "direction": "input", "error": f"{type(exc).__name__}: {exc}"}


def _add_fields(payload: List[Any], token_ids: bool) -> Dict[str, Any]:
    found = fingerprint(payload)
    layout = found[0] if found else DEFAULT_LAYOUT
    index = {name: i for i, name in enumerate(layout.request_fields)}
    prompt = _field(payload, index["prompt_token_ids"])
    sampling = _field(payload, index["sampling_params"]) or {}
    record: Dict[str, Any] = {
        "request_id": payload[0],
        "arrival_time": _field(payload, index["arrival_time"]),
        "prompt_len": len(prompt) if isinstance(prompt, list) else None,
        # absent = vLLM's default 16 (§3.3)
        "max_tokens": sampling.get("max_tokens", 16) if isinstance(sampling, dict) else None,
        "sampling": {k: sampling[k] for k in TIMING_SAMPLING_KEYS if isinstance(sampling, dict) and k in sampling},
        "priority": _field(payload, index.get("priority", -1)) or 0,
        "client_index": _field(payload, index["client_index"]),
    }
    if token_ids:
        record["prompt_token_ids"] = prompt
    return record


def output_record(t: float, rank: int, client: int, frames: Sequence[bytes], token_ids: bool = False) -> Dict[str, Any]:
    """The record of one output message pushed by engine `rank` to client `client`."""
    base: Dict[str, Any] = {"t": t, "rank": rank, "client": client}
    if len(frames) == 1 and frames[0] == ENGINE_CORE_DEAD:
        return {"kind": "dead", **base}
    try:
        message = unpack(frames[0])
        record: Dict[str, Any] = {
            "kind": "output",
            **base,
            "engine_index": message[0],
            "engine_timestamp": _field(message, 3),
            "requests": [_request_output(o, token_ids) for o in message[1] or ()],
            "finished_requests": _field(message, 5),
            "stats": stats_summary(_field(message, 2)),
        }
        utility = _field(message, 4)
        if utility is not None:
            record["utility_call_id"] = utility[0]
        return record
    except Exception as exc:
        return {"kind": "undecodable", **base, "direction": "output", "error": f"{type(exc).__name__}: {exc}"}


def _request_output(output: List[Any], token_ids: bool) -> Dict[str, Any]:
    tokens = output[1] or []
    entry: Dict[str, Any] = {"id": output[0], "tokens": len(tokens), "finish_reason": _field(output, 5)}
    stop_reason = _field(output, 6)
    if stop_reason is not None:
        entry["stop_reason"] = stop_reason
    events = _field(output, 7)
    if isinstance(events, list) and events:
        entry["events"] = [[e.get("type"), e.get("timestamp")] for e in events if isinstance(e, dict)]
    cached = num_cached_tokens(output)
    if cached is not None:
        entry["num_cached_tokens"] = cached
    if token_ids:
        entry["token_ids"] = list(tokens)
    return entry


def num_cached_tokens(output: Sequence[Any]) -> Optional[int]:
    """The prompt tokens a request found in the prefix cache, from the
    EngineCoreOutput that carries them (a request's first), or None.

    The trace writer does not know the frontend's wire era, so it reads every
    layout by shape (§4.5, §8.1): since 0.20 a PrefillStats map at index 10
    (0.20-0.25) or 11 (0.26+; index 10 is then trace_headers, a map of
    strings); before that an int at index 10."""
    for index in (11, 10):
        value = _field(output, index)
        if isinstance(value, dict) and isinstance(value.get("num_cached_tokens"), int):
            return value["num_cached_tokens"]
    value = _field(output, 10)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def stats_summary(stats: Any) -> Optional[Dict[str, Any]]:
    """Running, waiting, KV usage, step/wave and prefix-cache counters of a
    SchedulerStats map (§7.1); None when the message carries none."""
    if not isinstance(stats, dict):
        return None
    summary = {key: stats[key] for key in STATS_KEYS if key in stats}
    prefix = stats.get("prefix_cache_stats")
    if isinstance(prefix, dict):
        summary["prefix_cache"] = {key: prefix[key] for key in PREFIX_CACHE_KEYS if key in prefix}
    return summary


class TraceWriter:
    """Writes the header, then one line per record, to a text stream."""

    def __init__(self, stream: IO[str], token_ids: bool = False, **meta: Any) -> None:
        self.stream = stream
        self.token_ids = token_ids
        self.records = 0
        self._line(header(record_token_ids=token_ids, **meta))

    def _line(self, record: Dict[str, Any]) -> None:
        self.stream.write(json.dumps(record, separators=(",", ":")) + "\n")

    def write(self, record: Dict[str, Any]) -> None:
        """One already-built record."""
        self._line(record)
        self.records += 1

    def input(self, t: float, rank: int, client: int, frames: Sequence[bytes]) -> None:
        """An input message the tap relayed frontend -> engine."""
        self.write(input_record(t, rank, client, frames, self.token_ids))

    def output(self, t: float, rank: int, client: int, frames: Sequence[bytes]) -> None:
        """An output message the tap relayed engine -> frontend."""
        self.write(output_record(t, rank, client, frames, self.token_ids))

    def flush(self) -> None:
        self.stream.flush()


def parse_lines(lines: Iterable[str]) -> Tuple[Dict[str, Any], Iterator[Dict[str, Any]]]:
    """The header and an iterator over the records of a trace's lines.

    Raises TraceFormatError for a missing or foreign header or a newer
    version; a truncated last line (a tap killed mid-write) is skipped.
    """
    it = iter(lines)
    first = next(it, "")
    try:
        head = json.loads(first)
    except ValueError:
        raise TraceFormatError("first line is not a JSON header") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise TraceFormatError(f"not a {FORMAT} file")
    if not isinstance(head.get("version"), int) or head["version"] > VERSION:
        raise TraceFormatError(f"trace version {head.get('version')!r}; this reader knows up to {VERSION}")

    def records() -> Iterator[Dict[str, Any]]:
        for line in it:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError:
                if line.endswith("\n"):
                    raise TraceFormatError(f"bad record line: {line[:80]!r}") from None
                return  # the unfinished last line of an interrupted recording

    return head, records()


def read_trace(path: str) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Header and every record of the trace file at `path`."""
    with open(path, encoding="utf-8") as stream:
        head, records = parse_lines(stream)
        return head, list(records)
