"""Rendering the model's own chat template (`tokenizer.chat_template`) safely.

The template is Jinja2 code shipped inside a downloaded file, so it runs in an
immutable sandbox: it can read what it is given but cannot reach Python internals
(`''.__class__.__mro__`) or mutate its arguments. The environment mirrors the one
Hugging Face `transformers` uses, because that is what template authors test against:
trim_blocks/lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, and a
`tojson` that does not HTML-escape (Jinja's built-in one turns `<` into `\\u003c`,
which would corrupt tool-call JSON in the prompt).

Two things are stricter than Jinja's own sandbox: touching an unsafe attribute
(`self._TemplateReference__context`) fails at once instead of rendering as "", and
`{% include %}`/`{% import %}`/`{% extends %}` are refused (the loader reads nothing).

Every failure (syntax error, `raise_exception`, sandbox violation, a bug in the
template) becomes a `TokenizerError` carrying the template's own message and naming
where the template came from; a sandbox violation says the sandbox refused it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from minivllm.errors import TokenizerError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _NoFilesLoader(jinja2.BaseLoader):
    """`{% include %}`, `{% import %}` and `{% extends %}` reach this loader: a chat template
    is one self-contained string, and it must not read files (or anything else)."""

    def get_source(self, environment: jinja2.Environment, template: str) -> Any:
        raise SecurityError(f"the template tried to load {template!r} (include/import/extends); "
                            f"chat templates may not read files or other templates")


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja returns an Undefined that only fails when used further, so a bare
        # `{{ self._TemplateReference__context }}` would render as "". Refuse at once.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], loader=_NoFilesLoader())
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates expect."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 origin: str = "tokenizer.chat_template"):
        """`origin` names where the template came from in error messages (the metadata key
        and the GGUF file)."""
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"the model's chat template ({origin}) does not compile: {exc.message} (line {exc.lineno})"
            ) from exc

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, **context: Any) -> str:
        """The prompt text for `messages`; extra keyword arguments (e.g. `tools`) reach the template."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **context,
            )
        except SecurityError as exc:
            raise TokenizerError(
                f"the model's chat template ({self.origin}) was refused by the sandbox: {exc}. The template "
                f"tries to reach Python internals, files or to modify its arguments, which minivllm never "
                f"allows; do not trust this model file: use another one, or send a raw prompt instead of chat messages"
            ) from exc
        except jinja2.TemplateError as exc:
            # UndefinedError and raise_exception(...) land here.
            raise TokenizerError(f"the model's chat template ({self.origin}) failed: {exc}") from exc
        except Exception as exc:  # a bug inside third-party template code, e.g. str + int
            raise TokenizerError(
                f"the model's chat template ({self.origin}) failed: {type(exc).__name__}: {exc}"
            ) from exc
