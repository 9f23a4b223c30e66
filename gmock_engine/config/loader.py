"""The loader: argv (+ environment + config file) -> parsed options.

The first stage of start-up (argv -> parsed options -> settings -> app,
runtime/cli.py wires them): `parse_config` reads every option from the command
line, the environment or a file into the parsed options (parsed.py);
`reader` binds it to one command line for the reloads. None of the later
stages (settings.py, reload.py, the runtime) imports this module.

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
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import configargparse

from gmock_engine import __version__
from gmock_engine.config.option import add_groups, long_flag
from gmock_engine.config.options import GROUPS
# The parsed options' own names (parsed.py); the tools name them from here too.
from gmock_engine.config.parsed import ConfigError, Source, fault_specs

ENV_PREFIX = "GMOCK_"
CONFIG_SECTION = "gmock_engine"
#: `./run.sh serve`'s own options (tools/serve_config.py) go in section [serve]
#: of the same file; the engine's options stay in [gmock_engine].
SERVE_SECTION = "serve"
#: `./run.sh record` and `./run.sh fit` (tools/record.py, tools/fit.py) read theirs.
RECORD_SECTION = "record"
FIT_SECTION = "fit"
PROFILE_SECTION = "profile"
#: `./run.sh calibrate` (tools/calibrate.py): its sweep's and its tap's options.
CALIBRATE_SECTION = "calibrate"
#: The sections a config file may hold; each reader reads and checks its own
#: (a latency profile's, latency_profile.SECTION, read by --latency-profile: a
#: profile of `./run.sh profile` is also a config file, `--config P.ini`).
CONFIG_SECTIONS = (CONFIG_SECTION, SERVE_SECTION, RECORD_SECTION, FIT_SECTION, PROFILE_SECTION, CALIBRATE_SECTION,
                   "latency-profile")


# -- the parser ----------------------------------------------------------------


def ini_reader(section: str) -> type:
    """A configargparse config file parser class that reads only [section] of an INI file."""

    class IniSection(configargparse.IniConfigParser):
        def __init__(self) -> None:
            super().__init__([section], split_ml_text_to_list=False)

    IniSection.__doc__ = f"INI files, reading only the [{section}] section."
    return IniSection


class _Parser(configargparse.ArgumentParser):
    """Raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


class _Finder(argparse.ArgumentParser):
    """A plain parser of one option (locate_config); raises ConfigError."""

    error = _Parser.error


def new_parser(
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
    """The one parser of the engine's options: --config and --version, then
    the groups of options.py in their order (docs/configuration.md's option tables follow
    it, which a unit test keeps in step): --help, --print-config,
    conf/all-options.ini and docs/configuration.md list the options so."""
    parser = new_parser(
        "gmock-engine",
        "A model-free, GPU-free vLLM engine core that joins a real frontend's "
        "handshake as N remote engines and streams token ids.",
        "Every option can also be set as environment variable GMOCK_<FLAG> "
        "(e.g. GMOCK_ENGINE_COUNT=4) or as key <flag> in section [gmock_engine] of the "
        "--config file (e.g. engine-count = 4). Precedence: command line > environment > "
        "config file > default.",
        ini_reader(CONFIG_SECTION),
        ENV_PREFIX,
        "INI config file with a [gmock_engine] section (keys = long flag names)",
    )
    parser.add_argument("--version", action="version", version=f"gmock_engine {__version__}")
    add_groups(parser, GROUPS)
    return parser


# -- where a value came from ------------------------------------------------------


def env_name(action: argparse.Action, prefix: str = ENV_PREFIX) -> str:
    """The environment variable of an option: --engine-count -> GMOCK_ENGINE_COUNT
    (with prefix GMOCK_SERVE_: serve's --port -> GMOCK_SERVE_PORT)."""
    if action.dest == "config":
        return ENV_PREFIX + "CONFIG"
    return prefix + long_flag(action)[2:].upper().replace("-", "_")


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


class Sources:
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
            read = ", ".join(f"[{s}]" for s in CONFIG_SECTIONS[:-1]) + f" and [{CONFIG_SECTIONS[-1]}]"
            raise ConfigError(f"argument --config: {where} has unknown section [{others[0]}]; only {read} are read")
        known = {long_flag(a)[2:] for a in self.options() if a.dest != "config"}
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


def parse_tool_config(
    parser: configargparse.ArgumentParser, section: str, argv: Sequence[str], env: Optional[Mapping[str, str]] = None
) -> argparse.Namespace:
    """Parse a tool's own options (record, fit: a parser of new_parser, its
    config file section `section`) from argv + environment + config file, as
    the engine's; raise ConfigError naming the flag and where its value came
    from. The namespace gets `sources` and `config`."""
    env = dict(os.environ if env is None else env)
    sources = Sources(parser, list(argv), env, section=section)
    sources.check_config_file()
    try:
        args = parser.parse_args(list(argv), namespace=sources.namespace(), env_vars=env)
    except ConfigError as exc:
        raise ConfigError(sources.explain(str(exc))) from None
    args.sources = sources.resolve(args)
    args.config = sources.config_path
    return args


def _load_tokenizer(args: argparse.Namespace, sources: "Sources") -> None:
    """Load --tokenizer at start (a missing library or a bad file stops the
    program here, naming the flag); its vocabulary sets --vocab-size unless
    that was given."""
    from gmock_engine.content.tokenizer import ContentUnavailable, load_tokenizer

    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (ContentUnavailable, ValueError, OSError) as exc:
        raise ConfigError(f"argument --tokenizer: {exc} (from {sources.of(sources.find('--tokenizer'))})") from None
    if args.sources["vocab_size"].kind == "default":
        args.vocab_size = tokenizer.vocab_size
    elif args.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"argument --vocab-size: {args.vocab_size} (from {sources.of(sources.find('--vocab-size'))}) is smaller "
            f"than the tokenizer's {tokenizer.vocab_size} ids (--tokenizer {args.tokenizer})"
        )


def parse_config(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """Parse argv + env + config file into a Namespace; raise ConfigError.

    The namespace gets `sources` (dest -> Source) for --print-config and
    logging, and `data_parallel_size` filled in.
    """
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    parser = build_parser()
    sources = Sources(parser, argv, env)
    sources.check_config_file()
    try:
        args = parser.parse_args(argv, namespace=sources.namespace(), env_vars=env)
    except ConfigError as exc:
        raise ConfigError(sources.explain(str(exc))) from None
    #: dest -> Source for every option (--print-config, logging, and what
    #: settings.py enforces only when given: `sources[name].kind != "default"`).
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
    if args.tokenizer is not None:
        _load_tokenizer(args, sources)
    elif args.token_source == "text":
        raise ConfigError(
            f"argument --token-source: text (from {sources.of(sources.find('--token-source'))}) needs --tokenizer PATH "
            "(the served model's tokenizer, which encodes the text)"
        )
    if args.token_id_range is not None and args.token_id_range.high > args.vocab_size:
        raise ConfigError(
            f"argument --token-id-range: {args.token_id_range} goes past "
            f"--vocab-size {args.vocab_size} (from {sources.of(sources.find('--token-id-range'))})"
        )
    _check_spec_decode(args, sources)
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
    if args.latency_profile:
        linear = [f for f in ("--itl-ms", "--itl-ms-per-request", "--prefill-ms-per-token") if getattr(args, f[2:].replace("-", "_"))]
        if linear:
            raise ConfigError(
                f"argument --latency-profile: the profile (from {sources.of(sources.find('--latency-profile'))}) times "
                f"the steps; {', '.join(f'{f} (from {sources.of(sources.find(f))})' for f in linear)} would be "
                "ignored: give one or the other"
            )
    #: Every configured fault, in KINDS order (runtime/runner.py hands them to each engine).
    args.faults = fault_specs(args)
    _check_kv_events(args, sources)
    return args


def reader(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> Callable[[], argparse.Namespace]:
    """The loader bound to one command line: each call parses it again, with
    the environment (`env`, or the process's as it is then) and the --config
    file as they are then, into parsed options (ConfigError as parse_config).
    runtime/cli.py makes one and hands it on: its first call starts the process,
    the later ones are the reloads (SIGHUP), which go on from the parsed
    options it returns."""
    argv = list(argv)
    return lambda: parse_config(argv, env)


def _check_spec_decode(args: argparse.Namespace, sources: "Sources") -> None:
    """--spec-tokens: no fixed chunk beside it, and K acceptance rates or one."""
    if not args.spec_tokens:
        return
    where = sources.of(sources.find("--spec-tokens"))
    if args.output_token_chunk_size > 1:
        raise ConfigError(
            f"argument --spec-tokens: {args.spec_tokens} (from {where}) makes each step's token count from the drafts "
            f"accepted; --output-token-chunk-size {args.output_token_chunk_size} (from "
            f"{sources.of(sources.find('--output-token-chunk-size'))}) fixes it: give one or the other"
        )
    if len(args.spec_acceptance) not in (1, args.spec_tokens):
        raise ConfigError(
            f"argument --spec-acceptance: {len(args.spec_acceptance)} rates (from "
            f"{sources.of(sources.find('--spec-acceptance'))}) for --spec-tokens {args.spec_tokens} (from {where}): "
            f"give {args.spec_tokens} (one per draft position) or 1"
        )


def _check_kv_events(args: argparse.Namespace, sources: "Sources") -> None:
    """--kv-events-config needs the prefix cache it reports on; the kv-*
    faults need the events they act on."""
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


def ini_text(value: Any) -> str:
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
        text = ini_text(getattr(args, action.dest))
        source = args.sources.get(action.dest, Source("default"))
        if action.dest == "data_parallel_size" and source.kind == "default":
            source = Source("default", "(start rank + engine count)")
        key = long_flag(action)[2:]
        prefix = "# " if action.dest == "config" else ""
        lines.append(f"{prefix}{key} = {text}".rstrip().ljust(48) + f" ; from {source} (env {env_name(action)})")
    return "\n".join(lines)


def options_template() -> str:
    """conf/all-options.ini: every option, commented out, with its default
    and help (regenerate: python -m gmock_engine.config.loader > conf/all-options.ini)."""
    import textwrap

    parser = build_parser()
    lines = [
        "; gmock_engine: every option, with its default.",
        "; Use: ./run.sh --config conf/all-options.ini   (or GMOCK_CONFIG=conf/all-options.ini ./run.sh)",
        "; Keys are the long flag names; each can also be set as environment variable GMOCK_<FLAG>",
        "; or on the command line. Precedence: command line > environment > this file > default.",
        "; Uncomment a line to set it. Booleans take true/false.",
        "; Generated by: python -m gmock_engine.config.loader > conf/all-options.ini",
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
            default = ini_text(action.default)
            lines += ["; " + line for line in textwrap.wrap(f"{action.help} (env {env_name(action)})", 96)]
            lines.append(f";{long_flag(action)[2:]} = {default}".rstrip())
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(options_template(), end="")
