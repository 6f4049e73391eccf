"""The compiled float32 CPU GEMV (kernels/cpu_gemv.cpp) against the torch dequantization.

References: minivllm's torch dequantization (bit-exact with gguf.quants, test_dequant.py)
and a float64 matmul of its weights. The kernel's only rounding is float32 accumulation,
so the bound is the classical one for a K-term float32 dot product: |error| <=
K * 2^-24 * sum_k |x_k w_k| (plus the decoded weights being exact, checked bit for bit
through the identity matrix). A wrong nibble, scale or offset gives errors of order
sum |x w|, about 10^4 times the bound at K = 512.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT  # noqa: E402
from gguf import GGMLQuantizationType
from test_cpu_packed import _random_weight

from minivllm.gguf.reader import GGUFFile
from minivllm.kernels import cpu_gemv
from minivllm.kernels.quant_weight import QuantizedWeight

T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]
U_F32 = 2.0**-24


def _can_build() -> bool:
    # MINIVLLM_CPU_GEMV=torch (make test-portability's scalar variant) turns the kernel off.
    if os.environ.get("MINIVLLM_CPU_GEMV") == "torch":
        return False
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return shutil.which("g++") is not None and all(f" {f}" in flags for f in ("avx2", "fma", "f16c"))


def test_the_extension_builds_where_it_can():
    """Which path runs here: the compiled kernel wherever g++ and AVX2/FMA/F16C exist
    (CI included: `make setup` needs nothing more), else the named torch fallback."""
    if _can_build():
        assert cpu_gemv.extension() is not None, cpu_gemv.unavailable_reason()
        assert cpu_gemv.isa() in ("avx2", "avx512")
        assert cpu_gemv.extension().vector_width() == {"avx2": 8, "avx512": 16}[cpu_gemv.isa()]
    else:
        assert cpu_gemv.extension() is None and cpu_gemv.unavailable_reason()


needs_ext = pytest.mark.skipif(not _can_build(), reason="no g++ or no AVX2/FMA/F16C: the torch fallback runs")


def _bound_check(w: QuantizedWeight, x: torch.Tensor, y: torch.Tensor) -> None:
    W = w.dequantize(torch.float32).double()
    ref = x.double() @ W.T
    bound = w.shape[1] * U_F32 * (x.double().abs() @ W.abs().T)
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"{w.name}: error {float((err / bound).max()):.2f}x the f32 bound"


@needs_ext
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_matches_float64_reference_within_f32_accumulation(qtype, rows):
    k = 768 if qtype in (T.Q4_K, T.Q6_K) else 544  # odd block counts exercise the tails
    w = _random_weight(qtype, 72, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = cpu_gemv.gemv(x, [w])[0]
    assert y.dtype == torch.float32 and y.shape == (rows, 72)
    _bound_check(w, x, y)


@needs_ext
@pytest.mark.parametrize("qtype", TYPES)
def test_decoded_weights_are_bit_exact(qtype):
    """x = I_K: each output is one product w * 1 plus zeros, so y.T is the decoded matrix."""
    k = 256
    w = _random_weight(qtype, 40, k, seed=7)
    eye = torch.eye(k)
    got = torch.cat([cpu_gemv.gemv(eye[i:i + 8], [w])[0] for i in range(0, k, 8)]).T
    assert torch.equal(got, w.dequantize(torch.float32))


@needs_ext
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K])
def test_rows_are_bitwise_independent_of_the_batch(qtype):
    """A row's sums run in an order fixed by K alone: alone, in 8 rows or in 17, the same bits."""
    w = _random_weight(qtype, 64, 512, seed=2)
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(3))
    together = cpu_gemv.gemv(x, [w])[0]
    for i in range(17):
        assert torch.equal(cpu_gemv.gemv(x[i:i + 1], [w])[0][0], together[i])
    assert torch.equal(cpu_gemv.gemv(x[:8], [w])[0], together[:8])


@needs_ext
def test_several_weights_in_one_call_equal_separate_calls():
    ws = [_random_weight(T.Q4_1, 96, 512, seed=1), _random_weight(T.Q8_0, 32, 512, seed=2),
          _random_weight(T.Q6_K, 48, 512, seed=3)]
    x = torch.randn(2, 512)
    for y, w in zip(cpu_gemv.gemv(x, ws), ws):
        assert torch.equal(y, cpu_gemv.gemv(x, [w])[0])


@needs_ext
def test_thread_count_does_not_change_the_bits():
    w = _random_weight(T.Q4_0, 200, 512, seed=4)
    x = torch.randn(3, 512)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.gemv(x, [w])[0]
        torch.set_num_threads(2)
        two = cpu_gemv.gemv(x, [w])[0]
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


def _real(path, name: str) -> QuantizedWeight:
    f = GGUFFile(path)
    info = f.tensor_info(name)
    return QuantizedWeight(f.tensor_bytes(name), info.ggml_type, tuple(info.shape), name)


@needs_ext
@pytest.mark.parametrize("model, name", [
    ("smollm2", "blk.0.attn_k.weight"), ("smollm2", "blk.3.ffn_down.weight"), ("smollm2", "token_embd.weight"),
    ("qwen05", "blk.0.ffn_gate.weight"), ("qwen05", "blk.0.attn_v.weight"), ("qwen05", "blk.0.ffn_down.weight"),
    ("qwen05", "blk.11.ffn_down.weight"),
])  # fmt: skip
def test_real_model_tensors(model, name, smollm2_path, qwen05_path):
    w = _real(smollm2_path if model == "smollm2" else qwen05_path, name)
    assert w.ggml_type in cpu_gemv.F32_GEMV_TYPES
    x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0))
    _bound_check(w, x, cpu_gemv.gemv(x, [w])[0])


def test_torch_fallback_when_the_kernel_is_disabled(smollm2_path):
    """MINIVLLM_CPU_GEMV=torch stands in for a machine without a compiler: the engine
    says it runs the dense float32 path, and still generates."""
    code = (
        "from minivllm import LLM, SamplingParams\n"
        "from minivllm.kernels import cpu_gemv\n"
        f"llm = LLM({str(smollm2_path)!r}, device='cpu', dtype='float32', progress=False, max_model_len=64)\n"
        "out = llm.generate(['Hello'], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]\n"
        "print(sorted(llm.snapshot()['kernels']['gemv_kinds']), len(out.token_ids), cpu_gemv.unavailable_reason())\n"
    )
    env = {**os.environ, "MINIVLLM_CPU_GEMV": "torch"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['cpu-float32-torch'] 3 disabled by MINIVLLM_CPU_GEMV=torch"


@needs_ext
def test_avx2_build_where_avx512_is_the_default(tmp_path):
    """The AVX2 variant (what an AVX2-only CI machine builds) gives the same bounded results, for
    the float32 kernel and the portable q8 kernel."""
    if cpu_gemv.isa() != "avx512":
        pytest.skip("this machine already builds the AVX2 variant")
    code = (
        "import sys, torch\nsys.path[:0] = ['tests', 'tests/integration/kernels']\n"
        "from test_cpu_packed import _random_weight\nfrom test_cpu_gemv import TYPES, _bound_check\n"
        "from test_cpu_gemv_q8 import _q8_reference\n"
        "from minivllm.kernels import cpu_gemv\n"
        "assert cpu_gemv.isa() == 'avx2', cpu_gemv.unavailable_reason()\n"
        "torch.manual_seed(0)  # fixed inputs (unseeded, one run in many broke the q8 bound: see the closing note)\n"
        "for t in TYPES:\n"
        "    w = _random_weight(t, 40, 512, seed=1)\n"
        "    for m in (1, 5):\n"
        "        x = torch.randn(m, 512)\n"
        "        _bound_check(w, x, cpu_gemv.gemv(x, [w])[0])\n"
        "        if t in cpu_gemv.Q8_GEMV_TYPES:  # the portable q8 kernel (AVX2 or AVX-VNNI)\n"
        "            ref, bound = _q8_reference(x, w)\n"
        "            assert ((cpu_gemv.run_q8(x, cpu_gemv.prepare([w]))[0].double() - ref).abs() <= bound).all(), t\n"
        "print('ok')\n"
    )
    env = {**os.environ, "MINIVLLM_CPU_GEMV_ISA": "avx2"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=REPO_ROOT)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


@needs_ext
@pytest.mark.parametrize("s, kvh, group, d", [(1, 3, 3, 64), (37, 3, 3, 64), (520, 2, 7, 64)])
def test_decode_attention_over_scattered_pages_is_the_contiguous_result(s, kvh, group, d):
    """attend_decode_slots reads the same keys through pool slots in any order of pages:
    the result equals attend_decode's on the keys laid out in one run, bit for bit (so a
    request's page placement cannot change its tokens), and the float64 softmax within
    float32 rounding."""
    g = torch.Generator().manual_seed(s)
    h = kvh * group
    q = torch.randn(1, h, d, generator=g)
    k, v = torch.randn(s, kvh, d, generator=g), torch.randn(s, kvh, d, generator=g)
    pool_k, pool_v = torch.randn(3 * s + 8, kvh, d, generator=g), torch.randn(3 * s + 8, kvh, d, generator=g)
    slots = torch.randperm(3 * s + 8, generator=g)[:s]  # every position somewhere else in the pool
    pool_k[slots], pool_v[slots] = k, v
    got = cpu_gemv.attend_decode_slots(q, pool_k, pool_v, slots)
    assert torch.equal(got, cpu_gemv.attend_decode(q, k, v))
    qd = q[0].double().view(kvh, group, d)
    probs = torch.softmax(torch.einsum("kgd,skd->kgs", qd, k.double()) * d ** -0.5, dim=-1)
    ref = torch.einsum("kgs,skd->kgd", probs, v.double()).reshape(1, h, d)
    assert (got.double() - ref).abs().max() < 1e-5


@needs_ext
@pytest.mark.parametrize("s, kvh, group, d", [(1, 3, 3, 64), (37, 3, 3, 64), (520, 2, 7, 64), (9, 1, 4, 128)])
def test_decode_attention_matches_float64_softmax(s, kvh, group, d):
    """The compiled one-query attention (taken by attention._one_query on CPU) against a
    float64 softmax written out here, on slices of a larger pool as the cache hands them."""
    from minivllm.kernels.attention import _one_query

    g = torch.Generator().manual_seed(s)
    pool_k, pool_v = torch.randn(s + 20, kvh, d, generator=g), torch.randn(s + 20, kvh, d, generator=g)
    k, v = pool_k[10:10 + s], pool_v[10:10 + s]
    q = torch.randn(1, kvh * group, d, generator=g) * 3
    out = cpu_gemv.attend_decode(q, k, v)
    assert out is not None and out.shape == (1, kvh * group, d)
    qd = q.double().view(kvh, group, d)
    probs = torch.softmax(qd @ k.double().permute(1, 2, 0) * d ** -0.5, dim=-1)
    ref = (probs @ v.double().permute(1, 0, 2)).reshape(1, kvh * group, d)
    assert float((out.double() - ref).abs().max()) <= 1e-5 * max(1.0, float(ref.abs().max()))
    assert torch.equal(_one_query(q, k, v), out)  # the decode path takes it


@needs_ext
@pytest.mark.parametrize("style", ["adjacent", "halves"])
@pytest.mark.parametrize("rope_dim", [64, 32])
def test_rope_is_bit_exact_with_the_formula(style, rope_dim):
    """RotaryEmbedding.apply on CPU float32 takes the compiled rotation: the same products
    and sums as the formula written here in torch (partial rotary dims copied)."""
    from minivllm.kernels.rope import RotaryEmbedding

    rope = RotaryEmbedding(rope_dim, 10000.0, style)
    cos, sin = rope.cos_sin(torch.arange(3, 10))
    x = torch.randn(7, 5, 64, generator=torch.Generator().manual_seed(1))
    got = rope.apply(x, cos, sin)
    rot, c, s = x[..., :rope_dim], cos[:, None, :], sin[:, None, :]
    if style == "adjacent":
        a, b = rot[..., 0::2], rot[..., 1::2]
        ref = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = rot[..., : rope_dim // 2], rot[..., rope_dim // 2:]
        ref = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    assert torch.equal(got, torch.cat((ref, x[..., rope_dim:]), dim=-1))


@needs_ext
def test_rms_norm_matches_float64():
    from minivllm.kernels.rmsnorm import rms_norm

    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(2)) * 4
    w = torch.randn(576, generator=torch.Generator().manual_seed(3))
    got = rms_norm(x, w, 1e-5)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert got.dtype == torch.float32
    assert float((got.double() - ref).abs().max()) <= 4 * U_F32 * 576 * float(ref.abs().max())


@needs_ext
def test_project_many_is_separate_calls_in_one():
    """A layer's Q/K/V through one kernel call: the same bits as three QuantLinear calls
    (bias included), counted as three GEMV calls; above gemv_max_rows, separate GEMMs."""
    from minivllm.kernels.kernel_options import KernelOptions
    from minivllm.kernels.linear import QuantLinear, project_many

    opts = KernelOptions().resolved("cpu")
    ws = [_random_weight(T.Q4_1, 96, 512, seed=1), _random_weight(T.Q8_0, 32, 512, seed=2),
          _random_weight(T.Q5_0, 32, 512, seed=3)]
    lins = [QuantLinear(w, torch.randn(w.shape[0]) if i == 1 else None, options=opts, compute_dtype=torch.float32,
                        name=f"p{i}") for i, w in enumerate(ws)]
    for rows in (1, 3, opts.gemv_max_rows + 1):
        x = torch.randn(rows, 512)
        opts.path_counts.clear()
        fused = project_many(lins, x)
        counts = dict(opts.path_counts)
        separate = [lin(x) for lin in lins]
        assert all(torch.equal(a, b) for a, b in zip(fused, separate))
        assert counts == ({"gemv": 3} if rows <= opts.gemv_max_rows else {"gemm": 3})
    assert {lin.gemv_kind for lin in lins} == {f"cpu-f32-{cpu_gemv.isa()}"}


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A build killed mid-way (Ctrl-C, OOM) leaves torch's lock file, and every later
    process would wait on it forever: a lock older than any build is removed."""
    import os
    import time

    from minivllm.kernels import cpu_gemv as cg

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "some_ext" / "lock"
    lock.parent.mkdir()
    lock.touch()
    cg._remove_stale_lock("some_ext")
    assert lock.exists()  # a build may be running right now
    old = time.time() - cg._STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="did not finish"):
        cg._remove_stale_lock("some_ext")
    assert not lock.exists()
