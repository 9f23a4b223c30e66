"""A request's structured answer made off the engine's loop, pure.

Compiling a constraint with llguidance and walking its matcher for the
answer (content/structured_output.py, content/answer.py) takes from microseconds to
seconds: a 1 MB regex or a 2 000-property schema holds a thread for about
a second. Done on the engine's loop it would hold every stream of the
process. So, as vLLM's StructuredOutputManager submits `compile_grammar` to
a thread pool and its scheduler skips a request in WAITING_FOR_FSM until
the grammar is ready, the engine (engine.py) hands the request's shaping to
a `GrammarExecutor` as a job, holds the request (Scheduler.hold: status
WAITING_FOR_FSM, no step looks at it), and queues it when a `GrammarReady`
for it comes back; an ABORT meanwhile ends it at once (the late result is
dropped), a job that raised ends it with ERROR, and one that has not
finished within `--grammar-timeout-ms` ends it with ERROR naming that
option.

The executor is injected: `InlineExecutor` here runs the job at once (unit
tests, and any caller without a loop); the runtime's runs it in a thread
(runtime/grammar_pool.py). Neither gevent nor zmq here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from gmock_engine.content import answer as content
from gmock_engine.content.tokenizer import ContentUnavailable, load_tokenizer
from gmock_engine.wire.inputs import EngineCoreRequest

#: The option that bounds a job, named in the ERROR of a request it ends.
TIMEOUT_OPTION = "--grammar-timeout-ms"


@dataclass
class GrammarReady:
    """Not a wire message: the outcome of one request's job, for
    EngineCore.apply. `request` is the engine's Request the job shaped (its
    identity tells a late outcome for an aborted request from a new request
    with the same id), `core_request` and `xargs` its ADD and checked
    vllm_xargs, `since` when it was held (engine clock); `error`: what the
    job raised (None: it is shaped); `why`: a line for the log when it gets
    none of what it asked for (content.shape's answer); `timed_out`: the
    time limit passed first."""

    request_id: str
    request: Any
    core_request: EngineCoreRequest
    xargs: Any
    since: float
    error: Optional[BaseException] = None
    why: Optional[str] = None
    timed_out: bool = False


#: A job: it shapes its request and says how it went.
Job = Callable[[], GrammarReady]


class GrammarExecutor:
    """Where the engine runs a job (the interface; `InlineExecutor` is the
    synchronous one). `submit` either returns the job's GrammarReady at
    once (it ran the job), or None and later hands EngineCore.apply exactly
    one GrammarReady for the job: the job's own, or `timed_out` after
    `timeout_s` (a job still running then goes on; its result is dropped)."""

    def submit(self, job: Job, timed_out: GrammarReady, timeout_s: Optional[float]) -> Optional[GrammarReady]:
        raise NotImplementedError


class InlineExecutor(GrammarExecutor):
    """Runs each job at once, on the caller's thread (the engine checks the
    time it took against the limit when it applies the outcome)."""

    def submit(self, job: Job, timed_out: GrammarReady, timeout_s: Optional[float]) -> Optional[GrammarReady]:
        return job()


def needs_grammar(core_request: EngineCoreRequest, xargs: Any, settings: Any) -> bool:
    """Whether shaping this request may compile a grammar, so that it is
    made off the engine's loop: a structured-output constraint, or a tool
    call for a prompt that holds tools (content/answer.py; the cheap test of
    content.prompt_tools: its `<tool_call>` marker id among the prompt's
    ids). Without --tokenizer nothing compiles (content.shape says why)."""
    if settings.tokenizer is None:
        return False
    if core_request.structured_outputs is not None:
        return True
    if not (xargs.tool_call or (xargs.tool_call is None and settings.content.tool_call_rate > 0)):
        return False
    try:
        tokenizer = load_tokenizer(settings.tokenizer)
    except ContentUnavailable:
        return False
    marker = content.markers(tokenizer).tool_call_id
    return marker is not None and marker in (core_request.prompt_token_ids or ())


def shaping_job(held: GrammarReady, settings: Any, rank: int, cap: int) -> Job:
    """The job that shapes one planned, `held` request (content.shape) off
    the loop: its GrammarReady says what it raised, if anything (a
    GrammarError for a constraint that does not compile)."""
    request, core_request, xargs = held.request, held.core_request, held.xargs

    def job() -> GrammarReady:
        try:
            why = content.shape(request, core_request, xargs, settings, rank, cap)
        except Exception as exc:  # noqa: BLE001 - handed back: the engine ends this request with it
            return replace(held, error=exc)
        return replace(held, why=why)

    return job


def timeout_message(timeout_s: float) -> str:
    """The ERROR text of a request whose job passed the limit."""
    return (f"the structured output's grammar was not compiled and its answer not made within {timeout_s * 1000:g} ms "
            f"({TIMEOUT_OPTION})")  # fmt: skip
