"""The commands the docs show, run as written (tests/doc_commands_table.py says how).

Each `Run` row of the table whose kind is "serves", "engine", "frontend" or
"exits" is one test here; a "client" row runs inside the test of the serve it
names. Every command is printed as it is run, after the changes the table
declares (ports, smaller counts). tests/unit/test_doc_commands.py checks that
every documented command has a row; this file that the `Run` ones work.

Rows marked slow (GuideLLM, aiperf, the Python frontend) run only with
GMOCK_DOCS_SLOW=1, in CI's own step after the suite (.ci/run), with the heavy
clients installed by tests/e2e/install_clients.sh.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

import doc_commands as dc
import doc_commands_table as table
import e2e_harness as h
from gmock_engine.tools import frontends as _frontends
from gmock_engine.tools import procfs
from gmock_engine.tools.procgroup import free_ports

pytestmark = pytest.mark.e2e

#: The heavy clients' venvs (tests/e2e/install_clients.sh), under the frontends' cache.
CLIENTS = {"guidellm": "guidellm", "aiperf": "aiperf"}

_COMMANDS: Dict[str, dc.DocCommand] = {}
for _c in dc.documented_commands(h.REPO):
    _COMMANDS.setdefault(_c.key, _c)


def _clients_of(stack_key: str) -> List[Tuple[dc.DocCommand, table.Run]]:
    out = []
    for key, row in table.ROWS.items():
        if isinstance(row, table.Run) and row.kind == "client" and dc.normalize(row.stack) == stack_key and key in _COMMANDS:
            out.append((_COMMANDS[key], row))
    return out


def _frontends_of(engine_key: str) -> List[Tuple[dc.DocCommand, table.Run]]:
    return [(_COMMANDS[k], r) for k, r in table.ROWS.items()
            if isinstance(r, table.Run) and r.kind == "frontend" and dc.normalize(r.stack) == engine_key and k in _COMMANDS]  # fmt: skip


def _cases():
    """(id, command, row, its clients, phase): "suite" runs the fast part, "slow" the rest."""
    for key, row in table.ROWS.items():
        if not isinstance(row, table.Run) or row.kind == "client" or key not in _COMMANDS:
            continue
        cmd = _COMMANDS[key]
        test_id = f"{cmd.page}:{cmd.line}"
        if row.kind == "frontend":
            yield pytest.param(cmd, row, [], id=test_id, marks=_slow_marks(row.slow))
            continue
        clients = _clients_of(key)
        fast = [c for c in clients if not c[1].slow]
        slow = [c for c in clients if c[1].slow]
        if row.slow:
            yield pytest.param(cmd, row, clients, id=test_id, marks=_slow_marks(True))
            continue
        yield pytest.param(cmd, row, fast, id=test_id)
        if slow:
            yield pytest.param(cmd, row, slow, id=test_id + "-slow-clients", marks=_slow_marks(True))


def _slow_marks(slow: bool):
    return [pytest.mark.docs_slow] if slow else []


# -- how a command is run -------------------------------------------------------------------


class Values:
    """The free ports and paths a run puts in for the table's placeholders."""

    def __init__(self, tmp: Path, model_dir: Path) -> None:
        self.port, self.hport = free_ports(2)
        self.kvport, self.kvport2 = _free_pair(), _free_pair()
        self.tmp, self.model_dir = tmp, model_dir

    def fill(self, text: str) -> str:
        for name in ("port", "hport", "kvport2", "kvport", "model_dir", "tmp"):
            text = text.replace("{" + name + "}", str(getattr(self, name)))
        return text


def _free_pair() -> int:
    """A free port p with p + 1 free too (rank r of a KV-events publisher binds port + r)."""
    for _ in range(50):
        p = free_ports(1)[0]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def as_run(cmd: dc.DocCommand, row: table.Run, v: Values, port: Optional[int] = None) -> str:
    """The command as this run runs it: the row's substitutions, then the table's rules."""
    text = cmd.text
    for written, run_as in row.subs:
        assert written in text, f"{cmd.page}:{cmd.line}: the row substitutes {written!r}, not in the command"
        text = text.replace(written, v.fill(run_as))
    home = os.environ.get("GMOCK_FRONTENDS_HOME")
    if home:
        text = text.replace("~/.cache/gmock-frontends", home)
    if row.kind == "serves" and not re.search(r"--port\b", text):
        text = text.replace("./run.sh serve", f"./run.sh serve --port {v.port}", 1)  # SERVE_PORT
    if row.kind == "frontend":
        text = text.replace("<model>", str(v.model_dir))
        if not re.search(r"--port\b", text):
            text += f" --port {v.port}"  # SERVE_PORT
    if row.kind in ("engine", "frontend"):
        text = re.sub(r"\b2955\d\b", str(v.hport), text)  # HANDSHAKE
    if row.kind == "client":
        text = re.sub(r"\b(127\.0\.0\.1|localhost):8000\b", f"127.0.0.1:{port}", text)  # CLIENT_URLS
    return text


def script(cmd: dc.DocCommand, text: str) -> str:
    """The block's setup lines, then the command; `exec env` so that the pid is the
    program's own (a signal reaches it, not a shell), NAME=value prefixes and all."""
    setup = [line.replace("~/.cache/gmock-frontends", os.environ["GMOCK_FRONTENDS_HOME"])
             if os.environ.get("GMOCK_FRONTENDS_HOME") else line for line in cmd.setup]  # fmt: skip
    return "\n".join([*setup, "exec env " + text])


def workdir(cmd: dc.DocCommand, tmp) -> Path:
    """The checkout for ./run.sh and relative paths (.venv/bin/python); a temp folder for
    the rest, since GuideLLM and aiperf write their results where they run."""
    first = next(w for w in cmd.text.split() if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w))
    tmp = getattr(tmp, "tmp", tmp)
    return h.REPO if first.startswith(".") else Path(tmp)


@pytest.fixture(scope="module")
def tools_path(frontends, tmp_path_factory) -> Path:
    """A folder for PATH: vllm-rs (the installed binary), vllm (./run.sh vllm), the heavy clients."""
    bindir = tmp_path_factory.mktemp("doc-bin")
    (bindir / "vllm-rs").symlink_to(frontends.vllm_rs)
    vllm = bindir / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec "{h.RUN_SH}" vllm "$@"\n')
    vllm.chmod(0o755)
    clients = _frontends.frontends_home() / "clients"
    for name in CLIENTS:
        exe = clients / name / "bin" / name
        if exe.exists():
            (bindir / name).symlink_to(exe)
    return bindir


def run_env(bindir: Path, v: Values, row: table.Run) -> dict:
    env = {k: v_ for k, v_ in os.environ.items()
           if not k.startswith("GMOCK_") or k in ("GMOCK_VENV", "GMOCK_FRONTENDS_HOME")}  # fmt: skip
    env["PATH"] = f"{bindir}:{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"  # OFFLINE: as on a machine set up for no model hub
    if row.kind in ("engine", "frontend"):
        env["GMOCK_HANDSHAKE_ADDRESS"] = f"tcp://127.0.0.1:{v.hport}"  # HANDSHAKE
    return env


class Proc:
    """One command in the background: stdout read line by line, stdout+stderr kept in a file."""

    def __init__(self, text: str, cmd: dc.DocCommand, env: dict, tmp: Path) -> None:
        self.text = text
        self.started = time.monotonic()
        self.log_path = tmp / f"cmd-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w+")
        print(f"[docs] {cmd.page}:{cmd.line}: running: {text}", flush=True)
        self.proc = subprocess.Popen(["bash", "-c", script(cmd, text)], cwd=workdir(cmd, tmp), env=env, text=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True)  # fmt: skip
        self.lines: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.tree: List[int] = []

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        self._log.flush()
        return "\n".join(self.lines) + "\n" + self.log_path.read_text(errors="replace")

    def wait_for(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout * h.TIMEOUT_SCALE
        while not pred():
            if self.proc.poll() is not None:
                pytest.fail(f"{self.text}\nexited {self.proc.returncode} before {what}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.text}\nno {what} after {timeout:.0f} s:\n{self.output()[-4000:]}")
            time.sleep(0.2)
        self.tree = procfs.process_tree(self.proc.pid)

    def stop(self, timeout: float = 60) -> int:
        """SIGINT (Ctrl-C), as the docs stop it; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.text}\nstill running {timeout:.0f} s after SIGINT:\n{self.output()[-4000:]}")

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in self.tree:
            try:
                if pid != self.proc.pid:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self._log.close()


def http_status(url: str) -> Optional[int]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def check_output(text: str, row: table.Run, out: str, v: Values) -> None:
    """The row's `expect`: a regex, or one of the named checks below."""
    if not row.expect:
        return
    if row.expect.startswith("same-as:"):
        want = (h.REPO / row.expect.split(":", 1)[1]).read_text()
        got = (v.tmp / Path(row.expect).name).read_text()
        assert got == want, f"{text}: its output differs from {row.expect.split(':', 1)[1]}"
    elif row.expect == "guidellm-no-errors":
        assert_guidellm_ok(text, out)
    elif row.expect == "aiperf-no-errors":
        assert_aiperf_ok(text, out)
    else:
        assert re.search(row.expect, out, re.S), f"{text}\nits output does not match {row.expect!r}:\n{out[-4000:]}"


def assert_guidellm_ok(text: str, out: str) -> None:
    """GuideLLM 0.8's progress log: the benchmark completed, some requests succeeded, none errored."""
    counts = dc.guidellm_counts(out)
    assert counts and counts[0] > 0 and counts[1] == 0, f"{text}: (successful, errored) {counts}\n{out[-4000:]}"


def assert_aiperf_ok(text: str, out: str) -> None:
    """aiperf's summary table: a request count, and every error row at 0."""
    count, errors = dc.aiperf_counts(out)
    assert count, f"{text}: no requests counted\n{out[-4000:]}"
    assert not errors, f"{text}: errors\n" + "\n".join(errors)


def run_client(cmd: dc.DocCommand, row: table.Run, port: int, env: dict, v: Values) -> None:
    text = as_run(cmd, row, v, port)
    print(f"[docs] {cmd.page}:{cmd.line}: running: {text}", flush=True)
    t0 = time.monotonic()
    try:
        done = subprocess.run(["bash", "-c", script(cmd, text)], cwd=workdir(cmd, v), env=env, text=True,
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=row.timeout * h.TIMEOUT_SCALE)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd.page}:{cmd.line}: {text}\nstill running after {row.timeout:.0f} s:\n{e.stdout}\n{e.stderr}")
    out = done.stdout + "\n" + done.stderr
    print(f"[docs] {cmd.page}:{cmd.line}: exit {done.returncode} in {time.monotonic() - t0:.1f} s", flush=True)
    assert done.returncode == 0, f"{cmd.page}:{cmd.line}: {text}\nexit {done.returncode}:\n{out[-6000:]}"
    check_output(text, row, out, v)


# -- the tests ------------------------------------------------------------------------------


@pytest.fixture
def values(frontends, tmp_path) -> Values:
    return Values(tmp_path, _frontends.frontends_home() / "models" / "mock-vocab32000-len1048576")


@pytest.mark.parametrize("cmd,row,clients", list(_cases()))
def test_documented_command_runs_as_written(cmd, row, clients, values, tools_path, tmp_path):
    v = values
    env = run_env(tools_path, v, row)
    text = as_run(cmd, row, v)
    procs: List[Proc] = []
    try:
        if row.kind == "exits":
            run_client(cmd, row, v.port, env, v)
        elif row.kind == "serves":
            p = Proc(text, cmd, env, tmp_path)
            procs.append(p)
            p.wait_for(lambda: any(line.startswith("serving http") for line in p.lines), row.timeout, "serving line")
            print(f"[docs] {cmd.page}:{cmd.line}: serving line after {time.monotonic() - p.started:.1f} s", flush=True)
            url = re.match(r"serving (http://\S+/v1)", next(l for l in p.lines if l.startswith("serving"))).group(1)
            port = int(re.search(r":(\d+)/v1", url).group(1))
            assert http_status(url + "/models") == 200, f"{text}: GET /v1/models"
            for client, client_row in clients:
                run_client(client, client_row, port, run_env(tools_path, v, client_row), v)
            assert p.stop() == 0, f"{text}\nexit status after SIGINT:\n{p.output()[-4000:]}"
        elif row.kind == "engine":
            p = Proc(text, cmd, env, tmp_path)
            procs.append(p)
            p.wait_for(lambda: re.search(r"engines \S+ of DP \d+ joining tcp://127\.0\.0\.1:" + str(v.hport), p.output()),
                       60, "its start line (engines joining the handshake)")  # fmt: skip
            assert p.stop() == 0, f"{text}\nexit status after SIGINT:\n{p.output()[-4000:]}"
        elif row.kind == "frontend":
            engine_key = dc.normalize(row.stack)
            engine_row = table.ROWS[engine_key]
            engine = Proc(as_run(_COMMANDS[engine_key], engine_row, v), _COMMANDS[engine_key], env, tmp_path)
            procs.append(engine)
            front = Proc(text, cmd, env, tmp_path)
            procs.append(front)
            base = f"http://127.0.0.1:{v.port}"
            front.wait_for(lambda: http_status(base + "/health") == 200 and http_status(base + "/v1/models") == 200,
                           row.timeout, "/health and /v1/models 200")  # fmt: skip
            assert engine.proc.poll() is None, f"the engine stopped:\n{engine.output()[-4000:]}"
            front.stop()
            engine.stop()
        else:
            pytest.fail(f"unknown kind {row.kind!r}")
    finally:
        for p in reversed(procs):
            p.cleanup()
