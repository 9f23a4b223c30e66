"""config/loader.py: one precedence rule (CLI > env > file > default) and clear errors."""

import configparser
import re
import os

import pytest

from gmock_engine.config import reload
from gmock_engine.config.loader import ConfigError, build_parser, format_config, options_template, parse_config
from gmock_engine.tools.config_reference import REFERENCE_COMMAND, reference_page

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ini(tmp_path, body, name="c.ini"):
    path = tmp_path / name
    path.write_text("[gmock_engine]\n" + body)
    return str(path)


def test_defaults_match_the_rust_mock():
    args = parse_config([], env={})
    assert args.handshake_address == "tcp://127.0.0.1:29550"
    assert (args.engine_count, args.output_token_chunk_size, args.vocab_size, args.seed) == (1, 1, 32000, 0)
    assert args.log_requests is False
    assert args.max_model_len == 1048576 and args.block_size == 16
    assert args.data_parallel_size == 1 and args.sources["engine_count"].kind == "default"


@pytest.mark.parametrize(
    "flag,key,env,values",
    [
        ("--engine-count", "engine-count", "GMOCK_ENGINE_COUNT", ("2", "3", "4")),
        ("--handshake-address", "handshake-address", "GMOCK_HANDSHAKE_ADDRESS", ("tcp://h:1", "ipc:///tmp/x", "tcp://[::1]:5")),
        ("--vocab-size", "vocab-size", "GMOCK_VOCAB_SIZE", ("10", "20", "30")),
        ("--dtype", "dtype", "GMOCK_DTYPE", ("float16", "float32", "bfloat16")),
    ],
)
def test_precedence_file_env_cli(tmp_path, flag, key, env, values):
    file_value, env_value, cli_value = values
    path = ini(tmp_path, f"{key} = {file_value}\n")
    dest = key.replace("-", "_")

    def value(args):
        return str(getattr(args, dest))

    assert value(parse_config(["--config", path], env={})) == file_value
    args = parse_config(["--config", path], env={env: env_value})
    assert value(args) == env_value and args.sources[dest].kind == "environment"
    args = parse_config(["--config", path, flag, cli_value], env={env: env_value})
    assert value(args) == cli_value and args.sources[dest].kind == "command line"
    args = parse_config([], env={"GMOCK_CONFIG": path})
    assert value(args) == file_value and args.sources[dest].kind == "config file"
    assert path in args.sources[dest].detail and key in args.sources[dest].detail


def test_boolean_precedence_both_ways(tmp_path):
    path = ini(tmp_path, "log-requests = true\n")
    assert parse_config(["--config", path], env={}).log_requests is True
    assert parse_config(["--config", path], env={"GMOCK_LOG_REQUESTS": "false"}).log_requests is False
    assert parse_config(["--config", path, "--no-log-requests"], env={}).log_requests is False
    assert parse_config(["--log-requests"], env={"GMOCK_LOG_REQUESTS": "false"}).log_requests is True


def test_data_parallel_size_follows_start_rank_and_count():
    args = parse_config(["--engine-count", "2", "--data-parallel-start-rank", "2"], env={})
    assert args.data_parallel_size == 4
    with pytest.raises(ConfigError, match=r"--data-parallel-size: 3 is smaller .* = 4 \(from command line\)"):
        parse_config(["--engine-count", "2", "--data-parallel-start-rank", "2", "--data-parallel-size", "3"], env={})


@pytest.mark.parametrize(
    "argv,env,body,pattern",
    [
        (["--engine-count", "0"], {}, None, r"--engine-count: 0 is less than 1 \(from command line\)"),
        ([], {"GMOCK_OUTPUT_TOKEN_CHUNK_SIZE": "0"}, None, r"--output-token-chunk-size: .*environment GMOCK_OUTPUT_TOKEN_CHUNK_SIZE"),
        (None, {}, "vocab-size = 0\n", r"--vocab-size: 0 is less than 1 \(from config file .*c.ini, key vocab-size\)"),
        (None, {}, "engine-count = four\n", r"--engine-count: 'four' is not an integer \(from config file .*key engine-count"),
        (None, {}, "handshake-address = localhost:29550\n", r"--handshake-address: .* \(from config file .*key handshake-address"),
        (["--handshake-address", "tcp://h:99999"], {}, None, r"port 99999"),
        (["--handshake-address", "ipc://"], {}, None, r"no path"),
        (None, {}, "engine-cont = 4\n", r"config file .*c.ini: unknown key 'engine-cont'"),
        (None, {}, "dtype = int8\n", r"--dtype: 'int8' is not one of"),
        (["--no-such-flag"], {}, None, r"unrecognized arguments: --no-such-flag"),
        (["--token-source", "file:/no/such/file"], {}, None, r"--token-source: 'file:/no/such/file': .*No such file"),
        (["--token-source", "zipf"], {}, None, r"--token-source: 'zipf' is not random, echo, text or file:PATH"),
        (None, {}, "token-id-range = 30000:40000\n", r"--token-id-range: 30000:40000 goes past --vocab-size 32000 \(from config file"),
        ([], {"GMOCK_OUTPUT_LEN_DIST": "gauss:3"}, None, r"--output-len-dist: .*kind must be one of .*GMOCK_OUTPUT_LEN_DIST"),
        (["--jitter", "1.5"], {}, None, r"--jitter: 1.5 is more than 1.0"),
    ],
)
def test_bad_values_name_flag_and_source(tmp_path, argv, env, body, pattern):
    if body is not None:
        argv = ["--config", ini(tmp_path, body)]
    with pytest.raises(ConfigError, match=pattern):
        parse_config(argv, env=env)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"--config: config file .*nope.ini \(given by command line\) does not exist"):
        parse_config(["--config", str(tmp_path / "nope.ini")], env={})
    with pytest.raises(ConfigError, match=r"given by environment GMOCK_CONFIG\) does not exist"):
        parse_config([], env={"GMOCK_CONFIG": str(tmp_path / "nope.ini")})
    other = tmp_path / "other.ini"
    other.write_text("[engine]\nengine-count = 2\n")
    with pytest.raises(ConfigError, match=r"has no \[gmock_engine\] section"):
        parse_config(["--config", str(other)], env={})
    garbage = tmp_path / "garbage.ini"
    garbage.write_text("engine-count = 2\n")
    with pytest.raises(ConfigError, match=r"is not valid INI"):
        parse_config(["--config", str(garbage)], env={})


def test_print_config_names_every_option_and_its_source(tmp_path):
    path = ini(tmp_path, "engine-count = 4\n")
    text = format_config(parse_config(["--config", path, "--seed", "9"], env={"GMOCK_VOCAB_SIZE": "77"}))
    assert "engine-count = 4" in text and f"config file {path}, key engine-count" in text
    assert "seed = 9" in text and "from command line" in text
    assert "vocab-size = 77" in text and "environment GMOCK_VOCAB_SIZE" in text
    # The output is itself a valid config file with every option.
    parser = configparser.ConfigParser(inline_comment_prefixes=(";",))
    parser.read_string(text)
    keys = set(parser["gmock_engine"])
    flags = {a.option_strings[0][2:] for a in build_parser()._actions if a.option_strings and a.dest not in ("help", "version", "print_config", "config")}
    assert flags <= keys


SHIPPED = {"dp1.ini": 1, "dp4.ini": 4, "all-options.ini": 1, "small-gpu.ini": 4, "large-gpu.ini": 8, "chaos.ini": 4, "serve.ini": 1}


def test_every_shipped_config_file_is_tested():
    assert sorted(SHIPPED) == sorted(n for n in os.listdir(os.path.join(REPO, "conf")) if n.endswith(".ini"))


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_files_parse(name):
    args = parse_config(["--config", os.path.join(REPO, "conf", name)], env={})
    assert args.engine_count == SHIPPED[name]
    if name.endswith("gpu.ini"):  # profiles enforce their batch limit
        assert args.sources["max_num_seqs"].kind == "config file" and args.itl_ms > 0
    if name == "chaos.ini":  # every request fault, two timed engine faults, no start-up utility failures
        kinds = {spec.kind for spec in args.faults}
        assert {"error-mid-stream", "drop-finish", "duplicate-finish", "late-finish"} <= kinds
        assert [s.at for s in args.faults if s.kind in ("hang", "stall-outputs")] == [7200.0, 3600.0]
        assert [s.method for s in args.faults if s.kind == "fail-utility"] == ["reset_prefix_cache"]


def test_all_options_file_lists_every_option():
    text = open(os.path.join(REPO, "conf", "all-options.ini")).read()
    assert text == options_template(), "regenerate: python -m gmock_engine.config.loader > conf/all-options.ini"
    for action in build_parser()._actions:
        if action.option_strings and action.dest not in ("help", "version", "config"):
            assert f";{action.option_strings[0][2:]} =" in text, action.option_strings[0]


def test_configuration_reference_page_is_current_and_lists_every_option():
    text = open(os.path.join(REPO, "docs", "configuration.md")).read()
    assert text == reference_page(), f"regenerate: {REFERENCE_COMMAND}"
    assert REFERENCE_COMMAND in text
    engine_part = text.split("\n## `./run.sh serve`", 1)[0]  # the tools' tables follow; some share a flag's name
    rows = {line.split(" | ", 1)[0][2:]: line for line in engine_part.splitlines() if line.startswith("| `--")}
    for action in build_parser()._actions:
        if action.option_strings and action.dest not in ("help", "version"):
            row = next(line for flags, line in rows.items() if f"`{action.option_strings[0]}`" in flags.split(" / "))
            assert ("| yes, " in row) == (action.dest in reload.RELOADABLE), row


# -- each option group declared once, in the reference page's order ----------------


def _options(parser):
    return [a for a in parser._actions if a.option_strings and a.dest not in ("help", "version")]


def test_each_option_group_is_declared_in_one_block():
    # --help, --print-config and conf/all-options.ini list options in declaration
    # order: a group added to again after another group splits up in one of them.
    parser = build_parser()
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    titles = [group_of[id(a)] for a in _options(parser)]
    blocks = [t for i, t in enumerate(titles) if i == 0 or t != titles[i - 1]]
    assert len(blocks) == len(set(blocks)), f"groups reopened: {blocks}"


def test_configuration_page_lists_the_options_in_the_parsers_order():
    # docs/configuration.md is generated (its staleness is checked elsewhere):
    # here, that its engine tables name every option once, in the parser's order
    text = open(os.path.join(REPO, "docs", "configuration.md")).read()
    engine = text[text.index("## The engine") : text.index("## `./run.sh serve`")]
    page = re.findall(r"^\| `(--[a-z0-9-]+)`", engine, re.M)
    assert page == [a.option_strings[0] for a in _options(build_parser())]


# -- no abbreviations; every source form is reported right --------------------------


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--max-num-s", "64"], "--max-num-s"),
        (["--max-num-s=64"], "--max-num-s"),
        (["--num-gpu", "100"], "--num-gpu"),
        (["--no-log-req"], "--no-log-req"),
        (["--conf", "conf/dp1.ini"], "--conf"),
    ],
)
def test_abbreviated_flags_are_an_error_naming_the_flag(argv, flag):
    # argparse would take these as --max-num-seqs etc., but the limit is then
    # not enforced (its source looked like "default"): no abbreviations at all.
    with pytest.raises(ConfigError, match=rf"unrecognized arguments: {re.escape(flag)}\b") as info:
        parse_config(argv, env={})
    assert "abbreviations are not accepted" in str(info.value)


def _print_config_line(args, key):
    return next(line for line in format_config(args).splitlines() if line.startswith(f"{key} ="))


@pytest.mark.parametrize(
    "argv,env,body,dest,value,kind,detail",
    [
        (["--max-num-seqs", "64"], {}, None, "max_num_seqs", 64, "command line", ""),
        (["--max-num-seqs=64"], {}, None, "max_num_seqs", 64, "command line", ""),
        (["--max-num-seqs=64"], {"GMOCK_MAX_NUM_SEQS": "9"}, "max-num-seqs = 7\n", "max_num_seqs", 64, "command line", ""),
        ([], {"GMOCK_MAX_NUM_SEQS": "9"}, "max-num-seqs = 7\n", "max_num_seqs", 9, "environment", "GMOCK_MAX_NUM_SEQS"),
        ([], {}, "max-num-seqs = 7\n", "max_num_seqs", 7, "config file", "key max-num-seqs"),
        ([], {}, None, "max_num_seqs", 256, "default", ""),
        (["--log-requests"], {}, None, "log_requests", True, "command line", ""),
        (["--no-log-requests"], {}, "log-requests = true\n", "log_requests", False, "command line", ""),
        (["--no-log-requests"], {"GMOCK_LOG_REQUESTS": "true"}, None, "log_requests", False, "command line", ""),
        ([], {"GMOCK_LOG_REQUESTS": "false"}, "log-requests = true\n", "log_requests", False, "environment", "GMOCK_LOG_REQUESTS"),
        ([], {}, "log-requests = false\n", "log_requests", False, "config file", "key log-requests"),
        ([], {}, "log-requests = true\n", "log_requests", True, "config file", "key log-requests"),
        ([], {}, None, "log_requests", False, "default", ""),
        # a string default goes through its type like a given value
        ([], {}, None, "handshake_address", "tcp://127.0.0.1:29550", "default", ""),
        (["--handshake-address=ipc:///tmp/x"], {}, None, "handshake_address", "ipc:///tmp/x", "command line", ""),
        # an empty variable sets the value to "": it is not the default any more
        ([], {"GMOCK_VLLM_VERSION": ""}, None, "vllm_version", "", "environment", "GMOCK_VLLM_VERSION"),
    ],
)
def test_print_config_source_of_every_form(tmp_path, argv, env, body, dest, value, kind, detail):
    if body is not None:
        argv = ["--config", ini(tmp_path, body), *argv]
    args = parse_config(argv, env=env)
    assert getattr(args, dest) == value
    assert args.sources[dest].kind == kind and detail in args.sources[dest].detail
    line = _print_config_line(args, dest.replace("_", "-"))
    assert f"; from {kind}" in line and detail in line


def test_config_file_source_given_by_cli_or_environment(tmp_path):
    path = ini(tmp_path, "engine-count = 2\n")
    args = parse_config([f"--config={path}"], env={})
    assert args.config == path and str(args.sources["config"]) == "command line"
    args = parse_config([], env={"GMOCK_CONFIG": path})
    assert args.config == path and str(args.sources["config"]) == "environment GMOCK_CONFIG"
    assert args.engine_count == 2 and args.sources["engine_count"].kind == "config file"
    assert parse_config([], env={}).sources["config"].kind == "default"
    with pytest.raises(ConfigError, match=r"argument --config: expected one argument"):
        parse_config(["--config"], env={})


@pytest.mark.parametrize("name", ["max_num_seqs", "num_gpu_blocks", "max_num_batched_tokens"])
def test_a_limit_given_in_any_form_counts_as_given(tmp_path, name):
    # config/settings.py enforces these only when `sources[name].kind != "default"`.
    flag = "--" + name.replace("_", "-")
    forms = [
        ([flag, "64"], {}),
        ([f"{flag}=64"], {}),
        ([], {"GMOCK_" + name.upper(): "64"}),
        (["--config", ini(tmp_path, f"{flag[2:]} = 64\n")], {}),
    ]
    for argv, env in forms:
        args = parse_config(argv, env=env)
        assert getattr(args, name) == 64 and args.sources[name].kind != "default", (argv, env)
    assert parse_config([], env={}).sources[name].kind == "default"


@pytest.mark.parametrize(
    "argv,reason",
    [
        (["--vocab-size", str(2**32 + 1)], r"--vocab-size: 4294967297 is more than 4294967296"),
        (["--max-model-len", str(2**63)], r"--max-model-len: 9223372036854775808 is more than 9223372036854775807"),
        (["--num-gpu-blocks", "1" * 30], r"--num-gpu-blocks: 1+ is more than"),
    ],
)
def test_numbers_that_cannot_reach_a_frontend_are_refused_at_start(argv, reason):
    with pytest.raises(ConfigError, match=reason):
        parse_config(argv, env={})
