"""The scheduling-fidelity sitting's harness (benchmarks/scheduling_fidelity.py),
cheaply: the emulated GPU (a real vLLM engine core paced by a latency
profile, slow.ini) and the mock with that same profile and the sitting's engine
limits, behind the real Python frontend, on one short workload above
max_num_seqs; judged at the engine boundary, in bands that a mock
admitting a different number of requests, or a step early or late, falls
outside (the sitting's own goals need a quiet machine, which CI is not).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import pytest

import e2e_harness as h

sys.path.insert(0, str(h.REPO / "benchmarks"))
import scheduling_fidelity as sf  # noqa: E402  (benchmarks/scheduling_fidelity.py)

#: 36 requests of 64/16 tokens, 16 at a time against max_num_seqs 8: each
#: admission waits for a finish. Requests of one length run in waves of
#: max_num_seqs: 4.5 waves of 8, so that a slot more (4 waves of 9) or
#: less (5.1 of 7) moves the request rate and the queue time
WORKLOAD = sf.SchedWorkload("e2e_seqs_c16_64_16", "max_num_seqs under 16 concurrent",
                            (sf.Workload("e2e_seqs_c16_64_16", "sched", 36, sf._random(64, 16), concurrency=16),))  # fmt: skip
#: The profile both sides step by: slow.ini's steps of 36 ms and more, where
#: a request that the frontend delivers a few ms early or late still lands
#: in the same step (docs/latency-profile.md, "Steps three times as long").
PROFILE = sf.REFERENCE_PROFILE.parent / "slow.ini"
#: mock / reference, engine boundary: TTFT and queue time move with where
#: the frontend's ADDs land in a step on a loaded machine (1.00 on a quiet
#: one, a slot more 0.99-1.03); the inter-token time is the profile's on
#: both sides
BANDS = {("ttft", "p50"): (0.9, 1.1), ("queue", "p50"): (0.9, 1.1), ("queue", "p90"): (0.9, 1.1),
         ("itl", "p50"): (0.97, 1.03)}  # fmt: skip
#: the same for the request rate at the engine boundary
RATE_BAND = (0.95, 1.05)

#: Two engine stacks in turn: apart from the suite, as test_fidelity_e2e.py.
pytestmark = pytest.mark.solo


def test_the_mock_with_the_references_profile_and_limits_queues_as_vllm(frontends, tmp_path):
    options = argparse.Namespace(seed=1, timeout=300.0, max_busy=2.0, max_wait=0.0, profile=str(PROFILE))
    model = sf.emulated_model_dir(tmp_path / "emulated-model", options.profile)
    for target, name in (("emulated", "reference1"), ("mock", "mock")):
        sf.run_target(target, tmp_path / f"{name}.json", tmp_path / f"{name}.jsonl", [WORKLOAD], model, options)
    reference = sf.boundary(tmp_path / "reference1.json")[WORKLOAD.name]
    mock = sf.boundary(tmp_path / "mock.json")[WORKLOAD.name]
    assert reference["finished"] == mock["finished"] == 36
    lines = []
    for (name, p), (low, high) in BANDS.items():
        ref, got = (sf.engine_boundary.percentiles(side[name])[p] for side in (reference, mock))
        lines.append(f"{name} {p}: reference {ref:.2f} ms, mock {got:.2f} ms, ratio {got / ref:.2f}")
        assert ref > 0 and low <= got / ref <= high, "\n".join(lines)
    lines.append(f"req/s: reference {reference['throughput']:.3f}, mock {mock['throughput']:.3f}")
    assert RATE_BAND[0] <= mock["throughput"] / reference["throughput"] <= RATE_BAND[1], "\n".join(lines)
    print("\n".join(lines))
    with open(tmp_path / "table.md", "w") as f, contextlib.redirect_stdout(f):
        sf.table(tmp_path)
    assert "| e2e_seqs_c16_64_16 | queue p50 |" in (tmp_path / "table.md").read_text()
