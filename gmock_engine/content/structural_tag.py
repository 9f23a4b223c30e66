"""A structural tag in xgrammar's format as a Lark grammar for llguidance, pure.

Both frontends send tool_choice "required" and a named tool_choice as a
`structural_tag` (docs/protocol.md §3.3): `{"type": "structural_tag",
"format": {...}}`, the format of xgrammar, their default backend, which
llguidance does not read. `to_lark` writes the same language (or a part
of it: a triggered tag's free text is left out, so the answer is tags) as
a Lark grammar llguidance compiles (`%json` for a JSON schema). It knows
the format types the frontends send (tests/data/frontend_constraints.json
holds what they send): `const_string`, `json_schema` (style json),
`regex`, `any_text`, `sequence`, `or`, `tag`, `tags_with_separator`,
`triggered_tags`, `optional`, `plus`, `star` and `repeat`. Another type
(xgrammar's token-level `token`, `exclude_token`, `any_tokens`,
`token_triggered_tags`, `token_dispatch`; `dispatch`, `grammar`,
`qwen_xml_parameter`), a json_schema of another style and an `excludes`
list the mock would not keep raise ValueError naming the part: the
request ends with an error that names it, never with an answer outside
the tag.

vllm-rs with a reasoning parser puts the think block in the tag itself (a
first `optional` element: `<think>`, any text, `</think>`, then `\n\n`);
`to_lark` leaves that element out (`reasoning_prefix`): the engine writes
the think block before the grammar starts, as vLLM's structured-output
manager does with a reasoning parser (answer.py).

JSON inside comes out compact (the schema's `x-guidance` options), as every
structured answer of the mock.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, List, Optional, Tuple

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
            _no_excludes(node, kind)
            # any JSON (`true`: a tool the frontend does not pin) is written
            # as an object, what a tool call's arguments are
            schema = copy.deepcopy(schema) if isinstance(schema, dict) else {"type": "object"} if schema is True else schema
            if not isinstance(schema, dict):
                raise ValueError("json_schema is neither a schema nor true")
            no_additional_properties(schema)
            schema["x-guidance"] = dict(schema.get("x-guidance") or {}, **COMPACT)
            return self.rule("%json " + json.dumps(schema))
        if kind == "regex":
            return self.rule("/" + ascii_digits(str(node["pattern"])).replace("/", "\\/") + "/")
        if kind == "any_text":
            _no_excludes(node, kind)
            most = node.get("max_chars")
            return self.rule("/(.|\\n)" + ("*" if most is None else "{0,%d}" % int(most)) + "/")
        if kind in ("optional", "plus", "star"):
            return "(" + self.format(node["content"]) + ")" + {"optional": "?", "plus": "+", "star": "*"}[kind]
        if kind == "repeat":
            least, most = int(node["min"]), int(node["max"])
            if least < 0 or (most >= 0 and most < least):
                raise ValueError(f"repeat min {least} max {most} is no range")
            return "(" + self.format(node["content"]) + ")" + "{%d,%s}" % (least, "" if most < 0 else most)
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
        if isinstance(tag.get("begin"), dict) or isinstance(tag.get("end"), dict):
            raise ValueError("structural tag format type 'token' (a tag's begin or end as a token) is not supported")
        end = tag["end"]
        ends = "(" + " | ".join(_literal(e) for e in end) + ")" if isinstance(end, list) else _literal(end)
        return f"({_literal(tag['begin'])} {self.format(tag['content'])} {ends})"


def ascii_digits(pattern: str) -> str:
    """`pattern` with `\\d` and `\\D` as ASCII digits: what xgrammar, vLLM's
    default backend, and JSON Schema's regexes (ECMAScript) mean by them;
    llguidance's `\\d` is any Unicode digit, so an answer could hold a Kawi
    eight where the client's own check wants 0-9."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            pair = pattern[i:i + 2]
            if pair[1] in "dD":
                ascii = "0-9" if pair[1] == "d" else None
                if in_class:
                    out.append(ascii if ascii else pair)  # [\D] stays: no ASCII-only form inside a class
                else:
                    out.append("[0-9]" if ascii else "[^0-9]")
            else:
                out.append(pair)
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
        out.append(char)
        i += 1
    return "".join(out)


def _no_excludes(node: Dict[str, Any], kind: str) -> None:
    """An `excludes` list on free text the mock generates would not be kept: refused."""
    if node.get("excludes"):
        raise ValueError(f"{kind} excludes {node['excludes']!r:.80} is not supported")


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
    top = writer.format(reasoning_prefix(tag["format"])[1])
    return "\n".join([f"start: {top}"] + writer.rules)


def _is_think_tag(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "tag" and str(node.get("begin", "")).startswith("<think>")


def reasoning_prefix(node: Any) -> Tuple[Optional[Dict[str, Any]], Any]:
    """(the think block a format opens with, the format after it): vllm-rs
    with a reasoning parser sends `sequence[optional(sequence[tag <think>…
    </think>, const "\\n\\n"]), ANSWER]`; (None, node) for any other format."""
    if not isinstance(node, dict) or node.get("type") != "sequence":
        return None, node
    elements = node.get("elements")
    if not isinstance(elements, list) or len(elements) < 2:
        return None, node
    first = elements[0]
    if not isinstance(first, dict) or first.get("type") != "optional":
        return None, node
    inner = first.get("content")
    parts = inner.get("elements") if isinstance(inner, dict) and inner.get("type") == "sequence" else [inner]
    if not parts or not _is_think_tag(parts[0]):
        return None, node
    rest = elements[1:]
    return first, rest[0] if len(rest) == 1 else dict(node, elements=rest)


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
