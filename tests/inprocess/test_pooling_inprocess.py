"""Pooling requests over real sockets (docs/protocol.md §3.7): each era's
PoolingParams array answered with its tensor in that era's output layout, and
hostile pooling_params answered with an ERROR for that request only while the
engine goes on serving (its books balance: `serving`)."""

import array
import math

import pytest

from fake_frontend import FakeFrontend, era_request
from gmock_engine.tools.frontend import add_frames
from gmock_engine.wire.eras import WIRE_LAYOUTS
from gmock_engine.wire.types import FinishReason
from test_engine_inprocess import serving

FLAGS = ("--supported-tasks", "generate,embed,token_embed,score", "--embedding-dim", "16")


def pooling_add(layout, rid, raw, prompt=(5, 6, 7, 8)):
    return add_frames(era_request(layout, rid, prompt, sampling_params=None, pooling_params=raw, eos_token_id=None))


@pytest.mark.parametrize(
    "era, raw, shape, activated",
    [
        ("0.32", [True, 8, None, None, "embed", False, False, None, None, 2], [8], True),
        ("0.16", [None, True, None, None, None, "token_embed", False, True, None, 2], [4, 16], True),
        # 0.11.1-0.15: normalize false at 2 (softmax at 3 is not embed's)
        ("0.13", [None, None, False, True, None, None, None, None, "embed", False, False, None, 2], [16], False),
        # 0.11.0: classify's ancestor "score" for a cross-encoder, 2 labels (--num-labels' default)
        ("0.13", [None, None, None, None, True, None, None, "score", False, None, 2], [2], True),
    ],
)
def test_each_eras_pooling_params_get_one_output_with_the_tensor_in_that_eras_layout(era, raw, shape, activated):
    layout = WIRE_LAYOUTS[era]
    frontend = FakeFrontend(num_clients=1, dp=1)
    with serving(frontend, *FLAGS, "--protocol-version", era):
        frontend.send_raw(0, 0, pooling_add(layout, "p", raw))
        collected = frontend.collect(["p"])
        (out,) = collected.outputs["p"]
        assert out[1] == [] and out[5] == FinishReason.STOP and collected.finished_requests == ["p"]
        dtype, got_shape, data = out[4]
        assert dtype == "float32" and got_shape == shape and data.code == 3
        values = array.array("f", data.data)
        assert len(values) == math.prod(shape)
        if shape == [2]:
            assert abs(sum(values) - 1.0) < 1e-6  # softmax
        else:
            assert (abs(math.sqrt(sum(v * v for v in values[: shape[-1]])) - 1.0) < 1e-6) == activated


def test_hostile_pooling_params_end_that_request_only_and_the_engine_goes_on():
    layout = WIRE_LAYOUTS["0.33"]  # its outputs carry the RequestError
    hostile = {
        "unsupported": [True, None, None, None, "classify", False, False, None, None, 2],
        "unknown": [True, None, None, None, "fly", False, False, None, None, 2],
        "dims": [True, 17, None, None, "embed", False, False, None, None, 2],
        "negative": [True, -1, None, None, "embed", False, False, None, None, 2],
        "no-task": [True, None, None, None, None, False, False, None, None, 2],
        "a-map": {"task": "embed"},
        "a-string": "embed",
        "activation": [1, None, None, None, "embed", False, False, None, None, 2],
    }
    frontend = FakeFrontend(num_clients=1, dp=1)
    with serving(frontend, *FLAGS, "--protocol-version", "0.33"):
        for rid, raw in hostile.items():
            frontend.send_raw(0, 0, pooling_add(layout, rid, raw))
        frontend.send_raw(0, 0, pooling_add(layout, "good", [True, None, None, None, "embed", False, False, None, None, 2]))
        frontend.send_raw(0, 0, add_frames(era_request(layout, "gen", (1, 2, 3), {"max_tokens": 3})))
        collected = frontend.collect([*hostile, "good", "gen"])
        for rid in hostile:
            assert collected.terminal[rid] == FinishReason.ERROR, rid
            assert collected.outputs[rid][-1][4] is None
        assert "Unsupported task: 'classify'" in collected.outputs["unsupported"][-1][18]["message"]
        assert "got 17" in collected.outputs["dims"][-1][18]["message"]
        assert "pooling_params is dict, not a PoolingParams array" in collected.outputs["a-map"][-1][18]["message"]
        assert "use_activation 1 is not a bool" in collected.outputs["activation"][-1][18]["message"]
        assert collected.terminal["good"] == FinishReason.STOP and collected.outputs["good"][0][4][1] == [16]
        assert len(collected.tokens("gen")) == 3
