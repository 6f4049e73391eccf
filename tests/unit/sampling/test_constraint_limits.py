"""The static bounds on constraints (constraint_limits.py), against hand-counted depths,
and the shapes that segfaulted llguidance (issue 39) at full size and twice it: each is
refused with a ConfigError naming the limit and the value, before any compile."""

from __future__ import annotations

import json

import pytest

from minivllm.errors import ConfigError
from minivllm.reliability.hostile_constraints import gbnf_chain, lark_chain, ref_objects, ref_plain
from minivllm.sampling.constraint_limits import (
    MAX_CHOICES,
    MAX_CONSTRAINT_BYTES,
    MAX_JSON_DEPTH,
    MAX_RULE_DEPTH,
    MAX_SCHEMA_DEPTH,
    check_grammar,
    gbnf_rules,
    json_depth,
    json_text_depth,
    lark_rules,
    loads_client_json,
    rule_depth,
    schema_depth,
)
from minivllm.sampling.structured import StructuredOutput


def test_json_depth_counts_objects_and_arrays():
    assert json_depth(5) == 0 and json_depth({}) == 1 and json_depth([[]]) == 2
    assert json_depth({"a": [1, {"b": "[[[{"}]}) == 3
    assert json_text_depth('{"a": [1, {"b": "[[[{\\"{"}]}') == 3  # brackets in strings (escaped quote too) don't count
    assert json_text_depth("[" * 100_000 + "]" * 100_000) == 100_000


def test_deep_json_text_is_a_config_error_not_a_recursion_error():
    with pytest.raises(ConfigError, match=f"the limit is {MAX_JSON_DEPTH} levels"):
        loads_client_json("guided_json", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="not valid JSON"):
        loads_client_json("guided_json", "{")
    assert loads_client_json("x", '{"a": [1]}') == {"a": [1]}


def test_schema_depth_follows_nesting_and_refs():
    # root -> d0 -> ... -> d9: 11 schema nodes along the chain.
    assert schema_depth(ref_plain(9)) == 11
    # root -> d0 -> its property x ($ref) -> d1 -> ... : two nodes a link, then d5 (a string).
    assert schema_depth(ref_objects(5)) == 1 + 2 * 5 + 1
    assert schema_depth({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}}) == 3
    # Recursion (a tree) is compiled lazily by llguidance: the cycle adds nothing.
    assert schema_depth({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}) == 3


def test_rule_depth_of_lark_and_gbnf():
    assert rule_depth(lark_rules("g", lark_chain(9))) == 11  # start, r0..r9
    assert rule_depth(gbnf_rules(gbnf_chain(9))) == 11  # root, r0..r9
    lark = ('?start: value\nvalue: object | STRING  // a comment naming nope\n'
            'object: "{" [pair ("," pair)*] "}"\npair[capture]: STRING ":" value\nSTRING.2: /"[^"]*"/\n')
    rules = lark_rules("g", lark)
    assert set(rules) == {"start", "value", "object", "pair", "STRING"} and "nope" not in rules["value"]
    assert rule_depth(rules) == 5  # start value object pair STRING (pair -> value closes a cycle)
    gbnf = 'root ::= obj  # obj2 in a comment\nobj ::= "{" kv "}" | "root"\nkv ::= [a-z\\]]+ ":" obj\n'
    assert gbnf_rules(gbnf) == {"root": {"obj"}, "obj": {"kv"}, "kv": {"obj"}}


@pytest.mark.parametrize("kind, value, limit", [
    ("json_schema", ref_objects(1000), MAX_SCHEMA_DEPTH),  # segfaulted at ~920
    ("json_schema", ref_objects(2000), MAX_SCHEMA_DEPTH),
    ("json_schema", ref_plain(3000), MAX_SCHEMA_DEPTH),  # segfaulted at ~2,500
    ("json_schema", ref_plain(6000), MAX_SCHEMA_DEPTH),
    ("grammar", lark_chain(2800), MAX_RULE_DEPTH),  # segfaulted at ~2,700
    ("grammar", lark_chain(5600), MAX_RULE_DEPTH),
    ("grammar", gbnf_chain(4000), MAX_RULE_DEPTH),  # segfaulted at ~3,500
    ("grammar", gbnf_chain(8000), MAX_CONSTRAINT_BYTES),  # 151 KB: its size is checked first
    ("grammar", "start: T0\n" + "".join(f'T{i}: "a" T{i + 1}\n' for i in range(4000)) + 'T4000: "b"\n', MAX_RULE_DEPTH),
    ("grammar", "start: x\nx: %json " + json.dumps(ref_objects(1000)), MAX_SCHEMA_DEPTH),
    ("choice", [f"option {i}" for i in range(100_000)], MAX_CHOICES),  # took 19.6 s before its 400
    ("grammar", "root ::= " + " | ".join(f'"w{i}"' for i in range(50_000)), MAX_CONSTRAINT_BYTES),  # 1 MB class
    ("json_schema", "[" * 100_000 + "]" * 100_000, MAX_JSON_DEPTH),  # was a RecursionError: a 500
])
def test_shapes_that_crashed_llguidance_are_refused_naming_the_limit(kind, value, limit):
    with pytest.raises(ConfigError) as info:
        StructuredOutput(**{kind: value})
    message = str(info.value)
    assert f"the limit is {limit}" in message, message
    assert len(message) < 400, message  # names the value's size, never echoes it


def test_a_grammar_under_the_bounds_still_compiles():
    for value in (lark_chain(200), gbnf_chain(200)):
        check_grammar("g", value, value.startswith("start"))
        assert StructuredOutput(grammar=value).compiled
    assert StructuredOutput(json_schema=ref_objects(60)).compiled


def test_a_refused_value_is_shown_short():
    with pytest.raises(ConfigError) as info:
        StructuredOutput(choice=["a"] * 100_000 + [""])
    assert "non-empty strings" in str(info.value) and len(str(info.value)) < 400
