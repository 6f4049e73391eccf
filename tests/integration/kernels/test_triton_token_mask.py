"""The token-mask kernel (kernels/triton/token_mask.py), and the torch path it replaces,
against the bit layout read out in numpy: llguidance-style bitmasks (bit t of word
t // 32) with random bits, a vocabulary that is not a multiple of 32 or of the block, and
the last word's spare bits set, which must not reach past the row. CPU runs Triton's
interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_devices import DEVICES  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.triton.token_mask import mask_rows_inplace  # noqa: E402
from minivllm.sampling.constraint import mask_in_place  # noqa: E402


def _reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Token t of row r stays iff bit t % 32 of word t // 32 is set, read out in numpy."""
    vocab = logits.shape[1]
    words = bitmask.numpy().view(np.uint32)
    t = np.arange(vocab)
    keep = (words[:, t // 32] >> (t % 32).astype(np.uint32)) & 1
    return torch.where(torch.from_numpy(keep.astype(bool)), logits, torch.tensor(float("-inf"), dtype=logits.dtype))


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
    expected = _reference(logits, bitmask)
    out = mask_rows_inplace(logits.to(device), bitmask.to(device))
    assert torch.equal(out.cpu(), expected)
    assert torch.isinf(out[1]).all() and torch.equal(out[2].cpu(), logits[2])
    assert torch.equal(mask_in_place(logits.clone(), bitmask), expected)  # the torch path on CPU


@pytest.mark.parametrize("device", DEVICES)
def test_a_bitmask_too_short_for_the_row_is_refused(device):
    logits = torch.zeros(2, 100, device=device)
    with pytest.raises(ValueError, match="does not cover"):
        mask_rows_inplace(logits, torch.zeros(2, 3, dtype=torch.int32, device=device))


@pytest.mark.cuda
def test_masks_sent_beside_queued_work_arrive_whole():
    """MaskUpload (sampling/mask_upload.py) reuses its pinned and device buffers and copies
    on a side stream while the compute stream is busy: each step's rows must be masked by
    that step's bits, with steps of different sizes queued back to back, the buffer
    growing, and nothing synchronized between them but what the class does itself."""
    from minivllm.sampling.mask_upload import MaskUpload

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    vocab = 5003
    words = (vocab + 31) // 32
    upload = MaskUpload(device)
    busy = torch.randn(2048, 2048, device=device)
    results = []
    for n in (3, 16, 1, 24, 7, 16):
        for _ in range(4):  # work queued ahead, as the forward is
            busy = busy @ busy / busy.norm()
        bitmask = torch.randint(-2**31, 2**31 - 1, (n, words), generator=gen, dtype=torch.int64).to(torch.int32)
        logits = torch.randn(n, vocab, generator=gen)
        rows = [torch.from_numpy(bitmask.numpy()[k].copy()) for k in range(n)]
        masked = mask_in_place(logits.to(device), upload.send(rows))
        upload.done_reading()
        results.append((masked, _reference(logits, bitmask)))
    for masked, expected in results:
        assert torch.equal(masked.cpu(), expected)
