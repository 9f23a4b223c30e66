"""The weightless vision-language model directory (docs/multimodal.md).

Beside the text model dir (tools/model_dir.py) the frontends can serve an
Idefics3 (SmolVLM) style model: `Idefics3ForConditionalGeneration` with a
1-layer Llama text config and a SigLIP vision config of 364-pixel tiles and
14-pixel patches (no weights: a frontend in external-engine mode never loads
them), the real `Idefics3ImageProcessor` config, so `transformers` resizes,
splits and normalises each image as for the real model, and the
`Idefics3Processor` that expands each `<image>` of the prompt. Its token
count depends on the image's size: the longest edge is resized to at most
4 x 364 pixels, the image is split into up to 4 x 4 tiles of 364 pixels plus
one global tile, and each tile is 169 image tokens ((364 / 14)^2 / 2^2)
plus its markup (`<fake_token_around_image>`, `<row_R_col_C>` or
`<global-img>`).

LLaVA (`LlavaForConditionalGeneration`) is not used: vLLM 0.32's llava.py
imports its Pixtral module, which imports torchvision, and the frontends'
venv has no torchvision that loads with its torch (docs/multimodal.md).

The tokenizer is the text dir's byte-level BPE with the image markup added
at ids `vocab_size` and up (past the vocabulary the engine draws from, so an
answer never holds them; EOS stays `vocab_size - 1`); the text config's
vocab_size covers them. The chat template is the text dir's ChatML, whose
parts loop renders an image part as `<image>` (vLLM passes content in the
OpenAI format to a template that loops over parts).

Usage: python -m gmock_engine.tools.mm_model_dir OUTDIR [--vocab-size N] [--max-model-len N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List

from gmock_engine.tools import model_dir

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
#: The largest split grid of Idefics3's processor (4 x 4 tiles at the
#: default size), and the row/column markup its processor looks up (6 x 6).
GRID_MARKUP = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
#: Added at vocab_size and up, in this order: `<image>` is vocab_size.
IMAGE_MARKUP = [IMAGE_TOKEN, FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, END_OF_UTTERANCE] + GRID_MARKUP
#: SigLIP tiles of 364 pixels, 14-pixel patches, pixel shuffle by 2: 169 tokens per tile.
TILE_SIZE = 364
PATCH_SIZE = 14
SCALE_FACTOR = 2
TILE_TOKENS = (TILE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
#: The longest edge an image is resized to before it is split (4 tiles).
LONGEST_EDGE = 4 * TILE_SIZE

#: The text dir's template, an image part rendered as the placeholder the processor expands.
CHAT_TEMPLATE = model_dir.CHAT_TEMPLATE.replace(
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}",
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{- '" + IMAGE_TOKEN + "' -}}{%- endif -%}",
)
assert CHAT_TEMPLATE != model_dir.CHAT_TEMPLATE, "the text template's parts loop changed: render image parts again"


def image_token_id(vocab_size: int) -> int:
    """`<image>`'s id: just past the vocabulary the engine draws from."""
    return vocab_size


def _vision_config() -> dict:
    return {
        "model_type": "idefics3_vision",
        "hidden_size": 1152,
        "intermediate_size": 3072,
        "num_hidden_layers": 1,
        "num_attention_heads": 16,
        "image_size": TILE_SIZE,
        "patch_size": PATCH_SIZE,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    }


def _text_config(vocab_size: int, max_model_len: int) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": vocab_size + len(IMAGE_MARKUP),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": vocab_size - 3,
        "eos_token_id": vocab_size - 1,
        "pad_token_id": vocab_size - 3,
        "torch_dtype": "bfloat16",
    }


def _image_processor() -> dict:
    return {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": LONGEST_EDGE},
        "resample": 1,
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": TILE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }


def small_files(vocab_size: int = 32000, max_model_len: int = 8192) -> Dict[str, dict]:
    """file name -> JSON content of every file but tokenizer.json, config.json last."""
    text = model_dir.small_files(vocab_size, max_model_len)
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": image_token_id(vocab_size),
        "scale_factor": SCALE_FACTOR,
        "pad_token_id": vocab_size - 3,
        "text_config": _text_config(vocab_size, max_model_len),
        "vision_config": _vision_config(),
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    tokenizer_config = dict(text["tokenizer_config.json"], chat_template=CHAT_TEMPLATE, processor_class="Idefics3Processor")
    return {
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": text["generation_config.json"],
        "special_tokens_map.json": text["special_tokens_map.json"],
        "preprocessor_config.json": _image_processor(),
        "processor_config.json": {"processor_class": "Idefics3Processor", "image_seq_len": TILE_TOKENS},
        model_dir.DONE_FILE: config,
    }


def tokenizer_json(vocab_size: int) -> dict:
    """The text dir's tokenizer.json with IMAGE_MARKUP added at ids `vocab_size` and up."""
    tokenizer = model_dir.tokenizer_json(vocab_size)
    tokenizer["added_tokens"] += [
        {"id": vocab_size + i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, token in enumerate(IMAGE_MARKUP)
    ]  # fmt: skip
    return tokenizer


def write_mm_model_dir(dest: Path, vocab_size: int = 32000, max_model_len: int = 8192) -> Path:
    """Write the directory into `dest` (created), each file aside and renamed
    into place, config.json last; ValueError for a vocabulary the rules cannot make."""
    files = {"tokenizer.json": tokenizer_json(vocab_size), **small_files(vocab_size, max_model_len)}
    return model_dir.write_files(dest, files)


def is_current(dest: Path, vocab_size: int = 32000, max_model_len: int = 8192) -> bool:
    """`dest` is complete and what this version writes (its small files; tokenizer.json present)."""
    dest = Path(dest)
    try:
        for name, content in small_files(vocab_size, max_model_len).items():
            with open(dest / name, encoding="utf-8") as f:
                if json.load(f) != content:
                    return False
        return (dest / "tokenizer.json").stat().st_size > 0
    except (OSError, ValueError):
        return False


def ensure_mm_model_dir(dest: Path, vocab_size: int = 32000, max_model_len: int = 8192) -> Path:
    """`dest`, written unless it is complete and current already."""
    if not is_current(dest, vocab_size, max_model_len):
        write_mm_model_dir(dest, vocab_size, max_model_len)
    return Path(dest)


def main(argv: List[str] = None, say: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> int:
    parser = argparse.ArgumentParser(prog="python -m gmock_engine.tools.mm_model_dir", description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args(argv)
    try:
        write_mm_model_dir(args.outdir, args.vocab_size, args.max_model_len)
    except ValueError as exc:
        parser.error(f"--vocab-size: {exc}")
    say(f"model dir {args.outdir}: idefics3, vocab={args.vocab_size}, <image>={image_token_id(args.vocab_size)}, "
        f"eos={args.vocab_size - 1}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
