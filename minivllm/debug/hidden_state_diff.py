"""Replay a token sequence under two engines' kernel options and diff their residual streams.

Why a replay: the engine keeps no hidden states, and the difference that flips a
token is usually made long before the flip and carried in the KV cache (the
original engine's finding). So both sides recompute the common prefix the way their
engine computed it for a lone request: the prompt in chunks of `max_batched_tokens`
(prefill rows take the GEMM or GEMV path by chunk size), then one row per generated
token (decode). Same rows per call means the same kernel path as in the engine.

The two replays advance in lockstep and are compared chunk by chunk, so memory stays
at about one chunk of hidden states per side however long the prefix is. A replay is
any iterator of `ReplayChunk`s in sequence order (`engine_replay` here; transformers'
in reference_sides.py), so `diff_replays` also compares minivllm against another
engine, or two devices (rows are compared on the CPU when the sides' devices differ).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from minivllm.cache.contiguous import ContiguousKVCache
from minivllm.debug.divergence_report import LayerDiff
from minivllm.errors import MinivllmError


def engine_forward_schedule(n_prompt: int, n_total: int, chunk: int) -> list[tuple[int, int]]:
    """(start, rows) of each forward the engine runs for a lone request of n_total tokens:
    the prompt in chunks of `chunk`, then one decode row per later token."""
    calls = []
    start = 0
    while start < n_prompt:
        n = min(chunk, n_prompt - start)
        calls.append((start, n))
        start += n
    calls += [(pos, 1) for pos in range(n_prompt, n_total)]
    return calls


@dataclass
class ReplayChunk:
    start: int  # sequence position of the chunk's first row
    hidden: torch.Tensor  # (n_layers + 1, rows, d_model) float32: the embedding, then the residual after each layer
    logits: torch.Tensor  # (vocab,) float32, for the chunk's last row


def engine_replay(llm, token_ids: list[int], n_prompt: int) -> Iterator[ReplayChunk]:
    """`llm`'s forward over `token_ids` on its engine's schedule for a lone request."""
    model = llm.model
    cfg = model.config
    options = llm.engine.kernel_options
    cache = ContiguousKVCache(cfg.n_layers, len(token_ids), cfg.n_kv_heads, cfg.head_dim, model.dtype, model.device)
    ids = torch.tensor(token_ids, device=model.device)
    for start, n in engine_forward_schedule(n_prompt, len(token_ids), llm.engine.config.max_batched_tokens):
        hidden: list[torch.Tensor] = []
        # `using` is entered per call, not around the loop: the other side's replay runs
        # between our calls, under its own options.
        with model.using(options):
            logits = model.forward(ids[start:start + n], start, cache, hidden_states=hidden)
        yield ReplayChunk(start, torch.stack(hidden), logits)


class _LayerDiffAccumulator:
    """Per-layer max |Δ|, sums of squares and first differing position, over rows added in order."""

    def __init__(self, n_entries: int, device: torch.device):
        self.max_abs = torch.zeros(n_entries, dtype=torch.float64, device=device)
        self.sq_diff = torch.zeros(n_entries, dtype=torch.float64, device=device)
        self.sq_ref = torch.zeros(n_entries, dtype=torch.float64, device=device)
        self.first_pos: list[int | None] = [None] * n_entries

    def add(self, start: int, ha: torch.Tensor, hb: torch.Tensor) -> None:
        diff = (hb - ha).double()
        row_max = diff.abs().amax(dim=-1)  # (entries, rows)
        self.max_abs = torch.maximum(self.max_abs, row_max.amax(dim=-1))
        self.sq_diff += diff.square().sum(dim=(1, 2))
        self.sq_ref += ha.double().square().sum(dim=(1, 2))
        differs = row_max > 0
        any_row = differs.any(dim=-1).tolist()
        first_row = differs.int().argmax(dim=-1).tolist()  # index of the first True
        for i, (hit, row) in enumerate(zip(any_row, first_row)):
            if hit and self.first_pos[i] is None:
                self.first_pos[i] = start + row


def _rel_l2(sq_diff: float, sq_ref: float) -> float:
    if sq_ref > 0:
        return (sq_diff / sq_ref) ** 0.5
    return 0.0 if sq_diff == 0 else float("inf")


def layer_names(n_layers: int) -> list[str]:
    return ["embedding"] + [f"layer {i}" for i in range(n_layers)]


def diff_hidden_states(llm_a, llm_b, token_ids: list[int], n_prompt: int,
                       ) -> tuple[list[LayerDiff], torch.Tensor, torch.Tensor]:
    """Per-layer differences of b's residual stream from a's over `token_ids`, both
    minivllm `LLM`s replayed on their engines' schedules.

    Returns the layer diffs and each side's float32 logits for the last row (the
    split), which the caller checks against what the engine saw.
    """
    return diff_replays(engine_replay(llm_a, token_ids, n_prompt), engine_replay(llm_b, token_ids, n_prompt),
                        len(token_ids))


def diff_replays(replay_a: Iterator[ReplayChunk], replay_b: Iterator[ReplayChunk], total: int,
                 ) -> tuple[list[LayerDiff], torch.Tensor, torch.Tensor]:
    """`diff_hidden_states` over two replays of the same `total` tokens."""
    replays = {"a": replay_a, "b": replay_b}
    pending: dict[str, list[ReplayChunk]] = {"a": [], "b": []}
    covered = {"a": 0, "b": 0}
    last_logits: dict[str, torch.Tensor] = {}
    acc: _LayerDiffAccumulator | None = None
    split_a = split_b = None
    done = 0
    while done < total:
        side = "a" if covered["a"] <= covered["b"] else "b"
        chunk = next(replays[side])
        pending[side].append(chunk)
        covered[side] = chunk.start + chunk.hidden.shape[1]
        last_logits[side] = chunk.logits
        upto = min(covered.values())
        if upto <= done:
            continue
        ha, hb = (_take_rows(pending[s], done, upto) for s in ("a", "b"))
        if ha.shape[0] != hb.shape[0] or ha.shape[-1] != hb.shape[-1]:
            raise MinivllmError(f"the sides' hidden states do not line up: a has {ha.shape[0]} entries of width "
                                f"{ha.shape[-1]}, b {hb.shape[0]} of width {hb.shape[-1]}")
        if ha.device != hb.device:
            ha, hb = ha.cpu(), hb.cpu()
        if acc is None:
            acc = _LayerDiffAccumulator(ha.shape[0], ha.device)
        acc.add(done, ha, hb)
        if upto == total:
            split_a, split_b = ha[:, -1], hb[:, -1]
        done = upto

    diff = (split_b - split_a).double()
    split_max = diff.abs().amax(dim=-1).tolist()
    split_sq = diff.square().sum(dim=-1).tolist()
    split_ref = split_a.double().square().sum(dim=-1).tolist()
    names = layer_names(acc.max_abs.shape[0] - 1)
    prefix_max, prefix_sq, prefix_ref = acc.max_abs.tolist(), acc.sq_diff.tolist(), acc.sq_ref.tolist()
    diffs = [
        LayerDiff(layer=names[i], at_split_max_abs=split_max[i], at_split_rel_l2=_rel_l2(split_sq[i], split_ref[i]),
                  prefix_max_abs=prefix_max[i], prefix_rel_l2=_rel_l2(prefix_sq[i], prefix_ref[i]),
                  first_differing_position=acc.first_pos[i])
        for i in range(len(names))
    ]
    return diffs, last_logits["a"], last_logits["b"]


def _take_rows(chunks: list[ReplayChunk], lo: int, hi: int) -> torch.Tensor:
    """Rows lo..hi-1 of the pending chunks (dropping chunks that end at or before hi)."""
    parts = []
    for c in chunks:
        end = c.start + c.hidden.shape[1]
        a, b = max(lo, c.start), min(hi, end)
        if a < b:
            parts.append(c.hidden[:, a - c.start:b - c.start])
    chunks[:] = [c for c in chunks if c.start + c.hidden.shape[1] > hi]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
