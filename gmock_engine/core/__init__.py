"""The engine core: requests, the scheduler and its step plan, KV blocks, the output processor and the outputs on their way out. Pure (vLLM: `vllm/v1/core/`, `vllm/v1/engine/`)."""
