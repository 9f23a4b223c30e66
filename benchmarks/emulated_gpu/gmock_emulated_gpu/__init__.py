"""An emulated GPU for a real vLLM engine core: a vLLM plugin (entry point
`vllm.general_plugins` -> register) that registers the model architecture
ARCHITECTURE, a one-layer Qwen2 that computes each step for real on the CPU
and then paces it to the time a step function gives for the batch
(model.py, pacing.py): the same latency profile the mock reads
(`--latency-profile`), or an expression of the batch. Test and benchmark
infrastructure of gmock_engine (benchmarks/README.md, "The emulated GPU"),
not part of the serving package.
"""

#: The architecture a model dir's config.json names to be served by the emulated GPU.
ARCHITECTURE = "GmockEmulatedGpuForCausalLM"


def register() -> None:
    """The plugin's entry point: vLLM calls it in every process it starts
    (frontend, engine core, workers), perhaps more than once. The class is
    registered by name, so that vLLM imports it (and torch) only where a
    model is built."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "gmock_emulated_gpu.model:GmockEmulatedGpuForCausalLM")

