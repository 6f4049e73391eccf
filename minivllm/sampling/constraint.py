"""Token masks for constrained requests: one llguidance matcher per request.

A matcher follows the request's output token by token. It says which tokens may come
next, as a bitmask over the vocabulary (bit t of word t // 32), and the engine sets every
other logit to -inf, so greedy picks, top-k/top-p filters and the speculative verifier see
only tokens the constraint allows. It can also answer for one token (`allows`), which is
far cheaper than a mask: constrained_draw.py uses that to skip masks that cannot change
the draw.

A step's constrained plain rows get their masks on a background thread (llguidance drops
the GIL), started before the forward and collected after it, then applied in one
masked_fill: always for the rows that read their mask, and for the others while the
forward runs if their last mask was cheap. A row with no allowed token can no longer
satisfy its constraint and ends with an error.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from minivllm.errors import ConfigError
from minivllm.sampling.structured import StructuredOutput, llguidance_module, short_text
from minivllm.sampling.constrained_draw import draw_constrained, mask_always_read

BITS = 32


class Unsatisfiable(Exception):
    """No token can extend the output within the constraint."""


def llguidance_tokenizer(tokenizer, n_vocab: int):
    """llguidance's view of our vocabulary: every id's bytes, control tokens marked with a
    leading 0xFF (llguidance's convention for "special, never text"), ids past the
    tokenizer's vocabulary (padding rows of the output matrix) as empty tokens it never
    allows. Built once per tokenizer and vocabulary width (~0.1 s for 49k tokens)."""
    cache = tokenizer.__dict__.setdefault("_llguidance_tokenizers", {})
    if n_vocab in cache:
        return cache[n_vocab]
    llg = llguidance_module()
    pieces = []
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.token_bytes(i)
        pieces.append(b"\xff" + piece if tokenizer.is_special(i) else piece)
    pieces += [b""] * max(0, n_vocab - len(pieces))

    class _Vocabulary:  # the duck type llguidance.TokenizerWrapper reads
        eos_token_id = tokenizer.eos_id
        bos_token_id = tokenizer.bos_id
        tokens = pieces
        special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]

        def __call__(self, text):
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            return tokenizer.encode(text, add_bos=False, parse_special=False)

    eos = sorted(tokenizer.eos_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else None)
    built = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary()), n_vocab=n_vocab, eos_token=eos)
    cache[n_vocab] = built
    return built


class TokenConstraint:
    """One request's matcher. `fill` writes the next-token mask; `advance` takes the token
    that was chosen; `stopped` is true once the output is complete."""

    def __init__(self, structured: StructuredOutput, ll_tokenizer, text_vocab: int, eos_ids):
        llg = llguidance_module()
        self.structured = structured
        self._text_vocab = text_vocab  # ids at or past it are padding rows: never allowed
        self._eos_ids = frozenset(eos_ids)
        self.mask_cost_s = 0.0  # what the last mask took: decides whether one is computed ahead
        self._matcher = llg.LLMatcher(ll_tokenizer, structured.grammar_text(), log_level=0)
        if self._matcher.is_error():
            raise ConfigError(f"structured.{structured.kind}", short_text(getattr(structured, structured.kind)),
                              f"does not compile for this model's vocabulary: {self._matcher.get_error()}")

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        t0 = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        self.mask_cost_s = time.perf_counter() - t0

    def checks_tokens(self) -> bool:
        """Whether `allows` gives the mask's answer here. Not where the grammar forces text
        ahead: the mask then keeps to that text's canonical tokens (`{"` as one token, not
        `{` then `"`), while a token-by-token check would let any spelling of it through."""
        return not self._matcher.compute_ff_bytes()

    def allows(self, token: int) -> bool:
        """Whether the next mask would allow `token` (where `checks_tokens()`), asked without
        computing it: a few microseconds, against up to ~1.5 ms for a mask inside a
        length-bounded string. End-of-sequence is allowed once the output is complete;
        tests/integration/engine/test_constrained_draw.py compares the answers with the mask."""
        if token >= self._text_vocab:
            return False
        if token in self._eos_ids:
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token]) == 1

    def check(self) -> None:
        """Raise Unsatisfiable if the last `fill` found no way on. (llguidance then goes
        into an error state and allows only end-of-sequence, which would end the request
        as if its output were complete.)"""
        if self._matcher.is_error():
            reason = self._matcher.get_error().strip().splitlines()[0]
            if reason == "NoExtensionBias":
                reason = "no token of this model's vocabulary can continue it"
            raise Unsatisfiable(reason)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise Unsatisfiable(f"token {token} does not fit the {self.structured.kind} constraint: "
                                f"{self._matcher.get_error() or 'rejected'}")

    def try_advance(self, token: int) -> bool:
        """Take `token` if it fits (for a look-ahead along a draft), leaving the matcher as
        it was otherwise."""
        return self._matcher.try_consume_tokens([token]) == 1

    def rollback(self, n: int) -> None:
        if n:
            self._matcher.rollback(n)

    @property
    def stopped(self) -> bool:
        """Complete: nothing but end-of-sequence can follow."""
        return self._matcher.is_stopped()


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    return torch.zeros((rows, (vocab + BITS - 1) // BITS), dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """Bool [rows, vocab]: which tokens each row's mask allows, unpacked on `device`."""
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(BITS, dtype=torch.int32, device=device)
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(words.shape[0], -1)[:, :vocab]


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~allowed, float("-inf"))


# A row whose mask is optional (its token is checked first, see constrained_draw.py) gets
# it computed ahead only if its last mask was cheaper than this: outside strings masks take
# 5-100 us, inside a length-bounded string ~1.5 ms on a 152k vocabulary (measured with
# Qwen2.5's), which would keep the step waiting after the forward.
CHEAP_MASK_S = 0.25e-3


class StepMasks:
    """The masks of one step's plain constrained rows, computed on the mask thread while
    the forward runs and applied to those rows of the step's logits in one masked_fill.

    A row that reads its mask whatever it draws (`needed`: top-k/top-p rows, logprobs, a
    logits hook) always gets one. The others get one only while the forward still runs,
    cheapest first, and only when their last mask was cheap; without one, their draw asks
    the matcher about its candidate tokens instead and computes the mask only if none fits."""

    def __init__(self, pool: ThreadPoolExecutor | None, rows: dict[str, tuple[TokenConstraint, int, bool]], vocab: int):
        self._rows = rows  # request id -> (its constraint, its row of the step's logits, needed)
        self._vocab = vocab
        self._bitmask = new_bitmask(len(rows), vocab)
        self._forward_done = threading.Event()
        self._filled: list[int] = []  # indices into rows whose mask is in the bitmask
        jobs = sorted(enumerate(rows.values()), key=lambda job: (not job[1][2], job[1][0].mask_cost_s))

        def fill() -> None:  # llguidance drops the GIL while it computes a mask
            for j, (constraint, _, needed) in jobs:
                if needed or (constraint.mask_cost_s < CHEAP_MASK_S and not self._forward_done.is_set()):
                    constraint.fill(self._bitmask, j)
                    self._filled.append(j)

        self._future = pool.submit(fill) if rows else None

    def masked_rows(self, logits: torch.Tensor) -> dict[str, torch.Tensor | Exception]:
        """The rows masked so far, with forbidden tokens at -inf, or the exception that
        stops them (Unsatisfiable when no token is left). Rows left out have no mask yet."""
        if self._future is None:
            return {}
        self._forward_done.set()  # the optional masks not started yet are left to the draw
        ids = list(self._rows)
        try:
            self._future.result()
            if not self._filled:
                return {}
            filled = sorted(self._filled)
            bitmask = self._bitmask[filled]
            empty = (bitmask == 0).all(dim=1).tolist()
            index = torch.tensor([self._rows[ids[j]][1] for j in filled], device=logits.device)
            masked = mask_logits(logits.index_select(0, index), allowed_tokens(bitmask, self._vocab, logits.device))
        except Exception as exc:  # noqa: BLE001 - the rows fail, not the step
            return dict.fromkeys(self._rows, exc)
        out: dict[str, torch.Tensor | Exception] = {}
        for k, j in enumerate(filled):
            constraint = self._rows[ids[j]][0]
            try:
                constraint.check()
                if empty[k]:
                    raise Unsatisfiable("no token can continue the output within the constraint")
                out[ids[j]] = masked[k]
            except Unsatisfiable as exc:
                out[ids[j]] = exc
        return out


class Constraints:
    """The engine's side: builds each constrained request's matcher against the model's
    vocabulary, and masks its logits rows."""

    def __init__(self, tokenizer, vocab: int):
        self._tokenizer = tokenizer
        self.vocab = vocab
        self._pool: ThreadPoolExecutor | None = None  # computes the step's masks beside the forward
        # How constrained tokens were drawn, for benches and the workbench: rows masked
        # beside the forward, rows masked at their draw, draws settled by checking tokens.
        self.counts = {"masked_ahead": 0, "masked_at_draw": 0, "checked": 0}
        # One mask thread: measured on the H200 (scripts/structured_mask_threads.py at
        # commit 0d22810), a batch of 16 under a free-string schema ran at 0.94x
        # unconstrained with one thread, 0.80x with 8 and 0.82x with 15: the threads
        # contend with torch's and with each other.

    def make(self, structured: StructuredOutput | None) -> TokenConstraint | None:
        if structured is None:
            return None
        tok = self._tokenizer
        eos = tok.eos_ids or ([tok.eos_id] if tok.eos_id is not None else [])
        return TokenConstraint(structured, llguidance_tokenizer(tok, self.vocab), min(tok.vocab_size, self.vocab), eos)

    def start_step(self, plan_rows, *, masked_logits_wanted: bool = False) -> StepMasks:
        """Start the masks of the step's plain rows (`ScheduledStep.rows`, after drafting)
        whose request is constrained; verification rows are masked along their draft.
        `masked_logits_wanted`: something (a logits hook) reads every masked row."""
        rows, li = {}, 0
        for row in plan_rows:
            if not row.needs_logits:
                continue
            if row.draft_tokens:
                li += row.draft_tokens + 1
                continue
            req = row.request
            if req.constraint is not None:
                needed = masked_logits_wanted or mask_always_read(req.params)
                rows[req.id] = (req.constraint, li, needed)
            li += 1
        if rows and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="minivllm-masks")
        return StepMasks(self._pool, rows, self.vocab)

    def draw(self, req, row_logits: torch.Tensor, masked: torch.Tensor | None,
             want_masked: bool) -> tuple[int, torch.Tensor]:
        """The constrained row's token (`constrained_draw.draw_constrained`) and the logits
        it reports: the masked row where it was computed, else the raw one."""
        ready = masked is not None

        def mask_now() -> torch.Tensor:
            self.counts["masked_at_draw"] += 1
            return self.mask_now(req.constraint, row_logits)

        token, masked = draw_constrained(req, row_logits, masked, mask_now, want_masked=want_masked)
        self.counts["masked_ahead"] += ready
        self.counts["checked"] += masked is None
        return token, masked if masked is not None else row_logits

    def mask_now(self, constraint: TokenConstraint, row_logits: torch.Tensor) -> torch.Tensor:
        """One row, computed here (a follower's first token, a row outside a step's batch)."""
        bitmask = new_bitmask(1, self.vocab)
        constraint.fill(bitmask, 0)
        constraint.check()
        if not bool((bitmask != 0).any()):
            raise Unsatisfiable("no token can continue the output within the constraint")
        return mask_logits(row_logits, allowed_tokens(bitmask, self.vocab, row_logits.device)[0])

    def mask_along(self, constraint: TokenConstraint, logits: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """Rows 0..len(draft) of a verification: row r masked for the output extended by
        the first r draft tokens. Past a draft token the constraint forbids, the verifier
        rejects at that row and never reads the later ones (their mask repeats)."""
        n = logits.shape[0]
        bitmask = new_bitmask(n, self.vocab)
        taken = 0
        for r in range(n):
            constraint.fill(bitmask, r)
            if r == 0:
                constraint.check()
            if r == n - 1 or not constraint.try_advance(draft[r]):
                bitmask[r + 1:] = bitmask[r]
                break
            taken += 1
        constraint.rollback(taken)
        if not bool((bitmask[0] != 0).any()):
            raise Unsatisfiable("no token can continue the output within the constraint")
        return mask_logits(logits, allowed_tokens(bitmask, self.vocab, logits.device))
