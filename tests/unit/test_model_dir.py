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
    assert len(merges) == 32000 - 256 - 9  # bytes, added tokens, specials
    # every merge makes the token of the next id, from tokens that exist before it
    for rank, (a, b) in enumerate(merges):
        assert vocab[a + b] == 256 + rank and vocab[a] < vocab[a + b] and vocab[b] < vocab[a + b]
    assert merges[0] == ("Ġ", "Ġ")  # two spaces: the first printable pair


@pytest.mark.parametrize("size", [model_dir.MIN_VOCAB_SIZE, 1000, 9284, 50000, model_dir.MAX_VOCAB_SIZE])
def test_any_size_in_range_is_filled_exactly(size):
    vocab, merges = model_dir.vocabulary(size)
    assert len(vocab) == size and len(merges) == size - 265


def test_the_largest_vocabulary_is_all_the_rules_make():
    # one more three-symbol step finds no new token: MAX_VOCAB_SIZE is exact
    vocab, _ = model_dir.vocabulary(model_dir.MAX_VOCAB_SIZE)
    printable = [model_dir.byte_symbols()[b] for b in range(0x20, 0x7F)]
    pairs = [a + b for a in printable for b in printable]
    triples = {pairs[i % len(pairs)] + printable[(i // len(pairs) * 7 + i) % 95] for i in range(len(pairs) * 95)}
    assert len(vocab) == 256 + len(pairs) + len(triples - set(pairs)) + 9


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
    assert [t["id"] for t in tokenizer["added_tokens"]] == list(range(991, 1000))


def test_ensure_keeps_a_complete_dir_and_refuses_before_writing(tmp_path):
    dest = model_dir.ensure_model_dir(tmp_path / "m")
    stamp = (dest / "tokenizer.json").stat().st_mtime_ns
    model_dir.ensure_model_dir(dest)
    assert (dest / "tokenizer.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError):
        model_dir.write_model_dir(tmp_path / "never", vocab_size=10)
    assert not (tmp_path / "never").exists()


# -- the added tokens and the chat template (tool calling, reasoning) ------------------


@pytest.mark.parametrize("size", [model_dir.MIN_VOCAB_SIZE, 1000, 32000])
def test_added_tokens_come_just_before_the_specials_which_stay_last(size):
    vocab, merges = model_dir.vocabulary(size)
    markers = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
    assert [vocab[t] for t in markers] == list(range(size - 9, size - 3))
    assert [vocab[t] for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]] == [size - 3, size - 2, size - 1]
    assert all(vocab[a + b] < size - 9 for a, b in merges)  # no merge makes a marker: each is one added token
    added = model_dir.tokenizer_json(size)["added_tokens"]
    assert [(t["id"], t["content"], t["special"]) for t in added] == (
        [(size - 9 + i, t, False) for i, t in enumerate(markers)]
        + [(size - 3, "<|endoftext|>", True), (size - 2, "<|im_start|>", True), (size - 1, "<|im_end|>", True)])
    files = model_dir.model_files(size, 4096)
    assert files["config.json"]["eos_token_id"] == size - 1 == files["generation_config.json"]["eos_token_id"]


def test_tokenizers_reads_each_marker_as_one_id_and_keeps_it_in_the_text(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    dest = model_dir.write_model_dir(tmp_path / "m", vocab_size=1000)
    tok = tokenizers.Tokenizer.from_file(str(dest / "tokenizer.json"))
    text = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tok.encode(text).ids
    for i, marker in enumerate(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]):
        assert tok.token_to_id(marker) == 991 + i and tok.encode("x" + marker + "y").ids[1] == 991 + i
    assert {991, 992, 995, 996} <= set(ids)
    # not special: decoding with skip_special_tokens keeps them (the parsers read the text)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode([998, 65, 999], skip_special_tokens=True) == "A"


def test_the_chat_template_is_qwen25s_tool_calling_chatml():
    t = model_dir.CHAT_TEMPLATE
    # tools in the system turn, Qwen2.5's wording and tags
    assert "# Tools\\n\\nYou may call one or more functions to assist with the user query." in t
    assert "within <tools></tools> XML tags:\\n<tools>" in t and "(tool | tojson)" in t and "\\n</tools>" in t
    assert '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>' in t
    # assistant tool calls and tool results
    assert "'<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": '" in t and "'}\\n</tool_call>'" in t
    assert "'<|im_start|>user'" in t and "'\\n<tool_response>\\n'" in t and "'\\n</tool_response>'" in t
    # Qwen3's enable_thinking=false: an empty think block in the generation prompt
    assert "enable_thinking is false" in t and "'<think>\\n\\n</think>\\n\\n'" in t
    # content as a string or as parts, through one macro the messages' content is passed to
    assert "render_content(message['content'])" in t and "for part in content" in t
    # the real rendering (transformers, vLLM, vllm-rs): tests/e2e/test_model_dir_e2e.py


def test_ensure_rewrites_a_dir_an_older_version_wrote(tmp_path):
    dest = model_dir.write_model_dir(tmp_path / "m", vocab_size=1000)
    assert model_dir.is_current(dest, 1000) and not model_dir.is_current(dest, 1001)
    # an older model dir: the plain ChatML template and only the three specials
    tok_config = json.loads((dest / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config))
    assert not model_dir.is_current(dest, 1000)
    model_dir.ensure_model_dir(dest, vocab_size=1000)
    assert json.loads((dest / "tokenizer_config.json").read_text())["chat_template"] == model_dir.CHAT_TEMPLATE
    tokenizer = json.loads((dest / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = tokenizer["added_tokens"][-3:]
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    assert not model_dir.is_current(dest, 1000)
    model_dir.ensure_model_dir(dest, vocab_size=1000)
    assert len(json.loads((dest / "tokenizer.json").read_text())["added_tokens"]) == 9
    assert model_dir.is_current(dest, 1000)
