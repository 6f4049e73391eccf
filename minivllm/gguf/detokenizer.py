"""Turning a stream of generated token ids into text, one id at a time.

A byte-level BPE token is a run of *bytes*, not characters: an emoji or a CJK
character is often split over two or three tokens. Decoding each token on its own
would print U+FFFD halves. The detokenizer therefore appends each token's bytes and
runs them through an incremental UTF-8 decoder, which emits every completed character
and holds back an unfinished trailing sequence until the next token completes it.
Bytes that can never become valid (a stray continuation byte) are replaced with U+FFFD
right away, exactly as `Tokenizer.decode` replaces them, so the pieces always
concatenate to `tokenizer.decode(all_ids)`.
"""

from __future__ import annotations

import codecs

from minivllm.gguf.tokenizer import Tokenizer


class StreamingDetokenizer:
    """`push(id)` returns the newly completed text; `flush()` returns what is left."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        piece = self.tokenizer.token_bytes(token_id, skip_special_tokens=self.skip_special_tokens)
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end becomes U+FFFD); resets the stream."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
