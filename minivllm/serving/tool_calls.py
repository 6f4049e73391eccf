"""Tools on chat completions: the request's `tools` and `tool_choice`, checked, and what
they do to generation.

    tools=[{"type": "function", "function": {"name": "get_weather", "description": "...",
                                             "parameters": {JSON schema of the arguments}}}]
    tool_choice="auto" (the default with tools) | "none" | "required"
                | {"type": "function", "function": {"name": "get_weather"}}

- The chat template gets `tools=` as sent (Qwen2.5's renders them in a <tools> block);
  with "none" it gets none, and the output is not read for calls.
- "auto": generation is free; the output is parsed for calls (tool_call_parser.py).
- "required" / a named function: generation is constrained to exactly one call, in the
  wrapper the model's template asks for: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  when the template mentions <tool_call> (Qwen, Hermes), otherwise the bare JSON object
  (`"parameters"` instead of `"arguments"` where the template says so, as Llama 3.1's does).
  The grammar is Lark, each tool's call embedded as a JSON schema (llguidance's `%json`),
  so the arguments match that tool's parameters schema, read strictly (strict_schema.py:
  no property the tool did not declare, as OpenAI's strict mode and vLLM do).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from minivllm.errors import ConfigError
from minivllm.sampling.constraint_limits import check_json_depth
from minivllm.sampling.structured import StructuredOutput
from minivllm.serving.strict_schema import strict_schema
from minivllm.serving.structured_request import build_structured

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (plus '.')
CHOICES = ("none", "auto", "required")
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
# The call's JSON as the templates write it (Python's json.dumps separators), so the
# forced call reads like the examples the model was trained on.
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CallFormat:
    tagged: bool  # <tool_call>...</tool_call> around each call
    arguments_key: str = "arguments"


def call_format(chat_template: str | None) -> CallFormat:
    """The wrapper a model's chat template asks for, read from the template's text."""
    template = chat_template or ""
    if TAG_OPEN in template:
        return CallFormat(tagged=True)
    if re.search(r'"name":\s*function name,\s*"parameters"', template):  # Llama 3.1/3.2
        return CallFormat(tagged=False, arguments_key="parameters")
    return CallFormat(tagged=False)


@dataclass
class ToolRequest:
    tools: list[dict]  # validated, as the client sent them
    choice: str  # none, auto, required, or "function" (then `function` names it)
    function: str | None
    format: CallFormat
    # False when the request also sets an output format: with "auto" the format wins.
    read_calls: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def forced(self) -> bool:
        """The output is constrained to one call."""
        return self.choice in ("required", "function")

    @property
    def parses_output(self) -> bool:
        return self.choice != "none" and self.read_calls

    def template_context(self) -> dict:
        return {} if self.choice == "none" else {"tools": self.tools}

    def constraint(self) -> StructuredOutput | None:
        """The grammar of one call (of the named function, or of any tool), or None."""
        if not self.forced:
            return None
        rules, alternatives = [], []
        for i, tool in enumerate(self.tools):
            name = tool["function"]["name"]
            if self.choice == "function" and name != self.function:
                continue
            rules.append(f"call{i}: %json {json.dumps(self.call_schema(i), ensure_ascii=False)}")
            alternatives.append(f"call{i}")
        calls = " | ".join(alternatives)
        start = f'start: "{TAG_OPEN}\\n" ({calls}) "\\n{TAG_CLOSE}"' if self.format.tagged else f"start: {calls}"
        return build_structured("tools", {"grammar": "\n".join([start, *rules])})

    def call_schema(self, i: int) -> dict:
        """The JSON schema of a call of tool `i`: {"name": <its name>, "arguments": <its parameters>}."""
        fn = self.tools[i]["function"]
        field = f"tools[{i}].function.parameters"
        check_json_depth(field, fn.get("parameters"))
        params = strict_schema(fn.get("parameters") or NO_ARGUMENTS)  # no arguments the tool did not declare
        build_structured(field, {"json_schema": params})  # on its own: errors name the tool
        schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, self.format.arguments_key: params},
                  "required": ["name", self.format.arguments_key], "additionalProperties": False,
                  "x-guidance": CALL_JSON}
        for defs in ("$defs", "definitions"):  # "#/$defs/..." references resolve from the root
            if defs in params:
                schema[defs] = params.pop(defs)
        return schema


def tool_request(tools: list | None, tool_choice: str | dict | None, chat_template: str | None) -> ToolRequest | None:
    """The checked tools and choice of a chat request, or None when it offers none."""
    if not tools:
        if tool_choice in (None, "none", "auto"):
            return None
        raise ConfigError("tool_choice", tool_choice, "needs tools: list the functions the model may call in tools")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        checked.append(_checked_tool(i, tool))
        name = tool["function"]["name"]
        if name in names:
            raise ConfigError(f"tools[{i}].function.name", name, "is given twice; tool names must be unique")
        names.add(name)
    choice, function = _choice(tool_choice, names)
    return ToolRequest(checked, choice, function, call_format(chat_template))


def _checked_tool(i: int, tool: object) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ConfigError(f"tools[{i}].type", tool.get("type") if isinstance(tool, dict) else tool,
                          'only function tools are supported: {"type": "function", "function": {...}}')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ConfigError(f"tools[{i}].function", fn, 'must be an object with name, description and parameters')
    if not isinstance(fn.get("name"), str) or not NAME_RE.match(fn["name"]):
        raise ConfigError(f"tools[{i}].function.name", fn.get("name"), "must be 1-64 letters, digits, _, - or .")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ConfigError(f"tools[{i}].function.description", fn["description"], "must be a string")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise ConfigError(f"tools[{i}].function.parameters", fn["parameters"], "must be a JSON schema (an object)")
    check_json_depth(f"tools[{i}]", tool)  # before anything walks it recursively (json, the chat template)
    try:  # JSON can carry lone surrogates, which no tokenizer can encode
        json.dumps(tool, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"tools[{i}]", fn["name"], "contains a lone surrogate, which is not valid Unicode") from None
    return tool


def _choice(tool_choice: str | dict | None, names: set[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ConfigError("tool_choice", tool_choice, f"one of: {', '.join(CHOICES)}, or "
                              '{"type": "function", "function": {"name": ...}}')
        return tool_choice, None
    fn = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise ConfigError("tool_choice", tool_choice,
                          'a named choice is {"type": "function", "function": {"name": ...}}')
    if fn.get("name") not in names:
        raise ConfigError("tool_choice.function.name", fn.get("name"),
                          f"not one of the tools: {', '.join(sorted(names))}")
    return "function", fn["name"]
