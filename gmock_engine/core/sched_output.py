"""The step plan: what `Scheduler.schedule` decided for one step, pure
(vLLM: `vllm/v1/core/sched/output.py`, `SchedulerOutput`).

The scheduler decides (admission, the token budget, chunked prefill,
preemption, LoRA slots, P/D waits) and hands this plan to the output
processor, which takes its new and rejected requests
(`OutputProcessor.take_plan`), and to the latency model, which times the
step from it (`LatencyModel.step_time`). It is built every step:
slots, and the shared empty tuple where nothing happened.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Sequence, Tuple

from gmock_engine.core.request import Request

if TYPE_CHECKING:
    from gmock_engine.content.sampler import Sampler


class PauseState(enum.Enum):
    """As in vLLM's scheduler: PAUSED_NEW holds new requests but keeps
    stepping the running ones; PAUSED_ALL steps nothing."""

    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"
    PAUSED_ALL = "paused_all"


class BatchObserver:
    """What the scheduler tells the part that makes the outputs (the output
    processor, which sets itself as `Scheduler.output_processor`) about the
    running batch, so that the scheduler needs none of its code: a request
    left the batch, the whole batch left, a reload brought a new sampler."""

    def drop(self, request: Request) -> None:
        """`request` left the running batch (finished, aborted, preempted)."""

    def clear(self, running: Iterable[Request]) -> None:
        """Every running request left the batch at once."""

    def reconfigure(self, sampler: "Sampler", changed: bool) -> None:
        """A reload: `sampler` is for new requests; `changed`: its token source is new."""


class SchedulerOutput:
    """One step's plan (vLLM's SchedulerOutput, reduced to what a mock's
    step reads).

    * `scheduled_new_reqs`: the requests admitted in this step, in
      admission order (their first step in the running batch).
    * `num_running_reqs`: the running batch after scheduling (the admitted
      ones included): every one of them past its prefill is scheduled for
      its next tokens (`num_scheduled_tokens`).
    * `num_decode_tokens`, `num_prefill_tokens`: the decode tokens of the
      running requests past their prefill (a full chunk each, what the token
      budget reserves) and the prompt tokens prefilled in this step (chunks
      of running requests, then the admitted ones);
      `total_num_scheduled_tokens` is their sum; `prefill_attention` is
      Σ c·(p + c/2) over the step's prompt chunks (c tokens from position
      p), the attention work of the prefill (timing/profile.py), and
      `num_prefill_reqs` the requests that compute a prompt chunk;
      `num_draft_tokens`: with speculative decoding, the K drafts each
      decoding request verifies (content/spec_decode.py), computed as prompt tokens
      are.
    * `preempted_reqs`: the requests preempted in this step (back in the
      waiting queue; nothing is admitted in such a step).
    * `rejected_reqs`: (request, error) of requests the scheduler ended
      without running them (an adapter that cannot be loaded, KV that can
      never fit); their ids are `finished_req_ids`.
    """

    __slots__ = (
        "scheduled_new_reqs",
        "num_running_reqs",
        "num_decode_tokens",
        "num_prefill_tokens",
        "preempted_reqs",
        "rejected_reqs",
        "chunk",
        "prefill_attention",
        "num_draft_tokens",
        "num_prefill_reqs",
    )

    def __init__(
        self,
        scheduled_new_reqs: Sequence[Request] = (),
        num_running_reqs: int = 0,
        num_decode_tokens: int = 0,
        num_prefill_tokens: int = 0,
        preempted_reqs: Sequence[Request] = (),
        rejected_reqs: Sequence[Tuple[Request, Dict[str, Any]]] = (),
        chunk: int = 1,
        prefill_attention: float = 0.0,
        num_draft_tokens: int = 0,
        num_prefill_reqs: int = 0,
    ) -> None:
        self.scheduled_new_reqs = scheduled_new_reqs
        self.num_running_reqs = num_running_reqs
        self.num_decode_tokens = num_decode_tokens
        self.num_prefill_tokens = num_prefill_tokens
        self.preempted_reqs = preempted_reqs
        self.rejected_reqs = rejected_reqs
        #: tokens a running request past its prefill is scheduled for (its
        #: last output: what remains, if fewer)
        self.chunk = chunk
        self.prefill_attention = prefill_attention
        #: speculative decoding: the draft tokens the decoding requests
        #: verify in this step (K each, what the token budget reserves)
        self.num_draft_tokens = num_draft_tokens
        self.num_prefill_reqs = num_prefill_reqs

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Decode and prefill tokens of the step."""
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def finished_req_ids(self) -> List[str]:
        """Ids of the requests the scheduler ended in this step."""
        return [request.request_id for request, _ in self.rejected_reqs]

    def num_scheduled_tokens(self, request: Request) -> int:
        """Decode tokens scheduled for a running request past its prefill."""
        remaining = request.max_tokens - request.num_output_tokens
        return self.chunk if self.chunk < remaining else remaining

    def __repr__(self) -> str:
        return (
            f"SchedulerOutput(new={[r.request_id for r in self.scheduled_new_reqs]}, running={self.num_running_reqs}, "
            f"decode={self.num_decode_tokens}, prefill={self.num_prefill_tokens}, "
            f"preempted={[r.request_id for r in self.preempted_reqs]}, finished={self.finished_req_ids})"
        )
