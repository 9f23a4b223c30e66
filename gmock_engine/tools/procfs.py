"""CPU time and RSS of a process tree, from /proc (Linux).

Shared by the bench driver (the engine under load, with its --processes
workers) and benchmarks/soak.py and behind_frontend.py (the engine and the
frontend beside it). Processes that vanish between listing and reading are
skipped, not an error.
"""

from __future__ import annotations

import os
from typing import Dict, List

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields(pid: int) -> List[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces and ')'):
    field 0 is the state, 1 the ppid, 11/12 utime/stime, 21 the RSS in pages."""
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> List[int]:
    """pid and all its descendants (for --processes workers)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_stat_fields(int(entry))[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def tree_cpu_seconds(pids: List[int]) -> float:
    """utime + stime of the given processes, seconds."""
    total = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def tree_rss_bytes(pids: List[int]) -> int:
    """Resident set size of the given processes, bytes."""
    total = 0
    for pid in pids:
        try:
            total += int(_stat_fields(pid)[21]) * PAGE
        except OSError:
            continue
    return total
