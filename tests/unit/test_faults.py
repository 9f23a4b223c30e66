"""faults/specs.py: specs, triggers and the wire rewrite, without I/O."""

import pytest

from gmock_engine.faults.specs import KINDS, Faults, fail_after, parse_seconds, parse_spec, rewrite
from gmock_engine.wire.outputs import engine_core_output, engine_core_outputs, scheduler_stats
from gmock_engine.wire.types import FinishReason


@pytest.mark.parametrize(
    "text,seconds",
    [("90", 90.0), ("90s", 90.0), ("1.5s", 1.5), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), (".25", 0.25)],
)
def test_parse_seconds(text, seconds):
    assert parse_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "s", "1x", "-1", "1.2.3", "1 h"])
def test_parse_seconds_rejects(text):
    with pytest.raises(ValueError):
        parse_seconds(text)


def test_spec_defaults_and_keys():
    spec = parse_spec("stall-outputs", "every=100   ranks=0,2-3")
    assert spec.every == 100 and spec.ranks == frozenset({0, 2, 3}) and spec.duration == 10.0
    assert str(spec) == "every=100 ranks=0,2-3" and spec.max_fires is None
    assert parse_spec("hang", "at=2m").duration is None and parse_spec("hang", "at=2m").max_fires == 1
    assert parse_spec("late-finish", "rate=0.5").delay == 2.0
    slow = parse_spec("slow-steps", "rate=0.01 factor=3 duration=500ms limit=4")
    assert (slow.rate, slow.factor, slow.duration, slow.max_fires) == (0.01, 3.0, 0.5, 4)
    assert parse_spec("fail-utility", "every=1 method=sleep").method == "sleep"


@pytest.mark.parametrize(
    "kind,text,words",
    [
        ("crash", "", "exactly one trigger"),
        ("crash", "every=1 at=5", "exactly one trigger"),
        ("crash", "every=1 duration=5", "unknown key 'duration'"),
        ("slow-steps", "every=1", "needs factor="),
        ("slow-steps", "every=1 factor=0.5", "factor=0.5 is less than 1.0"),
        ("hang", "rate=1.5", "rate=1.5 is more than 1.0"),
        ("hang", "rate=0", "never fires"),
        ("hang", "every=0", "every=0 is less than 1"),
        ("hang", "every=two", "every=two is not an integer"),
        ("slow-steps", "every=1 factor=x", "factor=x is not a number"),
        ("hang", "at=soon", "is not a duration"),
        ("hang", "every=1 ranks=a", "ranks like 0,2,4-7"),
        ("hang", "every=1 ranks=0-99999999", "99999999 is not an engine rank"),
        ("hang", "every", "'every' is not key=value"),
        ("hang", "every=1 every=2", "given twice"),
    ],
)
def test_spec_errors_name_the_word(kind, text, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        parse_spec(kind, text)


def test_every_kind_has_help_and_parses_with_a_trigger():
    for kind, spec_kind in KINDS.items():
        extra = " factor=2" if kind == "slow-steps" else ""
        assert parse_spec(kind, "every=1" + extra).kind == kind
        assert spec_kind.help


def test_every_n_and_limit():
    faults = Faults([parse_spec("drop-finish", "every=3 limit=2")], rank=0, seed=0)
    fired = [bool(faults.on_request(0.0)) for _ in range(12)]
    assert [i + 1 for i, f in enumerate(fired) if f] == [3, 6]
    assert faults.summary() == {"fault_drop_finish": 2}


def test_rate_is_seeded_per_rank():
    def run(seed, rank):
        faults = Faults([parse_spec("error-mid-stream", "rate=0.1")], rank=rank, seed=seed)
        return [bool(faults.on_request(0.0)) for _ in range(5000)]

    first = run(1, 0)
    assert first == run(1, 0)
    assert first != run(1, 1) and first != run(2, 0)
    assert 350 < sum(first) < 650  # ~10 %


def test_at_fires_once_after_the_join():
    faults = Faults([parse_spec("duplicate-finish", "at=10s")], rank=0, seed=0)
    faults.joined(100.0)
    assert faults.on_request(105.0) == []
    assert [s.kind for s in faults.on_request(110.0)] == ["duplicate-finish"]
    assert faults.on_request(111.0) == []


def test_timed_engine_faults_are_not_fired_by_requests():
    faults = Faults([parse_spec("hang", "at=5"), parse_spec("crash", "every=2")], rank=0, seed=0)
    faults.joined(50.0)
    assert [(due, s.kind) for due, s in faults.timed()] == [(55.0, "hang")]
    assert [s.kind for _ in range(2) for s in faults.on_request(60.0)] == ["crash"]
    assert faults.fire(faults.timed()[0][1]) and not faults.fire(faults.timed()[0][1])


def test_ranks_select_engines():
    spec = parse_spec("crash", "every=1 ranks=1,3")
    assert [bool(Faults([spec], rank=r, seed=0)) for r in range(4)] == [False, True, False, True]
    assert Faults([spec], rank=0, seed=0).on_request(0.0) == []


def test_fail_utility_spares_gmock_stats_unless_named():
    faults = Faults([parse_spec("fail-utility", "every=1")], rank=0, seed=0)
    assert faults.on_utility("gmock_stats", 0.0) is None
    assert faults.on_utility("reset_prefix_cache", 0.0) is not None
    only_sleep = Faults([parse_spec("fail-utility", "every=1 method=sleep")], rank=0, seed=0)
    assert only_sleep.on_utility("wake_up", 0.0) is None and only_sleep.on_utility("sleep", 0.0) is not None


def test_fail_after_is_half_the_tokens():
    assert [fail_after(n) for n in (None, 0, 1, 2, 9, 10)] == [0, 0, 0, 1, 4, 5]


def _message(outputs, finished, stats=None):
    return engine_core_outputs(3, outputs, 12.5, finished, stats)


def _terminal(rid):
    return engine_core_output(rid, [7], FinishReason.LENGTH)


def test_rewrite_leaves_unmarked_messages_alone():
    message = _message([["a", [1]], _terminal("b")], ["b"])
    marked = {"c": parse_spec("drop-finish", "every=1")}
    assert rewrite(message, marked) == ([message], [])
    assert list(marked) == ["c"]  # a mark waits for its own request's end
    running = {"a": parse_spec("drop-finish", "every=1")}
    assert rewrite(message, running) == ([message], []) and list(running) == ["a"]


def test_rewrite_drop_finish():
    marked = {"b": parse_spec("drop-finish", "every=1")}
    now, later = rewrite(_message([["a", [1]], _terminal("b")], ["b"]), marked)
    assert now == [_message([["a", [1]]], None)] and later == [] and marked == {}
    # nothing else in the message: nothing is sent (never an empty message)
    marked = {"b": parse_spec("drop-finish", "every=1")}
    assert rewrite(_message([_terminal("b")], ["b"]), marked) == ([], [])
    # scheduler stats keep the message alive
    stats = scheduler_stats(1, 0, 0.1, 5)
    marked = {"b": parse_spec("drop-finish", "every=1")}
    assert rewrite(_message([_terminal("b")], ["b"], stats), marked) == ([_message([], None, stats)], [])


def test_rewrite_duplicate_and_late_finish():
    marked = {"b": parse_spec("duplicate-finish", "every=1"), "c": parse_spec("late-finish", "every=1 delay=1.5s")}
    message = _message([["a", [1]], _terminal("b"), _terminal("c")], ["b", "c"])
    now, later = rewrite(message, marked)
    assert now == [
        _message([["a", [1]], _terminal("b")], ["b"]),
        _message([_terminal("b")], ["b"]),
    ]
    assert later == [(1.5, _message([_terminal("c")], ["c"]))]
    assert marked == {}


def test_readme_shows_the_checked_reaction_table_and_every_fault_flag():
    """docs/faults.md's table is the one test_faults_e2e.py checks against the real frontends."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "tests", "e2e"))
    import fault_reactions

    with open(os.path.join(root, "docs", "faults.md")) as f:
        readme = f.read()
    assert fault_reactions.markdown_table() in readme
    for kind in KINDS:
        assert f"| `--fault-{kind}` |" in readme and f"| `{kind}` |" in readme
