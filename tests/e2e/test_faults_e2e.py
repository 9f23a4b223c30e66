"""Each injected fault against the real frontends: what a client sees.

One stack (frontend + gmock_engine, DP 1, or 2 for crash-one-of-two) per
fault and frontend; the probe
and the expected phrases are in fault_reactions.py, and docs/faults.md's table
("Fault injection") is rendered from the same phrases. ~6 min in all.
"""

from __future__ import annotations

import pytest

from fault_reactions import REACTIONS, SCENARIOS, observe

CASES = [(name, frontend) for name, scenario in SCENARIOS.items() for frontend in scenario.frontends]


@pytest.mark.parametrize("name,frontend", CASES, ids=[f"{f}-{n}" for n, f in CASES])
def test_frontend_reaction(name, frontend, frontends, model_dir, tmp_path):
    seen = observe(name, frontend, frontends, model_dir, tmp_path)
    print(f"{frontend} {name}: {seen.phrases} {seen.notes}")
    expected = REACTIONS[name][frontend]
    assert set(seen.phrases) == set(expected), "the probe watched other things than the table lists"
    for key, phrase in seen.phrases.items():
        allowed = expected[key] if isinstance(expected[key], tuple) else (expected[key],)
        assert phrase in allowed, f"{frontend} {name}: {key}: saw {phrase!r}, the table says {expected[key]!r}"
    assert "teardown" not in seen.notes, seen.notes["teardown"]
