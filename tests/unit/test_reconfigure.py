"""How a running engine takes a reload, without sockets: EngineCore.reconfigure
(between two steps), the fault decider carried over (faults.Faults) and the
fault layer rebuilt (fault_injection.build)."""

import pytest
from loguru import logger

from gmock_engine.runtime import fault_injection
from gmock_engine.core.engine import RELOADABLE_SETTINGS, EngineSettings
from gmock_engine.faults.specs import Faults, parse_spec
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.content.lengths import OutputLengths
from gmock_engine.content.tokens import EchoTokens, RandomTokens
from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.types import FinishReason
from engine_steps import Clock, engine_with, run, run_steps, tokens_of


def test_the_reloadable_settings_are_engine_settings_and_the_fixed_ones_are_not():
    assert set(RELOADABLE_SETTINGS) <= set(EngineSettings.__dataclass_fields__)
    for fixed in ("rank", "num_clients", "vocab_size", "seed", "kv_blocks", "block_size", "layout", "output_token_chunk_size"):
        assert fixed not in RELOADABLE_SETTINGS


# -- the engine takes it between steps ------------------------------------------------------


def make(**kw):
    return engine_with(Clock(0.0), **kw)


def add(rid, max_tokens=8, prompt=(1, 2, 3), **kw):
    return EngineCoreRequest(
        request_id=rid, prompt_len=len(prompt), max_tokens=max_tokens, has_sampling_params=True,
        prompt_token_ids=list(prompt), **kw,
    )  # fmt: skip


def test_latency_applies_from_the_next_step_and_back_to_unpaced():
    engine = make()
    engine.apply(add("a", max_tokens=100))
    run_steps(engine, 2)
    assert engine.next_step_time(1.0) == 1.0  # unpaced: back to back
    engine.reconfigure(EngineSettings(rank=0, num_clients=1, latency=LatencyModel(itl_ms=20)))
    assert engine.next_step_time(1.0) == pytest.approx(1.02)  # the very next step is paced
    run_steps(engine, 1)
    assert engine.step_delay == pytest.approx(0.02)
    engine.reconfigure(EngineSettings(rank=0, num_clients=1))
    assert engine.step_delay == 0.0 and engine.next_step_time(1.0) == 1.0


def test_a_new_token_source_is_for_new_requests_and_a_running_stream_stays_exact():
    engine = make()
    engine.apply(add("old", max_tokens=10, prompt=(7, 8, 9)))
    sent = run_steps(engine, 4)
    engine.reconfigure(EngineSettings(rank=0, num_clients=1, token_source=EchoTokens()))
    engine.apply(add("new", max_tokens=5, prompt=(7, 8, 9)))
    sent += run(engine)
    expected, _ = RandomTokens(32000, 0, 0).draw(RandomTokens(32000, 0, 0).initial_state("old"), 10)
    assert tokens_of(sent, "old") == expected  # as if nothing had happened
    assert tokens_of(sent, "new") == [7, 8, 9, 7, 8]


def test_the_same_token_source_keeps_the_sampler_so_running_requests_stay_on_the_fast_path():
    source = RandomTokens(32000, 0, 0)
    engine = make(token_source=source)
    engine.apply(add("a"))
    sampler = engine.scheduler.sampler
    engine.reconfigure(EngineSettings(rank=0, num_clients=1, token_source=source, latency=LatencyModel(itl_ms=1)))
    assert engine.scheduler.sampler is sampler
    engine.reconfigure(EngineSettings(rank=0, num_clients=1, token_source=source, logprobs_top1=0.9))
    assert engine.scheduler.sampler is not sampler and engine.scheduler.logprob_model.top1 == 0.9


def test_output_lengths_are_planned_for_new_requests_only():
    engine = make()
    engine.apply(add("before", max_tokens=20, eos_token_id=2))
    engine.reconfigure(EngineSettings(rank=0, num_clients=1, output_lengths=OutputLengths.parse("fixed:3")))
    engine.apply(add("after", max_tokens=20, eos_token_id=2))
    sent = run(engine)
    assert len(tokens_of(sent, "before")) == 20 and len(tokens_of(sent, "after")) == 3
    ends = {o[0]: o[5] for _, m in sent for o in m[1] if len(o) > 5 and o[5] is not None}
    assert ends == {"before": FinishReason.LENGTH, "after": FinishReason.STOP}


def test_a_tighter_batch_limit_admits_nothing_until_below_it_and_preempts_nobody():
    engine = make()
    for i in range(4):
        engine.apply(add(f"r{i}", max_tokens=4 + i))
    run_steps(engine, 1)
    engine.reconfigure(EngineSettings(rank=0, num_clients=1, max_num_seqs=2))
    for i in range(4, 6):
        engine.apply(add(f"r{i}", max_tokens=50))
    running = []
    while engine.has_work:
        engine.step()
        running.append(sorted(engine.active))
    # the four go on (nobody is preempted); a newcomer is admitted only below the limit
    assert running[0] == ["r0", "r1", "r2", "r3"] and engine.counters["preemptions"] == 0
    first_new = next(i for i, ids in enumerate(running) if "r4" in ids)
    # only once the batch is below 2 again: in the step whose outputs end r2
    # (vLLM frees a finished request's slot before it schedules the next step)
    assert running[first_new - 1] == ["r2", "r3"] and running[first_new] == ["r3", "r4"]
    assert all(len(ids) <= 2 for ids in running[first_new - 1 :]) and ["r4", "r5"] in running


def test_a_lifted_token_budget_finishes_the_chunked_prefills():
    engine = make(max_num_batched_tokens=8)
    engine.apply(add("long", max_tokens=3, prompt=list(range(100))))
    run_steps(engine, 2)  # 16 of 100 prompt tokens prefilled
    assert engine.scheduler.chunking
    engine.reconfigure(EngineSettings(rank=0, num_clients=1))
    sent = run_steps(engine, 10)
    assert not engine.scheduler.chunking and len(tokens_of(sent, "long")) == 3 and not engine.has_work


# -- the fault layer, rebuilt ------------------------------------------------------------


def specs(*pairs):
    return [parse_spec(kind, text) for kind, text in pairs]


def test_an_unchanged_spec_goes_on_a_changed_one_starts_afresh_and_the_totals_carry_over():
    before = Faults(specs(("drop-finish", "every=3"), ("error-mid-stream", "every=2 limit=1")), rank=0, seed=0)
    fired = [[s.kind for s in before.on_request(0.0)] for _ in range(4)]
    assert fired == [[], ["error-mid-stream"], ["drop-finish"], []]  # the 4th: limit=1 used up
    after = Faults(specs(("drop-finish", "every=3"), ("error-mid-stream", "every=2 limit=2")), 0, 0, before, now=10.0)
    # drop-finish goes on counting (its 6th occasion fires); error-mid-stream starts again (and its limit)
    fired = [[s.kind for s in after.on_request(10.0)] for _ in range(4)]
    assert fired == [[], ["drop-finish", "error-mid-stream"], [], ["error-mid-stream"]]
    assert after.injected == {"error-mid-stream": 3, "drop-finish": 2}  # totals, never back


def test_a_new_at_counts_from_the_reload_and_an_unchanged_one_from_the_join():
    before = Faults(specs(("hang", "at=60")), rank=0, seed=0)
    before.joined(100.0)
    after = Faults(specs(("hang", "at=60"), ("stall-outputs", "at=60")), 0, 0, before, now=130.0)
    assert [(due, s.kind) for due, s in after.timed()] == [(160.0, "hang"), (190.0, "stall-outputs")]


class Hands:
    def __init__(self):
        self.spawned = []

    def spawn(self, name, func, *args):
        self.spawned.append(name)

    def put(self, item):
        pass

    def vanish(self):
        raise SystemExit("vanished")


def rebuild(previous, *pairs, now=0.0, engine=None, hands=None):
    hands = hands or Hands()
    hooks = fault_injection.RuntimeHooks(0, logger, hands.spawn, hands.put, hands.vanish)
    return fault_injection.build(specs(*pairs), 0, hooks, previous=previous, now=now, engine=engine)


def test_rebuild_keeps_the_gates_and_what_is_under_way():
    hands = Hands()
    layer, _ = fault_injection.build(specs(("drop-finish", "every=1")), 0, fault_injection.RuntimeHooks(0, logger, hands.spawn, hands.put, hands.vanish))
    layer.joined(object(), 0.0)
    layer.on_input(EngineCoreRequest("marked", 3, 4, True))
    assert "marked" in layer.marked
    # the fault is turned off, but the request it marked still loses its finish
    new, timer = rebuild(layer, engine=object())
    assert isinstance(new, fault_injection.FaultInjector) and new.marked is layer.marked and timer is None
    assert new.flowing is layer.flowing and new.outputs_flowing is layer.outputs_flowing
    # nothing under way and nothing configured: the null object again, with the same gates
    new.marked.clear()
    quiet, timer = rebuild(new)
    assert isinstance(quiet, fault_injection.NoFaults) and quiet.flowing is layer.flowing and timer is None
    assert quiet.faults.injected == {"drop-finish": 1}


def test_rebuild_from_no_faults_turns_faults_on_and_gives_the_timer_of_the_timed_ones():
    hands = Hands()
    layer, _ = fault_injection.build([], 0, fault_injection.RuntimeHooks(0, logger, hands.spawn, hands.put, hands.vanish))
    new, timer = rebuild(layer, ("error-mid-stream", "every=1"), ("hang", "at=5 duration=1s"), now=50.0, engine=object())
    assert isinstance(new, fault_injection.FaultInjector) and timer is not None
    assert new.flowing is layer.flowing
    assert [(due, s.kind) for due, s in new.faults.timed()] == [(55.0, "hang")]
    request, _ = new.on_input(EngineCoreRequest("r", 3, 10, True))
    assert request.extra_args["mock_fail_after"] == 5
