"""The weightless model directory a vLLM frontend serves in front of the mock.

A frontend started with `--data-parallel-size-local 0` loads no weights; it
reads only config.json (a tiny Qwen2 decoder), the tokenizer and its config
(a ChatML chat template) and generation_config.json. This module writes
them, with the tokenizer built here from rules, not downloaded and not
trained, and written as the `tokenizer.json` that HuggingFace `tokenizers`
would save for it (a byte-level BPE), so no `tokenizers` package is needed:
`./run.sh serve` writes the directory from the engine's own venv, before any
frontend is installed. tests/e2e/test_model_dir_e2e.py checks the file
against the one `tokenizers` builds from the same vocabulary and merges.

Vocabulary layout (size `vocab_size`, default 32000):
  ids [0, 256)            the 256 byte-level symbols
  ids [256, 256+95*95)    every pair of printable-ASCII byte symbols
  ids [.., vocab-9)       three-symbol tokens (pair + printable symbol)
  vocab-9 .. vocab-4      <tool_call>, </tool_call>, <tool_response>,
                          </tool_response>, <think>, </think>: added tokens,
                          not special (as in Qwen2.5/Qwen3), so a tool-call or
                          reasoning parser finds each as one id and the text
                          keeps them
  vocab-3, -2, -1         <|endoftext|>, <|im_start|>, <|im_end|> (special)
so almost every id decodes to 1-3 printable ASCII characters, which keeps the
frontend's incremental detokenizer cheap and its output valid UTF-8; the
specials stay last (EOS = vocab_size - 1) whatever else is added before them.

The chat template is ChatML with Qwen2.5's tool calling: `tools` go into the
system turn under `# Tools` inside `<tools></tools>`, an assistant's tool calls
are rendered as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`
(what the hermes tool-call parser reads), tool results as `<tool_response>`
blocks in a user turn; and Qwen3's `enable_thinking=false` (chat template
kwargs) closes an empty `<think></think>` block in the generation prompt, as
the qwen3 reasoning parser expects. Without tools and without a system
message nothing is added (no default system prompt).

With `embedding_dim` (`--embedding-dim N`) the same decoder describes a
pooling model (docs/embeddings.md): hidden_size N, the size a frontend
started with `--runner pooling --convert embed` reports for its vectors, and
`is_matryoshka` so that it passes a request's `dimensions` on to the engine;
with `num_labels` also `id2label`, the labels of `--convert classify`.

With `--emulated-gpu-profile FILE` or `--emulated-gpu-step-ms EXPR` the dir
is the emulated GPU's (benchmarks/emulated_gpu/, benchmarks/README.md): a
real vLLM engine core with that plugin computes the decoder for real, one
layer big enough for vLLM's CPU attention backend (EMULATED_GPU_CONFIG), and
paces each step to the time the latency profile, or the expression of the
batch, gives; the frontend in front of it serves the same dir.

Usage: python -m gmock_engine.tools.model_dir OUTDIR [--vocab-size N] [--max-model-len N]
       [--embedding-dim N [--num-labels L]]
       [--emulated-gpu-profile FILE | --emulated-gpu-step-ms EXPR [--emulated-gpu-spread --emulated-gpu-seed N]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Added tokens that are not special (Qwen's order), placed just before SPECIALS:
#: the markup the hermes tool-call parser and the qwen3 reasoning parser look up by id.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

#: The smallest vocabulary: the 256 byte symbols, the added tokens, the specials and one merge.
MIN_VOCAB_SIZE = 256 + len(ADDED_TOKENS) + len(SPECIALS) + 1
#: The largest the rules below make: bytes, 95*95 pairs, the distinct triples, added tokens, specials.
MAX_VOCAB_SIZE = 866665

#: ChatML with Qwen2.5's tool calling (see the module docstring). One macro renders
#: a message's content, a string or a list of parts (its loop over the parts makes
#: vLLM pass content in the OpenAI format).
CHAT_TEMPLATE = "".join(
    line.strip()
    for line in """
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content -%}
        {%- for part in content -%}
            {%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if messages[0]['role'] == 'system' -%}
        {{- render_content(messages[0]['content']) + '\\n\\n' -}}
    {%- endif -%}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' -}}
    {{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' and loop.first and tools -%}
    {%- elif message['role'] == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + render_content(message['content']) + '\\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- else -%}
        {%- set content = render_content(message['content']) -%}
        {{- '<|im_start|>' + message['role'] + '\\n' + content -}}
        {%- if message['role'] == 'assistant' and message.tool_calls -%}
            {%- for tool_call in message.tool_calls -%}
                {%- if (loop.first and content) or not loop.first -%}
                    {{- '\\n' -}}
                {%- endif -%}
                {%- if tool_call.function is defined -%}
                    {%- set tool_call = tool_call.function -%}
                {%- endif -%}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' -}}
                {%- if tool_call.arguments is string -%}
                    {{- tool_call.arguments -}}
                {%- else -%}
                    {{- tool_call.arguments | tojson -}}
                {%- endif -%}
                {{- '}\\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- endif -%}
{%- endif -%}
""".splitlines()
)

#: Written last: a directory with it is complete (files are placed atomically).
DONE_FILE = "config.json"


def byte_symbols() -> List[str]:
    """GPT-2's byte-to-unicode table (what the ByteLevel pre-tokenizer maps
    each byte to): list index = byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def check_vocab_size(vocab_size: int) -> None:
    """ValueError unless the rules make a vocabulary of this size."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"a vocabulary of {vocab_size} ids is too small (at least {MIN_VOCAB_SIZE})")
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(f"a vocabulary of {vocab_size} ids is too large (at most {MAX_VOCAB_SIZE})")


def vocabulary(vocab_size: int) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """(token -> id, merges in rank order) for a vocabulary of `vocab_size`
    ids, the added tokens, then the specials last. ValueError when the rules
    cannot fill it."""
    check_vocab_size(vocab_size)
    sym = byte_symbols()
    printable = [sym[b] for b in range(0x20, 0x7F)]  # 95 symbols, space is 'Ġ'
    vocab = {s: i for i, s in enumerate(sym)}
    merges: List[Tuple[str, str]] = []
    budget = vocab_size - len(ADDED_TOKENS) - len(SPECIALS)

    def add(a: str, b: str) -> None:
        tok = a + b
        if tok not in vocab and len(vocab) < budget:
            vocab[tok] = len(vocab)
            merges.append((a, b))

    pairs = []
    for a in printable:
        for b in printable:
            if len(vocab) >= budget:
                break
            before = len(vocab)
            add(a, b)
            if len(vocab) > before:
                pairs.append(a + b)
    # Three-symbol tokens: interleaved so that letter and space combinations come early.
    i = 0
    while len(vocab) < budget and i < len(pairs) * len(printable):
        add(pairs[i % len(pairs)], printable[(i // len(pairs) * 7 + i) % len(printable)])
        i += 1
    assert len(vocab) == budget, "MAX_VOCAB_SIZE is more than the rules make"
    for s in ADDED_TOKENS + SPECIALS:
        vocab[s] = len(vocab)
    return vocab, merges


def added_tokens(vocab_size: int) -> List[dict]:
    """tokenizer.json's "added_tokens": ADDED_TOKENS (not special) and SPECIALS, by id,
    the last len(ADDED_TOKENS) + len(SPECIALS) ids of the vocabulary."""
    first = vocab_size - len(ADDED_TOKENS) - len(SPECIALS)
    return [
        {"id": first + i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": token in SPECIALS}
        for i, token in enumerate(ADDED_TOKENS + SPECIALS)
    ]  # fmt: skip


def tokenizer_json(vocab_size: int) -> dict:
    """tokenizer.json as `tokenizers` (0.20 and later: merges as pairs) saves a
    BPE model with a ByteLevel pre-tokenizer and decoder, the added tokens and the specials."""
    vocab, merges = vocabulary(vocab_size)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens(vocab_size),
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [list(m) for m in merges],
        },
    }


def small_files(vocab_size: int = 32000, max_model_len: int = 8192, embedding_dim: Optional[int] = None,
                num_labels: Optional[int] = None) -> Dict[str, dict]:
    """file name -> JSON content of every file but tokenizer.json, config.json
    last (cheap: no vocabulary is built). `embedding_dim`: a pooling model
    of that hidden size (Matryoshka: any smaller `dimensions` is allowed);
    with `num_labels`, its classifier's labels (LABEL_0...)."""
    eos_id = vocab_size - 1  # <|im_end|>
    pad_id = vocab_size - 3  # <|endoftext|>
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": max_model_len,
        "max_window_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    if embedding_dim is not None:
        config.update(hidden_size=embedding_dim, is_matryoshka=True)
        if num_labels is not None:
            config.update(id2label={str(i): f"LABEL_{i}" for i in range(num_labels)},
                          label2id={f"LABEL_{i}": i for i in range(num_labels)})  # fmt: skip
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_model_len,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    return {
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": {"bos_token_id": pad_id, "eos_token_id": eos_id, "pad_token_id": pad_id},
        "special_tokens_map.json": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        DONE_FILE: config,
    }


def model_files(vocab_size: int = 32000, max_model_len: int = 8192, embedding_dim: Optional[int] = None,
                num_labels: Optional[int] = None) -> Dict[str, dict]:
    """file name -> JSON content of the model directory, config.json last."""
    return {"tokenizer.json": tokenizer_json(vocab_size), **small_files(vocab_size, max_model_len, embedding_dim, num_labels)}


def write_model_dir(dest: Path, vocab_size: int = 32000, max_model_len: int = 8192, embedding_dim: Optional[int] = None,
                    num_labels: Optional[int] = None) -> Path:
    """Write the model directory into `dest` (created). Each file is written
    aside and renamed into place, config.json last, so a frontend reading
    the directory, or a second writer of the same one, never sees half a
    file. ValueError for a vocabulary the rules cannot make."""
    files = model_files(vocab_size, max_model_len, embedding_dim, num_labels)  # before touching the disk: may raise
    return write_files(dest, files)


def write_files(dest: Path, files: Dict[str, object]) -> Path:
    """Write a model dir's JSON `files` into `dest` (created), in their order,
    each aside and renamed into place (config.json last where it is last)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = dest / name
        tmp = path.with_name(f"{name}.tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(content, f, ensure_ascii=False, indent=None if name == "tokenizer.json" else 2)
            f.write("\n")
        os.replace(tmp, path)
    return dest


#: How much of tokenizer.json is_current reads: its added tokens come before the vocabulary.
_HEAD_CHARS = 8192


def is_current(dest: Path, vocab_size: int = 32000, max_model_len: int = 8192, embedding_dim: Optional[int] = None,
               num_labels: Optional[int] = None) -> bool:
    """`dest` is complete and what this version writes: every file but
    tokenizer.json as written now, and tokenizer.json's added tokens (a dir
    written before the added tokens or the tool-calling template existed is not)."""
    dest = Path(dest)
    try:
        for name, content in small_files(vocab_size, max_model_len, embedding_dim, num_labels).items():
            with open(dest / name, encoding="utf-8") as f:
                if json.load(f) != content:
                    return False
        with open(dest / "tokenizer.json", encoding="utf-8") as f:
            head = f.read(_HEAD_CHARS)
    except (OSError, ValueError):
        return False
    return f'"added_tokens": {json.dumps(added_tokens(vocab_size), ensure_ascii=False)}' in head


def ensure_model_dir(dest: Path, vocab_size: int = 32000, max_model_len: int = 8192, embedding_dim: Optional[int] = None,
                     num_labels: Optional[int] = None) -> Path:
    """`dest`, written unless it is complete and current already (is_current)."""
    dest = Path(dest)
    if not is_current(dest, vocab_size, max_model_len, embedding_dim, num_labels):
        write_model_dir(dest, vocab_size, max_model_len, embedding_dim, num_labels)
    return dest


#: The emulated GPU's architecture (benchmarks/emulated_gpu/gmock_emulated_gpu/__init__.py
#: ARCHITECTURE) and config.json's key for its step function (its config/loader.py CONFIG_KEY).
EMULATED_GPU_ARCHITECTURE = "GmockEmulatedGpuForCausalLM"
EMULATED_GPU_KEY = "gmock_emulated_gpu"
#: The emulated GPU's decoder: one layer, heads of 64 (vLLM's CPU attention
#: backend needs head_dim > 16), small enough that its real forward stays well
#: inside the emulated step time on a small CPU.
EMULATED_GPU_CONFIG = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "max_window_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}  # fmt: skip


def emulated_gpu_settings(latency_profile: Optional[str] = None, step_ms: Optional[str] = None, spread: bool = False,
                          seed: int = 0) -> Dict[str, object]:  # fmt: skip
    """config.json's emulated GPU settings: a latency profile (its absolute
    path: the engine reads it where it runs) or a step expression, one of them."""
    if bool(latency_profile) == bool(step_ms):
        raise ValueError("the emulated GPU needs a latency profile or a step expression (one of them)")
    settings: Dict[str, object] = {"spread": spread, "seed": seed}
    if latency_profile:
        settings["latency_profile"] = str(Path(latency_profile).resolve())
    else:
        settings["step_ms"] = step_ms
    return settings


def write_emulated_gpu_dir(dest: Path, latency_profile: Optional[str] = None, step_ms: Optional[str] = None,
                           spread: bool = False, seed: int = 0, max_model_len: int = 8192) -> Path:  # fmt: skip
    """The model dir (ensure_model_dir) made the emulated GPU's: its
    architecture, EMULATED_GPU_CONFIG, float32 (vLLM's CPU default) and the
    step function (emulated_gpu_settings). config.json is rewritten in place
    only when it changes, and renamed into place, as write_model_dir does."""
    settings = emulated_gpu_settings(latency_profile, step_ms, spread, seed)  # before touching the disk: may raise
    dest = ensure_model_dir(Path(dest), max_model_len=max_model_len)
    path = dest / DONE_FILE
    config = json.loads(path.read_text(encoding="utf-8"))
    wanted = {**config, **EMULATED_GPU_CONFIG, "architectures": [EMULATED_GPU_ARCHITECTURE], "torch_dtype": "float32",
              EMULATED_GPU_KEY: settings}  # fmt: skip
    if wanted != config:
        tmp = path.with_name(f"{DONE_FILE}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(wanted, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    return dest


def main(argv: List[str] = None, say: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> int:
    parser = argparse.ArgumentParser(prog="python -m gmock_engine.tools.model_dir", description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--embedding-dim", type=int, default=None, help="a pooling model of this hidden size")
    parser.add_argument("--num-labels", type=int, default=None, help="with --embedding-dim: its classifier's labels")
    gpu = parser.add_argument_group("the emulated GPU's model dir (benchmarks/emulated_gpu/)")
    step = gpu.add_mutually_exclusive_group()
    step.add_argument("--emulated-gpu-profile", metavar="FILE", help="pace each step to this latency profile")
    step.add_argument("--emulated-gpu-step-ms", metavar="EXPR",
                      help="pace each step to this expression of batch, decodes, prefill_tokens, prefill_reqs, "
                           "prefill_attention, context (ms)")  # fmt: skip
    gpu.add_argument("--emulated-gpu-spread", action="store_true", help="with a profile: draw each step from its spread")
    gpu.add_argument("--emulated-gpu-seed", type=int, default=0, help="the spread's seed")
    args = parser.parse_args(argv)
    if args.emulated_gpu_profile or args.emulated_gpu_step_ms:
        if args.embedding_dim is not None:
            parser.error("--embedding-dim: not with the emulated GPU (a decoder)")
        write_emulated_gpu_dir(args.outdir, args.emulated_gpu_profile, args.emulated_gpu_step_ms, args.emulated_gpu_spread,
                               args.emulated_gpu_seed, args.max_model_len)  # fmt: skip
        say(f"model dir {args.outdir}: the emulated GPU's ({EMULATED_GPU_ARCHITECTURE}), "
            f"{args.emulated_gpu_profile or args.emulated_gpu_step_ms}")
        return 0
    try:
        write_model_dir(args.outdir, args.vocab_size, args.max_model_len, args.embedding_dim, args.num_labels)
    except ValueError as exc:
        parser.error(f"--vocab-size: {exc}")
    say(f"model dir {args.outdir}: vocab={args.vocab_size} eos={args.vocab_size - 1} max_model_len={args.max_model_len}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
