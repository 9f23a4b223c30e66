"""`--token-source text` (tokens.TextTokens, content/corpus.py): ids of English text
encoded once with the served model's tokenizer. What a client sees is
checked: any slice decodes to printable text, re-tokenizing a request's
text counts what was generated, the ids are deterministic per (seed, rank,
request id), stop ids stay out while the text stays text, and the flag
stops at start without --tokenizer. Also through the engine: lanes, stop
sets and logprobs."""

import random

import pytest

from gmock_engine.config import loader as config, validators
from gmock_engine.content import corpus, tokens
from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.content.tokenizer import load_tokenizer
from gmock_engine.tools import model_dir
from gmock_engine.wire.inputs import EngineCoreRequest

from engine_steps import outputs_of, run, tokens_of
from test_logprobs import check_row, decode_lists

tokenizers = pytest.importorskip("tokenizers")


def _trained(directory, pre_tokenizer, decoder, normalizer=None):
    """A BPE trained on the corpus (longer tokens than the model dir's, as a real vocabulary has)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(list(corpus.SENTENCES), trainer)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module", params=["model-dir", "model-dir-1000", "byte-level", "metaspace", "sentencepiece-legacy"])
def tokenizer(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(request.param)
    if request.param == "model-dir":
        path = model_dir.write_model_dir(base / "m", vocab_size=32000)
    elif request.param == "model-dir-1000":
        path = model_dir.write_model_dir(base / "m", vocab_size=1000)
    elif request.param == "byte-level":  # GPT-2 / Llama 3 / Qwen style
        path = _trained(base / "t", tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False), tokenizers.decoders.ByteLevel())
    elif request.param == "metaspace":  # SentencePiece style: the space is a "▁" prefix of the next word
        path = _trained(base / "t", tokenizers.pre_tokenizers.Metaspace(), tokenizers.decoders.Metaspace())
    else:  # Llama 2's: a normalizer prepends "▁" to the text, so " The" is "▁▁The" (tokens.sentence_ids' other case)
        norm, dec = tokenizers.normalizers, tokenizers.decoders
        path = _trained(
            base / "t",
            tokenizers.pre_tokenizers.Split("▁", behavior="merged_with_next"),
            dec.Sequence([dec.Replace("▁", " "), dec.Fuse(), dec.Strip(" ", 1, 0)]),
            norm.Sequence([norm.Prepend("▁"), norm.Replace(" ", "▁")]),
        )
    return load_tokenizer(str(path))


def _request_text(source, tok, rid, n, chunk):
    """What a frontend makes of one request: its ids drawn `chunk` at a time, decoded."""
    state = source.initial_state(rid)
    ids = []
    while len(ids) < n:
        more, state = source.draw(state, min(chunk, n - len(ids)))
        ids += more
    return ids, tok.decode(ids)


def test_any_slice_decodes_to_printable_text(tokenizer):
    source = tokens.TextTokens(tokenizer, 0, 0)
    assert 60000 <= source.size <= tokens.TEXT_POOL_SIZE
    rng = random.Random(1)
    for _ in range(400):
        start, n = rng.randrange(source.size), rng.randint(1, 300)
        ids, _ = source.draw(start, n)
        text = tokenizer.decode(ids)
        assert text and text.isprintable() and "\ufffd" not in text, (start, n, text)
    whole = tokenizer.decode(source.ids[: source.size])
    assert tokenizer.encode(whole) == source.ids[: source.size]  # one tokenization of real text
    assert "  " not in whole and whole.strip()[-1] == "."
    # every sentence of the corpus, and only those: prose, not junk
    assert {s.strip() for s in whole.replace(". ", ".\0").replace("? ", "?\0").split("\0")} <= set(corpus.SENTENCES)


def test_re_tokenizing_a_requests_text_counts_what_was_generated(tokenizer):
    source = tokens.TextTokens(tokenizer, 3, 1)
    rng = random.Random(2)
    generated = counted = 0
    for i in range(300):
        n = rng.randint(8, 600)
        ids, text = _request_text(source, tokenizer, f"cmpl-{i}-0", n, rng.choice((1, 4, 64)))
        again = len(tokenizer.encode(text))
        assert abs(again - n) <= max(2, 0.02 * n), (n, again, text)
        generated += n
        counted += again
    assert abs(counted - generated) <= 0.02 * generated


def test_requests_start_at_a_sentence_and_are_deterministic_per_seed_rank_and_request(tokenizer):
    def first(seed, rank, rid, n=30):
        tokens._text_pools.clear()  # built again: the same pool from the same seed
        source = tokens.TextTokens(tokenizer, seed, rank)
        return _request_text(source, tokenizer, rid, n, 4)

    assert first(0, 0, "a") == first(0, 0, "a")
    assert first(0, 0, "a") != first(0, 0, "b")
    assert first(0, 0, "a") != first(0, 1, "a")
    assert first(0, 0, "a") != first(1, 0, "a")
    for rid in ("a", "b", "c", "d"):
        text = first(5, 0, rid, 200)[1].strip()
        assert any(text.startswith(s) for s in corpus.SENTENCES), text
    pool = tokens.TextTokens(tokenizer, 0, 0).ids
    assert tokens.TextTokens(tokenizer, 0, 1).ids is pool  # one pool per seed, every rank
    assert tokens.TextTokens(tokenizer, 1, 0).ids != pool


def test_stop_ids_stay_out_and_the_text_stays_text(tokenizer):
    source = tokens.TextTokens(tokenizer, 0, 0)
    counts = {}
    for token in source.ids[: source.size]:
        counts[token] = counts.get(token, 0) + 1
    common = sorted(counts, key=counts.get, reverse=True)[:3]  # the most frequent ids of the text
    stops = frozenset(common + [tokenizer.vocab_size - 1])
    free = source.ids_avoiding(stops)
    assert len(free) == len(source.ids) and not stops & set(free)
    rng = random.Random(3)
    for _ in range(200):
        p, n = rng.randrange(source.size), rng.randint(1, tokens.POOL_PAD)
        assert free[p : p + n] == source.avoid(source.ids[p : p + n], stops)
        text = tokenizer.decode(free[p : p + n])
        assert text.isprintable() and "\ufffd" not in text
    assert not source.only_emits(0, stops)
    assert source.only_emits(0, frozenset(counts))
    # every filler a stop id as well: the next id that is not
    fillers = frozenset(source._fillers) | stops
    assert not fillers & set(source.avoid(source.ids[:500], fillers))


def test_through_the_engine_with_lanes_stop_ids_and_logprobs(tokenizer):
    def engine(chunk):
        source = tokens.make_source("text", tokenizer.vocab_size, 7, 0, tokenizer=tokenizer.path)
        return source, EngineCore(
            EngineSettings(rank=0, num_clients=1, vocab_size=tokenizer.vocab_size, seed=7, output_token_chunk_size=chunk, token_source=source)
        )

    for chunk in (1, 4):
        source, e = engine(chunk)
        stop = source.ids[source.initial_state("s") + 2]  # the third id of request "s"
        e.apply(EngineCoreRequest("plain", 3, 50, True, prompt_token_ids=[1, 2, 3]))
        e.apply(EngineCoreRequest("s", 3, 50, True, prompt_token_ids=[1, 2, 3], stop_token_ids=(stop,)))
        e.apply(EngineCoreRequest("lp", 3, 50, True, prompt_token_ids=[1, 2, 3], logprobs=3))
        sent = run(e)
        assert tokens_of(sent, "plain") == source.draw(source.initial_state("plain"), 50)[0]
        assert tokens_of(sent, "lp") == source.draw(source.initial_state("lp"), 50)[0]
        rows = [row for o in outputs_of(sent, "lp") for row in zip(*decode_lists(o[2]))]
        assert [ids[0] for (ids, _), _ in rows] == tokens_of(sent, "lp")  # column 0: the sampled text ids
        for (ids, lps), rank in rows:
            assert len(ids) == 4
            check_row(ids, lps, rank)
        made = tokens_of(sent, "s")
        assert len(made) == 50 and stop not in made
        assert made == source.avoid(source.draw(source.initial_state("s"), 50)[0], {stop})
        for rid in ("plain", "s", "lp"):
            text = tokenizer.decode(tokens_of(sent, rid))
            assert text.isprintable() and "\ufffd" not in text and "  " not in text
            if rid != "s":  # the stop id became a filler there
                assert any(text.strip().startswith(s) or s.startswith(text.strip()) for s in corpus.SENTENCES), text
                assert abs(len(tokenizer.encode(text)) - 50) <= 1


def test_text_needs_the_tokenizer_flag(tmp_path):
    assert validators.token_source("text") == "text"
    with pytest.raises(config.ConfigError, match=r"argument --token-source: text \(from command line\) needs --tokenizer PATH"):
        config.parse_config(["--token-source", "text"], env={})
    with pytest.raises(config.ConfigError, match=r"--token-source: text \(from environment GMOCK_TOKEN_SOURCE\) needs --tokenizer"):
        config.parse_config([], env={"GMOCK_TOKEN_SOURCE": "text"})
    with pytest.raises(ValueError, match="--token-source text needs --tokenizer"):
        tokens.make_source("text", 32000, 0, 0)
    path = model_dir.write_model_dir(tmp_path / "m", vocab_size=2000)
    c = config.parse_config(["--token-source", "text", "--tokenizer", str(path)], env={})
    assert c.token_source == "text" and c.vocab_size == 2000


def test_the_pool_is_built_in_well_under_a_second(tokenizer):
    import time

    tokens._text_pools.clear()
    tokens._sentence_ids.clear()
    start = time.perf_counter()
    tokens.TextTokens(tokenizer, 11, 0)
    assert time.perf_counter() - start < 0.5


def test_a_reload_switches_to_text_for_new_requests_and_refuses_it_without_a_tokenizer(tmp_path):
    from gmock_engine.config import reload, settings

    path = model_dir.write_model_dir(tmp_path / "m", vocab_size=2000)
    live = tmp_path / "live.ini"
    live.write_text("[gmock_engine]\ntoken-source = random\n")
    argv = ["--config", str(live), "--tokenizer", str(path)]
    current = config.parse_config(argv, env={})
    live.write_text("[gmock_engine]\ntoken-source = text\n")
    found = reload.check(current, lambda: config.parse_config(argv, env={}))
    assert found.error is None and [c.flag for c in found.changes] == ["--token-source"]
    parts = settings.from_config(found.config)
    engine = settings.engine_settings(parts, 0, 1, False, settings.Wire())
    assert isinstance(engine.token_source, tokens.TextTokens)
    # the same reload in a process started without --tokenizer: refused, naming both flags
    bare = ["--config", str(live)]
    live.write_text("[gmock_engine]\ntoken-source = random\n")
    current = config.parse_config(bare, env={})
    live.write_text("[gmock_engine]\ntoken-source = text\n")
    found = reload.check(current, lambda: config.parse_config(bare, env={}))
    assert found.error and "--token-source: text" in found.error and "needs --tokenizer" in found.error
