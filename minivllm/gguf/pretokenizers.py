"""Pre-tokenizer rules per `tokenizer.ggml.pre`, transcribed from llama.cpp.

A byte-level BPE vocabulary only reproduces its model's token ids if the text is cut
into words exactly the way the model's own tokenizer did before merging. GGUF files do
not store that regex; they store a name (`tokenizer.ggml.pre`), and llama.cpp maps the
name to a list of regexes in `llm_tokenizer_bpe` (src/llama-vocab.cpp). The names,
groups and regexes below are copied from there (llama.cpp 0c1e570, vendored by
llama-cpp-python 0.3.36), including llama.cpp's case-insensitive-free rewrite of
`(?i:'s|...)` as `'[sS]|...`: Oniguruma's `(?i)` also folds characters such as
U+017F (long s) that llama.cpp's rewrite does not, and llama.cpp is the reference.

Each regex list becomes a `Sequence` of isolating `Split`s, which is what llama.cpp's
`unicode_regex_split` does: every regex further splits the words produced by the
previous one, and text between matches stays a word of its own. The final `ByteLevel`
only maps bytes to the GPT-2 printable alphabet; its own GPT-2 regex is off.

llama.cpp also ties two behaviours to the pre-tokenizer name, so they live here too:
`ignore_merges` (a whole word that is itself a vocabulary entry is emitted without
running merges; Llama 3 relies on it) and the default of `add_bos` when the file has no
`tokenizer.ggml.add_bos_token`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

from minivllm.errors import TokenizerError

# The GPT-2 word regex. llama.cpp's string has no final `|\s+`; its hand-written matcher
# (unicode_regex_split_custom_gpt2) nevertheless emits a lone whitespace run as a word,
# which an isolating Split does too (unmatched text becomes its own piece).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Same as Llama 3 except that digits are split one by one (\p{N} instead of \p{N}{1,3}).
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerRule:
    """What llama.cpp does for one group of `tokenizer.ggml.pre` names."""

    group: str  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_* name, for messages
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # used only when the file lacks tokenizer.ggml.add_bos_token

    def build(self) -> pre_tokenizers.PreTokenizer:
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self.regexes]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        return pre_tokenizers.Sequence(steps)


# llama.cpp's `default:` branch, used for "default" and for files with no pre name at all.
DEFAULT = PreTokenizerRule(
    "DEFAULT",
    (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
)
LLAMA3 = PreTokenizerRule("LLAMA3", (_LLAMA3,), ignore_merges=True, add_bos=True)
QWEN2 = PreTokenizerRule("QWEN2", (_QWEN2,))
# StarCoder-family vocabularies (SmolLM among them) isolate every digit first.
STARCODER = PreTokenizerRule("STARCODER", (r"\p{N}", _GPT2))
GPT2 = PreTokenizerRule("GPT2", (_GPT2,))
# DBRX and Smaug use the Llama 3 regex but neither ignore_merges nor a default BOS.
LLAMA3_REGEX_ONLY = PreTokenizerRule("DBRX", (_LLAMA3,))

# `tokenizer.ggml.pre` value -> rule, in the order llama.cpp's `impl::load` tests them.
# Only groups whose regexes Oniguruma reproduces and that need no other special
# handling are listed; anything else must fail loudly rather than mis-tokenize.
PRE_TOKENIZERS: dict[str, PreTokenizerRule] = {
    "default": DEFAULT,
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
        LLAMA3,
    ),
    "mpt": GPT2,
    "starcoder": STARCODER,
    **dict.fromkeys(
        [
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
        ],
        GPT2,
    ),
    "refact": STARCODER,
    "command-r": STARCODER,
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"], QWEN2),
    "stablelm2": QWEN2,
    "olmo": GPT2,
    "dbrx": LLAMA3_REGEX_ONLY,
    "smaug-bpe": LLAMA3_REGEX_ONLY,
    "jais": GPT2,
    "smollm": STARCODER,
    "codeshell": STARCODER,
    "exaone": STARCODER,
    "exaone4": GPT2,
    "minerva-7b": STARCODER,
    "megrez": QWEN2,
    "trillion": GPT2,
    "granite-docling": GPT2,
    "hunyuan": QWEN2,
    "solar-open": QWEN2,
    "mellum2": STARCODER,
}


def pre_tokenizer_rule(pre: str | None) -> PreTokenizerRule:
    """The rule for a `tokenizer.ggml.pre` value; `None` (key absent) is llama.cpp's default."""
    if pre is None or pre == "":
        return DEFAULT
    try:
        return PRE_TOKENIZERS[pre]
    except KeyError:
        raise TokenizerError(
            f"unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre); minivllm supports: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}. Use a model whose vocabulary uses one of them."
        ) from None
