"""KV blocks in the schedule, pure (vLLM: the KV side of
`vllm/v1/core/sched/scheduler.py`: running requests' slots first,
recompute preemption, WAITING_FOR_REMOTE_KVS)."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from gmock_engine.core.request import Request, RequestStatus
from gmock_engine.wire.outputs import engine_core_event, request_error
from gmock_engine.wire.types import EngineCoreEventType, FinishReason

_PREEMPTED, _RUNNING, _REMOTE_KVS = RequestStatus.PREEMPTED, RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS
#: no request preempted in a step (most steps)
_NONE: Tuple[Any, ...] = ()


class KVScheduling:
    """The scheduler's KV: the slots of the running requests' next tokens,
    recompute preemption when blocks run out, and a P/D consumer's remote
    KV (its admission, its arrival, a failed load). A part of `Scheduler`
    (core/scheduler.py), whose state it reads."""

    def remote_kvs_arrived(self, request: Request) -> None:
        """A running P/D request's prefill wait is over (its KV is here):
        it is running, no longer waiting for remote KVs."""
        self.transferring.discard(request.request_id)
        request.status = _RUNNING

    def kv_load_failed(self, request: Request, now: float) -> Optional[bool]:
        """A consumer's transfer failed (mock_kv_load, --fault-kv-transfer-fail).
        kv_load_failure_policy "recompute": it prefills itself now, with the
        latency model's prefill time (True: no token in this step; False: at
        once). "fail" (vLLM's default): None, it ends with ERROR and no tokens
        (vLLM: failed_kv_load_req_ids -> FINISHED_ERROR), which the output
        processor sends."""
        request.kv.fail = False
        assert self.kv_transfer is not None
        if self.kv_transfer.settings.load_failure_policy == "recompute":
            request.kv.loaded_tokens = 0
            wait = self.latency.first_token_seconds(request.prompt_len, self.rng) if self.latency.paced else 0.0
            if wait <= 0:
                return False
            request.ready_at = now + wait
            self.prefilling[request.request_id] = request.ready_at
            return True
        request.finish = FinishReason.ERROR
        return None

    def _kv_admit(self, request: Request, now: float, target: int, extra: float = 0.0) -> None:
        """A consumer request joins the batch: it waits for its KV (the
        prompt tokens not in the local cache) instead of prefilling them, as
        vLLM's WAITING_FOR_REMOTE_KVS; its first token comes when the
        transfer is done (also at once: a failure is then seen by the output
        processor, `kv_load_failed`);
        `extra`: a LoRA load in the same step."""
        assert self.kv_transfer is not None
        wait = self.kv_transfer.admitted(request.kv, target, self.kv.block_size, self.latency.time_scale) + extra
        request.prefill_left = 0
        request.ready_at = now + wait
        self.prefilling[request.request_id] = request.ready_at
        self.transferring.add(request.request_id)
        request.status = _REMOTE_KVS

    def _reserve_decode_blocks(self, decided_at: float) -> Any:
        """KV for the running requests' tokens of this step, before anything
        is admitted (vLLM schedules running requests first): a request
        crossing a block boundary needs a new block; when they run out, the
        newest running request is preempted (vLLM's recompute preemption)
        until the rest fit. Returns the preempted requests (a falsy empty
        tuple when none: then admissions may follow; after a preemption
        nothing is admitted in this step, as in vLLM). `decided_at`: the
        PREEMPTED events' time (with async scheduling the call before)."""
        kv, prefilling = self.kv, self.prefilling
        preempted: Any = _NONE
        # the slots of the step being planned hold the KV it computes: the
        # token emitted last and all but the last of those it samples
        # (vLLM's num_computed_tokens + num_new_tokens); scheduled after the
        # outputs (not async), the one emitted last is in num_tokens already
        emitted = 0 if self.async_scheduling else 1
        while True:
            needs = []
            total = 0
            for request in self.running.values():
                if request.request_id in prefilling:
                    continue  # its prompt's blocks came with its admission; no new KV before its first token
                need = kv.blocks_to_grow(request, self._next_tokens(request) - emitted)
                if need > 0:
                    needs.append((request, need))
                    total += need
            if kv.fits(total) or not self.running:
                break
            victim = self._victim()
            self._preempt(victim, decided_at)
            preempted = [victim] if preempted is _NONE else preempted + [victim]
        for request, need in needs:
            kv.allocate(request, need)
        return preempted

    def _victim(self) -> Request:
        """The running request to preempt when KV runs out: vLLM's FCFS takes
        the last of its running list (the newest admitted, `self.running[-1]`);
        its priority policy the greatest (priority, arrival_time) of the
        running requests, so a request resumed after a preemption (admitted
        again, last, but arrived long ago) is not the one preempted again
        while later arrivals of its priority run."""
        if self.priority_policy:
            return max(self.running.values(), key=lambda r: (r.priority, r.arrival))
        return next(reversed(self.running.values()))

    def preempt_all(self, now: float) -> None:
        """Every running request back to the queue, newest first (vLLM's
        reset_prefix_cache(reset_running_requests=True))."""
        while self.running:
            self._preempt(next(reversed(self.running.values())), now)

    def _preempt(self, request: Request, now: float) -> None:
        """Back to the front of the queue; its KV is freed and recomputed later."""
        del self.running[request.request_id]
        self._release(request)
        # Events not sent yet (QUEUED, SCHEDULED of a request preempted before
        # its first token) stay: they all ride on its next output, as in vLLM.
        request.pending_events = (request.pending_events or []) + [engine_core_event(EngineCoreEventType.PREEMPTED, now)]
        self.waiting.prepend_request(request)
        request.status = _PREEMPTED
        self.counters["preemptions"] += 1
        self._on_preempt(request)

    def _reject_too_long(self, request: Request, rejected: List[Any]) -> None:
        """A request whose KV can never fit: ERROR now, not a queue that never moves."""
        request.status = RequestStatus.FINISHED_IGNORED
        error = request_error("kv_cache_too_small", f"needs more than the engine's {self.kv.num_blocks} KV blocks")
        rejected.append((request, error))
        self._on_reject(request)
