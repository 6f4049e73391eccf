"""A step's tokens, drawn together.

Drawn row by row, every token costs a device round trip (an argmax, then `.item()`), and
a constrained row two or three (candidates, then a mask). At batch 16 on an H200 those
round trips took about as long as the forward (scripts/profile_structured_step.py). So:

- the masks computed beside the forward are applied in one launch;
- greedy rows, constrained or not, take one argmax over their stacked logits: masked
  where a mask is ready, unmasked for the rows that check their token instead
  (constrained_draw.py). One round trip brings the tokens back;
- a checked row whose argmax the constraint forbids tries the top candidates next: one
  top-k for all such rows, queued on a GPU behind the argmax's copy back, so it runs while
  the host checks, and is read only in the steps that need it;
- rows whose check found nothing get their masks computed then, applied in one launch,
  and one more argmax: a second round trip, in the steps that have such rows.

Rows whose token the grammar forces take it with no mask and no argmax
(`constrained_draw.draws_forced`).

Sampled rows draw alone: each has its own generator, so a seeded request gives the same
tokens in any batch. The tokens are the ones a row-by-row draw gives: the same logits, the
same penalties, and an argmax over a row of a stack is the argmax over that row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sampling.constrained_draw import (
    checks_candidates,
    draws_forced,
    first_allowed,
    launch_greedy_candidates,
    penalized,
    read_greedy_candidates,
    sampled_candidates,
)
from minivllm.sampling.sampler import sample


@dataclass(frozen=True)
class Drawn:
    token: int
    # What the token was drawn from, for logits hooks and logprobs: for a constrained row
    # the masked logits where its mask was computed, else the raw row.
    logits: torch.Tensor


@dataclass(slots=True)  # a few per step: slots make them cheap to build
class _Greedy:
    """A row that takes the argmax of `row`; `checked`: `row` is unmasked and the token
    stands only if the constraint allows it (else the candidates, then the mask)."""
    request: object
    row: torch.Tensor
    report: torch.Tensor
    checked: bool = False


def draw_step(rows: list[tuple[object, torch.Tensor]], masks: dict, constraints, *,
              want_masked: bool) -> dict[str, Drawn | Exception]:
    """`rows`: (request, its logits row) for each plain row of the step. `masks`: request
    id -> its mask computed beside the forward (a bitmask row), or the exception that
    stopped it (`Constraints.early_masks`). `want_masked`: something reads every
    constrained row's masked logits (a logits hook). Returns request id -> Drawn, or the
    exception that ends that request (Unsatisfiable when its constraint has no token left)."""
    out: dict[str, Drawn | Exception] = {}
    greedy: list[_Greedy] = []
    sampled, check_sampled = [], []
    to_mask = []  # (request, logits row, its bitmask row or None to compute it now, the token if drawn already)
    for req, row in rows:
        p, constraint = req.params, req.constraint
        if constraint is None:
            (greedy.append(_Greedy(req, row, row)) if p.greedy else sampled.append((req, row, row)))
            continue
        mask = masks.get(req.id)
        if isinstance(mask, Exception):
            out[req.id] = mask
        elif draws_forced(req, want_masked):
            constraints.counts["forced"] += 1
            out[req.id] = Drawn(constraint.forced_token(), row)
        elif checks_candidates(p) and constraint.checks_tokens() and not (p.greedy and mask is not None):
            # Sampled rows check even with a mask ready: a seed's tokens never depend on timing.
            (
                greedy.append(_Greedy(req, row, row, checked=True))
                if p.greedy
                else check_sampled.append((req, row, mask))
            )
        else:
            to_mask.append((req, row, mask, None))

    # Everything known before the tokens come back goes onto the device first: the ready
    # masks, then one argmax over every greedy row (checked rows unmasked), whose copy back
    # is queued before the checked rows' candidates, so the candidates' top-k runs while
    # the host checks the argmax tokens, and is read only if one of them is forbidden.
    if to_mask:
        _masked_draws(to_mask, constraints, greedy, out)
    late = []  # (request, logits row, its bitmask row or None, the token if drawn already)
    if greedy:
        late += _greedy_draws(greedy, constraints, out)
    for req, row, report in sampled:
        out[req.id] = _alone(req, row, report)
    for req, row, mask in check_sampled:
        try:
            token = first_allowed(req.constraint, sampled_candidates(req, row))
        except Exception as exc:  # noqa: BLE001 - this row fails, not the step
            out[req.id] = exc
            continue
        if token is None or want_masked or req.params.logprobs is not None:
            late.append((req, row, mask, token))
        else:
            constraints.counts["masked_ahead" if mask is not None else "checked"] += 1
            out[req.id] = Drawn(token, row)

    # Rows whose check found no allowed token (or whose report needs the mask): a second
    # round trip, only in steps that have them.
    if late:
        greedy_late: list[_Greedy] = []
        _masked_draws(late, constraints, greedy_late, out)
        if greedy_late:
            _greedy_draws(greedy_late, constraints, out)
    return out


def _greedy_draws(greedy: list[_Greedy], constraints, out: dict) -> list:
    """The greedy rows' tokens from one argmax; returns the checked rows none of whose
    candidates the constraint allows, to be masked."""
    stacked = penalized([g.request for g in greedy], [g.row for g in greedy])
    checked = any(g.checked for g in greedy)
    # On a GPU the top-k is queued now, behind the argmax's copy; on a CPU it would cost
    # its full time, so it runs only if some argmax is forbidden. It covers every greedy
    # row: one top-k runs its rows side by side, so the unchecked ones cost it little,
    # and picking the checked rows out first would index with a host list, a copy that
    # waits for the device (the forward) before the top-k is even queued.
    queued = checked and queues_candidates(stacked)
    read_tokens = _queue_read(stacked.argmax(dim=-1)) if queued else stacked.argmax(dim=-1).tolist
    launched = launch_greedy_candidates(stacked) if queued else None
    forbidden = []
    for k, (g, token) in enumerate(zip(greedy, read_tokens())):
        if g.checked and not g.request.constraint.allows(token):
            forbidden.append(k)
        else:
            constraints.counts["checked"] += g.checked
            out[g.request.id] = Drawn(token, g.report)
    if not forbidden:
        return []
    if launched is None:
        launched, picks = launch_greedy_candidates(stacked[forbidden]), list(range(len(forbidden)))
    else:
        picks = forbidden
    late = []
    for k, candidates in zip(
        forbidden, read_greedy_candidates(launched, picks, [greedy[k].request for k in forbidden])
    ):
        g = greedy[k]
        token = first_allowed(g.request.constraint, candidates)
        if token is None:
            late.append((g.request, g.row, None, None))
        else:
            constraints.counts["checked"] += 1
            out[g.request.id] = Drawn(token, g.report)
    return late


def queues_candidates(logits: torch.Tensor) -> bool:
    """Whether the checked rows' top-k is queued with the argmax, before anyone knows it
    is needed: where the device works apart from the host (a GPU)."""
    return logits.is_cuda


_readbacks: dict = {}  # device -> (a pinned host buffer, an event), reused step after step


def _queue_read(tensor: torch.Tensor):
    """Starts the copy of `tensor` (int64) to the host; returns the function that waits
    for it and gives it as a list. On a GPU, work queued after this call does not delay
    the read. The pinned buffer and the event are reused (allocating them took ~0.1 ms a
    step): the previous read has always been waited for before the next copy starts."""
    if not tensor.is_cuda:
        return tensor.tolist
    n = tensor.numel()
    buffer, copied = _readbacks.get(tensor.device, (None, None))
    if buffer is None or buffer.numel() < n:
        buffer, copied = torch.empty(max(n, 64), dtype=torch.int64, pin_memory=True), torch.cuda.Event()
        _readbacks[tensor.device] = (buffer, copied)
    host = buffer[:n]
    host.copy_(tensor, non_blocking=True)
    copied.record()

    def read() -> list:
        copied.synchronize()
        return host.tolist()
    return read


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
            greedy.append(_Greedy(req, masked[j], masked[j]))
        else:
            out[req.id] = _alone(req, masked[j], masked[j])


def _alone(req, row: torch.Tensor, report: torch.Tensor) -> Drawn | Exception:
    try:
        return Drawn(sample(row, req.all_ids, req.output_ids, req.params, req.generator), report)
    except Exception as exc:  # noqa: BLE001 - this row fails, not the step
        return exc
