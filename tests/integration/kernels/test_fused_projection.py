"""Fused projections (kernels/fused_projection.py): one weight and one launch for a layer's
Q/K/V and gate/up, SwiGLU in the gate+up GEMV's epilogue.

References: the separate `QuantLinear` GEMVs of the same weights, computed before fusing
(bit for bit: the rows never meet in a sum, so the same launch shape gives the same per-row
arithmetic), `swiglu(gate(x), up(x))` (the swiglu kernel, bit for bit), and the torch
dequantization + float32 matmul with silu(g) * u (a tolerance: independent of every
kernel). The model test runs the GPU path on CPU tensors (Triton's interpreter,
MINIVLLM_TRITON_CPU=1) and counts the Triton launches of one decode step.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from gemv_table import gemv_table
from gguf import GGMLQuantizationType as T
from test_triton_gemv import random_weight  # noqa: E402
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.gemv_configs import GemvConfig, lookup  # noqa: E402
from minivllm.kernels.kernel_options import KernelOptions, kernel_options_for_call  # noqa: E402
from minivllm.kernels.linear import QuantLinear, project_many  # noqa: E402

cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")
TYPES = [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_1]


@pytest.fixture
def gpu_path_on_cpu(monkeypatch):
    monkeypatch.setenv("MINIVLLM_TRITON_CPU", "1")
    monkeypatch.delenv("MINIVLLM_FUSED_PROJECTIONS", raising=False)


def _linears(types, sizes, k, opts, dtype=torch.float16, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (t, n) in enumerate(zip(types, sizes)):
        b = torch.randn(n, generator=gen) if bias else None
        out.append(QuantLinear(random_weight(t, n, k, seed=seed + i), b, options=opts, compute_dtype=dtype,
                               name=f"p{i}"))
    return out


def _k(t):
    return 256 if t in (T.Q4_K, T.Q6_K) else 128


@cpu_only
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_fused_qkv_equals_the_separate_gemvs_bit_for_bit(ggml_type, gpu_path_on_cpu):
    from minivllm.kernels.fused_projection import fuse_projections

    k = _k(ggml_type)
    opts = KernelOptions(gemv_max_rows=8, dequant_cache=False)
    q, kk, v = _linears([ggml_type] * 3, [32, 16, 16], k, opts)
    gen = torch.Generator().manual_seed(1)
    xs = {m: (torch.randn(m, k, generator=gen) * 0.5).half() for m in (1, 3)}
    cases = [(1, False), (3, True), (3, False)]  # tiled; tiled batch-invariant; several-rows kernel
    separate = {}
    for m, inv in cases:
        with kernel_options_for_call(KernelOptions(gemv_max_rows=8, dequant_cache=False, batch_invariant=inv)):
            separate[m, inv] = [lin(xs[m]) for lin in (q, kk, v)]
    bytes_before = sum(lin.weight.nbytes for lin in (q, kk, v))
    groups = fuse_projections((q, kk, v), "attn_qkv")
    assert len(groups) == 1 and groups[0].linear.out_features == 64
    fused_qs = groups[0].linear.repacked.qs
    for lin in (q, kk, v):  # the parts hold views of the fused weight, not copies
        assert lin.repacked.qs.untyped_storage().data_ptr() == fused_qs.untyped_storage().data_ptr()
    assert sum(lin.weight.nbytes for lin in (q, kk, v)) == bytes_before == groups[0].linear.weight.nbytes
    for m, inv in cases:
        opts_call = KernelOptions(gemv_max_rows=8, dequant_cache=False, batch_invariant=inv)
        with kernel_options_for_call(opts_call):
            fused = project_many((q, kk, v), xs[m])
            alone = [lin(xs[m]) for lin in (q, kk, v)]  # a part called alone reads its view
        assert opts_call.path_counts == Counter({"gemv-invariant" if inv else "gemv": 4})
        for a, b, c in zip(fused, separate[m, inv], alone):
            assert torch.equal(a, b) and torch.equal(c, b), (m, inv)
        assert fused[0].untyped_storage().data_ptr() == fused[2].untyped_storage().data_ptr()  # views of one output
        if inv:  # batch-invariant: a row alone gives the bits it gave in the batch
            with kernel_options_for_call(opts_call):
                alone_row = project_many((q, kk, v), xs[m][1:2])
            assert all(torch.equal(a[0], b[1]) for a, b in zip(alone_row, fused))


def _swiglu_reference(x, gate, up, wg, wu):
    """silu(g) * u from the torch dequantization, float32 (independent of every kernel)."""
    g = x.float() @ wg.dequantize(torch.float32).T + gate.bias
    u = x.float() @ wu.dequantize(torch.float32).T + up.bias
    return torch.nn.functional.silu(g) * u


@cpu_only
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
def test_swiglu_epilogue_equals_swiglu_of_the_separate_gemvs(ggml_type, gpu_path_on_cpu):
    from minivllm.kernels.fused_projection import fuse_projections, project_swiglu
    from minivllm.kernels.triton.fused import swiglu

    k = _k(ggml_type)
    opts = KernelOptions(gemv_max_rows=8, dequant_cache=False)
    gate, up = _linears([ggml_type] * 2, [24, 24], k, opts, seed=5)
    wg, wu = gate.repacked.to_quantized(), up.repacked.to_quantized()
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, k, generator=gen) * 0.3).half()
    cases = [(1, False), (3, True), (2, False)]  # epilogue; epilogue batch-invariant; GEMV + swiglu of halves
    separate = {}
    for m, inv in cases:
        with kernel_options_for_call(KernelOptions(gemv_max_rows=8, dequant_cache=False, batch_invariant=inv)):
            separate[m, inv] = swiglu(gate(x[:m]), up(x[:m]), torch.float16)
    (group,) = fuse_projections((gate, up), "ffn_gate_up")
    launches = _count_launches()
    for m, inv in cases:
        with kernel_options_for_call(KernelOptions(gemv_max_rows=8, dequant_cache=False, batch_invariant=inv)):
            with launches:
                y = project_swiglu(gate, up, x[:m], torch.float16)
        assert y.dtype == torch.float16 and torch.equal(y, separate[m, inv]), (m, inv)
        ref = _swiglu_reference(x[:m], gate, up, wg, wu)
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
        epilogue = m == 1 or inv
        if inv:  # batch-invariant: a row alone gives the bits it gave in the batch
            with kernel_options_for_call(KernelOptions(gemv_max_rows=8, dequant_cache=False, batch_invariant=True)):
                assert torch.equal(project_swiglu(gate, up, x[1:2], torch.float16)[0], y[1])
        assert launches.counts == ({"_tiled_gemv_kernel": 1} if epilogue
                                   else {"_multirow_gemv_kernel": 1, "_swiglu_kernel": 1}), (m, inv)


@cpu_only
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_split_k_swiglu_epilogue_sums_in_slice_order(ggml_type):
    """Split K: both halves' partials go to the workspace and the in-order sum applies
    SwiGLU; the same bits as the split GEMVs then the swiglu kernel."""
    from minivllm.kernels.quant_weight import QuantizedWeight
    from minivllm.kernels.repacked_layout import repack
    from minivllm.kernels.triton.fused import swiglu
    from minivllm.kernels.triton.tiled_gemv import tiled_gemv, tiled_gemv_swiglu

    k = 512
    wg, wu = random_weight(ggml_type, 12, k, seed=7), random_weight(ggml_type, 12, k, seed=8)
    fused = repack(QuantizedWeight(torch.cat([wg.raw, wu.raw]), ggml_type, (24, k)))
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, k, generator=gen) * 0.3).half()
    bias = torch.randn(24, generator=gen)
    for cfg in (GemvConfig(block_nb=2, block_g=4, split=3), GemvConfig(block_nb=1, block_g=8, split=2)):
        ref = swiglu(tiled_gemv(x, repack(wg), cfg, out_dtype=torch.float16, bias=bias[:12]),
                     tiled_gemv(x, repack(wu), cfg, out_dtype=torch.float16, bias=bias[12:]), torch.float16)
        y = tiled_gemv_swiglu(x, fused, cfg, mid_dtype=torch.float16, out_dtype=torch.float16, bias=bias)
        assert torch.equal(y, ref), cfg


@cpu_only
def test_runs_of_one_type_fuse_and_the_switch_turns_fusion_off(gpu_path_on_cpu, monkeypatch):
    """Q4_K_M: V in Q6_K (llama.cpp's use_more_bits layers) fuses Q|K and leaves V alone."""
    from minivllm.kernels.fused_projection import FUSED_PROJECTIONS_ENV, fuse_projections

    opts = KernelOptions(gemv_max_rows=8, dequant_cache=False)
    q, kk, v = _linears([T.Q4_K, T.Q4_K, T.Q6_K], [32, 16, 16], 256, opts)
    (group,) = fuse_projections((q, kk, v), "attn_qkv")
    assert group.parts == (q, kk) and group.name == "p0+p1" and v.fused is None
    # A weight without the GPU layout (a type the repacked kernels lack) breaks a run.
    a, b, c = _linears([T.Q4_K, T.Q5_1, T.Q4_K], [16, 16, 16], 256, opts)
    assert b.repacked is None and fuse_projections((a, b, c), "x") == []
    (after,) = fuse_projections((b, c, a), "y")
    assert after.parts == (c, a)
    monkeypatch.setenv(FUSED_PROJECTIONS_ENV, "0")
    assert fuse_projections(tuple(_linears([T.Q4_K] * 2, [16, 16], 256, opts)), "g") == []


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_concatenated_rows_and_their_views_unpack_to_the_file_bytes(ggml_type):
    """The fused weight gives back the parts' GGUF bytes (the GEMM path dequantizes it),
    and so does each part's view, at K = 256 too (one super-block per row)."""
    from minivllm.kernels.repacked_layout import concat_rows, repack, row_range, unpack_raw

    for k in (256, 512):
        ws = [random_weight(ggml_type, n, k, seed=n) for n in (8, 12, 4)]
        fused = concat_rows([repack(w) for w in ws], "qkv")
        assert torch.equal(unpack_raw(fused), torch.cat([w.raw for w in ws]))
        row = 0
        for w in ws:
            assert torch.equal(unpack_raw(row_range(fused, row, w.shape[0], "part")), w.raw)
            row += w.shape[0]


def test_unmeasured_fused_shapes_take_the_nearest_measured_row(tmp_path, monkeypatch):
    # A table measuring only the 3584 and 18944 rows of K = 3584 (the committed sm90 table
    # has the fused shapes measured since): the fused shapes take their nearest measured N.
    from minivllm.kernels.gemv_configs import default_config

    square = {"block_nb": 4, "block_g": 64, "split": 1, "num_warps": 8, "num_stages": 3}
    wide = {"block_nb": 8, "block_g": 16, "split": 1, "num_warps": 4, "num_stages": 2}
    with gemv_table(tmp_path, monkeypatch, {"sm90": {"configs": {"Q4_K:3584x3584": square, "Q4_K:18944x3584": wide},
                                                     "configs_int8": {}}}):
        assert lookup("sm90", "Q4_K", 4608, 3584) == GemvConfig(**square)  # Q|K|V of the 7B
        assert lookup("sm90", "Q4_K", 37888, 3584) == GemvConfig(**wide)  # gate|up of the 7B
        assert lookup("sm90", "Q4_K", 4096, 3584) == GemvConfig(**square)  # Q|K (V in Q6_K)
        assert lookup("sm90", "Q5_0", 1152, 896) == default_config(1152, 896)  # nothing measured at K = 896
        assert lookup("sm90", "Q4_K", 152064, 3584) == default_config(152064, 3584)  # over 4x from 18944


class _count_launches:
    """Triton launches by kernel name while inside `with` (the interpreter's entry point)."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self.counts = {}
        self._orig = InterpretedFunction.run
        counts = self.counts

        def run(fn, *args, **kwargs):
            counts[fn.__name__] = counts.get(fn.__name__, 0) + 1
            return self._orig(fn, *args, **kwargs)

        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._orig


def _sane_linear(t, n, k, opts, dtype, seed, bias=False):
    """Blocks of llama.cpp-like spread (std 1/sqrt(K): outputs of unit scale, no f16 overflow)."""
    import numpy as np

    from minivllm.bench.synthetic_model import q4_k_blocks, q6_k_blocks, q8_0_blocks
    from minivllm.kernels.quant_weight import QuantizedWeight

    make = {T.Q4_K: (q4_k_blocks, 256), T.Q6_K: (q6_k_blocks, 256), T.Q8_0: (q8_0_blocks, 32)}[t]
    blocks = make[0](np.random.default_rng(seed), n * k // make[1], k ** -0.5)
    w = QuantizedWeight(torch.from_numpy(np.ascontiguousarray(blocks)).reshape(n, -1), t, (n, k), f"w{seed}")
    b = 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(seed)) if bias else None
    return QuantLinear(w, b, options=opts, compute_dtype=dtype, name=f"w{seed}")


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_0], ids=lambda t: t.name)
def test_fused_7b_shapes_on_cuda(ggml_type):
    """Qwen2.5-7B shapes, compiled kernels: Q|K|V in one weight with the table's launch
    shape against the torch reference; with one launch shape for fused and parts, bit for
    bit; gate|up with the SwiGLU epilogue bit for bit against the separate GEMVs of the same
    shape then the swiglu kernel (the same tile, so the same sums)."""
    from test_triton_gemv import reference  # noqa: E402

    from minivllm.kernels.gemv_configs import lookup
    from minivllm.kernels.repacked_layout import concat_rows, repack
    from minivllm.kernels.triton.fused import swiglu
    from minivllm.kernels.triton.tiled_gemv import tiled_gemv, tiled_gemv_swiglu

    k = 3584
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(1, k, generator=gen) * 0.5).half().cuda()
    parts = [random_weight(ggml_type, n, k, device="cuda", seed=n) for n in (3584, 512, 512)]
    fused = concat_rows([repack(w) for w in parts], "qkv")
    ref = torch.cat([reference(x, w) for w in parts], dim=1)
    y = tiled_gemv(x, fused, lookup("sm90", ggml_type.name, 4608, k), out_dtype=torch.float16)
    torch.testing.assert_close(y.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
    cfg = lookup("sm90", ggml_type.name, 3584, k)
    y1 = tiled_gemv(x, fused, cfg, out_dtype=torch.float16)
    assert torch.equal(y1, torch.cat([tiled_gemv(x, repack(w), cfg, out_dtype=torch.float16) for w in parts], 1))
    gate, up = (random_weight(ggml_type, 18944, k, device="cuda", seed=s) for s in (1, 2))
    gu = concat_rows([repack(gate), repack(up)], "gate_up")
    for cfg in (lookup("sm90", ggml_type.name, 37888, k), GemvConfig(block_nb=4, block_g=32, split=4)):
        y = tiled_gemv_swiglu(x, gu, cfg, mid_dtype=torch.float16, out_dtype=torch.float16)
        sep = GemvConfig(max(2, cfg.block_nb), cfg.block_g, cfg.split, cfg.num_warps, cfg.num_stages)
        ref = swiglu(tiled_gemv(x, repack(gate), sep, out_dtype=torch.float16),
                     tiled_gemv(x, repack(up), sep, out_dtype=torch.float16), torch.float16)
        assert torch.equal(y, ref), cfg


def _tiny_model(dtype):
    """A 2-layer Qwen2-layout model: layer 0 all Q4_K (Q|K|V fuse), layer 1 with V and down
    in Q6_K (Q4_K_M's extra-bits layers: Q|K fuse, V alone)."""
    from minivllm.kernels.linear import QuantEmbedding
    from minivllm.kernels.rope import RotaryEmbedding
    from minivllm.model.config import ModelConfig
    from minivllm.model.decoder import DecoderLayer, DecoderModel

    d, ff, heads, kvh, hd, vocab = 256, 256, 2, 1, 64, 32
    cfg = ModelConfig("qwen2", n_layers=2, d_model=d, n_heads=heads, n_kv_heads=kvh, head_dim=hd, d_ff=ff,
                      vocab_size=vocab, rms_eps=1e-6, rope_base=10000.0, rope_dim=hd, rope_style="halves",
                      rope_linear_factor=1.0, context_length=64, qkv_bias=True, tied_embeddings=False,
                      has_rope_freqs=False)
    opts = KernelOptions(gemv_max_rows=8, dequant_cache=False)
    gen = torch.Generator().manual_seed(9)
    layers = []
    for i, more in enumerate((T.Q4_K, T.Q6_K)):
        s = 10 * i
        layers.append(DecoderLayer(
            attn_norm=1 + 0.1 * torch.randn(d, generator=gen),
            q=_sane_linear(T.Q4_K, heads * hd, d, opts, dtype, s, bias=True),
            k=_sane_linear(T.Q4_K, kvh * hd, d, opts, dtype, s + 1, bias=True),
            v=_sane_linear(more, kvh * hd, d, opts, dtype, s + 2, bias=True),
            o=_sane_linear(T.Q8_0, d, heads * hd, opts, dtype, s + 3),
            ffn_norm=1 + 0.1 * torch.randn(d, generator=gen),
            gate=_sane_linear(T.Q4_K, ff, d, opts, dtype, s + 4), up=_sane_linear(T.Q4_K, ff, d, opts, dtype, s + 5),
            down=_sane_linear(more, d, ff, opts, dtype, s + 6)))
    head = _sane_linear(T.Q6_K, vocab, d, opts, torch.float32, 99)
    embedding = QuantEmbedding(random_weight(T.Q8_0, vocab, d, seed=98), options=opts)
    rope = RotaryEmbedding(hd, 10000.0, "halves", device="cpu")
    return DecoderModel(cfg, embedding, layers, torch.ones(d), head, rope, dtype, torch.device("cpu"), opts)


@pytest.fixture
def few_programs(tmp_path, monkeypatch):
    """A launch table with 8 row groups and the whole K per program for the tiny model's
    shapes (the nearest-N rule covers the fused ones): the interpreter runs each program
    in Python, so fewer of them keep the test fast. Both runs use the same table."""
    big = {"block_nb": 8, "block_g": 8, "split": 1, "num_warps": 4, "num_stages": 2}
    with gemv_table(tmp_path, monkeypatch, {"sm90": {"configs": {"Q4_K:256x256": big, "Q6_K:128x256": big,
                                                                 "Q8_0:256x128": big}}}):
        yield


@cpu_only
def test_greedy_decode_is_unchanged_by_fusion_and_launches_fewer_gemvs(gpu_path_on_cpu, few_programs, monkeypatch):
    """The GPU code path (fused layer kernels, repacked GEMVs) on CPU tensors: the same
    logits, bit for bit, and so the same greedy tokens, with fusion on and off; a decode
    step's GEMV launches go from 7 per layer to 4 (Q|K|V, o, gate|up+SwiGLU, down), 5
    where V has another type, and the swiglu kernel's launches go."""
    import warnings

    from minivllm.cache.contiguous import ContiguousKVCache
    from minivllm.kernels.fused_projection import FUSED_PROJECTIONS_ENV

    runs = {}
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    for fusion in ("0", "1"):
        monkeypatch.setenv(FUSED_PROJECTIONS_ENV, fusion)
        model = _tiny_model(torch.float16)
        assert model.fuse_projections() == (4 if fusion == "1" else 0)  # q|k|v, q|k, two gate|up
        bytes_held = model.weight_bytes()
        cache = ContiguousKVCache(2, 16, 1, 64, torch.float16, "cpu")
        ids, logits_seen = [3, 17, 5, 30], []
        with model.using(KernelOptions(gemv_max_rows=1, dequant_cache=False)):  # prefill: 4 rows, GEMM
            logits = model.forward(torch.tensor(ids), 0, cache)
        counter = _count_launches()
        for step in range(3):
            logits_seen.append(logits)
            ids.append(int(logits.argmax()))
            with counter if step == 0 else _nothing():
                logits = model.forward(torch.tensor(ids[-1:]), len(ids) - 1, cache)
        runs[fusion] = (ids, logits_seen, counter.counts, bytes_held)
    caught.__exit__(None, None, None)
    assert not [w for w in seen if "could not run" in str(w.message)]  # no fallback to the torch steps
    (ids0, logits0, launches0, bytes0), (ids1, logits1, launches1, bytes1) = runs["0"], runs["1"]
    assert ids0 == ids1
    for a, b in zip(logits0, logits1):
        assert torch.equal(a, b)
    assert bytes0 == bytes1  # one copy of the weights either way
    # One decode step: 7 GEMVs per layer + the LM head, separate; 4 + 5 + 1 fused.
    assert launches0["_tiled_gemv_kernel"] == 2 * 7 + 1 and launches0["_swiglu_kernel"] == 2
    assert launches1["_tiled_gemv_kernel"] == 4 + 5 + 1 and "_swiglu_kernel" not in launches1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.cuda
def test_fusion_on_and_off_agree_on_cuda(tiny_qwen_gguf, monkeypatch):
    """A small synthetic Qwen2 file (Q5_0 rows of 896, Q8_0 V in the extra-bits layers) on
    CUDA, loaded with fusion on and off: logits within the f16 tolerance of each other
    (the launch shapes differ, so the sums may round differently), greedy tokens mostly
    the same, one copy of the weights either way."""
    from conftest import TINY_QWEN_PROMPTS
    from synthetic_gguf import minivllm_logits

    from minivllm.engine.llm import LLM
    from minivllm.kernels.fused_projection import FUSED_PROJECTIONS_ENV
    from minivllm.sampling.sampling_params import SamplingParams

    path, prompts = tiny_qwen_gguf, TINY_QWEN_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for fusion in ("1", "0"):
        monkeypatch.setenv(FUSED_PROJECTIONS_ENV, fusion)
        llm = LLM(str(path), progress=False, max_model_len=128, device="cuda", dtype="f16")
        ids = llm.tokenizer.encode(prompts[2])
        runs[fusion] = (minivllm_logits(llm.model, ids), [o.token_ids for o in llm.generate(prompts, params)],
                        llm.model.weight_bytes())
        del llm
        torch.cuda.empty_cache()
    (a, toks, bytes_on), (b, plain, bytes_off) = runs["1"], runs["0"]
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))
    assert sum(x == y for t1, t2 in zip(toks, plain) for x, y in zip(t1, t2)) >= 0.8 * sum(map(len, toks))
    assert bytes_on == bytes_off
