"""The single-sequence reference of the engine tests: one request alone, through
`DecoderModel.forward` over a `ContiguousKVCache`, and the sampler with a fresh seeded
generator, with each decision's margin (sampling_margin.draw_margin). A path that batches,
restores cached pages or moves K/V between engines must give these tokens up to the
reference's first near-tie (`check_greedy`)."""

from __future__ import annotations

import contextlib

import torch
from sampling_margin import draw_margin

from minivllm import SamplingParams
from minivllm.cache.contiguous import ContiguousKVCache
from minivllm.sampling.sampler import make_generator, sample

_memo: dict = {}


@torch.inference_mode()
def reference_tokens(model, tokenizer, ids: list[int], params: SamplingParams, *, max_model_len: int,
                     kernel_options=None) -> tuple[list[int], list[float]]:
    """Ends at EOS / a stop token / max_tokens / max_model_len; stop strings are ignored. With
    `kernel_options`, the model runs under them (engines leave theirs on a shared model).
    Returns the tokens and the reference's margin at each; memoized per model and request."""
    key = (id(model), tuple(ids), params.temperature, params.top_k, params.top_p, params.min_p, params.seed,
           params.max_tokens, params.ignore_eos, tuple(params.stop_token_ids), params.repetition_penalty,
           max_model_len, repr(kernel_options))
    if key in _memo:
        return _memo[key]
    c = model.config
    n = min(params.max_tokens, max_model_len - len(ids))
    cache = ContiguousKVCache(c.n_layers, len(ids) + n, c.n_kv_heads, c.head_dim, model.dtype, model.device)
    generator = make_generator(params, torch.device("cpu"))
    out, margins = [], []
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_ids))
    with model.using(kernel_options) if kernel_options is not None else contextlib.nullcontext():
        logits = model.forward(torch.tensor(ids), 0, cache)
        for i in range(n):
            # greedy: the top-2 gap of the penalised logits; seeded: how close this draw came to another token
            margins.append(draw_margin(logits, ids + out, out, params, generator))
            token = sample(logits, ids + out, out, params, generator)
            out.append(token)
            if token in stops or i + 1 == n:
                break
            logits = model.forward(torch.tensor([token]), len(ids) + i, cache)
    _memo[key] = (out, margins)
    return out, margins


def check_greedy(got: list[int], want: list[int], margins: list[float], label: str, near_tie: float) -> int | None:
    """got == want, except from a flipped near-tie (reference margin < near_tie) on.
    Returns the tolerated index or None."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            print(f"{label}: token {i} differs (got {g}, reference {w}); reference margin {margins[i]:.3e}")
            assert margins[i] < near_tie, (f"{label}: token {i} is {g}, the single-sequence reference gives {w} "
                                           f"with top-2 margin {margins[i]:.3e} >= {near_tie}: not a near-tie")
            return i
    assert len(got) == len(want), f"{label}: {got} vs reference {want}"
    return None
