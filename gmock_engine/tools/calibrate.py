"""`./run.sh calibrate` (`gmock-engine calibrate`): record a real engine
under a standard sweep, so that one command gives a trace that covers what
`./run.sh fit` needs (docs/latency-profile.md, "Make it behave like my GPU").

It starts the record tap (tools/record.py, as `./run.sh record` with the
same options) between the user's frontend and engine cores, waits until the
frontend's /health answers (the engines joined through the tap), sends the
sweep of calibrate_plan.py through the frontend's OpenAI API with a small
HTTP client of its own (prompts as token ids, so their lengths are exact,
EOS ignored, so the outputs are), stops the tap, which writes the trace,
and with `--profile-output` fits a profile to it. `--drive-only` sends the
sweep without a tap of its own (a `./run.sh record` already runs).

Plain Python: threads for the clients (the engine never imports vLLM, and
neither does this).
"""

from __future__ import annotations

import http.client
import json
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gmock_engine.config.loader import CALIBRATE_SECTION, ENV_PREFIX, ConfigError, ini_reader, new_parser, parse_tool_config
from gmock_engine.config.option import Group, Option, add_groups
from gmock_engine.config.validators import float_at_least, int_at_least, nonempty
from gmock_engine.tools import record_config
from gmock_engine.tools.calibrate_plan import RATE_OF_MIXED, Phase, Request, describe, poisson_gaps, sweep

#: Prompt token ids are drawn from this range: below any real vocabulary's
#: size (the frontends' test model has 32 000), above the special and byte
#: tokens most vocabularies begin with; random, so prompts share no prefix.
PROMPT_TOKEN_IDS = (1000, 20000)
#: The max_model_len assumed when the frontend's /v1/models does not say it.
DEFAULT_MAX_MODEL_LEN = 4096

CALIBRATE_ENV_PREFIX = ENV_PREFIX + "CALIBRATE_"
GROUPS = (
    Group(
        "sweep",
        (
            Option("--base-url", "the frontend's HTTP address, e.g. http://127.0.0.1:8000; required", type=nonempty),
            Option("--model", "the served model name (default: the first of the frontend's /v1/models)"),
            Option("--max-concurrency", "the largest batch the sweep drives (closed loops at 1, 2, 4, ... up to it)",
                   default=16, type=int_at_least(1, 4096)),  # fmt: skip
            Option("--max-num-batched-tokens", "the engine's token budget per step (its log says it): the longest "
                   "prompts go beyond it, and the fit after --profile-output is given it", default=2048,
                   type=int_at_least(2)),  # fmt: skip
            Option("--max-model-len", "the longest sequence the engine takes (default: the frontend's /v1/models says it, else 4096)",
                   type=int_at_least(32)),  # fmt: skip
            Option("--scale", "multiplies the sweep's request counts", default=1.0, type=float_at_least(0.01)),
            Option("--seed", "seed of the prompts, their lengths and the arrivals", default=0, type=int_at_least(0)),
            Option("--quick", "a sweep of a few seconds (outputs of 16, a handful of requests a phase): to check a setup",
                   default=False, boolean=True),  # fmt: skip
            Option("--request-timeout", "seconds a request may take", default=600.0, type=float_at_least(1.0)),
            Option("--start-timeout", "seconds to wait for the frontend's /health (the engines joining through the tap)",
                   default=900.0, type=float_at_least(1.0)),  # fmt: skip
            Option("--drive-only", "send the sweep only: no tap of its own (a ./run.sh record already records)",
                   default=False, boolean=True),  # fmt: skip
            Option("--profile-output", "when given, fit a profile to the trace (./run.sh fit) and write it here"),
        ),
    ),
) + tuple(Group("the record tap (./run.sh record's options)", g.options) for g in record_config.GROUPS)


def build_calibrate_parser() -> Any:
    """The parser of `./run.sh calibrate`'s options."""
    parser = new_parser(
        "gmock-engine calibrate",
        "Record a real engine under a standard sweep, for ./run.sh fit (docs/latency-profile.md).",
        "Each option can also be set as environment variable GMOCK_CALIBRATE_<FLAG> or as key <flag> in section "
        f"[{CALIBRATE_SECTION}] of the --config file. Precedence: command line > environment > config file > default.",
        ini_reader(CALIBRATE_SECTION),
        CALIBRATE_ENV_PREFIX,
        f"INI config file with a [{CALIBRATE_SECTION}] section (keys = long flag names)",
    )
    add_groups(parser, GROUPS)
    return parser


def parse_args(argv: Sequence[str], env: Optional[Dict[str, str]] = None) -> Any:
    """The options; ConfigError names a missing or bad one."""
    args = parse_tool_config(build_calibrate_parser(), CALIBRATE_SECTION, argv, env)
    required = ["base_url"] + ([] if args.drive_only else ["handshake_address", "engine_handshake_address"])
    for name in required:
        if getattr(args, name) is None:
            raise ConfigError(f"argument --{name.replace('_', '-')} is required (or {CALIBRATE_ENV_PREFIX}{name.upper()}, "
                              f"or key {name.replace('_', '-')} in [{CALIBRATE_SECTION}])")  # fmt: skip
    url = urllib.parse.urlsplit(args.base_url)
    if url.scheme != "http" or not url.hostname:
        raise ConfigError(f"argument --base-url: {args.base_url!r} is not an http://host:port address")
    return args


class Client:
    """The frontend's OpenAI API over plain HTTP, one connection per call."""

    def __init__(self, base_url: str, timeout: float) -> None:
        url = urllib.parse.urlsplit(base_url)
        self.host, self.port, self.prefix = url.hostname, url.port or 80, url.path.rstrip("/")
        self.timeout = timeout

    def call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None, timeout: Optional[float] = None) -> Tuple[int, bytes]:
        """(status, body) of one request; OSError when unreachable."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, self.prefix + path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def healthy(self) -> bool:
        """Whether /health answers 200 (every engine joined)."""
        try:
            return self.call("GET", "/health", timeout=5.0)[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def model_card(self, name: Optional[str]) -> Dict[str, Any]:
        """The /v1/models entry of `name` (or the first); {} when it has none."""
        status, body = self.call("GET", "/v1/models", timeout=30.0)
        if status != 200:
            raise RuntimeError(f"GET /v1/models: status {status}: {body[:200]!r}")
        cards = json.loads(body).get("data") or []
        for card in cards:
            if name is None or card.get("id") == name:
                return card
        raise RuntimeError(f"GET /v1/models: no model {name!r} (served: {', '.join(str(c.get('id')) for c in cards)})")


@dataclass
class PhaseResult:
    """What a phase's requests got: counts, errors and the wall-clock time."""

    name: str
    sent: int = 0
    ok: int = 0
    output_tokens: int = 0
    errors: List[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def request_rate(self) -> float:
        """Requests that completed a second."""
        return self.ok / self.seconds if self.seconds > 0 else 0.0


class Sweep:
    """Sends a plan's phases through a Client, one after the other."""

    def __init__(self, client: Client, model: str, seed: int) -> None:
        self.client, self.model = client, model
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def _prompt(self, n: int) -> List[int]:
        with self.lock:
            return [self.rng.randrange(*PROMPT_TOKEN_IDS) for _ in range(n)]

    def send(self, request: Request, result: PhaseResult) -> None:
        """One completion, counted in `result`."""
        body = {"model": self.model, "prompt": self._prompt(request.prompt), "max_tokens": request.output,
                "min_tokens": request.output, "ignore_eos": True, "temperature": 0.0}  # fmt: skip
        try:
            status, data = self.client.call("POST", "/v1/completions", body)
            error = None if status == 200 else f"status {status}: {data[:200]!r}"
            tokens = json.loads(data).get("usage", {}).get("completion_tokens", 0) if status == 200 else 0
        except (OSError, http.client.HTTPException, ValueError) as exc:
            error, tokens = f"{type(exc).__name__}: {exc}", 0
        with self.lock:
            result.sent += 1
            if error is None:
                result.ok += 1
                result.output_tokens += tokens
            else:
                result.errors.append(f"{request.prompt} in / {request.output} out: {error}")

    def run_phase(self, phase: Phase, rate: Optional[float] = None) -> PhaseResult:
        """Send a phase: a closed loop of its concurrency, or Poisson arrivals at its rate (or `rate`)."""
        result = PhaseResult(phase.name)
        started = time.monotonic()
        threads: List[threading.Thread] = []
        if phase.closed_loop:
            queue = list(reversed(phase.requests))

            def loop() -> None:
                while True:
                    with self.lock:
                        if not queue:
                            return
                        request = queue.pop()
                    self.send(request, result)

            threads = [threading.Thread(target=loop, daemon=True) for _ in range(min(phase.concurrency or 1, len(queue)))]
            for t in threads:
                t.start()
        else:
            gaps = poisson_gaps(self.rng, phase.rate or rate or 1.0, len(phase.requests))
            due = started
            for request, gap in zip(phase.requests, gaps):
                due += gap
                time.sleep(max(0.0, due - time.monotonic()))
                t = threading.Thread(target=self.send, args=(request, result), daemon=True)
                t.start()
                threads.append(t)
        for t in threads:
            t.join()
        result.seconds = time.monotonic() - started
        return result

    def run(self, phases: Sequence[Phase], say=print) -> List[PhaseResult]:
        """Every phase in turn; the Poisson phase's rate from the closed loop before it."""
        results: List[PhaseResult] = []
        for phase in phases:
            rate = None
            if not phase.closed_loop and phase.rate is None:
                rate = RATE_OF_MIXED * (results[-1].request_rate if results and results[-1].request_rate > 0 else 1.0)
            result = self.run_phase(phase, rate)
            results.append(result)
            shown = f" at {rate:.2f}/s" if rate else ""
            say(f"calibrate: {phase.name}{shown}: {result.ok}/{result.sent} requests in {result.seconds:.1f} s "
                f"({result.request_rate:.2f}/s, {result.output_tokens} tokens)")  # fmt: skip
            for error in result.errors[:3]:
                say(f"calibrate:   failed: {error}")
        return results


def _tap_argv(args: Any) -> List[str]:
    """`gmock-engine record` with this command's record options."""
    argv = [sys.executable, "-m", "gmock_engine", "record", "--handshake-address", args.handshake_address,
            "--engine-handshake-address", args.engine_handshake_address, "--engine-count", str(args.engine_count),
            "--data-parallel-start-rank", str(args.data_parallel_start_rank), "-o", args.output]  # fmt: skip
    if args.advertise_host:
        argv += ["--advertise-host", args.advertise_host]
    if args.record_token_ids:
        argv.append("--record-token-ids")
    return argv


def _stop(tap: subprocess.Popen) -> int:
    """SIGTERM the tap and wait for it to write the rest of its trace."""
    if tap.poll() is None:
        tap.send_signal(signal.SIGTERM)
    try:
        return tap.wait(timeout=120)
    except subprocess.TimeoutExpired:
        tap.kill()
        return tap.wait()


def main(argv: Sequence[str]) -> int:
    """`gmock-engine calibrate`: 0 when every request of the sweep completed
    and the trace (and the profile) were written; 1 when some failed; 2 for a
    bad option or a frontend that did not come up."""
    try:
        args = parse_args(argv)
    except ConfigError as exc:
        print(f"gmock-engine calibrate: {exc}", file=sys.stderr)
        return 2
    client = Client(args.base_url, args.request_timeout)
    tap = None if args.drive_only else subprocess.Popen(_tap_argv(args))
    results: List[PhaseResult] = []
    try:
        print(f"calibrate: waiting for {args.base_url}/health (start the engine cores with the tap's address, "
              f"{args.engine_handshake_address})" if tap else f"calibrate: waiting for {args.base_url}/health", flush=True)  # fmt: skip
        deadline = time.monotonic() + args.start_timeout
        while not client.healthy():
            if tap is not None and tap.poll() is not None:
                print(f"gmock-engine calibrate: the record tap exited with status {tap.returncode}", file=sys.stderr)
                return 2
            if time.monotonic() > deadline:
                print(f"gmock-engine calibrate: {args.base_url}/health did not answer 200 in {args.start_timeout:g} s",
                      file=sys.stderr)  # fmt: skip
                return 2
            time.sleep(0.5)
        try:
            card = client.model_card(args.model)
        except (OSError, http.client.HTTPException, ValueError, RuntimeError) as exc:
            print(f"gmock-engine calibrate: {exc}", file=sys.stderr)
            return 2
        max_model_len = args.max_model_len or int(card.get("max_model_len") or DEFAULT_MAX_MODEL_LEN)
        phases = sweep(args.max_concurrency, args.max_num_batched_tokens, max_model_len, args.scale, args.seed, args.quick)
        print(f"calibrate: model {card['id']}, max_model_len {max_model_len}, max_num_batched_tokens "
              f"{args.max_num_batched_tokens}; the sweep:", flush=True)  # fmt: skip
        for line in describe(phases):
            print(f"  {line}", flush=True)
        results = Sweep(client, card["id"], args.seed).run(phases, say=lambda text: print(text, flush=True))
    finally:
        if tap is not None:
            code = _stop(tap)
            if code != 0:
                print(f"gmock-engine calibrate: the record tap exited with status {code}", file=sys.stderr)
    failed = sum(len(r.errors) for r in results)
    if tap is not None:
        print(f"calibrate: trace written to {args.output}")
    if args.profile_output:
        if tap is None:
            print("gmock-engine calibrate: --profile-output needs the trace of the tap (not with --drive-only)", file=sys.stderr)
            return 2
        from gmock_engine.tools.fit import main as fit_main

        code = fit_main([args.output, "--max-num-batched-tokens", str(args.max_num_batched_tokens), "-o", args.profile_output])
        if code != 0:
            return code
    else:
        print(f"calibrate: next: ./run.sh fit {args.output} --max-num-batched-tokens {args.max_num_batched_tokens} -o profile.ini")
    if failed:
        print(f"gmock-engine calibrate: {failed} requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
