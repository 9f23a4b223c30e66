"""The tokenizer of the model the frontend serves (`--tokenizer PATH`).

The engine needs it only for content a client parses: text that reads like
text (`--token-source text`), structured outputs, tool calls and reasoning.
It is the model directory's `tokenizer.json`, loaded with Hugging Face
`tokenizers` (what vLLM loads), an optional extra: `pip install
'gmock-engine[content]'`. Without `--tokenizer` the engine imports neither.

One Tokenizer per path and process (`load_tokenizer` caches it): every
engine of a process shares it, and a reload that names the same path keeps
it.

Pure: neither gevent nor zmq.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

#: What to run when a content feature is asked for without its libraries.
INSTALL_HINT = "pip install 'gmock-engine[content]'"


class ContentUnavailable(RuntimeError):
    """A content feature was asked for and its optional library is missing."""


def require(module: str, feature: str) -> Any:
    """Import `module` for `feature`, or ContentUnavailable naming the install command."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ContentUnavailable(f"{feature} needs the Python package {module!r} ({exc}); install it with: {INSTALL_HINT}") from None


def _read_json(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except FileNotFoundError:
        return {}
    return value if isinstance(value, dict) else {}


def tokenizer_file(path: str) -> str:
    """The tokenizer.json that `path` names: the file itself, or the one in a
    model directory. ValueError when there is none."""
    candidate = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        raise ValueError(f"{path}: no tokenizer.json (give a model directory or the file itself)")
    return candidate


@dataclass
class Tokenizer:
    """A loaded tokenizer: ids <-> text as the frontend's tokenizer maps them."""

    #: the tokenizer.json it was loaded from
    path: str
    #: its text (llguidance builds its own tokenizer from it)
    json_text: str
    #: ids the model has (the model's config.json vocab_size when known; at
    #: least every id the tokenizer defines)
    vocab_size: int
    #: the model's end-of-sequence id (generation_config.json, config.json or
    #: the tokenizer config's eos_token), None when none says
    eos_token_id: Optional[int]
    #: ids of the special (added, special) tokens
    special_ids: frozenset = field(default_factory=frozenset)
    _backend: Any = field(default=None, repr=False)

    def encode(self, text: str) -> List[int]:
        """The ids of `text`, without special tokens added around it."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (invalid UTF-8 becomes U+FFFD, as in the frontends)."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> Optional[int]:
        """The id of one token of the vocabulary (e.g. "<think>"), None if absent."""
        return self._backend.token_to_id(token)


_loaded: Dict[str, Tokenizer] = {}


def _eos_id(directory: str, backend: Any) -> Optional[int]:
    for name, key in (("generation_config.json", "eos_token_id"), ("config.json", "eos_token_id")):
        value = _read_json(os.path.join(directory, name)).get(key)
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int):
            return value
    token = _read_json(os.path.join(directory, "tokenizer_config.json")).get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at `path` (a model directory or a tokenizer.json), loaded
    once per process. ValueError for a missing or unreadable file,
    ContentUnavailable without the `tokenizers` package."""
    file = os.path.abspath(tokenizer_file(path))
    known = _loaded.get(file)
    if known is not None:
        return known
    tokenizers = require("tokenizers", "--tokenizer")
    with open(file, encoding="utf-8") as handle:
        text = handle.read()
    try:
        backend = tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # the library raises its own Exception subclass for a bad file
        raise ValueError(f"{file}: not a tokenizer the `tokenizers` library reads ({exc})") from None
    directory = os.path.dirname(file)
    size = backend.get_vocab_size(with_added_tokens=True)
    configured = _read_json(os.path.join(directory, "config.json")).get("vocab_size")
    if isinstance(configured, int) and configured > size:
        size = configured
    specials = frozenset(t.get("id") for t in json.loads(text).get("added_tokens", ()) if t.get("special"))
    tokenizer = Tokenizer(file, text, size, _eos_id(directory, backend), specials, backend)
    _loaded[file] = tokenizer
    return tokenizer
