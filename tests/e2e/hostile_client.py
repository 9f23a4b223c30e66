"""The hostile catalogue's HTTP client: a case's request sent as it is (raw
headers, an SSE body read line by line), what the client saw (`Answer`),
the normal requests that must still be served exactly after each case (3),
and the two bursts (concurrent duplicate ids, the disconnect storm). The
checks and the runner: hostile_catalogue.py."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import e2e_harness as h
from hostile_cases import CHAT, COMPLETIONS, PROMPT, STORM_STREAMS, Case, chat, completion

#: (1): the bound for a hostile request's answer (a stream: until it ends).
CASE_WAIT_S = 15.0
#: (3): the bound for each normal request.
NORMAL_WAIT_S = 15.0
EXCERPT_CHARS = 140
#: How long the engine may take to log the end of every closed storm stream.
STORM_END_S = 30.0


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
