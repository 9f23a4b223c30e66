"""docs/configuration.md, generated from the parsers: every option of the
engine (config.build_parser, declared in config/options.py) and of `./run.sh serve`
(serve_config.py), group by group as the parsers hold them: flag, variable,
config-file key, default, whether a reload (SIGHUP) changes it and when,
and its help. tests/unit/test_config.py fails when the page is stale.

Regenerate: python -m gmock_engine.tools.config_reference > docs/configuration.md
"""

from __future__ import annotations

import argparse
from typing import List

from gmock_engine.config.loader import CALIBRATE_SECTION, CONFIG_SECTION, ENV_PREFIX, FIT_SECTION, PROFILE_SECTION, RECORD_SECTION, SERVE_SECTION, build_parser, env_name, ini_text
from gmock_engine.config.option import long_flag
from gmock_engine.config.options import OPTIONS
from gmock_engine.tools.calibrate import CALIBRATE_ENV_PREFIX, build_calibrate_parser
from gmock_engine.tools.fit import FIT_ENV_PREFIX, build_fit_parser
from gmock_engine.tools.gpu_profile import PROFILE_ENV_PREFIX, build_profile_parser
from gmock_engine.tools.record_config import RECORD_ENV_PREFIX, build_record_parser
from gmock_engine.tools.serve_config import SERVE_ENV_PREFIX, build_serve_parser

#: How to regenerate docs/configuration.md (the page says it; its test names it).
REFERENCE_COMMAND = "python -m gmock_engine.tools.config_reference > docs/configuration.md"


def _md(text: str) -> str:
    """Text for a Markdown table cell: no cell breaks, emphasis or HTML tags."""
    for plain, escaped in (("|", "\\|"), ("*", "\\*"), ("<", "&lt;"), (">", "&gt;")):
        text = text.replace(plain, escaped)
    return text


def reference_tables(parser: argparse.ArgumentParser, section: str, env_prefix: str, reloads: bool) -> List[str]:
    """One Markdown table per option group of `parser`, in the parser's order;
    `reloads`: with the column of what a reload does (config/options.py declares it)."""
    lines: List[str] = []
    head = ["flag", "environment", f"key in [{section}]", "default"] + (["reloads (SIGHUP)"] if reloads else []) + ["meaning"]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest not in ("help", "version")]
        if not actions:
            continue
        title = "general" if group.title in ("options", "optional arguments") else group.title
        lines += ["", f"### {_md(title)}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for action in actions:
            flags = " / ".join(f"`{o}`" for o in action.option_strings)
            key = "–" if action.dest == "config" else f"`{long_flag(action)[2:]}`"
            default = ini_text(action.default)
            row = [flags, f"`{env_name(action, env_prefix)}`", key, f"`{default}`" if default else "–"]
            if reloads:
                option = OPTIONS.get(action.dest)
                when = option.reload if option is not None else None
                row.append(f"yes, {when}" if when else "no")
            lines.append("| " + " | ".join(row + [_md(action.help or "")]) + " |")
    return lines


def reference_page() -> str:
    """docs/configuration.md: every option of the engine and of `./run.sh serve`,
    as the parsers declare them (regenerate: REFERENCE_COMMAND)."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the parsers; do not edit. Regenerate: {REFERENCE_COMMAND} -->",
        "",
        "Every option of the engine (`./run.sh`, `python -m gmock_engine`) and of `./run.sh serve`, "
        "`./run.sh record`, `./run.sh calibrate`, `./run.sh fit` and `./run.sh profile`, generated from their parsers (`gmock_engine/config/options.py`, "
        "`gmock_engine/tools/serve_config.py`, `record.py`, `calibrate.py`, `fit.py`, `gpu_profile.py`). "
        "Each option can be given on the command line, as its environment variable or as its key in "
        "the `--config` INI file. One precedence for all: "
        "**command line > environment > config file > default**. A boolean flag also has its "
        "`--no-` form; in the file and the environment it takes `true`/`false`. "
        "`--print-config` prints every value and where it came from.",
        "",
        "Regenerate this page after changing an option (tests/unit/test_config.py fails when it is stale):",
        "",
        "```sh",
        f".venv/bin/{REFERENCE_COMMAND}",
        "```",
        "",
        f"## The engine: section `[{CONFIG_SECTION}]`, variables `{ENV_PREFIX}<FLAG>`",
        "",
        "`kill -HUP <pid>` reads the configuration again ([live reconfiguration](reload.md)): an option "
        "marked *reloads* takes its new value, when the column says; any other keeps the value it "
        "started with, named in one warning.",
    ]
    lines += reference_tables(build_parser(), CONFIG_SECTION, ENV_PREFIX, reloads=True)
    tools = (
        ("`./run.sh serve`", build_serve_parser, SERVE_SECTION, SERVE_ENV_PREFIX,
         "Read once at start; every other argument of `./run.sh serve` is an engine option, passed through."),
        ("`./run.sh record`", build_record_parser, RECORD_SECTION, RECORD_ENV_PREFIX, "The record tap ([record](record.md))."),
        ("`./run.sh calibrate`", build_calibrate_parser, CALIBRATE_SECTION, CALIBRATE_ENV_PREFIX,
         "A standard sweep through a frontend while the record tap records it ([latency profile](latency-profile.md)); "
         "the tap's options are `./run.sh record`'s."),
        ("`./run.sh fit TRACE...`", build_fit_parser, FIT_SECTION, FIT_ENV_PREFIX,
         "The fit of a latency profile ([latency profile](latency-profile.md)); the traces are arguments."),
        ("`./run.sh profile`", build_profile_parser, PROFILE_SECTION, PROFILE_ENV_PREFIX,
         "A GPU deployment's profile from AIConfigurator's tables ([GPU profiles](gpu-profiles.md)); needs the `gpu` extra."),
    )  # fmt: skip
    for title, build, section, prefix, intro in tools:
        lines += ["", f"## {title}: section `[{section}]`, variables `{prefix}<FLAG>`", "", intro]
        lines += reference_tables(build(), section, prefix, reloads=False)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_page(), end="")
