"""Live reconfiguration without sockets: which options reload, what a reload
finds (reload.check: the changes, old -> new and source; a bad file refused
whole) and the log sink's new level (logs.set_level). How the engine takes
it: test_reconfigure.py."""

import io
import os
import re

import pytest
from loguru import logger

from gmock_engine.utils import logs
from gmock_engine.config import reload
from gmock_engine.config.loader import build_parser, parse_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Config:
    """A config file a test rewrites, and the process's fixed command line and environment."""

    def __init__(self, tmp_path, body, argv=(), env=None):
        self.path = tmp_path / "live.ini"
        self.write(body)
        self.argv = ["--config", str(self.path), *argv]
        self.env = dict(env or {})

    def write(self, body):
        self.path.write_text("[gmock_engine]\n" + body)

    def load(self):
        return parse_config(self.argv, env=self.env)


# -- which options reload -----------------------------------------------------------


def dests():
    return {a.dest for a in build_parser()._actions if a.option_strings and a.dest not in ("help", "version")}


def test_every_reloadable_name_is_an_option_and_the_fixed_ones_are_the_rest():
    assert reload.RELOADABLE <= dests()
    fixed = dests() - reload.RELOADABLE - reload.NOT_COMPARED
    # the handshake, the topology, the wire and what READY told the frontend stay as they are
    for name in ("handshake_address", "engine_count", "processes", "data_parallel_start_rank", "data_parallel_size",
                 "protocol_version", "metrics_port", "block_size", "vocab_size", "num_gpu_blocks", "max_model_len",
                 "dtype", "parallel_config_hash", "seed", "output_token_chunk_size", "supported_tasks"):  # fmt: skip
        assert name in fixed, name
    for name in ("itl_ms", "time_scale", "output_len_dist", "token_source", "fault_crash", "fault_fail_utility",
                 "log_level", "summary_interval", "logprobs_top1", "max_num_seqs", "max_num_batched_tokens"):  # fmt: skip
        assert name in reload.RELOADABLE, name
    assert set(reload.WORKER_COMMAND_LINE) <= fixed


def test_readme_names_every_reloadable_flag_in_its_section():
    section = open(os.path.join(REPO, "docs", "reload.md")).read()
    for action in build_parser()._actions:
        if action.dest in reload.RELOADABLE and not action.dest.startswith("fault_"):
            flag = next(o for o in action.option_strings if not o.startswith("--no-"))
            assert f"`{flag}`" in section, flag
    assert "`--fault-*`" in section and "`--num-gpu-blocks`" in section


def test_readme_example_lines_are_what_a_reload_logs(tmp_path, monkeypatch):
    section = open(os.path.join(REPO, "docs", "reload.md")).read()
    monkeypatch.chdir(tmp_path)  # the page's file is ./soak.ini
    argv = ["--config", "soak.ini"]
    (tmp_path / "soak.ini").write_text("[gmock_engine]\nengine-count = 4\n")
    current = parse_config(argv, env={})
    (tmp_path / "soak.ini").write_text(
        "[gmock_engine]\nengine-count = 4\nitl-ms = 20\nmax-num-seqs = 64\nvocab-size = 64000\n"
        "fault-error-mid-stream = rate=0.01 ranks=1\n"
    )
    found = reload.check(current, lambda: parse_config(argv, env={}))
    assert f"INFO     {found.line(2, 'engines 0..3')}\n" in section
    assert f"WARNING  {reload.fixed_line(found.fixed)}\n" in section
    (tmp_path / "soak.ini").write_text("[gmock_engine]\nengine-count = 4\nitl-ms = fast\n")
    found = reload.check(current, lambda: parse_config(argv, env={}))
    assert f"ERROR    {found.refused_line(2, 'engines 0..3')}\n" in section


# -- what a reload finds ----------------------------------------------------------------


def test_a_change_lists_old_new_and_source_and_the_fixed_ones_apart(tmp_path):
    live = Config(tmp_path, "itl-ms = 0\nvocab-size = 32000\n")
    current = live.load()
    live.write("itl-ms = 20\nvocab-size = 64000\nfault-error-mid-stream = rate=0.01 ranks=1\n")
    found = reload.check(current, live.load)
    assert found.error is None
    where = f"config file {live.path}"
    assert [str(c) for c in found.changes] == [
        f"--itl-ms 0 -> 20 ({where}, key itl-ms)",
        f"--fault-error-mid-stream unset -> 'rate=0.01 ranks=1' ({where}, key fault-error-mid-stream)",
    ]
    assert [str(c) for c in found.fixed] == [f"--vocab-size 32000 -> 64000 ({where}, key vocab-size)"]
    # the configuration from now on: the reloadable values as read, the others as they were
    new = found.config
    assert new.itl_ms == 20.0 and new.vocab_size == 32000 and new.sources["itl_ms"].kind == "config file"
    assert [s.kind for s in new.faults] == ["error-mid-stream"] and new.faults[0].rate == 0.01
    assert current.itl_ms == 0.0 and current.faults == []  # the current one is not touched
    assert found.line(2) == (
        f"config reload (generation 2): --itl-ms 0 -> 20 ({where}, key itl-ms); "
        f"--fault-error-mid-stream unset -> 'rate=0.01 ranks=1' ({where}, key fault-error-mid-stream)"
    )
    assert reload.fixed_line(found.fixed) == (
        f"config reload: cannot change while running, left as they are: --vocab-size 32000 -> 64000 ({where}, key vocab-size)"
    )


def test_the_command_line_keeps_its_precedence_and_the_environment_beats_the_file(tmp_path):
    live = Config(tmp_path, "itl-ms = 1\nttft-ms = 1\n", argv=["--itl-ms", "5"], env={"GMOCK_TTFT_MS": "7"})
    current = live.load()
    live.write("itl-ms = 50\nttft-ms = 70\njitter = 0.5\n")
    found = reload.check(current, live.load)
    assert [c.dest for c in found.changes] == ["jitter"]
    assert (found.config.itl_ms, found.config.ttft_ms, found.config.jitter) == (5.0, 7.0, 0.5)
    # a changed environment (an in-process loader can have one) counts too, and beats the file
    live.env["GMOCK_JITTER"] = "0.25"
    found = reload.check(found.config, live.load)
    assert [str(c) for c in found.changes] == ["--jitter 0.5 -> 0.25 (environment GMOCK_JITTER)"]


def test_nothing_changed_is_a_reload_too(tmp_path):
    live = Config(tmp_path, "itl-ms = 3\n")
    found = reload.check(live.load(), live.load)
    assert found.error is None and found.changes == [] and found.fixed == []
    assert found.line(5) == "config reload (generation 5): no reloadable option changed"
    assert found.line(5, "engines 0..3") == "config reload (generation 5, engines 0..3): no reloadable option changed"


def test_a_limit_counts_as_given_or_not(tmp_path):
    live = Config(tmp_path, "")
    current = live.load()
    live.write("max-num-seqs = 256\n")  # the default's value, but now given: enforced
    found = reload.check(current, live.load)
    assert [str(c) for c in found.changes] == [f"--max-num-seqs unlimited -> 256 (config file {live.path}, key max-num-seqs)"]
    live.write("")
    found = reload.check(found.config, live.load)
    assert [str(c) for c in found.changes] == ["--max-num-seqs 256 -> unlimited (default)"]
    assert found.config.sources["max_num_seqs"].kind == "default"


@pytest.mark.parametrize(
    "body,why",
    [
        ("itl-ms = fast\n", r"argument --itl-ms: 'fast' is not a number \(from config file .*live.ini, key itl-ms\)"),
        ("itl-ms = 20\nmax-num-seq = 4\n", r"unknown key 'max-num-seq'"),
        ("itl-ms = 20\nfault-crash = sometimes\n", r"argument --fault-crash: 'sometimes' is not key=value"),
        ("itl-ms 20\n", r"is not valid INI"),
        (None, r"does not exist"),
        ("token-id-range = 0:50000\n", r"--token-id-range: 0:50000 goes past --vocab-size 32000 .*cannot change while running"),
    ],
)
def test_a_bad_file_is_refused_whole_and_says_why(tmp_path, body, why):
    live = Config(tmp_path, "itl-ms = 2\n")
    current = live.load()
    snapshot = dict(vars(current))
    if body is None:
        live.path.unlink()
    elif body.startswith("token-id-range"):
        live.write("vocab-size = 64000\n" + body)  # fine on its own, not with the vocabulary in force
    else:
        live.write(body)
    found = reload.check(current, live.load)
    assert found.config is None and found.changes == [] and re.search(why, found.error), found.error
    assert vars(current) == snapshot
    assert found.refused_line(3).startswith("config reload refused, nothing changed (generation 3 stays): ")
    assert found.refused_line(3, "engines 0..0").startswith("config reload refused, nothing changed (generation 3 stays, engines 0..0): ")


def test_show_writes_values_as_the_file_does():
    assert [reload.show(v) for v in (None, True, 20.0, 0.125, 7, ("a", "b"), "every=2", "rate=1 ranks=0")] == [
        "unset", "true", "20", "0.125", "7", "a,b", "every=2", "'rate=1 ranks=0'",
    ]  # fmt: skip


# -- logging --------------------------------------------------------------------------------


def test_set_level_replaces_only_the_sink_of_setup_logging():
    out = io.StringIO()
    kept = []
    try:
        logs.setup_logging("INFO", sink=out)
        other = logger.add(kept.append, level="DEBUG")
        logger.debug("hidden")
        assert logs.set_level("DEBUG", False)
        logger.debug("shown")
        assert "hidden" not in out.getvalue() and "shown" in out.getvalue()
        assert len(kept) == 2  # the other sink saw both, and is still there
        logger.remove(other)
    finally:
        logger.remove()
        logs._configured.clear()
        logger.add(__import__("sys").stderr)
