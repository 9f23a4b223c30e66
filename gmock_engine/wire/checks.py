"""The checks of an ADD's vllm_xargs (SamplingParams.extra_args, §3.3), pure.

`inputs.decode_add` checks every wire field of an ADD; what a client put in
`vllm_xargs` is checked here, by `check_xargs`, which the engine calls once
per ADD that carries any (EngineCore.add_request: after the checks that
need its settings and the fault layer, which may add P/D delays): the mock
scenarios (`mock_*`, docs/scheduling-and-latency.md, "Per-request scenarios"), the P/D scenarios and
`kv_transfer_params`. A wrong type or an out-of-range value raises
`BadValue` naming the key and the value: nothing is coerced, and the request
ends with ERROR instead of the engine carrying a value it cannot send (a
`mock_stop_token_id` of 1e300 once reached msgpack's packer and stopped the
engine). The plans that use the checked values and the engine's settings
are request.plan (length and finish) and kv_transfer.plan (P/D role).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

from gmock_engine.utils.logs import short
from gmock_engine.wire.types import TOKEN_ID_LIMIT, BadValue

#: Upper bound of vllm_xargs mock_ttft_ms (one hour): a timer needs a finite time.
MAX_XARGS_TTFT_MS = 3_600_000
#: The P/D scenario keys of vllm_xargs (kv_transfer.py).
KV_XARGS = ("mock_kv_load", "mock_kv_transfer_delay_ms")
#: The vllm_xargs keys the engine reads (docs/scheduling-and-latency.md, "Per-request scenarios"); any
#: other `mock_` key is refused, so a typo is an error and not a silent no-op.
MOCK_XARGS = ("mock_output_len", "mock_stop_token_id", "mock_finish", "mock_fail_after", "mock_ttft_ms",
              "mock_tool_call", "mock_reasoning_tokens", "mock_spec_acceptance") + KV_XARGS  # fmt: skip
#: Upper bound of mock_reasoning_tokens.
MAX_REASONING_TOKENS = 1 << 20
#: Upper bound of mock_kv_transfer_delay_ms (one hour).
MAX_DELAY_MS = 3_600_000
#: At most this many remote block ids in kv_transfer_params (a hostile list is not walked for ever).
MAX_REMOTE_BLOCKS = 1 << 20
#: mock_finish's values.
FINISH_MODES = ("stop", "length", "error")
_INT64_MAX = (1 << 63) - 1


class BadXargs(BadValue):
    """A bad value of a mock scenario key (not a P/D one): its answer says
    "bad vllm_xargs: " before the reason."""


class Xargs(NamedTuple):
    """A request's checked vllm_xargs; None: the key is absent (or null)."""

    fail_after: Optional[int] = None
    output_len: Optional[int] = None
    stop_token_id: Optional[int] = None
    #: mock_finish: "stop", "length" or "error".
    finish: Optional[str] = None
    ttft_ms: Optional[float] = None
    #: P/D (kv/transfer.py): mock_kv_load = "fail", mock_kv_transfer_delay_ms in seconds.
    kv_load_fails: bool = False
    kv_delay_s: float = 0.0
    #: mock_tool_call: answer a prompt with tools by a call (True) or text (False) (content/answer.py)
    tool_call: Optional[bool] = None
    #: mock_reasoning_tokens: ids of the <think> span (0: none) (content/answer.py)
    reasoning_tokens: Optional[int] = None
    #: mock_spec_acceptance: the acceptance rate of every draft position (content/spec_decode.py)
    spec_acceptance: Optional[float] = None


#: What a request without vllm_xargs has (most requests).
NO_XARGS = Xargs()


def check_xargs(xargs: Dict[str, Any]) -> Xargs:
    """Every key of `xargs` the engine reads, checked: first the mock
    scenarios (BadXargs), then the P/D ones (BadValue). `kv_transfer_params`
    is checked by kv_transfer.plan, only where P/D is on (vLLM without a KV
    connector ignores it)."""
    for key in xargs:
        if isinstance(key, str) and key.startswith("mock_") and key not in MOCK_XARGS:
            raise BadXargs(f"unknown key {short(key, 40)} (known: {', '.join(MOCK_XARGS)})")
    fail_after = _xarg_int(xargs, "mock_fail_after", 0, _INT64_MAX)
    output_len = _xarg_int(xargs, "mock_output_len", 1, _INT64_MAX)
    stop_token = _xarg_int(xargs, "mock_stop_token_id", 0, TOKEN_ID_LIMIT - 1)
    mode = xargs.get("mock_finish")
    if mode is not None and (not isinstance(mode, str) or mode not in FINISH_MODES):
        raise BadXargs(f"mock_finish must be stop, length or error, not {cut(mode)}")
    ttft = xargs.get("mock_ttft_ms")
    if ttft is not None:
        if isinstance(ttft, bool) or not isinstance(ttft, (int, float)) or not 0 <= ttft <= MAX_XARGS_TTFT_MS:
            raise BadXargs(f"mock_ttft_ms must be a number in 0..{MAX_XARGS_TTFT_MS}, not {cut(ttft)}")  # also nan, inf
        ttft = float(ttft)
    tool_call = xargs.get("mock_tool_call")
    if tool_call is not None:
        # (the Python frontend's vllm_xargs type turns a JSON false into 0)
        if tool_call not in (True, False) or not isinstance(tool_call, (bool, int)):
            raise BadXargs(f"mock_tool_call must be true or false (or 1, 0), not {cut(tool_call)}")
        tool_call = bool(tool_call)
    reasoning = _xarg_int(xargs, "mock_reasoning_tokens", 0, MAX_REASONING_TOKENS)
    spec = xargs.get("mock_spec_acceptance")
    if spec is not None:
        if isinstance(spec, bool) or not isinstance(spec, (int, float)) or not 0 <= spec <= 1:
            raise BadXargs(f"mock_spec_acceptance must be a number in 0..1, not {cut(spec)}")  # also nan
        spec = float(spec)
    fails, delay_s = _kv_scenario(xargs)
    return Xargs(fail_after, output_len, stop_token, mode, ttft, fails, delay_s, tool_call, reasoning, spec)


def _xarg_int(xargs: Dict[str, Any], key: str, low: int, high: int) -> Optional[int]:
    """vllm_xargs[key] as an int in low..high (None when absent or null);
    BadXargs for anything else: a float, a string, a bool, a huge number."""
    value = xargs.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadXargs(f"{key} must be an int in {low}..{high}, not {cut(value)}")
    return value


def _kv_scenario(extra_args: Dict[str, Any]) -> Tuple[bool, float]:
    """The P/D vllm_xargs: mock_kv_load = "fail", mock_kv_transfer_delay_ms."""
    load = extra_args.get("mock_kv_load")
    if load is not None and load not in ("fail", "ok"):
        raise BadValue(f"mock_kv_load must be fail or ok, not {cut(load)}")
    delay = extra_args.get("mock_kv_transfer_delay_ms")
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= MAX_DELAY_MS:
            raise BadValue(f"mock_kv_transfer_delay_ms must be a number in 0..{MAX_DELAY_MS}, not {cut(delay)}")
    return load == "fail", (delay or 0.0) / 1000.0


def check_kv_transfer_params(params: Any) -> None:
    """kv_transfer_params as a connector reads them: a map whose known keys
    have their types (nil allowed: vLLM's proxy sends `remote_engine_id: null`
    to the prefill side); BadValue names the first key that has not."""
    if not isinstance(params, dict):
        raise BadValue(f"kv_transfer_params must be a map, not {type(params).__name__}")
    for key in ("do_remote_decode", "do_remote_prefill"):
        value = params.get(key)
        if value is not None and not isinstance(value, bool):
            raise BadValue(f"kv_transfer_params.{key} must be a bool, not {cut(value)}")
    if params.get("do_remote_decode") is True and params.get("do_remote_prefill") is True:
        raise BadValue("kv_transfer_params has both do_remote_decode and do_remote_prefill")
    for key in ("remote_engine_id", "remote_host", "remote_request_id"):
        value = params.get(key)
        if value is not None and not isinstance(value, str):
            raise BadValue(f"kv_transfer_params.{key} must be a string, not {cut(value)}")
    port = params.get("remote_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise BadValue(f"kv_transfer_params.remote_port must be an int in 0..65535, not {cut(port)}")
    _check_block_ids(params.get("remote_block_ids"))


def _check_block_ids(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise BadValue(f"kv_transfer_params.remote_block_ids must be a list, not {cut(value)}")
    # a flat list (older NIXL) or one list per KV cache group (0.2x+)
    groups = value if value and all(isinstance(g, list) for g in value) else [value]
    count = 0
    for group in groups:
        for block in group:
            count += 1
            if count > MAX_REMOTE_BLOCKS:
                raise BadValue(f"kv_transfer_params.remote_block_ids has more than {MAX_REMOTE_BLOCKS} ids")
            if isinstance(block, bool) or not isinstance(block, int) or block < 0 or block >= 1 << 63:
                raise BadValue(f"kv_transfer_params.remote_block_ids holds {cut(block)}, not a block id")


def cut(value: Any, limit: int = 60) -> str:
    """repr() of a client's value for a message, at most `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
