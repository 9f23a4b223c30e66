"""A structural tag in xgrammar's format as a Lark grammar for llguidance, pure.

Both frontends send tool_choice "required" and a named tool_choice as a
`structural_tag` (docs/protocol.md §3.3): `{"type": "structural_tag",
"format": {...}}`, the format of xgrammar, their default backend, which
llguidance does not read. `to_lark` writes the same language as a Lark
grammar llguidance compiles (`%json` for a JSON schema); it knows the
format types a tool call is made of: `const_string`, `json_schema`,
`regex`, `any_text`, `sequence`, `or`, `tag`, `tags_with_separator` and
`triggered_tags`. Another type raises ValueError naming it.

JSON inside comes out compact (the schema's `x-guidance` options), as every
structured answer of the mock.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, List

#: What a JSON schema inside a tag compiles with: no whitespace between tokens.
COMPACT = {"whitespace_flexible": False}


class _Writer:
    """The rules of one grammar, named r0, r1, ... (`start` refers to the top one)."""

    def __init__(self) -> None:
        self.rules: List[str] = []

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def format(self, node: Any) -> str:
        """A Lark expression for one format node."""
        if not isinstance(node, dict):
            raise ValueError(f"a structural tag format is a map, not {type(node).__name__}")
        kind = node.get("type")
        if kind == "const_string":
            return _literal(node["value"])
        if kind == "json_schema":
            schema = node.get("json_schema", True)
            if node.get("style", "json") != "json":
                raise ValueError(f"json_schema style {node.get('style')!r} is not supported (only json)")
            # any JSON (`true`: a tool the frontend does not pin) is written
            # as an object, what a tool call's arguments are
            schema = copy.deepcopy(schema) if isinstance(schema, dict) else {"type": "object"} if schema is True else schema
            if not isinstance(schema, dict):
                raise ValueError("json_schema is neither a schema nor true")
            no_additional_properties(schema)
            schema["x-guidance"] = dict(schema.get("x-guidance") or {}, **COMPACT)
            return self.rule("%json " + json.dumps(schema))
        if kind == "regex":
            return self.rule("/" + str(node["pattern"]).replace("/", "\\/") + "/")
        if kind == "any_text":
            return self.rule("/(.|\\n)*/")
        if kind in ("sequence", "or"):
            parts = [self.format(element) for element in node["elements"]]
            if not parts:
                raise ValueError(f"{kind} has no elements")
            return "(" + (" " if kind == "sequence" else " | ").join(parts) + ")"
        if kind == "tag":
            return self._tag(node)
        if kind in ("tags_with_separator", "triggered_tags"):
            tags = [self._tag(tag) for tag in node["tags"]]
            if not tags:
                raise ValueError(f"{kind} has no tags")
            one = "(" + " | ".join(tags) + ")"
            text = node.get("separator", "") if kind == "tags_with_separator" else ""
            separator = _literal(text) if text else ""
            many = one if node.get("stop_after_first") else f"{one} ({separator} {one})*" if separator else f"{one}+"
            return many if node.get("at_least_one") else f"({many})?"
        raise ValueError(f"structural tag format type {kind!r} is not supported")

    def _tag(self, tag: Dict[str, Any]) -> str:
        if not isinstance(tag, dict):
            raise ValueError("a tag is a map with begin, content and end")
        end = tag["end"]
        ends = "(" + " | ".join(_literal(e) for e in end) + ")" if isinstance(end, list) else _literal(end)
        return f"({_literal(tag['begin'])} {self.format(tag['content'])} {ends})"


def _literal(text: Any) -> str:
    if not isinstance(text, str):
        raise ValueError(f"expected a string, not {type(text).__name__}")
    return json.dumps(text) if text else '""'


def is_xgrammar_format(tag: Any) -> bool:
    """True for xgrammar's structural tag (a `format`), False for the older
    triggers-and-structures one vLLM's guidance backend reads."""
    return isinstance(tag, dict) and "format" in tag


def to_lark(tag: Dict[str, Any]) -> str:
    """The Lark grammar of an xgrammar structural tag; ValueError (or
    KeyError, TypeError) for one it cannot write."""
    writer = _Writer()
    top = writer.format(tag["format"])
    return "\n".join([f"start: {top}"] + writer.rules)


def no_additional_properties(schema: Any) -> None:
    """vLLM's process_for_additional_properties, in place: additionalProperties
    false wherever an object schema names its properties and says nothing.
    The mock's answers name only the properties a schema names, as a model's
    do (valid under any schema)."""
    if isinstance(schema, list):
        for item in schema:
            no_additional_properties(item)
    elif isinstance(schema, dict):
        for value in schema.values():
            if isinstance(value, (dict, list)):
                no_additional_properties(value)
        if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
            schema["additionalProperties"] = False
