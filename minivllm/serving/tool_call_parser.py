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
A forced call cut by max_tokens still comes back as a call (`reply_calls`).
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
        except (ValueError, RecursionError):  # model output nested past the parser's reach is text too
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
        except (ValueError, RecursionError):
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
        except (ValueError, RecursionError):
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


_CUT_NAME = re.compile(r'"name":\s*"([^"]*)')
_CUT_ARGUMENTS = re.compile(r'"(?:arguments|parameters)":\s*(.*)\Z', re.DOTALL)


def cut_call(text: str, names: Collection[str]) -> dict | None:
    """The call a forced tool call's output was writing when max_tokens cut it: its name
    (the one tool whose name the written part begins), its arguments as far as written
    (JSON text that does not parse). None if not even the name's first letters came out,
    or they fit several tools."""
    m = _CUT_NAME.search(text)
    if m is None:
        return None
    fits = [n for n in names if n.startswith(m.group(1))]
    if len(fits) != 1:
        return None
    args = _CUT_ARGUMENTS.search(text, m.end())
    return {"id": new_call_id(), "type": "function",
            "function": {"name": fits[0], "arguments": args.group(1) if args else ""}}


def reply_calls(text: str, finish_reason: str | None, names: Collection[str] | None,
                forced: bool = False) -> tuple[str | None, list[dict], str | None]:
    """(content, calls, finish_reason) of a reply: "tool_calls" when the output holds
    calls. A forced call (tool_choice "required" or a named function) that max_tokens cut
    is still a call, with its arguments as far as written, and finish_reason "length"."""
    content, calls = parse_tool_calls(text, names)
    if calls:
        return content, calls, "tool_calls"
    if forced and finish_reason == "length":
        call = cut_call(text, names or ())
        if call is not None:
            return None, [call], "length"
    return content, [], finish_reason


class ToolCallStream:
    """Streamed text split into content to send now and calls sent at the end.

    `feed(delta)` returns the content that can go out: everything up to a `<tool_call>` (or
    a tail that may be the start of one), nothing while the output is only whitespace, and
    nothing at all once the output opens with '{' or '[' (a bare JSON call). `finish()`
    parses the whole text as `parse_tool_calls` does and returns the content not sent yet
    and the calls, so the streamed content adds up to the non-streamed one."""

    def __init__(self, names: Collection[str] | None = None, forced: bool = False):
        self.names = names
        self.forced = forced  # the output is a forced call: see `reply_calls`
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

    def finish(self, finish_reason: str | None = None) -> tuple[str, list[dict], str | None]:
        content, calls, finish_reason = reply_calls(self.text, finish_reason, self.names, self.forced)
        return (content or "")[self.sent:], calls, finish_reason


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin a `<tool_call>`."""
    for n in range(min(len(TAG_OPEN) - 1, len(text)), 0, -1):
        if TAG_OPEN.startswith(text[-n:]):
            return n
    return 0
