"""The parsed options: what the loader (loader.py) hands on to the settings
(settings.py) and to a reload (reload.py).

Start-up is one way: argv -> parsed options -> settings -> app. The parsed
options are an `argparse.Namespace` with every option's value (by dest),
`sources` (dest -> `Source`: where each value came from), `faults` (the
--fault-* specs given, in faults.KINDS order) and `config` (the --config
path). A bad value raises `ConfigError`, whose message names the flag and
the value's source. This module is what the later stages know of the
loader: they never call it or its parser.

Pure: neither gevent nor zmq, nor configargparse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

from gmock_engine.faults.specs import KINDS


class ConfigError(Exception):
    """A configuration problem; the message names the flag and its source."""


@dataclass
class Source:
    """Where an option's value came from."""

    kind: str  # "command line" | "environment" | "config file" | "default"
    detail: str = ""  # variable name, or "FILE, key KEY"

    def __str__(self) -> str:
        return f"{self.kind} {self.detail}".strip()


def fault_specs(options: Any) -> List[Any]:
    """Every configured --fault-* spec, in faults.KINDS order (the parsed
    options' `faults`)."""
    found = (getattr(options, "fault_" + kind.replace("-", "_")) for kind in KINDS)
    return [spec for spec in found if spec is not None]


#: Limits in effect only when given: the value, or unlimited (None) when it
#: comes from the default (then READY only reports it).
ENFORCED_WHEN_GIVEN = frozenset({"max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks"})


def effective(options: Any, name: str) -> Any:
    """What option `name` of the parsed options does: its value, or None for
    a limit of ENFORCED_WHEN_GIVEN left at its default (settings.py and a
    reload's comparison read the limits so)."""
    if name in ENFORCED_WHEN_GIVEN and options.sources[name].kind == "default":
        return None
    return getattr(options, name)
