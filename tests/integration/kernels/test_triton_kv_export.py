"""The zero-copy export of a split request's K/V (kernels/triton/kv_export.py): every
destination page holds its source page converted as `Tensor.to` converts it, every other
page untouched. CPU runs Triton's interpreter on CPU pools; the `cuda` variant stores from
the GPU into a real shared pool registered as mapped host memory (the path a GPU prefill
worker takes), which only a GPU can check.
"""

from __future__ import annotations

import pytest
import torch
from triton_devices import DEVICES, INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.errors import ConfigError  # noqa: E402
from minivllm.kernels import fallbacks  # noqa: E402
from minivllm.kernels.triton import kv_export  # noqa: E402
from minivllm.kernels.triton.kv_export import export_pages  # noqa: E402
from minivllm.serving import kv_landing  # noqa: E402

SRC_PAGES, DST_PAGES = [9, 2, 5, 0, 7], [3, 4, 5, 8, 11]  # any order in, runs with gaps out


def _host_pools(layers: int, pages: int, page_shape: tuple, device: torch.device):
    """Destination pools filled with -7: plain CPU tensors, or, for a GPU, a shared pool
    mapped and registered the way a decode worker's is (cache/shared_pool_memory.py)."""
    if device.type == "cpu":
        return [torch.full((layers, pages, *page_shape), -7.0) for _ in range(2)], None
    from minivllm.cache.shared_pool_memory import SharedPoolMemory, attach

    owner = SharedPoolMemory((layers, pages, *page_shape), torch.float32)
    k, v = attach(owner.describe(), device)
    k.fill_(-7.0)
    v.fill_(-7.0)
    return [k, v], owner


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("page_shape", [(4, 2, 8), (16, 3, 50)], ids=["one-step", "three-steps-last-partial"])
def test_each_page_lands_in_its_reserved_page_converted(device, src_dtype, page_shape):
    device = torch.device(device)
    gen = torch.Generator().manual_seed(11)
    layers = 3
    src = [(100 * torch.randn(layers, 10, *page_shape, generator=gen)).to(src_dtype).to(device) for _ in range(2)]
    dst, owner = _host_pools(layers, 12, page_shape, device)
    export_pages(SRC_PAGES, DST_PAGES, src, dst)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for s_pool, d_pool in zip(src, dst):
        s_pool = s_pool.cpu()
        for layer in range(layers):
            for s, d in zip(SRC_PAGES, DST_PAGES):
                assert torch.equal(d_pool[layer, d], s_pool[layer, s].to(torch.float32)), (layer, s, d)
            for untouched in set(range(12)) - set(DST_PAGES):
                assert (d_pool[layer, untouched] == -7.0).all(), (layer, untouched)
    del owner


@pytest.mark.skipif(not INTERPRETED, reason="CPU pools run under the interpreter")
def test_mismatched_pools_are_refused_by_name():
    src = [torch.zeros(2, 4, 4, 2, 8, dtype=torch.float16)]
    with pytest.raises(ConfigError, match="export_pages"):
        export_pages([0, 1], [0], src, [torch.zeros(2, 4, 4, 2, 8)])
    with pytest.raises(ConfigError, match="same layers and page size"):
        export_pages([0], [0], src, [torch.zeros(2, 4, 8, 2, 8)])  # pages of another size
    with pytest.raises(ConfigError, match="same layers and page size"):
        export_pages([0], [0], src, [torch.zeros(3, 4, 4, 2, 8)])  # another layer count


@pytest.mark.skipif(not INTERPRETED, reason="CPU pools run under the interpreter")
def test_the_landing_takes_it_unless_told_not_to_and_falls_back_once_it_failed(monkeypatch):
    """kv_landing's switch: on unless MINIVLLM_EXPORT_ZERO_COPY=0 (any value but 0 or 1 refused
    by name); on, it stores the pages; a launch that raises is recorded as a fallback and the
    DMA path is taken from then on."""
    from minivllm.serving.kv_landing import _stored_by_the_gpu

    src = [torch.randn(2, 6, 4, 2, 8).half() for _ in range(2)]
    dst = [torch.full((2, 6, 4, 2, 8), -7.0) for _ in range(2)]
    monkeypatch.setattr(fallbacks, "_failed", {})
    monkeypatch.setenv(kv_landing.ZERO_COPY_ENV, "0")
    assert not _stored_by_the_gpu([1, 2], [3, 4], src, dst)
    assert (dst[0] == -7.0).all()
    monkeypatch.setenv(kv_landing.ZERO_COPY_ENV, "yes")
    with pytest.raises(ConfigError, match="MINIVLLM_EXPORT_ZERO_COPY=.*yes.*set it to 1"):
        _stored_by_the_gpu([1, 2], [3, 4], src, dst)
    monkeypatch.delenv(kv_landing.ZERO_COPY_ENV)
    assert _stored_by_the_gpu([1, 2], [3, 4], src, dst)
    assert torch.equal(dst[1][:, 4], src[1][:, 2].float())
    assert (dst[0][:, 0] == -7.0).all()  # pages not asked for untouched

    def refuse(*args):
        raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")

    monkeypatch.setattr(kv_export, "export_pages", refuse)
    monkeypatch.setattr(fallbacks, "_failed", {})
    with pytest.warns(RuntimeWarning, match="by DMA"):
        assert not _stored_by_the_gpu([1, 2], [3, 4], src, dst)
    assert fallbacks.failed("kv_export", ("cpu",))
    monkeypatch.setattr(kv_export, "export_pages", lambda *a: pytest.fail("a failed kernel is not tried again"))
    assert not _stored_by_the_gpu([1, 2], [3, 4], src, dst)


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton.kv_export import _export_pages_kernel
out = {}
for src in ("*fp16", "*fp32"):
    sig = {"src_ptr": src, "dst_ptr": "*fp32", "src_pages_ptr": "*i32", "dst_pages_ptr": "*i32",
           "src_layer_stride": "i64", "src_page_stride": "i64", "dst_layer_stride": "i64", "dst_page_stride": "i64",
           "PAGE": "constexpr", "BLOCK": "constexpr"}
    names = list(sig)  # as a launch specializes them: pointers and strides divisible by 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names[:2] + names[4:8]}
    k = triton.compile(ASTSource(_export_pages_kernel, sig, {"PAGE": 8192, "BLOCK": 1024}, attrs),
                       target=GPUTarget("cuda", int(sys.argv[1]), 32))
    p = k.asm["ptx"]
    out[src] = {"target": f".target sm_{sys.argv[1]}" in p, "bf16": "bf16" in p, "mma": "mma." in p,
                "wide_stores": "st.global.v4" in p}
print(json.dumps(out))
"""


@pytest.mark.parametrize("arch", ["75", "90"])
def test_export_kernel_compiles_for_t4_sm75_and_sm90(arch):
    """Without a device: no bf16, no tensor cores, and 16-byte stores (whole lines to the
    host are what keeps the link busy)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, arch], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for src, r in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert r == {"target": True, "bf16": False, "mma": False, "wide_stores": True}, src


@pytest.mark.skipif(not INTERPRETED, reason="the smoke run is the CPU's (interpreter)")
def test_the_export_bench_runs_both_paths_and_checks_their_pages(tmp_path):
    """scripts/export_bench.py --smoke: both paths and the plain copy timed, every path's
    pages equal to the source's (its exit status says so)."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    out = tmp_path / "export.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "export_bench.py"), str(out), "--smoke"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    paths = json.loads(out.read_text())["paths"]
    assert paths["dma"]["pages_equal"] and paths["zero-copy"]["pages_equal"]
    assert all(p["median_ms"] > 0 for p in paths.values())
