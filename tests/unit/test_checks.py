"""wire/checks.py: an ADD's vllm_xargs are checked in one place, before the
plans (request.plan, kv_transfer.plan) use them; the answers an engine gives
for a bad value keep their words and their order."""

import pytest

from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.wire.checks import NO_XARGS, BadXargs, Xargs, check_xargs
from gmock_engine.wire.eras import WIRE_LAYOUTS
from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.types import BadValue, FinishReason

ERROR_AT = WIRE_LAYOUTS["0.33"].output_position("error")


def test_check_xargs_gives_the_checked_values():
    xargs = {"mock_fail_after": 3, "mock_output_len": 7, "mock_stop_token_id": 5, "mock_finish": "stop",
             "mock_ttft_ms": 2, "mock_kv_load": "fail", "mock_kv_transfer_delay_ms": 250, "other": "ignored"}  # fmt: skip
    assert check_xargs(xargs) == Xargs(3, 7, 5, "stop", 2.0, True, 0.25)
    assert isinstance(check_xargs({"mock_ttft_ms": 2}).ttft_ms, float)
    assert check_xargs({"mock_output_len": None, "unrelated": 1}) == NO_XARGS


@pytest.mark.parametrize(
    "xargs,error",
    [
        ({"mock_finish": "maybe"}, BadXargs),
        ({"mock_outputlen": 1}, BadXargs),
        ({"mock_kv_load": "maybe"}, BadValue),
        ({"mock_kv_transfer_delay_ms": -1}, BadValue),
    ],
)
def test_mock_scenarios_and_pd_scenarios_raise_their_own_error(xargs, error):
    with pytest.raises(error) as raised:
        check_xargs(xargs)
    assert (type(raised.value) is BadXargs) == (error is BadXargs)


def _answer(extra_args):
    engine = EngineCore(EngineSettings(rank=0, num_clients=1), clock=lambda: 100.0)
    sent = [m for _, m in engine.apply(EngineCoreRequest("r", 4, 10, True, extra_args=extra_args))]
    [output] = [o for m in sent for o in m[1] if o[0] == "r"]
    assert output[5] == FinishReason.ERROR and output[ERROR_AT]["code"] == "validation_error"
    return output[ERROR_AT]["message"]


def test_the_answers_keep_their_words_and_order():
    # a mock scenario's reason is said as a bad vllm_xargs, a P/D one plainly
    assert _answer({"mock_finish": "maybe"}) == "bad vllm_xargs: mock_finish must be stop, length or error, not 'maybe'"
    assert _answer({"mock_kv_load": "maybe"}) == "mock_kv_load must be fail or ok, not 'maybe'"
    # both bad: the mock scenario is checked first, as request.plan once did before kv_transfer.plan
    assert _answer({"mock_kv_load": "maybe", "mock_finish": "maybe"}).startswith("bad vllm_xargs: mock_finish")
