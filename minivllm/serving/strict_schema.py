"""A JSON schema in strict mode: no properties or items beyond the ones it lists.

OpenAI's structured outputs with `strict: true`, and vLLM's default grammar backend, read
an object schema that does not say otherwise as closed: a model then cannot wander into
properties nobody asked for (a small model, given an open `arguments` object, rambles in
made-up keys until max_tokens). JSON Schema itself reads a missing `additionalProperties`
as "anything", and so does llguidance, which has no switch for this; so the schema is
rewritten before it compiles:

- an object schema (one with `properties`, or of type "object") without
  `additionalProperties` gets `additionalProperties: false`;
- an array schema with `prefixItems` and no `items` gets `items: false`.

What the schema states explicitly is kept. Used for a forced tool call's arguments and
for `response_format` json_schema with `strict: true`.
"""

from __future__ import annotations

import copy
from typing import Any

from minivllm.sampling.constraint_limits import SUBSCHEMA_LISTS, SUBSCHEMA_MAPS, SUBSCHEMA_ONE


def _is_object_schema(node: dict) -> bool:
    kind = node.get("type")
    return isinstance(node.get("properties"), dict) or kind == "object" or (isinstance(kind, list) and "object" in kind)


def strict_schema(schema: Any) -> Any:
    """A strict copy of `schema` (its depth already bounded by constraint_limits)."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if _is_object_schema(node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        if "prefixItems" in node and "items" not in node:
            node["items"] = False
        for key in SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in SUBSCHEMA_ONE:
            stack.append(node.get(key))
        if isinstance(node.get("items"), list):
            stack.extend(node["items"])
    return out
