"""The wire layout over real sockets (docs/protocol.md §8.2): `--protocol-version
auto` settles on the era of the first ADD and answers every request in it;
an explicit version wins; /metrics says which layout is in use."""

from loguru import logger

from fake_frontend import FakeFrontend, era_request
from gmock_engine.runtime import metrics
from gmock_engine.tools.frontend import add_frames
from gmock_engine.wire.eras import WIRE_LAYOUTS, layout_for_version
from gmock_engine.wire.types import FinishReason
from test_engine_inprocess import serving


def wire_gauge(app):
    for family in metrics.registry(app.runners, app).collect():
        for sample in family.samples:
            if sample.name == "gmock_wire_layout":
                return sample.labels
    raise AssertionError("no gmock_wire_layout sample")


def test_auto_answers_a_0_16_frontend_in_its_own_layout_and_says_so_once():
    lines = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO")
    frontend = FakeFrontend(num_clients=1, dp=1)
    try:
        with serving(frontend) as app:
            assert wire_gauge(app) == {"era": "0.33", "versions": "0.33", "how": "pending"}
            old = WIRE_LAYOUTS["0.16"]  # eos_token_id at 5, 18 elements (§8.1)
            for rid in ("a", "b"):
                frontend.send_raw(0, 0, add_frames(era_request(old, rid, (1, 2, 3, 4), {"max_tokens": 3}, eos_token_id=None)))
            collected = frontend.collect(["a", "b"])
            final = collected.outputs["a"][-1]
            assert len(collected.tokens("a")) == 3 and final[5] == FinishReason.LENGTH
            # the first output's prefill accounting is num_cached_tokens (an int) at 10, not a map
            first = collected.outputs["a"][0]
            assert len(first) == 11 and first[10] == 0
            assert wire_gauge(app) == {"era": "0.16", "versions": "0.16", "how": "detected"}
        said = [line for line in lines if "protocol: the frontend speaks" in line]
        assert len(said) == 1 and "vLLM 0.16" in said[0] and "eos_token_id at 5" in said[0]
    finally:
        logger.remove(sink)


def test_an_explicit_version_is_used_from_the_start_and_errors_end_as_its_era_knows():
    frontend = FakeFrontend(num_clients=1, dp=1)
    with serving(frontend, "--protocol-version", "0.12.0") as app:
        assert wire_gauge(app) == {"era": "0.11.1", "versions": "0.11.1–0.12", "how": "configured"}
        layout = WIRE_LAYOUTS["0.11.1"]
        frontend.send_raw(0, 0, add_frames(era_request(layout, "e", (1, 2, 3, 4), {"max_tokens": 4, "extra_args": {"mock_finish": "error"}},
                                                       eos_token_id=None)))
        collected = frontend.collect(["e"])
        # 0.11/0.12 have no ERROR: the request ends as ABORT, with no RequestError field
        assert collected.terminal["e"] == FinishReason.ABORT
        assert len(collected.outputs["e"][-1]) <= len(layout.output_fields)
        assert app.wire.layout is layout_for_version("0.12")
