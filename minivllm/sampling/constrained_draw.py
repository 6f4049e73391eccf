"""Drawing a constrained row's token, with its mask computed only when it can change the draw.

A mask inside a length-bounded JSON string costs llguidance a walk of most of the token
trie (~1.5 ms on Qwen2.5's 152k vocabulary; a batch-16 decode step on an H200 takes ~4
ms), and there most tokens are allowed anyway. So a row first takes the tokens it would
draw without the mask and asks the matcher about them (microseconds each,
`TokenConstraint.allows`); the mask is computed only when none of them fits. The token is
the one the masked draw gives, by construction:

- greedy: the candidates are the top logits in descending order, ties by lowest id as
  argmax breaks them. The first allowed one is the masked argmax as long as every token
  at least as likely is among the candidates, so the group tied at the cut-off is left out.
- temperature-only sampling: rejection sampling. Independent draws from the unmasked
  distribution; the first allowed one is distributed exactly as a draw from the masked,
  renormalised distribution, and when none of them is allowed a draw from that masked
  distribution follows, so the mixture is that distribution too. A seed gives the same
  tokens whether or not a mask happened to be ready: the procedure never looks.
- top-k, top-p, min-p: what the filter keeps depends on the mask, so the mask comes first.

Greedy rows whose mask is ready (computed beside the forward) use it directly: same token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.sampling.sampler import apply_penalties, filtered_probs, sample
from minivllm.sampling.sampling_params import SamplingParams

GREEDY_CANDIDATES = 32  # inside a string most of the vocabulary is allowed: the top few suffice
SAMPLED_CANDIDATES = 8


def checks_candidates(p: SamplingParams) -> bool:
    """The draw can be checked token by token and still equal the masked draw."""
    return p.greedy or (not p.top_k and p.top_p >= 1.0 and p.min_p == 0.0)


def mask_always_read(p: SamplingParams) -> bool:
    """The row reads its masked logits whatever it draws: filters, or logprobs (which
    report the distribution the token was drawn from)."""
    return p.logprobs is not None or not checks_candidates(p)


def _candidates(req, row_logits: torch.Tensor) -> list[int]:
    """The tokens the unmasked draw would take, in the order it would prefer them."""
    p = req.params
    logits = apply_penalties(row_logits.clone(), req.all_ids, req.output_ids, p)
    if not p.greedy:
        probs = filtered_probs(logits, p)
        return torch.multinomial(probs, SAMPLED_CANDIDATES, replacement=True, generator=req.generator).tolist()
    n = min(GREEDY_CANDIDATES, logits.shape[-1])
    values, ids = torch.topk(logits, n)
    ranked = sorted(zip(values.tolist(), ids.tolist()), key=lambda vi: (-vi[0], vi[1]))
    if n < logits.shape[-1]:
        cut = ranked[-1][0]  # tokens outside the top n may tie with it
        ranked = [vi for vi in ranked if vi[0] > cut]
    return [i for _, i in ranked]


def draw_constrained(req, row_logits: torch.Tensor, masked: torch.Tensor | None,
                     mask_now: Callable[[], torch.Tensor], *, want_masked: bool) -> tuple[int, torch.Tensor | None]:
    """(token, the row's masked logits or None if nothing needed them). `masked`: the row
    already masked beside the forward, or None; `mask_now` masks it here (and raises
    Unsatisfiable when no token is left); `want_masked`: the caller reads the masked row."""
    p = req.params
    token = None
    if checks_candidates(p) and not (p.greedy and masked is not None):
        constraint = req.constraint
        if constraint.checks_tokens():
            token = next((t for t in _candidates(req, row_logits) if constraint.allows(t)), None)
    if masked is None and (token is None or want_masked or p.logprobs is not None):
        masked = mask_now()
    if token is None:
        token = sample(masked, req.all_ids, req.output_ids, p, req.generator)
    return token, masked
