"""tools/model_dir.py: the weightless model directory, written without `tokenizers`
(tests/e2e/test_model_dir_e2e.py holds it against the file `tokenizers` saves)."""

import json

import pytest

from gmock_engine.tools import model_dir


def test_vocabulary_layout():
    vocab, merges = model_dir.vocabulary(32000)
    assert len(vocab) == 32000 and len(set(vocab.values())) == 32000
    assert sorted(vocab.values()) == list(range(32000))
    symbols = model_dir.byte_symbols()
    assert [vocab[s] for s in symbols] == list(range(256))
    assert [vocab[s] for s in model_dir.SPECIALS] == [31997, 31998, 31999]
    assert len(merges) == 32000 - 256 - 3
    # every merge makes the token of the next id, from tokens that exist before it
    for rank, (a, b) in enumerate(merges):
        assert vocab[a + b] == 256 + rank and vocab[a] < vocab[a + b] and vocab[b] < vocab[a + b]
    assert merges[0] == ("Ġ", "Ġ")  # two spaces: the first printable pair


@pytest.mark.parametrize("size", [model_dir.MIN_VOCAB_SIZE, 1000, 9284, 50000, model_dir.MAX_VOCAB_SIZE])
def test_any_size_in_range_is_filled_exactly(size):
    vocab, merges = model_dir.vocabulary(size)
    assert len(vocab) == size and len(merges) == size - 259


def test_the_largest_vocabulary_is_all_the_rules_make():
    # one more three-symbol step finds no new token: MAX_VOCAB_SIZE is exact
    vocab, _ = model_dir.vocabulary(model_dir.MAX_VOCAB_SIZE)
    printable = [model_dir.byte_symbols()[b] for b in range(0x20, 0x7F)]
    pairs = [a + b for a in printable for b in printable]
    triples = {pairs[i % len(pairs)] + printable[(i // len(pairs) * 7 + i) % 95] for i in range(len(pairs) * 95)}
    assert len(vocab) == 256 + len(pairs) + len(triples - set(pairs)) + 3


@pytest.mark.parametrize("size, match", [(model_dir.MIN_VOCAB_SIZE - 1, "too small"), (model_dir.MAX_VOCAB_SIZE + 1, "too large")])
def test_impossible_sizes_are_refused(size, match):
    with pytest.raises(ValueError, match=match):
        model_dir.vocabulary(size)


def test_written_dir_is_complete_and_consistent(tmp_path):
    dest = model_dir.write_model_dir(tmp_path / "m", vocab_size=1000, max_model_len=4096)
    names = sorted(p.name for p in dest.iterdir())
    assert names == ["config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((dest / "config.json").read_text())
    tokenizer = json.loads((dest / "tokenizer.json").read_text())
    tok_config = json.loads((dest / "tokenizer_config.json").read_text())
    assert config["vocab_size"] == 1000 and config["eos_token_id"] == 999 and config["max_position_embeddings"] == 4096
    assert tok_config["model_max_length"] == 4096 and "<|im_start|>" in tok_config["chat_template"]
    assert len(tokenizer["model"]["vocab"]) == 1000
    assert [t["id"] for t in tokenizer["added_tokens"]] == [997, 998, 999]


def test_ensure_keeps_a_complete_dir_and_refuses_before_writing(tmp_path):
    dest = model_dir.ensure_model_dir(tmp_path / "m")
    stamp = (dest / "tokenizer.json").stat().st_mtime_ns
    model_dir.ensure_model_dir(dest)
    assert (dest / "tokenizer.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError):
        model_dir.write_model_dir(tmp_path / "never", vocab_size=10)
    assert not (tmp_path / "never").exists()
