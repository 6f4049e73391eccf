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

A greedy row first checks its unmasked argmax alone (ties go to the lowest id, as in the
masked argmax, so an allowed argmax is the masked one), and the top candidates only when
that is forbidden. Greedy rows whose mask is ready (computed beside the forward) use it
directly: same token. step_draw.py runs this for a whole step's rows at once.

Before any of this: where the grammar forces text, its mask allows one token (the first of
that text's canonical tokens), so the row's token is known on the host before the forward
ends, and nothing is computed for it (`draws_forced`). In a step whose rows are all forced
the host never waits for the device, and queues the next forward right behind this one.
"""

from __future__ import annotations

import torch

from minivllm.sampling.sampler import adjusts_logits, apply_penalties, filtered_probs
from minivllm.sampling.sampling_params import SamplingParams

GREEDY_CANDIDATES = 32  # inside a string most of the vocabulary is allowed: the top few suffice
SAMPLED_CANDIDATES = 8
# What `TokenConstraint.allows` costs, next to a mask: 2-5 us on Qwen2.5's vocabulary
# against 10-50 us for a mask outside strings and up to 1.5 ms inside a bounded one. A
# greedy row checks only as many candidates as its last mask would have paid for.
CHECK_COST_S = 3e-6


def checks_candidates(p: SamplingParams) -> bool:
    """The draw can be checked token by token and still equal the masked draw."""
    return p.greedy or (not p.top_k and p.top_p >= 1.0 and p.min_p == 0.0)


def mask_always_read(p: SamplingParams) -> bool:
    """The row reads its masked logits whatever it draws: filters, or logprobs (which
    report the distribution the token was drawn from)."""
    return p.logprobs is not None or not checks_candidates(p)


def draws_forced(req, masked_logits_wanted: bool = False) -> bool:
    """The row's token is the one its grammar forces (`TokenConstraint.forced_token`),
    drawn without a mask: the masked draw could give no other, greedy or sampled, whatever
    the penalties and filters. Not for rows that report the masked logits (logprobs, a
    logits hook), which still get them."""
    return (not masked_logits_wanted and req.params.logprobs is None
            and req.constraint.forced_token() is not None)


def penalized(requests, rows: list[torch.Tensor]) -> torch.Tensor:
    """The rows stacked into a new tensor, each with its request's logit_bias and penalties applied."""
    stacked = torch.stack(rows)
    for k, req in enumerate(requests):
        p = req.params
        if adjusts_logits(p):
            apply_penalties(stacked[k], req.all_ids, req.output_ids, p)  # in place, on the copy
    return stacked


def launch_greedy_candidates(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The top logits of each (penalized) row, queued on the device: values descending,
    their ids, and whether that is the whole row. Read with `read_greedy_candidates`."""
    n = min(GREEDY_CANDIDATES, logits.shape[-1])
    values, ids = torch.topk(logits, n, dim=-1)  # sorted=True: values descending
    return values, ids, n == logits.shape[-1]


def read_greedy_candidates(launched, picks: list[int], requests) -> list[list[int]]:
    """The candidates of rows `picks` of a `launch_greedy_candidates` (one device round
    trip for all of them), best first, as many as each request's check may try
    (`greedy_check_limit`)."""
    values, ids, complete = launched
    values, ids = values.tolist(), ids.tolist()
    return [_ranked(values[k], ids[k], complete, greedy_check_limit(req.constraint))
            for k, req in zip(picks, requests)]


def _ranked(values: list[float], ids: list[int], complete: bool, limit: int) -> list[int]:
    """The first `limit` ids in argmax order: descending value, ties by lowest id (top-k
    orders ties as it likes). Tokens outside the top n may tie with its last value, so
    that group is left out unless the top n is the whole row."""
    cut = None if complete else values[-1]
    out: list[int] = []
    k = 0
    while k < len(values) and len(out) < limit and (cut is None or values[k] > cut):
        j = k + 1
        while j < len(values) and values[j] == values[k]:
            j += 1
        out += sorted(ids[k:j])
        k = j
    return out[:limit]


def sampled_candidates(req, row_logits: torch.Tensor) -> list[int]:
    """Independent draws from the row's unmasked distribution (its own generator)."""
    logits = apply_penalties(row_logits.clone(), req.all_ids, req.output_ids, req.params)
    probs = filtered_probs(logits, req.params)
    return torch.multinomial(probs, SAMPLED_CANDIDATES, replacement=True, generator=req.generator).tolist()


def greedy_check_limit(constraint) -> int:
    """How many of a greedy row's candidates to check before computing its mask instead:
    any prefix of them gives the masked argmax, so this trades only time."""
    return max(1, int(constraint.mask_cost_s / CHECK_COST_S))


def first_allowed(constraint, candidates: list[int]) -> int | None:
    return next((t for t in candidates if constraint.allows(t)), None)
