"""What a constrained request's output must match: a JSON schema, any JSON object, a regex,
a grammar (Lark, or llama.cpp's GBNF) or one of a list of strings.

    SamplingParams(structured=StructuredOutput(json_schema={"type": "object", ...}))
    SamplingParams(structured={"regex": r"\\d{3}-\\d{4}"})        # a dict works too

Exactly one kind is set. The constraint itself is compiled by llguidance (the engine vLLM,
SGLang and llama.cpp use), once here to check it, so a schema or grammar that does not
compile is a `ConfigError` naming the field when the request is made, not an error
mid-generation; and again in the engine, against the model's vocabulary (constraint.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from minivllm.errors import ConfigError

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# Compact JSON ("," and ":" with no whitespace around them): a model asked for JSON cannot
# then spend its whole budget on whitespace, a known failure of free-whitespace JSON modes.
JSON_OPTIONS = {"whitespace_flexible": False}


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

    def __post_init__(self) -> None:
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ConfigError("structured", chosen or "nothing",
                              f"set exactly one of {', '.join(KINDS)}")
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise ConfigError("structured.json_schema", self.json_schema[:80], f"is not valid JSON: {exc}") from exc
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
            raise ConfigError(f"structured.{kind}", getattr(self, kind), allowed[kind])
        try:
            error = llguidance_module().LLMatcher.validate_grammar(self.grammar_text())
        except ValueError as exc:  # llguidance's converters refuse some inputs outright
            error = str(exc) or type(exc).__name__
        if error and not error.startswith("WARNING"):
            raise ConfigError(f"structured.{kind}", short_text(getattr(self, kind)), f"does not compile: {error.strip()}")

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
        raise ConfigError("structured", type(value).__name__, "must be a StructuredOutput or a dict such as {'regex': ...}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar this constraint compiles to."""
        llg = llguidance_module()
        kind = self.kind
        if kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(self.json_schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.regex)
        if kind == "grammar":
            return llg.grammar_from("grammar", self.grammar)  # Lark, or GBNF (told apart by llguidance)
        return llg.grammar_from("choice", json.dumps(self.choice))

    def describe(self) -> str:
        return f"{self.kind}: {short_text(getattr(self, self.kind))}"


def short_text(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
