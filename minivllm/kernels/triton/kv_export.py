"""A split request's K/V pages written by the GPU straight into the decode worker's host
pool (issue 43), one launch per pool: no staging copy on the device, no DMA per layer.

Why: the DMA path (`serving/kv_landing.gather_layers`) gathers each group of layers' pages
on the device, converts them to the importer's dtype, then queues one DMA per layer and run
of destination pages. For a 4,096-token 0.5B prompt that is 100 MB in 48+ DMAs and as
many gather/convert launches; under a decode backlog they queue behind the decode graphs,
and the export took 1.8-2.3x a single pinned `copy_` of the same bytes (h100-s58).

Here every program reads one source page of one layer (f16 or f32, on the device) and
stores it, converted to the destination's dtype, into its reserved page of the host pool.
The pool is registered with the driver as mapped memory (cache/shared_pool_memory.py), so
the GPU's stores cross the link as posted writes, coalesced a page at a time. Triton's
launcher turns the pool's host address into its device alias itself: its driver.c
(Triton 3.9) asks `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)` for every
pointer argument; seen to work on an H100 (h100-s59: the pages bit-equal to the source's).
Values are those of `Tensor.to` (one rounding from the source dtype, none from f16 to f32).

The default since h100-s59, where a 4,096-token 0.5B export took 1.23x a pinned `copy_` of
the same bytes (1.29x with the default stream busy, 1.10x at the 7B's shape) against 19.6x
for the DMA path with the destination in runs of 7 pages. `MINIVLLM_EXPORT_ZERO_COPY=0` takes
the DMA path (the switch is `serving/kv_landing.zero_copy_requested`). A launch that fails
(a driver that will not map the pool) is recorded in `fallbacks.py` and the DMA path runs
instead.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from minivllm.errors import ConfigError

BLOCK = 1024  # elements a program stores per step: 4 KB of float32, whole 128-byte lines


@triton.jit
def _export_pages_kernel(src_ptr, dst_ptr, src_pages_ptr, dst_pages_ptr, src_layer_stride, src_page_stride,
                         dst_layer_stride, dst_page_stride, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = src_ptr + layer * src_layer_stride + tl.load(src_pages_ptr + i).to(tl.int64) * src_page_stride
    dst = dst_ptr + layer * dst_layer_stride + tl.load(dst_pages_ptr + i).to(tl.int64) * dst_page_stride
    for start in tl.static_range(0, PAGE, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < PAGE
        values = tl.load(src + offs, mask=ok, eviction_policy="evict_first")
        tl.store(dst + offs, values.to(dst_ptr.dtype.element_ty), mask=ok)


def export_pages(src_pages: list[int], dst_pages: list[int], src_pools, dst_pools) -> None:
    """Page src_pages[i] of every layer of each source pool (layers x pages x ...) into page
    dst_pages[i] of the matching destination pool, converted to its dtype, one launch per
    pool on the current stream. The sources live on the GPU, the destinations in host
    memory registered as mapped (or, under Triton's interpreter, both on the CPU). Each
    page must be contiguous, and a page the same number of values on both sides."""
    if len(src_pages) != len(dst_pages):
        raise ConfigError("export_pages", (len(src_pages), len(dst_pages)), "one destination page per source page")
    if not src_pages:
        return
    device = src_pools[0].device
    src_idx = torch.tensor(src_pages, dtype=torch.int32, device=device)
    dst_idx = torch.tensor(dst_pages, dtype=torch.int32, device=device)
    for src, dst in zip(src_pools, dst_pools):
        page = src[0, 0].numel()
        if (src.shape[0] != dst.shape[0] or dst[0, 0].numel() != page or not src[0, 0].is_contiguous()
                or not dst[0, 0].is_contiguous()):
            raise ConfigError("export_pages pools", (tuple(src.shape), tuple(dst.shape)),
                              "the same layers and page size on both sides, each page contiguous")
        grid = (len(src_pages), src.shape[0])
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _export_pages_kernel[grid](src, dst, src_idx, dst_idx, src.stride(0), src.stride(1), dst.stride(0),
                                       dst.stride(1), PAGE=page, BLOCK=min(BLOCK, triton.next_power_of_2(page)))

