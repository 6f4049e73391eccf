"""Async scheduling: queue the next decode step before reading this one's tokens.

A decode step on a GPU is: the host plans it, the GPU runs it, the host reads the drawn
tokens and applies them (stop checks, text, pages, metrics), and only then plans the
next. While the host applies and plans, the GPU waits: on the lent H100 that gap was
0.7-1.0 ms per step (scripts/profile_decode_step.py), a quarter of a 7B token's budget
and half of a 0.5B one's.

When the next step is certain to be "the same rows, one position further", the engine
queues it first and reads afterwards:

    step k:   launch k            (the previous step's ahead launch, or a normal one)
              plan k+1 ahead      (Scheduler.plan_ahead: same rows, a page if one is due)
              launch k+1          (ModelRunner.launch_ahead: the graph takes the tokens
                                   that step k's replay drew, on the device)
              collect k           (waits for k's tokens only; k+1 is running)
              update k            (appends, finishes, publishes)
    step k+1: collect k+1 ...

It holds for a step whose rows are all plain decode rows, greedy or sampled (no
constraint, draft, penalty, logit bias, logprobs, logits hook or flight leader: nothing
that needs the host between the logits and the token), run through a CUDA graph,
with no waiting request able to take a free slot and every row able to take one more token
(`can_continue`). A row that update k finishes anyway (an EOS, a stop string, an abort)
is dropped from step k+1 before it is applied: its ahead token's K/V landed in one of
its own pages, past its computed positions, so nothing reads it, and nothing published
covers it. If any row is dropped, the whole ahead step is applied without that row.

The drawn tokens are the same: the graph's argmax is the greedy draw (first maximum); a
sampled row samples on the device from its own logits with its own generator, the same
operations in the same order as `sampler.sample`; and the step's inputs are the ones the
next normal step would have built.
"""

from __future__ import annotations

from minivllm.engine.request import Status
from minivllm.sampling.sampler import adjusts_logits


def row_can_pipeline(row) -> bool:
    """A scheduled row whose token can be drawn on the device and fed to the next step."""
    req = row.request
    p = req.params
    return (row.n_tokens == 1 and row.needs_logits and not row.draft_tokens and not row.keep_logits
            and req.phase == "decode" and req.constraint is None and req.spec is None
            and p.logprobs is None and not adjusts_logits(p))


def can_continue(req, max_model_len: int) -> bool:
    """`req` will still run after the token in flight is appended, unless that token ends it:
    the token after it is within max_tokens and the context."""
    return len(req.output_ids) + 2 <= req.params.max_tokens and req.num_computed + 2 <= max_model_len


def steady_decode(plan, launched, *, hooked: bool, running: int) -> bool:
    """Whether `plan`, just launched as `launched`, can have its next step queued ahead:
    every running request is one of its rows (none is left prefilling), and its graph
    replay covered exactly these rows in this order (the next replay reads its tokens)."""
    return (launched is not None and launched.graph is not None and not hooked and bool(plan.rows)
            and len(plan.rows) == running == launched.graph.rows and launched.output.forward_error is None
            and all(row_can_pipeline(row) for row in plan.rows))


def still_valid(plan, expected_starts: list[int]) -> list[bool]:
    """For an ahead plan, after the step before it was applied: which rows still run at
    the position they were queued for."""
    return [row.request.status == Status.RUNNING and row.request.num_computed == start
            for row, start in zip(plan.rows, expected_starts, strict=True)]
