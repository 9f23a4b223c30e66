"""`./run.sh serve`'s plan, pure: its command line, [serve] section and
GMOCK_SERVE_* variables, and the engine's options beside them, read into what
to start (tools/serve.py starts, supervises and stops it): the frontend and its
flags, the engines and theirs, the model dir, the ports; a bad combination
stops here, before anything starts."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

from gmock_engine.config import loader as cfg
from gmock_engine.content import pooling
from gmock_engine.tools import frontends, model_dir, procgroup
from gmock_engine.tools.serve_config import build_serve_parser, frontend_arg_list, parse_serve_config

PROG = "gmock-engine serve"


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


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
