"""KV-cache events for routers as the wire encodes them, and P/D KV transfer (vLLM: `vllm/distributed/kv_events.py`, `kv_transfer/`)."""
