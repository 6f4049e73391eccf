"""The draft model's forwards: proposals for every speculative row of a step, together.

A round for a request with n committed tokens and k draft tokens (the scheduler has
already given it draft pages for positions 0..n+k-2, in the draft pool of
spec/drafter.py):

  1. catch-up + first proposal: one draft forward over `all_ids[computed:n]` (the last
     committed token, plus whatever the draft has not seen: the whole prompt in the first
     round, the tokens decoded while the gate paused it, the bonus token's predecessor)
     gives x1;
  2. x1 .. x(k-1) are fed back one position at a time, one batched forward per position
     across all requests still proposing (on CUDA through the draft's own CUDA graphs);
     a request stops early at a stop token.

The draft then has K/V for n + k - 1 positions. This module only reads requests and
draws from their generators; it returns each row's `DraftOutcome` (proposal, positions
computed) and `Scheduler.update` writes them into `request.spec` and cuts the draft
pages back after verification. A draft forward that raises costs speed only: every row
of the step gets an empty, failed outcome (its draft K/V is recomputed later).
"""

from __future__ import annotations

import time

import torch

from minivllm.engine.cuda_graphs import decode_graph_runner
from minivllm.engine.runner_output import DraftOutcome
from minivllm.engine.step_inputs import Chunk, StepInputs
from minivllm.spec.drafter import choose


class DraftRunner:
    def __init__(self, model, pool, options, *, vocab: int, stop_ids, max_rows: int, max_model_len: int,
                 tokens: int, eager: bool):
        self.model = model
        self.pool = pool
        self.options = options
        self.vocab = vocab
        self.stop_ids = stop_ids
        self.inputs = StepInputs(pool, tokens=tokens, rows=max_rows, invariant=options.batch_invariant)
        self.graphs = None if eager else decode_graph_runner(model, pool, max_rows=max_rows,
                                                             max_model_len=max_model_len, options=options)
        # What the snapshot's speculative section reports about the draft's work.
        self.forwards = 0
        self.tokens = 0
        self.seconds = 0.0
        self.last_error: str | None = None

    def propose(self, jobs: list[tuple[object, int]]) -> dict[str, DraftOutcome]:
        """`jobs`: (request, k >= 1) pairs. Each request's outcome: up to k tokens."""
        t0 = time.perf_counter()
        try:
            return self._propose(jobs)
        except Exception as exc:  # noqa: BLE001 — a failed draft costs speed, never the requests
            self.last_error = f"draft forward failed: {type(exc).__name__}: {exc}"[:500]
            return {req.id: DraftOutcome([], None, 0, 0, failed=True) for req, _ in jobs}
        finally:
            self.seconds += time.perf_counter() - t0

    def _propose(self, jobs: list[tuple[object, int]]) -> dict[str, DraftOutcome]:
        out: dict[str, DraftOutcome] = {}
        for req, _ in jobs:
            computed = req.spec.computed
            out[req.id] = DraftOutcome([], None if req.params.greedy else [], computed, req.num_tokens - computed)
        active = list(jobs)
        first = True
        while active:
            chunks = []
            for req, _ in active:
                outcome = out[req.id]
                chunk = req.all_ids[outcome.computed:] if first else [outcome.tokens[-1]]
                chunks.append(Chunk(chunk, outcome.computed, req.spec.block_table))
            logits = self._forward(chunks)
            still = []
            for i, (req, k) in enumerate(active):
                outcome = out[req.id]
                outcome.computed = chunks[i].start + len(chunks[i].token_ids)
                context = req.all_ids + outcome.tokens
                outputs = req.output_ids + outcome.tokens
                token, q = choose(logits[i], context, outputs, req.params, self.vocab, req.generator)
                outcome.tokens.append(token)
                if q is not None:
                    outcome.q.append(q)
                stop = (token in self.stop_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids
                if len(outcome.tokens) < k and not stop:
                    still.append((req, k))
            active = still
            first = False
        return out

    def _forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits of each chunk's last row."""
        self.forwards += 1
        self.tokens += sum(len(c.token_ids) for c in chunks)
        last, row = [], 0
        for c in chunks:
            row += len(c.token_ids)
            last.append(row - 1)
        batch = self.inputs.fill(chunks, last)
        graphs = self.graphs
        if graphs is not None and graphs.can_run(batch.segments):
            logits = graphs.run([t for c in chunks for t in c.token_ids], batch.segments)
            if logits is not None:
                return logits
        return self.model.forward_batch(batch.token_ids, batch.positions, batch.kv, batch.logit_rows,
                                        options=self.options)
