"""Reloads under load, one gmock_engine App against the fake frontend in one hub.

`App.request_reload` is what runtime/cli.py's SIGHUP handler calls; the reload runs
in the App's config-reloader greenlet and each engine's stepper takes it
between two steps. Times are only checked as lower bounds (a paced gap is
at least its ITL), so a slow machine cannot make these fail.
"""

import contextlib
import time

import gevent
from loguru import logger

from fake_frontend import Collected, FakeFrontend
from gmock_engine.config.loader import parse_config
from gmock_engine.wire.eras import WIRE_LAYOUTS
from gmock_engine.wire.types import FinishReason
from gmock_engine.runtime.app import App
from gmock_engine.config.settings import from_config
from gmock_engine.content.tokens import RandomTokens

ERROR_POSITION = WIRE_LAYOUTS["0.33"].output_position("error")


class LiveConfig:
    """The --config file of a running App, rewritten by the test."""

    def __init__(self, tmp_path, body):
        self.path = tmp_path / "live.ini"
        self.write(body)

    def write(self, body):
        self.path.write_text("[gmock_engine]\n" + body)


@contextlib.contextmanager
def reloadable(frontend, live, *flags, dp=1):
    argv = ["--handshake-address", frontend.handshake_address, "--config", str(live.path), *flags]
    config = parse_config(argv, env={})
    app = App(from_config(config), config, load=lambda: parse_config(argv, env={}))
    lines = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO")
    waiter = gevent.spawn(app.run)
    assert app.started.wait(10)
    try:
        frontend.accept_engines()
        assert app.wait_joined(5)
        yield app, lines
        app.stop()
        assert waiter.get(timeout=5) == 0
        assert all(c["violations"] == 0 for c in app.counters().values()), app.counters()
    finally:
        logger.remove(sink)
        if not waiter.dead:
            app.stop()
            waiter.join(timeout=5)
        frontend.close()


def reload_and_wait(app, frontend, generation, ranks=(0,)):
    """SIGHUP's path (the handler only sets an event), then wait until every
    engine says (gmock_stats) it runs with `generation`."""
    app.request_reload()
    with gevent.Timeout(5):
        while app.generation < generation:
            gevent.sleep(0.005)
    with gevent.Timeout(5):
        for rank in ranks:
            while app.runners[rank].generation != generation:
                gevent.sleep(0.005)


def expected_tokens(rid, n, rank=0, seed=0):
    source = RandomTokens(32000, seed, rank)
    return source.draw(source.initial_state(rid), n)[0]


def read_until(frontend, collected, predicate, timeout=10):
    with gevent.Timeout(timeout):
        while not predicate(collected):
            collected.add(frontend.recv())


def stamps_of(messages, rid, after=float("-inf"), until=float("inf")):
    """Engine timestamps (time.monotonic) of the messages carrying rid's tokens, in a window."""
    return [m[3] for m in messages if after < m[3] < until and any(o[0] == rid and o[1] for o in m[1])]


def paced(gaps, itl):
    """Steps `itl` apart. A lower bound on the whole and on the median, not on
    each gap: a message's timestamp is taken after its step's work, so a step
    the OS held up looks late and the next one (on time) close to it."""
    gaps = sorted(gaps)
    return sum(gaps) >= (len(gaps) - 1) * itl * 0.95 and gaps[len(gaps) // 2] >= itl * 0.9


def step_gaps(messages, rid):
    """Gaps between the engine timestamps of the messages carrying rid's tokens."""
    stamps = [m[3] for m in messages if any(o[0] == rid and o[1] for o in m[1])]
    return [b - a for a, b in zip(stamps, stamps[1:])]


def test_itl_0_to_20_and_back_shows_in_the_timestamps_and_the_stream_stays_exact(tmp_path):
    live = LiveConfig(tmp_path, "itl-ms = 0\n")
    frontend = FakeFrontend(num_clients=1, dp=1)
    with reloadable(frontend, live) as (app, lines):
        frontend.add(0, "long", max_tokens=10**6)
        collected = Collected()
        read_until(frontend, collected, lambda c: len(c.tokens("long")) >= 50)
        asked = time.monotonic()  # the engine clock of the message timestamps
        live.write("itl-ms = 20\n")
        reload_and_wait(app, frontend, 2)
        taken = time.monotonic()
        assert any(f"config reload (generation 2, engines 0..0): --itl-ms 0 -> 20 (config file {live.path}, key itl-ms)" in l for l in lines)
        # what was stepped before the reload is still on its way; every step after it is 20 ms from the last
        read_until(frontend, collected, lambda c: len(stamps_of(c.messages, "long", after=taken)) >= 8)
        before = stamps_of(collected.messages, "long", until=asked)
        assert min(b - a for a, b in zip(before, before[1:])) < 0.005  # unpaced
        after = stamps_of(collected.messages, "long", after=taken)
        assert paced([b - a for a, b in zip(after, after[1:])], 0.020), after
        live.write("itl-ms = 0\n")
        reload_and_wait(app, frontend, 3)
        unpaced_from = time.monotonic()
        count = len(collected.tokens("long"))
        read_until(frontend, collected, lambda c: len(c.tokens("long")) >= count + 300)
        assert time.monotonic() - unpaced_from < 3.0  # 300 steps of 20 ms would take 6 s
        frontend.abort(0, ["long"])
        frontend.collect(["long"], into=collected)
        tokens = collected.tokens("long")
        assert tokens == expected_tokens("long", len(tokens))  # not one token lost, doubled or changed
        assert collected.terminal["long"] == FinishReason.ABORT and collected.finished_requests == ["long"]


def test_turning_a_fault_on_and_off_under_load(tmp_path):
    live = LiveConfig(tmp_path, "itl-ms = 2\n")
    frontend = FakeFrontend(num_clients=1, dp=2)
    with reloadable(frontend, live, "--engine-count", "2") as (app, lines):
        for rank in (0, 1):
            frontend.add(rank, f"across-{rank}", max_tokens=300)
        collected = Collected()
        read_until(frontend, collected, lambda c: len(c.tokens("across-1")) >= 10)
        live.write("itl-ms = 2\nfault-error-mid-stream = every=1\n")
        reload_and_wait(app, frontend, 2, ranks=(0, 1))
        assert any("--fault-error-mid-stream unset -> every=1" in l for l in lines)
        for rank in (0, 1):
            frontend.add(rank, f"faulty-{rank}", max_tokens=20)
        read_until(frontend, collected, lambda c: {"faulty-0", "faulty-1"} <= set(c.terminal))
        live.write("itl-ms = 2\n")
        reload_and_wait(app, frontend, 3, ranks=(0, 1))
        for rank in (0, 1):
            frontend.add(rank, f"healed-{rank}", max_tokens=20)
        ids = [f"{name}-{rank}" for name in ("across", "faulty", "healed") for rank in (0, 1)]
        frontend.collect(ids, timeout=20, into=collected)
        for rank in (0, 1):
            # the stream that ran across both reloads is exact, its ADD came before the fault
            across = collected.tokens(f"across-{rank}")
            assert across == expected_tokens(f"across-{rank}", 300, rank) and collected.terminal[f"across-{rank}"] == FinishReason.LENGTH
            # the fault acts on the requests that arrive while it is on
            assert len(collected.tokens(f"faulty-{rank}")) == 10 and collected.terminal[f"faulty-{rank}"] == FinishReason.ERROR
            assert collected.outputs[f"faulty-{rank}"][-1][ERROR_POSITION]["code"] == "mock_failure"
            assert len(collected.tokens(f"healed-{rank}")) == 20 and collected.terminal[f"healed-{rank}"] == FinishReason.LENGTH
        # the count of what was injected stays after the fault is off
        counts = app.counters()
        assert all(counts[r]["fault_error_mid_stream"] == 1 and counts[r]["finished_error"] == 1 for r in (0, 1)), counts


def test_a_bad_file_is_refused_without_disturbing_a_running_stream(tmp_path):
    live = LiveConfig(tmp_path, "itl-ms = 5\n")
    frontend = FakeFrontend(num_clients=1, dp=1)
    with reloadable(frontend, live) as (app, lines):
        frontend.add(0, "steady", max_tokens=60)
        collected = Collected()
        read_until(frontend, collected, lambda c: len(c.tokens("steady")) >= 5)
        live.write("itl-ms = 0\nmax-num-seqs = lots\n")  # the good line must not be taken either
        app.request_reload()
        with gevent.Timeout(5):
            while app.reloads["refused"] < 1:
                gevent.sleep(0.005)
        frontend.collect(["steady"], into=collected)
        assert collected.tokens("steady") == expected_tokens("steady", 60)
        assert collected.terminal["steady"] == FinishReason.LENGTH
        assert paced(step_gaps(collected.messages, "steady"), 0.005)  # still paced at 5 ms
        assert app.generation == 1 and app.runners[0].generation == 1 and app.config.itl_ms == 5.0
        refusal = [l for l in lines if "config reload refused" in l]
        assert len(refusal) == 1 and "nothing changed (generation 1 stays, engines 0..0): argument --max-num-seqs: 'lots' is not an integer" in refusal[0]
        # and the next good file is taken
        live.write("itl-ms = 1\n")
        reload_and_wait(app, frontend, 2)
        assert app.config.itl_ms == 1.0 and app.reloads == {"refused": 1, "applied": 1}


def test_a_new_token_source_and_batch_limit_for_what_comes_next(tmp_path):
    live = LiveConfig(tmp_path, "itl-ms = 2\n")
    frontend = FakeFrontend(num_clients=1, dp=1)
    with reloadable(frontend, live) as (app, lines):
        frontend.add(0, "random", max_tokens=100)
        collected = Collected()
        read_until(frontend, collected, lambda c: len(c.tokens("random")) >= 3)
        live.write("itl-ms = 2\ntoken-source = echo\nmax-num-seqs = 1\nvocab-size = 7\n")
        reload_and_wait(app, frontend, 2)
        assert any(l.rstrip().endswith(f"--vocab-size 32000 -> 7 (config file {live.path}, key vocab-size)") for l in lines)
        frontend.add(0, "echo", max_tokens=4, prompt_token_ids=[5, 6])
        gevent.sleep(0.05)
        call_id = frontend.utility(0, "gmock_stats")
        reply = None
        with gevent.Timeout(5):
            while reply is None:
                message = frontend.recv()
                if len(message) > 4 and message[4] is not None and message[4][0] == call_id:
                    reply = message[4]
                else:
                    collected.add(message)
        stats = reply[2][1]
        assert stats["active"] == 1 and stats["waiting"] == 1 and stats["config_generation"] == 2
        frontend.collect(["random", "echo"], into=collected)
        assert collected.tokens("random") == expected_tokens("random", 100)
        assert collected.tokens("echo") == [5, 6, 5, 6]


def test_a_reload_during_the_handshake_is_what_the_engine_starts_with(tmp_path):
    live = LiveConfig(tmp_path, "")
    frontend = FakeFrontend(num_clients=1, dp=1)
    argv = ["--handshake-address", frontend.handshake_address, "--config", str(live.path)]
    config = parse_config(argv, env={})
    app = App(from_config(config), config, load=lambda: parse_config(argv, env={}))
    waiter = gevent.spawn(app.run)
    assert app.started.wait(10)
    try:
        live.write("itl-ms = 20\nfault-error-mid-stream = every=1\n")
        assert app.reload() and app.runners[0].engine is None
        frontend.accept_engines()
        assert app.wait_joined(5)
        frontend.add(0, "first", max_tokens=6)
        collected = frontend.collect(["first"])
        assert collected.terminal["first"] == FinishReason.ERROR and len(collected.tokens("first")) == 3
        assert paced(step_gaps(collected.messages, "first"), 0.020)
    finally:
        app.stop()
        assert waiter.get(timeout=5) == 0
        frontend.close()


def test_the_summary_interval_and_the_metrics(tmp_path):
    from gmock_engine.runtime import metrics

    live = LiveConfig(tmp_path, "summary-interval = 0\n")
    frontend = FakeFrontend(num_clients=1, dp=1)
    with reloadable(frontend, live) as (app, lines):
        assert app.summary is None
        before = app.loaded_at
        live.write("summary-interval = 0.05\n")
        reload_and_wait(app, frontend, 2)
        gevent.sleep(0.2)
        assert sum("engine 0 summary" in l for l in lines) >= 2
        samples = {}
        for family in metrics.registry(app.runners, app).collect():
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        assert samples[("gmock_config_generation", ())] == 2
        assert samples[("gmock_config_last_reload_timestamp_seconds", ())] == app.loaded_at > before
        assert samples[("gmock_config_reloads_total", (("result", "applied"),))] == 1
        assert samples[("gmock_config_reloads_total", (("result", "refused"),))] == 0
        assert samples[("gmock_engine_config_generation", (("engine", "0"),))] == 2


def test_a_timed_fault_brought_by_a_reload_counts_from_the_reload_and_a_hung_engine_takes_it_after(tmp_path):
    live = LiveConfig(tmp_path, "itl-ms = 5\n")
    frontend = FakeFrontend(num_clients=1, dp=1)
    with reloadable(frontend, live) as (app, lines):
        frontend.add(0, "steady", max_tokens=400)
        collected = Collected()
        read_until(frontend, collected, lambda c: len(c.tokens("steady")) >= 5)
        gevent.sleep(0.3)  # at=0.3s from the join would be over by now
        live.write("itl-ms = 5\nfault-hang = at=0.3s duration=0.4s\n")
        asked = time.monotonic()
        reload_and_wait(app, frontend, 2)
        runner = app.runners[0]
        with gevent.Timeout(5):
            while not runner.injector.hung:
                gevent.sleep(0.01)
        assert time.monotonic() - asked >= 0.3  # at= counts from the reload, not the join
        # a reload while hung waits for the hang to end (the stepper takes it between two steps)
        live.write("itl-ms = 1\nfault-hang = at=0.3s duration=0.4s\n")
        app.request_reload()
        with gevent.Timeout(5):
            while app.generation < 3:
                gevent.sleep(0.005)
        assert runner.generation == 2 and runner.injector.hung
        with gevent.Timeout(5):
            while runner.generation != 3:
                gevent.sleep(0.005)
        assert not runner.injector.hung
        frontend.collect(["steady"], into=collected)
        assert collected.tokens("steady") == expected_tokens("steady", 400)
        assert max(step_gaps(collected.messages, "steady")) >= 0.35  # the hang
        assert app.counters()[0]["fault_hang"] == 1  # at= fires once, and the unchanged spec did not fire again
