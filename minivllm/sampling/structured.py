"""What a constrained request's output must match: a JSON schema, any JSON object, a regex,
a grammar (Lark, or llama.cpp's GBNF) or one of a list of strings.

    SamplingParams(structured=StructuredOutput(json_schema={"type": "object", ...}))
    SamplingParams(structured={"regex": r"\\d{3}-\\d{4}"})        # a dict works too

Exactly one kind is set. The constraint is checked against static bounds
(constraint_limits.py: sizes, nesting, $ref and rule-chain depth) and compiled by
llguidance (the engine vLLM, SGLang and llama.cpp use) once here, in a child process with
a time budget (constraint_compiler.py), so a schema or grammar that does not compile, or
would crash or stall the compiler, is a `ConfigError` naming the field when the request is
made, not an error mid-generation. The text llguidance accepted is kept in `compiled`;
it is what crosses the wire to a worker, which builds its matcher from it against the
model's vocabulary (constraint.py) without converting or vetting it again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from minivllm.errors import ConfigError
from minivllm.sampling.constraint_compiler import compile_constraint
from minivllm.sampling.constraint_limits import (
    check_choices,
    check_grammar,
    check_schema,
    check_size,
    loads_client_json,
)

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


def llguidance_module():
    try:
        import llguidance
    except ImportError as exc:  # a dependency of minivllm; missing only in a broken install
        raise ConfigError("structured", "llguidance", "needs the llguidance package: pip install llguidance") from exc
    return llguidance


@dataclass
class StructuredOutput:
    json_schema: dict | str | None = None  # a JSON schema, as a dict or its JSON text
    json_object: bool = False  # any JSON object (OpenAI's JSON mode)
    regex: str | None = None  # the whole output matches it
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    choice: list[str] | None = None  # the whole output is one of these
    # The llguidance grammar the constraint compiled to, set once it passed the bounds and
    # the compile; a StructuredOutput that arrives with it (from the controller, over the
    # wire) is trusted and not compiled again.
    compiled: str | None = None

    def __post_init__(self) -> None:
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ConfigError("structured", chosen or "nothing",
                              f"set exactly one of {', '.join(KINDS)}")
        if isinstance(self.json_schema, str):
            self.json_schema = loads_client_json("structured.json_schema", self.json_schema)
        checks = {
            "json_schema": lambda v: isinstance(v, dict),
            "json_object": lambda v: v is True,
            "regex": lambda v: isinstance(v, str) and v != "",
            "grammar": lambda v: isinstance(v, str) and v.strip() != "",
            "choice": lambda v: isinstance(v, list) and v and all(isinstance(c, str) and c for c in v),
        }
        allowed = {"json_schema": "must be a JSON schema (an object)", "json_object": "must be true",
                   "regex": "must be a non-empty regular expression", "grammar": "must be a non-empty grammar",
                   "choice": "must be a non-empty list of non-empty strings"}
        kind = chosen[0]
        if not checks[kind](getattr(self, kind)):
            value = getattr(self, kind)  # shown short: a 100k-entry list must not come back in the error
            raise ConfigError(f"structured.{kind}", short_text(value) if isinstance(value, (str, list)) else value,
                              allowed[kind])
        if self.compiled is None:
            field, value = f"structured.{kind}", getattr(self, kind)
            self._check_bounds(field, value)
            self.compiled = compile_constraint(field, kind, value, short_text(value))

    def _check_bounds(self, field: str, value: Any) -> None:
        kind = self.kind
        if kind == "json_schema":
            check_schema(field, value)
        elif kind == "regex":
            check_size(field, len(value.encode("utf-8", "surrogatepass")))
        elif kind == "grammar":
            from llguidance.gbnf_to_lark import is_lark_syntax  # how llguidance tells Lark from GBNF

            check_grammar(field, value, is_lark_syntax(value))
        elif kind == "choice":
            check_choices(field, value)

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutput | None":
        """None, a StructuredOutput, or a dict of its fields (as it crosses the wire)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise ConfigError("structured", unknown, f"unknown keys; use {', '.join(KINDS)}")
            return cls(**value)
        raise ConfigError(
            "structured", type(value).__name__, "must be a StructuredOutput or a dict such as {'regex': ...}"
        )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar this constraint compiled to."""
        return self.compiled

    def describe(self) -> str:
        return f"{self.kind}: {short_text(getattr(self, self.kind))}"


def short_text(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= limit else text[:limit - 3] + "..."
