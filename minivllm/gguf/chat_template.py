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
MAX_RENDERED_CHARS) are refused before they allocate. A template over MAX_TEMPLATE_CHARS
(256 KiB) or MAX_TEMPLATE_TOKENS Jinja tokens, or nested too deeply to compile, is
refused with `ChatTemplateTooLarge` when the model loads, so compiling it is bounded. A template that only burns CPU in
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
        if (
            operator == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and abs(right) > 1024
            and abs(left) > 1
        ):
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


# Bounds checked when a model loads, before anything is compiled. Real templates are a few
# KB and a few thousand lexer tokens (Qwen2.5's: 2.5 KB, 530); compiling costs about 15 µs
# per token, so a template at the token bound compiles in well under a second, while a
# 10 MB one took 33 s and 449 MB.
MAX_TEMPLATE_CHARS = 256 * 1024
MAX_TEMPLATE_TOKENS = 32768
# Blocks and brackets open at once (real templates: under 10). Deeper ones overflow the
# parser's recursion or Python's block nesting when compiled.
MAX_TEMPLATE_NESTING = 48
_BLOCK_OPENERS = frozenset({"if", "for", "macro", "call", "filter", "with", "autoescape", "block"})


class ChatTemplateTooLarge(TokenizerError):
    """A chat template over the size, token or nesting bounds; refused when the model loads."""


def check_template_bounds(source: str, origin: str = "tokenizer.chat_template") -> None:
    """Refuse a template too large to compile quickly: over MAX_TEMPLATE_CHARS characters or
    MAX_TEMPLATE_TOKENS Jinja tokens (lexing stops at the bound, so this check is cheap)."""
    advice = "this is not a real chat template; do not trust this model file, or use one with a normal template"
    if len(source) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateTooLarge(f"the model's chat template ({origin}) has {len(source)} characters, over the limit "
                                   f"of {MAX_TEMPLATE_CHARS}; {advice}")
    depth, after_block_begin = 0, False
    try:
        for n, (line, kind, value) in enumerate(_environment().lex(source), 1):
            if n > MAX_TEMPLATE_TOKENS:
                raise ChatTemplateTooLarge(f"the model's chat template ({origin}) has more than {MAX_TEMPLATE_TOKENS} "
                                           f"Jinja tokens, over the limit; {advice}")
            if kind == "whitespace":
                continue
            if (kind == "operator" and value in "([{") or (
                after_block_begin and kind == "name" and value in _BLOCK_OPENERS
            ):
                depth += 1
                if depth > MAX_TEMPLATE_NESTING:
                    raise ChatTemplateTooLarge(f"the model's chat template ({origin}) nests blocks and brackets more "
                                               f"than {MAX_TEMPLATE_NESTING} deep (line {line}); {advice}")
            elif (kind == "operator" and value in ")]}") or (
                after_block_begin and kind == "name" and value.startswith("end")
            ):
                depth -= 1
            after_block_begin = kind == "block_begin"
    except jinja2.TemplateSyntaxError:
        return  # reported with its line when the template is compiled


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
        check_template_bounds(source, origin)
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"the model's chat template ({origin}) does not compile: {exc.message} (line {exc.lineno})"
            ) from exc
        except (RecursionError, SyntaxError, MemoryError):  # Python's own limits on the generated code
            raise ChatTemplateTooLarge(f"the model's chat template ({origin}) nests too deeply to compile; this is "
                                       "not a real chat template: use a model file with a normal one") from None

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
