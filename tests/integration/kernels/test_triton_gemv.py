"""The fused dequantize-GEMV Triton kernels against the torch dequant reference.

Reference: `x.float() @ w.dequantize(float32).T` (torch dequantization, bit-exact with
gguf-py, then a float32 matmul). Weights are random *valid* blocks: random quant bytes
with small finite f16 scale fields. CPU variants run Triton's interpreter (switched on
only where there is no GPU, since it is read when the kernel module is imported) at
small shapes; `cuda` variants run the compiled kernels at 7B-like shapes.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T  # noqa: E402
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.errors import ConfigError, DeviceError, UnsupportedTensorTypeError  # noqa: E402
from minivllm.gguf.quant_types import SUPPORTED_TYPES  # noqa: E402
from minivllm.kernels.gpu_profile import gpu_profile  # noqa: E402 (the T4 profile decides as a T4 would)
from minivllm.kernels.quant_weight import QuantizedWeight  # noqa: E402
from minivllm.kernels.triton.dequant_gemv import SUPPORTED_GEMV_TYPES, triton_gemv  # noqa: E402

LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
FLOATS = [T.F32, T.F16, T.BF16]
ALL_TYPES = LEGACY + K_QUANTS + FLOATS
# Byte offsets of the f16 scale fields (d, and m/dmin where there is one) in each block.
F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
              T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}

cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")


@pytest.fixture(autouse=True)
def _compiled_kernel_for_cuda(request):
    if "cuda" in request.keywords and INTERPRETED:
        pytest.fail("TRITON_INTERPRET=1 was set before the kernel was imported, so this CUDA test would run the "
                    "interpreter instead of the compiled kernel; run this file on its own without TRITON_INTERPRET")


def random_weight(ggml_type: T, n: int, k: int, *, device: str = "cpu", seed: int = 0) -> QuantizedWeight:
    """An (n, k) weight of random valid blocks (quant bits random, scales small and finite)."""
    gen = torch.Generator().manual_seed(seed)
    if ggml_type in FLOAT_DTYPES:
        raw = torch.randn(n, k, generator=gen).to(FLOAT_DTYPES[ggml_type]).view(torch.uint8).reshape(n, -1)
    else:
        qt = SUPPORTED_TYPES[ggml_type]
        n_blocks = n * k // qt.block_size
        blocks = torch.randint(0, 256, (n_blocks, qt.type_size), dtype=torch.uint8, generator=gen)
        for off in F16_FIELDS[ggml_type]:
            scale = (torch.rand(n_blocks, 1, generator=gen) * 0.02 + 1e-3).half()
            blocks[:, off:off + 2] = scale.view(torch.uint8)
        raw = blocks.reshape(n, -1)
    return QuantizedWeight(raw.to(device), ggml_type, (n, k), name=f"blk.0.test.{ggml_type.name}")


def reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return x.float() @ w.dequantize(torch.float32).T


def assert_close_to_reference(y: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    """Only float32 summation order may differ: errors scale with sqrt(K) * eps * magnitude."""
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.isfinite(y).all()
    scale = ref.abs().max().item()
    err = (y - ref).abs().max().item()
    assert err <= 2e-6 * (k ** 0.5) * scale + 1e-30, f"max error {err:.3g} vs reference magnitude {scale:.3g}"


def _k_for(ggml_type: T, legacy_k: int, kquant_k: int) -> int:
    return kquant_k if ggml_type in K_QUANTS else legacy_k


# --- interpreter (CPU) ---------------------------------------------------------------


def test_supported_types_are_the_promised_ones():
    assert SUPPORTED_GEMV_TYPES == frozenset(ALL_TYPES)


@cpu_only
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_matches_reference_interpreted(ggml_type):
    # K is not a multiple of the kernel's 512-element K tile (288 = 9 legacy blocks,
    # 768 = 3 super-blocks); N = 13 is not a multiple of any BLOCK_N.
    k = _k_for(ggml_type, 288, 768)
    w = random_weight(ggml_type, 13, k, seed=1)
    gen = torch.Generator().manual_seed(2)
    for m in (1, 2, 3, 8):
        x = torch.randn(m, k, generator=gen)
        assert_close_to_reference(triton_gemv(x, w), reference(x, w), k)


@cpu_only
@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q6_K, T.BF16], ids=lambda t: t.name)
def test_float16_activations_interpreted(ggml_type):
    k = _k_for(ggml_type, 64, 256)
    w = random_weight(ggml_type, 5, k, seed=3)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)).half()
    assert_close_to_reference(triton_gemv(x, w), reference(x, w), k)


def _check_row_invariance(w: QuantizedWeight, k: int, device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    batch = torch.randn(8, k, generator=gen).to(device)
    other = torch.randn(8, k, generator=gen).to(device) * 100  # different neighbours, other magnitudes
    full = triton_gemv(batch, w, invariant=True)
    for r in (0, 3, 7):
        alone = triton_gemv(batch[r:r + 1].contiguous(), w, invariant=True)
        assert torch.equal(full[r], alone[0]), f"row {r}: batch of 8 differs from the row alone"
        mixed = other.clone()
        mixed[r] = batch[r]
        assert torch.equal(triton_gemv(mixed, w, invariant=True)[r], alone[0]), f"row {r}: depends on other rows"
        for m in (2, 3):
            part = torch.cat([batch[r:r + 1], other[: m - 1]])
            assert torch.equal(triton_gemv(part, w, invariant=True)[0], alone[0]), f"row {r}: depends on M={m}"
    assert_close_to_reference(full, reference(batch, w), k)


@cpu_only
@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_invariant_rows_bitwise_independent_of_batch_interpreted(ggml_type):
    k = _k_for(ggml_type, 96, 512)
    _check_row_invariance(random_weight(ggml_type, 9, k, seed=6), k, "cpu")


def test_unsupported_type_names_weight_and_supported_list():
    qt = SUPPORTED_TYPES[T.Q2_K]
    w = QuantizedWeight(torch.zeros(4, qt.type_size, dtype=torch.uint8), T.Q2_K, (4, 256), name="blk.3.ffn_down.weight")
    with pytest.raises(UnsupportedTensorTypeError) as e:
        triton_gemv(torch.zeros(1, 256), w)
    msg = str(e.value)
    assert "blk.3.ffn_down.weight" in msg and "Q2_K" in msg and "Q4_K" in msg and "BF16" in msg


def test_shape_mismatch_is_a_clear_error():
    w = random_weight(T.Q8_0, 4, 64)
    with pytest.raises(ConfigError, match=r"expected \(M, 64\)"):
        triton_gemv(torch.zeros(1, 32), w)


def test_cpu_tensors_refused_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = random_weight(T.Q8_0, 4, 64)
    with pytest.raises(DeviceError, match="CUDA device"):
        triton_gemv(torch.zeros(1, 64), w)


# --- compiled kernels (CUDA) ---------------------------------------------------------

BIG_SHAPES = [(4096, 4096), (18944, 3584)]


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_matches_reference_cuda(ggml_type):
    n, k = BIG_SHAPES[0]
    w = random_weight(ggml_type, n, k, device="cuda", seed=7)
    gen = torch.Generator().manual_seed(8)
    for m in (1, 2, 3, 8):
        x = torch.randn(m, k, generator=gen).cuda()
        assert_close_to_reference(triton_gemv(x, w), reference(x, w), k)
        assert_close_to_reference(triton_gemv(x.half(), w), reference(x.half(), w), k)


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_matches_reference_ffn_shape_cuda(ggml_type):
    # Qwen2.5-7B's ffn_up/gate (18944 x 3584) and ffn_down (3584 x 18944): K = 3584 and
    # 18944 are not multiples of the 1024-element tile some autotuned configs use.
    for n, k in [(18944, 3584), (3584, 18944)]:
        w = random_weight(ggml_type, n, k, device="cuda", seed=9)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(10)).cuda()
        assert_close_to_reference(triton_gemv(x, w), reference(x, w), k)
        assert_close_to_reference(triton_gemv(x, w, invariant=True), reference(x, w), k)


@pytest.mark.cuda
def test_bf16_activations_on_sm80_cuda():
    if gpu_profile().capability[0] < 8:
        w = random_weight(T.Q4_K, 8, 256, device="cuda")
        with pytest.raises(DeviceError, match="sm_80"):
            triton_gemv(torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16), w)
        return
    k = 4096
    w = random_weight(T.Q4_K, 1024, k, device="cuda", seed=11)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(12)).cuda().bfloat16()
    assert_close_to_reference(triton_gemv(x, w), reference(x, w), k)


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_invariant_rows_bitwise_independent_of_batch_cuda(ggml_type):
    n, k = BIG_SHAPES[0]
    _check_row_invariance(random_weight(ggml_type, n, k, device="cuda", seed=13), k, "cuda")


# --- T4 (sm_75) compilation, checked without a GPU -------------------------------------

_COMPILE_FOR_SM75 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gguf import GGMLQuantizationType as T
from minivllm.kernels.triton.dequant_gemv import _KERNELS, _dequant_gemv_kernel
import torch
ptr = {torch.uint8: "*u8", torch.float32: "*fp32", torch.float16: "*fp16", torch.int16: "*i16"}
out = {}
for name in sys.argv[1].split(","):
    spec = _KERNELS[T[name]]
    for block_m, block_n in ((1, 8), (8, 1)):
        sig = {"x_ptr": "*fp16", "w_ptr": ptr[spec.view], "out_ptr": "*fp32", "M": "i32", "N": "i32",
               "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
        sig.update({c: "constexpr" for c in ("N_GROUPS", "DECODE", "GROUP", "TILE_K", "BLOCK_N", "BLOCK_M")})
        const = {"N_GROUPS": 512 // spec.group, "DECODE": spec.decode, "GROUP": spec.group, "TILE_K": 512,
                 "BLOCK_N": block_n, "BLOCK_M": block_m}
        k = triton.compile(ASTSource(_dequant_gemv_kernel, sig, const), target=GPUTarget("cuda", 75, 32),
                           options={"num_warps": 4})
        out[f"{name}/m{block_m}"] = k.asm["ptx"]
print(json.dumps({key: {"target": ".target sm_75" in p, "bf16": "bf16" in p, "mma": "mma." in p}
                  for key, p in out.items()}))
"""


def test_kernels_compile_for_t4_sm75_without_bf16_or_mma():
    """Every kernel variant compiles to sm_75 PTX (a Kaggle T4) with no bf16 and no
    tensor-core (mma) instructions. Runs the real Triton compiler in a subprocess,
    since this module may have switched on the interpreter; no GPU is needed."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    names = ",".join(t.name for t in ALL_TYPES)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM75, names], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 2 * len(ALL_TYPES)
    for key, r in result.items():
        assert r == {"target": True, "bf16": False, "mma": False}, key
