"""Turn one row of logits into one token, following a request's `SamplingParams`.

Order of operations (same as vLLM/llama.cpp): the request's logit_bias on raw logits,
then penalties, then
temperature, then the top-k / top-p / min-p filters, then a draw from the request's
own generator. A per-request generator is what makes a seed reproduce the same
tokens whatever else shares the batch.
"""

from __future__ import annotations

import torch

from minivllm.sampling.sampling_params import SamplingParams


def adjusts_logits(p: SamplingParams) -> bool:
    """Whether `apply_penalties` changes a row for these params (a bias or a penalty)."""
    return bool(p.logit_bias) or p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)


def apply_logit_bias(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Add the request's logit_bias to its tokens' logits, in place. Ids past the row's
    end (a draft's shorter shared vocabulary) have no logit here and are left out."""
    if p.logit_bias:
        n = logits.shape[-1]
        pairs = [(t, b) for t, b in p.logit_bias.items() if t < n]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], device=logits.device)
            logits[ids] += torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
    return logits


def apply_penalties(
    logits: torch.Tensor, context_ids: list[int], output_ids: list[int], p: SamplingParams
) -> torch.Tensor:
    """The logit_bias, then the repetition / presence / frequency penalties, in place: every
    draw (plain, batched, constrained, speculative verification and drafts) goes through here."""
    apply_logit_bias(logits, p)
    if p.repetition_penalty != 1.0 and context_ids:
        window = context_ids[-p.repetition_window:] if p.repetition_window else context_ids
        ids = torch.tensor(sorted(set(window)), device=logits.device)
        seen = logits[ids]
        # Divide positive logits, multiply negative ones: both make the token less likely.
        penalized = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        # An extreme (but finite, valid) penalty like 1e-300 overflows to inf; keep the
        # order it means without an inf that would turn the softmax into NaN.
        big = torch.finfo(logits.dtype).max
        logits[ids] = penalized.nan_to_num(posinf=big, neginf=-big)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        ids, counts = torch.tensor(output_ids, device=logits.device).unique(return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from (float32, sums to 1)."""
    logits = logits.float()
    # Shift so the largest logit is 0 before dividing: the softmax is the same, and a tiny
    # temperature (1e-30) then sends the others to -inf instead of everything to +inf / NaN.
    # The temperature is floored at float32's smallest normal number: a denormal like
    # 5e-324 rounds to 0 in float32 and 0/0 would be NaN; at 1.2e-38 every logit below the
    # top one still goes to -inf, so the result is the same (greedy, ties kept).
    logits = (logits - logits.max()) / max(p.temperature, torch.finfo(torch.float32).tiny)
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass
        # *before* it is still below top_p.
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop = before >= p.top_p
        drop[0] = False  # the most likely token always stays (a top_p below float32's range would drop all)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def make_generator(p: SamplingParams, device: torch.device) -> torch.Generator | None:
    if p.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def sample(logits: torch.Tensor, context_ids: list[int], output_ids: list[int], p: SamplingParams,
           generator: torch.Generator | None) -> int:
    logits = apply_penalties(logits.clone(), context_ids, output_ids, p)
    if p.greedy:
        return int(torch.argmax(logits).item())
    return int(sampled_on_device(logits, p, generator).item())


def sampled_on_device(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """A non-greedy draw from `logits` (penalties already applied), left on the device as a
    (1,) int64 tensor: nothing waits for it (async scheduling feeds it to the next step)."""
    return torch.multinomial(filtered_probs(logits, p), 1, generator=generator)


def top_logprobs(logits: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """Log-probabilities of the model's own distribution (before penalties and filters):
    the `n` most likely tokens plus the sampled one."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = {}
    if n:
        values, ids = torch.topk(logp, n)
        out = {int(i): float(v) for i, v in zip(ids.tolist(), values.tolist())}
    out[token] = float(logp[token])
    return out
