"""`ModelRunner`: the only code that runs a model.

    output = runner.execute(plan)      # = runner.collect(runner.launch(plan))

`launch` runs the draft model for the speculative rows (draft_runner.py), writes the
step's inputs into persistent buffers (step_inputs.py) and queues the target forward
(a CUDA graph for a pure decode step, else eager). `collect` computes the constrained
rows' masks while a GPU still runs it, draws every plain row together (step_draw.py),
verifies the speculative rows (spec/speculator.py) and returns a plain `RunnerOutput`.

What the runner may touch: the models, the KV pool's tensors (through the forward's
`PagedBatchKV`), its own buffers, graphs and kernel options, and its counters. It reads
requests (ids, params, block tables, constraint matchers, which it leaves as it found
them) and draws from their generators; it changes nothing else on a request, never calls
a `KVManager`, and never finishes anything: `Scheduler.update` applies the output.

Kernel options are per call: the runner passes its own (resolved for its device) to
every forward, so engines forked over one model never see each other's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.cache.batch_kv import Segment
from minivllm.engine.cuda_graphs import GraphStep, decode_graph_runner
from minivllm.engine.prefill_graphs import PrefillGraphRunner
from minivllm.engine.runner_output import RowError, RowOutput, RunnerOutput
from minivllm.engine.step_inputs import Chunk, StepInputs
from minivllm.obs.trace import trace_scope
from minivllm.sampling.constraint import Unsatisfiable
from minivllm.sampling.sampler import sampled_on_device, top_logprobs
from minivllm.sampling.step_draw import Drawn, draw_step


@dataclass
class LaunchedStep:
    """A step whose target forward is queued: what `collect` needs to finish it."""
    plan: object
    output: RunnerOutput
    logits: torch.Tensor | None
    rows: list[tuple[object, int, int]]  # (scheduled row, first logits row, draft tokens verified there)
    graph: GraphStep | None = None  # the CUDA-graph replay that ran it, if one did
    # Every row's token is already drawn on the device (`draw_on_device`): a later step may
    # have been queued since and overwritten the logits, so `collect` reads only tokens.
    drawn_on_device: bool = False


class ModelRunner:
    def __init__(self, model, pool, config, *, max_model_len: int, constraints, speculator=None, draft_model=None):
        self.model = model
        self.pool = pool
        self.constraints = constraints
        self.speculator = speculator
        self.options = config.kernel_options().resolved(model.device, dense_bytes=model.dense_bytes())
        self.graphs = None if config.enforce_eager else decode_graph_runner(
            model, pool, max_rows=config.max_rows, max_model_len=max_model_len, options=self.options)
        self.prefill_graphs = None
        if self.graphs is not None and config.prefill_graphs:
            self.prefill_graphs = PrefillGraphRunner(
                model, pool, scratch_page=self.graphs.scratch_page, max_tokens=config.max_batched_tokens,
                max_rows=config.max_rows, max_model_len=max_model_len, options=self.options)
        self.inputs = StepInputs(pool, tokens=config.max_batched_tokens, rows=config.max_rows,
                                 invariant=self.options.batch_invariant)
        # Set by the engine: something reads every drawn row's logits (LLMEngine.logits_hook),
        # so constrained rows are masked before their draw.
        self.masked_logits_wanted = False
        self.draft = None
        if speculator is not None:
            from minivllm.engine.draft_runner import DraftRunner

            options = config.kernel_options().resolved(draft_model.device, dense_bytes=draft_model.dense_bytes())
            self.draft = DraftRunner(draft_model, speculator.drafter.pool, options, vocab=speculator.vocab,
                                     stop_ids=speculator.stop_ids, max_rows=config.max_rows,
                                     max_model_len=max_model_len, tokens=config.max_batched_tokens,
                                     eager=config.enforce_eager)

    @torch.inference_mode()
    def execute(self, plan) -> RunnerOutput:
        return self.collect(self.launch(plan))

    # -- launch: draft, inputs, the queued forward ------------------------------------------------

    @torch.inference_mode()
    def launch(self, plan) -> LaunchedStep:
        output = RunnerOutput()
        jobs = [(row.request, row.draft_tokens) for row in plan.rows if row.draft_tokens]
        if jobs:
            with trace_scope("draft", len(jobs)):
                output.drafts = self.draft.propose(jobs)
        chunks, logit_rows, rows = [], [], []
        n = 0
        for row in plan.rows:
            req = row.request
            start = req.num_computed
            drafted = output.drafts[req.id].tokens if row.draft_tokens else []
            if drafted:
                # Verification row: the last committed token and the proposal, scored at
                # every position (k rows check the proposal, the last one gives the bonus).
                chunk = req.all_ids[start:start + 1] + drafted
                rows.append((row, len(logit_rows), len(drafted)))
                logit_rows += range(n, n + len(chunk))
            else:
                chunk = req.all_ids[start:start + (1 if row.draft_tokens else row.n_tokens)]
                if row.needs_logits:
                    rows.append((row, len(logit_rows), 0))
                    logit_rows.append(n + len(chunk) - 1)
            n += len(chunk)
            chunks.append(Chunk(chunk, start, req.block_table))
        output.logits_rows = len(logit_rows)
        self.options.path_counts.clear()
        graph = None
        try:
            with trace_scope("model", "mixed" if plan.decode_rows and plan.prefill_tokens else
                             "decode" if plan.decode_rows else "prefill"):
                graph = self._replay(chunks, logit_rows)
                logits = graph.logits if graph is not None else self._replay_prefill(chunks, logit_rows)
                if logits is None:
                    logits = self._forward(chunks, logit_rows)
        except Exception as exc:  # noqa: BLE001 — a failed forward fails its requests, not the engine
            output.forward_error = f"forward failed: {exc}"
            logits = None
        output.kernel_paths = dict(self.options.path_counts)
        return LaunchedStep(plan, output, logits, rows, graph)

    def draw_on_device(self, step: LaunchedStep) -> None:
        """Draw every row of `step` (a replayed graph whose rows all pass
        `step_pipeline.row_can_pipeline`) without waiting for it: greedy rows keep the
        graph's argmax, sampled rows sample from their logits on the device with their own
        generator, as `sample` would. The next replay reads these tokens."""
        for row, li, _ in step.rows:
            req = row.request
            if not req.params.greedy:
                step.graph.replace(li, sampled_on_device(step.logits[li], req.params, req.generator))
        step.drawn_on_device = True

    def launch_ahead(self, plan) -> LaunchedStep | None:
        """Queue `plan`, the rows of the step just launched (same rows, same order, one
        position further), before that step's tokens are read: its graph replay takes the
        tokens the last replay drew on the device (step_pipeline.py). None (nothing queued)
        when no graph can run it."""
        segments = [Segment(row.request.block_table, row.request.num_computed + 1, 1) for row in plan.rows]
        graphs = self.graphs
        if graphs is None or not graphs.can_run(segments):
            return None
        output = RunnerOutput()
        output.logits_rows = len(segments)
        self.options.path_counts.clear()
        try:
            with trace_scope("model", "decode ahead"):
                graph = graphs.run(None, segments)
        except Exception:  # noqa: BLE001 — the step then runs the usual way, after this one is applied
            return None
        if graph is None:
            return None
        output.kernel_paths = dict(self.options.path_counts)
        return LaunchedStep(plan, output, graph.logits, [(row, i, 0) for i, row in enumerate(plan.rows)], graph)

    def _replay(self, chunks: list[Chunk], logit_rows: list[int]) -> GraphStep | None:
        """A pure decode step through its bucket's CUDA graph (no generic input fill: the
        graph runner packs its own), or None for the eager path."""
        graphs = self.graphs
        if graphs is None or len(logit_rows) != len(chunks) or any(len(c.token_ids) != 1 for c in chunks):
            return None
        segments = [Segment(c.block_table, c.start, 1) for c in chunks]
        if not graphs.can_run(segments):
            return None
        return graphs.run([c.token_ids[0] for c in chunks], segments)

    def _replay_prefill(self, chunks: list[Chunk], logit_rows: list[int]) -> torch.Tensor | None:
        """A step with prompt chunks through its bucket's CUDA graph (prefill_graphs.py):
        the logits rows asked for, or None for the eager path."""
        graphs = self.prefill_graphs
        if graphs is None or not graphs.can_run(sum(len(c.token_ids) for c in chunks), len(chunks), len(logit_rows)):
            return None
        return graphs.run(chunks, logit_rows)

    def _forward(self, chunks: list[Chunk], logit_rows: list[int]) -> torch.Tensor:
        batch = self.inputs.fill(chunks, logit_rows)
        return self.model.forward_batch(batch.token_ids, batch.positions, batch.kv, batch.logit_rows,
                                        options=self.options)

    # -- collect: masks, draws, verification ------------------------------------------------------

    @torch.inference_mode()
    def collect(self, step: LaunchedStep) -> RunnerOutput:
        output, logits = step.output, step.logits
        if logits is None:
            return output
        if step.drawn_on_device:
            tokens = step.graph.tokens()
            for row, li, _ in step.rows:
                output.rows[row.request.id] = self.token_row(row.request, Drawn(tokens[li], logits[li]))
            return output
        plain = [(row.request, li) for row, li, drafted in step.rows if not drafted]
        # Constrained rows' masks, computed while a GPU still runs the forward just queued.
        masks = self.constraints.early_masks(plain, masked_logits_wanted=self.masked_logits_wanted,
                                             device_busy=logits.is_cuda)
        views = logits.unbind(0)  # every row's view at once: cheaper than indexing each
        drawn = self._draw([(req, views[li]) for req, li in plain], masks)
        for row, li, drafted in step.rows:
            req = row.request
            if drafted:
                output.rows[req.id] = self._verify(req, logits[li:li + drafted + 1], output.drafts[req.id])
                continue
            if row.keep_logits:
                output.rows[req.id] = RowOutput(prompt_logits=views[li].clone())
            output.rows[req.id] = self.token_row(req, drawn[req.id], into=output.rows.get(req.id))
        if logits.is_cuda and any(drafted or (row.request.spec is not None and row.request.output_ids)
                                  for row, _, drafted in step.rows):
            torch.cuda.synchronize(logits.device)  # the pay-off gate weighs device time; forced tokens need not wait
        return output

    def draw_alone(self, req, row_logits: torch.Tensor) -> RowOutput:
        """One row's token drawn from `row_logits` with no forward (a single-flight
        follower's first token, from its leader's prompt logits)."""
        return self.token_row(req, self._draw([(req, row_logits)], {})[req.id])

    def token_row(self, req, drawn, into: RowOutput | None = None) -> RowOutput:
        """A plain row's output from its draw (a step_draw.Drawn, or why it has none)."""
        out = into or RowOutput()
        try:
            if isinstance(drawn, Exception):
                raise drawn
            logprobs = top_logprobs(drawn.logits, drawn.token, req.params.logprobs) \
                if req.params.logprobs is not None else None
        except Unsatisfiable as exc:
            out.error = RowError("constraint", str(exc))
            return out
        except Exception as exc:  # noqa: BLE001
            out.error = RowError("sampling", f"sampling failed: {exc}")
            return out
        out.tokens, out.logits, out.logprobs = [drawn.token], [drawn.logits], [logprobs]
        return out

    def _draw(self, rows: list[tuple[object, torch.Tensor]], masks: dict) -> dict:
        """The rows' tokens, drawn together (step_draw.py). If that fails, each row draws
        alone, so the failure ends only the requests it belongs to."""
        try:
            with trace_scope("sample", len(rows)):
                return draw_step(rows, masks, self.constraints, want_masked=self.masked_logits_wanted)
        except Exception as exc:  # noqa: BLE001
            if len(rows) == 1:
                return {rows[0][0].id: exc}
            return {k: v for row in rows for k, v in self._draw([row], masks).items()}

    def _verify(self, req, logits: torch.Tensor, proposal) -> RowOutput:
        """Accept or correct the proposal against the target's rows (masked along the
        draft for a constrained request)."""
        out = RowOutput()
        try:
            with trace_scope("verify", req.id):
                if req.constraint is not None:
                    logits = self.constraints.mask_along(req.constraint, logits, proposal.tokens)
                result = self.speculator.verify(req, logits, proposal)
            out.round = result
            out.tokens = list(result.tokens)
            out.logits = [logits[r] for r in result.logit_rows]
            want = req.params.logprobs
            out.logprobs = [top_logprobs(logits[r], t, want) if want is not None else None
                            for t, r in zip(result.tokens, result.logit_rows, strict=True)]
        except Unsatisfiable as exc:
            out.round, out.error = None, RowError("constraint", str(exc))
        except Exception as exc:  # noqa: BLE001
            out.round, out.error = None, RowError("verification", f"verification failed: {exc}")
        return out
