"""A perturbed copy of a model, as a draft that agrees with its target often but not always.

Speculative decoding needs a draft with the target's tokenizer. Where no smaller model of
the family is at hand (the quick mode of `notebooks/speculative.ipynb`, tests on a small
CPU), the target's own file loaded a second time, with the final RMSNorm's per-channel gain
multiplied by `1 + noise * N(0, 1)`, is one: its greedy choice is usually the target's, its
distribution is not (the TV distance grows with `noise`), so acceptance, the TV budgets of
mentored decoding and the adaptive policies all have something to show. The target is never
touched: the copy is its own `DecoderModel` (the weights are mapped from the file
copy-on-write; only the 1-D norm gain is new).
"""

from __future__ import annotations

from pathlib import Path

import torch

from minivllm.gguf.reader import GGUFFile
from minivllm.model.decoder import DecoderModel
from minivllm.model.loader import load_model


def perturbed_copy(path: str | Path, *, noise: float = 1.0, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> DecoderModel:
    """The model in `path` (a .gguf file) loaded again with a perturbed final norm gain."""
    if not noise >= 0:
        raise ValueError(f"noise={noise!r}: must be >= 0")
    model = load_model(GGUFFile(path), torch.device(device), dtype, progress=False)
    gain = model.output_norm
    g = torch.Generator(device="cpu").manual_seed(seed)
    factors = 1.0 + noise * torch.randn(gain.shape, generator=g, dtype=torch.float32)
    model.output_norm = (gain.float().cpu() * factors).to(device=gain.device, dtype=gain.dtype)
    return model
