"""gmock_engine/content/tokenizer.py and --tokenizer: the served model's tokenizer, loaded once, errors at start."""

import json
import sys

import pytest

from gmock_engine.config import loader as config
from gmock_engine.content import tokenizer
from gmock_engine.tools import model_dir

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir.write_model_dir(tmp_path_factory.mktemp("model"), vocab_size=4000)


def test_loads_the_model_dirs_tokenizer_once(model):
    tok = tokenizer.load_tokenizer(str(model))
    assert tok.vocab_size == 4000
    assert tok.eos_token_id == 3999  # <|im_end|>, from generation_config.json
    assert tok.special_ids == {3997, 3998, 3999}
    text = "Hello, world: {\"a\": [1, 2]}"
    assert tok.decode(tok.encode(text)) == text
    assert tok.token_id("<|im_start|>") == 3998
    assert tokenizer.load_tokenizer(str(model / "tokenizer.json")) is tok


def test_flag_sets_the_vocab_size_unless_given(model):
    assert config.parse_config(["--tokenizer", str(model)], env={}).vocab_size == 4000
    with pytest.raises(config.ConfigError, match=r"--vocab-size: 100 .* smaller than the tokenizer's 4000"):
        config.parse_config(["--tokenizer", str(model), "--vocab-size", "100"], env={})
    assert config.parse_config(["--tokenizer", str(model), "--vocab-size", "5000"], env={}).vocab_size == 5000


def test_bad_paths_stop_at_start_naming_the_flag(tmp_path):
    with pytest.raises(config.ConfigError, match=r"argument --tokenizer: .*no tokenizer.json .*\(from command line\)"):
        config.parse_config(["--tokenizer", str(tmp_path)], env={})  # a dir without tokenizer.json
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps({"model": {"type": "nothing"}}))
    with pytest.raises(config.ConfigError, match=r"argument --tokenizer: .*not a tokenizer"):
        config.parse_config(["--tokenizer", str(bad)], env={})


def test_missing_library_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import then raises ImportError
    path = model_dir.write_model_dir(tmp_path / "m", vocab_size=300)
    with pytest.raises(config.ConfigError, match=r"--tokenizer.*pip install 'gmock-engine\[content\]'"):
        config.parse_config(["--tokenizer", str(path)], env={})
