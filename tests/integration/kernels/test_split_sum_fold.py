"""The split-K sum folded into add_rms_norm (kernels/triton/split_sum.py).

References: a hand computation in torch of what a split GEMV's output is (slices summed
in order in float32, then the bias, rounded once to the out dtype) and of the residual
add (h + that, float32), bit for bit; the separate path (the GEMV's own split-sum launch,
then add_rms_norm), bit for bit; RMSNorm within float32 tolerance of
`kernels.rmsnorm.rms_norm` (its row sum runs in another order). The data is chosen so
that another slice order, a missing rounding or the bias added elsewhere changes the
bits (checked in the test). CPU runs Triton's interpreter; CUDA the compiled kernels,
also inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from gemv_table import gemv_table
from gguf import GGMLQuantizationType as T
from test_triton_gemv import random_weight  # noqa: E402
from triton_devices import DEVICES, INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.gemv_configs import GemvConfig  # noqa: E402
from minivllm.kernels.rmsnorm import rms_norm  # noqa: E402
from minivllm.kernels.triton.fused import add_rms_norm  # noqa: E402
from minivllm.kernels.triton.split_sum import SplitPartials  # noqa: E402
from minivllm.kernels.triton.tiled_gemv import sum_splits, tiled_gemv  # noqa: E402

cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")
EPS = 1e-6


@pytest.fixture
def device(request):
    return torch.device(request.param)


def _hand_sum(ws: torch.Tensor, bias, out_dtype, order=None) -> torch.Tensor:
    """The split GEMV's output by hand: float32 sum of the slices in `order` (default: slice
    order), + bias, rounded once to out_dtype."""
    order = range(ws.shape[0]) if order is None else order
    y = None
    for s in order:
        y = ws[s].clone() if y is None else y + ws[s]
    if bias is not None:
        y = y + bias
    return y.to(out_dtype)


def _workspace(split: int, m: int, d: int, device, seed: int) -> torch.Tensor:
    """Partials whose float32 sum depends on the order (from 3 slices on; two always add
    the same): slice 1 cancels slice 0 exactly, so in slice order the small slices after
    them add up exactly, while in any other order they are first rounded to the big
    values' steps."""
    gen = torch.Generator().manual_seed(seed)
    ws = torch.randn(split, m, d, generator=gen)
    ws[0] *= 3000.0
    if split > 2:
        ws[1] = -ws[0]
    return ws.to(device)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("m", [1, 5])
def test_add_rms_norm_of_partials_equals_the_separate_split_sum(device, split, has_bias, out_dtype, m):
    d = 320  # not a power of two: the masked tail of the row block
    gen = torch.Generator().manual_seed(100 * split + m)
    ws = _workspace(split, m, d, device, seed=split + 7 * m)
    bias = (0.3 * torch.randn(d, generator=gen)).to(device) if has_bias else None
    h = (4 * torch.randn(m, d, generator=gen)).to(device)
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device)

    y = _hand_sum(ws, bias, out_dtype)
    ref_h = h + y.float()
    # The data tells the orders and roundings apart, so the equalities below can fail.
    if split > 2:
        assert not torch.equal(_hand_sum(ws, bias, out_dtype, order=reversed(range(split))), y)
    assert not torch.equal(h + _hand_sum(ws, bias, torch.float32), ref_h) or out_dtype == torch.float32
    if has_bias:
        assert not torch.equal(h + _hand_sum(ws, None, out_dtype).float() + bias, ref_h)

    out = torch.empty((m, d), dtype=out_dtype, device=device)
    sum_splits(ws, out, bias)  # the separate launch
    assert torch.equal(out, y)
    h_sep, x_sep = add_rms_norm(h, out, w, EPS, torch.float16)
    h_fold, x_fold = add_rms_norm(h, SplitPartials(ws, bias, out_dtype), w, EPS, torch.float16)
    assert torch.equal(h_fold, ref_h) and torch.equal(h_sep, ref_h)
    assert torch.equal(x_fold, x_sep)
    torch.testing.assert_close(x_fold.float(), rms_norm(ref_h, w, EPS).half().float(), rtol=1e-3, atol=1e-3)
    if m > 1:  # a row alone: the same bits as in the batch
        one = SplitPartials(ws[:, 3:4].contiguous(), bias, out_dtype)
        assert torch.equal(add_rms_norm(h[3:4].contiguous(), one, w, EPS, torch.float16)[1][0], x_fold[3])


def test_add_rms_norm_refuses_a_delta_of_another_shape():
    h = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="delta of shape"):
        add_rms_norm(h, SplitPartials(torch.zeros(2, 3, 64), None, torch.float16), torch.ones(64), EPS, torch.float16)


# K = 512 (16 groups of 32) in 3 slices of 6 groups (the last one shorter), in 2 slices,
# and whole (a plain tensor).
_CONFIGS = [GemvConfig(block_nb=2, block_g=2, split=3), GemvConfig(block_nb=4, block_g=4, split=2),
            GemvConfig(block_nb=4, block_g=16, split=1)]


@cpu_only
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3])
def test_deferred_tiled_gemv_folds_to_the_same_bits(ggml_type, m):
    """tiled_gemv(defer_split_sum=True) hands back its workspace where K is split (a plain
    tensor where it is not), and add_rms_norm of it gives the bits of the GEMV's own sum."""
    from minivllm.kernels.repacked_layout import repack
    from minivllm.kernels.triton.tiled_gemv import launch_shape

    gen = torch.Generator().manual_seed(5)
    n, k = 64, 512
    for cfg in _CONFIGS:
        rw = repack(random_weight(ggml_type, n, k, seed=n + k))
        x = (torch.randn(m, k, generator=gen) * 0.5).half()
        bias = torch.randn(n, generator=gen)
        h, w = 4 * torch.randn(m, n, generator=gen), 1 + 0.1 * torch.randn(n, generator=gen)
        split = launch_shape(n, k, m, cfg)[2]
        for b in (bias, None):
            plain = tiled_gemv(x, rw, cfg, out_dtype=torch.float16, bias=b)
            deferred = tiled_gemv(x, rw, cfg, out_dtype=torch.float16, bias=b, defer_split_sum=True)
            if split == 1:
                assert isinstance(deferred, torch.Tensor) and torch.equal(deferred, plain)
                continue
            assert isinstance(deferred, SplitPartials) and deferred.split == split and deferred.shape == (m, n)
            assert torch.equal(_hand_sum(deferred.ws, b, torch.float16), plain)
            sep = add_rms_norm(h, plain, w, EPS, torch.float16)
            fold = add_rms_norm(h, deferred, w, EPS, torch.float16)
            assert torch.equal(fold[0], sep[0]) and torch.equal(fold[1], sep[1]), (cfg, b is None)


@cpu_only
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_quant_linear_partials_on_the_int8_and_float_paths(ggml_type, monkeypatch, tmp_path):
    """`QuantLinear.partials` through the dispatch (the GPU path on CPU tensors): the int8
    GEMV (MINIVLLM_Q8_GEMV=1) and the float tiled GEMV give their partials where the
    table splits K, and add_rms_norm of them equals add_rms_norm of the layer's output;
    the GEMM path (more rows than gemv_max_rows) gives the layer's tensor."""

    from minivllm.kernels.kernel_options import KernelOptions, kernel_options_for_call
    from minivllm.kernels.linear import QuantLinear

    n, k = 64, 512
    split2 = {"block_nb": 4, "block_g": 4, "split": 2, "num_warps": 4, "num_stages": 2}
    key = f"{ggml_type.name}:{n}x{k}"
    monkeypatch.setenv("MINIVLLM_TRITON_CPU", "1")
    with gemv_table(tmp_path, monkeypatch, {"sm90": {"configs": {key: split2}, "configs_int8": {key: split2}}}):
        gen = torch.Generator().manual_seed(8)
        opts = KernelOptions(gemv_max_rows=1, dequant_cache=False)
        lin = QuantLinear(random_weight(ggml_type, n, k, seed=3), torch.randn(n, generator=gen), options=opts,
                          compute_dtype=torch.float16, name="attn_output")
        h, w = 4 * torch.randn(2, n, generator=gen), 1 + 0.1 * torch.randn(n, generator=gen)
        x = (torch.randn(2, k, generator=gen) * 0.5).half()
        for int8 in ("0", "1"):
            monkeypatch.setenv("MINIVLLM_Q8_GEMV", int8)
            with kernel_options_for_call(opts):
                y, p = lin(x[:1]), lin.partials(x[:1])
                assert isinstance(p, SplitPartials) and p.split == 2 and p.out_dtype == torch.float16, int8
                assert torch.equal(add_rms_norm(h[:1], p, w, EPS, torch.float16)[1],
                                   add_rms_norm(h[:1], y, w, EPS, torch.float16)[1]), int8
                both = lin.partials(x)  # 2 rows: the GEMM path
                assert isinstance(both, torch.Tensor) and torch.equal(both, lin(x))
            assert opts.path_counts == {"gemv": 2, "gemm": 2}
            opts.path_counts.clear()


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type,n,k", [(T.Q4_K, 3584, 3584), (T.Q6_K, 3584, 18944), (T.Q4_K, 3584, 18944)],
                         ids=["o-Q4_K", "down-Q6_K", "down-Q4_K"])
def test_fold_on_cuda_at_7b_shapes_and_in_a_cuda_graph(ggml_type, n, k):
    """Qwen2.5-7B's o and down shapes, compiled kernels, the table's launch shape and a
    forced 4-way split: the fold gives the separate path's bits, eagerly and replayed in a
    CUDA graph with new inputs (no host sync, the workspace from the graph's pool)."""
    from minivllm.kernels.gemv_configs import lookup
    from minivllm.kernels.repacked_layout import repack

    rw = repack(random_weight(ggml_type, n, k, device="cuda", seed=k))
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(n, generator=gen).cuda()
    w = (1 + 0.1 * torch.randn(n, generator=gen)).cuda()
    x = torch.empty(1, k, dtype=torch.float16, device="cuda")  # the inputs a graph reads, refilled per replay
    h = torch.empty(1, n, device="cuda")

    def step(cfg, fold):
        y = tiled_gemv(x, rw, cfg, out_dtype=torch.float16, bias=bias, defer_split_sum=fold)
        return add_rms_norm(h, y, w, EPS, torch.float16)

    for cfg in (lookup("sm90", ggml_type.name, n, k), GemvConfig(block_nb=4, block_g=32, split=4)):
        x.copy_((torch.randn(1, k, generator=gen) * 0.5).half())
        h.copy_(4 * torch.randn(1, n, generator=gen))
        sep, fold = step(cfg, False), step(cfg, True)
        assert torch.equal(sep[0], fold[0]) and torch.equal(sep[1], fold[1]), cfg
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(cfg, True)
        x.copy_((torch.randn(1, k, generator=gen) * 0.5).half())
        h.copy_(4 * torch.randn(1, n, generator=gen))
        graph.replay()
        again = step(cfg, False)
        assert torch.equal(captured[0], again[0]) and torch.equal(captured[1], again[1]), cfg


@pytest.fixture
def split_o_and_down(tmp_path, monkeypatch):
    """A launch table giving the tiny model's o (Q8_0 256x128) and down (Q4_K, Q6_K
    256x256) projections 2 slices of K. By the nearest-N rule the fused Q|K|V, Q|K, V and
    gate|up of K = 256 take the 256x256 rows too (split, summed by their own launch, as
    nothing folds them); the LM head (Q6_K 32x256, 8x away) keeps the default, unsplit."""
    k256 = {"block_nb": 8, "block_g": 4, "split": 2, "num_warps": 4, "num_stages": 2}  # 8 groups: 4 + 4
    k128 = {"block_nb": 8, "block_g": 2, "split": 2, "num_warps": 4, "num_stages": 2}  # 4 groups: 2 + 2
    monkeypatch.setenv("MINIVLLM_TRITON_CPU", "1")
    monkeypatch.delenv("MINIVLLM_FUSED_PROJECTIONS", raising=False)
    with gemv_table(tmp_path, monkeypatch, {"sm90": {"configs": {"Q4_K:256x256": k256, "Q6_K:256x256": k256,
                                                                 "Q8_0:256x128": k128}}}):
        yield


@cpu_only
def test_greedy_decode_is_bit_identical_with_the_fold_and_launches_fewer_split_sums(split_o_and_down, monkeypatch):
    """The GPU code path on CPU tensors (the tiny 2-layer Qwen2 of test_fused_projection,
    fused projections on), fold on and off: the same logits bit for bit, so the same greedy
    tokens, for a batch-invariant prefill (4 rows through the split tiled GEMV) and three
    decode steps; in a decode step the 4 split sums of o and down (2 layers) are no longer
    launched, and add_rms_norm runs as often as before."""
    import warnings

    from test_fused_projection import _count_launches, _nothing, _tiny_model

    from minivllm.cache.contiguous import ContiguousKVCache
    from minivllm.kernels.fused_projection import FOLD_SPLIT_SUM_ENV
    from minivllm.kernels.kernel_options import KernelOptions

    runs = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for fold in ("0", "1"):
            monkeypatch.setenv(FOLD_SPLIT_SUM_ENV, fold)
            model = _tiny_model(torch.float16)
            assert model.fuse_projections() == 4
            with model.using(KernelOptions(gemv_max_rows=1, dequant_cache=False)):
                probe = (torch.randn(1, 128, generator=torch.Generator().manual_seed(0)) * 0.5).half()
                assert isinstance(model.layers[0].o.partials(probe), SplitPartials)  # the table splits o
            cache = ContiguousKVCache(2, 16, 1, 64, torch.float16, "cpu")
            ids, logits_seen = [3, 17, 5, 30], []
            with model.using(KernelOptions(gemv_max_rows=1, dequant_cache=False, batch_invariant=True)):
                logits = model.forward(torch.tensor(ids), 0, cache, all_logits=True)
            prefill, logits = logits, logits[-1]
            counter = _count_launches()
            for step in range(3):
                logits_seen.append(logits)
                ids.append(int(logits.argmax()))
                with counter if step == 0 else _nothing():
                    with model.using(KernelOptions(gemv_max_rows=1, dequant_cache=False)):
                        logits = model.forward(torch.tensor(ids[-1:]), len(ids) - 1, cache)
            runs[fold] = (ids, prefill, logits_seen + [logits], counter.counts)
    assert not [w for w in seen if "could not run" in str(w.message)]  # no fallback to the torch steps
    (ids0, prefill0, logits0, launches0), (ids1, prefill1, logits1, launches1) = runs["0"], runs["1"]
    assert ids0 == ids1
    assert torch.equal(prefill0, prefill1)
    for a, b in zip(logits0, logits1):
        assert torch.equal(a, b)
    # Separate: Q|K|V, o, gate|up, down in layer 0; Q|K, V, o, gate|up, down in layer 1.
    assert launches0["_sum_splits_kernel"] == 4 + 5
    assert launches1["_sum_splits_kernel"] == 4 + 5 - 4
    assert launches0["_add_rms_norm_kernel"] == launches1["_add_rms_norm_kernel"] == 2 * 2 + 1
    assert launches0["_tiled_gemv_kernel"] == launches1["_tiled_gemv_kernel"] == 4 + 5 + 1


@pytest.mark.cuda
def test_fold_on_and_off_give_the_same_bits_on_cuda(tiny_qwen_gguf, tmp_path, monkeypatch):
    """A small synthetic Qwen2 file on CUDA (CUDA graphs on, as by default), its o and down
    projections split in 2 by a launch table: fold on and off give the same logits bit for
    bit and the same greedy tokens, solo and batched, also in batch-invariant mode."""

    from conftest import TINY_QWEN_PROMPTS
    from synthetic_gguf import minivllm_logits

    from minivllm.engine.llm import LLM
    from minivllm.kernels.fused_projection import FOLD_SPLIT_SUM_ENV
    from minivllm.sampling.sampling_params import SamplingParams

    # The tiny file's o (896x896) and down (896x1024), whatever type each layer has.
    k896 = {"block_nb": 1, "block_g": 2, "split": 2, "num_warps": 4, "num_stages": 2}  # 28 groups: 14 + 14
    k1024 = {"block_nb": 1, "block_g": 4, "split": 2, "num_warps": 4, "num_stages": 2}  # 32 groups: 16 + 16
    rows = {}
    for t in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"):
        rows[f"{t}:896x896"], rows[f"{t}:896x1024"] = k896, k1024
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    with gemv_table(tmp_path, monkeypatch, {key: {"configs": rows, "configs_int8": rows}
                                            for key in ("sm90", "sm80", "sm75")}):
        for fold in ("0", "1"):
            monkeypatch.setenv(FOLD_SPLIT_SUM_ENV, fold)
            llm = LLM(str(tiny_qwen_gguf), progress=False, max_model_len=128, device="cuda", dtype="f16")
            layer = llm.model.layers[0]
            assert isinstance(layer.o.partials(torch.randn(1, 896, device="cuda").half()), SplitPartials)
            ids = llm.tokenizer.encode(TINY_QWEN_PROMPTS[2])
            inv = llm.fork(batch_invariant=True)
            runs[fold] = (minivllm_logits(llm.model, ids),
                          [o.token_ids for o in llm.generate(TINY_QWEN_PROMPTS, params)],
                          [o.token_ids for o in inv.generate(TINY_QWEN_PROMPTS, params)],
                          [inv.generate([p], params)[0].token_ids for p in TINY_QWEN_PROMPTS])
            del llm, inv
            torch.cuda.empty_cache()
    (logits0, toks0, inv0, solo0), (logits1, toks1, inv1, solo1) = runs["0"], runs["1"]
    assert torch.equal(logits0, logits1)
    assert toks0 == toks1 and inv0 == inv1 and solo0 == solo1
    assert inv1 == solo1  # batch-invariant mode: solo and batched alike, with the fold


class _StoringCache:
    """ContiguousKVCache with the paged pool's fused-store interface (`store_target`,
    `attend_stored`), so the decoder's RoPE kernel writes K and V itself on CPU tensors as
    it does on a GPU's pool; the positions are the slots."""

    def __init__(self, cache):
        self.cache = cache

    def view(self, start: int, n: int):
        outer = self

        class View:
            def store_target(self, layer):
                slots = torch.arange(start, start + n, dtype=torch.int32)
                return outer.cache.k[layer], outer.cache.v[layer], slots

            def attend_stored(self, layer, q):
                from minivllm.kernels.attention import causal_attention

                end = start + n
                return causal_attention(q, outer.cache.k[layer, :end], outer.cache.v[layer, :end], start)

        return View()


def _qkv_outputs(ws: torch.Tensor, bias):
    """A fused GEMV's partials and, separately summed (`sum_splits`), its output."""
    out = torch.empty(ws.shape[1:], dtype=torch.float16)
    sum_splits(ws, out, bias)
    return SplitPartials(ws, bias, torch.float16), out


@cpu_only
@pytest.mark.parametrize("layout", ["qkv", "qk+v-split", "qk+v-plain", "qk-plain+v-split"])
@pytest.mark.parametrize("m", [1, 3])
def test_rope_qk_partials_equals_the_split_sums_then_rope_qk(layout, m):
    """rope_qk_partials of a fused Q|K|V GEMV's partials, or of Q|K's and V's (each split or
    plain), gives rope_qk's bits on the separately summed outputs: the rotated queries and
    every key and value written to the cache (float32 and f16 caches, with biases); the
    data tells slice orders and roundings apart (checked)."""
    from minivllm.kernels.rope import RotaryEmbedding
    from minivllm.kernels.triton.fused import rope_qk, rope_qk_partials

    h, kvh, d = 6, 2, 32  # the partials' queries over two programs, the second one's last two heads masked
    gen = torch.Generator().manual_seed(m)
    rope = RotaryEmbedding(d, 10000.0, "halves", device="cpu")
    cos, sin = rope.cos_sin(torch.arange(5, 5 + m))
    qk_n, v_n = (h + kvh) * d, kvh * d
    fused = layout == "qkv"
    ws_qk = _workspace(3, m, qk_n + (v_n if fused else 0), "cpu", seed=m + 1)
    b_qk = 0.3 * torch.randn(ws_qk.shape[2], generator=gen)
    qk_p, qk_out = _qkv_outputs(ws_qk, b_qk)
    if fused:
        v_p, v_out = qk_p, qk_out[:, qk_n:]
    else:
        ws_v = _workspace(2, m, v_n, "cpu", seed=m + 2)
        b_v = 0.3 * torch.randn(v_n, generator=gen)
        v_p, v_out = _qkv_outputs(ws_v, b_v)
        if layout == "qk+v-plain":
            v_p = v_out
        if layout == "qk-plain+v-split":
            qk_p = qk_out
    assert not torch.equal(_hand_sum(ws_qk, b_qk, torch.float16, order=[2, 1, 0]), qk_out)
    for cache_dtype in (torch.float32, torch.float16):
        caches = []
        for use_partials in (False, True):
            kc = torch.full((8, kvh, d), float("nan"), dtype=cache_dtype)
            vc = torch.full((8, kvh, d), float("nan"), dtype=cache_dtype)
            slots = torch.tensor([6, 1, 3][:m], dtype=torch.int32)
            if use_partials:
                q = rope_qk_partials(qk_p, v_p, h, kvh, cos, sin, "halves", (kc, vc, slots))
            else:
                q_, k_ = qk_out[:, : h * d].view(m, h, d), qk_out[:, h * d: qk_n].view(m, kvh, d)
                q, _ = rope_qk(q_, k_, cos, sin, "halves", store=(kc, vc, slots, v_out.reshape(m, kvh, d)))
            caches.append((q, kc, vc))
        (q0, k0, v0), (q1, k1, v1) = caches
        assert torch.equal(q0, q1)
        assert torch.equal(k0.nan_to_num(), k1.nan_to_num()) and torch.equal(v0.nan_to_num(), v1.nan_to_num())
        assert not v0[slots[0].item()].isnan().any()  # the rows' slots were written


@cpu_only
def test_decode_with_the_qkv_fold_in_rope_is_bit_identical_and_launches_no_qkv_sums(split_o_and_down, monkeypatch):
    """The tiny model's GPU code path on CPU tensors with a cache that takes the fused K/V
    store (as a GPU's page pool does): fold on and off give the same logits bit for bit
    over a prefill and three decode steps; with the fold, a decode step launches none of
    the Q|K|V (layer 0), Q|K and V (layer 1) split sums, nor o's and down's, only gate|up's;
    without MINIVLLM_FOLD_QKV_SUM=1 (the default) the QKV ones launch again (same bits)."""
    import warnings

    from test_fused_projection import _count_launches, _nothing, _tiny_model

    from minivllm.cache.contiguous import ContiguousKVCache
    from minivllm.kernels.fused_projection import FOLD_QKV_SUM_ENV, FOLD_SPLIT_SUM_ENV
    from minivllm.kernels.kernel_options import KernelOptions

    runs = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for fold, qkv in (("0", "1"), ("1", "1"), ("1", "0")):
            monkeypatch.setenv(FOLD_SPLIT_SUM_ENV, fold)
            monkeypatch.setenv(FOLD_QKV_SUM_ENV, qkv)
            model = _tiny_model(torch.float16)
            assert model.fuse_projections() == 4
            cache = _StoringCache(ContiguousKVCache(2, 16, 1, 64, torch.float16, "cpu"))
            ids, seen_logits = [3, 17, 5, 30], []
            with model.using(KernelOptions(gemv_max_rows=1, dequant_cache=False, batch_invariant=True)):
                logits = model.forward_batch(torch.tensor(ids), torch.arange(4), cache.view(0, 4), None)[-1]
            counter = _count_launches()
            for step in range(3):
                seen_logits.append(logits)
                ids.append(int(logits.argmax()))
                with counter if step == 0 else _nothing():
                    with model.using(KernelOptions(gemv_max_rows=1, dequant_cache=False)):
                        pos = len(ids) - 1
                        logits = model.forward_batch(torch.tensor(ids[-1:]), torch.tensor([pos]),
                                                     cache.view(pos, 1), None)[0]
            runs[fold + qkv] = (ids, seen_logits + [logits], counter.counts)
    assert not [w for w in seen if "could not run" in str(w.message)]  # no fallback to the torch steps
    (ids0, logits0, launches0), launches1 = runs["01"], runs["11"][2]
    for ids, logits, _ in (runs["11"], runs["10"]):
        assert ids == ids0
        for a, b in zip(logits0, logits):
            assert torch.equal(a, b)
    assert launches0["_sum_splits_kernel"] == 4 + 5
    assert launches1["_sum_splits_kernel"] == 2  # gate|up's, one a layer
    assert runs["10"][2]["_sum_splits_kernel"] == 2 + 3  # and Q|K|V's, Q|K's, V's
    assert launches0["_rope_qk_kernel"] == launches1["_rope_qk_kernel"] == 2
