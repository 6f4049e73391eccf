"""The output constraint a request body asks for, as a `StructuredOutput`.

Three ways of asking, as in OpenAI's API and vLLM's:

    "response_format": {"type": "json_object"}
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {...}, "strict": true}}
    "guided_json": {...} (or its JSON text), "guided_regex": "...", "guided_grammar": "...",
    "guided_choice": ["yes", "no"]
    "structured_outputs": {"json": ... | "regex": ... | "grammar": ... | "choice": [...] | "json_object": true}

`strict: true` closes the schema's objects (strict_schema.py). A request uses one source;
two (say response_format and guided_regex, or a schema and a forced tool call) are a
ConfigError naming both. Every error names the request's own field
(`response_format.json_schema.schema`, `guided_regex`, `structured_outputs.grammar`), so a
schema or grammar that does not compile is a 400 pointing at what the client sent.
"""

from __future__ import annotations

from typing import Any

from minivllm.errors import ConfigError, quoted
from minivllm.sampling.constraint_limits import check_json_depth
from minivllm.sampling.structured import StructuredOutput
from minivllm.serving.strict_schema import strict_schema

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# structured_outputs keys (vLLM's StructuredOutputsParams) -> StructuredOutput fields.
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
                           "json_object": "json_object"}
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
                 "guided_choice": "choice"}


def structured_from_request(*, response_format: dict | None = None, structured_outputs: dict | None = None,
                            extra: dict[str, StructuredOutput] | None = None, **guided: Any) -> StructuredOutput | None:
    """The request's constraint, or None. `guided` holds the guided_* fields; `extra` holds
    constraints other fields already built (tool_choice's forced call), for the conflict check."""
    unknown = sorted(set(guided) - set(GUIDED_FIELDS))
    if unknown:
        raise TypeError(f"unknown guided fields: {unknown}")
    wanted: list[tuple[str, dict]] = []  # (request field, StructuredOutput kwargs)
    if response_format is not None:
        kwargs = _response_format(response_format)
        if kwargs is not None:
            wanted.append(("response_format.json_schema.schema" if "json_schema" in kwargs else "response_format",
                           kwargs))
    for name, kind in GUIDED_FIELDS.items():
        if guided.get(name) is not None:
            wanted.append((name, {kind: guided[name]}))
    if structured_outputs is not None:
        wanted.append(_structured_outputs(structured_outputs))
    built = dict(extra or {})
    sources = [field.split(".")[0] for field, _ in wanted] + list(built)
    if len(sources) > 1:
        raise ConfigError(sources[1], sources, f"give one way of constraining the output; this request sets "
                                               f"{' and '.join(sources)}")
    if built:
        return next(iter(built.values()))
    if not wanted:
        return None
    field, kwargs = wanted[0]
    return build_structured(field, kwargs)


def build_structured(field: str, kwargs: dict) -> StructuredOutput:
    """StructuredOutput(**kwargs), its errors renamed to the request's `field`. llguidance
    raises ValueError for some inputs (a GBNF-looking grammar that does not convert, a
    schema that is `true`, lone surrogates): those are the client's errors too, not a 500."""
    try:
        return StructuredOutput(**kwargs)
    except ConfigError as exc:
        raise ConfigError(field, exc.value, reason(exc)) from None
    except ValueError as exc:  # UnicodeEncodeError included
        value = next(iter(kwargs.values()))
        raise ConfigError(field, value if isinstance(value, str) and len(value) <= 80 else f"<{field}>",
                          f"does not compile: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def reason(exc: ConfigError) -> str:
    """The 'allowed' part of a ConfigError's message (after "invalid field=value: ")."""
    text, prefix = str(exc), f"invalid {exc.field}={quoted(exc.value)}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def _response_format(value: dict) -> dict | None:
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ConfigError("response_format.type", kind, f"one of: {', '.join(RESPONSE_FORMATS)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ConfigError("response_format.json_schema", spec, 'must be an object such as {"name": "answer", '
                          '"schema": {"type": "object", ...}}')
    if "name" in spec and not isinstance(spec["name"], str):
        raise ConfigError("response_format.json_schema.name", spec["name"], "must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ConfigError("response_format.json_schema.strict", spec["strict"], "must be true or false")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise ConfigError("response_format.json_schema.schema", schema, "give the JSON schema (an object) the "
                          "output must match")
    if spec.get("strict") is True:  # closed objects, as OpenAI's strict mode reads them
        check_json_depth("response_format.json_schema.schema", schema)
        schema = strict_schema(schema)
    return {"json_schema": schema}


def _structured_outputs(value: dict) -> tuple[str, dict]:
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    for key in given:
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise ConfigError(f"structured_outputs.{key}", given[key], f"not supported; set one of "
                              f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    if len(given) != 1:
        raise ConfigError("structured_outputs", sorted(given) or "nothing",
                          f"set exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    (key, v), = given.items()
    return f"structured_outputs.{key}", {STRUCTURED_OUTPUTS_KEYS[key]: v}
