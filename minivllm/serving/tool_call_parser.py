"""Tool calls read out of a model's text, whole (`parse_tool_calls`) or as it streams
(`ToolCallStream`).

Two shapes are recognised:

- tagged blocks, as Qwen2.5 and Hermes templates ask for (several allowed, text around them):
      <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
  the last block may lack its closing tag (a model that stops right after the JSON);
- a bare JSON call as the whole output, as Llama 3.x emits, with "arguments" or "parameters",
  or several separated by ';', or a JSON list of them.

A call must be a JSON object with a string "name" (one of the request's tools) and an object
(or the JSON text of one) for its arguments; anything else stays in the content as text, so
nothing the model wrote is lost. Calls come back in OpenAI's shape, arguments as JSON text:
    {"id": "call_...", "type": "function", "function": {"name": ..., "arguments": "{...}"}}
The content is the text outside the calls, None when that is only whitespace.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection

from minivllm.serving.tool_calls import TAG_CLOSE, TAG_OPEN

_BLOCK = re.compile(re.escape(TAG_OPEN) + r"(.*?)(?:" + re.escape(TAG_CLOSE) + r"|\Z)", re.DOTALL)
_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def as_call(value: object, names: Collection[str] | None) -> dict | None:
    """An OpenAI tool call made of one parsed JSON value, or None if it is not a call."""
    if not isinstance(value, dict) or set(value) - {"name", "arguments", "parameters"}:
        return None
    name = value.get("name")
    if not isinstance(name, str) or (names is not None and name not in names):
        return None
    if ("arguments" in value) == ("parameters" in value):
        return None
    args = value.get("arguments", value.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _tagged(text: str, names: Collection[str] | None) -> tuple[str, list[dict]]:
    outside, calls, at = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            call = as_call(json.loads(m.group(1)), names)
        except ValueError:
            call = None
        if call is None:
            continue  # left in the content, as written
        outside.append(text[at:m.start()])
        calls.append(call)
        at = m.end()
    outside.append(text[at:])
    return "".join(outside), calls


def _bare(text: str, names: Collection[str] | None) -> list[dict]:
    """The calls if the whole text is bare JSON calls (or a list of them), else []."""
    values, at, text = [], 0, text.strip()
    while at < len(text):
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return []
        values += value if isinstance(value, list) else [value]
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
    calls = [as_call(v, names) for v in values]
    return calls if calls and all(calls) else []


def parse_tool_calls(text: str, names: Collection[str] | None = None) -> tuple[str | None, list[dict]]:
    """(content, calls). Without calls the content is the text unchanged."""
    outside, calls = _tagged(text, names) if TAG_OPEN in text else (text, [])
    if not calls:
        calls = _bare(text, names) if text.lstrip()[:1] in ("{", "[") else []
        outside = "" if calls else text
    if not calls:
        return text, []
    return (outside if outside.strip() else None), calls


class ToolCallStream:
    """Streamed text split into content to send now and calls sent at the end.

    `feed(delta)` returns the content that can go out: everything up to a `<tool_call>` (or
    a tail that may be the start of one), nothing while the output is only whitespace, and
    nothing at all once the output opens with '{' or '[' (a bare JSON call). `finish()`
    parses the whole text as `parse_tool_calls` does and returns the content not sent yet
    and the calls, so the streamed content adds up to the non-streamed one."""

    def __init__(self, names: Collection[str] | None = None):
        self.names = names
        self.text = ""
        self.sent = 0
        self.held_from: int | None = None

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.held_from is None:
            found = self.text.find(TAG_OPEN, max(0, self.sent - len(TAG_OPEN)))
            if found >= 0:
                self.held_from = found
            elif self.text.lstrip()[:1] in ("{", "["):
                self.held_from = 0
        end = self.held_from if self.held_from is not None else len(self.text) - _partial_tag(self.text)
        if end <= self.sent or not self.text[:end].strip():
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = parse_tool_calls(self.text, self.names)
        return (content or "")[self.sent:], calls


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin a `<tool_call>`."""
    for n in range(min(len(TAG_OPEN) - 1, len(text)), 0, -1):
        if TAG_OPEN.startswith(text[-n:]):
            return n
    return 0
