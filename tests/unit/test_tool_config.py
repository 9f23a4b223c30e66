"""`./run.sh record` and `./run.sh fit` take their options as the engine does:
command line > GMOCK_RECORD_* / GMOCK_FIT_* > [record] / [fit] of --config > default;
a bad value stops them at start naming the flag and where it came from."""

import pytest

from gmock_engine.config.loader import ConfigError
from gmock_engine.tools import fit as fitting
from gmock_engine.tools import record, record_config


def _config(tmp_path, text):
    path = tmp_path / "tools.ini"
    path.write_text(text)
    return str(path)


def test_record_reads_the_command_line_the_environment_and_its_section(tmp_path):
    conf = _config(tmp_path, "[gmock_engine]\nengine-count = 9\n\n[record]\nengine-count = 2\noutput = a.jsonl\n"
                             "engine-handshake-address = tcp://127.0.0.1:5001\nrecord-token-ids = true\n")  # fmt: skip
    env = {"GMOCK_RECORD_HANDSHAKE_ADDRESS": "tcp://127.0.0.1:5000", "GMOCK_RECORD_OUTPUT": "b.jsonl"}
    args = record_config.parse_args(["--config", conf, "--data-parallel-start-rank", "2"], env)
    assert (args.handshake_address, args.engine_handshake_address) == ("tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001")
    assert (args.engine_count, args.data_parallel_start_rank, args.output, args.record_token_ids) == (2, 2, "b.jsonl", True)
    assert args.sources["output"].kind == "environment" and args.sources["engine_count"].kind == "config file"
    # the aliases a vLLM user types
    args = record_config.parse_args(["--config", conf, "-o", "c.jsonl", "--data-parallel-size-local", "3"], env)
    assert (args.output, args.engine_count) == ("c.jsonl", 3)


@pytest.mark.parametrize(
    "argv, env, ini, message",
    [
        ([], {}, None, "--handshake-address is required"),
        (["--handshake-address", "tcp://h:1"], {}, None, "--engine-handshake-address is required"),
        (["--handshake-address", "tcp://x"], {}, None, "--handshake-address: 'tcp://x' is not tcp://host:port.*from command line"),
        ([], {"GMOCK_RECORD_ENGINE_COUNT": "0"}, "[record]\nhandshake-address = tcp://h:1\n", "--engine-count.*from environment"),
        ([], {}, "[record]\nengine-count = many\n", r"--engine-count.*from config file .*tools.ini, key engine-count"),
        ([], {}, "[record]\nengine-cuont = 2\n", r"tools.ini: unknown key 'engine-cuont' in \[record\]"),
    ],
)
def test_record_refuses_a_bad_option_naming_it_and_its_source(tmp_path, argv, env, ini, message):
    if ini is not None:
        argv = ["--config", _config(tmp_path, ini)] + argv
    with pytest.raises(ConfigError, match=message):
        record_config.parse_args(argv, env)


def test_record_main_says_what_is_wrong_and_exits_2(capsys):
    assert record.main(["--handshake-address", "tcp://h:1"]) == 2
    assert "gmock-engine record: argument --engine-handshake-address is required" in capsys.readouterr().err


def test_fit_reads_its_section_and_refuses_a_bad_value(tmp_path, monkeypatch, capsys):
    conf = _config(tmp_path, "[fit]\nmodel = banana\n")
    assert fitting.main(["--config", conf, "t.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "argument --model" in err and "'banana' is not one of linear, linear+attention, table" in err and "tools.ini" in err
    monkeypatch.setenv("GMOCK_FIT_FOLDS", "1")
    assert fitting.main(["t.jsonl"]) == 2
    assert "argument --folds" in capsys.readouterr().err
    monkeypatch.delenv("GMOCK_FIT_FOLDS")
    # a good file: the trace is read (and is missing: exit 2 naming it)
    conf = _config(tmp_path, "[fit]\nmodel = table\nfolds = 3\noutput = p.ini\n")
    assert fitting.main(["--config", conf, str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
