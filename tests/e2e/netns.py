"""Hosts on one machine: network namespaces joined by a bridge, for the
multi-host e2e tests (test_multihost_e2e.py, benchmarks/link_faults.py).

`Hosts(n)` creates namespaces `gm-<pid>-<k>-1..n` (k numbers the Hosts of
one process), each with `lo` up and an `eth0` (one end of a veth pair) at
`10.<x>.0.<i>/24`; the other ends hang on a bridge `gm-<pid>-<k>b` in the
root namespace, which has `10.<x>.0.254`, so the
test process itself reaches every host (HTTP to a frontend) like a client on
the same LAN. `link_down(i)` / `link_up(i)` switch host i's bridge-side veth
end: its carrier goes, packets to and from it are dropped, TCP connections
stay open and retransmit (a cable pulled, not a host gone); with
`silent=True` the link stays up but leaves the bridge (packets lost, nobody
told: a switch or route failing). `run(i, argv)`
is the argv that runs a command in host i (`ip netns exec`).

Needs root and `ip netns`; `unavailable()` says why not (for a skip). Every
name starts with `gm-<pid>-`: `close()` removes what this process made, also
after a failure, and `remove_leftovers()` what processes that no longer run
left behind (a killed test run), so nothing piles up.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import subprocess
from typing import List, Optional, Sequence

PREFIX = "gm-"
ROOT_HOST = 254
#: Numbers the Hosts of one process, so that two at once do not collide.
_SERIAL = itertools.count(1)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def unavailable() -> Optional[str]:
    """Why network namespaces cannot be used here, or None when they can
    (root, `ip` present, a namespace can be created and removed)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
        run = subprocess.run(["ip", "netns", "exec", probe, "true"], capture_output=True, text=True, timeout=20)
        if run.returncode != 0:
            return f"`ip netns exec` failed: {run.stderr.strip() or run.returncode}"
        veth = _ip("link", "add", f"{PREFIX}{os.getpid()}-pv", "type", "veth", "peer", "name", "p0", "netns", probe,
                   check=False)  # fmt: skip
        if veth.returncode != 0:
            return f"`ip link add ... type veth` failed: {veth.stderr.strip() or veth.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"network namespaces are not usable: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
        _ip("link", "del", f"{PREFIX}{os.getpid()}-pv", check=False)
    return None


def _owner_alive(name: str) -> bool:
    m = re.match(rf"^{PREFIX}(\d+)-", name)
    if not m:
        return True  # not one of ours
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> List[str]:
    """Remove namespaces and links named gm-<pid>-... whose pid no longer runs; their names."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX) and not _owner_alive(name):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"^\d+:\s+([^:@\s]+)", line)
        if m and m.group(1).startswith(PREFIX) and not _owner_alive(m.group(1)):
            _ip("link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


def _free_subnet() -> int:
    """x of a 10.x.0.0/24 no interface here uses (starting from one the pid picks)."""
    used = set()
    for line in _ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
        m = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/(\d+)", line)
        if m:
            used.add(ipaddress.ip_network(f"{m.group(1)}/{m.group(2)}", strict=False))
    start = 100 + os.getpid() % 100
    for step in range(150):
        x = 100 + (start - 100 + step) % 150
        net = ipaddress.ip_network(f"10.{x}.0.0/24")
        if not any(net.overlaps(u) for u in used):
            return x
    raise RuntimeError("no free 10.x.0.0/24 subnet for the test hosts")


class Hosts:
    """`count` (1..9) emulated hosts on one bridge (see the module doc). A context manager:
    leaving it removes every namespace and link, whatever happened inside."""

    def __init__(self, count: int) -> None:
        if not 1 <= count <= 9:
            raise ValueError("1..9 hosts (a link's name has 15 characters at most)")
        self.count = count
        # gm-<pid>-<serial>: at most 13 characters, so "<tag>b" and "<tag>v<i>" fit a link name
        self.tag = f"{PREFIX}{os.getpid()}-{next(_SERIAL) % 100}"
        self.x = _free_subnet()
        self.names = [f"{self.tag}-{i}" for i in range(1, count + 1)]
        self.bridge = f"{self.tag}b"
        self._made: List[str] = []

    def address(self, i: int) -> str:
        """The IP of host i (1-based); `address(ROOT_HOST)` is the root namespace's."""
        return f"10.{self.x}.0.{i}"

    @property
    def root_address(self) -> str:
        return self.address(ROOT_HOST)

    @property
    def bridge_mac(self) -> str:
        """The bridge's (the root's) MAC: locally administered, from the subnet."""
        return f"02:00:0a:{self.x:02x}:00:{ROOT_HOST:02x}"

    def veth(self, i: int) -> str:
        """The bridge-side end of host i's link (what link_down switches)."""
        return f"{self.tag}v{i}"

    def name(self, i: int) -> str:
        return self.names[i - 1]

    def run(self, i: int, argv: Sequence[str]) -> List[str]:
        """`argv` run inside host i."""
        return ["ip", "netns", "exec", self.name(i), *map(str, argv)]

    def open(self) -> "Hosts":
        """Create everything; on a failure remove what was made and raise."""
        remove_leftovers()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(self.bridge)
            # A bridge takes the lowest MAC of its ports unless given one: a silent
            # link_down of the port holding it would change the root's MAC under the
            # other hosts' ARP entries, and cut them off the client too.
            _ip("link", "set", self.bridge, "address", self.bridge_mac)
            _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.names, start=1):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._made.append(self.veth(i))
                _ip("link", "set", self.veth(i), "master", self.bridge)
                _ip("link", "set", self.veth(i), "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def link_down(self, i: int, silent: bool = False) -> None:
        """Cut host i off the bridge (both directions). Default: its link goes down
        (host i sees no carrier, as with a pulled cable: its own sends fail at once).
        `silent`: the link is taken off the bridge but stays up on both ends, so
        nobody is told and every packet is just lost (a switch or a route failing
        between the hosts)."""
        if silent:
            _ip("link", "set", self.veth(i), "nomaster")
        else:
            _ip("link", "set", self.veth(i), "down")

    def link_up(self, i: int, silent: bool = False) -> None:
        """Undo link_down(i, silent)."""
        if silent:
            _ip("link", "set", self.veth(i), "master", self.bridge)
        else:
            _ip("link", "set", self.veth(i), "up")

    def close(self) -> None:
        """Remove every namespace and link made (idempotent, never raises)."""
        for thing in reversed(self._made):
            if thing in self.names:
                _ip("netns", "del", thing, check=False)
            else:
                _ip("link", "del", thing, check=False)
        self._made.clear()

    def __enter__(self) -> "Hosts":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
