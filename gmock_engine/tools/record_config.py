"""`./run.sh record`'s options (the tap itself: record.py): declared as the
engine's are, read from the command line, GMOCK_RECORD_* and [record] of
--config. Pure: no zmq, so the configuration reference can list them."""

from __future__ import annotations

import argparse
from typing import Any, Mapping, Optional, Sequence

from gmock_engine.config.loader import ENV_PREFIX, RECORD_SECTION, ConfigError, ini_reader, new_parser, parse_tool_config
from gmock_engine.config.option import Group, Option, add_groups
from gmock_engine.config.validators import int_at_least, nonempty, zmq_address

#: `./run.sh record`'s options, also as GMOCK_RECORD_<FLAG> or in [record] of --config.
RECORD_ENV_PREFIX = ENV_PREFIX + "RECORD_"
GROUPS = (
    Group(
        None,
        (
            Option("--handshake-address", "the frontend's handshake ROUTER (as for an engine); required", type=zmq_address),
            Option("--engine-handshake-address", "the handshake ROUTER the tap binds for the engines; required", type=zmq_address),
            Option("--engine-count", "engines behind the tap", default=1, type=int_at_least(1, 0xFFFF), aliases=("--data-parallel-size-local",)),
            Option("--data-parallel-start-rank", "rank of the first engine", default=0, type=int_at_least(0, 0xFFFF)),
            Option("--advertise-host", "host the engines reach the tap's data sockets at (default: the engine handshake host)"),
            Option("--output", "trace file (JSON lines, docs/record.md)", default="trace.jsonl", type=nonempty, aliases=("-o",)),
            Option("--record-token-ids", "also record prompt and output token ids", default=False, boolean=True),
        ),
    ),
)


def build_record_parser() -> Any:
    """The parser of `./run.sh record`'s options."""
    parser = new_parser(
        "gmock-engine record",
        "Record tap between a frontend and engine cores (docs/record.md).",
        "Each option can also be set as environment variable GMOCK_RECORD_<FLAG> or as key <flag> in section "
        f"[{RECORD_SECTION}] of the --config file. Precedence: command line > environment > config file > default.",
        ini_reader(RECORD_SECTION),
        RECORD_ENV_PREFIX,
        f"INI config file with a [{RECORD_SECTION}] section (keys = long flag names)",
    )
    add_groups(parser, GROUPS)
    return parser


def parse_args(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """The tap's options from argv + GMOCK_RECORD_* + [record]; ConfigError names the flag and its source."""
    args = parse_tool_config(build_record_parser(), RECORD_SECTION, argv, env)
    for name in ("handshake_address", "engine_handshake_address"):
        if getattr(args, name) is None:
            raise ConfigError(f"argument --{name.replace('_', '-')} is required (or GMOCK_RECORD_{name.upper()}, or key {name.replace('_', '-')} in [{RECORD_SECTION}])")
    return args
