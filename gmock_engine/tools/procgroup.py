"""Child processes that leave nothing behind: a frontend or an engine started in
its own session, stopped as a group.

Used by `./run.sh serve` (tools/serve.py) and the e2e harness. A `ProcessGroup`
starts a command in a new session (its own process group, out of reach of the
terminal's Ctrl-C, which goes to the parent only) with its output appended to a
log file, and tracks the leader's descendants too, so a child that moved to a
session of its own (e.g. an engine worker started with setsid) is stopped with
it. `stop_groups` ends groups with SIGTERM, repeated (vLLM 0.32 swallows a
SIGTERM that arrives while it waits for engines), then SIGKILL.

Also here: the process table from /proc, free TCP ports, and a LISTEN check
that reads /proc/net/tcp instead of connecting (a probe connection to a
frontend's ZMQ handshake ROUTER would count as a bogus peer). Standard
library only; Linux (/proc).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import random
import shlex
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple


#: Where free_ports looks when the kernel's ephemeral range cannot be read.
_DEFAULT_EPHEMERAL = (32768, 60999)
_LOWEST_PORT = 10000


def ephemeral_range() -> Tuple[int, int]:
    """The kernel's ephemeral port range (ip_local_port_range), inclusive."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """`count` distinct free TCP ports on `host` (held open together while
    picking), chosen outside the kernel's ephemeral range: a port picked
    there and released can be handed out again to anything that binds port
    0 before its user binds it (a frontend's own ZMQ sockets bind
    `tcp://127.0.0.1:*`; CI once saw serve's HTTP port answer with a ZMQ
    greeting). Falls back to the ephemeral range when the rest is taken."""
    low, high = ephemeral_range()
    candidates = [p for p in range(_LOWEST_PORT, 65536) if not low <= p <= high]
    # a random handful is plenty (shuffling every candidate port costs for nothing)
    candidates = random.Random().sample(candidates, min(len(candidates), 16 * count))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: List[socket.socket] = []
    try:
        for port in candidates + [0] * count:
            if len(socks) == count:
                break
            s = socket.socket(family, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def is_listening(port: int, pid: Optional[int] = None) -> bool:
    """Is some socket LISTENing on TCP `port` (any address)? From /proc/net/tcp{,6}
    of this process's network namespace, or of process `pid`'s."""
    suffix = f":{port:04X}"
    root = "/proc" if pid is None else f"/proc/{pid}"
    for table in (f"{root}/net/tcp", f"{root}/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == "0A" and fields[1].endswith(suffix):
                        return True
        except (FileNotFoundError, ProcessLookupError):
            continue
    return False


def tail_text(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def tail_file(path: Path, lines: int = 40, max_bytes: int = 256 * 1024) -> str:
    """The last `lines` lines of a (log) file, read from its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return f"<no log file {path}>"
    return tail_text(data, lines)


def proc_table() -> Dict[int, Tuple[str, int, int]]:
    """pid -> (state, ppid, pgid) for every process, from /proc/<pid>/stat."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces/parens: split after the last ')'.
        rest = stat[stat.rfind(")") + 2 :].split()
        if len(rest) >= 3:
            table[int(entry)] = (rest[0], int(rest[1]), int(rest[2]))
    return table


def group_members(pgid: int) -> List[int]:
    """PIDs (not zombies) whose process group is `pgid`."""
    return sorted(pid for pid, (state, _, grp) in proc_table().items() if grp == pgid and state != "Z")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux
    PR_SET_PDEATHSIG), so a SIGKILLed `serve` leaves no frontend behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


_LIVE_GROUPS: "Set[ProcessGroup]" = set()
_LIVE_LOCK = threading.Lock()


class ProcessGroup:
    """A child started in its own session/process group, output appended to a log file.

    Besides the group it tracks the leader's descendants, so a child that moved to a
    session of its own is stopped too. `die_with_parent`: the leader gets SIGTERM when
    this process dies (PR_SET_PDEATHSIG). Subclasses may set `announce` (a callable
    taking one line, e.g. print) and `log_prefix` (put before the command line that
    heads the log).
    """

    announce: Callable[[str], None] = staticmethod(lambda line: None)
    log_prefix = ""

    def __init__(self, name: str, argv: List[str], log_path: Path, env: dict, cwd: Optional[Path] = None,
                 die_with_parent: bool = False):  # fmt: skip
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"{self.log_prefix}$ {shlex.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=str(cwd) if cwd else None, start_new_session=True,
                preexec_fn=_die_with_parent if die_with_parent else None,
            )  # fmt: skip
        self.pgid = self.popen.pid  # start_new_session: the child leads its own group
        self.tracked: Set[int] = {self.pgid}
        with _LIVE_LOCK:
            _LIVE_GROUPS.add(self)
        self.announce(f"started {name} pid={self.pgid} log={self.log_path}")

    def alive(self) -> bool:
        """Is the leader process still running?"""
        return self.popen.poll() is None

    def refresh(self) -> List[int]:
        """Track new group members and descendants; return the live tracked pids."""
        self.popen.poll()  # reap the leader if it exited
        table = proc_table()
        live = {pid for pid, (state, _, _) in table.items() if state != "Z"}
        self.tracked = {pid for pid in self.tracked if pid in live}
        self.tracked |= {pid for pid, (state, _, grp) in table.items() if grp == self.pgid and state != "Z"}
        children: Dict[int, List[int]] = {}
        for pid, (_, ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        stack = list(self.tracked)
        while stack:
            for child in children.get(stack.pop(), []):
                if child in live and child not in self.tracked:
                    self.tracked.add(child)
                    stack.append(child)
        self.tracked.discard(os.getpid())
        return sorted(self.tracked)

    def members(self) -> List[int]:
        return self.refresh()

    def gone(self) -> bool:
        return self.popen.poll() is not None and not self.refresh()

    def signal(self, sig: int, outside: bool = True) -> None:
        """Signal the group and, with `outside`, every tracked process outside it (and
        the group it leads). The first SIGTERM goes to the group only: a process that
        stops its own workers would otherwise hand each of them a second signal, which
        many programs (gmock_engine's workers too) take as "exit at once"."""
        pids = self.refresh()
        targets = {self.pgid}
        if outside:
            table = proc_table()
            targets |= {table[pid][2] for pid in pids if pid in table and table[pid][2] == pid}
        for grp in targets - {os.getpgrp(), 0}:
            try:
                os.killpg(grp, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if outside:
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def tail(self, lines: int = 40) -> str:
        return tail_file(self.log_path, lines)

    def describe_exit(self) -> str:
        rc = self.popen.poll()
        return "running" if rc is None else f"exited rc={rc}"

    def forget(self) -> None:
        with _LIVE_LOCK:
            _LIVE_GROUPS.discard(self)


def stop_groups(groups: List[ProcessGroup], term_timeout: float = 25.0, repeat_every: float = 5.0,
                kill_timeout: float = 10.0) -> List[str]:  # fmt: skip
    """SIGTERM every group (repeated every `repeat_every` s), wait up to
    `term_timeout`, then SIGKILL what is left.

    Returns a list of problems (groups that needed SIGKILL or that survived it); an
    empty list means all went down on SIGTERM. Never raises.
    """
    problems: List[str] = []
    groups = [g for g in groups if g is not None]
    t0 = time.monotonic()
    for g in groups:
        g.signal(signal.SIGTERM, outside=False)
    last_term = t0
    while time.monotonic() - t0 < term_timeout and not all(g.gone() for g in groups):
        time.sleep(0.1)
        if time.monotonic() - last_term >= repeat_every:
            last_term = time.monotonic()
            for g in groups:
                if not g.gone():
                    g.signal(signal.SIGTERM)
    for g in groups:
        if not g.gone():
            problems.append(f"{g.name} (pgid {g.pgid}): pids {g.members()} still there "
                            f"{term_timeout:.0f}s after SIGTERM: sent SIGKILL")  # fmt: skip
            g.signal(signal.SIGKILL)
    t1 = time.monotonic()
    while time.monotonic() - t1 < kill_timeout and not all(g.gone() for g in groups):
        time.sleep(0.1)
    for g in groups:
        try:
            g.popen.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        left = g.members()
        if left or g.popen.poll() is None:
            problems.append(f"{g.name} (pgid {g.pgid}) survived SIGKILL: pids {left}")
        else:
            g.forget()
        g.announce(f"stopped {g.name} pgid={g.pgid}: {g.describe_exit()} after {time.monotonic() - t0:.1f}s")
    return problems


def kill_all_now() -> None:
    """SIGKILL every group still live in this process (a second Ctrl-C, atexit)."""
    with _LIVE_LOCK:
        groups = list(_LIVE_GROUPS)
    for g in groups:
        g.signal(signal.SIGKILL)


atexit.register(kill_all_now)  # last resort (e.g. pytest interrupted between setup and teardown)
