"""A step's tokens, drawn together.

Drawn row by row, every token costs a device round trip (an argmax, then `.item()`), and
a constrained row two or three (candidates, then a mask). At batch 16 on an H200 those
round trips took about as long as the forward (scripts/profile_structured_step.py). So:

- greedy rows, constrained or not, take one argmax over their stacked logits;
- constrained rows that check candidates first (constrained_draw.py) get them from one
  top-k over their stacked logits;
- the constrained rows that still need a mask get it computed then, all in one bitmask,
  and applied in one masked_fill.

Sampled rows draw alone: each has its own generator, so a seeded request gives the same
tokens in any batch. The tokens are the ones a row-by-row draw gives: the same logits, the
same penalties, and an argmax over a row of a stack is the argmax over that row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sampling.constrained_draw import (checks_candidates, first_allowed, greedy_candidates,
                                                greedy_check_limit, penalized, sampled_candidates)
from minivllm.sampling.sampler import sample


@dataclass(frozen=True)
class Drawn:
    token: int
    # What the token was drawn from, for logits hooks and logprobs: for a constrained row
    # the masked logits where its mask was computed, else the raw row.
    logits: torch.Tensor


def draw_step(rows: list[tuple[object, torch.Tensor]], masked: dict, constraints, *,
              want_masked: bool) -> dict[str, Drawn | Exception]:
    """`rows`: (request, its logits row) for each plain row of the step. `masked`: request
    id -> the row masked beside the forward, or the exception that stopped its mask
    (`Constraints.required_masks`). `want_masked`: something reads every constrained row's
    masked logits (a logits hook). Returns request id -> Drawn, or the exception that ends
    that request (Unsatisfiable when its constraint has no token left)."""
    out: dict[str, Drawn | Exception] = {}
    greedy: list[tuple[object, torch.Tensor, torch.Tensor]] = []  # (request, row to argmax, row to report)
    check_greedy, check_sampled, need_mask = [], [], []
    for req, row in rows:
        p, constraint = req.params, req.constraint
        if constraint is None:
            if p.greedy:
                greedy.append((req, row, row))
            else:
                out[req.id] = _alone(req, row, row)
            continue
        ready = masked.get(req.id)
        if isinstance(ready, Exception):
            out[req.id] = ready
            continue
        checks = checks_candidates(p) and constraint.checks_tokens()
        if ready is not None and (p.greedy or not checks):
            constraints.counts["masked_ahead"] += 1
            _from_mask(req, ready, greedy, out)
        elif checks:  # sampled rows check even with a mask ready: the seed's tokens never depend on timing
            (check_greedy if p.greedy else check_sampled).append((req, row, ready))
        else:
            need_mask.append((req, row, None))

    checked = []
    if check_greedy:
        reqs = [req for req, _, _ in check_greedy]
        for (req, row, ready), candidates in zip(check_greedy, greedy_candidates(reqs, [r for _, r, _ in check_greedy])):
            candidates = candidates[:greedy_check_limit(req.constraint)]
            checked.append((req, row, ready, first_allowed(req.constraint, candidates)))
    for req, row, ready in check_sampled:
        try:
            checked.append((req, row, ready, first_allowed(req.constraint, sampled_candidates(req, row))))
        except Exception as exc:  # noqa: BLE001 - this row fails, not the step
            out[req.id] = exc
    for req, row, ready, token in checked:
        reads_mask = want_masked or req.params.logprobs is not None
        if ready is not None:
            constraints.counts["masked_ahead"] += 1
            if token is None:
                _from_mask(req, ready, greedy, out)
            else:
                out[req.id] = Drawn(token, ready)
        elif token is None or reads_mask:
            need_mask.append((req, row, token))
        else:
            constraints.counts["checked"] += 1
            out[req.id] = Drawn(token, row)

    if need_mask:
        constraints.counts["masked_at_draw"] += len(need_mask)
        masks = constraints.mask_rows([req.constraint for req, _, _ in need_mask],
                                      torch.stack([row for _, row, _ in need_mask]))
        for (req, _, token), mask in zip(need_mask, masks):
            if isinstance(mask, Exception):
                out[req.id] = mask
            elif token is not None:
                out[req.id] = Drawn(token, mask)
            else:
                _from_mask(req, mask, greedy, out)

    if greedy:
        reqs = [req for req, _, _ in greedy]
        tokens = penalized(reqs, [r for _, r, _ in greedy]).argmax(dim=-1).tolist()
        for (req, _, report), token in zip(greedy, tokens):
            out[req.id] = Drawn(token, report)
    return out


def _from_mask(req, masked_row: torch.Tensor, greedy: list, out: dict) -> None:
    """Draw from the masked row: greedy rows join the step's one argmax."""
    if req.params.greedy:
        greedy.append((req, masked_row, masked_row))
    else:
        out[req.id] = _alone(req, masked_row, masked_row)


def _alone(req, row: torch.Tensor, report: torch.Tensor) -> Drawn | Exception:
    try:
        return Drawn(sample(row, req.all_ids, req.output_ids, req.params, req.generator), report)
    except Exception as exc:  # noqa: BLE001 - this row fails, not the step
        return exc
