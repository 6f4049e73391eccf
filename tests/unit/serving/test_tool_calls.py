"""Tool calls and structured-output fields of the OpenAI API, without a model.

Parsing of Qwen-style tagged and bare-JSON calls (malformed ones stay content), the
streaming splitter against the whole-text parse, the request fields -> StructuredOutput
mapping with its conflict errors, tools / tool_choice checks, and the forced-call grammar
run through llguidance over a byte vocabulary (each byte one token).
"""

from __future__ import annotations

import json

import llguidance
import pytest

from minivllm.errors import ConfigError
from minivllm.serving.openai_schema import ChatCompletionRequest, CompletionRequest
from minivllm.serving.structured_request import structured_from_request
from minivllm.serving.tool_call_parser import ToolCallStream, parse_tool_calls
from minivllm.serving.tool_calls import call_format, tool_request

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = ["get_weather", "get_time"]
QWEN_TEMPLATE = "... <tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call> ..."
LLAMA_TEMPLATE = ('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                  'its value}. Do not use variables.')


def fn(call: dict) -> tuple[str, dict]:
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 10
    return call["function"]["name"], json.loads(call["function"]["arguments"])


# --- parsing -------------------------------------------------------------------------


def test_qwen_tagged_call_with_text_around_it():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check.\n"
    assert [fn(c) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"})]


def test_several_tagged_calls_and_no_content():
    text = ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>')
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None
    assert [fn(c) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert calls[0]["id"] != calls[1]["id"]


def test_last_tagged_call_may_lack_its_closing_tag():
    _, calls = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {}}', NAMES)
    assert [fn(c) for c in calls] == [("get_time", {})]


def test_bare_json_calls_as_llama_emits_them():
    _, calls = parse_tool_calls(' {"name": "get_weather", "parameters": {"city": "Rome"}}', NAMES)
    assert [fn(c) for c in calls] == [("get_weather", {"city": "Rome"})]
    _, calls = parse_tool_calls('{"name": "get_time", "parameters": {}}; {"name": "get_time", "arguments": {}}', NAMES)
    assert len(calls) == 2
    _, calls = parse_tool_calls('[{"name": "get_time", "arguments": {}}]', NAMES)
    assert len(calls) == 1


@pytest.mark.parametrize("text", [
    "The weather is nice.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not one of the tools
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_time", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_time", "arguments": "not json"}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {}, "extra": 1}\n</tool_call>',
    '{"name": "get_time", "arguments": {}} and then some prose',  # bare JSON must be the whole output
    '{"city": "Paris"}',  # JSON, but not a call
    '{"name": "get_time", "arguments": {}, "parameters": {}}',
])
def test_malformed_calls_stay_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_a_malformed_block_stays_beside_a_good_one():
    bad = '<tool_call>\n{"name": broken}\n</tool_call>'
    good = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(bad + "\n" + good, NAMES)
    assert content == bad + "\n" and [fn(c) for c in calls] == [("get_time", {})]


@pytest.mark.parametrize("text", [
    "Hello there, no tools needed.",
    "  \n Sure.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
    "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n",
    '{"name": "get_weather", "arguments": {"city": "Nice", "unit": "c"}}',
    '{"a": 1} is JSON but not a call',
    "A <tool_call> that never parses, and a < sign",
    "text <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call> more text",
])
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_content_adds_up_to_the_whole_text_parse(text, piece):
    splitter = ToolCallStream(NAMES)
    sent = "".join(splitter.feed(text[i:i + piece]) for i in range(0, len(text), piece))
    rest, calls, _ = splitter.finish()
    content, whole_calls = parse_tool_calls(text, NAMES)
    assert sent + rest == (content or "")
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    if "<tool_call>" in text:  # nothing from a call's opening tag on went out early
        assert "<tool_call>" not in sent and "get_time" not in sent


def test_streaming_sends_plain_content_as_it_comes():
    splitter = ToolCallStream(NAMES)
    assert splitter.feed("Hello") == "Hello"
    assert splitter.feed(" wor") == " wor"
    assert splitter.feed("ld <tool") == "ld "  # may be the start of a call: held
    assert splitter.feed("s are fun") == "<tools are fun"


# --- request fields -> StructuredOutput ------------------------------------------------

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.mark.parametrize("fields, kind, value", [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     "json_schema", {**SCHEMA, "additionalProperties": False}),  # strict: closed
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
     "json_schema", SCHEMA),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
    ({"guided_regex": r"\d{3}"}, "regex", r"\d{3}"),
    ({"guided_grammar": 'start: "yes" | "no"'}, "grammar", 'start: "yes" | "no"'),
    ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": "[a-z]+", "grammar": None}}, "regex", "[a-z]+"),
    ({"structured_outputs": {"choice": ["x"]}}, "choice", ["x"]),
    ({"structured_outputs": {"json_object": True}}, "json_object", True),
])
def test_request_fields_map_to_a_structured_output(fields, kind, value):
    s = structured_from_request(**fields)
    assert s.kind == kind and getattr(s, kind) == value
    # The same through the pydantic bodies of both endpoints, into SamplingParams.
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
    assert chat.sampling_params(16).structured.kind == kind
    assert CompletionRequest(prompt="hi", **fields).sampling_params(16).structured.kind == kind


def test_text_format_and_nothing_are_no_constraint():
    assert structured_from_request() is None
    assert structured_from_request(response_format={"type": "text"}) is None
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format={"type": "text"},
                                 tools=[], tool_choice="none")
    assert body.sampling_params(16).structured is None and body.tool_request(QWEN_TEMPLATE) is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar"),
    # llguidance raises ValueError for these: still the client's error, named.
    ({"guided_json": "true"}, "guided_json"),
    ({"guided_grammar": "%json {"}, "guided_grammar"),
    ({"guided_grammar": 'x ::= "a"'}, "guided_grammar"),  # GBNF without a root rule
    ({"guided_regex": "\ud800"}, "guided_regex"),
])
def test_bad_fields_name_themselves(fields, param):
    with pytest.raises(ConfigError) as info:
        structured_from_request(**fields)
    assert info.value.field == param


@pytest.mark.parametrize("fields, names", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, ["response_format", "guided_regex"]),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, ["guided_json", "guided_choice"]),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, ["guided_regex", "structured_outputs"]),
])
def test_two_constraint_sources_conflict(fields, names):
    with pytest.raises(ConfigError) as info:
        structured_from_request(**fields)
    assert info.value.field == names[1]
    assert " and ".join(names) in str(info.value)


def test_a_forced_tool_call_conflicts_with_a_response_format():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                 tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ConfigError) as info:
        body.sampling_params(16, body.tool_request(QWEN_TEMPLATE))
    assert info.value.field == "tool_choice" and "response_format and tool_choice" in str(info.value)


# --- tools and tool_choice ---------------------------------------------------------------


def test_tool_choice_decides_template_parsing_and_constraint():
    auto = tool_request([WEATHER, TIME], None, QWEN_TEMPLATE)
    assert auto.choice == "auto" and auto.template_context() == {"tools": [WEATHER, TIME]}
    assert auto.parses_output and auto.constraint() is None
    none = tool_request([WEATHER], "none", QWEN_TEMPLATE)
    assert none.template_context() == {} and not none.parses_output and none.constraint() is None
    assert tool_request([WEATHER], "required", QWEN_TEMPLATE).constraint().kind == "grammar"
    named = tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, QWEN_TEMPLATE)
    assert named.choice == "function" and named.function == "get_time"


@pytest.mark.parametrize("tools, choice, param", [
    (None, "required", "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools[0].function.parameters"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "description": "\ud800"}}], None, "tools[0]"),
])
def test_bad_tools_and_choices_name_the_field(tools, choice, param):
    with pytest.raises(ConfigError) as info:
        tool_request(tools, choice, QWEN_TEMPLATE)
    assert info.value.field == param


def test_a_parameters_schema_that_does_not_compile_names_its_tool():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}
    with pytest.raises(ConfigError) as info:
        tool_request([WEATHER, bad], "required", QWEN_TEMPLATE).constraint()
    assert info.value.field == "tools[1].function.parameters"


def test_call_format_is_read_from_the_template():
    assert call_format(QWEN_TEMPLATE).tagged
    llama = call_format(LLAMA_TEMPLATE)
    assert not llama.tagged and llama.arguments_key == "parameters"
    plain = call_format("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not plain.tagged and plain.arguments_key == "arguments"
    assert not call_format(None).tagged


class _Bytes:
    """A vocabulary of the 256 bytes plus an end-of-sequence token, for llguidance."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


def accepts(structured, text: str) -> bool:
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257)
    m = llguidance.LLMatcher(tok, structured.grammar_text(), log_level=0)
    return m.consume_tokens(list(text.encode())) and m.is_stopped()


def test_forced_call_grammar_takes_exactly_one_valid_call():
    required = tool_request([WEATHER, TIME], "required", QWEN_TEMPLATE).constraint()
    weather = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    assert accepts(required, f"<tool_call>\n{weather}\n</tool_call>")
    assert accepts(required, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(required, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert not accepts(required, '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')
    assert not accepts(required, weather)  # the Qwen wrapper is required
    named = tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}},
                         QWEN_TEMPLATE).constraint()
    assert accepts(named, f"<tool_call>\n{weather}\n</tool_call>")
    assert not accepts(named, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    bare = tool_request([WEATHER], "required", "no tag here").constraint()
    assert accepts(bare, weather) and not accepts(bare, f"<tool_call>\n{weather}\n</tool_call>")
    llama = tool_request([TIME], "required", LLAMA_TEMPLATE).constraint()
    assert accepts(llama, '{"name": "get_time", "parameters": {}}')
    # The parser reads back what the grammar lets through.
    assert [fn(c) for c in parse_tool_calls(f"<tool_call>\n{weather}\n</tool_call>", NAMES)[1]] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]


def test_parameters_with_defs_keep_their_references():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
        "additionalProperties": False,
        "$defs": {"P": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                        "additionalProperties": False}}}}}
    forced = tool_request([tool], "required", "plain").constraint()
    assert accepts(forced, '{"name": "f", "arguments": {"p": {"n": 3}}}')
    assert not accepts(forced, '{"name": "f", "arguments": {"p": {"n": "3"}}}')


def test_chat_messages_carry_tool_calls_and_tool_answers():
    body = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ],
        tools=[WEATHER],
    )
    user, assistant, tool = body.chat_messages()
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert assistant["content"] == ""
    assert tool == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    bad = ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(ConfigError) as info:
        bad.chat_messages()
    assert info.value.field == "messages[0].tool_calls[0].function.arguments"


def test_text_completions_refuse_tools():
    with pytest.raises(ConfigError) as info:
        CompletionRequest(prompt="x", tools=[WEATHER]).prompt_input()
    assert info.value.field == "tools"


def test_an_output_format_wins_over_reading_calls_with_auto():
    messages = [{"role": "user", "content": "hi"}]
    both = ChatCompletionRequest(messages=messages, tools=[WEATHER], response_format={"type": "json_object"})
    tools = both.tool_request(QWEN_TEMPLATE)
    assert not tools.parses_output and tools.template_context() == {"tools": [WEATHER]}
    assert both.sampling_params(16, tools).structured.kind == "json_object"
    plain = ChatCompletionRequest(messages=messages, tools=[WEATHER], response_format={"type": "text"})
    assert plain.tool_request(QWEN_TEMPLATE).parses_output
