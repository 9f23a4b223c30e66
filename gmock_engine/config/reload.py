"""Live reconfiguration (SIGHUP): what a reload changes, decided without I/O.

`kill -HUP <pid>` makes the process read its configuration again, the way
it did at start: the same command line, which keeps its precedence, the
environment and the --config file (command line > environment > config
file > default). A reload re-enters start-up (argv -> parsed options ->
settings -> app) at the parsed options: `compare(current, new)` compares
the parsed options read again with those in force, and `check(current,
read)` first reads them with `read`, the loader stage runtime/cli.py bound to the
process's command line (config.reader), whose ConfigError refuses the
reload. This module knows the parsed options (parsed.py) and the settings,
never the loader. Both return a `Reload`:

* `changes`: the options in RELOADABLE (declared so in options.py) whose value changed, each with
  old -> new and the source of the new value;
* `config`: the configuration from now on: the current one with the
  reloadable options as read (every other option as it was);
* `fixed`: options that changed but cannot while the process runs (the
  handshake, the engine count and ranks, the processes, the wire layout,
  what READY told the frontend, ...): left as they are, named in one warning;
* `error`: a bad file or value (the ConfigError message, naming the flag
  and its source): then nothing changes at all.

The runtime applies a Reload (runtime/app.py, `App.reload`): logging and the
summary interval at once, each engine's settings through its stepper,
between two steps. Like the rest of the configuration, this module imports
neither gevent nor zmq.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional

from gmock_engine.config import options
from gmock_engine.config.parsed import ENFORCED_WHEN_GIVEN, ConfigError, Source, effective, fault_specs

if TYPE_CHECKING:
    from gmock_engine.faults.specs import FaultSpec
    from gmock_engine.config.settings import EngineSettings, Settings

#: --fault-*: each engine's fault layer is rebuilt (fault_injection.build).
FAULTS = options.reloading(options.FAULT_LAYER)
#: Every option a reload applies (each says so where it is declared, options.py,
#: with when it applies); any other option is fixed while the process runs.
RELOADABLE = options.RELOADABLE

#: Not options to compare: how the configuration is found, a one-shot action.
NOT_COMPARED = frozenset({"config", "print_config"})

#: What the supervisor of --processes appends to every worker's command line
#: (processes.worker_command), so a worker never sees them change in the
#: file: the supervisor names them in its warning instead.
WORKER_COMMAND_LINE = ("processes", "data_parallel_start_rank", "engine_count", "data_parallel_size", "metrics_port")


def show(value: Any) -> str:
    """A value as the reload line writes it: as in the config file, quoted
    when it has spaces (fault specs), `unset` for none, floats shortest."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.15g}"
    if hasattr(value, "label"):  # a file read with its option (--latency-profile): path and content
        return str(value.label)
    text = ",".join(str(v) for v in value) if isinstance(value, (tuple, list)) else str(value)
    return repr(text) if not text or any(c.isspace() for c in text) else text


@dataclass(frozen=True)
class Change:
    """One option whose value a reload found changed."""

    dest: str
    flag: str
    old: str
    new: str
    #: where the new value came from
    source: Source

    def __str__(self) -> str:
        return f"{self.flag} {self.old} -> {self.new} ({self.source})"


@dataclass
class Reload:
    """What a reload found (see the module docstring)."""

    config: Optional[argparse.Namespace]
    changes: List[Change] = field(default_factory=list)
    fixed: List[Change] = field(default_factory=list)
    error: Optional[str] = None

    def changed(self, dests: Iterable[str]) -> bool:
        """True when one of these options changed."""
        wanted = set(dests)
        return any(c.dest in wanted for c in self.changes)

    def fixed_among(self, dests: Iterable[str]) -> List[Change]:
        """The fixed options among these that changed (the supervisor's share)."""
        wanted = set(dests)
        return [c for c in self.fixed if c.dest in wanted]

    def refused_line(self, generation: Optional[int] = None, engines: str = "") -> str:
        """The log line of a reload refused (`error`): `generation` stays in force."""
        context = ", ".join(p for p in (f"generation {generation} stays" if generation is not None else "", engines) if p)
        return f"config reload refused, nothing changed{f' ({context})' if context else ''}: {self.error}"

    def line(self, generation: int, engines: str = "") -> str:
        """The one log line of a reload that took, as `generation` (of the
        `engines` of this process, e.g. "engines 0..3"): every change,
        old -> new (source of the new value)."""
        context = ", ".join(p for p in (f"generation {generation}", engines) if p)
        if not self.changes:
            return f"config reload ({context}): no reloadable option changed"
        return f"config reload ({context}): " + "; ".join(str(c) for c in self.changes)


def fixed_line(changes: List[Change]) -> str:
    """The one warning naming the options a reload cannot change."""
    return "config reload: cannot change while running, left as they are: " + "; ".join(str(c) for c in changes)


def refused(reason: str) -> Reload:
    """A reload that changes nothing, and why."""
    return Reload(None, error=reason)


def _show_effective(dest: str, value: Any) -> str:
    if value is None and dest in ENFORCED_WHEN_GIVEN:
        return "unlimited"
    return show(value)


def check(current: argparse.Namespace, read: Callable[[], argparse.Namespace]) -> Reload:
    """Read the parsed options again (`read`: the loader stage bound to the
    process's command line, config.reader) and `compare` them with
    `current`; a ConfigError refuses the reload."""
    try:
        new = read()
    except ConfigError as exc:
        return refused(str(exc))
    return compare(current, new)


def compare(current: argparse.Namespace, new: argparse.Namespace) -> Reload:
    """The Reload from the parsed options in force to `new` (read again)."""
    merged = argparse.Namespace(**vars(current))
    merged.sources = dict(current.sources)
    result = Reload(merged)
    for dest, option in options.OPTIONS.items():
        if dest in NOT_COMPARED or not hasattr(new, dest):
            continue
        old_value, new_value = effective(current, dest), effective(new, dest)
        change = None
        if old_value != new_value:
            source = new.sources[dest]
            if dest == "data_parallel_size" and source.kind == "default":
                source = Source("default", "= start rank + engine count")
            change = Change(dest, option.flag, _show_effective(dest, old_value), _show_effective(dest, new_value), source)
        if dest in RELOADABLE:
            # the value and its source as read (a source may move, e.g. from
            # the file to the environment, without a change of value)
            setattr(merged, dest, getattr(new, dest))
            merged.sources[dest] = new.sources[dest]
            if change is not None:
                result.changes.append(change)
        elif change is not None:
            result.fixed.append(change)
    merged.faults = fault_specs(merged)
    # the loader checked the new values against each other; a reloadable
    # one must also fit the fixed options in force
    id_range = merged.token_id_range
    if id_range is not None and id_range.high > merged.vocab_size:
        return refused(
            f"argument --token-id-range: {id_range} goes past --vocab-size {merged.vocab_size} "
            f"(from {merged.sources['token_id_range']}), and --vocab-size cannot change while running"
        )
    spec_tokens, rates = merged.spec_tokens, merged.spec_acceptance
    if spec_tokens and len(rates) not in (1, spec_tokens):
        return refused(
            f"argument --spec-acceptance: {len(rates)} rates (from {merged.sources['spec_acceptance']}) for "
            f"--spec-tokens {spec_tokens} draft positions: give {spec_tokens} or 1 (--spec-tokens cannot change while running)"
        )
    return result


@dataclass
class Reconfiguration:
    """One engine's share of a Reload (App.reload hands it to the engine's
    runner): its stepper takes it between two steps."""

    #: The configuration generation it makes (App.generation).
    generation: int
    #: The configuration in force from now on (Reload.config).
    config: Any
    #: The engine's new settings (None: not joined yet; its handshake builds them from `parts`).
    settings: Optional["EngineSettings"]
    #: The new --fault-* specs; None: unchanged (the fault layer stays as it is).
    faults: Optional[List["FaultSpec"]]
    #: The settings from `config` (settings.from_config): what the engine's
    #: handshake builds its EngineSettings from when it had not joined yet.
    parts: Optional["Settings"] = None
