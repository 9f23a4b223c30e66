"""Utility calls and the pause/sleep state: pure (vLLM: `EngineCore`'s
utility methods in `vllm/v1/engine/core.py`, docs/protocol.md §3.5, §5).

Every call is answered exactly once on the caller's output socket
(`outputs[client_index]`), with its call id: a result, or a
`failure_message` for a method the mock does not know or arguments it
cannot use (the call fails, nothing else). The one exception is pause mode
"wait", answered when the engine has drained.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from gmock_engine.core.kv_cache_manager import KVCacheManager
from gmock_engine.core.ledger import Ledger
from gmock_engine.utils.logs import Throttle, short
from gmock_engine.core.lora import AdapterRegistry, LoRAError, decode_lora_request
from gmock_engine.core.outbox import Outbound
from gmock_engine.wire.checks import cut
from gmock_engine.core.sched_output import PauseState
from gmock_engine.core.scheduler import Scheduler
from gmock_engine.wire.inputs import UtilityCall
from gmock_engine.wire.outputs import utility_reply
from gmock_engine.wire.types import BadValue

PAUSE_MODES = ("abort", "wait", "keep")


class UtilityFailure(Exception):
    """A utility call the engine answers with `failure_message`."""


class Utilities:
    """The utility table's state: pause/sleep as vLLM 0.32/0.33 keep it
    (the scheduler holds the pause state itself), weight version, calls
    waiting for a drain."""

    def __init__(
        self,
        rank: int,
        clock: Callable[[], float],
        scheduler: Scheduler,
        kv: KVCacheManager,
        ledger: Ledger,
        throttle: Throttle,
        log: Any,
        supported_tasks: Sequence[str],
        abort_all: Callable[[], List[Outbound]],
    ) -> None:
        self.rank = rank
        self.clock = clock
        self.scheduler = scheduler
        self.kv = kv
        self.ledger = ledger
        self.throttle = throttle
        self.log = log
        self.supported_tasks = tuple(supported_tasks)
        #: the engine's: every in-flight request ends with an ABORT output
        self.abort_all = abort_all
        #: Extra figures for the `gmock_stats` utility: the engine's counters
        #: and the runtime's own (set by the engine); called with
        #: restart_window=True it also starts their windowed figures again.
        self.stats_provider: Callable[..., Dict[str, Any]] = _no_figures
        #: pause_generation in modes abort/wait rejects new ADDs (0.33, §5).
        self.reject_new_requests = False
        self.sleep_level = 0
        self.weight_version: Optional[str] = None
        #: The engine's LoRA adapter registry (None: LoRA not enabled; set by the engine).
        self.lora: Optional[AdapterRegistry] = None
        #: (receiver cache, encoder cache) of mm_cache.py, set by EngineCore: reset_mm_cache / reset_encoder_cache clear them
        self.mm_caches: Optional[Tuple[Any, Any]] = None
        #: Utility calls answered when the engine has drained (pause mode "wait").
        self._replies_when_drained: List[Tuple[int, int]] = []

    def call(self, call: UtilityCall) -> List[Outbound]:
        """Run one call; its answer (or nothing yet, for pause mode wait)."""
        handler = _UTILITIES.get(call.method)
        if handler is None:
            self.throttle.warning("unknown utility", "UTILITY {}: unsupported method; answered with a failure", short(call.method, 60))
            return [self.reply(call, failure=f"unsupported method {cut(call.method)} (gmock_engine)")]
        self.log.opt(lazy=True).debug(
            "UTILITY {} args={} call_id={}", lambda: call.method, lambda: cut(call.args, 200), lambda: call.call_id
        )
        try:
            return handler(self, call)
        except UtilityFailure as exc:
            self.throttle.warning("utility failure", "UTILITY {}: {}", call.method, exc)
            return [self.reply(call, failure=str(exc))]
        except (TypeError, ValueError, AttributeError, IndexError, KeyError, OverflowError) as exc:
            # arguments of a shape the handler did not expect: that call fails, nothing else
            self.throttle.warning("utility failure", "UTILITY {}: bad arguments {} ({})", call.method, cut(call.args), exc)
            return [self.reply(call, failure=f"{call.method}: bad arguments {cut(call.args)}: {type(exc).__name__}: {str(exc):.200}")]

    def reply(self, call: UtilityCall, result: Any = None, failure: Optional[str] = None) -> Outbound:
        return (call.client_index, utility_reply(self.rank, call.call_id, self.clock(), result, failure))

    # -- pause and sleep ---------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self.scheduler.pause_state is not PauseState.UNPAUSED

    def pause(self, call: UtilityCall, mode: Any, reject_new: Optional[bool]) -> List[Outbound]:
        """vLLM's pause_scheduler (0.32/0.33 core.py): abort ends every
        request; wait keeps stepping and answers when drained; keep freezes."""
        if mode not in PAUSE_MODES:
            raise UtilityFailure(f"Invalid pause mode: {cut(mode)}")
        out = self.abort_all() if mode == "abort" else []
        self.scheduler.pause_state = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        if reject_new is not None:
            self.reject_new_requests = reject_new
        if mode == "wait" and self.scheduler.running:
            self._replies_when_drained.append((call.client_index, call.call_id))
            return out
        out.append(self.reply(call))
        return out

    def resume(self) -> None:
        """resume_scheduler: waiting requests are admitted again."""
        self.scheduler.pause_state = PauseState.UNPAUSED
        self.reject_new_requests = False

    def check_drained(self, out: List[Outbound]) -> None:
        """Answer the pause-mode-wait calls once nothing runs any more."""
        if self._replies_when_drained and not self.scheduler.running:
            for client, call_id in self._replies_when_drained:
                out.append((client, utility_reply(self.rank, call_id, self.clock())))
            self._replies_when_drained.clear()


# -- the table -------------------------------------------------------------------------

Handler = Callable[[Utilities, UtilityCall], List[Outbound]]


def _no_figures(restart_window: bool = False) -> Dict[str, Any]:
    return {}


def _arg(call: UtilityCall, index: int, default: Any) -> Any:
    return call.args[index] if len(call.args) > index else default


def _u_value(value: Any) -> Handler:
    return lambda u, call: [u.reply(call, value)]


def _u_supported_tasks(u: Utilities, call: UtilityCall) -> List[Outbound]:
    return [u.reply(call, list(u.supported_tasks))]


def _u_is_sleeping(u: Utilities, call: UtilityCall) -> List[Outbound]:
    # vLLM 0.33: is_sleeping = scheduler paused or executor asleep.
    return [u.reply(call, u.sleep_level > 0 or u.paused)]


def _u_is_paused(u: Utilities, call: UtilityCall) -> List[Outbound]:
    return [u.reply(call, u.paused)]


def _u_sleep(u: Utilities, call: UtilityCall) -> List[Outbound]:
    # [level, mode]; older frontends send only level (§5). Sleep pauses first.
    level = _arg(call, 0, 1)
    if not isinstance(level, int) or isinstance(level, bool) or level < 0:
        raise UtilityFailure(f"Invalid sleep level: {cut(level)}")
    out = u.pause(call, _arg(call, 1, "abort"), reject_new=None)
    u.sleep_level = level
    return out


def _u_wake_up(u: Utilities, call: UtilityCall) -> List[Outbound]:
    # A mock holds no memory: any wake_up wakes fully, which also resumes.
    u.sleep_level = 0
    u.resume()
    return [u.reply(call, True)]


def _u_pause_generation(u: Utilities, call: UtilityCall) -> List[Outbound]:
    mode = _arg(call, 0, "abort")
    return u.pause(call, mode, reject_new=mode != "keep")


def _u_pause_scheduler(u: Utilities, call: UtilityCall) -> List[Outbound]:
    return u.pause(call, _arg(call, 0, "abort"), reject_new=None)


def _u_resume_scheduler(u: Utilities, call: UtilityCall) -> List[Outbound]:
    u.resume()
    return [u.reply(call)]


def _u_reset_prefix_cache(u: Utilities, call: UtilityCall) -> List[Outbound]:
    """As vLLM's: refused (False) while running requests hold blocks, unless
    reset_running_requests (args[0]) preempts them first."""
    if _arg(call, 0, False) is True and u.kv.caching and u.scheduler.running:
        u.scheduler.preempt_all(u.clock())
    return [u.reply(call, u.kv.reset_prefix_cache())]


def _u_get_weight_version(u: Utilities, call: UtilityCall) -> List[Outbound]:
    return [u.reply(call, u.weight_version)]


def _u_set_weight_version(u: Utilities, call: UtilityCall) -> List[Outbound]:
    version = _arg(call, 0, None)
    if version is not None and not isinstance(version, str):
        raise UtilityFailure(f"weight version must be a string, got {type(version).__name__}")
    u.weight_version = version
    return [u.reply(call)]


def _u_gmock_stats(u: Utilities, call: UtilityCall) -> List[Outbound]:
    """gmock_engine's own method (not vLLM's): the books and the engine's
    counters, with runtime figures, for the bench driver and test harnesses.

    `gmock_stats(True)` also starts a new window for the windowed figures
    (step lateness) after taking them: the bench driver calls it as its
    measured window begins, so the ramp-up's steps (thousands of first
    outputs at once) do not count in the window's percentiles."""
    restart = _arg(call, 0, False)
    if not isinstance(restart, bool):
        raise UtilityFailure(f"gmock_stats: the argument (start a new window) must be a bool, got {cut(restart)}")
    stats: Dict[str, Any] = {
        "rank": u.rank,
        "active": len(u.scheduler.running),
        "waiting": len(u.scheduler.waiting) + len(u.scheduler.waiting_for_fsm),
        "counters": dict(u.scheduler.counters),
        "ledger": u.ledger.summary(),
    }
    if u.lora is not None:
        stats["lora"] = u.lora.snapshot()
    stats.update(u.stats_provider(restart_window=restart))
    return [u.reply(call, stats)]


# -- LoRA (vllm/v1/engine/core.py add_lora/remove_lora/list_loras/pin_lora,
# answered by the executor's LRUCacheWorkerLoRAManager; lora.py) -------------


def _registry(u: Utilities) -> AdapterRegistry:
    if u.lora is None:
        # what vLLM's worker says when the engine runs without a LoRA config
        raise UtilityFailure("LoRA is not enabled. Use --enable-lora to enable LoRA.")
    return u.lora


def _lora_id(call: UtilityCall) -> int:
    lora_id = _arg(call, 0, None)
    if isinstance(lora_id, bool) or not isinstance(lora_id, int):
        raise UtilityFailure(f"{call.method}: lora_id must be an int, got {cut(lora_id)}")
    return lora_id


def _u_add_lora(u: Utilities, call: UtilityCall) -> List[Outbound]:
    registry = _registry(u)
    try:
        request = decode_lora_request(_arg(call, 0, None))
    except BadValue as exc:
        raise UtilityFailure(f"add_lora: {exc}") from None
    if request is None:
        raise UtilityFailure("add_lora: lora_request is nil")
    try:
        result = registry.add(request)
    except LoRAError as exc:
        raise UtilityFailure(str(exc)) from None
    u.log.info("LoRA adapter {} (id {}) loaded from {}: {}", short(request.lora_name, 60), request.lora_int_id, short(request.lora_path, 120), registry.snapshot())
    return [u.reply(call, result)]


def _u_remove_lora(u: Utilities, call: UtilityCall) -> List[Outbound]:
    registry, lora_id = _registry(u), _lora_id(call)
    removed = registry.remove(lora_id)
    u.log.info("LoRA adapter id {} removed: {} {}", lora_id, removed, registry.snapshot())
    return [u.reply(call, removed)]


def _u_pin_lora(u: Utilities, call: UtilityCall) -> List[Outbound]:
    registry, lora_id = _registry(u), _lora_id(call)
    try:
        pinned = registry.pin(lora_id)
    except LoRAError as exc:
        raise UtilityFailure(str(exc)) from None
    u.log.info("LoRA adapter id {} pinned: {}", lora_id, registry.snapshot())
    return [u.reply(call, pinned)]


def _u_list_loras(u: Utilities, call: UtilityCall) -> List[Outbound]:
    # vLLM's engine without LoRA: the executor answers an empty set
    return [u.reply(call, [] if u.lora is None else u.lora.list())]


def _u_reset_mm_cache(u: Utilities, call: UtilityCall) -> List[Outbound]:
    # the frontend clears its processor cache at the same call (vLLM's reset_mm_cache)
    if u.mm_caches is not None:
        u.mm_caches[0].clear()
    return [u.reply(call, None)]


def _u_reset_encoder_cache(u: Utilities, call: UtilityCall) -> List[Outbound]:
    if u.mm_caches is not None and u.mm_caches[1] is not None:
        u.mm_caches[1].clear()
    return [u.reply(call, None)]


#: Utility methods and their answers (docs/protocol.md §5, "recommended mock answer").
_UTILITIES: Dict[str, Handler] = {
    "get_supported_tasks": _u_supported_tasks,
    "is_sleeping": _u_is_sleeping,
    "is_scheduler_paused": _u_is_paused,
    "sleep": _u_sleep,
    "wake_up": _u_wake_up,
    "pause_generation": _u_pause_generation,
    "pause_scheduler": _u_pause_scheduler,
    "resume_scheduler": _u_resume_scheduler,
    "reset_prefix_cache": _u_reset_prefix_cache,
    "reset_mm_cache": _u_reset_mm_cache,
    "reset_encoder_cache": _u_reset_encoder_cache,
    "profile": _u_value(None),
    "execute_dummy_batch": _u_value(None),
    "get_weight_version": _u_get_weight_version,
    "set_weight_version": _u_set_weight_version,
    "list_loras": _u_list_loras,
    "gmock_stats": _u_gmock_stats,
    "add_lora": _u_add_lora,
    "remove_lora": _u_remove_lora,
    "pin_lora": _u_pin_lora,
    "collective_rpc": _u_value([]),
    "compute_weight_checksums": _u_value([]),
    "release_kv_cache_memory": _u_value(None),
    "save_sharded_state": _u_value(None),
}

SUPPORTED_UTILITIES = tuple(sorted(_UTILITIES))
