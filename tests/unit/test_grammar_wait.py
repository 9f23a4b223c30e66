"""A request's structured answer made off the engine's loop (core/grammar_wait.py):
held in WAITING_FOR_FSM, no step schedules it until its job's outcome comes
back; an ABORT meanwhile ends it and the late outcome is dropped; a compile
error or the time limit (--grammar-timeout-ms) ends it with ERROR; a spec
compiled once is not compiled again (the compile cache). The executor is a
manual one: the test decides when each job runs."""

import json

import pytest

from gmock_engine.core import grammar_wait
from gmock_engine.content import structured_output
from gmock_engine.core.request import RequestStatus
from gmock_engine.content.tokenizer import load_tokenizer
from gmock_engine.tools import model_dir
from gmock_engine.wire.inputs import AbortRequests, EngineCoreRequest, StructuredOutputsParams
from gmock_engine.wire.types import FinishReason
from engine_steps import Clock, engine_with, outputs_of, run, tokens_of

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

VOCAB = 4000
EOS = VOCAB - 1
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


class ManualExecutor(grammar_wait.GrammarExecutor):
    """Keeps each job until the test runs it (or times it out)."""

    def __init__(self):
        self.jobs = []

    def submit(self, job, timed_out, timeout_s):
        self.jobs.append((job, timed_out, timeout_s))
        return None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir.write_model_dir(tmp_path_factory.mktemp("model"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(str(model))


def add(rid, schema=SCHEMA, max_tokens=300):
    return EngineCoreRequest(rid, 4, max_tokens, True, eos_token_id=EOS, all_stop_token_ids=(EOS,),
                             structured_outputs=StructuredOutputsParams("json", json.dumps(schema)))  # fmt: skip


def plain(rid, max_tokens=5):
    return EngineCoreRequest(rid, 4, max_tokens, True)


def finish_of(sent, rid):
    return outputs_of(sent, rid)[-1][5]


def engine(model, clock=None, **kw):
    e = engine_with(clock=clock, vocab_size=VOCAB, tokenizer=str(model), **kw)
    e.grammar_executor = ManualExecutor()
    return e


def test_a_held_request_is_not_scheduled_until_its_answer_is_ready(model, tokenizer):
    e = engine(model)
    assert e.apply(add("s")) == []
    assert e.scheduler.waiting_for_fsm["s"].status is RequestStatus.WAITING_FOR_FSM
    assert e.num_active == 1 and e.scheduler.request_counts() == (0, 1)  # counted as waiting, as vLLM counts it
    e.apply(plain("p"))
    sent = run(e)  # the plain request runs to its end meanwhile; nothing of the held one
    assert finish_of(sent, "p") == FinishReason.LENGTH
    assert outputs_of(sent, "s") == [] and not e.has_work
    job, _, timeout = e.grammar_executor.jobs.pop()
    assert timeout == 30.0  # the default --grammar-timeout-ms
    assert e.apply(job()) == []  # queued now
    assert "s" not in e.scheduler.waiting_for_fsm
    sent = run(e)
    assert finish_of(sent, "s") == FinishReason.STOP
    text = tokenizer.decode([t for t in tokens_of(sent, "s") if t != EOS])
    jsonschema.validate(json.loads(text), SCHEMA)


def test_the_queued_event_has_the_time_of_the_add_and_scheduled_that_of_the_step(model):
    clock = Clock()
    e = engine(model, clock=clock)
    e.apply(add("s"))
    clock.now += 5.0  # the compile took 5 s
    e.apply(e.grammar_executor.jobs.pop()[0]())
    first = outputs_of(run(e), "s")[0]
    queued, scheduled = first[7]
    assert (queued["type"], queued["timestamp"]) == (1, 100.0)  # vLLM's queue time includes the compile
    assert (scheduled["type"], scheduled["timestamp"]) == (2, 105.0)


def test_an_abort_while_held_ends_it_and_the_late_answer_is_dropped(model):
    e = engine(model)
    e.apply(add("s"))
    sent = e.apply(AbortRequests(["s"]))
    assert finish_of(sent, "s") == FinishReason.ABORT
    assert e.num_active == 0
    old, timed_out, _ = e.grammar_executor.jobs.pop()
    # the id may come again: a new request, its own job; the old one's outcomes are not its
    e.apply(add("s"))
    assert e.apply(old()) == [] and e.apply(timed_out) == []
    assert "s" in e.scheduler.waiting_for_fsm and not e.has_work and run(e) == []
    job, _, _ = e.grammar_executor.jobs.pop()
    e.apply(job())
    assert finish_of(run(e), "s") == FinishReason.STOP


def test_a_duplicate_of_a_held_request_is_an_error(model):
    e = engine(model)
    e.apply(add("s"))
    sent = e.apply(add("s"))
    assert finish_of(sent, "s") == FinishReason.ERROR
    assert "s" in e.scheduler.waiting_for_fsm


def test_a_spec_compiled_once_is_not_compiled_again(model, tokenizer):
    e = engine(model)
    generator = structured_output.for_tokenizer(tokenizer)
    schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], unit={"enum": ["C", "F"]}))  # not compiled by another test
    before = generator.compiles
    for rid in ("a", "b"):
        e.apply(add(rid, schema))
        job, _, _ = e.grammar_executor.jobs.pop()
        e.apply(job())
        assert generator.compiles == before + 1  # the second request: a cache hit
    other = dict(schema, required=["city"])
    e.apply(add("c", other))
    e.apply(e.grammar_executor.jobs.pop()[0]())
    assert generator.compiles == before + 2
    sent = run(e)
    assert [finish_of(sent, rid) for rid in "abc"] == [FinishReason.STOP] * 3


def test_the_time_limit_ends_a_held_request_with_error(model):
    e = engine(model, grammar_timeout_s=2.0)
    e.apply(add("s"))
    job, timed_out, timeout = e.grammar_executor.jobs.pop()
    assert timeout == 2.0
    sent = e.apply(timed_out)  # the runtime's executor: the limit passed before the job ended
    assert finish_of(sent, "s") == FinishReason.ERROR
    assert "within 2000 ms (--grammar-timeout-ms)" in repr(outputs_of(sent, "s")[-1])  # the ERROR names the limit
    assert e.apply(job()) == [] and e.num_active == 0  # the job's own outcome, late: dropped


def test_a_job_that_took_longer_than_the_limit_ends_with_error(model):
    clock = Clock()

    class Slow(grammar_wait.GrammarExecutor):
        def submit(self, job, timed_out, timeout_s):
            clock.now += 3.0  # the job took 3 s
            return job()

    e = engine_with(clock=clock, vocab_size=VOCAB, tokenizer=str(model), grammar_timeout_s=2.0)
    e.grammar_executor = Slow()
    assert finish_of(e.apply(add("s")), "s") == FinishReason.ERROR
    e2 = engine_with(clock=clock, vocab_size=VOCAB, tokenizer=str(model), grammar_timeout_s=0.0)  # 0: no limit
    e2.grammar_executor = Slow()
    assert e2.apply(add("s")) == []
    assert finish_of(run(e2), "s") == FinishReason.STOP


def test_a_constraint_that_does_not_compile_ends_with_error(model):
    e = engine(model)
    e.apply(EngineCoreRequest("r", 4, 50, True, eos_token_id=EOS, structured_outputs=StructuredOutputsParams("regex", "(unclosed")))
    job, _, _ = e.grammar_executor.jobs.pop()
    sent = e.apply(job())
    assert finish_of(sent, "r") == FinishReason.ERROR and e.num_active == 0
