"""f16 and bf16 activations against the float32 path of the same model.

Reference: minivllm's own float32 path, which test_forward_reference.py pins to
transformers at ≤1e-4 relative error. The property here is numerical: lowering the
activation dtype must keep greedy top-1 choices (≥ 99% of positions) on a prompt set.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DATA_DIR, cuda_devices
from minivllm.cache.contiguous import ContiguousKVCache
from minivllm.devices import check_dtype_supported, resolve_device, resolve_dtype
from minivllm.errors import ConfigError, DeviceError
from minivllm.gguf.reader import GGUFFile
from minivllm.gguf.tokenizer import Tokenizer
from minivllm.model.loader import load_model

PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]


def _top1(model, sequences, device) -> torch.Tensor:
    cfg = model.config
    picks = []
    for ids in sequences:
        cache = ContiguousKVCache(cfg.n_layers, len(ids), cfg.n_kv_heads, cfg.head_dim, model.dtype, device)
        picks.append(model.forward(torch.tensor(ids, device=device), 0, cache, all_logits=True).argmax(-1).cpu())
    return torch.cat(picks)


def _agreement(path, device: str, dtypes: list[str]) -> dict[str, float]:
    gf = GGUFFile(path)
    tok = Tokenizer.from_gguf(gf)
    dev = torch.device(device)
    sequences = [tok.encode(p) for p in PROMPTS]
    ref = _top1(load_model(gf, dev, torch.float32, progress=False), sequences, dev)
    return {dt: (_top1(load_model(gf, dev, resolve_dtype(dt), progress=False), sequences, dev) == ref).float().mean().item()
            for dt in dtypes}


@pytest.mark.parametrize("model", ["smollm2", "qwen05"])
def test_low_precision_top1_agreement_cpu(model, smollm2_path, qwen05_path):
    path = smollm2_path if model == "smollm2" else qwen05_path
    agreement = _agreement(path, "cpu", ["f16", "bf16"])
    for dt, frac in agreement.items():
        assert frac >= 0.99, f"{model} {dt}: top-1 agreement with f32 is {frac:.2%} < 99%"


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["smollm2", "qwen05"])
def test_low_precision_top1_agreement_cuda(model, smollm2_path, qwen05_path):
    path = smollm2_path if model == "smollm2" else qwen05_path
    dev = cuda_devices()[0]
    major, _ = torch.cuda.get_device_capability(dev)
    agreement = _agreement(path, dev, ["f16", "bf16"] if major >= 8 else ["f16"])
    for dt, frac in agreement.items():
        assert frac >= 0.99, f"{model} {dt} on {dev}: top-1 agreement with f32 is {frac:.2%} < 99%"


def test_dtype_names_are_validated():
    assert resolve_dtype("f16") is torch.float16 and resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ConfigError, match="dtype"):
        resolve_dtype("int8")


def test_gpu_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceError, match="--inference-device cpu"):
        resolve_device("gpu")


def test_unknown_device_name_is_a_config_error():
    with pytest.raises(ConfigError, match="inference_device"):
        resolve_device("tpu")


@pytest.mark.cuda
def test_bf16_policy_follows_compute_capability():
    """bf16 is accepted on sm_80+ and refused, naming the GPU and the fix, below (T4 = sm_75)."""
    for dev in cuda_devices():
        device = torch.device(dev)
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 8:
            check_dtype_supported(device, torch.bfloat16)
        else:
            with pytest.raises(DeviceError, match="--activation-dtype f16"):
                check_dtype_supported(device, torch.bfloat16)
