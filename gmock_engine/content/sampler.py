"""A request's sampler: where its tokens and logprobs come from (vLLM:
`vllm/v1/sample/sampler.py`, which samples and computes logprobs in one
place). Pure: neither gevent nor zmq."""

from __future__ import annotations

from gmock_engine.content.logprobs import LogprobModel
from gmock_engine.content.tokens import TokenSource


class Sampler:
    """Where a request's tokens and logprobs come from: the token source
    (tokens.py) and the logprob model (logprobs.py) of its ADD. A request
    keeps its sampler to its end: its generator state belongs to that
    source, so a reload that changes --token-source or the logprob settings
    changes them for new requests only (vLLM's sampler is one per engine;
    here a request's tokens stay deterministic per its arrival settings)."""

    __slots__ = ("tokens", "logprobs")

    def __init__(self, tokens: TokenSource, logprobs: LogprobModel) -> None:
        self.tokens = tokens
        self.logprobs = logprobs
