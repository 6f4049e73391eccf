"""The GGUF tokenizer against llama.cpp's recorded token ids, plus decode, streaming and chat templates.

Reference data (data/tokenizer_reference/*.llamacpp.json) was recorded by
scripts/record_llamacpp_token_ids.py with llama-cpp-python 0.3.36 (llama.cpp commit
0c1e57098bba43ac29e6e3b677cdceebdd22334f), installed in a scratch venv, never here:

    /tmp/lcpp/bin/python scripts/record_llamacpp_token_ids.py \\
        SmolLM2-135M-Instruct.Q4_1.gguf data/tokenizer_reference/smollm2-135m.llamacpp.json
    /tmp/lcpp/bin/python scripts/record_llamacpp_token_ids.py \\
        Qwen2.5-Coder-0.5B-Instruct.gguf data/tokenizer_reference/qwen2.5-coder-0.5b.llamacpp.json
    for pre in llama-bpe gpt-2 default; do
        /tmp/lcpp/bin/python scripts/record_llamacpp_token_ids.py --synthetic-pre $pre \\
            SmolLM2-135M-Instruct.Q4_1.gguf data/tokenizer_reference/$pre-synthetic.llamacpp.json
    done

Each corpus text (data/tokenizer_corpus.json) was tokenized with llama.cpp's
add_special=True, parse_special=True, and some also with either turned off. The
synthetic files reuse the SmolLM2 vocabulary (plus digit tokens) under another
`tokenizer.ggml.pre` and are rebuilt here by the same helper
(tests/tokenizer_fixtures.py); a SHA-256 of the `tokenizer.*` metadata proves the
vocabulary under test is the one recorded.
"""

from __future__ import annotations

import json
import random

import jinja2.sandbox
import pytest
from tokenizer_fixtures import (
    REFERENCE_DIR,
    SYNTHETIC_PRES,
    load_corpus,
    synthetic_reference_name,
    tokenizer_metadata_sha256,
    write_byte_vocab_gguf,
    write_synthetic_vocab_gguf,
)

from minivllm.errors import TokenizerError
from minivllm.gguf.chat_template import ChatTemplate
from minivllm.gguf.detokenizer import StreamingDetokenizer
from minivllm.gguf.reader import GGUFFile
from minivllm.gguf.tokenizer import Tokenizer

REAL = {"smollm2-135m": "smollm2_path", "qwen2.5-coder-0.5b": "qwen05_path"}
SUBJECTS = [*REAL, *(f"{pre}-synthetic" for pre in SYNTHETIC_PRES)]


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_path) -> GGUFFile:
    return GGUFFile(smollm2_path)


@pytest.fixture(scope="module", params=SUBJECTS)
def subject(request):
    """(tokenizer, GGUF metadata, llama.cpp reference) for each recorded vocabulary."""
    return request.getfixturevalue("subject_by_name")(request.param)


def _load_subject(request, name: str) -> tuple:
    if name in REAL:
        gguf = GGUFFile(request.getfixturevalue(REAL[name]))
        ref_path = REFERENCE_DIR / f"{name}.llamacpp.json"
    else:
        pre = name.removesuffix("-synthetic")
        source = request.getfixturevalue("smollm2_gguf").metadata
        tmp = request.getfixturevalue("tmp_path_factory").mktemp("vocab")
        gguf = GGUFFile(write_synthetic_vocab_gguf(tmp / f"{pre}.gguf", pre, source))
        ref_path = REFERENCE_DIR / synthetic_reference_name(pre)
    ref = json.loads(ref_path.read_text(encoding="utf-8"))
    return Tokenizer.from_gguf(gguf), gguf.metadata, ref


@pytest.fixture(scope="module")
def subject_by_name(request):
    """Reuse a `subject` tokenizer outside the parametrized tests (loading Qwen takes ~1 s)."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            cache[name] = _load_subject(request, name)
        return cache[name]

    return get


def _ours(tok: Tokenizer, case: dict) -> list[int]:
    # llama.cpp's add_special=True means "BOS if the model wants it": our add_bos=None.
    return tok.encode(case["text"], add_bos=None if case["add_bos"] else False, parse_special=case["special"])


# -- agreement with llama.cpp -----------------------------------------------------------


def test_vocabulary_is_the_recorded_one(subject):
    _, metadata, ref = subject
    assert tokenizer_metadata_sha256(metadata) == ref["tokenizer_metadata_sha256"], (
        "the tokenizer metadata differs from the file the reference ids were recorded from; "
        "re-record with scripts/record_llamacpp_token_ids.py"
    )


def test_corpus_covers_every_recorded_case(subject):
    _, _, ref = subject
    corpus = load_corpus()
    expected = len(corpus["texts"]) + len(corpus["also_without_special_parsing"]) + len(corpus["also_without_bos"])
    assert len(ref["cases"]) == expected, "corpus and reference are out of sync; re-record"


def test_token_ids_match_llamacpp(subject):
    tok, _, ref = subject
    wrong = [
        (c["text"], c["add_bos"], c["special"], c["ids"], _ours(tok, c))
        for c in ref["cases"]
        if _ours(tok, c) != c["ids"]
    ]
    assert not wrong, f"{len(wrong)} of {len(ref['cases'])} cases differ from llama.cpp; first: " + "\n".join(
        f"{t!r} add_bos={b} special={s}\n  llama.cpp {want}\n  ours      {got}" for t, b, s, want, got in wrong[:5]
    )


def test_special_ids_match_llamacpp_and_metadata(subject):
    tok, metadata, ref = subject
    vocab = ref["vocab"]
    assert tok.vocab_size == vocab["n_tokens"] == len(metadata["tokenizer.ggml.tokens"])
    assert tok.bos_id == vocab["bos_id"] == metadata["tokenizer.ggml.bos_token_id"]
    assert tok.eos_id == vocab["eos_id"] == metadata["tokenizer.ggml.eos_token_id"]
    assert tok.add_bos == vocab["add_bos"]
    assert tok.eos_ids == frozenset(vocab["eog_ids"])
    assert tok.eos_id in tok.eos_ids
    assert {i for i in range(tok.vocab_size) if tok.is_special(i)} == set(vocab["control_ids"])


def test_add_bos_follows_metadata_and_llamacpp_default(subject):
    tok, metadata, ref = subject
    # Real files say it; the synthetic ones leave it to llama.cpp's per-pre default.
    expected = metadata.get("tokenizer.ggml.add_bos_token", tok.pre in ("llama-bpe",))
    assert tok.add_bos == bool(expected) == ref["vocab"]["add_bos"]
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id
    assert tok.encode("", add_bos=True) == [tok.bos_id]
    assert tok.encode("", add_bos=False) == []
    assert tok.eos_id not in tok.encode("hi")  # never EOS


# -- decoding ---------------------------------------------------------------------------


def test_decode_roundtrips_corpus(subject):
    tok, _, ref = subject
    for text in load_corpus()["texts"]:
        for parse_special in (True, False):
            assert tok.decode(tok.encode(text, add_bos=False, parse_special=parse_special)) == text


def test_decode_matches_llamacpp_detokenize(subject):
    tok, _, ref = subject
    for case in ref["cases"]:
        ours = tok.decode(case["ids"])
        if ours == case["detokenized"]:
            continue
        # The one intended difference: for gpt-2/llama-bpe/default vocabularies llama.cpp
        # "cleans up" spaces (" ." -> ".", " 's" -> "'s"), which loses text. Ours stays exact.
        assert tok.rule.group in ("GPT2", "DEFAULT", "LLAMA3"), case["text"]
        n_bos = 1 if case["add_bos"] and tok.add_bos else 0
        assert ours == tok.decode(case["ids"][:n_bos]) + case["text"]


def test_skip_special_tokens(subject):
    tok, _, _ = subject
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_bos=False)
    if tok.token_to_id("<|im_start|>") is None:
        pytest.skip("no ChatML tokens in this vocabulary")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def _stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> list[str]:
    d = StreamingDetokenizer(tok, skip_special_tokens=skip)
    return [d.push(i) for i in ids] + [d.flush()]


def test_streaming_detokenizer_on_corpus(subject):
    tok, _, ref = subject
    for case in ref["cases"]:
        for skip in (False, True):
            pieces = _stream(tok, case["ids"], skip)
            assert "".join(pieces) == tok.decode(case["ids"], skip_special_tokens=skip), case["text"]
            assert not any("\ufffd" in p for p in pieces), case["text"]


def test_streaming_detokenizer_on_random_ids(subject):
    tok, _, _ = subject
    rng = random.Random(1234)
    # Tokens that are not valid UTF-8 on their own (pieces of multi-byte characters)
    # are what streaming must hold back; mix them with ordinary tokens.
    sample = rng.sample(range(tok.vocab_size), 4000)
    partial = [i for i in sample if not _valid(tok.token_bytes(i))]
    assert partial, "expected byte-level tokens that split UTF-8 characters"
    valid_seqs = 0
    for _ in range(3000):
        ids = [rng.choice(partial) if rng.random() < 0.6 else rng.choice(sample) for _ in range(rng.randint(1, 10))]
        pieces = _stream(tok, ids)
        # Concatenation holds for any ids, invalid UTF-8 included (both replace with U+FFFD).
        assert "".join(pieces) == tok.decode(ids)
        if _valid(b"".join(tok.token_bytes(i) for i in ids)):
            valid_seqs += 1
            assert not any("\ufffd" in p for p in pieces), ids
    assert valid_seqs >= 50


def _valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_streaming_holds_back_a_split_emoji(smollm2_gguf):
    tok = Tokenizer.from_gguf(smollm2_gguf)
    ids = tok.encode("🦀", add_bos=False)
    assert len(ids) > 1, "the crab emoji should span several tokens"
    pieces = _stream(tok, ids)
    assert pieces[-2:] == ["🦀", ""] and not any(pieces[:-2])


# -- chat templates ---------------------------------------------------------------------

CONVERSATION = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]


def test_chat_template_smollm2(smollm2_gguf):
    tok = Tokenizer.from_gguf(smollm2_gguf)
    # SmolLM2-Instruct's published ChatML template, with its default system prompt.
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
    )
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(CONVERSATION[:1]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_qwen(subject_by_name):
    tok = subject_by_name("qwen2.5-coder-0.5b")[0]
    # Qwen2.5's published template: ChatML with Qwen's default system prompt.
    expected = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(CONVERSATION) == expected
    system = [{"role": "system", "content": "Be terse."}, CONVERSATION[0]]
    assert tok.apply_chat_template(system) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    # tojson must not HTML-escape: tool schemas reach the model verbatim.
    tool = {"type": "function", "function": {"name": "lt", "description": "a < b & c"}}
    rendered = tok.apply_chat_template(CONVERSATION[:1], tools=[tool])
    assert '{"type": "function", "function": {"name": "lt", "description": "a < b & c"}}' in rendered


def test_chat_template_errors_become_tokenizer_errors():
    with pytest.raises(TokenizerError, match="only user and assistant roles"):
        ChatTemplate("{{ raise_exception('only user and assistant roles are supported') }}").render([])
    with pytest.raises(TokenizerError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(TokenizerError):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"content": "x"}])


def test_chat_template_is_sandboxed():
    with pytest.raises(TokenizerError) as info:
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([])
    assert isinstance(info.value.__cause__, jinja2.sandbox.SecurityError)
    # Immutable: a template cannot modify the caller's messages.
    with pytest.raises(TokenizerError):
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_missing_chat_template_is_an_error(tmp_path):
    tok = Tokenizer.from_gguf(_tiny_gguf(tmp_path))
    with pytest.raises(TokenizerError, match="no chat template.*prompt"):
        tok.apply_chat_template(CONVERSATION)


def test_template_from_file_raising(tmp_path):
    tok = Tokenizer.from_gguf(_tiny_gguf(tmp_path, chat_template="{{ raise_exception('system role not allowed') }}"))
    with pytest.raises(TokenizerError, match="system role not allowed"):
        tok.apply_chat_template(CONVERSATION)


# -- unsupported vocabularies -----------------------------------------------------------


def test_unknown_pre_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="'no-such-pre'.*qwen2"):
        Tokenizer.from_gguf(_tiny_gguf(tmp_path, pre="no-such-pre"))


def test_non_bpe_tokenizer_model(tmp_path):
    with pytest.raises(TokenizerError, match="'llama'"):
        Tokenizer.from_gguf(_tiny_gguf(tmp_path, model="llama"))


def test_missing_pre_uses_llamacpp_default(tmp_path):
    tok = Tokenizer.from_gguf(_tiny_gguf(tmp_path, pre=None))
    assert tok.rule.group == "DEFAULT"
    assert tok.decode(tok.encode("a b")) == "a b"


def test_qwen_opens_without_per_token_python_calls(qwen05_path):
    """Opening a 151k-token vocabulary must not call a Python function per token (that
    made it take seconds). Counted with cProfile rather than timed, so it holds on any
    machine; built-in calls (bytes.decode over the array) are allowed."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    tok = Tokenizer.from_gguf(GGUFFile(qwen05_path))
    profile.disable()
    vocab = tok.vocab_size
    python_calls = {
        f"{file}:{line}({name})": stats[1]
        for (file, line, name), stats in pstats.Stats(profile).stats.items()
        if file != "~" and not file.startswith("<")
    }
    busiest = max(python_calls, key=python_calls.get)
    assert vocab > 150_000 and python_calls[busiest] < vocab // 20, (busiest, python_calls[busiest], vocab)


def _tiny_gguf(tmp_path, *, model: str = "gpt2", pre: str | None = "gpt-2", chat_template: str | None = None):
    return write_byte_vocab_gguf(
        tmp_path / f"tiny-{model}-{pre}.gguf", model=model, pre=pre, chat_template=chat_template
    )
