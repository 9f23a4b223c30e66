"""tools/mm_model_dir.py: the vision-language model dir (the frontend loads it in
tests/e2e/test_multimodal_e2e.py; docs/multimodal.md)."""

import json

from gmock_engine.tools import mm_model_dir


def test_the_image_markup_comes_after_the_vocabulary_and_the_configs_agree(tmp_path):
    dest = mm_model_dir.write_mm_model_dir(tmp_path / "m", vocab_size=1000, max_model_len=4096)
    config = json.loads((dest / "config.json").read_text())
    tokenizer = json.loads((dest / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert added["<image>"] == config["image_token_id"] == 1000 == mm_model_dir.image_token_id(1000)
    assert sorted(added[t] for t in mm_model_dir.IMAGE_MARKUP) == list(range(1000, 1000 + len(mm_model_dir.IMAGE_MARKUP)))
    assert added["<|im_end|>"] == config["text_config"]["eos_token_id"] == 999  # EOS stays the vocabulary's last id
    assert config["text_config"]["vocab_size"] == 1000 + len(mm_model_dir.IMAGE_MARKUP)  # the markup ids are in range
    processor = json.loads((dest / "processor_config.json").read_text())
    assert processor["image_seq_len"] == mm_model_dir.TILE_TOKENS == 169
    assert json.loads((dest / "preprocessor_config.json").read_text())["max_image_size"] == {"longest_edge": 364}
    assert mm_model_dir.is_current(dest, 1000, 4096) and not mm_model_dir.is_current(dest, 1000, 8192)
