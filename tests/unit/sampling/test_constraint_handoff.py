"""How a compiled constraint reaches a worker's engine: the StructuredOutput crosses the
wire with the grammar text llguidance accepted and is not converted or compiled again,
and the matcher can be built ahead (`Constraints.prepare`, the worker's receiver thread)
so the step loop's `make` only takes it."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from minivllm.errors import ConfigError
from minivllm.sampling import structured as structured_module
from minivllm.sampling.constraint import READY, Constraints, TokenConstraint
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.sampling.structured import StructuredOutput

GBNF = 'root ::= "yes" | "no"'


class ByteTokenizer:
    """Token i is byte i; 256 is end-of-sequence."""
    vocab_size = 257
    eos_id, bos_id, eos_ids = 256, None, [256]

    def token_bytes(self, i: int) -> bytes:
        return bytes([i]) if i < 256 else b"<eos>"

    def is_special(self, i: int) -> bool:
        return i == 256

    def encode(self, text, add_bos=False, parse_special=False):
        return list(text.encode())


def test_a_structured_output_from_the_wire_is_not_compiled_again(monkeypatch):
    sent = SamplingParams(structured=StructuredOutput(grammar=GBNF))
    wire = asdict(sent)
    assert wire["structured"]["compiled"].startswith("%llguidance")  # the Lark llguidance accepted

    def no_compile(*args, **kwargs):
        raise AssertionError("a worker compiled a constraint the controller had compiled")

    monkeypatch.setattr(structured_module, "compile_constraint", no_compile)
    received = SamplingParams(**wire).structured
    assert received.grammar_text() == sent.structured.grammar_text() and received.grammar == GBNF
    with pytest.raises(AssertionError):
        StructuredOutput(grammar=GBNF)  # one not compiled yet would be


def test_prepare_builds_the_matcher_that_make_then_takes():
    constraints = Constraints(ByteTokenizer(), 257)
    structured = StructuredOutput(grammar=GBNF)
    constraints.prepare(structured)
    ready = structured.__dict__[READY]
    assert isinstance(ready, TokenConstraint)
    assert constraints.make(structured) is ready
    again = constraints.make(structured)  # taken once: a reused StructuredOutput builds its own
    assert isinstance(again, TokenConstraint) and again is not ready
    assert ready.allows(ord("y")) and not ready.allows(ord("x"))


def test_a_failure_while_preparing_is_raised_by_make():
    constraints = Constraints(ByteTokenizer(), 257)
    structured = StructuredOutput(grammar=GBNF)
    structured.compiled = "%llguidance {}\nstart: nope_undefined"  # fails against the vocabulary's build
    constraints.prepare(structured)
    with pytest.raises(ConfigError, match="does not compile"):
        constraints.make(structured)
