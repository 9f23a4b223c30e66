"""The model dir's tokenizer.json, written without `tokenizers` (tools/model_dir.py),
against the file HuggingFace `tokenizers` saves for the same vocabulary and merges,
and loaded the way the Python frontend loads it (transformers' AutoTokenizer):
run with the Python frontend's venv, which has both (~5 s)."""

from __future__ import annotations

import json
import subprocess

import pytest

from gmock_engine.tools import model_dir

pytestmark = pytest.mark.e2e

CHECK = r"""
import json, sys
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer
path, vocab_size = sys.argv[1], int(sys.argv[2])
ours = json.load(open(path + "/tokenizer.json", encoding="utf-8"))
added = [t for t in ours["added_tokens"] if not t["special"]]
specials = [t["content"] for t in ours["added_tokens"] if t["special"]]
vocab = {k: v for k, v in ours["model"]["vocab"].items() if v < vocab_size - len(added) - len(specials)}
merges = [tuple(m) for m in ours["model"]["merges"]]
for s in [t["content"] for t in added] + specials:
    vocab[s] = len(vocab)
tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
tok.decoder = decoders.ByteLevel()
tok.add_tokens([AddedToken(t["content"], special=False, normalized=False) for t in added])
tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
theirs = json.loads(tok.to_str())
hf = AutoTokenizer.from_pretrained(path)
chat = hf.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True)
ids = hf(chat, add_special_tokens=False)["input_ids"]
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
conversation = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    {"role": "assistant", "content": "Sunny in Paris."},
]
with_tools = hf.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
no_system = hf.apply_chat_template(conversation[1:2], tools=tools, tokenize=False, add_generation_prompt=False)
no_thinking = hf.apply_chat_template(conversation[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
markers = {t["content"]: hf.convert_tokens_to_ids(t["content"]) for t in added}
print(json.dumps({"equal": theirs == ours, "chat": chat, "ids": ids, "decoded": hf.decode(ids),
                  "eos": hf.eos_token_id, "vocab": len(hf), "with_tools": with_tools, "no_system": no_system,
                  "no_thinking": no_thinking, "markers": markers,
                  "think_ids": hf("<think>x</think>", add_special_tokens=False)["input_ids"]}))
"""

TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


@pytest.mark.parametrize("vocab_size", [32000, 1000])
def test_tokenizer_json_is_what_tokenizers_saves(frontends, tmp_path, vocab_size):
    dest = model_dir.write_model_dir(tmp_path / "m", vocab_size=vocab_size)
    out = subprocess.run([str(frontends.python), "-c", CHECK, str(dest), str(vocab_size)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["equal"], "tokenizers saves a different tokenizer.json for the same vocabulary"
    assert result["chat"] == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert result["decoded"] == result["chat"]
    assert result["ids"][0] == vocab_size - 2 and result["eos"] == vocab_size - 1 and result["vocab"] == vocab_size
    # the added markers: one id each, before the specials; the text keeps them
    assert result["markers"] == {t: vocab_size - 9 + i for i, t in enumerate(
        ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"])}  # fmt: skip
    assert result["think_ids"][0] == vocab_size - 5 and result["think_ids"][-1] == vocab_size - 4
    # Qwen2.5's tool calling, as transformers renders the template (what vLLM does)
    assert result["with_tools"] == (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_SYSTEM
        + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        + '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        + "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\nSunny in Paris.<|im_end|>\n<|im_start|>assistant\n"
    )  # fmt: skip
    assert result["no_system"] == "<|im_start|>system\n" + TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    assert result["no_thinking"] == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
