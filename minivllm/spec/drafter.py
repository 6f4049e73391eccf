"""The draft model's side of speculation: each request's draft state, the draft's KV
pages, and how a draft token is chosen.

Each request keeps a draft block table and how many of its positions have draft K/V
(`SpecState`, on `request.spec`). The draft forwards that make a proposal run in the
model runner (engine/draft_runner.py: spec/ keeps no forward code of its own). After a
round the draft has K/V for n + k - 1 positions; after verification the scheduler cuts
them back to those the target accepted. Pages come from the draft's own pool, sized for
as many tokens as the target's; when it is full, a request simply decodes without a
proposal this step (speculation never preempts anything). The draft's block tables are
written only by its `KVManager` (cache/kv_manager.py), one per draft pool, without a
prefix cache, and only the scheduler calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.cache.kv_manager import KVManager
from minivllm.cache.page_pool import PagePool
from minivllm.sampling.sampler import apply_penalties, filtered_probs
from minivllm.spec.draft_policy import DraftController
from minivllm.spec.stats import SpecStats


@dataclass
class SpecState:
    """One request's speculation state (the engine keeps it on `request.spec`)."""

    controller: DraftController
    stats: SpecStats = field(default_factory=SpecStats)
    block_table: list[int] = field(default_factory=list)  # draft KV pages (written by the draft's KVManager)
    computed: int = 0  # positions with draft K/V
    catch_up: int = 0  # tokens the latest round's first draft forward had to compute

    def describe(self) -> dict:
        """This request's speculation row in engine snapshots."""
        gate = self.controller.gate
        return {**self.stats.as_dict(), "next_draft_tokens": self.controller.wanted(),
                "draft_computed_tokens": self.computed, "draft_pages": len(self.block_table),
                "gate": gate.describe() if gate is not None else None}


def processed_logits(
    row: torch.Tensor, context_ids: list[int], output_ids: list[int], params, vocab: int
) -> torch.Tensor:
    """A logits row over the shared vocabulary with the request's penalties applied: the
    same processing for the target's and the draft's rows."""
    return apply_penalties(row[:vocab].float().clone(), context_ids, output_ids, params)


def choose(row: torch.Tensor, context_ids: list[int], output_ids: list[int], params, vocab: int,
           generator) -> tuple[int, torch.Tensor | None]:
    """The token a request takes from one logits row, and the distribution it came from
    (None for greedy)."""
    logits = processed_logits(row, context_ids, output_ids, params, vocab)
    if params.greedy:
        return int(torch.argmax(logits)), None
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


class Drafter:
    """The draft's KV pages: its own pool, sized for as many tokens as the target's, and
    the `KVManager` that writes the draft block tables (no prefix cache). The scheduler
    is the only caller of that manager's mutators (engine/scheduler.py); the model
    runner's draft forwards (engine/draft_runner.py) read and write the pool's K/V."""

    def __init__(self, model, *, num_pages: int, page_size: int):
        cfg = model.config
        self.pool = PagePool(n_layers=cfg.n_layers, num_pages=num_pages, page_size=page_size,
                             n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype=model.dtype, device=model.device)
        self.kv = KVManager(self.pool)
