"""A step's tokens, drawn together.

Drawn row by row, every token costs a device round trip (an argmax, then `.item()`), and
a constrained row two or three (candidates, then a mask). At batch 16 on an H200 those
round trips took about as long as the forward (scripts/profile_structured_step.py). So:

- greedy rows, constrained or not, take one argmax over their stacked logits;
- constrained rows that check candidates first (constrained_draw.py) get them from one
  top-k over their stacked logits, queued behind that argmax and the masks computed
  beside the forward (applied in one launch), so one round trip brings all of it back;
- rows whose check found nothing get their masks computed then, applied in one launch,
  and one more argmax: a second round trip, in the steps that have such rows.

Sampled rows draw alone: each has its own generator, so a seeded request gives the same
tokens in any batch. The tokens are the ones a row-by-row draw gives: the same logits, the
same penalties, and an argmax over a row of a stack is the argmax over that row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sampling.constrained_draw import (checks_candidates, first_allowed, greedy_candidates, penalized,
                                                sampled_candidates)
from minivllm.sampling.sampler import sample


@dataclass(frozen=True)
class Drawn:
    token: int
    # What the token was drawn from, for logits hooks and logprobs: for a constrained row
    # the masked logits where its mask was computed, else the raw row.
    logits: torch.Tensor


def draw_step(rows: list[tuple[object, torch.Tensor]], masks: dict, constraints, *,
              want_masked: bool) -> dict[str, Drawn | Exception]:
    """`rows`: (request, its logits row) for each plain row of the step. `masks`: request
    id -> its mask computed beside the forward (a bitmask row), or the exception that
    stopped it (`Constraints.early_masks`). `want_masked`: something reads every
    constrained row's masked logits (a logits hook). Returns request id -> Drawn, or the
    exception that ends that request (Unsatisfiable when its constraint has no token left)."""
    out: dict[str, Drawn | Exception] = {}
    greedy: list[tuple[object, torch.Tensor, torch.Tensor]] = []  # (request, row to argmax, row to report)
    sampled, check_greedy, check_sampled = [], [], []
    to_mask = []  # (request, logits row, its bitmask row or None to compute it now, the token if drawn already)
    for req, row in rows:
        p, constraint = req.params, req.constraint
        if constraint is None:
            (greedy if p.greedy else sampled).append((req, row, row))
            continue
        mask = masks.get(req.id)
        if isinstance(mask, Exception):
            out[req.id] = mask
        elif checks_candidates(p) and constraint.checks_tokens() and not (p.greedy and mask is not None):
            # Sampled rows check even with a mask ready: a seed's tokens never depend on timing.
            (check_greedy if p.greedy else check_sampled).append((req, row, mask))
        else:
            to_mask.append((req, row, mask, None))

    # Everything known before the candidates come back goes onto the device first, so one
    # round trip (the candidates' copy back) brings the greedy tokens too.
    if to_mask:
        _masked_draws(to_mask, constraints, greedy, out)
    argmax = _launch_argmax(greedy)
    checked = []
    if check_greedy:
        reqs = [req for req, _, _ in check_greedy]
        for (req, row, mask), candidates in zip(check_greedy, greedy_candidates(reqs, [r for _, r, _ in check_greedy])):
            checked.append((req, row, mask, first_allowed(req.constraint, candidates)))
    _read_argmax(greedy, argmax, out)
    for req, row, report in sampled:
        out[req.id] = _alone(req, row, report)
    for req, row, mask in check_sampled:
        try:
            checked.append((req, row, mask, first_allowed(req.constraint, sampled_candidates(req, row))))
        except Exception as exc:  # noqa: BLE001 - this row fails, not the step
            out[req.id] = exc

    # Rows whose check found no allowed token (or whose report needs the mask): a second
    # round trip, only in steps that have them.
    late = []
    for req, row, mask, token in checked:
        if token is None or want_masked or req.params.logprobs is not None:
            late.append((req, row, mask, token))
        elif mask is not None:
            constraints.counts["masked_ahead"] += 1
            out[req.id] = Drawn(token, row)
        else:
            constraints.counts["checked"] += 1
            out[req.id] = Drawn(token, row)
    if late:
        greedy_late: list = []
        _masked_draws(late, constraints, greedy_late, out)
        _read_argmax(greedy_late, _launch_argmax(greedy_late), out)
    return out


def _launch_argmax(greedy: list) -> torch.Tensor | None:
    """The greedy rows' tokens, queued on the device (read with `_read_argmax`)."""
    if not greedy:
        return None
    return penalized([req for req, _, _ in greedy], [r for _, r, _ in greedy]).argmax(dim=-1)


def _read_argmax(greedy: list, argmax: torch.Tensor | None, out: dict) -> None:
    if argmax is not None:
        for (req, _, report), token in zip(greedy, argmax.tolist()):
            out[req.id] = Drawn(token, report)


def _masked_draws(to_mask: list, constraints, greedy: list, out: dict) -> None:
    """The rows drawn from their masked logits: the masks not computed beside the forward
    are computed now, and all of them applied in one launch. Greedy rows join `greedy`,
    for one argmax; sampled rows draw alone."""
    late = [k for k, (_, _, mask, _) in enumerate(to_mask) if mask is None]
    constraints.counts["masked_ahead"] += len(to_mask) - len(late)
    constraints.counts["masked_at_draw"] += len(late)
    bitmask_rows = [mask for _, _, mask, _ in to_mask]
    if late:
        bitmask, failures = constraints.fill_masks([to_mask[k][0].constraint for k in late])
        for j, k in enumerate(late):
            bitmask_rows[k] = failures[j] or bitmask[j]
    live = [k for k, mask in enumerate(bitmask_rows) if not isinstance(mask, Exception)]
    for k, mask in enumerate(bitmask_rows):
        if isinstance(mask, Exception):
            out[to_mask[k][0].id] = mask
    if not live:
        return
    masked = constraints.apply([bitmask_rows[k] for k in live], torch.stack([to_mask[k][1] for k in live]))
    for j, k in enumerate(live):
        req, _, _, token = to_mask[k]
        if token is not None:
            out[req.id] = Drawn(token, masked[j])
        elif req.params.greedy:
            greedy.append((req, masked[j], masked[j]))
        else:
            out[req.id] = _alone(req, masked[j], masked[j])


def _alone(req, row: torch.Tensor, report: torch.Tensor) -> Drawn | Exception:
    try:
        return Drawn(sample(row, req.all_ids, req.output_ids, req.params, req.generator), report)
    except Exception as exc:  # noqa: BLE001 - this row fails, not the step
        return exc
