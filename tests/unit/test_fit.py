"""The fit (tools/fit.py, tools/steps.py) on traces of a known model.

The traces come from the engine itself on a virtual clock, timed by a
profile whose values the test knows: the steps read back from the trace
must be the steps the engine timed, and the fit must recover the profile.
That ties the fit's definitions of a step's composition to the engine's.
"""

import dataclasses
import json
import random
import sys
from pathlib import Path

import msgpack
import pytest

from gmock_engine.timing.latency import LatencyModel
from gmock_engine.timing.profile import NEW_MAX, NEW_SIZE, STEADY, StepProfile, format_profile, read_profile
from gmock_engine.tools import fit as fitting
from gmock_engine.tools.steps import Step, steps_from_trace
from gmock_engine.timing.trace import header, output_record
from gmock_engine.wire.inputs import EngineCoreRequest
from engine_steps import Clock, engine_with

TRUE = StepProfile(
    batch=(1, 2, 4, 8, 16),
    step_ms=(5.0, 5.6, 6.5, 9.0, 14.0),
    prefill_ms_per_token=0.03,
    prefill_attention_ms=0.02,
    prefill_ms_per_request=1.5,
    context_ms_per_ktoken=0.08,
)


class Recorder:
    """The engine's latency model, recording what each step was timed from."""

    def __init__(self, model):
        self._model = model
        self.timed = []
        self.novelty = []
        #: the engine clock of each step timed
        self.starts = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def step_time(self, plan, rng, context_tokens=0, sizes=None):
        self.timed.append((plan.num_running_reqs, plan.num_prefill_tokens, plan.prefill_attention, context_tokens, plan.num_prefill_reqs))
        seen, largest = (len(sizes.seen), sizes.largest) if sizes is not None else (0, 0)
        seconds = self._model.step_time(plan, rng, context_tokens, sizes)
        # the step's novelty as the engine's sizes changed: a new one, a new largest one
        grew = sizes is not None and len(sizes.seen) > seen
        self.novelty.append(NEW_MAX if grew and sizes.largest > largest else NEW_SIZE if grew else STEADY)
        return seconds


def workload(n, seed, max_prompt=1024, rates=(3.0, 12.0, 30.0), prompts=()):
    """`n` requests in phases of Poisson arrivals at each of `rates` (per s):
    batches from 1 to about 16; prompts of 8..`max_prompt` tokens, or of the
    lengths `prompts` (steps of a size then recur, as in a benchmark's)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rates[i * len(rates) // n])
        prompt = rng.choice(prompts) if prompts else rng.randint(8, max_prompt)
        out.append((t, f"r{i}", prompt, rng.randint(4, 64)))
    return out


def simulate(profile, arrivals, seed=0, reader_lag=0.0, shared_prefix=0, **settings):
    """Run the engine with `profile` over `arrivals` (t, id, prompt_len,
    max_tokens) on a virtual clock; return (trace records, recorder).
    `reader_lag`: an ADD that arrives this little before a step reaches the
    engine after it (its reader greenlet had not run yet), as over sockets.
    `shared_prefix`: the prompts carry token ids, the first that many the
    same in all (with prefix caching: hits, also for a preempted request)."""
    clock = Clock(0.0)
    engine = engine_with(clock, latency=LatencyModel(profile=profile), seed=seed, **settings)
    recorder = Recorder(engine.scheduler.latency)
    engine.scheduler.latency = recorder
    records, pending = [], list(arrivals)
    due = last_call = None
    for _ in range(200000):
        if not pending and not engine.has_work:
            return records, recorder
        if pending and (due is None or pending[0][0] <= due - reader_lag):
            t, rid, prompt_len, max_tokens = pending.pop(0)
            clock.now = max(clock.now, t)
            ids = None
            if shared_prefix:
                ids = [7 + i % 97 for i in range(min(shared_prefix, prompt_len))]
                ids += [1000 + (7919 * len(records) + i) % 30000 for i in range(prompt_len - len(ids))]
            engine.apply(EngineCoreRequest(rid, prompt_len, max_tokens, True, prompt_token_ids=ids))
            records.append({"kind": "add", "t": t, "rank": 0, "client": 0, "request_id": rid,
                            "prompt_len": prompt_len, "max_tokens": max_tokens})
            if due is None:
                due = clock.now
            continue
        clock.now = max(clock.now, due)
        started = clock.now
        timed = len(recorder.timed)
        # this step call ends a step of the engine if the last one timed the gap up to it
        ended = bool(recorder.starts) and recorder.starts[-1] == last_call and recorder.timed[-1][0] > 0
        last_call = started
        sent = engine.step()
        if len(recorder.timed) > timed:
            recorder.starts.append(started)
        for client, message in sent:
            records.append(output_record(clock.now, 0, client, [msgpack.packb(message, use_bin_type=True)]))
        if not sent and ended:  # a real engine sends its SchedulerStats every step, tokens or not
            records.append({"kind": "output", "t": clock.now, "rank": 0, "client": 0, "engine_timestamp": clock.now,
                            "requests": [], "finished_requests": None, "stats": {}})
        due = engine.next_step_time(started) if engine.has_work else None
    raise AssertionError("simulation did not end")


@pytest.mark.parametrize(
    "budget, reader_lag, async_scheduling",
    [(None, 0.0, False), (2048, 0.0, False), (2048, 0.002, False), (2048, 0.002, True), (512, 0.002, False)],
)
def test_steps_read_back_are_the_steps_the_engine_timed(budget, reader_lag, async_scheduling):
    """With a token budget a prompt's place matters (the read-back splits it
    into chunks by the budget), and over sockets an ADD that came just
    before a step is scheduled only in the next: its SCHEDULED stamp is then
    the instant the step sent its outputs, and its prompt is the next step's;
    an engine that schedules a step ahead runs it in the step after that."""
    # a new-size spread of 1: the engine tracks its step sizes, the times are TRUE's
    settings = {} if budget is None else {"max_num_batched_tokens": budget}
    profile = dataclasses.replace(TRUE, spread_new_size=(1.0, 1.0))
    records, recorder = simulate(profile, workload(120, seed=1), reader_lag=reader_lag, async_scheduling=async_scheduling, **settings)
    steps = steps_from_trace(records, max_num_batched_tokens=budget, ahead=async_scheduling)
    # a step read back spans the engine's gap from one step of its own to the
    # next, which sent that step's tokens: the engine timed the gap from the plan
    # it made when the gap began
    assert {NEW_SIZE, NEW_MAX} <= set(recorder.novelty)
    assert len(steps) > 300
    _assert_read_back_as_timed(steps, recorder)


def _assert_read_back_as_timed(steps, recorder):
    """Every step read back is one the engine timed, with its composition."""
    timed = {round(t, 9): c for t, c in zip(recorder.starts, recorder.timed)}
    novelty = {round(t, 9): n for t, n in zip(recorder.starts, recorder.novelty)}
    checked = 0
    for step in steps:
        expected = timed.get(round(step.start, 9))
        if expected is None:
            continue
        assert (step.batch, step.prefill_tokens, step.context_tokens, step.prefill_reqs) == (expected[0], expected[1], expected[3], expected[4]), step
        assert step.novelty == novelty[round(step.start, 9)], step
        assert step.prefill_attention == pytest.approx(expected[2])
        assert step.duration_ms == pytest.approx(TRUE.predict_ms(*expected), rel=1e-6)
        checked += 1
    assert checked == len(steps)


def _events(records, kind):
    return [e for r in records if r.get("kind") == "output" for item in r["requests"] for e in item.get("events") or () if e[0] == kind]


@pytest.mark.parametrize("blocks, caching", [(60, False), (40, True)], ids=["recompute", "recompute-with-cache-hits"])
def test_a_preempted_request_is_read_back_as_computed_again(blocks, caching):
    """Under KV pressure the engine preempts the newest request and later
    computes its tokens so far again as a prompt, less the blocks the
    prefix cache still holds for it (counted in SchedulerStats as
    preempted_hits): the read-back places that recomputation as prefill in
    the steps the engine timed it in, and leaves the request out of the
    batch while it waits."""
    profile = dataclasses.replace(TRUE, spread_new_size=(1.0, 1.0))
    records, recorder = simulate(
        profile, workload(150, seed=3, max_prompt=300, rates=(20.0, 60.0)), reader_lag=0.002,
        shared_prefix=64 if caching else 0, max_num_batched_tokens=512, kv_blocks=blocks, num_gpu_blocks=blocks,
        prefix_caching=caching,
    )
    assert len(_events(records, 3)) >= 20  # PREEMPTED
    resume_hits = sum(r["stats"]["prefix_cache"]["preempted_hits"] for r in records
                      if r.get("kind") == "output" and (r.get("stats") or {}).get("prefix_cache"))
    assert (resume_hits > 1000) == caching
    steps = steps_from_trace(records, max_num_batched_tokens=512, ahead=False)
    assert len(steps) > 1000
    _assert_read_back_as_timed(steps, recorder)


@pytest.mark.parametrize("arrivals, budget", [(workload(120, seed=1), 2048), (workload(60, seed=5, rates=(100.0,)), 512)],
                         ids=["steady", "most-prompts-chunked"])  # fmt: skip
def test_the_first_tokens_say_whether_the_engine_scheduled_a_step_ahead(arrivals, budget):
    """Read as if it scheduled each step as the one before ended, a trace of
    an engine that scheduled a step ahead puts many prompts a step early;
    its first tokens come two steps after the boundary they were scheduled
    at, one without (a chunked prompt's later: those are left out), which
    the read-back and the fit go by unless told."""
    from gmock_engine.tools.steps import schedules_ahead, scheduling_lags

    profile = dataclasses.replace(TRUE, spread_new_size=(1.0, 1.0))
    for async_scheduling in (False, True):
        records, recorder = simulate(profile, arrivals, reader_lag=0.002, async_scheduling=async_scheduling, max_num_batched_tokens=budget)
        lags = scheduling_lags(records, budget)
        assert schedules_ahead(lags) is async_scheduling, lags
        read = steps_from_trace(records, max_num_batched_tokens=budget)  # as the first tokens say
        assert read == steps_from_trace(records, max_num_batched_tokens=budget, ahead=async_scheduling)
        if budget == 2048:  # rarely binding; where a budget binds, an engine that schedules ahead counts the requests ending in a step, the read-back not
            timed = {round(t, 9): c[1] for t, c in zip(recorder.starts, recorder.timed)}
            assert all(timed[round(s.start, 9)] == s.prefill_tokens for s in read)
            read_sync = steps_from_trace(records, max_num_batched_tokens=budget, ahead=False)
            wrong = [s for s in read_sync if timed[round(s.start, 9)] != s.prefill_tokens]
            assert bool(wrong) is async_scheduling and len(wrong) < 200


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_slot_admissions_say_at_which_step_end_a_waiting_request_got_a_freed_slot(async_scheduling):
    """Two slots, eight requests at once: the six that wait each get a slot
    a finish freed, decided at that step end (scheduling a step ahead, for
    the step after the next: the first token says that, not the SCHEDULED
    event)."""
    from gmock_engine.tools.steps import slot_admissions

    arrivals = [(0.0, f"r{i}", 64, 3 + i % 3) for i in range(8)]
    records, _ = simulate(TRUE, arrivals, max_num_seqs=2, async_scheduling=async_scheduling)
    assert slot_admissions(records) == {"with a finish": 6, "a step after one": 0, "other": 0}


def test_fit_reads_an_engine_that_scheduled_ahead_and_says_so(tmp_path, capsys):
    """`./run.sh fit` on the trace of an engine that scheduled a step ahead
    recovers its profile and writes the hint to serve with --async-scheduling."""
    records, _ = simulate(TRUE, workload(300, seed=5), reader_lag=0.002, async_scheduling=True, max_num_batched_tokens=2048)
    path = tmp_path / "async.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [header(ranks=[0])] + records) + "\n")
    out = tmp_path / "profile.ini"
    assert fitting.main([str(path), "--max-num-batched-tokens", "2048", "--model", "table", "-o", str(out)]) == 0
    assert "read as async scheduling" in capsys.readouterr().out
    text = out.read_text()
    assert "serve with --async-scheduling" in text
    p = read_profile(str(out))
    assert p.prefill_ms_per_token == pytest.approx(TRUE.prefill_ms_per_token, rel=0.15)
    assert p.batch_ms(4) == pytest.approx(TRUE.batch_ms(4), rel=0.05)


def test_fit_recovers_the_profile_and_prefers_the_table():
    records, _ = simulate(TRUE, workload(300, seed=2))
    result = fitting.fit(steps_from_trace(records))
    assert result.chosen == "table"
    p = result.profile
    for b in (1, 2, 4, 8):
        assert p.batch_ms(b) == pytest.approx(TRUE.batch_ms(b), rel=0.03), b
    assert p.prefill_ms_per_token == pytest.approx(TRUE.prefill_ms_per_token, rel=0.05)
    assert p.prefill_attention_ms == pytest.approx(TRUE.prefill_attention_ms, rel=0.05)
    assert p.prefill_ms_per_request == pytest.approx(TRUE.prefill_ms_per_request, rel=0.05)
    assert p.context_ms_per_ktoken == pytest.approx(TRUE.context_ms_per_ktoken, rel=0.1)
    # no noise in the engine: the spread is a point at 1
    for q in p.spread_decode:
        assert q[0] == pytest.approx(1.0, abs=0.01) and q[-1] == pytest.approx(1.0, abs=0.01)


def test_fit_prices_the_steps_of_new_sizes_apart():
    # an engine whose first step of a size takes twice its time, and a step
    # larger than any before six times, as vLLM's CPU backend, which builds
    # its kernels per token count and grows its buffers
    truth = dataclasses.replace(TRUE, spread_new_size=(2.0, 2.0), spread_new_max=(6.0, 6.0))
    records, recorder = simulate(truth, workload(300, seed=2, prompts=(100, 300, 700)))
    assert 30 < sum(1 for n in recorder.novelty if n) < 0.2 * len(recorder.novelty)
    assert recorder.novelty.count(NEW_MAX) >= fitting.MIN_NEW_SIZE_STEPS
    steps = steps_from_trace(records)
    result = fitting.fit(steps)
    p = result.profile
    assert fitting.quantile(p.spread_new_size, 0.5) == pytest.approx(2.0, rel=0.05), result.report
    assert fitting.quantile(p.spread_new_max, 0.5) == pytest.approx(6.0, rel=0.05), result.report
    # the other steps are priced as if there were no such cost: the slow
    # steps are neither in the coefficients nor in the spreads
    errors = sorted(abs(e) for e in fitting.relative_errors(p, [s for s in steps if not s.novelty]))
    assert fitting.quantile(errors, 0.9) < 0.02, fitting.summary(errors)
    for q in p.spread_decode + p.spread_prefill:
        assert q[-1] == pytest.approx(1.0, abs=0.02)
    assert any("chosen: apart" in line for line in result.report), result.report
    assert any("a spread each" in line for line in result.report), result.report
    # factors for the new sizes; the few new largest ones are not compared
    assert [line.split(":")[0] for line in result.report if "chosen: factors" in line] == ["spread_new_size"], result.report


def test_new_largest_sizes_share_the_spread_when_they_cost_the_same():
    truth = dataclasses.replace(TRUE, spread_new_size=(1.5, 2.5))
    records, _ = simulate(truth, workload(300, seed=2, prompts=(100, 300, 700)))
    result = fitting.fit(steps_from_trace(records))
    assert result.profile.spread_new_max == () and fitting.quantile(result.profile.spread_new_size, 0.5) == pytest.approx(2.0, rel=0.1)
    assert any("one spread" in line for line in result.report), result.report


def test_a_new_size_cost_of_fixed_ms_is_fitted_as_ms_added():
    # an engine whose first step of a size takes 8 ms more whatever its size
    # (building a kernel for a new token count): twice a short decode step's
    # time, a small part of a long prefill's, so no factor fits it
    truth = dataclasses.replace(TRUE, spread_new_size_ms=(8.0, 8.0))
    records, recorder = simulate(truth, workload(300, seed=2, prompts=(100, 300, 700)))
    assert sum(1 for n in recorder.novelty if n) >= 2 * fitting.MIN_NEW_SIZE_STEPS
    result = fitting.fit(steps_from_trace(records))
    p = result.profile
    assert p.spread_new_size == () and p.spread_new_max == () and p.spread_new_max_ms == (), result.report
    assert fitting.quantile(p.spread_new_size_ms, 0.5) == pytest.approx(8.0, abs=0.4), result.report
    assert any("spread_new_size: held-out" in line and "chosen: ms added" in line for line in result.report), result.report


def test_rank_z_says_which_sample_is_larger():
    low, high = [1.0, 1.1, 1.2, 1.3] * 5, [2.0, 3.0, 4.0] * 3
    assert fitting.rank_z(high, low) > 4 and fitting.rank_z(low, high) < -4
    assert fitting.rank_z(low, low) == pytest.approx(0.0) and fitting.rank_z([], low) == 0.0


def test_an_engine_without_a_new_size_cost_keeps_its_first_steps_in_the_spreads():
    noisy = dataclasses.replace(TRUE, spread_decode=(tuple(0.8 + 0.04 * i for i in range(11)),))
    records, _ = simulate(noisy, workload(300, seed=2, prompts=(100, 300, 700)))
    result = fitting.fit(steps_from_trace(records))
    assert result.profile.spread_new_size == () and result.profile.spread_new_max == ()
    assert any("chosen: with the others" in line for line in result.report), result.report


def test_fit_recovers_the_spread():
    spread = tuple(0.8 + 0.4 * i / 10 for i in range(11))  # uniform on [0.8, 1.2]
    noisy = StepProfile(TRUE.batch, TRUE.step_ms, TRUE.prefill_ms_per_token, TRUE.prefill_attention_ms,
                        TRUE.context_ms_per_ktoken, spread_decode=(spread,), spread_prefill=(spread,))
    records, _ = simulate(noisy, workload(300, seed=3))
    result = fitting.fit(steps_from_trace(records))
    p = result.profile
    for b in (2, 4):  # the table's shape
        assert p.batch_ms(b) / p.batch_ms(1) == pytest.approx(TRUE.batch_ms(b) / TRUE.batch_ms(1), rel=0.06), b
    # what the engine draws, prediction x spread, is the engine's own distribution
    # (101 points: q[5] is the 5 % quantile, q[95] the 95 %)
    q = p.spread_decode[0]  # the set that batch 1 draws from (the first bin, if the fit made bins)
    for i, expected in ((5, 0.82), (50, 1.0), (95, 1.18)):
        assert p.batch_ms(1) * q[i] == pytest.approx(TRUE.batch_ms(1) * expected, rel=0.03), i


def test_a_linear_engine_is_fitted_as_linear_figures():
    linear = StepProfile(batch=(1, 2), step_ms=(6.0, 6.5), prefill_ms_per_token=0.05)
    records, _ = simulate(linear, workload(200, seed=4, max_prompt=512))
    result = fitting.fit(steps_from_trace(records), model="linear")
    p = result.profile
    assert p.batch_ms(1) == pytest.approx(6.0, rel=0.02) and p.batch_ms(9) == pytest.approx(10.0, rel=0.02)
    assert p.prefill_ms_per_token == pytest.approx(0.05, rel=0.03)


def test_the_context_is_priced_from_within_runs_not_across_a_drifting_recording():
    """Short prompts first, then long ones on a machine that has grown 1 ms
    a step slower (the reference engine drifts so between workloads minutes
    apart): across the recording the context goes with the drift, and a
    slope fitted across it prices 1 000 tokens held several times as high as
    the engine does. Within each run of decode steps of one batch only the
    context grows, and its slope is the engine's."""
    short, _ = simulate(TRUE, workload(150, seed=7, max_prompt=96))
    long, _ = simulate(TRUE, workload(150, seed=8, prompts=(900, 1000)))
    early = steps_from_trace(short)
    shift = early[-1].end + 5.0
    late = [dataclasses.replace(s, start=s.start + shift, end=s.end + shift + 0.001) for s in steps_from_trace(long)]
    steps = early + late
    assert fitting.context_slope(steps) == pytest.approx(TRUE.context_ms_per_ktoken, rel=0.1)
    table = fitting.CANDIDATES[2]
    assert fitting.fit_candidate(table, steps).context_ms_per_ktoken == pytest.approx(TRUE.context_ms_per_ktoken, rel=0.1)


def test_decode_runs_break_at_a_prefill_a_gap_another_batch_or_another_engine():
    def step(start, batch=4, prefill=0, rank=0, context=1000):
        return Step(rank=rank, start=start, end=start + 0.01, batch=batch, decode=batch, prefill_tokens=prefill,
                    prefill_attention=0.0, context_tokens=context, woke=False)  # fmt: skip

    n = fitting.MIN_RUN_STEPS
    t = [0.01 * i for i in range(6 * n)]
    steps = [step(t[i], context=1000 + i) for i in range(n)]  # a run
    steps.append(step(t[n], prefill=64))  # a prefill ends it
    steps += [step(t[n + 1 + i]) for i in range(n)]  # a run
    steps += [step(t[2 * n + 1 + i] + 1.0) for i in range(n - 1)]  # after a gap: too short
    steps += [step(t[3 * n + i] + 1.0, batch=5) for i in range(n)]  # another batch: a run
    steps += [step(t[4 * n + i] + 1.0, rank=i % 2) for i in range(n)]  # engines alternate: none
    assert [len(r) for r in fitting.decode_runs(steps)] == [n, n, n]


def test_chunked_prefill_is_placed_within_the_token_budget():
    records, recorder = simulate(TRUE, workload(60, seed=5, rates=(100.0,)), max_num_batched_tokens=512)
    steps = steps_from_trace(records, max_num_batched_tokens=512)
    assert max(s.prefill_tokens for s in steps) <= 512
    assert sum(s.prefill_tokens for s in steps) == sum(c[1] for c in recorder.timed)
    result = fitting.fit(steps)
    assert result.profile.prefill_ms_per_token == pytest.approx(TRUE.prefill_ms_per_token, rel=0.15)


def test_too_few_steps_is_an_error():
    records, _ = simulate(TRUE, workload(1, seed=6))
    with pytest.raises(ValueError, match="too few"):
        fitting.fit(steps_from_trace(records))


def test_nnls_keeps_coefficients_non_negative():
    rows = [[1.0, float(x)] for x in range(10)]
    ys = [5.0 - 0.1 * x for x in range(10)]  # a falling line: the slope would be negative
    a, b = fitting.nnls(rows, ys, [1.0] * 10)
    assert b == 0.0 and a == pytest.approx(sum(ys) / len(ys))


def test_engine_clock_times_steps_and_the_input_delay():
    """The engine's stamps time the steps (the tap's receive times lag); its
    QUEUED event against the relayed ADD gives the input delay."""
    from gmock_engine.tools.steps import input_delays_ms

    # engine clock = tap clock - 5 s; outputs reach the tap 0.1 ms late, the second 40 ms late
    records = [
        {"kind": "add", "t": 10.000, "rank": 0, "client": 0, "request_id": "a", "prompt_len": 64, "max_tokens": 2},
        {"kind": "output", "t": 10.0101, "rank": 0, "client": 0, "engine_timestamp": 5.010, "finished_requests": None,
         "requests": [{"id": "a", "tokens": 1, "finish_reason": None, "events": [[1, 5.002], [2, 5.0025]]}]},
        {"kind": "output", "t": 10.0540, "rank": 0, "client": 0, "engine_timestamp": 5.014, "finished_requests": ["a"],
         "requests": [{"id": "a", "tokens": 1, "finish_reason": 1}]},
    ]
    first, second = steps_from_trace(records)
    assert first.woke and first.duration_ms == pytest.approx(7.5)  # from SCHEDULED, on the engine clock
    assert (first.batch, first.prefill_tokens, second.batch, second.decode) == (1, 64, 1, 1)
    assert second.duration_ms == pytest.approx(4.0)  # not the 43.9 ms between the receive times
    assert input_delays_ms(records) == [pytest.approx(2.1)]


def _add(t, rid, prompt_len, max_tokens=1):
    return {"kind": "add", "t": t, "rank": 0, "client": 0, "request_id": rid, "prompt_len": prompt_len, "max_tokens": max_tokens}


def _output(engine_t, items, finished=None):
    """Engine clock = tap clock - 5 s; relayed 0.1 ms late."""
    return {"kind": "output", "t": engine_t + 5.0001, "rank": 0, "client": 0, "engine_timestamp": engine_t,
            "finished_requests": finished, "requests": items}  # fmt: skip


def _first(rid, queued, scheduled, finish=None):
    return {"id": rid, "tokens": 1, "finish_reason": finish, "events": [[1, queued], [2, scheduled]]}


def test_an_add_seen_before_the_last_step_ended_starts_the_next_one_when_scheduled():
    """A real engine: `b`'s ADD passes the tap while the step that ends `a`
    runs and is scheduled after it; the engine is idle in between, and the
    step that prefills `b` is timed from its SCHEDULED event."""
    records = [
        _add(10.000, "a", 64),
        _output(5.010, [_first("a", 5.0005, 5.001, finish=1)], finished=["a"]),
        _add(10.0095, "b", 64),  # before a's step ended (10.0101 at the tap)
        _output(5.030, [_first("b", 5.0102, 5.0103, finish=1)], finished=["b"]),
    ]
    first, second = steps_from_trace(records, max_num_batched_tokens=2048)
    assert (second.batch, second.prefill_tokens, second.woke) == (1, 64, True)
    assert second.duration_ms == pytest.approx(19.7)


def test_the_mocks_order_places_each_prompt_in_the_step_that_computed_it():
    """The mock schedules at a step boundary before it stamps the outputs of
    the step that ended there (a real engine after): a SCHEDULED event just
    before a step's end belongs to the step after it. `b` is scheduled while
    `a` decodes, `c` at the boundary where `a` ends; each prompt is computed
    whole in the step that ends with its first token."""
    records = [
        _add(10.000, "a", 64, max_tokens=2),
        _output(5.010, [_first("a", 5.0005, 5.001)]),
        _add(10.0099, "b", 256),  # reached the engine after its step at 5.0099 had scheduled
        _output(5.020, [{"id": "a", "tokens": 1, "finish_reason": 1}], finished=["a"]),  # scheduled b at 5.0199 first
        _output(5.030, [_first("b", 5.0100, 5.0199, finish=1)], finished=["b"]),
        _add(10.0395, "c", 128),
        _output(5.050, [_first("c", 5.0396, 5.0399, finish=1)], finished=["c"]),
    ]
    steps = steps_from_trace(records, max_num_batched_tokens=2048)
    by_end = {round(s.end - 10.0001, 4): (s.batch, s.decode, s.prefill_tokens) for s in steps}  # on the tap clock
    assert by_end[0.02] == (1, 1, 0)  # a's second token; b not yet
    assert by_end[0.03] == (1, 0, 256)
    assert by_end[0.05] == (1, 0, 128)
    assert [s.duration_ms for s in steps if s.prefill_tokens == 256] == [pytest.approx(10.0)]


def test_the_input_delay_counts_only_requests_that_found_the_engine_idle():
    """An ADD that comes while another request runs waits for the step in
    progress before the engine queues it: that wait is the scheduler's (the
    mock admits at a step boundary), not the input path's, so it is left out."""
    from gmock_engine.tools.steps import input_delays_ms

    def output(t, engine_t, items, finished=None):
        return {"kind": "output", "t": t, "rank": 0, "client": 0, "engine_timestamp": engine_t,
                "finished_requests": finished, "requests": items}  # fmt: skip

    def add(t, rid):
        return {"kind": "add", "t": t, "rank": 0, "client": 0, "request_id": rid, "prompt_len": 64, "max_tokens": 2}

    # engine clock = tap clock - 5 s, outputs relayed 0.1 ms late
    records = [
        add(10.000, "a"),  # idle engine: 1 ms to QUEUED
        output(10.0101, 5.010, [{"id": "a", "tokens": 1, "finish_reason": None, "events": [[1, 5.001], [2, 5.001]]}]),
        add(10.100, "b"),  # a still runs: QUEUED only when its step ends, 6 ms later
        output(10.1061, 5.106, [{"id": "a", "tokens": 1, "finish_reason": None},
                                {"id": "b", "tokens": 1, "finish_reason": None, "events": [[1, 5.106], [2, 5.106]]}]),
        output(10.2001, 5.200, [{"id": "a", "tokens": 1, "finish_reason": 1}, {"id": "b", "tokens": 1, "finish_reason": 1}]),
        add(10.300, "c"),  # idle again: 2 ms
        output(10.3101, 5.310, [{"id": "c", "tokens": 1, "finish_reason": 1, "events": [[1, 5.302], [2, 5.302]]}]),
    ]  # fmt: skip
    assert input_delays_ms(records) == [pytest.approx(1.1), pytest.approx(2.1)]


def test_fit_bins_the_prefill_spread_when_short_prefills_vary_more():
    """Short prefills vary by a factor of up to 2, long ones by 2 %: one set
    of factors would give long prefills the short ones' tail; the fit picks
    bins by their held-out pinball loss, and each bin keeps its own spread."""
    wide = tuple(1.0 + i / 10 for i in range(11))  # uniform on [1, 2]
    tight = tuple(1.0 + 0.02 * i / 10 for i in range(11))
    truth = dataclasses.replace(TRUE, spread_prefill=(wide, tight), spread_prefill_bins=(128,))
    records, _ = simulate(truth, workload(400, seed=7))
    steps = steps_from_trace(records)
    result = fitting.fit(steps, model="table")
    p = result.profile
    assert len(p.spread_prefill_bins) >= 1, result.report
    long_bin = p.spread_prefill[-1]
    assert long_bin[95] < 1.1, long_bin  # the long prefills keep a tight spread
    short_bin = p.spread_prefill[0]
    assert short_bin[95] - short_bin[5] > 0.5, short_bin  # the short ones keep their tail
    assert any("prefill spread bins" in line for line in result.report)


def test_fit_bins_the_decode_spread_when_small_batches_vary_more():
    """Steps of one request vary by up to 2x, steps of more by 2 %: one set
    of factors, fitted mostly on the small batches, would give a full
    batch their tail; the fit picks batch bins by held-out pinball loss."""
    wide = tuple(1.0 + i / 10 for i in range(11))  # uniform on [1, 2]
    tight = tuple(1.0 + 0.02 * i / 10 for i in range(11))
    truth = dataclasses.replace(TRUE, spread_decode=(wide, tight), spread_decode_bins=(1,))
    records, _ = simulate(truth, workload(400, seed=8))
    result = fitting.fit(steps_from_trace(records), model="table")
    p = result.profile
    assert p.spread_decode_bins and p.spread_decode_bins[0] == 1, result.report
    assert all(q[95] < 1.1 for q in p.spread_decode[1:]), p.spread_decode  # batches above 1 keep a tight spread
    assert p.spread_decode[0][95] - p.spread_decode[0][5] > 0.5, p.spread_decode[0]  # batch 1 keeps its tail
    assert any("decode spread bins" in line for line in result.report)


def test_batch_bins_double_and_merge_bins_too_small():
    keys = sorted([1] * 100 + [2] * 10 + [3] * 25 + [5] * 40 + [12] * 40 + [16] * 5)
    choices = fitting.doubling_bins(keys)
    # doubling: 1 | 2-3 (35) | 4-7 (40) | 8-15 (40) | 16 (5, joins 8-15); fourfold: 1 | 2-7 | 8-31
    assert choices == [(), (1, 3, 7), (1, 7)]
    assert fitting.doubling_bins([4] * 50) == [()]  # one key: no bins
    assert fitting.doubling_bins([]) == [()]


def test_prefill_bins_offer_equal_counts_and_doubling_once_each():
    keys = sorted([16] * 40 + [100] * 40 + [500] * 40)
    choices = fitting.prefill_bins(keys)
    assert choices[0] == () and len(choices) == len(set(choices))
    assert (16, 100) in choices  # three of equal counts
    assert (31, 127) in choices  # doubling: ... | 32-63 | 64-127 | ..., empty bins merged upward


def test_the_robust_fit_keeps_the_typical_step_when_some_steps_stall(monkeypatch):
    """One prefill step in five slowed threefold: least squares prices
    every prompt higher; the robust fit keeps the typical step's price and
    leaves the stalls to the spread."""
    records, _ = simulate(TRUE, workload(300, seed=4))
    steps = steps_from_trace(records)
    stalled = [dataclasses.replace(s, end=s.start + 3 * (s.end - s.start)) if s.prefill_tokens and i % 5 == 0 else s
               for i, s in enumerate(steps)]  # fmt: skip
    table = fitting.CANDIDATES[2]

    def prefill_ms(p):  # a 256-token prompt at batch 4
        return p.predict_ms(4, 256, 256 * 128, 1000, 1) - p.predict_ms(4, 0, 0.0, 1000, 0)

    robust = fitting.fit_candidate(table, stalled)
    assert prefill_ms(robust) == pytest.approx(prefill_ms(TRUE), rel=0.01)
    assert robust.batch_ms(4) == pytest.approx(TRUE.batch_ms(4), rel=0.03)
    monkeypatch.setattr(fitting, "ROBUST_ITERATIONS", 0)
    plain = fitting.fit_candidate(table, stalled)
    assert prefill_ms(plain) > 1.05 * prefill_ms(TRUE)  # what the reweighting is for


def test_score_steps_prefers_the_profile_that_draws_as_the_engine_did(tmp_path, capsys):
    truth = dataclasses.replace(TRUE, spread_new_size=(2.0, 2.0), spread_new_max=(6.0, 6.0))
    records, _ = simulate(truth, workload(200, seed=4, prompts=(100, 300, 700)))
    steps = steps_from_trace(records)
    right = {g: (n, loss) for g, n, loss in fitting.score_steps(truth, steps)}
    blind = {g: (n, loss) for g, n, loss in fitting.score_steps(TRUE, steps)}
    assert right["all"][0] == sum(right[g][0] for g in ("decode", "prefill", "new size", "new largest size"))
    assert right["new size"][0] > 10 and right["new largest size"][0] > 5
    assert right["all"][1] == pytest.approx(0.0, abs=1e-6)  # every step as the engine timed it
    assert blind["decode"][1] == pytest.approx(0.0, abs=1e-6) and blind["new largest size"][1] > 1.0
    # the same through benchmarks/fidelity.py score, from a trace file
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # a script of the checkout
    import fidelity

    trace = tmp_path / "held.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in [header(), *records]))
    profiles = []
    for name, profile in (("truth", truth), ("blind", TRUE)):
        profiles += ["--profile", str(tmp_path / f"{name}.ini")]
        (tmp_path / f"{name}.ini").write_text(format_profile(profile))
    assert fidelity.main(["score", *profiles, str(trace)]) == 0
    printed = capsys.readouterr().out.splitlines()
    rows = [line for line in printed if line.startswith(f"| {tmp_path}")]
    assert len(rows) == 2 and rows[0].split(" | ")[1].startswith("0.000") and not rows[1].split(" | ")[1].startswith("0.000"), printed
