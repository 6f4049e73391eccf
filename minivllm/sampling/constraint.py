"""Token masks for constrained requests: one llguidance matcher per request.

A matcher follows the request's output token by token. It says which tokens may come
next, as a bitmask over the vocabulary (bit t of word t // 32), and the engine sets every
other logit to -inf, so greedy picks, top-k/top-p filters and the speculative verifier see
only tokens the constraint allows. It can also answer for one token (`allows`), which is
far cheaper than a mask: constrained_draw.py uses that to skip masks that cannot change
the draw, and step_draw.py computes the masks still needed at the draw all together.

The masks a step's constrained plain rows will read are computed once the forward is
queued (beside the device's work on a GPU) and applied in one launch. A row with no
allowed token can no longer satisfy its constraint and ends with an error.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from minivllm.errors import ConfigError
from minivllm.sampling.constrained_draw import draws_forced, mask_always_read
from minivllm.sampling.mask_upload import MaskUpload
from minivllm.sampling.structured import StructuredOutput, llguidance_module, short_text

BITS = 32
READY = "prepared_matcher"  # where `Constraints.prepare` leaves a matcher on its StructuredOutput


def first_line(error: str, limit: int = 300) -> str:
    """llguidance's error, short: its verbose errors go on to dump the parser's state and
    the grammar (200 KB for a large one), which no client error should carry."""
    lines = error.strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


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


_executors: list = []  # llguidance's thread pool, made once per process


def _executor():
    if not _executors:
        _executors.append(llguidance_module().LLExecutor())
    return _executors[0]


class TokenConstraint:
    """One request's matcher. `fill` writes the next-token mask; `advance` takes the token
    that was chosen; `stopped` is true once the output is complete."""

    def __init__(self, structured: StructuredOutput, ll_tokenizer, text_vocab: int, eos_ids, probe_ids=()):
        llg = llguidance_module()
        self.structured = structured
        self._probe_ids = tuple(probe_ids)  # word pieces for `looks_narrow`
        self._text_vocab = text_vocab  # ids at or past it are padding rows: never allowed
        self._eos_ids = frozenset(eos_ids)
        self.mask_cost_s = 0.0  # what the last mask took: how many candidates a check may try first
        self._checks_tokens: bool | None = None  # checks_tokens() at the current position, once asked
        self._forced: int | None | bool = False  # forced_token() there, once asked (False: not yet)
        self._matcher = llg.LLMatcher(ll_tokenizer, structured.grammar_text(), log_level=0)
        if self._matcher.is_error():
            raise ConfigError(f"structured.{structured.kind}", short_text(getattr(structured, structured.kind)),
                              f"does not compile for this model's vocabulary: {first_line(self._matcher.get_error())}")

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        t0 = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        self.mask_cost_s = time.perf_counter() - t0

    @staticmethod
    def fill_all(constraints: list[TokenConstraint], bitmask: torch.Tensor) -> None:
        """Row k of `bitmask` (contiguous, numpy-backed) gets constraints[k]'s mask, the
        rows computed in parallel by llguidance's thread pool, outside the GIL. Rows of
        a batch often reach the same kind of position in the same step (a schema's
        strings open together), so masks that cost ~1 ms each come due together; in
        parallel a step pays about the dearest one, not their sum."""
        first: dict[int, int] = {}  # a matcher listed twice (one request's rows) is computed once
        for k, c in enumerate(constraints):
            first.setdefault(id(c), k)
        if len(first) == 1:
            constraints[0].fill(bitmask, 0)
        else:
            t0 = time.perf_counter()
            _executor().unsafe_compute_mask_ptr([(constraints[k]._matcher, k) for k in first.values()],
                                                bitmask.data_ptr(), bitmask.shape[1] * bitmask.element_size(),
                                                bitmask.shape[0])
            elapsed = time.perf_counter() - t0  # a bound on each row's cost: what its checks may spend next
            for k in first.values():
                constraints[k].mask_cost_s = elapsed
        words = bitmask.numpy()
        for k, c in enumerate(constraints):
            if first[id(c)] != k:
                words[k] = words[first[id(c)]]

    def checks_tokens(self) -> bool:
        """Whether `allows` gives the mask's answer here. Not where the grammar forces text
        ahead: the mask then keeps to that text's canonical tokens (`{"` as one token, not
        `{` then `"`), while a token-by-token check would let any spelling of it through."""
        if self._checks_tokens is None:  # asked twice a step: by early_masks, then the draw
            self._checks_tokens = not self._matcher.compute_ff_bytes()
        return self._checks_tokens

    def forced_token(self) -> int | None:
        """The token the grammar forces next, or None. Where the grammar forces text,
        llguidance tokenizes it canonically, and its mask allows exactly the first of those
        tokens (tests/integration/engine/test_constrained_draw.py holds it to that on every
        position of its traces): the masked draw gives that token whatever the logits,
        greedy or sampled, so a forced row needs no mask, no argmax and no device round
        trip. About 9 us (it tokenizes the forced text), asked only where the cheap
        `checks_tokens` already found forced bytes, against ~30 us for the mask there."""
        if self._forced is False:
            tokens = None if self.checks_tokens() else self._matcher.compute_ff_tokens()
            self._forced = tokens[0] if tokens and tokens[0] < self._text_vocab else None
        return self._forced

    def looks_narrow(self) -> bool:
        """Whether a check of the model's top tokens would likely find nothing here, so the
        mask is worth computing beside the forward: none of a few common word pieces
        ("e", "the", ...) fits. Between a schema's strings (keys, commas, numbers) none
        does, and the mask is quick. Inside a string or free text they do, most tokens
        are allowed, and the mask is the expensive one (a walk of most of the token trie).
        Also judging narrow the last characters of a length-bounded string (where the
        longer pieces stop fitting) was measured to cost more than it saved on an H200:
        a batch's rows reach those positions in the same steps, and their masks, ~1 ms
        each, outlasted the forward. Only timing rides on this guess, never a token."""
        return bool(self._probe_ids) and not any(self.allows(t) for t in self._probe_ids)

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
            reason = first_line(self._matcher.get_error())
            if reason == "NoExtensionBias":
                reason = "no token of this model's vocabulary can continue it"
            raise Unsatisfiable(reason)

    def _moved(self) -> None:
        """The position changed: what was cached about it is stale."""
        self._checks_tokens = None
        self._forced = False

    def advance(self, token: int) -> None:
        self._moved()
        if not self._matcher.consume_token(token):
            raise Unsatisfiable(f"token {token} does not fit the {self.structured.kind} constraint: "
                                f"{first_line(self._matcher.get_error()) or 'rejected'}")

    def try_advance(self, token: int) -> bool:
        """Take `token` if it fits (for a look-ahead along a draft), leaving the matcher as
        it was otherwise."""
        self._moved()
        return self._matcher.try_consume_tokens([token]) == 1

    def rollback(self, n: int) -> None:
        if n:
            self._moved()
            self._matcher.rollback(n)

    @property
    def stopped(self) -> bool:
        """Complete: nothing but end-of-sequence can follow."""
        return self._matcher.is_stopped()


# The bitmasks live in numpy-backed tensors, and the host-side work on them (zeroing,
# stacking, the empty-row test) is numpy's: torch's CPU ops on them woke its intra-op
# thread pool and took ~1 ms each on the 16-core H200 host, against microseconds here
# (scripts/profile_structured_step.py), and a step did three. Copies to the GPU from
# this pageable memory are staged by the driver without waiting for the device.


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """Zeroed words for `rows` masks."""
    return torch.from_numpy(np.zeros((rows, (vocab + BITS - 1) // BITS), dtype=np.int32))


def allowed_tokens(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """Bool [rows, vocab]: which tokens each row's mask allows, unpacked on `device`."""
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(BITS, dtype=torch.int32, device=device)
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(words.shape[0], -1)[:, :vocab]


_kernel_state = {"mask_rows": None}  # the Triton kernel, once imported; False after it failed here


def mask_in_place(rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`rows` (a tensor of their own: overwritten) with forbidden tokens at -inf. On CUDA
    one Triton launch (kernels/triton/token_mask.py), else the torch unpack; the same
    result either way."""
    if rows.is_cuda and _kernel_state["mask_rows"] is not False:
        try:
            if _kernel_state["mask_rows"] is None:
                from minivllm.kernels.triton.token_mask import mask_rows_inplace
                _kernel_state["mask_rows"] = mask_rows_inplace
            return _kernel_state["mask_rows"](rows, bitmask.to(rows.device, non_blocking=True))
        except Exception as exc:  # noqa: BLE001 - no Triton, or it cannot compile here: the torch path
            warnings.warn(f"token masks: the Triton kernel is unavailable ({exc}); using torch ops", stacklevel=2)
            _kernel_state["mask_rows"] = False
    return rows.masked_fill_(~allowed_tokens(bitmask, rows.shape[-1], rows.device), float("-inf"))


PROBE_TEXTS = ("e", "a", "s", "the", " the")


def probe_tokens(tokenizer) -> tuple[int, ...]:
    """The ids of PROBE_TEXTS that this vocabulary spells as one token."""
    ids = set()
    for text in PROBE_TEXTS:
        try:
            spelled = tokenizer.encode(text, add_bos=False, parse_special=False)
        except Exception:  # noqa: BLE001 - a tokenizer without these texts just probes fewer
            continue
        if len(spelled) == 1:
            ids.add(spelled[0])
    return tuple(sorted(ids))


class Constraints:
    """The engine's side: builds each constrained request's matcher against the model's
    vocabulary, and masks its logits rows."""

    def __init__(self, tokenizer, vocab: int):
        self._tokenizer = tokenizer
        self.vocab = vocab
        self._probe_ids = probe_tokens(tokenizer)
        self._uploads: dict[torch.device, MaskUpload] = {}
        # How constrained tokens were drawn, for benches and the workbench: tokens the
        # grammar forced, rows masked beside the forward, rows masked at their draw,
        # draws settled by checking tokens.
        self.counts = {"forced": 0, "masked_ahead": 0, "masked_at_draw": 0, "checked": 0}

    def prepare(self, structured: StructuredOutput | None) -> None:
        """Build `structured`'s matcher now, for the `make` that follows. A worker calls it
        on a thread of its own (serving/matcher_builds.py): llguidance compiles without the
        GIL (up to ~1 s for the largest grammars constraint_limits.py lets through), so its
        step loop never waits on one request's grammar. A failure is kept and raised by
        `make`."""
        if structured is None or READY in structured.__dict__:
            return
        try:
            ready: TokenConstraint | ConfigError = self.make(structured)
        except ConfigError as exc:
            ready = exc
        structured.__dict__[READY] = ready

    def make(self, structured: StructuredOutput | None) -> TokenConstraint | None:
        if structured is None:
            return None
        ready = structured.__dict__.pop(READY, None)  # taken once: a reused StructuredOutput builds anew
        if isinstance(ready, ConfigError):
            raise ready
        if ready is not None:
            return ready
        tok = self._tokenizer
        eos = tok.eos_ids or ([tok.eos_id] if tok.eos_id is not None else [])
        return TokenConstraint(structured, llguidance_tokenizer(tok, self.vocab), min(tok.vocab_size, self.vocab), eos,
                               self._probe_ids)

    def early_masks(self, plain_rows, *, masked_logits_wanted: bool = False,
                    device_busy: bool = False) -> dict[str, torch.Tensor | Exception]:
        """The masks (bitmask rows) computed for the step's plain rows ((request, its row of
        the logits)) before their logits are read, or the exception that stops a row
        (Unsatisfiable when no token is left); verification rows are masked along their
        draft (`mask_along`). Called once the forward is queued: on a GPU
        (`device_busy`) the device is still computing it, so these masks cost the step
        nothing while they take less than it.

        Never the rows whose token the grammar forces (`draws_forced`). Always the rows
        that read their mask whatever they draw (top-k/top-p rows,
        logprobs, `masked_logits_wanted` for a logits hook) and those where the grammar
        forces text ahead, whose token no check can settle (`TokenConstraint.checks_tokens`).
        Beside a busy device, also the greedy rows whose mask looks narrow
        (`TokenConstraint.looks_narrow`): a check there would likely find nothing and
        cost a second device round trip for the mask at the draw. The other rows check
        candidate tokens at the draw (constrained_draw.py). Masking every row here, in
        case, was measured to cost more than it saved on an H200: the mask that opens a
        length-bounded string can take 4 ms, longer than the forward it was to hide
        behind. Sampled rows check even when narrow, so a seed's tokens never depend on
        where the step ran."""
        out: dict[str, torch.Tensor | Exception] = {}
        reqs = []
        for req, _ in plain_rows:
            if req.constraint is None:
                continue
            try:
                if not draws_forced(req, masked_logits_wanted) and (
                        masked_logits_wanted or mask_always_read(req.params) or not req.constraint.checks_tokens()
                        or (device_busy and req.params.greedy and req.constraint.looks_narrow())):
                    reqs.append(req)
            except Exception as exc:  # noqa: BLE001 - a matcher that fails to answer fails its row
                out[req.id] = exc
        if not reqs:
            return out
        try:
            bitmask, failures = self.fill_masks([req.constraint for req in reqs])
        except Exception as exc:  # noqa: BLE001 - these rows fail, not the step
            return {**out, **{req.id: exc for req in reqs}}
        return {**out, **{req.id: failure or bitmask[k] for k, (req, failure) in enumerate(zip(reqs, failures))}}

    def fill_masks(self, constraints: list[TokenConstraint]) -> tuple[torch.Tensor, list[Exception | None]]:
        """Each constraint's mask, computed now, as a row of one bitmask; and for each the
        Unsatisfiable that stops it if no token is left, else None."""
        bitmask = new_bitmask(len(constraints), self.vocab)
        TokenConstraint.fill_all(constraints, bitmask)
        failures: list[Exception | None] = []
        for k, constraint in enumerate(constraints):
            failures.append(None)
            try:
                constraint.check()
            except Unsatisfiable as exc:
                failures[k] = exc
        for k, any_allowed in enumerate(bitmask.numpy().any(axis=1).tolist()):
            if not any_allowed and failures[k] is None:
                failures[k] = Unsatisfiable("no token can continue the output within the constraint")
        return bitmask, failures

    def apply(self, bitmask_rows: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """`rows` (stacked for this: overwritten) with row k masked by bitmask_rows[k], in
        one launch on a GPU, whose bitmask is sent beside the forward (mask_upload.py)."""
        if not rows.is_cuda:
            return mask_in_place(rows, torch.from_numpy(np.stack([r.numpy() for r in bitmask_rows])))
        upload = self._uploads.get(rows.device)
        if upload is None:
            upload = self._uploads[rows.device] = MaskUpload(rows.device)
        masked = mask_in_place(rows, upload.send(bitmask_rows))
        upload.done_reading()
        return masked

    def mask_now(self, constraint: TokenConstraint, row_logits: torch.Tensor) -> torch.Tensor:
        """One row masked here; raises Unsatisfiable when no token is left."""
        bitmask, (failure,) = self.fill_masks([constraint])
        if failure is not None:
            raise failure
        return self.apply([bitmask[0]], row_logits[None].clone())[0]

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
                bitmask.numpy()[r + 1:] = bitmask.numpy()[r]
                break
            taken += 1
        constraint.rollback(taken)
        if not bitmask.numpy()[0].any():
            raise Unsatisfiable("no token can continue the output within the constraint")
        return mask_in_place(logits.clone(), bitmask)
