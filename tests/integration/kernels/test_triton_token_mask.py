"""The token-mask kernel (kernels/triton/token_mask.py) against the torch unpack it
replaces: llguidance-style bitmasks (bit t of word t // 32) with random bits, a vocabulary
that is not a multiple of 32 or of the block, and the last word's spare bits set, which
must not reach past the row. CPU runs Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from triton_devices import DEVICES  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.triton.token_mask import mask_rows_inplace  # noqa: E402
from minivllm.sampling.constraint import allowed_tokens, mask_logits  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [2085, 64])
def test_mask_rows_equals_the_torch_unpack(device, dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 5
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0  # a row with nothing allowed
    bitmask[2] = -1  # everything allowed, spare bits included
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    expected = mask_logits(logits, allowed_tokens(bitmask, vocab, torch.device("cpu")))
    out = mask_rows_inplace(logits.to(device), bitmask.to(device))
    assert torch.equal(out.cpu(), expected)
    assert torch.isinf(out[1]).all() and torch.equal(out[2].cpu(), logits[2])


@pytest.mark.parametrize("device", DEVICES)
def test_a_bitmask_too_short_for_the_row_is_refused(device):
    logits = torch.zeros(2, 100, device=device)
    with pytest.raises(ValueError, match="does not cover"):
        mask_rows_inplace(logits, torch.zeros(2, 3, dtype=torch.int32, device=device))
