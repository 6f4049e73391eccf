"""Paged-attention test cases shared by the kernel's test files: the test device (the
interpreter on CPU, the compiled kernel on CUDA), scattered K/V pages with their block
tables, and the float64 reference."""

from __future__ import annotations

import pytest
import torch
from triton_devices import INTERPRETED

HEAD_DIM = 64
# (heads, KV heads, head_dim) of Qwen2.5-7B and Qwen2.5-0.5B.
MODEL_SHAPES = [pytest.param(28, 4, 128, id="7B"), pytest.param(14, 2, 64, id="0.5B")]


def kernel_device(name: str) -> torch.device:
    """The device a `device`-parametrized kernel test runs on; a CUDA variant refuses to
    run the interpreter in place of the compiled kernel."""
    if name == "cuda" and INTERPRETED:
        pytest.fail("TRITON_INTERPRET=1 was set before the kernel was imported, so this CUDA test would run the "
                    "interpreter instead of the compiled kernel; run this file on its own without TRITON_INTERPRET")
    return torch.device(name)


def scattered_pages(*, seq_lens: list[int], page_size: int, kvh: int, dtype: torch.dtype, device, seed: int,
           head_dim: int = HEAD_DIM, width: int | None = None):
    """Random K/V pages and block tables whose pages are scattered and out of order
    (a permutation of the pool), padded with a junk page id to `width` pages (default:
    one more than the longest table; a CUDA graph's tables are max_model_len wide)."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(n_pages) + 3  # a few pages nobody owns
    k = torch.randn(num_pages, page_size, kvh, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_pages, page_size, kvh, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for n in n_pages:
        tables.append(order[used:used + n])
        used += n
    width = width or max(n_pages) + 1
    padded = [t + [order[-1]] * (width - len(t)) for t in tables]
    block_tables = torch.tensor(padded, dtype=torch.int32)
    return k.to(device), v.to(device), block_tables.to(device), tables


def sequence_kv(pages: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    """A sequence's first n keys gathered in order, through plain torch indexing."""
    return pages[torch.tensor(table, device=pages.device)].reshape(-1, *pages.shape[2:])[:n]


def plain_attention(q_row: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 softmax(q kᵀ / √d) v for one query row (H, D) over all of k/v (S, KVH, D)."""
    h, d = q_row.shape
    g = h // k.shape[1]
    k64 = k.double().repeat_interleave(g, dim=1).transpose(0, 1)  # (H, S, D)
    v64 = v.double().repeat_interleave(g, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,hsd->hs", q_row.double(), k64) / d ** 0.5
    return torch.einsum("hs,hsd->hd", torch.softmax(scores, dim=-1), v64)
