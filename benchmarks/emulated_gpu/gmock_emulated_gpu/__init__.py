"""An emulated GPU for a real vLLM engine core: a vLLM plugin (entry point
`vllm.general_plugins` -> register) that registers the model architecture
ARCHITECTURE, a one-layer Qwen2 that computes each step for real on the CPU
and then paces it to the time a step function gives for the batch
(model.py, pacing.py): the same latency profile the mock reads
(`--latency-profile`), or an expression of the batch. Test and benchmark
infrastructure of gmock_engine (benchmarks/README.md, "The emulated GPU"),
not part of the serving package.
"""

import os

#: The architecture a model dir's config.json names to be served by the emulated GPU.
ARCHITECTURE = "GmockEmulatedGpuForCausalLM"


def register() -> None:
    """The plugin's entry point: vLLM calls it in every process it starts
    (frontend, engine core, workers), perhaps more than once. The class is
    registered by name, so that vLLM imports it (and torch) only where a
    model is built."""
    from vllm import ModelRegistry

    if os.environ.get(SPIN_ENV, "0") != "1":
        _no_spin()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "gmock_emulated_gpu.model:GmockEmulatedGpuForCausalLM")


#: Set to 1 to keep vLLM's busy-wait between its engine core and its worker.
SPIN_ENV = "GMOCK_EMULATED_GPU_SPIN"


def _no_spin() -> None:
    """vLLM's engine core and its CPU worker wait for each other's messages
    by spinning (sched_yield) for a second after each (shm_broadcast.py
    SpinCondition, `busy_loop_s`). A GPU host has cores to spare for that;
    on a small CPU the spinning thread takes a core the emulated GPU's host
    work (scheduling, sampling, outputs) and the frontend need, and the
    step times then follow the machine's load. Without it they wait on the
    notification socket vLLM keeps for its idle mode (a wake-up of tens of
    microseconds)."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # another layout: leave it
        return
    cls = getattr(shm_broadcast, "SpinCondition", None)
    if cls is None or getattr(cls.__init__, "_gmock_no_spin", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs["busy_loop_s"] = 0.0
        original(self, *args, **kwargs)

    __init__._gmock_no_spin = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
