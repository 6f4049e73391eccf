"""A split request's K/V export timed alone (issue 43's transfer row): the pages of one
prompt from a GPU pool (f16) into a decode worker's shared CPU pool (f32, mapped and
registered as the worker's is), by each path, against one plain pinned `copy_` of the same
bytes.

    python scripts/export_bench.py OUT_JSON [--tokens 4096] [--shape 0.5B] [--busy]
    TRITON_INTERPRET=1 python scripts/export_bench.py OUT_JSON --smoke   # no GPU: tiny shapes

Paths: `dma` (serving/kv_landing.gather_layers: layer groups gathered and converted on the
GPU, then a DMA per layer and run of pages) and `zero-copy` (kernels/triton/kv_export.py:
one kernel per pool storing into the mapped pool). Each is timed from the host's call to
the export stream's end, as kv_landing times it, on a stream of its own; the median and
mean ± std of --repeats runs, and the ratio to the plain copy (the row's floor: within 2x).
--busy keeps the default stream replaying a graph of GEMM-sized work meanwhile, the way a
decode backlog keeps the exporter busy (a rough stand-in for the bench's backlog of 8).
Source pages are taken in a shuffled order and land in runs with gaps, as a landing's
reserved pages can; every path's pages are checked against the source.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHAPES = {"7B": dict(layers=28, kv_heads=4, head_dim=128), "0.5B": dict(layers=24, kv_heads=2, head_dim=64)}
PAGE_SIZE = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_json")
    p.add_argument("--tokens", type=int, default=4096, help="prompt tokens exported (whole pages)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5B")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--busy", action="store_true", help="the default stream kept busy meanwhile")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    return p.parse_args(argv)


def page_lists(n: int, pool_pages: int, seed: int = 3) -> tuple[list[int], list[int]]:
    """n source pages in a shuffled order; n destination pages in runs of 7 with one-page gaps."""
    import random

    src = random.Random(seed).sample(range(pool_pages), n)
    dst = [i + i // 7 for i in range(n)]
    return src, dst


def time_path(run, device, repeats: int) -> list[float]:
    """ms per call of `run()` on a stream of its own, host call to stream end."""
    import torch

    times = []
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    for _ in range(repeats + 1):  # the first is a warm-up (kernel compile, page faults)
        t0 = time.perf_counter()
        if side is not None:
            with torch.cuda.stream(side):
                run()
            side.synchronize()
        else:
            run()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[1:]


def stats(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "std_ms": statistics.stdev(ms) if len(ms) > 1 else 0.0, "runs_ms": ms}


def main(argv=None) -> int:
    import torch

    from minivllm.cache.shared_pool_memory import SharedPoolMemory, attach
    from minivllm.kernels.triton.kv_export import export_pages
    from minivllm.serving.kv_landing import gather_layers

    args = parse_args(argv)
    shape = dict(layers=2, kv_heads=2, head_dim=8) if args.smoke else SHAPES[args.shape]
    tokens = 64 if args.smoke else args.tokens
    device = torch.device("cpu" if args.smoke else "cuda:0")
    n = tokens // PAGE_SIZE
    page = (PAGE_SIZE, shape["kv_heads"], shape["head_dim"])
    src_pages, dst_pages = page_lists(n, 2 * n)
    gen = torch.Generator().manual_seed(5)
    src = [torch.randn(shape["layers"], 2 * n, *page, generator=gen).half().to(device) for _ in range(2)]
    owner = SharedPoolMemory((shape["layers"], dst_pages[-1] + 1, *page), torch.float32)
    dst = attach(owner.describe(), device)
    link_bytes = 2 * shape["layers"] * n * PAGE_SIZE * shape["kv_heads"] * shape["head_dim"] * 4
    busy = BusyStream(device) if args.busy else None
    rows = {}
    paths = {"dma": lambda: gather_layers(src_pages, dst_pages, src, dst),
             "zero-copy": lambda: export_pages(src_pages, dst_pages, src, dst)}
    for name, run in paths.items():
        for d in dst:
            d.fill_(-7.0)
        try:
            ms = time_path(run, device, 2 if args.smoke else args.repeats)
        except Exception as exc:  # noqa: BLE001 - a path that cannot run here is reported, not fatal
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        ok = all(torch.equal(d[layer, dp], s[layer, sp].float().cpu()) for s, d in zip(src, dst)
                 for layer in range(shape["layers"]) for sp, dp in zip(src_pages, dst_pages))
        rows[name] = {**stats(ms), "pages_equal": ok}
    flat = torch.empty(link_bytes // 4, dtype=torch.float32, device=device)
    host = torch.empty(flat.shape, dtype=torch.float32, pin_memory=device.type == "cuda")
    rows["plain copy_"] = stats(time_path(lambda: host.copy_(flat, non_blocking=True), device,
                                          2 if args.smoke else args.repeats))
    if busy is not None:
        busy.stop()
    plain = rows["plain copy_"]["median_ms"]
    for r in rows.values():
        if "median_ms" in r:
            r["gb_per_s"] = link_bytes / r["median_ms"] / 1e6
            r["over_plain_copy"] = r["median_ms"] / plain
    out = {"shape": args.shape if not args.smoke else "smoke", "tokens": tokens, "pages": n,
           "link_bytes": link_bytes, "busy": args.busy, "device": describe(device), "paths": rows,
           "timing": "host call to the export stream's end, median and mean ± std of the repeats after one warm-up"}
    Path(args.out_json).write_text(json.dumps(out, indent=1))
    for name, r in rows.items():
        if "median_ms" in r:
            print(f"{name:12s} {r['median_ms']:7.2f} ms (mean {r['mean_ms']:.2f} ± {r['std_ms']:.2f}) "
                  f"{r['gb_per_s']:6.1f} GB/s  {r['over_plain_copy']:.2f}x the plain copy"
                  f"{'' if r.get('pages_equal', True) else '  PAGES DIFFER'}")
        else:
            print(f"{name:12s} {r['error']}")
    return 0 if all(r.get("pages_equal", True) for r in rows.values() if "error" not in r) else 1


def describe(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"


class BusyStream:
    """The default stream replaying GEMMs until `stop()`: a decode backlog's stand-in."""

    def __init__(self, device):
        import threading

        import torch

        self.done = threading.Event()
        a = torch.randn(4096, 4096, device=device, dtype=torch.float16)

        def loop():
            with torch.cuda.device(device):
                while not self.done.is_set():
                    for _ in range(8):
                        a @ a
                    torch.cuda.current_stream(device).synchronize()

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(10)


if __name__ == "__main__":
    raise SystemExit(main())
