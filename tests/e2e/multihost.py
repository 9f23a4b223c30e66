"""A frontend host and engine hosts, each its own network namespace
(netns.Hosts), started as docs/operations.md "Engines on several hosts" says.

Host 1 runs the frontend with `--data-parallel-address <host 1's IP>` and the
handshake on port 29550, HTTP on 0.0.0.0:8000 (the namespaces have ports of
their own, so the recipe's fixed ports are used as written); host 2.. each run
one gmock_engine process with `--handshake-address tcp://<host 1>:29550` and
its slice of the ranks. The test process reaches HTTP over the bridge, like a
client on the LAN. Everything else (process groups, logs, stop) is
e2e_harness.Stack's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import e2e_harness as h
import netns
from gmock_engine.tools import frontends as _frontends

HANDSHAKE_PORT = 29550
HTTP_PORT = 8000


def netns_of(pid: int) -> Optional[int]:
    """The inode of process `pid`'s network namespace (None if gone)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


class MultiHostStack(h.Stack):
    """`topology.engine_processes[k]` runs on host k + 2; the frontend on host 1.

    `advertise`: the frontend's --data-parallel-address (default: host 1's IP;
    a misconfiguration test gives 127.0.0.1 or 0.0.0.0). `handshake_host`: the
    address the engines are given (default host 1's IP)."""

    def __init__(self, topology: h.Topology, frontends: h.Frontends, model_dir: Path, log_dir: Path,
                 hosts: netns.Hosts, engine_args: Optional[list] = None, advertise: Optional[str] = None,
                 handshake_host: Optional[str] = None, handshake_port: int = HANDSHAKE_PORT,
                 frontend_dp: Optional[int] = None):
        super().__init__(topology, frontends, model_dir, log_dir, engine_args=engine_args)
        self.hosts = hosts
        self.frontend_ip = hosts.address(1)
        self.advertise = advertise or self.frontend_ip
        self.handshake_host = handshake_host or self.frontend_ip
        self.hs_port, self.http_port = HANDSHAKE_PORT, HTTP_PORT
        self.engine_hs_port = handshake_port
        self.frontend_dp = frontend_dp or topology.dp
        self.base_url = f"http://{self.frontend_ip}:{HTTP_PORT}"

    def frontend_argv(self) -> list:
        """docs/operations.md's frontend line for this topology, run in host 1."""
        t, fe = self.topology, self.frontends
        common = [str(self.model_dir), "--served-model-name", h.MODEL_NAME,
                  "--data-parallel-size", str(self.frontend_dp), "--data-parallel-size-local", "0"]
        if t.frontend == "python":
            argv = [str(fe.python), str(_frontends.VLLM_CLI), "serve", *common, "--api-server-count", str(t.api_servers),
                    "--data-parallel-address", self.advertise, "--data-parallel-rpc-port", str(HANDSHAKE_PORT),
                    "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
        else:
            argv = [str(fe.vllm_rs), "serve", *common, "--data-parallel-address", self.advertise,
                    "--handshake-port", str(HANDSHAKE_PORT), "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
        return self.hosts.run(1, argv)

    def engine_host(self, index: int) -> int:
        """The host (2..) that engine process `index` runs on."""
        return index + 2

    def engine_argv(self, process_args: Optional[tuple] = None, index: int = 0) -> list:
        ranks = list(process_args) if process_args else ["--engine-count", str(self.topology.dp)]
        argv = [str(h.RUN_SH), "--handshake-address", f"tcp://{self.handshake_host}:{self.engine_hs_port}", *ranks,
                *(["--log-requests"] if self.log_requests else []), *self.engine_args]
        return self.hosts.run(self.engine_host(index), argv)

    def start_frontend(self) -> None:
        t0 = time.monotonic()
        self.frontend = h.ProcessGroup(f"{self.topology.frontend}-frontend", self.frontend_argv(),
                                       self.log_dir / "frontend.log",
                                       env={**h.frontend_env(), **self.frontend_env_extra})
        pid = self.frontend.popen.pid
        waited = h.wait_until(lambda: h.is_listening(HANDSHAKE_PORT, pid), self.topology.handshake_timeout,
                              f"the frontend's handshake port {HANDSHAKE_PORT} to listen on host 1",
                              check=self._check_alive)
        self.timings["handshake_listen_s"] = round(waited, 1)
        print(f"[e2e] {self.topology.id}: handshake {self.frontend_ip}:{HANDSHAKE_PORT} listens after "
              f"{time.monotonic() - t0:.1f}s")

    def start_engine(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GMOCK_E2E_") and k != "GMOCK_FRONTENDS_HOME"}
        env["PYTHONUNBUFFERED"] = "1"
        for index, process_args in enumerate(self.topology.engine_processes or (None,)):
            name = f"gmock-engine-host{self.engine_host(index)}"
            self.engines.append(h.ProcessGroup(name, self.engine_argv(process_args, index), self.engine_log_path(index),
                                               env=env, cwd=h.REPO))
        self.engine = self.engines[0]
