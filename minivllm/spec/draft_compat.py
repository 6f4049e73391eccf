"""Can this model draft for that one? Refused at load, with the first difference named.

Verification compares the draft's and the target's distributions id by id, so both must
map every token text to the same id. The model files may still differ in padding rows:
Qwen2.5's embedding matrices are rounded up past the tokenizer (151,936 rows for the 0.5B
and 1.5B, 152,064 for the 7B), and those rows are never real tokens. Distributions are
therefore compared over the tokenizer's ids only.
"""

from __future__ import annotations

from minivllm.errors import ConfigError


def shared_vocab_size(target_tokenizer, draft_tokenizer, target_config, draft_config, *, draft_name: str) -> int:
    """The number of token ids both models score identically named; raises ConfigError
    naming the first mismatch."""
    t_tok, d_tok = target_tokenizer, draft_tokenizer
    n = t_tok.vocab_size
    fix = "use a draft model from the target's family (same tokenizer), e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b"
    if d_tok.vocab_size != n:
        raise ConfigError("draft_model", draft_name,
                          f"its tokenizer has {d_tok.vocab_size} tokens and the target's has {n}; {fix}")
    for i in range(n):
        a, b = t_tok.id_to_token(i), d_tok.id_to_token(i)
        if a != b:
            raise ConfigError("draft_model", draft_name,
                              f"token id {i} is {b!r} in the draft's tokenizer but {a!r} in the target's; {fix}")
    if set(d_tok.eos_ids) != set(t_tok.eos_ids):
        raise ConfigError("draft_model", draft_name,
                          f"its end-of-generation ids {sorted(d_tok.eos_ids)} differ from the target's "
                          f"{sorted(t_tok.eos_ids)}; {fix}")
    for which, cfg in (("target", target_config), ("draft", draft_config)):
        if cfg.vocab_size < n:
            raise ConfigError("draft_model", draft_name,
                              f"the {which} model scores {cfg.vocab_size} ids but its tokenizer has {n}; the file is "
                              f"inconsistent")
    return n
