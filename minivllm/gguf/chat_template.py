"""Rendering the model's own chat template (`tokenizer.chat_template`) safely.

The template is Jinja2 code shipped inside a downloaded file, so it runs in an
immutable sandbox: it can read what it is given but cannot reach Python internals
(`''.__class__.__mro__`) or mutate its arguments. The environment mirrors the one
Hugging Face `transformers` uses, because that is what template authors test against:
trim_blocks/lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, and a
`tojson` that does not HTML-escape (Jinja's built-in one turns `<` into `\\u003c`,
which would corrupt tool-call JSON in the prompt).

Three things are stricter than Jinja's own sandbox: touching an unsafe attribute
(`self._TemplateReference__context`) fails at once instead of rendering as "",
`{% include %}`/`{% import %}`/`{% extends %}` are refused (the loader reads nothing), and
memory bombs (`'x' * 10**10`, `10 ** 10**9`, `''.ljust(10**10)`, or output past
MAX_RENDERED_CHARS) are refused before they allocate. A template that only burns CPU in
empty loops is not stopped (Jinja caps `range` at 100,000 items, not nesting).

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


# A prompt is at most a context window of text; a template that builds more is a bomb
# (`{{ 'x' * 10**10 }}`), refused before the string exists.
MAX_RENDERED_CHARS = 4 << 20
_PADDING_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})


def _size_of(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(times, int) and _size_of(seq) * max(times, 0) > MAX_RENDERED_CHARS:
                    raise SecurityError(f"the template tried to build a sequence of {_size_of(seq) * times} items "
                                        f"(limit {MAX_RENDERED_CHARS})")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) > 1024 and abs(left) > 1:
            raise SecurityError(f"the template tried to compute {left} ** {right}")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's signature
        name = getattr(__obj, "__name__", "")
        if isinstance(getattr(__obj, "__self__", None), str) and name in _PADDING_METHODS:
            if any(isinstance(a, int) and a > MAX_RENDERED_CHARS for a in args):
                raise SecurityError(f"the template tried to pad a string to more than {MAX_RENDERED_CHARS} characters")
        return super().call(__context, __obj, *args, **kwargs)

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
            pieces, size = [], 0
            for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=self.bos_token, eos_token=self.eos_token, **context):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise SecurityError(f"the rendered prompt grew past {MAX_RENDERED_CHARS} characters")
                pieces.append(piece)
            return "".join(pieces)
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
