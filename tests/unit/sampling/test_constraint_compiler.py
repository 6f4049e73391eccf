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
