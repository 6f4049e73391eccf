"""A split request's K/V written straight into the decode worker's own pages (issue 43).

The decode worker's CPU pool lives in memory this process can map (cache/shared_pool_
memory.py). Before the prefill worker's first token is due, the decode worker reserves
pages for the prompt's full pages (`LLMEngine.reserve_import`: blocks it has cached
already are kept, free pages taken for the rest) and the controller forwards that
*landing* to the prefill worker. At export, the prefill worker copies its pages into the
reserved ones: one copy, converted to the importer's dtype on the way (on a GPU exporter
the conversion runs on the GPU, then the device copies into the mapped pool by DMA, the
pool being host-registered). The importer then only indexes the pages (`LandedBlocks`):
no segment, no second copy.

    landing = {"pool": <SharedPoolMemory.describe()>, "have": n, "pages": [...], "page_size": ps}

Why the pages cannot be reused under the writer: the importer gives a reservation back
only when told by the controller, and the controller says so only after the prefill
worker is done with the request (its `exported` or terminal event, or its death); the
importer's own end frees the memory with it. The wire fields besides the K/V are the
segment path's (`handoff_fields`), so the importer's side differs in one field:
`landed` (how many blocks were written) instead of `segment`.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from minivllm.cache.kv_transfer import LandedBlocks, PageSpan
from minivllm.cache.shared_pool_memory import attach
from minivllm.engine.handoff import Handoff
from minivllm.errors import ConfigError
from minivllm.kernels import fallbacks
from minivllm.serving.kv_segment import handoff_fields, handoff_from_fields

# Whether a GPU exporter stores a split request's pages into the decode worker's pool with one
# kernel per pool (kernels/triton/kv_export.py, the default since h100-s59) or gathers them and
# copies by DMA (0). Read here, without Triton, so a worker checks it at start on any device.
ZERO_COPY_ENV = "MINIVLLM_EXPORT_ZERO_COPY"


def zero_copy_requested() -> bool:
    """On unless MINIVLLM_EXPORT_ZERO_COPY=0; any other value than 0 or 1 is refused by name."""
    value = os.environ.get(ZERO_COPY_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(ZERO_COPY_ENV, value, "set it to 1 (the GPU stores a split request's pages into the "
                          "decode worker's pool, the default) or 0 (gathered on the GPU, then copied by DMA)")
    return value == "1"


def handoff_to_landing(handoff: Handoff, landing: dict) -> dict:
    """Write `handoff`'s K/V (a PageSpan of this pool) into the importer's reserved pages and
    return the message fields for its import. Writes only the reserved blocks past those
    the importer had cached; the importer recomputes any tail past what was reserved."""
    span: PageSpan = handoff.kv
    t0 = time.perf_counter()
    src_k, src_v = span.pool.k, span.pool.v
    dst_k, dst_v = attach(landing["pool"], src_k.device)  # mapped already unless its prefetch is still going
    attach_ms = (time.perf_counter() - t0) * 1e3
    # On a GPU the copies run on a stream of their own: the worker's stream holds the decode
    # step queued ahead (async scheduling), and behind it an export under load waited a
    # whole step for nothing (h100-s55: 11x a plain copy_ with 8 answers decoding). Nothing
    # queued there writes these pages: they are full prompt pages, finished when the step
    # that wrote them returned the token this export waited for (the host has read it), and
    # the worker frees them only after this function has waited for its own stream.
    side = _side_stream(src_k.device)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        blocks, have = _write_pages(span, landing, src_k, src_v, dst_k, dst_v)
    if side is not None:
        side.synchronize()  # written before the importer is told (and before the pages are freed)
    written = max(0, blocks - have) * int(landing["page_size"])
    per_token = 2 * src_k[:, 0, 0].numel() * src_k.element_size()
    # What crossed the link: the K/V in the importer's dtype (a GPU's f16 pages arrive as a
    # CPU pool's f32, converted before the DMA), against `nbytes` in the exporter's.
    link_bytes = written * 2 * dst_k[:, 0, 0].numel() * dst_k.element_size()
    return {**handoff_fields(handoff), "landed": blocks, "landed_tokens": written, "nbytes": written * per_token,
            "link_bytes": link_bytes,
            "dtype": str(src_k.dtype).removeprefix("torch."), "write_ms": (time.perf_counter() - t0) * 1e3,
            "attach_ms": attach_ms}


_SIDE_STREAMS: dict = {}  # torch.device -> the stream exports copy on


def _side_stream(device: torch.device):
    """The export stream of a CUDA device (one per device and process), None elsewhere."""
    if device.type != "cuda":
        return None
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _write_pages(span: PageSpan, landing: dict, src_k, src_v, dst_k, dst_v) -> tuple[int, int]:
    """Copy the span's full pages past those the importer has into its reserved pages (on
    the current stream); returns (blocks landed, blocks it had)."""
    ps, dst_ps = span.pool.page_size, int(landing["page_size"])
    have, pages = int(landing["have"]), [int(p) for p in landing["pages"]]
    blocks = min(have + len(pages), span.n_tokens // dst_ps)
    if blocks <= have:
        pass
    elif ps == dst_ps and src_k.device.type == "cuda":
        src_pages, dst_pages = span.pages[have:blocks], pages[:blocks - have]
        if not _stored_by_the_gpu(src_pages, dst_pages, (src_k, src_v), (dst_k, dst_v)):
            gather_layers(src_pages, dst_pages, (src_k, src_v), (dst_k, dst_v))
    elif ps == dst_ps:  # page to page, in runs of consecutive pages on both sides
        pairs = [(span.pages[j], pages[j - have]) for j in range(have, blocks)]
        for src, dst, n in _runs(pairs):
            _copy(dst_k, src_k[:, src:src + n], dst, n)
            _copy(dst_v, src_v[:, src:src + n], dst, n)
    else:  # other page sizes: the tokens gathered first, then cut into the importer's pages
        kv = span.blocks()
        shape = (kv.k.shape[0], -1, dst_ps, *kv.k.shape[2:])
        gk, gv = kv.k[:, :blocks * dst_ps].reshape(shape), kv.v[:, :blocks * dst_ps].reshape(shape)
        pairs = [(j, pages[j - have]) for j in range(have, blocks)]
        for src, dst, n in _runs(pairs):
            _copy(dst_k, gk[:, src:src + n], dst, n)
            _copy(dst_v, gv[:, src:src + n], dst, n)
    return blocks, have


# Bytes (in the destination's dtype) one gather of `gather_layers` may hold on the source
# device: a few layers a launch. One layer a launch took 3.5-4.5 ms to export a 4,096-token
# 0.5B prompt's 100 MB under a decode backlog (h100-s58: 96 small gather and convert
# launches queued behind the decode graphs, at 1.8-2.3x a plain copy's time); every layer
# at once held ~1 GB for a 7B prompt of that length.
GATHER_BYTES = 64 << 20


def gather_layers(src_pages: list[int], dst_pages: list[int], src_pools, dst_pools) -> None:
    """Pages `src_pages` of each source pool (layers x pages x ...) into pages `dst_pages`
    of the matching destination pool, a few layers at a time: gathered where the source
    lives (one launch for the group's layers, whatever the page order) in the destination's
    dtype, then one copy per layer and run of consecutive destination pages (on a GPU: DMAs
    into the host-registered pool, queued on the current stream). The transient copy is a
    group's pages (at most GATHER_BYTES, at least one layer); the caching allocator reuses
    it group after group on the same stream, which orders each reuse after the DMAs that
    read it."""
    idx = torch.tensor(src_pages, dtype=torch.long, device=src_pools[0].device)
    runs = _runs(list(enumerate(dst_pages)))
    n_layers = src_pools[0].shape[0]
    page = src_pools[0][0, 0]
    layer_bytes = len(src_pages) * page.numel() * dst_pools[0].element_size()
    group = max(1, min(n_layers, GATHER_BYTES // max(1, layer_bytes)))
    for first in range(0, n_layers, group):
        last = min(n_layers, first + group)
        for src, dst in zip(src_pools, dst_pools):
            gathered = src[first:last].index_select(1, idx).to(dst.dtype)  # (layers, pages, ...), contiguous
            for i, layer in enumerate(range(first, last)):
                for s, d, n in runs:
                    dst[layer, d:d + n].copy_(gathered[i, s:s + n], non_blocking=src.device.type == "cuda")


def _stored_by_the_gpu(src_pages: list[int], dst_pages: list[int], src_pools, dst_pools) -> bool:
    """The zero-copy export (kernels/triton/kv_export.py) where asked for and not failed here
    before; False when the caller must take the DMA path. (Imported here: only a CUDA
    exporter gets this far, and Triton is installed only where one can run.)"""
    from minivllm.kernels.triton.kv_export import export_pages

    key = (str(src_pools[0].device),)
    if not zero_copy_requested() or fallbacks.failed("kv_export", key):
        return False
    try:
        export_pages(src_pages, dst_pages, src_pools, dst_pools)
    except Exception as exc:  # noqa: BLE001 - e.g. a driver that would not map the pool: the DMA path
        fallbacks.record("kv_export", key, src_pools[0].device, exc, "the export gathers and copies by DMA")
        return False
    return True


def handoff_from_landing(meta: dict, params) -> Handoff:
    """The importer's Handoff for K/V already in its reserved pages."""
    return handoff_from_fields(meta, params, LandedBlocks(list(meta["kv_token_ids"]), int(meta["landed"])))


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source start, destination start, length) of the runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def _copy(dst: torch.Tensor, src: torch.Tensor, start: int, n: int) -> None:
    """`src` (layers × n pages × ...) into pages start..start+n of the mapped pool `dst`."""
    if src.device.type == "cpu":
        dst[:, start:start + n].copy_(src)  # one strided copy, converting the dtype on the way
        return
    # From a GPU (other page sizes): convert there, then one DMA per layer (each a
    # contiguous range of the pool; the pool is host-registered, so asynchronous).
    src = src.to(dst.dtype).contiguous()
    for layer in range(src.shape[0]):
        dst[layer, start:start + n].copy_(src[layer], non_blocking=True)
