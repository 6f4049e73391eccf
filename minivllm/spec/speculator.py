"""The engine's speculation: policies, verification and figures. `LLMEngine` owns one
when it is given a draft model.

A step with speculation (all draft-model work finishes first, then the target model runs
once):
  1. the scheduler gives each decoding request that wants to speculate a row of 1 + k
     tokens (`wanted_tokens`: the request's draft-length controller, capped by its
     remaining max_tokens and the context) when the step budget and free pages of both
     pools allow;
  2. the model runner runs the draft for all of them together (engine/draft_runner.py);
  3. the target's one forward carries those verification rows — the last committed
     token and the k proposals, with logits at all k + 1 positions — next to every other
     request's prefill chunks and decode rows;
  4. `verify` (called by the runner) walks each proposal in order (verify.py): accepted
     tokens, then a replacement at the first rejection, or a bonus token from the
     (k+1)-th logits row when all k were accepted. A round yields 1 to k + 1 tokens;
  5. `Scheduler.update` appends them, keeps the target's K/V for the accepted positions,
     cuts the draft's back to what it computed of them, and records the round here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from minivllm.sampling.sampler import filtered_probs
from minivllm.spec.draft_compat import shared_vocab_size
from minivllm.spec.draft_policy import parse_draft_policy
from minivllm.spec.drafter import Drafter, SpecState, choose, processed_logits
from minivllm.spec.stats import SpecStats
from minivllm.spec.verify import verify_greedy, verify_sampled

RECENT_ROUNDS = 128


@dataclass
class RoundResult:
    tokens: list[int]  # to append, in order: accepted proposals, then the replacement or the bonus token
    logit_rows: list[int]  # which of the round's logits rows each token was decided at
    accepted: int
    proposed: int
    bonus: bool
    tvs: list[float]


class Speculator:
    def __init__(self, draft_model, draft_tokenizer, target_model, target_tokenizer, config, *,
                 kv_tokens: int, page_size: int, draft_name: str = "draft"):
        self.vocab = shared_vocab_size(target_tokenizer, draft_tokenizer, target_model.config, draft_model.config,
                                       draft_name=draft_name)
        d, t = draft_model.device, target_model.device
        if d.type != t.type or (d.index or 0) != (t.index or 0):  # "cuda" means cuda:0 here
            from minivllm.errors import ConfigError

            raise ConfigError("draft_model", draft_name, f"is on {draft_model.device} but the target is on "
                              f"{target_model.device}; load both on the engine's device")
        self.policy = parse_draft_policy(config.draft_policy, config.num_draft_tokens)
        self.tv_budget = config.tv_budget
        self.stop_ids = frozenset(target_tokenizer.eos_ids)
        self.draft_name = draft_name
        self.drafter = Drafter(draft_model, num_pages=-(-kv_tokens // page_size) + 1, page_size=page_size)
        self.totals = SpecStats()  # requests that have finished
        self.recent: deque[dict] = deque(maxlen=RECENT_ROUNDS)  # the latest rounds, for the widgets

    # -- per request ------------------------------------------------------------------------

    def attach(self, req) -> None:
        req.spec = SpecState(self.policy.new_controller())

    def wanted_tokens(self, req, max_model_len: int) -> int:
        """How many draft tokens the request's next decode row should carry: its
        controller's choice, capped so that a round (up to k + 1 tokens) stays within
        max_tokens and the context."""
        k = req.spec.controller.wanted()
        room = min(req.params.max_tokens - len(req.output_ids), max_model_len - req.num_tokens) - 1
        return max(0, min(k, room))

    def finished(self, req) -> None:
        """A speculating request finished: its figures move into the totals."""
        if req.spec is not None:
            self.totals.merge(req.spec.stats)

    # -- a step -----------------------------------------------------------------------------

    def verify(self, req, logits: torch.Tensor, proposal) -> RoundResult:
        """Check `proposal` (its `tokens`, and `q` when sampling) against the target's
        logits rows (len(proposal.tokens) + 1 of them)."""
        params, gen, vocab = req.params, req.generator, self.vocab
        committed, outputs = req.all_ids, req.output_ids
        tokens: list[int] = []
        tvs: list[float] = []
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.stop_ids)
        m = len(proposal.tokens)
        # A mentored budget may accept a draft token the target gives no mass to, which a
        # constrained request's masked logits say the constraint forbids: verify it exactly.
        budget = 0.0 if getattr(req, "constraint", None) is not None else self.tv_budget
        for i, x in enumerate(proposal.tokens):
            row = processed_logits(logits[i], committed + tokens, outputs + tokens, params, vocab)
            if params.greedy:
                verdict = verify_greedy(int(torch.argmax(row)), x)
            else:
                verdict = verify_sampled(filtered_probs(row, params), proposal.q[i], x, budget, gen)
                tvs.append(verdict.tv)
            tokens.append(verdict.token)
            if not verdict.accepted:
                return RoundResult(tokens, list(range(len(tokens))), i, m, False, tvs)
            if x in stops:  # the request ends at this token: no bonus
                return RoundResult(tokens, list(range(len(tokens))), i + 1, m, False, tvs)
        bonus, _ = choose(logits[m], committed + tokens, outputs + tokens, params, vocab, gen)
        tokens.append(bonus)
        return RoundResult(tokens, list(range(m + 1)), m, m, True, tvs)

    def record_round(self, req, result: RoundResult, step: int) -> None:
        """Count a verified round (before its tokens are appended: the request may finish
        on one of them, and its stats then move into the engine's totals)."""
        state = req.spec
        state.stats.record_round(result.proposed, result.accepted, result.bonus, result.tvs)
        state.controller.length.update(result.accepted, result.proposed)
        self.recent.append({"step": step, "request": req.id, "proposed": result.proposed,
                            "accepted": result.accepted, "bonus": result.bonus,
                            "tv_mean": sum(result.tvs) / len(result.tvs) if result.tvs else None})

    def record_plain(self, req) -> None:
        req.spec.stats.plain_steps += 1

    def record_step_time(self, timed: list, seconds: float, *, measured: bool) -> None:
        """Feed the pay-off gate one whole step: `timed` holds (request, round result or None
        for a plain step). The gate compares tokens per second of whole steps; a step that
        also ran a prefill chunk (measured=False) times the prompt, not speculation."""
        for req, result in timed:
            if req.status.value == "finished":
                continue
            tokens = 1 if result is None else len(result.tokens)
            self.record_time(req, tokens, seconds, speculative=result is not None, measured=measured)

    def record_time(self, req, tokens: int, seconds: float, *, speculative: bool, measured: bool) -> None:
        """Feed the pay-off gate one step of this request: `tokens` it got in `seconds`."""
        gate = req.spec.controller.gate
        if gate is None:
            return
        if speculative:
            gate.record_round(tokens, seconds, measured=measured and req.spec.catch_up <= 2)
        else:
            gate.record_plain(tokens, seconds, measured=measured)

    # -- inspection -------------------------------------------------------------------------

    def snapshot(self, active_requests, draft_runner) -> dict:
        """`draft_runner`: the model runner's draft side (its forwards, time and last error)."""
        totals = SpecStats()
        totals.merge(self.totals)
        for req in active_requests:
            if req.spec is not None:
                totals.merge(req.spec.stats)
        pool, draft = self.drafter.pool, draft_runner
        return {"enabled": True, "draft_model": self.draft_name, "policy": self.policy.name,
                "tv_budget": self.tv_budget, "shared_vocab": self.vocab, **totals.as_dict(),
                "draft_forwards": draft.forwards, "draft_tokens_computed": draft.tokens,
                "draft_seconds": draft.seconds,
                "draft_kv": {"total_pages": pool.num_pages, "free_pages": pool.num_free, "page_size": pool.page_size},
                "recent_rounds": list(self.recent), "last_error": draft.last_error}
