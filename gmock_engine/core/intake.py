"""How the engine core takes a request in, pure (vLLM: `EngineCore.add_request`
and the scheduler's `add_request`): an ADD checked, planned and queued, or
held while its structured answer is made off the loop (core/grammar_wait.py),
or answered at once with ERROR; a pooling ADD; a P/D plan. `RequestIntake` is
a part of `EngineCore` (core/engine.py), which owns the state it reads."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from gmock_engine.content import answer as content, pooling
from gmock_engine.content.tokens import request_seed
from gmock_engine.core import grammar_wait
from gmock_engine.core.lora import decode_lora_request
from gmock_engine.core.outbox import Outbound
from gmock_engine.core.request import Request, plan
from gmock_engine.kv import transfer as kv_transfer
from gmock_engine.timing.replay import follow
from gmock_engine.utils.logs import short
from gmock_engine.wire.checks import NO_XARGS, BadXargs, Xargs, check_xargs
from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.outputs import engine_core_event, mm_cache_miss_output, request_error
from gmock_engine.wire.types import BadValue, EngineCoreEventType, FinishReason

#: read once per ADD: a module constant, not an enum member lookup (a metaclass attribute lookup per use)
_QUEUED = EngineCoreEventType.QUEUED


class RequestIntake:
    """The ADD path of `EngineCore`: its methods read the engine's parts
    (settings, scheduler, KV manager, ledger, outbox) as the engine's own."""

    def add_request(self, request: EngineCoreRequest) -> List[Outbound]:
        """ADD (§3.2, §9.3): checked, planned, queued."""
        rid, client = request.request_id, request.client_index
        if not self._valid_client(client, f"ADD {short(rid)}"):
            return []
        self.ledger.started(rid)
        # --replay: every ADD takes its turn, as each was recorded (timing/replay.py)
        recorded = self.settings.replay.take(self.rank, rid) if self.settings.replay is not None else None
        # A duplicate first: even an abort_immediately ADD must not end the original.
        if rid in self.scheduler.running or rid in self.scheduler.waiting or rid in self.scheduler.waiting_for_fsm:
            self.throttle.warning("duplicate request id", "ADD {}: duplicate of an active request id; answered with ERROR", short(rid))
            error = request_error("duplicate_request_id", f"request id {short(rid)} is already active")
            return self._answer_now(client, rid, FinishReason.ERROR, error)
        if request.abort_immediately:
            # §3.2 idx 19: no output, only the id in finished_requests.
            self.outbox.finish(client, rid)
            return self._flush()
        if self.shutting_down:
            # vLLM's _reject_add_in_shutdown: an ABORT output for the newcomer
            return self._answer_now(client, rid, FinishReason.ABORT)
        if not request.has_sampling_params and request.pooling_params is None:
            self.throttle.warning("pooling request", "ADD {}: sampling_params is nil (pooling request); answered with ERROR", short(rid))
            return self._answer_now(client, rid, FinishReason.ERROR, request_error("unsupported", "the mock engine only generates"))
        if self.utilities.reject_new_requests:
            error = request_error("engine_paused", "Generation is paused. Please retry after it resumes.", retryable=True)
            return self._answer_now(client, rid, FinishReason.ERROR, error)
        if request.prompt_len > self.settings.max_model_len:
            reason = f"the prompt has {request.prompt_len} tokens, more than max_model_len {self.settings.max_model_len}"
            self.throttle.warning("invalid request", "ADD {}: {}; answered with ERROR", short(rid), reason)
            return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", reason))
        if request.mm_features:
            missing = self.mm_cache.receive(request.mm_features)
            if missing:
                # the frontend stripped items this engine does not hold: vLLM's
                # _handle_mm_cache_miss, a retryable ERROR naming them
                self.throttle.warning("mm cache miss", "ADD {}: {} multimodal item(s) not in the engine's cache; answered with ERROR",
                                      short(rid), len(missing))  # fmt: skip
                error = request_error("multimodal_cache_miss", "Multi-modal processor cache miss.", retryable=True)
                self.outbox.end(client, rid, mm_cache_miss_output(rid, missing, error, self.layout))
                self._log_end(rid, 0, FinishReason.ERROR)
                return self._flush()
        if not request.has_sampling_params:
            return self._add_pooling(request)
        lora_request = None
        if request.lora_request is not None:
            # a bad LoRARequest ends this request only (vLLM's would fail in
            # msgspec or LoRARequest.__post_init__); without --enable-lora the
            # error is vLLM's input processor's (_validate_lora)
            try:
                lora_request = decode_lora_request(request.lora_request)
            except BadValue as exc:
                return self._invalid(client, rid, exc)
            if self.lora is None:
                reason = f"Got lora_request {lora_request.lora_name!r} but LoRA is not enabled!"
                self.throttle.warning("invalid request", "ADD {}: {}; answered with ERROR", short(rid), reason)
                return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", reason))
        max_tokens = request.max_tokens or 0
        sampler = self.scheduler.sampler
        entry = Request(rid, client, max_tokens, sampler.tokens.initial_state(rid, request.prompt_token_ids), request.prompt_len, self.clock())
        entry.sampler = sampler
        entry.lora_request = lora_request
        entry.mm_features = request.mm_features
        entry.pending_events = [engine_core_event(_QUEUED, entry.queued_at)]
        settings = self.settings
        try:
            # every vllm_xargs key the engine reads, checked in one place (most requests carry none)
            xargs = check_xargs(request.extra_args) if request.extra_args else NO_XARGS
        except BadXargs as exc:
            reason = f"{str(exc):.200}"
            self.throttle.warning("invalid request", "ADD {}: bad vllm_xargs ({}); answered with ERROR", short(rid), reason)
            return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", f"bad vllm_xargs: {reason}"))
        except BadValue as exc:
            return self._invalid(client, rid, exc)
        plan(entry, request, xargs, sampler.tokens, settings.max_model_len, settings.output_lengths, settings.seed, self.rank)
        if recorded is not None:
            follow(entry, recorded, request.eos_token_id, min(max_tokens, max(0, settings.max_model_len - request.prompt_len)))
        if recorded is None and settings.tokenizer is not None and grammar_wait.needs_grammar(request, xargs, settings):
            # a grammar to compile and walk: off the loop, the request held until it is done
            self.scheduler.hold(entry)
            held = grammar_wait.GrammarReady(rid, entry, request, xargs, self.clock())
            cap = min(max_tokens, max(0, settings.max_model_len - request.prompt_len))
            job = grammar_wait.shaping_job(held, settings, self.rank, cap)
            ready = self.grammar_executor.submit(job, dataclasses.replace(held, timed_out=True), settings.grammar_timeout_s or None)
            return self.grammar_ready(ready) if ready is not None else []
        try:
            # tool calls without tools in the prompt, reasoning spans (content/answer.py): most requests ask for none
            if recorded is None and (request.structured_outputs is not None or xargs is not NO_XARGS
                                     or (settings.content.active and settings.tokenizer is not None)):
                why = content.shape(entry, request, xargs, settings, self.rank, min(max_tokens, max(0, settings.max_model_len - request.prompt_len)))
                if why is not None:
                    self.throttle.warning("content", "ADD {}: {}", short(rid), why)
        except BadValue as exc:
            return self._invalid(client, rid, exc)
        return self._queue(entry, request, xargs)

    def grammar_ready(self, ready: grammar_wait.GrammarReady) -> List[Outbound]:
        """A held request's structured answer is made (or failed, or its
        time limit passed): queued for scheduling as vLLM's WAITING_FOR_FSM
        request whose grammar is ready, or ended with ERROR. An outcome for
        a request no longer held (aborted meanwhile) is dropped."""
        entry = ready.request
        if not self.scheduler.release(entry):
            return []
        request, xargs = ready.core_request, ready.xargs
        client, rid = entry.client_index, entry.request_id
        timeout = self.settings.grammar_timeout_s
        if ready.timed_out or (timeout and self.clock() - ready.since > timeout):
            reason = grammar_wait.timeout_message(timeout)
            self.throttle.warning("grammar timeout", "ADD {}: {}; answered with ERROR", short(rid), reason)
            return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", reason))
        if ready.error is not None:
            if not isinstance(ready.error, BadValue):
                # a bug the request's content found: that request ends, as one in add_request would
                self.throttle.warning("contained failure", "ADD {}: shaping failed ({!r}); answered with ERROR", short(rid), ready.error)
                return self.answer_failure(request, ready.error)
            return self._invalid(client, rid, ready.error)
        if ready.why is not None:
            self.throttle.warning("content", "ADD {}: {}", short(rid), ready.why)
        return self._queue(entry, request, xargs)

    def _invalid(self, client: int, rid: str, exc: BaseException) -> List[Outbound]:
        """A value the request cannot be served with: ERROR naming it."""
        reason = f"{str(exc):.200}"
        self.throttle.warning("invalid request", "ADD {}: {}; answered with ERROR", short(rid), reason)
        return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", reason))

    def _queue(self, entry: Request, request: EngineCoreRequest, xargs: Xargs) -> List[Outbound]:
        """The last of an ADD, once its content is shaped: its P/D plan,
        the log line, its KV and logprobs, and the waiting queue."""
        rid, client, settings = entry.request_id, entry.client_index, self.settings
        max_tokens = request.max_tokens or 0
        lora_request = entry.lora_request
        if request.extra_args:  # P/D params ride in extra_args: most requests carry none
            try:
                entry.kv = self._plan_kv_transfer(entry, request, xargs)
            except BadValue as exc:
                return self._invalid(client, rid, exc)
        else:
            entry.kv = None
        if settings.log_requests:
            self.log.info(
                "mock request started engine={} request_id={} prompt_len={} max_tokens={} chunk={}{}",
                self.rank,
                short(rid),
                request.prompt_len,
                max_tokens,
                self.chunk,
                # the adapter it names, for per-adapter counts from the log (docs/lora.md)
                ("" if lora_request is None else f" lora={short(lora_request.lora_name, 60)}")
                # its multimodal items, and how many came without data (served from the receiver cache)
                + ("" if not request.mm_features else
                   f" mm_items={len(request.mm_features)} mm_stripped={sum(f.data_bytes is None for f in request.mm_features)}"),
            )
        if max_tokens == 0:
            return self._answer_now(client, rid, FinishReason.LENGTH)
        entry.priority = request.priority
        self.kv.track(entry, request.prompt_token_ids)
        if request.logprobs is not None or request.prompt_logprobs is not None:
            asked = max(request.logprobs or 0, request.prompt_logprobs or 0)
            if asked + 1 > self._logprob_span:
                reason = f"{asked} logprobs asked, but the engine makes only {self._logprob_span} distinct token ids"
                self.throttle.warning("invalid request", "ADD {}: {}; answered with ERROR", short(rid), reason)
                return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", reason))
            entry.num_logprobs = request.logprobs
            entry.num_prompt_logprobs = request.prompt_logprobs
            entry.shaped = True
            entry.logprob_state = request_seed(settings.seed, self.rank, rid) ^ 0x5DEECE66D
            if request.prompt_logprobs is not None:
                entry.prompt_token_ids = request.prompt_token_ids
        self.scheduler.add_request(entry)
        return []

    def _add_pooling(self, request: EngineCoreRequest) -> List[Outbound]:
        """A pooling request (§3.7): its tensor made now, then one prefill; a bad one gets an ERROR."""
        try:
            pooled = pooling.request_tensor(request, self.settings)
        except BadValue as exc:
            return self._invalid(request.client_index, request.request_id, exc)
        # one "token" to go (its prefill), no token source
        entry = Request(request.request_id, request.client_index, 1, None, request.prompt_len, self.clock())
        entry.pooling, entry.priority = pooled, request.priority
        entry.pending_events = [engine_core_event(_QUEUED, entry.queued_at)]
        self.kv.track(entry, request.prompt_token_ids)
        self.scheduler.add_request(entry)
        return []

    def _plan_kv_transfer(self, entry: Request, request: EngineCoreRequest, xargs: Xargs) -> Optional[kv_transfer.KVPlan]:
        """P/D (kv/transfer.py): a producer request ends after its first token
        (LENGTH, as vLLM's with the proxy's max_tokens=1); BadValue for bad params."""
        kv = kv_transfer.plan(self.kv_transfer, request.extra_args, xargs)
        if kv is None and self.kv_transfer is None and request.extra_args.get("kv_transfer_params") is not None:
            self.throttle.warning("kv_transfer_params ignored", "ADD {}: kv_transfer_params but no --kv-role; ignored, as vLLM without a KV connector", short(entry.request_id))
        if kv is not None and self.settings.log_requests:
            # the params as this engine got them: the e2e tests check a proxy passed them on unchanged
            self.log.info(
                "mock request kv_transfer engine={} request_id={} role={} kv_transfer_params={}",
                self.rank,
                short(entry.request_id),
                "producer" if kv.produce else "consumer",
                kv_transfer.describe(request.extra_args.get("kv_transfer_params")),
            )
        if kv is not None and kv.produce and entry.max_tokens > 1:
            entry.max_tokens = 1
            if entry.finish is FinishReason.STOP:  # its EOS would have come later
                entry.finish, entry.last_token, entry.stop_reason = FinishReason.LENGTH, None, None
        return kv
