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
