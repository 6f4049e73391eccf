"""The compile in a child process (constraint_compiler.py): what it returns is what
llguidance gives in-process; a constraint that crashes the compiler or outlasts the budget
is a ConfigError, and this process (pytest) lives on, as does the next compile."""

from __future__ import annotations

import json

import llguidance
import pytest

from minivllm.errors import ConfigError
from minivllm.sampling.constraint_compiler import compile_constraint


def ref_objects(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def test_the_child_returns_llguidances_own_grammar():
    gbnf = 'root ::= "yes" | "no" [0-9]*'
    assert compile_constraint("g", "grammar", gbnf, "x") == llguidance.grammar_from("grammar", gbnf)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(compile_constraint("g", "json_schema", schema, "x")) == json.loads(
        llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))


def test_a_compile_error_names_the_field():
    with pytest.raises(ConfigError, match="guided_json.*does not compile: .*wat"):
        compile_constraint("guided_json", "json_schema", {"type": "wat"}, "x")


def test_a_crash_in_the_compiler_is_a_config_error_and_the_next_compile_works():
    # 300 links crash llguidance on the child's 2 MiB stack (~230 do there; ~920 on 8 MiB):
    # here, past the static bounds, only the child dies.
    with pytest.raises(ConfigError, match="crashed the grammar compiler .signal 11"):
        compile_constraint("response_format", "json_schema", ref_objects(300), "x")
    assert compile_constraint("g", "regex", "[a-z]+", "x")


def test_a_compile_past_the_budget_is_a_config_error():
    slow = "start: " + " | ".join(f'"w{i}"' for i in range(20_000))  # ~0.4 s to compile here
    with pytest.raises(ConfigError, match="took longer than the 0.01 s compile budget"):
        compile_constraint("guided_grammar", "grammar", slow, "x", budget_s=0.01)
    assert compile_constraint("g", "regex", "[0-9]+", "x")


class _Bytes:  # a byte-level vocabulary: token i is byte i, 256 is end-of-sequence
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


def _matches(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes())), grammar, log_level=0)
    data = list(text.encode())
    return matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting() and not matcher.is_error()


def test_a_long_choice_list_matches_exactly_its_entries():
    """2,500 choices: llguidance's own choice grammar puts them in one Earley row, which
    holds at most 2,000 items, and fails at the first byte; as one terminal they work."""
    choices = [f"option {i}" for i in range(2500)] + ['a "quoted" \\ one', "ünïcode"]
    grammar = compile_constraint("guided_choice", "choice", choices, "x")
    for text in ("option 0", "option 1234", "option 2499", 'a "quoted" \\ one', "ünïcode"):
        assert _matches(grammar, text), text
    for text in ("option 2500", "option", "option 12345", ""):
        assert not _matches(grammar, text), text
    assert not _matches(llguidance.grammar_from("choice", json.dumps(choices)), "option 1234")  # the row limit
