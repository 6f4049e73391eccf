"""The draft model's side of speculation: its own KV pages, and proposals for many
requests at once.

Each request keeps a draft block table and how many of its positions have draft K/V
(`DraftState`, on `request.spec`). A round for a request with n committed tokens and a
proposal length k:

  1. catch-up + first proposal: one draft forward over `all_ids[computed:n]` (the last
     committed token, plus whatever the draft has not seen: the whole prompt in the first
     round, the tokens decoded while the gate paused it, the bonus token's predecessor)
     gives x1;
  2. x1 .. x(k-1) are fed back one position at a time, one batched forward per position
     across all requests still proposing (on CUDA through the draft's own CUDA graphs);
     a request stops early at a stop token.

The draft then has K/V for n + k - 1 positions; after verification `truncate` keeps
those the target accepted. Pages come from the draft's own pool, sized for as many
tokens as the target's; when it is full, a request simply decodes without a proposal
this step (speculation never preempts anything). The draft's block tables are written
only by its `KVManager` (cache/kv_manager.py), one per draft pool, without a prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.cache.batch_kv import PagedBatchKV, Segment
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


@dataclass
class Proposal:
    tokens: list[int]
    q: list[torch.Tensor] | None  # the draft's processed distribution per token (sampling only)


def processed_logits(row: torch.Tensor, context_ids: list[int], output_ids: list[int], params, vocab: int) -> torch.Tensor:
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
    def __init__(self, model, *, num_pages: int, page_size: int, kernel_options, vocab: int,
                 graph_runner=None, max_rows: int, max_model_len: int):
        cfg = model.config
        self.model = model
        self.vocab = vocab
        self.pool = PagePool(n_layers=cfg.n_layers, num_pages=num_pages, page_size=page_size,
                             n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype=model.dtype, device=model.device)
        self.kv = KVManager(self.pool)
        self.kernel_options = kernel_options
        self.graph_runner = None
        if graph_runner is not None:
            self.graph_runner = graph_runner(model, self.pool, max_rows=max_rows, max_model_len=max_model_len,
                                             invariant=kernel_options.batch_invariant)
        self.forwards = 0
        self.tokens = 0

    # -- pages ------------------------------------------------------------------------------

    def _reserve(self, state: SpecState, positions: int) -> bool:
        """Pages for draft positions 0..positions-1; False (nothing taken) if they don't fit."""
        return self.kv.allocate_slots(state, positions) is not None

    def truncate(self, state: SpecState, valid: int) -> None:
        """Keep draft K/V for positions < valid only, and the pages that hold them."""
        state.computed = min(state.computed, valid)
        self.kv.truncate(state, state.computed)

    def release(self, state: SpecState) -> None:
        self.kv.free(state)
        state.computed = 0

    # -- proposals --------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, jobs: list[tuple[object, int]], stop_ids) -> dict[str, Proposal]:
        """`jobs`: (request, k) pairs. Returns each request's proposal (possibly shorter than
        k, or empty when its draft pages do not fit)."""
        out: dict[str, Proposal] = {}
        active = []
        for req, k in jobs:
            state: SpecState = req.spec
            n = req.num_tokens
            # Shrink k until the draft positions 0..n+k-2 fit in the draft pool.
            while k > 0 and not self._reserve(state, n + k - 1):
                k -= 1
            if k == 0:
                out[req.id] = Proposal([], None)
                continue
            state.catch_up = n - state.computed
            out[req.id] = Proposal([], None if req.params.greedy else [])
            active.append((req, k))
        first = True
        self.model.set_kernel_options(self.kernel_options)
        while active:
            ids, positions, segments = [], [], []
            for req, _ in active:
                state = req.spec
                if first:
                    chunk = req.all_ids[state.computed:]
                else:
                    chunk = [out[req.id].tokens[-1]]
                start = state.computed
                ids += chunk
                positions += range(start, start + len(chunk))
                segments.append(Segment(list(state.block_table), start, len(chunk)))
            logits = self._forward(ids, positions, segments)
            still = []
            for i, (req, k) in enumerate(active):
                state, proposal = req.spec, out[req.id]
                state.computed = segments[i].start + segments[i].n
                context = req.all_ids + proposal.tokens
                outputs = req.output_ids + proposal.tokens
                token, q = choose(logits[i], context, outputs, req.params, self.vocab, req.generator)
                proposal.tokens.append(token)
                if q is not None:
                    proposal.q.append(q)
                stop = (token in stop_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids
                if len(proposal.tokens) < k and not stop:
                    still.append((req, k))
            active = still
            first = False
        return out

    def _forward(self, ids: list[int], positions: list[int], segments: list[Segment]) -> torch.Tensor:
        """Logits of each segment's last row."""
        self.forwards += 1
        self.tokens += len(ids)
        runner = self.graph_runner
        if runner is not None and runner.can_run(segments):
            logits = runner.run(ids, segments)
            if logits is not None:
                return logits
        device = self.model.device
        last, row = [], 0
        for seg in segments:
            row += seg.n
            last.append(row - 1)
        kv = PagedBatchKV(self.pool, segments, invariant=self.kernel_options.batch_invariant)
        return self.model.forward_batch(torch.tensor(ids, device=device), torch.tensor(positions, device=device), kv,
                                        torch.tensor(last, dtype=torch.long, device=device))
