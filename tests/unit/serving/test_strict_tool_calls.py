"""Strict schemas (strict_schema.py) and forced calls cut by max_tokens (tool_call_parser.py),
checked against hand-written expectations and against llguidance's own matcher: a strict
forced-call grammar admits no argument the tool did not declare."""

from __future__ import annotations

import json

import llguidance
import pytest

from minivllm.errors import ConfigError
from minivllm.serving.openai_schema import ChatCompletionRequest
from minivllm.serving.strict_schema import strict_schema
from minivllm.serving.structured_request import structured_from_request
from minivllm.serving.tool_call_parser import ToolCallStream, cut_call, reply_calls
from minivllm.serving.tool_calls import tool_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_strict_closes_objects_and_tuples_it_does_not_already_say_about():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "open": {"type": "object", "additionalProperties": True},
        "t": {"type": "array", "prefixItems": [{"type": "string"}]},
        "l": {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]}}},
        "$defs": {"d": {"properties": {"x": {}}}}}
    strict = strict_schema(schema)
    assert strict == {"type": "object", "additionalProperties": False, "properties": {
        "a": {"type": "object", "additionalProperties": False, "properties": {"b": {"type": "integer"}}},
        "open": {"type": "object", "additionalProperties": True},
        "t": {"type": "array", "prefixItems": [{"type": "string"}], "items": False},
        "l": {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {}, "additionalProperties": False},
                                                   {"type": "null"}]}}},
        "$defs": {"d": {"properties": {"x": {}}, "additionalProperties": False}}}
    assert "additionalProperties" not in schema  # the client's schema is left as sent


def _matcher(structured):
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    return llguidance.LLMatcher(tok, structured.grammar_text(), log_level=0)


class _Bytes:  # a byte-level vocabulary: token i is byte i, 256 is end-of-sequence
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


def _accepts(matcher, text: str) -> bool:
    return matcher.try_consume_tokens(list(text.encode())) == len(text.encode()) and matcher.is_accepting()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_admits_no_undeclared_argument(choice):
    structured = tool_request([WEATHER], choice, None).constraint()
    assert _accepts(_matcher(structured), '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    # Before strict mode this was what a small model wrote until max_tokens (issue 39).
    assert not _accepts(_matcher(structured), '{"name": "get_weather", "arguments": {"city": "Paris", "x": 1}}')


def test_strict_json_schema_is_closed_and_a_plain_one_is_not():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    strict = structured_from_request(response_format={**fmt, "json_schema": {**fmt["json_schema"], "strict": True}})
    plain = structured_from_request(response_format=fmt)
    assert _accepts(_matcher(plain), '{"a":1,"b":2}')
    assert not _accepts(_matcher(strict), '{"a":1,"b":2}') and _accepts(_matcher(strict), '{"a":1}')


def test_a_forced_call_cut_by_max_tokens_is_still_a_call():
    names = ["get_weather", "get_time"]
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls, finish = reply_calls(text, "length", names, forced=True)
    assert content is None and finish == "length"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert cut_call('{"name": "get_w', names)["function"] == {"name": "get_weather", "arguments": ""}
    assert cut_call('{"name": "get_', names) is None  # either tool: no call to claim
    # Not forced, or not cut: the text stays text.
    assert reply_calls(text, "length", names, forced=False) == (text, [], "length")
    whole = '{"name": "get_time", "arguments": {}}'
    _, calls, finish = reply_calls(whole, "stop", names, forced=True)
    assert finish == "tool_calls" and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    splitter = ToolCallStream(names, forced=True)
    splitter.feed(text)
    rest, calls, finish = splitter.finish("length")
    assert (rest, finish, calls[0]["function"]["name"]) == ("", "length", "get_weather")


def test_deep_tool_call_arguments_in_messages_are_a_400_not_a_recursion_error():
    deep = "[" * 100_000 + "]" * 100_000
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                             "function": {"name": "f", "arguments": deep}}]}])
    with pytest.raises(ConfigError, match=r"messages\[1\].tool_calls\[0\].function.arguments.*the limit is 100"):
        body.chat_messages()


def test_deep_tool_parameters_are_a_400():
    params = {"type": "object"}
    for _ in range(200):
        params = {"type": "object", "properties": {"x": params}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    with pytest.raises(ConfigError, match=r"tools\[0\].*the limit is 100"):
        tool_request([tool], "required", None)
    assert json.dumps(WEATHER)  # the shallow one is fine
    assert tool_request([WEATHER], "required", None).constraint() is not None
