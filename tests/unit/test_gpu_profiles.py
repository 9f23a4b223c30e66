"""The ready-made GPU profiles (conf/profiles/): each is what `./run.sh profile`
writes for the command in its header, the engine reads it as a profile and
as a config file, and the tool stops on what the tables cannot serve.
The regeneration needs AIConfigurator's core (the `gpu` extra); without it
those tests are skipped, the others run."""

from __future__ import annotations

import os
import shlex

import pytest

from gmock_engine.config.loader import parse_config
from gmock_engine.timing.profile import read_profile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILES = sorted(n for n in os.listdir(os.path.join(REPO, "conf", "profiles")) if n.endswith(".ini"))


def _command(name):
    """The `written by:` command of a shipped profile's header, as profile.main's argv."""
    with open(os.path.join(REPO, "conf", "profiles", name), encoding="utf-8") as f:
        line = next(line for line in f if line.startswith("# written by: ./run.sh profile "))
    return shlex.split(line.split("./run.sh profile ", 1)[1])


def test_the_issue_s_deployments_ship():
    wanted = {f"{gpu}-{model}.ini" for gpu in ("h100", "h200")
              for model in ("llama-3.1-8b-tp1", "llama-3.1-70b-tp4", "qwen3-32b-tp2", "gpt-oss-120b-tp2")}  # fmt: skip
    assert wanted <= set(PROFILES)
    assert {"a100-llama-3.1-8b-tp1.ini", "b200-llama-3.1-70b-tp4.ini"} <= set(PROFILES)


@pytest.mark.parametrize("name", PROFILES)
def test_a_shipped_profile_is_a_profile_and_a_config_file(name, monkeypatch):
    monkeypatch.chdir(REPO)
    path = os.path.join("conf", "profiles", name)
    profile = read_profile(path)
    assert profile.batch[0] == 1 and profile.prefill_tokens and profile.prefill_ms[-1] > 0 and profile.context_ms_per_ktoken > 0
    args = parse_config(["--config", path], env={})
    assert args.latency_profile.path == path and args.latency_profile.profile == profile
    assert args.async_scheduling and args.sources["num_gpu_blocks"].kind == "config file"
    assert args.max_num_batched_tokens in (2048, 8192) and args.max_num_seqs in (256, 1024)
    assert _command(name)[-2:] == ["-o", path]


@pytest.mark.parametrize("name", PROFILES)
def test_a_shipped_profile_is_what_the_command_writes(name, tmp_path, monkeypatch):
    pytest.importorskip("aiconfigurator_core", reason="the gpu extra (pip install 'gmock-engine[gpu]') is not installed")
    from gmock_engine.tools import gpu_profile as profile

    monkeypatch.chdir(REPO)
    argv = _command(name)
    args = profile.parse_tool_config(profile.build_profile_parser(), profile.PROFILE_SECTION, argv, env={})
    text = profile.build_from(args)
    with open(args.output, encoding="utf-8") as f:
        assert f.read() == text, f"regenerate: ./run.sh profile {shlex.join(argv)}"


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["--system", "x100_sxm", "--model", "meta-llama/Llama-3.1-8B"], r"--system x100_sxm: no vLLM tables for it; the tables serve: .*h100_sxm"),
        (["--system", "h100_sxm", "--model", "acme/Nonesuch-7B"], r"--model acme/Nonesuch-7B: AIConfigurator has no config of it .*Qwen/Qwen3-32B"),
        (["--system", "h100_sxm", "--model", "meta-llama/Llama-3.1-8B", "--backend-version", "0.1.0"],
         r"--backend-version 0.1.0: h100_sxm has vLLM tables of 0.24.0 only"),
        (["--system", "h100_sxm", "--model", "meta-llama/Llama-3.1-8B", "--tp", "3"], r"--tp 3: the tables serve TP 1, 2, 4 or 8"),
        (["--system", "h100_sxm", "--model", "meta-llama/Llama-3.1-405B", "--tp", "1"], r"does not fit h100_sxm: weights .* try a larger --tp"),
        (["--system", "h200_sxm", "--model", "MiniMaxAI/MiniMax-M2.5", "--tp", "8", "--precision", "native"],
         r"the tables cannot serve MiniMaxAI/MiniMax-M2.5 on h200_sxm at TP 8, native: .*weight_block_size"),
        (["--model", "meta-llama/Llama-3.1-8B"], r"argument --system: required"),
        (["--system", "h100_sxm", "--model", "meta-llama/Llama-3.1-8B", "--precision", "int3"], r"argument --precision: .*int3"),
    ],
)
def test_what_the_tables_cannot_serve_stops_with_what_they_can(argv, pattern, tmp_path, capsys):
    pytest.importorskip("aiconfigurator_core", reason="the gpu extra is not installed")
    import re

    from gmock_engine.tools import gpu_profile as profile

    out = tmp_path / "p.ini"
    assert profile.main([*argv, "-o", str(out)]) == 2
    assert re.search(pattern, capsys.readouterr().err)
    assert not out.exists()


def test_a_model_given_as_its_config_json(tmp_path):
    pytest.importorskip("aiconfigurator_core", reason="the gpu extra is not installed")
    import aiconfigurator_core

    from gmock_engine.tools import gpu_profile as profile

    source = os.path.join(os.path.dirname(aiconfigurator_core.__file__), "model_configs", "Qwen--Qwen3-8B_config.json")
    config = tmp_path / "config.json"
    config.write_text(open(source, encoding="utf-8").read())
    out = tmp_path / "p.ini"
    assert profile.main(["--system", "h100_sxm", "--model", str(config), "-o", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# config.json on h100_sxm, TP 1, bf16")
    listed = profile.build("h100_sxm", "Qwen/Qwen3-8B", 1, "bf16", None, str(out))
    # the same model by name: the same timing and limits
    assert text.split("[latency-profile]", 1)[1] == listed.split("[latency-profile]", 1)[1]
