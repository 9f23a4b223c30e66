"""The hostile catalogue's cases: one `Case` per adversarial request (or
small burst) that hostile_catalogue.py sends through a real frontend: every
vllm_xargs key with hostile values, sampling parameters at their extremes,
prompts near and beyond max_model_len and out-of-vocabulary ids, odd request
ids, 200 streams closed at once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import e2e_harness as h

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Say something about mock engines."}]
PROMPT = "The quick brown fox jumps over the lazy dog"

#: The test model's context length (the model-dir writer's default, as the brief's
#: "test model"): these stacks use their own model dir with it, not the
#: harness's 1048576, so that "near" and "beyond" max_model_len are cheap.
MAX_MODEL_LEN = 8192
VOCAB_SIZE = 32000


@dataclass(frozen=True)
class Case:
    """One hostile request. `body` gets "model" if it has none; `headers` are
    (name, raw bytes) pairs sent as they are (UTF-8, empty, 100 kB)."""

    id: str
    path: str = COMPLETIONS
    body: Optional[Dict[str, Any]] = None
    stream: bool = False
    headers: Tuple[Tuple[str, bytes], ...] = ()
    #: "request" | "duplicate-id" (two concurrent requests, same X-Request-Id)
    #: | "disconnect-storm" (STORM_STREAMS streams closed mid-stream at once)
    kind: str = "request"
    #: what real vLLM would do, where it is known (shown in the table; not checked)
    note: str = ""

    def http_body(self) -> bytes:
        body = dict(self.body or {})
        body.setdefault("model", h.MODEL_NAME)
        if self.stream:
            body["stream"] = True
            body.setdefault("stream_options", {"include_usage": True})
        return json.dumps(body).encode()


def completion(max_tokens: int = 4, **extra) -> Dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, **extra}


def chat(max_tokens: int = 4, **extra) -> Dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": max_tokens, **extra}


#: Hostile values for every vllm_xargs key: (id, value).
XARGS_VALUES: List[Tuple[str, Any]] = [
    ("1e30-int", 10**30),
    ("2p64", 2**64),
    ("2p63m1", 2**63 - 1),
    ("2p32", 2**32),
    ("1e300", 1e300),
    ("1e12", 1e12),
    ("neg1", -1),
    ("neg2p63", -(2**63)),
    ("half", 0.5),
    ("str12", "12"),
    ("str30digits", "1" * 30),
    ("true", True),
    ("dict", {"a": 1}),
    ("list", [1, 2]),
    ("null", None),
]

#: The engine's vllm_xargs keys, each with what it needs beside it to matter:
#: mock_stop_token_id is used only when the request ends with STOP.
XARGS_KEYS: List[Tuple[str, Dict[str, Any]]] = [
    ("mock_output_len", {}),
    ("mock_stop_token_id", {"mock_output_len": 2}),
    ("mock_finish", {}),
    ("mock_fail_after", {}),
    ("mock_ttft_ms", {}),
]

#: The values also sent as streaming chat (the other endpoint, the other output path).
XARGS_CHAT_STREAM_VALUES = ("1e30-int", "1e300", "2p64", "neg2p63")


def _xargs_cases() -> List[Case]:
    cases = []
    for key, companion in XARGS_KEYS:
        short = key[len("mock_"):]
        for vid, value in XARGS_VALUES:
            xargs = {**companion, key: value}
            cases.append(Case(f"xargs-{short}-{vid}", COMPLETIONS, completion(4, vllm_xargs=xargs)))
        for vid, value in XARGS_VALUES:
            if vid in XARGS_CHAT_STREAM_VALUES:
                xargs = {**companion, key: value}
                cases.append(Case(f"xargs-{short}-{vid}-chat-stream", CHAT, chat(4, vllm_xargs=xargs), stream=True))
    cases += [
        Case("xargs-unknown-key", COMPLETIONS, completion(4, vllm_xargs={"mock_output_length": 2}),
             note="an unknown mock_ key: ignored, 4 tokens, length"),
        Case("xargs-empty", COMPLETIONS, completion(4, vllm_xargs={})),
        Case("xargs-1000-keys", COMPLETIONS, completion(4, vllm_xargs={f"k{i}": i for i in range(1000)})),
        Case("xargs-all-keys-huge", COMPLETIONS,
             completion(4, vllm_xargs={k: 10**30 for k, _ in XARGS_KEYS})),
    ]
    return cases


def _sampling_cases() -> List[Case]:
    whole_vocab = list(range(VOCAB_SIZE))
    return [
        # max_tokens / min_tokens
        Case("max_tokens-0", COMPLETIONS, completion(0)),
        Case("max_tokens-0-chat", CHAT, chat(0)),
        Case("max_tokens-1", COMPLETIONS, completion(1)),
        Case("max_tokens-1-chat-stream", CHAT, chat(1), stream=True),
        Case("max_tokens-1e9", COMPLETIONS, completion(10**9)),
        Case("max_tokens-1e9-chat-stream", CHAT, chat(10**9), stream=True),
        Case("max_tokens-neg1", COMPLETIONS, completion(-1)),
        Case("max_tokens-2p64", COMPLETIONS, completion(2**64)),
        Case("min_tokens-gt-max_tokens", COMPLETIONS, completion(3, min_tokens=10)),
        Case("min_tokens-1e9", COMPLETIONS, completion(3, min_tokens=10**9)),
        Case("min_tokens-gt-max_tokens-chat-stream", CHAT, chat(3, min_tokens=10), stream=True),
        # seeds and priorities (the default fcfs engine)
        Case("seed-2p63", COMPLETIONS, completion(4, seed=2**63)),
        Case("seed-2p64", COMPLETIONS, completion(4, seed=2**64)),
        Case("seed-neg1", COMPLETIONS, completion(4, seed=-1)),
        Case("seed-2p64-chat-stream", CHAT, chat(4, seed=2**64), stream=True),
        Case("priority-2p63", COMPLETIONS, completion(4, priority=2**63)),
        Case("priority-2p64", COMPLETIONS, completion(4, priority=2**64)),
        Case("priority-neg2p63", COMPLETIONS, completion(4, priority=-(2**63))),
        Case("priority-2p63-chat-stream", CHAT, chat(4, priority=2**63), stream=True),
        # stop token ids
        Case("stop_token_ids-5000", COMPLETIONS, completion(4, stop_token_ids=list(range(1000, 6000)))),
        Case("stop_token_ids-2p32", COMPLETIONS, completion(4, stop_token_ids=[2**32])),
        Case("stop_token_ids-2p63", COMPLETIONS, completion(4, stop_token_ids=[2**63])),
        Case("stop_token_ids-neg1", COMPLETIONS, completion(4, stop_token_ids=[-1])),
        Case("stop_token_ids-whole-vocab", COMPLETIONS, completion(4, stop_token_ids=whole_vocab),
             note="vLLM: 1 token, finish_reason stop"),
        Case("stop_token_ids-whole-vocab-chat-stream", CHAT, chat(4, stop_token_ids=whole_vocab), stream=True,
             note="vLLM: 1 token, finish_reason stop"),
        Case("stop-strings-1000", COMPLETIONS, completion(4, stop=[f"s{i}" for i in range(1000)])),
        # n and best_of
        Case("n-2", COMPLETIONS, completion(4, n=2)),
        Case("n-2-chat-stream", CHAT, chat(4, n=2), stream=True),
        Case("n-128", COMPLETIONS, completion(2, n=128)),
        Case("n-0", COMPLETIONS, completion(4, n=0)),
        Case("n-2p63", COMPLETIONS, completion(4, n=2**63)),
        Case("best_of-2", COMPLETIONS, completion(4, best_of=2)),
        Case("best_of-2-n-2", COMPLETIONS, completion(4, n=2, best_of=2)),
        # logit_bias
        Case("logit_bias-100", COMPLETIONS, completion(4, logit_bias={"5": 100})),
        Case("logit_bias-1e300", COMPLETIONS, completion(4, logit_bias={"5": 1e300})),
        Case("logit_bias-neg1e300", COMPLETIONS, completion(4, logit_bias={"5": -1e300})),
        Case("logit_bias-oov-32000", COMPLETIONS, completion(4, logit_bias={"32000": 1})),
        Case("logit_bias-oov-2p64", COMPLETIONS, completion(4, logit_bias={str(2**64): 1})),
        Case("logit_bias-neg-key", COMPLETIONS, completion(4, logit_bias={"-1": 1})),
        Case("logit_bias-text-key", COMPLETIONS, completion(4, logit_bias={"abc": 1})),
        Case("logit_bias-whole-vocab-chat", CHAT, chat(4, logit_bias={str(i): -100 for i in range(VOCAB_SIZE)})),
        # structured outputs
        Case("response_format-json_object", CHAT, chat(4, response_format={"type": "json_object"})),
        Case("response_format-json_schema", CHAT, chat(4, response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}})),
        Case("response_format-json_schema-stream", CHAT, chat(4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}), stream=True),
        Case("response_format-bogus-type", CHAT, chat(4, response_format={"type": "nonsense"})),
        Case("guided_json", COMPLETIONS, completion(4, guided_json={"type": "object"})),
        Case("guided_regex", COMPLETIONS, completion(4, guided_regex="[a-z]+")),
        Case("structured_outputs-json", COMPLETIONS, completion(4, structured_outputs={"json": {"type": "object"}})),
        Case("structured_outputs-regex", COMPLETIONS, completion(4, structured_outputs={"regex": "[0-9]{3}"})),
        Case("structured_outputs-choice-chat", CHAT, chat(4, structured_outputs={"choice": ["yes", "no"]})),
        Case("structured_outputs-bad-regex", COMPLETIONS, completion(4, structured_outputs={"regex": "(["})),
    ]


def _prompt_cases() -> List[Case]:
    return [
        Case("prompt-ids-near-max-len", COMPLETIONS, completion(5, prompt=[100] * (MAX_MODEL_LEN - 200)),
             note="fits: 5 tokens, length"),
        Case("prompt-ids-exactly-max-len", COMPLETIONS, completion(5, prompt=[100] * (MAX_MODEL_LEN - 5)),
             note="prompt + max_tokens == max_model_len: fits"),
        Case("prompt-ids-max-len", COMPLETIONS, completion(5, prompt=[100] * MAX_MODEL_LEN)),
        Case("prompt-ids-beyond-max-len", COMPLETIONS, completion(5, prompt=[100] * (3 * MAX_MODEL_LEN))),
        Case("prompt-text-beyond-max-len", COMPLETIONS, completion(5, prompt="word " * (4 * MAX_MODEL_LEN))),
        Case("prompt-text-beyond-max-len-chat-stream", CHAT,
             chat(5, messages=[{"role": "user", "content": "word " * (4 * MAX_MODEL_LEN)}]), stream=True),
        Case("prompt-empty", COMPLETIONS, completion(4, prompt="")),
        Case("prompt-empty-stream", COMPLETIONS, completion(4, prompt=""), stream=True),
        Case("prompt-ids-empty", COMPLETIONS, completion(4, prompt=[])),
        Case("chat-empty-content", CHAT, chat(4, messages=[{"role": "user", "content": ""}])),
        Case("chat-no-messages", CHAT, chat(4, messages=[])),
        Case("prompt-ids-neg1", COMPLETIONS, completion(4, prompt=[-1])),
        Case("prompt-ids-2p31", COMPLETIONS, completion(4, prompt=[2**31])),
        Case("prompt-ids-32000", COMPLETIONS, completion(4, prompt=[VOCAB_SIZE])),
        Case("prompt-ids-1e12", COMPLETIONS, completion(4, prompt=[10**12])),
        Case("prompt-ids-2p64", COMPLETIONS, completion(4, prompt=[2**64])),
        Case("prompt-ids-1e12-stream", COMPLETIONS, completion(4, prompt=[10**12]), stream=True),
        Case("prompt-ids-batch-of-oov", COMPLETIONS, completion(4, prompt=[[1, 2], [VOCAB_SIZE], [-1]])),
    ]


def _request_id_cases() -> List[Case]:
    def rid(value: bytes) -> Tuple[Tuple[str, bytes], ...]:
        return (("X-Request-Id", value),)

    unicode_id = "äöü-漢字-🙂-\u202e-id".encode()
    return [
        Case("request_id-100kB", COMPLETIONS, completion(4), headers=rid(b"r" * 100_000)),
        Case("request_id-100kB-chat-stream", CHAT, chat(4), stream=True, headers=rid(b"r" * 100_000)),
        Case("request_id-10kB", COMPLETIONS, completion(4), headers=rid(b"r" * 10_000)),
        Case("request_id-unicode", COMPLETIONS, completion(4), headers=rid(unicode_id)),
        Case("request_id-unicode-chat-stream", CHAT, chat(4), stream=True, headers=rid(unicode_id)),
        Case("request_id-spaces", COMPLETIONS, completion(4), headers=rid(b"a b  c   d")),
        Case("request_id-empty", COMPLETIONS, completion(4), headers=rid(b"")),
        Case("request_id-latin1-bytes", COMPLETIONS, completion(4), headers=rid(b"\xff\xfe\x80-id")),
        Case("request_id-body-10kB-chat", CHAT, chat(4, request_id="b" * 10_000)),
        Case("request_id-duplicate-concurrent", COMPLETIONS, completion(20), stream=True,
             headers=rid(b"hostile-duplicate-id"), kind="duplicate-id"),
    ]


#: Concurrent streams of the disconnect storm, and each one's length (they must
#: still run when the client closes them: ~101 ms per step with 200 running).
STORM_STREAMS = 200
STORM_MAX_TOKENS = 8000

CASES: List[Case] = [
    *_xargs_cases(),
    *_sampling_cases(),
    *_prompt_cases(),
    *_request_id_cases(),
    Case("disconnect-storm-200", CHAT, chat(STORM_MAX_TOKENS), stream=True, kind="disconnect-storm"),
]

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
