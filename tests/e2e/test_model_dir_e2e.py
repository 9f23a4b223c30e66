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
vocab = {k: v for k, v in ours["model"]["vocab"].items() if v < vocab_size - 3}
merges = [tuple(m) for m in ours["model"]["merges"]]
specials = [t["content"] for t in ours["added_tokens"]]
for s in specials:
    vocab[s] = len(vocab)
tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
tok.decoder = decoders.ByteLevel()
tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
theirs = json.loads(tok.to_str())
hf = AutoTokenizer.from_pretrained(path)
chat = hf.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True)
ids = hf(chat, add_special_tokens=False)["input_ids"]
print(json.dumps({"equal": theirs == ours, "chat": chat, "ids": ids, "decoded": hf.decode(ids),
                  "eos": hf.eos_token_id, "vocab": len(hf)}))
"""


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
