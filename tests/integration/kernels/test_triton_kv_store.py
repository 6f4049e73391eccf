"""Writing a step's K/V into their page slots in one launch (kernels/triton/kv_store.py),
and RoPE writing them itself (`rope_qk(..., store=...)`), against torch's two
`index_copy_` writes: the same bits in every slot, the rest of the cache untouched.
CPU runs Triton's interpreter; `cuda` variants the compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_devices import DEVICES  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.rope import RotaryEmbedding  # noqa: E402
from minivllm.kernels.triton.fused import rope_qk  # noqa: E402
from minivllm.kernels.triton.kv_store import store_kv  # noqa: E402


@pytest.fixture
def device(request):
    return torch.device(request.param)


def _caches(slots: int, kvh: int, d: int, dtype: torch.dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, kvh, d, generator=gen).to(dtype).to(device),
            torch.randn(slots, kvh, d, generator=gen).to(dtype).to(device))


def _index_writes(kc, vc, slots, k, v):
    """The old path (PagedBatchKV.attend before): two index_copy_ on copies."""
    kr, vr = kc.clone(), vc.clone()
    kr.index_copy_(0, slots, k.to(kr.dtype))
    vr.index_copy_(0, slots, v.to(vr.dtype))
    return kr, vr


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float16),
                                                   (torch.float32, torch.float32)])
@pytest.mark.parametrize("kvh,d", [(4, 128), (2, 64)])
def test_store_kv_equals_two_index_writes(device, src_dtype, cache_dtype, kvh, d):
    kc, vc = _caches(48, kvh, d, cache_dtype, device, seed=kvh + d)
    gen = torch.Generator().manual_seed(5)
    # Values whose f32 -> f16 rounding is not trivial, scattered slots out of order.
    k = (100 * torch.randn(5, kvh, d, generator=gen)).to(src_dtype).to(device)
    v = (100 * torch.randn(5, kvh, d, generator=gen)).to(src_dtype).to(device)
    slots = torch.tensor([17, 3, 40, 0, 47], device=device)
    ref_k, ref_v = _index_writes(kc, vc, slots, k, v)
    store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("style", ["halves", "adjacent"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
def test_rope_qk_store_equals_rope_then_index_writes(device, style, cache_dtype):
    """7B shape: RoPE storing K and V gives the cache the bits that rope_qk's keys plus
    two index writes give, and the same q and k outputs as without the store."""
    t, h, kvh, d = 3, 28, 4, 128
    gen = torch.Generator().manual_seed(6)
    rope = RotaryEmbedding(d, 1e6, style, device=device)
    cos, sin = rope.cos_sin(torch.tensor([0, 511, 4095], device=device))
    q = torch.randn(t, h, d, generator=gen).half().to(device)
    k = torch.randn(t, kvh, d, generator=gen).half().to(device)
    v = torch.randn(t, kvh, d, generator=gen).half().to(device)
    kc, vc = _caches(32, kvh, d, cache_dtype, device, seed=7)
    slots = torch.tensor([31, 2, 16], device=device)
    qo, ko = rope_qk(q, k, cos, sin, style)
    ref_k, ref_v = _index_writes(kc, vc, slots, ko, v)
    qs, ks = rope_qk(q, k, cos, sin, style, store=(kc, vc, slots, v))
    assert torch.equal(qs, qo) and torch.equal(ks, ko)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_store_kv_shape_errors_name_the_inputs():
    from minivllm.errors import ConfigError

    kc = torch.zeros(8, 2, 64)
    with pytest.raises(ConfigError, match="store_kv shapes"):
        store_kv(torch.zeros(2, 2, 64), torch.zeros(2, 2, 64), kc, kc, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ConfigError, match="store_kv shapes"):
        store_kv(torch.zeros(2, 4, 64), torch.zeros(2, 4, 64), kc, kc, torch.zeros(2, dtype=torch.long))


@pytest.mark.cuda
def test_paged_batch_kv_stores_like_index_writes_on_cuda():
    """PagedBatchKV on CUDA: `attend` (one store launch) and `store_target` + rope_qk +
    `attend_stored` leave the pool as two index writes would and attend alike."""
    from minivllm.cache.batch_kv import PagedBatchKV, Segment
    from minivllm.cache.page_pool import PagePool

    pools = [PagePool(n_layers=2, num_pages=12, page_size=16, n_kv_heads=2, head_dim=64, dtype=torch.float16,
                      device="cuda") for _ in range(3)]
    for p in pools:
        p.k.normal_(generator=torch.Generator("cuda").manual_seed(1))
        p.v.normal_(generator=torch.Generator("cuda").manual_seed(2))
    segs = [Segment([3, 7], 20, 1), Segment([5], 9, 1)]
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 14, 64, generator=gen).cuda()
    k = torch.randn(2, 2, 64, generator=gen).half().cuda()
    v = torch.randn(2, 2, 64, generator=gen).half().cuda()
    cos, sin = RotaryEmbedding(64, 1e6, "halves", device="cuda").cos_sin(torch.tensor([20, 9], device="cuda"))
    qr, kr = rope_qk(q, k, cos, sin, "halves")
    ref = PagedBatchKV(pools[0], segs)
    slots = ref.write_slots
    kf, vf = pools[0].k[1].view(-1, 2, 64), pools[0].v[1].view(-1, 2, 64)
    kf.index_copy_(0, slots, kr)
    vf.index_copy_(0, slots, v)
    out_ref = ref.attend_stored(1, qr)
    out_a = PagedBatchKV(pools[1], segs).attend(1, qr, kr, v)
    fused = PagedBatchKV(pools[2], segs)
    target = fused.store_target(1)
    assert target is not None
    q2, _ = rope_qk(q, k, cos, sin, "halves", store=(*target, v))
    out_b = fused.attend_stored(1, q2)
    for p in pools[1:]:
        assert torch.equal(p.k, pools[0].k) and torch.equal(p.v, pools[0].v)
    assert torch.equal(out_a, out_ref) and torch.equal(out_b, out_ref)


_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton import kv_store as ks
out = {}
sig = {"k_ptr": "*fp16", "v_ptr": "*fp16", "kc_ptr": "*fp16", "vc_ptr": "*fp16", "slots_ptr": "*i64"}
sig.update({n: "i32" for n in ("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_kcs", "stride_kch",
                               "stride_vcs", "stride_vch")})
const = {"KVH": 4, "HEAD_DIM": 128, "BLOCK_H": 4, "BLOCK_D": 128, "PDL": False}
sig.update({n: "constexpr" for n in const})
attrs = {(i,): [["tt.divisibility", 16]] for i in range(13)}
for cc in (75, 90):
    const["PDL"] = cc >= 90
    k = triton.compile(ASTSource(ks._store_kv_kernel, sig, const, attrs=attrs),
                       target=GPUTarget("cuda", cc, 32 if cc < 90 else 128), options={"num_warps": 2})
    out[f"sm{cc}"] = k.asm["ptx"]
print(json.dumps({key: {"target": f".target sm_{key[2:]}" in p, "bf16": "bf16" in p, "mma": "mma." in p,
                         "gdc": "griddepcontrol.wait" in p}
                  for key, p in out.items()}))
"""


def test_store_kernel_compiles_for_sm75_and_sm90():
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {f"sm{cc}": {"target": True, "bf16": False, "mma": False, "gdc": cc == 90} for cc in (75, 90)}
