"""Control-token text in chat content, escaped out of the way of the template's own.

`Tokenizer.encode_chat` renders the chat template over content in which every
control-token text (`<|im_end|>`, ...) has been replaced by an escape sequence, so that
the control tokens found in the rendered prompt are exactly those the template wrote;
the runs of text between them are then turned back (`reveal`) and encoded as plain text.

The escape is one character E plus one code character:

    E E        stands for a literal E in the content
    E C(t)     stands for the control-token text t

E is chosen once per tokenizer, from the private-use planes first, among characters that
occur neither in the chat template nor in any control-token text; each control-token
text gets its own code character C(t), none of them inside a control-token text either.
Neither choice depends on the content, so no content can exhaust them (an earlier
design picked one unused private-use character per text from the content's complement:
content holding every private-use code point left none, and the request never ended).
Since E and the codes are in no control-token text, escaped content holds none, however
its pieces and the escapes sit side by side; and since E is not in the template, every E
in the rendered prompt came from content.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

from minivllm.errors import TokenizerError

SURROGATES = range(0xD800, 0xE000)


def code_points() -> Iterator[str]:
    """Every character, the private-use ones first (planes 15 and 16, then the BMP's)."""
    preferred = (range(0xF0000, 0x110000), range(0xE000, 0xF900))
    for block in preferred:
        yield from map(chr, block)
    for c in range(0x110000):
        if c not in SURROGATES and not any(c in block for block in preferred):
            yield chr(c)


class ControlTextEscape:
    def __init__(self, control_texts: Iterable[str], template: str):
        self.texts = sorted(set(control_texts), key=len, reverse=True)  # longest first: `<|a|>` in `<|a|>b|>`
        in_texts = set("".join(self.texts))
        candidates = (c for c in code_points() if c not in in_texts)
        self.escape = next((c for c in candidates if c not in template), None)
        codes = dict(zip(self.texts, candidates))
        if self.escape is None or len(codes) < len(self.texts):  # a vocabulary of over a million control texts
            raise TokenizerError(f"cannot escape {len(self.texts)} control-token texts in chat content: too few "
                                 "characters are left outside them and the chat template")
        self.codes = codes
        self.table = {self.escape: self.escape, **{code: text for text, code in codes.items()}}
        self.pattern = re.compile(re.escape(self.escape) + "(.?)", re.DOTALL)

    def found_in(self, value: Any) -> list[str]:
        """The control-token texts that occur in the strings of `value` (a conversation,
        tool schemas), longest first; empty when the content needs no escaping."""
        strings = list(strings_in(value))
        return [t for t in self.texts if any(t in s for s in strings)]

    def hide(self, value: Any, found: list[str]) -> Any:
        """A copy of `value` with E doubled and each text of `found` replaced by its escape."""
        if isinstance(value, str):
            value = value.replace(self.escape, self.escape * 2)
            for text in found:
                value = value.replace(text, self.escape + self.codes[text])
            return value
        if isinstance(value, dict):
            return {self.hide(k, found): self.hide(v, found) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.hide(v, found) for v in value)
        return value

    def reveal(self, text: str) -> str:
        """Rendered text with every escape turned back into what it stands for (an E the
        template cut from its code, by slicing content, is left as it is)."""
        return self.pattern.sub(lambda m: self.table.get(m.group(1), m.group(0)), text)


def strings_in(value: Any) -> Iterator[str]:
    """Every string inside nested dicts, lists and tuples."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings_in(k)
            yield from strings_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from strings_in(v)
