"""Tool calls for `tool_choice` required and named: each call's arguments
follow its tool's own parameters schema, pure.

Both frontends (`--tool-call-parser hermes`) send a required or named
tool_choice as a structural tag (tests/data/frontend_constraints.json holds
what they send): `tags_with_separator` over one `tag` per tool and layout,
whose begin names the tool (`<tool_call>\\n{"name": "get_weather",
"arguments": `) and whose content is a `json_schema`: the tool's parameters
when the tool is `strict: true` (or the server runs `--tool-strict-level
parameter`), else `true`, any JSON. `stop_after_first` when
`parallel_tool_calls` is false or the choice is named: one call; else one
or more.

A real model writes arguments for the schema its prompt shows, whether or
not the grammar pins them. `pin_arguments` does the same for the mock: a
tag whose content is `true` gets the parameters of the tool its begin
names, read from the prompt's `<tools>` block (content.prompt_tools). The
answer is then valid under the frontend's tag (a pinned schema is a part
of "any JSON") and its arguments under the tool's schema. A tool the
prompt does not show keeps `true` (an object, structural_tag.py).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Dict, Optional

from gmock_engine.wire.inputs import StructuredOutputsParams

#: The tool name in a hermes-style tag's begin.
_HERMES_NAME = re.compile(r'"name":\s*"((?:[^"\\]|\\.)*)"')


def tool_of(begin: Any, schemas: Dict[str, Any]) -> Optional[str]:
    """The tool a tag's begin names: the hermes `"name": "…"` field, else
    the longest tool name the begin holds (`<function=NAME>`,
    `<invoke name="NAME">`); None when it names none of `schemas`."""
    if not isinstance(begin, str):
        return None
    found = _HERMES_NAME.search(begin)
    if found is not None:
        try:
            name = json.loads('"' + found.group(1) + '"')
        except ValueError:
            name = found.group(1)
        return name if name in schemas else None
    names = [name for name in schemas if name and name in begin]
    return max(names, key=len) if names else None


def _pin(node: Any, schemas: Dict[str, Any]) -> bool:
    """Pin, in place, every tag of `node` whose content is any JSON; whether any was."""
    if isinstance(node, list):
        return any([_pin(item, schemas) for item in node])
    if not isinstance(node, dict):
        return False
    content = node.get("content")
    if node.get("type") == "tag" and isinstance(content, dict) and content.get("type") == "json_schema" \
            and content.get("json_schema", True) is True:  # fmt: skip
        name = tool_of(node.get("begin"), schemas)
        if name is None:
            return False
        node["content"] = dict(content, json_schema=copy.deepcopy(schemas[name]))
        return True
    return any([_pin(value, schemas) for value in node.values() if isinstance(value, (dict, list))])


def pin_arguments(params: StructuredOutputsParams, schemas: Dict[str, Any]) -> StructuredOutputsParams:
    """`params` with every tool-call tag whose arguments are any JSON pinned
    to the parameters schema (`schemas`: tool name -> schema, from the
    prompt) of the tool its begin names; `params` itself when there is none
    (another kind, an unreadable spec: compiling reports it)."""
    if params.kind != "structural_tag" or not schemas or '"json_schema": true' not in params.spec.replace('":true', '": true'):
        return params
    try:
        tag = json.loads(params.spec)
    except ValueError:
        return params
    if not _pin(tag, schemas):
        return params
    return StructuredOutputsParams(params.kind, json.dumps(tag))


#: What a text answer is, where tool_choice auto's tag allows text: no `<`, so never a trigger.
TEXT = {"type": "regex", "pattern": "[^<]+"}


def choose_auto(params: StructuredOutputsParams, call: bool) -> StructuredOutputsParams:
    """tool_choice auto with a strict tool: the frontends send `triggered_tags`
    (text, or calls where a trigger starts one). The mock decides as for an
    auto request without a constraint (--tool-call-rate, vllm_xargs
    mock_tool_call): `call`, the tags with at least one call; else text
    without a trigger (a part of the tag's language). `params` itself for any
    other constraint."""
    if params.kind != "structural_tag" or '"triggered_tags"' not in params.spec:
        return params
    try:
        tag = json.loads(params.spec)
        form = tag["format"]
    except (ValueError, KeyError, TypeError):
        return params
    from gmock_engine.content.structural_tag import reasoning_prefix

    prefix, answer = reasoning_prefix(form)
    if not isinstance(answer, dict) or answer.get("type") != "triggered_tags" or answer.get("at_least_one"):
        return params
    chosen = dict(answer, at_least_one=True) if call else TEXT
    tag["format"] = chosen if prefix is None else {"type": "sequence", "elements": [prefix, chosen]}
    return StructuredOutputsParams(params.kind, json.dumps(tag))
