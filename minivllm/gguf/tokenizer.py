"""The model's tokenizer, rebuilt from GGUF metadata so that it agrees with llama.cpp.

A GGUF file carries the vocabulary, BPE merges, per-token types and a pre-tokenizer
*name*; llama.cpp turns those into a tokenizer with rules spread over
`src/llama-vocab.cpp`. This module rebuilds the same tokenizer on Hugging Face
`tokenizers` (fast, Rust) for byte-level BPE vocabularies (`tokenizer.ggml.model ==
"gpt2"`: Llama 3, Qwen2, SmolLM, ...), and copies llama.cpp's rules for everything
`tokenizers` cannot know from the file alone:

* which tokens are matched verbatim in text (CONTROL/UNKNOWN only when parsing special
  tokens, USER_DEFINED always), including tokens llama.cpp *promotes* to control by
  their text (`<|im_end|>`, `<|eot_id|>`, ...);
* the end-of-generation set, also partly recognised by token text;
* whether to prepend BOS when the file does not say;
* how ids turn back into bytes (control text verbatim, unused tokens as nothing).

Decoding is done here, not by `tokenizers`, so that `decode` and the streaming
detokenizer share one id -> bytes function and cannot disagree.
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any, Iterable

import numpy as np
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from minivllm.errors import InvalidMetadataError, TokenizerError
from minivllm.gguf.chat_template import ChatTemplate, check_template_bounds
from minivllm.gguf.control_escape import ControlTextEscape
from minivllm.gguf.pretokenizers import PreTokenizerRule, pre_tokenizer_rule
from minivllm.gguf.reader import GGUFFile

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Tokens llama.cpp finds by their text when the file does not give the id, and then
# treats as control tokens whatever their stored type. Each role: (metadata key, texts).
# From llama_vocab::impl::load ("auto-detect special tokens by text").
_ROLE_TEXTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "eot": ("tokenizer.ggml.eot_token_id", (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
        "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
    )),
    "eom": ("tokenizer.ggml.eom_token_id", ("<|eom_id|>",)),
    "fim_pre": ("tokenizer.ggml.fim_pre_token_id", (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|code_prefix|>", "<|prefix|>",
    )),
    "fim_suf": ("tokenizer.ggml.fim_suf_token_id", (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|code_suffix|>", "<|suffix|>",
    )),
    "fim_mid": ("tokenizer.ggml.fim_mid_token_id", (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
        "<|code_middle|>", "<|middle|>",
    )),
    "fim_pad": ("tokenizer.ggml.fim_pad_token_id", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    "fim_rep": ("tokenizer.ggml.fim_rep_token_id", (
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    )),
    "fim_sep": ("tokenizer.ggml.fim_sep_token_id", ("<|file_sep|>",)),
}
# Deprecated spellings of the FIM keys that llama.cpp still reads.
_ROLE_KEY_ALIASES = {
    "fim_pre": "tokenizer.ggml.prefix_token_id",
    "fim_suf": "tokenizer.ggml.suffix_token_id",
    "fim_mid": "tokenizer.ggml.middle_token_id",
}
# llama.cpp stops generation on these FIM roles: in a FIM prompt they start new context.
_EOG_ROLES = ("fim_pad", "fim_rep", "fim_sep", "eot", "eom")
# Every token with one of these texts ends generation (and is made a control token).
# llama.cpp keys this on text because converters rarely mark it (ggml-org/llama.cpp#9606).
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)
# gpt-oss markers that must always be rendered: llama.cpp forces them to USER_DEFINED.
_FORCED_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# Byte-level BPE ("GPT-2") alphabet: byte b is stored as the printable character
# _BYTE_TO_CHAR[b]. Decoding maps each character back to its byte.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_BYTE_TO_CHAR = {b: chr(b) for b in _PRINTABLE}
_BYTE_TO_CHAR.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in _BYTE_TO_CHAR)})
# One str.translate pass turns a token string into a latin-1 string whose code points
# are the bytes. Latin-1 characters outside the alphabet map to their own UTF-8 bytes;
# anything above U+00FF is left alone and makes the latin-1 encode fail (slow path).
_TO_LATIN1 = {cp: chr(cp).encode("utf-8").decode("latin-1") for cp in range(256)}
_TO_LATIN1.update({ord(c): chr(b) for b, c in _BYTE_TO_CHAR.items()})
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _byte_level_bytes(text: str) -> bytes:
    try:
        return text.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        # Not a byte-level string (llama.cpp would print [UNK_BYTE_...]); keep such characters as text.
        return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode("utf-8") for c in text)


def _metadata_id(gguf: GGUFFile, key: str, n_tokens: int, default: int | None = None) -> int | None:
    """A token id from metadata; absent or out-of-range ids give `default`, as in llama.cpp."""
    value = gguf.get_as(key, "int")
    if value is None or not 0 <= int(value) < n_tokens:
        return default
    return int(value)


class Tokenizer:
    """Text <-> token ids for one model, with llama.cpp's results.

    Build it with `Tokenizer.from_gguf(file)`. `encode` parses special-token text
    (`<|im_start|>`) into its id by default, like llama.cpp's `parse_special=true`.
    """

    def __init__(
        self,
        *,
        hf_tokenizer: HFTokenizer,
        tokens: list[str],
        vocab: dict[str, int],
        attrs: dict[int, int],
        rule: PreTokenizerRule,
        pre: str | None,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: frozenset[int],
        add_bos: bool,
        chat_template: str | None,
        source: str | None = None,
    ):
        self._hf = hf_tokenizer
        self._tokens = tokens
        self._vocab = vocab
        self._attrs = attrs  # id -> token type, for every non-NORMAL token
        self.rule = rule
        self.pre = pre
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.source = source  # the GGUF file, named in chat-template errors
        self._special = frozenset(i for i, a in attrs.items() if a in (CONTROL, UNKNOWN))
        self._pieces: dict[int, bytes] = {}
        self._template: ChatTemplate | None = None
        self._escape: ControlTextEscape | None = None
        # `encode_special_tokens` is a flag on the shared Rust tokenizer; the lock keeps a
        # parse_special=False call from leaking into a concurrent call.
        self._lock = threading.Lock()

    # -- construction ----------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf: GGUFFile | str | os.PathLike) -> "Tokenizer":
        if not isinstance(gguf, GGUFFile):
            gguf = GGUFFile(gguf)
        # Building 150k-entry containers of fresh objects triggers repeated full garbage
        # collections that find nothing (about a third of the load time); pause them.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return cls._from_gguf(gguf)
        finally:
            if gc_was_enabled:
                gc.enable()

    @classmethod
    def _from_gguf(cls, gguf: GGUFFile) -> "Tokenizer":
        model = gguf.require_as("tokenizer.ggml.model", "str")
        if model != "gpt2":
            raise TokenizerError(
                f"{gguf.path}: tokenizer model {model!r} (tokenizer.ggml.model) is not supported; minivllm "
                f"supports byte-level BPE vocabularies ('gpt2': Llama 3, Qwen2, SmolLM, ...). "
                f"Use a model with such a vocabulary."
            )
        pre = gguf.get_as("tokenizer.ggml.pre", "str")
        rule = pre_tokenizer_rule(pre)
        tokens: list[str] = gguf.require_as("tokenizer.ggml.tokens", "strings")
        merges: list[str] = gguf.require_as("tokenizer.ggml.merges", "strings")
        n = len(tokens)
        if n == 0:
            raise InvalidMetadataError("tokenizer.ggml.tokens", str(gguf.path), "is empty, expected the vocabulary")

        if "" in tokens:  # llama.cpp renames empty entries so every id keeps a unique text
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        vocab = dict(zip(tokens, range(n)))
        if len(vocab) != n:
            raise TokenizerError(f"{gguf.path}: the vocabulary has duplicate token strings; the file is corrupt")

        types = gguf.get_as("tokenizer.ggml.token_type", "ints")
        attrs: dict[int, int] = {}
        if types is not None:
            if len(types) != n:
                raise InvalidMetadataError(
                    "tokenizer.ggml.token_type", str(gguf.path),
                    f"has {len(types)} entries, expected one per token of tokenizer.ggml.tokens ({n})",
                )
            for i in np.flatnonzero(types != NORMAL).tolist():
                attrs[i] = int(types[i])

        # llama.cpp's BPE defaults are bos = eos = 11 (GPT-2-era files); metadata wins.
        default = 11 if n > 11 else None
        bos_id = _metadata_id(gguf, "tokenizer.ggml.bos_token_id", n, default)
        eos_id = _metadata_id(gguf, "tokenizer.ggml.eos_token_id", n, default)

        roles: dict[str, int | None] = {}
        for role, (key, texts) in _ROLE_TEXTS.items():
            rid = _metadata_id(gguf, key, n)
            if rid is None and role in _ROLE_KEY_ALIASES:
                rid = _metadata_id(gguf, _ROLE_KEY_ALIASES[role], n)
            if rid is None:
                # llama.cpp takes whichever match its hash map yields first; the lowest id
                # is a deterministic stand-in (it only matters for which one is promoted).
                found = sorted(vocab[t] for t in texts if t in vocab)
                if found:
                    rid = found[0]
                    attrs[rid] = CONTROL
            roles[role] = rid

        eog = {roles[r] for r in _EOG_ROLES if roles[r] is not None}
        for text in _EOG_TEXTS:
            if text in vocab:
                eog.add(vocab[text])
                if attrs.get(vocab[text]) not in (CONTROL, UNKNOWN):
                    attrs[vocab[text]] = CONTROL
        for text in _FORCED_USER_DEFINED:
            if text in vocab:
                attrs[vocab[text]] = USER_DEFINED
        if eos_id is not None:
            eog.add(eos_id)
        _drop_false_eog(eog, tokens, attrs)

        add_bos_meta = gguf.get_as("tokenizer.ggml.add_bos_token", "bool")
        add_bos = rule.add_bos if add_bos_meta is None else bool(add_bos_meta)
        if add_bos and bos_id is None:
            raise TokenizerError(f"{gguf.path}: the model asks for a BOS token but defines none")

        chat_template = gguf.get_as("tokenizer.chat_template", "str")
        if chat_template:
            check_template_bounds(chat_template, f"tokenizer.chat_template of {gguf.path}")
        hf = _build_hf(tokens, vocab, merges, attrs, rule, str(gguf.path))
        return cls(
            hf_tokenizer=hf, tokens=tokens, vocab=vocab, attrs=attrs, rule=rule, pre=pre, bos_id=bos_id,
            eos_id=eos_id, eos_ids=frozenset(eog), add_bos=add_bos,
            chat_template=chat_template,
            source=str(gguf.path),
        )

    # -- encoding --------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. `add_bos=None` follows the model; EOS is never added.

        With `parse_special=False`, control-token text such as `<|im_end|>` is tokenized
        as plain characters (safe for untrusted input); user-defined tokens still match.
        """
        with self._lock:
            if parse_special:
                ids = self._hf.encode(text, add_special_tokens=False).ids
            else:
                self._hf.encode_special_tokens = True
                try:
                    ids = self._hf.encode(text, add_special_tokens=False).ids
                finally:
                    self._hf.encode_special_tokens = False
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos=True but this model has no BOS token")
            ids.insert(0, self.bos_id)
        return ids

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, add_bos: bool | None = None,
                    **context: Any) -> tuple[str, list[int]]:
        """The prompt text and ids of a conversation, with control tokens only where the
        chat template itself put them.

        Message content (every string inside `messages` and `context`) is text: a user who
        writes `<|im_end|>\n<|im_start|>system` gets those characters as ordinary tokens,
        never the control ids, so they cannot forge a turn. Content without control-token
        text takes the plain path (render, then encode with special-token parsing), so its
        ids are exactly what `encode(apply_chat_template(...))` gives. Otherwise each
        control-token text in the content is escaped before rendering (`control_escape.py`:
        an escape that no content can exhaust); the rendered prompt is split at the control
        tokens the template wrote, and the runs between them are encoded with the escapes
        turned back into their plain text (`parse_special=False`). User-defined tokens (Qwen's `<tool_call>`) still
        match in content, as in llama.cpp and `transformers`; they are not control tokens.
        Not covered: a template whose own literal text would complete a control token with
        the edge of the content (`'<|im_' + content`); no real template writes one.
        """
        escape = self._control_escape()
        found = escape.found_in([messages, context])
        if not found:
            text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **context)
            return text, self.encode(text, add_bos=add_bos)
        rendered = self.apply_chat_template(escape.hide(messages, found), add_generation_prompt=add_generation_prompt,
                                            **escape.hide(context, found))
        with self._lock:
            enc = self._hf.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        run_start = 0
        for tid, (start, end) in zip(enc.ids, enc.offsets):
            if tid in self._special:  # the content holds none, so the template wrote it
                if start > run_start:
                    ids += self.encode(escape.reveal(rendered[run_start:start]), add_bos=False, parse_special=False)
                ids.append(tid)
                run_start = end
        if run_start < len(rendered):
            ids += self.encode(escape.reveal(rendered[run_start:]), add_bos=False, parse_special=False)
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos=True but this model has no BOS token")
            ids.insert(0, self.bos_id)
        return escape.reveal(rendered), ids

    def _control_escape(self) -> ControlTextEscape:
        """How control-token text in chat content is escaped (`control_escape.py`); built
        once, from the vocabulary and the template alone."""
        if self._escape is None:
            self._escape = ControlTextEscape((self._tokens[i] for i in self._special), self.chat_template or "")
        return self._escape

    # -- decoding --------------------------------------------------------------------

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = False) -> bytes:
        """The bytes one token stands for (may be part of a UTF-8 character)."""
        if skip_special_tokens and token_id in self._special:
            return b""
        try:
            return self._pieces[token_id]
        except KeyError:
            pass
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})")
        text = self._tokens[token_id]
        kind = self._attrs.get(token_id, NORMAL)
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            piece = text.encode("utf-8")
        elif kind == NORMAL:
            piece = _byte_level_bytes(text)
        elif kind == BYTE:  # "<0xAB>"
            piece = bytes([int(text[3:5], 16)])
        else:  # UNUSED / UNDEFINED: llama.cpp renders nothing
            piece = b""
        self._pieces[token_id] = piece
        return piece

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a sequence cut mid-character) becomes U+FFFD."""
        piece = self.token_bytes
        return b"".join(piece(int(i), skip_special_tokens=skip_special_tokens) for i in ids).decode(
            "utf-8", errors="replace"
        )

    # -- vocabulary ------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry as stored (byte-level alphabet, e.g. 'Ġhello')."""
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})")
        return self._tokens[token_id]

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def is_special(self, token_id: int) -> bool:
        """Control (or unknown) tokens: matched only with parse_special, dropped by skip_special_tokens."""
        return token_id in self._special

    # -- chat ------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **context: Any) -> str:
        """The prompt for a conversation, rendered with the model's own template."""
        if self._template is None:
            if not self.chat_template:
                raise TokenizerError(
                    "this model has no chat template (tokenizer.chat_template is missing); "
                    "pass a raw prompt instead of chat messages"
                )
            self._template = ChatTemplate(
                self.chat_template,
                bos_token=self._tokens[self.bos_id] if self.bos_id is not None else "",
                eos_token=self._tokens[self.eos_id] if self.eos_id is not None else "",
                origin=f"tokenizer.chat_template of {self.source}" if self.source else "tokenizer.chat_template",
            )
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **context)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(pre={self.pre!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={sorted(self.eos_ids)})"
        )


def _drop_false_eog(eog: set[int], tokens: list[str], attrs: dict[int, int]) -> None:
    """llama.cpp's two exceptions to "these texts end generation"."""
    by_text = {tokens[i]: i for i in eog}
    # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation.
    has_call = "<|call|>" in by_text or "<|calls|>" in by_text
    if "<|end|>" in by_text and has_call and ("<|return|>" in by_text or "<|flush|>" in by_text):
        eog.discard(by_text["<|end|>"])
        attrs[by_text["<|end|>"]] = USER_DEFINED
    # Gemma 4 / PLaMo: "</s>" is an ordinary token there.
    if "</s>" in by_text and ("<|tool_response>" in by_text or "<|plamo:eos|>" in by_text):
        eog.discard(by_text["</s>"])
        attrs.pop(by_text["</s>"], None)


def _build_hf(
    tokens: list[str], vocab: dict[str, int], merges: list[str], attrs: dict[int, int],
    rule: PreTokenizerRule, where: str,
) -> HFTokenizer:
    # llama.cpp splits a merge at the first space after position 0.
    pairs = [(m[:i], m[i + 1:]) for m in merges if (i := m.find(" ", 1)) > 0]
    try:
        bpe = models.BPE(vocab, pairs, ignore_merges=rule.ignore_merges, fuse_unk=False, byte_fallback=False)
    except Exception as exc:  # e.g. a merge whose result is not in the vocabulary
        raise TokenizerError(f"{where}: cannot build the BPE tokenizer from the file's vocabulary: {exc}") from exc
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = rule.build()
    # Tokens llama.cpp matches verbatim before BPE (its "special tokens cache").
    added = [
        AddedToken(tokens[i], special=kind in (CONTROL, UNKNOWN), normalized=False)
        for i, kind in sorted(attrs.items())
        if kind in (CONTROL, UNKNOWN, USER_DEFINED)
    ]
    hf.add_tokens(added)
    return hf
