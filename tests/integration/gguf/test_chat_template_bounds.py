"""Chat templates too large or too deep to compile quickly are refused when the model loads.

Templates are written into real GGUF files (tokenizer-only, via gguf-py's writer) and
loaded through `Tokenizer.from_gguf`, as a server would. Work is bounded, not timed:
tracemalloc's peak while loading a 10 MB template stays near the size of the string the
reader must hold (compiling it took 449 MB), and the lexer pass stops at the token bound.
"""

from __future__ import annotations

import tracemalloc

import pytest
from tokenizer_fixtures import write_byte_vocab_gguf

from minivllm.gguf import chat_template as ct
from minivllm.gguf.chat_template import (
    MAX_TEMPLATE_CHARS,
    MAX_TEMPLATE_NESTING,
    MAX_TEMPLATE_TOKENS,
    ChatTemplateTooLarge,
    check_template_bounds,
)
from minivllm.gguf.tokenizer import Tokenizer


def load(tmp_path, template: str) -> Tokenizer:
    return Tokenizer.from_gguf(write_byte_vocab_gguf(tmp_path / "model.gguf", chat_template=template))


def test_a_10_mb_template_is_refused_at_load_without_compiling(tmp_path):
    template = "{{1}}" * (2 * 1024 * 1024)
    path = write_byte_vocab_gguf(tmp_path / "model.gguf", chat_template=template)
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateTooLarge) as info:
            Tokenizer.from_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert "tokenizer.chat_template" in message and str(path) in message
    assert f"{len(template)} characters" in message and str(MAX_TEMPLATE_CHARS) in message
    assert peak < 6 * len(template), peak  # the string (and its metadata copy), not a compiled template


def test_too_many_tokens_is_refused_after_lexing_only_up_to_the_bound(tmp_path, monkeypatch):
    template = "{{1}}" * (MAX_TEMPLATE_CHARS // 5)  # under the size bound, ~3x over the token bound
    assert len(template) <= MAX_TEMPLATE_CHARS
    lexed = []
    real_environment = ct._environment

    def counting_environment():
        env = real_environment()
        lex = env.lex
        env.lex = lambda source: (lexed.append(1) or token for token in lex(source))  # noqa: E731
        return env

    monkeypatch.setattr(ct, "_environment", counting_environment)
    with pytest.raises(ChatTemplateTooLarge, match=f"more than {MAX_TEMPLATE_TOKENS} Jinja tokens"):
        load(tmp_path, template)
    assert len(lexed) == MAX_TEMPLATE_TOKENS + 1


@pytest.mark.parametrize("template", [
    "{% if x %}" * (MAX_TEMPLATE_NESTING + 1) + "{% endif %}" * (MAX_TEMPLATE_NESTING + 1),
    "{% for m in messages %}" * 30 + "{% if m %}" * 30 + "{% endif %}" * 30 + "{% endfor %}" * 30,
    "{{ " + "(" * 200 + "1" + ")" * 200 + " }}",
    "{{ " + "[" * 100 + "]" * 100 + " }}",
])
def test_deep_nesting_is_refused_at_load(tmp_path, template):
    with pytest.raises(ChatTemplateTooLarge, match="nests blocks and brackets"):
        load(tmp_path, template)


def test_nesting_that_compile_rejects_is_a_named_error_not_a_crash(tmp_path):
    # Within the lexer's nesting bound but past Python's 20 nested blocks in generated code.
    template = "{% for m in messages %}" * 24 + "x" + "{% endfor %}" * 24
    check_template_bounds(template)
    tok = load(tmp_path, template)
    with pytest.raises(ChatTemplateTooLarge, match="nests too deeply"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_real_templates_are_far_inside_the_bounds(smollm2_path, qwen05_path):
    for path in (smollm2_path, qwen05_path):
        tok = Tokenizer.from_gguf(path)
        source = tok.chat_template
        assert len(source) < MAX_TEMPLATE_CHARS // 16
        assert sum(1 for _ in ct._environment().lex(source)) < MAX_TEMPLATE_TOKENS // 16
        assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}])
