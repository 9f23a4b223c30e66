"""What an engine option is: `Option` and `Group`, and when a reload applies one.

options.py declares every option with these; config.build_parser adds the
groups to its parser (add_groups), and reload.py asks each option's `reload`.

Pure: neither gevent nor zmq, nor configargparse (the groups are added to
any argparse parser).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

# -- when a reload applies an option (Option.reload) ------------------------------

#: The latency model and the scheduler's limits: from each engine's next step
#: (READY keeps the limits it reported).
NEXT_STEP = "from each engine's next step"
#: How requests end, where tokens and logprobs come from.
NEW_REQUESTS = "for the requests that arrive from then on"
#: --fault-*: each engine's fault layer is rebuilt (fault_injection.rebuild).
FAULT_LAYER = "each engine's fault layer is rebuilt"
#: Logging, the books and how the process stops.
AT_ONCE = "at once"


@dataclass(frozen=True)
class Option:
    """One option as declared: the parser's arguments and its reload behaviour."""

    flag: str
    help: str
    default: Any = None
    #: the value type (validators.py); None: the text as given
    type: Optional[Callable[[str], Any]] = None
    #: --flag / --no-flag (argparse.BooleanOptionalAction)
    boolean: bool = False
    metavar: Optional[str] = None
    #: when a reload applies it (one of the constants above); None: fixed while running
    reload: Optional[str] = None
    #: the EngineSettings field it reaches each engine by on a reload
    setting: Optional[str] = None
    #: other spellings on the command line (-o, a vLLM flag's name)
    aliases: Tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        """The namespace attribute: --engine-count -> engine_count."""
        return self.flag[2:].replace("-", "_")

    def add_to(self, group: Any) -> argparse.Action:
        """Add this option to a parser or argument group."""
        kwargs: dict = {"default": self.default, "help": self.help}
        if self.boolean:
            kwargs["action"] = argparse.BooleanOptionalAction
        if self.type is not None:
            kwargs["type"] = self.type
        if self.metavar is not None:
            kwargs["metavar"] = self.metavar
        return group.add_argument(self.flag, *self.aliases, dest=self.dest, **kwargs)


@dataclass(frozen=True)
class Group:
    """An option group: its title (None: the parser's own, untitled group) and options."""

    title: Optional[str]
    options: Tuple[Option, ...]


def long_flag(action: argparse.Action) -> str:
    """An argparse action's long flag: --log-json, not --no-log-json."""
    return next(o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-"))


def add_groups(parser: Any, groups: Tuple[Group, ...]) -> None:
    """Add `groups` to an argparse parser, each as one argument group."""
    for group in groups:
        target = parser if group.title is None else parser.add_argument_group(group.title)
        for option in group.options:
            option.add_to(target)
