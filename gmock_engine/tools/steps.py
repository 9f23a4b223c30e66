"""A recorded engine's steps, read back from a trace (gmock_engine/timing/trace.py).

A real engine core sends one EngineCoreOutputs per client at the end of
each step (with SchedulerStats to client 0 even when no request has a
token: docs/protocol.md §7.1), so consecutive output messages of one engine
are consecutive steps. For each step this module works out what the fit
(tools/fit.py) needs, with the features defined as the mock's scheduler
computes them (core/sched_output.py, core/kv_cache_manager.py), so that a profile
fitted here times the mock's steps the same way:

* its duration: from the end of the previous step, or, when the engine had
  nothing to do then, from when it scheduled the request whose ADD woke it
  (its SCHEDULED event, §4.5; the ADD's arrival when the engine sends no
  events); a step ends
  at its outputs' engine timestamp (§4.2), moved onto the tap's clock by
  the smallest lag between the two: the tap's receive times come late in
  bursts when the machine is short of CPU, the engine's stamps do not;
* `batch`: the requests in the step: those with tokens in it, and those
  whose prompt the step computed a chunk of without a token yet;
* `prefill_tokens` and `prefill_attention` (Σ c·(p + c/2) over the chunks):
  a request's uncached prompt (its `num_cached_tokens` excluded) is computed
  in the steps from the one it was scheduled for (its SCHEDULED event,
  `_boundary`; an engine that schedules a step ahead, vLLM's async
  scheduling, runs it a step later than one that does not:
  `scheduling_lags` tells them apart) to its first token, first come first
  served within the token budget (`max_num_batched_tokens`, as vLLM's
  scheduler: decodes first, then prompt chunks); a request with its first
  token in a step finishes its prompt there;
* a preempted request (its PREEMPTED event) leaves the batch, and from
  the SCHEDULED event after it its tokens so far (prompt and generated)
  are computed again as a prompt, up to its next token (vLLM's recompute
  preemption), less what the prefix cache still held for it: the step's
  SchedulerStats count those hits (`preempted_hits`, §7.1), 0 when absent;
* `context_tokens`: the tokens the requests of the step hold when it
  begins: prompt plus tokens generated before it (the mock's
  `KVCacheManager.tokens` when it times the step);
* `novelty`: whether it is the engine's first step of its size (prompt
  tokens computed plus decoding requests) since the trace began, or one
  larger than any before it (latency_profile.StepSizes, which the mock's
  scheduler keeps too).

Utility replies are not steps. Records of several engines are split by rank.
"""

from __future__ import annotations

import math

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

from gmock_engine.timing.profile import STEADY, StepSizes


@dataclass
class Step:
    """One engine step as recorded (times in seconds on the tap's clock)."""

    rank: int
    start: float
    end: float
    batch: int
    decode: int
    prefill_tokens: int
    prefill_attention: float
    context_tokens: int
    #: the engine was idle before this step (it started on an ADD's arrival)
    woke: bool
    #: the engine's first step of this size (prompt tokens computed plus
    #: decoding requests) in the trace, or one larger than any before it:
    #: latency_profile.StepSizes.add (a real engine may pay for a size once)
    novelty: int = STEADY

    @property
    def duration_ms(self) -> float:
        """The step's time, ms."""
        return (self.end - self.start) * 1000.0

    @property
    def prefill_reqs(self) -> int:
        """The requests that computed a prompt chunk in the step (the batch's
        others decoded): the scheduler's SchedulerOutput.num_prefill_reqs."""
        return self.batch - self.decode


class _Pending:
    """A request between its ADD and its first token."""

    __slots__ = ("request_id", "arrival", "prompt_len", "cached", "done")

    def __init__(self, request_id: str, arrival: float, prompt_len: int, cached: int) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.cached = min(cached, prompt_len)
        #: uncached prompt tokens computed so far
        self.done = 0

    @property
    def left(self) -> int:
        return self.prompt_len - self.cached - self.done


def _scheduled_by(scheduled: Dict[str, float], add: Dict[str, Any], offset: Optional[float], boundary: float) -> bool:
    """The engine scheduled this ADD's request in time for the step being
    read: its SCHEDULED event, when sent, is before `boundary` (steps_of_rank
    says which)."""
    stamp = scheduled.get(add["request_id"])
    return stamp is None or offset is None or stamp + offset < boundary


def _boundary(start: Optional[float], end: float, prev_start: Optional[float], ahead: bool, woken: bool) -> float:
    """Before when a request's SCHEDULED event falls if its prompt is
    computed in the step from `start` to `end`.

    Each engine schedules at a step boundary and stamps its outputs at the
    same boundary, in its own order: a real engine stamps the previous
    step's outputs, then schedules (its SCHEDULED event just after the
    boundary); the mock schedules, then stamps (engine.step: the event just
    before it). Either way the event is nearer the boundary than the
    middle of a step. Without async scheduling a request scheduled at a
    boundary runs in the step that starts there: its event is before the
    middle of that step. With it (`ahead`), the engine plans a step ahead
    and the request runs in the step after: its event is before the middle
    of the step before; except in a step that an idle engine began
    (`woken`), which runs what it scheduled when it woke."""
    if start is None:
        return end
    if not ahead or woken:
        return (start + end) / 2.0
    return start if prev_start is None else (prev_start + start) / 2.0


def _step_groups(outputs: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
    """Output records of one engine grouped per step: one message per client
    with the same engine timestamp (a step's messages leave back to back)."""
    groups: List[List[Dict[str, Any]]] = []
    last: Any = object()
    for record in outputs:
        stamp = record.get("engine_timestamp")
        if groups and stamp is not None and stamp == last:
            groups[-1].append(record)
        else:
            groups.append([record])
        last = stamp
    return groups


def steps_of_rank(
    records: Iterable[Dict[str, Any]], rank: int, max_num_batched_tokens: Optional[int] = None, ahead: bool = False
) -> List[Step]:
    """The steps of engine `rank` (see the module docstring); `records` in
    trace order; `ahead`: the engine scheduled a step ahead (vLLM's async
    scheduling: `_boundary`)."""
    adds, aborts, outputs = _engine_records(records, rank)
    cached = _cached_tokens(outputs)
    scheduled = _first_events(outputs, SCHEDULED)

    groups = _step_groups(outputs)
    preempts, resumes = _preemptions(outputs)
    resume_hits = _resume_hits(groups, resumes)
    by_id = {add["request_id"]: add for add in adds}
    admitted: set = set()
    pending: Dict[str, _Pending] = {}  # FCFS: insertion order is arrival order
    running: Dict[str, int] = {}  # id -> prompt + generated tokens
    preempted: Dict[str, int] = {}  # id -> prompt + generated tokens, to compute again
    steps: List[Step] = []
    sizes = StepSizes()  # of every step, timed or not
    ai = bi = 0

    def admit(add: Dict[str, Any]) -> None:
        rid = add["request_id"]
        if rid not in admitted:
            admitted.add(rid)
            pending[rid] = _Pending(rid, add["t"], int(add.get("prompt_len") or 0), cached.get(rid, 0))

    def preempt(rid: str) -> None:
        if rid in running:
            preempted[rid] = running.pop(rid)
        elif rid in pending:  # before its first token: its prompt is computed again
            preempted[rid] = pending.pop(rid).prompt_len

    def resume(rid: str, stamp: float, at: float) -> None:
        # back at the front of the queue (vLLM prepends it), behind the prompts being chunked
        tokens = preempted.pop(rid)
        hits, queries = resume_hits.get((rid, stamp), (0, 0))
        again = _Pending(rid, at, tokens, min(round(hits * tokens / queries) if queries else 0, tokens - 1))
        chunking = {k: p for k, p in pending.items() if p.done}
        rest = {k: p for k, p in pending.items() if not p.done}
        pending.clear()
        pending.update(chunking)
        pending[rid] = again
        pending.update(rest)

    # The engine's own timestamps time its steps: the tap's receive times
    # lag behind when it is short of CPU, in bursts.
    offset = _clock_offset(outputs)
    prev_end: Optional[float] = None
    prev_start: Optional[float] = None
    pi = ri = 0
    for group in groups:
        end = group[0]["engine_timestamp"] + offset if offset is not None else min(r["t"] for r in group)
        while ai < len(adds) and adds[ai]["request_id"] in admitted:
            ai += 1
        start: Optional[float] = prev_end
        woke = False
        if not (pending or running):
            # idle after the previous step: the next ADD woke the engine, unless
            # the engine scheduled it only after this step (a step of nothing,
            # e.g. the one that reports the last finish)
            start = None
            if ai < len(adds) and adds[ai]["t"] <= end:
                stamp = scheduled.get(adds[ai]["request_id"])
                if stamp is None or offset is None:
                    if prev_end is None or adds[ai]["t"] >= prev_end:
                        start, woke = adds[ai]["t"], True
                elif stamp + offset < end:
                    # the engine's own time it scheduled the request; an ADD the
                    # tap saw before the previous step ended may have reached the
                    # engine only after it (the step then began when it was scheduled)
                    start, woke = stamp + offset, True
                    if prev_end is not None and start < prev_end:
                        start, woke = prev_end, False
        limit = start if start is not None else end
        boundary = _boundary(start, end, prev_start, ahead, not (pending or running))
        while ai < len(adds) and adds[ai]["t"] <= limit and _scheduled_by(scheduled, adds[ai], offset, boundary):
            admit(adds[ai])
            ai += 1
        while bi < len(aborts) and aborts[bi]["t"] <= limit:
            for rid in aborts[bi].get("request_ids", ()):
                pending.pop(rid, None)
                running.pop(rid, None)
                preempted.pop(rid, None)
            bi += 1
        # Preempted when the step was scheduled: out of it. An engine that
        # schedules ahead preempts a request while it decodes in the step
        # under way, whose token for it is then not sent (`leaving`).
        leaving: List[str] = []
        if offset is not None:
            while pi < len(preempts) and preempts[pi][0] + offset < (limit if ahead else boundary):
                preempt(preempts[pi][1])
                pi += 1
            while ahead and pi < len(preempts) and preempts[pi][0] + offset < end:
                leaving.append(preempts[pi][1])
                pi += 1
            while ri < len(resumes) and resumes[ri][0] + offset < boundary:
                stamp, rid = resumes[ri]
                if rid in preempted:
                    resume(rid, stamp, min(stamp + offset, limit))
                ri += 1
        tokens: Dict[str, int] = {}
        finished: List[str] = []
        for record in group:
            for item in record.get("requests", ()):
                rid = item["id"]
                tokens[rid] = tokens.get(rid, 0) + int(item.get("tokens") or 0)
                if item.get("finish_reason") is not None:
                    finished.append(rid)
            finished.extend(record.get("finished_requests") or ())
        for rid in tokens:
            if rid not in running and rid not in pending and rid in by_id and rid not in admitted:
                admit(by_id[rid])  # its ADD reached the tap after the step began (clock noise)
            elif rid in preempted:  # its resume was stamped after the step began (clock noise)
                stamp = next((t for t, r in resumes[ri:] if r == rid), 0.0)
                resume(rid, stamp, limit)
        decode = sum(1 for rid in tokens if rid in running) + sum(1 for rid in leaving if rid in running and rid not in tokens)
        budget = None if max_num_batched_tokens is None else max_num_batched_tokens - decode
        prefill = 0
        attention = 0.0
        batch = decode
        for rid, req in list(pending.items()):
            first = rid in tokens
            if first:
                take = req.left
            elif budget is None or (start is not None and req.arrival > start):
                continue  # not scheduled: unlimited, it would have had its first token now
            else:
                take = max(0, min(req.left - 1, budget))
            if budget is not None:
                budget -= take
            attention += take * (req.cached + req.done + take / 2)
            prefill += take
            req.done += take
            if first:
                del pending[rid]
                running[rid] = req.prompt_len
                batch += 1
            elif take:
                batch += 1
        context = sum(running.values()) + sum(p.prompt_len for p in pending.values() if p.done)
        for rid, n in tokens.items():
            if rid in running:
                running[rid] += n
        novelty = sizes.add(decode + prefill)
        if start is not None:
            steps.append(Step(rank, start, end, batch, decode, prefill, attention, context, woke, novelty))
        for rid in finished:
            running.pop(rid, None)
            pending.pop(rid, None)
            preempted.pop(rid, None)
        for rid in leaving:
            preempt(rid)
        prev_end, prev_start = end, start
    return steps


#: EngineCoreEvent types (docs/protocol.md §4.5).
QUEUED, SCHEDULED, PREEMPTED = 1, 2, 3
#: An ADD with no other ADD to its engine this long before it came alone.
ISOLATED_S = 0.02


def _ranks(records: Iterable[Dict[str, Any]]) -> List[int]:
    """The engines that sent outputs in a trace's records."""
    return sorted({r["rank"] for r in records if r.get("kind") == "output" and "rank" in r})


def _engine_records(records: Iterable[Dict[str, Any]], rank: int) -> "tuple[List[Dict[str, Any]], List[Dict[str, Any]], List[Dict[str, Any]]]":
    """Engine `rank`'s ADDs, ABORTs and outputs (utility replies left out),
    each in receive order."""
    adds: List[Dict[str, Any]] = []
    aborts: List[Dict[str, Any]] = []
    outputs: List[Dict[str, Any]] = []
    for record in records:
        if record.get("rank") != rank:
            continue
        kind = record.get("kind")
        if kind == "add":
            adds.append(record)
        elif kind == "abort":
            aborts.append(record)
        elif kind == "output" and record.get("utility_call_id") is None:
            outputs.append(record)
    for found in (adds, aborts, outputs):
        found.sort(key=lambda r: r["t"])
    return adds, aborts, outputs


def _clock_offset(outputs: List[Dict[str, Any]]) -> Optional[float]:
    """Tap clock - engine clock, from an engine's outputs: the smallest lag
    between an output's engine timestamp and its receipt (the relay's own
    latency); None unless every output has a timestamp."""
    stamped = [r["t"] - r["engine_timestamp"] for r in outputs if isinstance(r.get("engine_timestamp"), (int, float))]
    return min(stamped) if stamped and len(stamped) == len(outputs) else None


def _cached_tokens(outputs: List[Dict[str, Any]]) -> Dict[str, int]:
    """Request id -> its prompt tokens found in the prefix cache (its first
    `num_cached_tokens`; requests without hits are left out)."""
    cached: Dict[str, int] = {}
    for record in outputs:
        for item in record.get("requests", ()):
            if item.get("num_cached_tokens") and item["id"] not in cached:
                cached[item["id"]] = int(item["num_cached_tokens"])
    return cached


def _first_events(outputs: List[Dict[str, Any]], kind: int) -> Dict[str, float]:
    """Request id -> the engine-clock time of its first event of `kind`."""
    found: Dict[str, float] = {}
    for record in outputs:
        for item in record.get("requests", ()):
            for event in item.get("events") or ():
                if event[0] == kind and item["id"] not in found and isinstance(event[1], (int, float)):
                    found[item["id"]] = float(event[1])
    return found


def _preemptions(outputs: List[Dict[str, Any]]) -> "tuple[List[tuple[float, str]], List[tuple[float, str]]]":
    """(engine-clock stamp, request id) of each preemption (its PREEMPTED
    event) and of each resume (the SCHEDULED event after one), each in time
    order. A preempted request's events ride on its next output, after its
    resume (§4.5)."""
    preempts, resumes = [], []
    for record in outputs:
        for item in record.get("requests", ()):
            out = False
            for event in item.get("events") or ():
                if not isinstance(event[1], (int, float)):
                    continue
                if event[0] == PREEMPTED:
                    preempts.append((float(event[1]), item["id"]))
                    out = True
                elif event[0] == SCHEDULED and out:
                    resumes.append((float(event[1]), item["id"]))
                    out = False
    preempts.sort()
    resumes.sort()
    return preempts, resumes


def _resume_hits(
    groups: List[List[Dict[str, Any]]], resumes: List["tuple[float, str]"]
) -> Dict["tuple[str, float]", "tuple[int, int]"]:
    """(request id, resume stamp) -> the prompt tokens the prefix cache held
    for it when it was resumed. An engine counts its resumes
    (`preempted_requests`) and their cache hits (`preempted_hits`, §7.1:
    vLLM records them at admission) in the first SchedulerStats it sends
    once it decided them: those stamped at the end of the step that follows
    (vLLM), or with the outputs of the boundary it decided them at, when
    stats are due (the mock's, at most every outbox.STATS_INTERVAL_S; with
    async scheduling it stamps the event a step earlier). So each resume,
    in time order, goes to the first stats at or after its stamp that still
    count one not placed. Returns (hits, queries) of those stats: resumes
    counted together share the hits in proportion to their tokens (the
    queries). Empty when the engine sends no such counts."""
    ends = _step_ends(groups)
    if ends is None:
        return {}
    room: Dict[int, int] = {}  # group index -> resumes its stats count and not placed yet
    counted: Dict[int, "tuple[int, int]"] = {}
    keys = ("preempted_requests", "preempted_queries", "preempted_hits")
    for i, group in enumerate(groups):
        for record in group:
            prefix = (record.get("stats") or {}).get("prefix_cache") or {}
            if all(isinstance(prefix.get(key), int) for key in keys):
                hits, queries = counted.get(i, (0, 0))
                room[i] = room.get(i, 0) + prefix["preempted_requests"]
                counted[i] = (hits + prefix["preempted_hits"], queries + prefix["preempted_queries"])
    counts = list(room)  # the groups with such stats, in order
    placed: Dict["tuple[str, float]", "tuple[int, int]"] = {}
    for stamp, rid in resumes:
        j = bisect_left(counts, bisect_left(ends, stamp))
        while j < len(counts) and room[counts[j]] <= 0:
            j += 1
        if j < len(counts):
            room[counts[j]] -= 1
            placed[(rid, stamp)] = counted[counts[j]]
    return placed


def _step_ends(groups: List[List[Dict[str, Any]]]) -> Optional[List[float]]:
    """The engine-clock end of each step (`_step_groups`), or None when
    there are no steps or one is not stamped."""
    ends = [group[0]["engine_timestamp"] for group in groups]
    if not ends or any(not isinstance(t, (int, float)) for t in ends):
        return None
    return ends


def _nearest(ends: List[float], stamp: float) -> int:
    """The index of the step end in `ends` (sorted) nearest `stamp`: the
    boundary an engine made a decision stamped then at."""
    i = bisect_left(ends, stamp)
    return i if i == 0 or (i < len(ends) and ends[i] - stamp < stamp - ends[i - 1]) else i - 1


def scheduling_lags(records: List[Dict[str, Any]], max_num_batched_tokens: Optional[int] = None) -> Dict[int, int]:
    """How many steps after the boundary it was scheduled at each request
    had its first token -> how many requests. The boundary is the step end
    nearest its SCHEDULED event (`_boundary`: an engine schedules at one).
    An engine that schedules each step as the one before ends gives a
    request that came while the batch ran its first token 1 step later (a
    chunked prompt more); one that schedules a step ahead (vLLM's async
    scheduling) 2. A request that woke an idle engine has it 0 or 1 steps
    later either way. With a token budget only the requests whose uncached
    prompt is at most a quarter of it count: the others are likely chunked."""
    lags: Dict[int, int] = {}
    for rank in _ranks(records):
        adds, _, outputs = _engine_records(records, rank)
        prompts = {add["request_id"]: int(add.get("prompt_len") or 0) for add in adds}
        scheduled = _first_events(outputs, SCHEDULED)
        groups = _step_groups(outputs)
        ends = _step_ends(groups)
        if ends is None:
            continue
        first: Dict[str, int] = {}
        for index, group in enumerate(groups):
            for record in group:
                for item in record.get("requests", ()):
                    if item.get("tokens") and item["id"] not in first:
                        first[item["id"]] = index
        cached = _cached_tokens(outputs)
        for rid, stamp in scheduled.items():
            if rid not in first:
                continue
            if max_num_batched_tokens is not None and prompts.get(rid, 0) - cached.get(rid, 0) > max_num_batched_tokens // 4:
                continue
            nearest = _nearest(ends, stamp)
            lag = first[rid] - nearest
            lags[lag] = lags.get(lag, 0) + 1
    return lags


def schedules_ahead(lags: Dict[int, int]) -> Optional[bool]:
    """Whether the lags (scheduling_lags) say the engine scheduled a step
    ahead: most requests with a lag of 1 or 2 have 2. None: neither seen."""
    one, two = lags.get(1, 0), lags.get(2, 0)
    return None if one + two == 0 else two > one


def slot_admissions(records: List[Dict[str, Any]]) -> Dict[str, int]:
    """Where the requests that waited in the queue were scheduled, against
    the finishes that made room: "with a finish" (at the step end whose
    outputs ended a request: vLLM frees what ended before it schedules
    again, so a freed slot is decided on at once; with async scheduling for
    the step after the next, which the first token shows, not this),
    "a step after one" (a finish at the step end before only, none at its
    own: the slot was given a step late), "other" (no finish at either:
    the token budget, the KV blocks or the input path held it). A request
    waited when it was queued (QUEUED) before the step end before the one
    nearest its SCHEDULED event. Engine clock only: the tap's times play no
    part."""
    counts = {"with a finish": 0, "a step after one": 0, "other": 0}
    for rank in _ranks(records):
        _, _, outputs = _engine_records(records, rank)
        groups = _step_groups(outputs)
        ends = _step_ends(groups)
        if ends is None:
            continue
        finished = [any(r.get("finished_requests") or any(i.get("finish_reason") is not None for i in r.get("requests", ())) for r in group)
                    for group in groups]  # fmt: skip
        queued = _first_events(outputs, QUEUED)
        for rid, stamp in _first_events(outputs, SCHEDULED).items():
            nearest = _nearest(ends, stamp)
            if nearest == 0 or rid not in queued or queued[rid] >= ends[nearest - 1]:
                continue  # it did not wait through a step end
            if finished[nearest]:
                counts["with a finish"] += 1
            elif finished[nearest - 1]:
                counts["a step after one"] += 1
            else:
                counts["other"] += 1
    return counts


def input_delays_ms(records: List[Dict[str, Any]]) -> List[float]:
    """Per request, ms from the tap relaying its ADD to the engine queueing
    it (its QUEUED event, §4.5): the engine's input path (receiving,
    decoding, preparing the request), which a request's first token waits
    for on top of its steps. A real engine queues a request only between
    two steps, so an ADD that comes while it runs requests also waits for
    the step in progress; the mock's scheduler makes that wait itself (it
    admits at a step boundary), so only the requests that found the engine
    idle count: every request before them had finished, and no other ADD
    came in the ISOLATED_S before (in a burst each waits for the ones
    before it). The engine clock is moved onto the tap's by the smallest
    lag of its outputs (an engine whose outputs are not all stamped has
    none); a request the tap was slow to stamp can come out below 0 and
    counts as 0."""
    delays: List[float] = []
    for rank in _ranks(records):
        adds, aborts, outputs = _engine_records(records, rank)
        offset = _clock_offset(outputs)
        if offset is None:
            continue
        queued = _first_events(outputs, QUEUED)
        ended = _end_times(aborts, outputs, offset)
        previous = None
        busy_until = -math.inf  # when every request added so far had ended
        for add in adds:
            alone = previous is None or add["t"] - previous >= ISOLATED_S
            previous = add["t"]
            idle = busy_until <= add["t"]
            busy_until = max(busy_until, ended.get(add["request_id"], math.inf))
            if alone and idle and add["request_id"] in queued:
                delays.append(max(0.0, (queued[add["request_id"]] + offset - add["t"]) * 1000.0))
    return delays


def _end_times(aborts: List[Dict[str, Any]], outputs: List[Dict[str, Any]], offset: float) -> Dict[str, float]:
    """Request id -> when it left the engine, on the tap's clock: the output
    that finished it (engine clock + `offset`), or the ABORT relayed."""
    ended: Dict[str, float] = {}
    for record in outputs:
        t = record["engine_timestamp"] + offset
        for item in record.get("requests", ()):
            if item.get("finish_reason") is not None:
                ended.setdefault(item["id"], t)
        for rid in record.get("finished_requests") or ():
            ended.setdefault(rid, t)
    for record in aborts:
        for rid in record.get("request_ids", ()):
            ended.setdefault(rid, record["t"])
    return ended


def steps_from_trace(
    records: List[Dict[str, Any]], max_num_batched_tokens: Optional[int] = None, ahead: Optional[bool] = None
) -> List[Step]:
    """The steps of every engine in a trace's records, engine by engine
    (`ahead`: steps_of_rank; None: what the first tokens say,
    schedules_ahead)."""
    if ahead is None:
        ahead = schedules_ahead(scheduling_lags(records, max_num_batched_tokens)) is True
    steps: List[Step] = []
    for rank in _ranks(records):
        steps.extend(steps_of_rank(records, rank, max_num_batched_tokens, ahead))
    return steps
