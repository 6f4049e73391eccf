"""Reference causal attention over a request's cached keys and values.

Scores and softmax run in float32 whatever the activation dtype (f16 softmax
saturates on long contexts). Grouped-query attention is handled by SDPA's
`enable_gqa`, so K/V heads are never materialised `n_heads / n_kv_heads` times.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """q: (T, H, D) for positions q_start..q_start+T-1; k, v: (S, KVH, D) for positions 0..S-1.

    Returns (T, H, D) in q's dtype. Query i sees keys 0..q_start+i.
    """
    t, s = q.shape[0], k.shape[0]
    if t == 1 and q_start == s - 1:
        return _one_query(q, k, v)
    qf = q.float().transpose(0, 1)  # (H, T, D)
    kf = k.float().transpose(0, 1)
    vf = v.float().transpose(0, 1)
    if q_start == 0 and t == s:
        out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
    else:
        q_pos = torch.arange(q_start, q_start + t, device=q.device)[:, None]
        k_pos = torch.arange(s, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=k_pos <= q_pos, enable_gqa=True)
    return out.transpose(0, 1).to(q.dtype)


def _one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A decode row: one query over every key, no mask needed. Two grouped bmm calls:
    on CPU, SDPA's math path with a mask costs ~5x more for one row (266 vs 48 µs for
    SmolLM2's 9 heads at 40 keys), and a decode step makes one call per layer."""
    _, h, d = q.shape
    kvh = k.shape[1]
    if q.device.type == "cpu" and k.dtype == torch.float32 and v.dtype == torch.float32:
        from minivllm.kernels.cpu_gemv import attend_decode

        out = attend_decode(q, k, v)  # the same float32 math in one compiled call, or None
        if out is not None:
            return out
    qf = q.float().view(kvh, h // kvh, d) * d ** -0.5  # query heads grouped under their KV head
    probs = torch.softmax(torch.bmm(qf, k.float().permute(1, 2, 0)), dim=-1)  # (KVH, G, S)
    return torch.bmm(probs, v.float().permute(1, 0, 2)).reshape(1, h, d).to(q.dtype)
