"""Sweep the tiled decode GEMV's launch shapes on this GPU and write its config table.

For each weight type and Qwen2.5-7B shape (the attention, K/V, FFN up/gate, FFN down and
LM-head matrices) this times, at M = 1 from CUDA-graph replays over weight copies larger
than the L2 (`bench/kernels.graph_us`), every candidate (row groups per program, groups
per trip, warps, pipeline stages, K slices) of `kernels/triton/tiled_gemv.py`, the older
one-row-group kernel (`MINIVLLM_GEMV_KERNEL=legacy`), the fused projections' shapes
(Q|K|V, Q|K and gate|up, the last with its SwiGLU epilogue, as the decoder launches it), the same candidates of the
int8-activation kernel (`q8_gemv.py`; activations quantized once beforehand, as a layer's
Q/K/V share one quantization; the quantize kernel is timed on its own) and f16 cuBLAS on the dense
matrix, against the measured copy bandwidth (bytes read + written).

    python3 scripts/gemv_sweep.py OUTDIR [--types Q4_K,Q6_K] [--quick Q4_0,Q4_1] [--shapes fused,0.5b]

`--shapes` (sets 7b, fused, 0.5b, or NxK entries; default all) sweeps a part: the shapes it
does not measure keep the committed table's rows in the written config table.

Writes OUTDIR/gemv-sweep-<key>.json (every timing, the device, the winners),
OUTDIR/gemv-sweep-<key>.md and OUTDIR/gemv_configs.json: the committed table
(minivllm/kernels/gemv_configs.json) with this profile's row replaced, which
MINIVLLM_GEMV_CONFIGS=OUTDIR/gemv_configs.json makes the engine use before it is committed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

# The Qwen2.5-7B matrices; the fused projections of the 7B (kernels/fused_projection.py):
# Q|K|V, Q|K (V in Q6_K), gate|up; the 0.5B's separate and fused shapes (K = 896: legacy
# types only, 896 is not whole 256-element super-blocks).
SHAPE_SETS = {
    "7b": [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944), (152064, 3584)],
    "fused": [(4608, 3584), (4096, 3584), (37888, 3584)],
    "0.5b": [(896, 896), (128, 896), (1152, 896), (1024, 896), (4864, 896), (9728, 896), (896, 4864)],
}
SHAPES = [shape for shapes in SHAPE_SETS.values() for shape in shapes]
# Fused gate|up weights: the float kernel is timed with its SwiGLU epilogue (`tiled_gemv_swiglu`),
# the launch the decoder makes for them at one row.
PAIRED_SHAPES = {(37888, 3584), (9728, 896)}
K_QUANTS = {"Q4_K", "Q6_K"}  # rows must be whole 256-element super-blocks
LM_HEAD_TYPES = {"Q4_K", "Q6_K", "Q8_0"}  # the big matrix only for the types an LM head has
TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "Q4_1"]
# (block_nb, block_g, num_warps, num_stages): the tile a program reads per trip is
# block_nb * block_g * 64 bytes (4-bit types), 2 - 8 KB.
CANDIDATES = [(1, 64, 4, 2), (2, 32, 4, 2), (4, 32, 4, 2), (4, 16, 4, 3), (8, 16, 4, 2), (2, 64, 8, 2),
              (8, 32, 8, 2), (4, 64, 8, 3)]
# (4, 16, 4, 2): half the words a trip of (8, 16), so two trips held before the PDL wait
# (MINIVLLM_GEMV_EARLY_LOAD=2) take the registers one trip of (8, 16) does (gemv_sass.py --early)
QUICK = [(1, 64, 4, 2), (4, 32, 4, 2), (8, 32, 8, 2), (8, 16, 4, 2), (4, 16, 4, 2)]


def _splits(n: int, k: int, block_nb: int, block_g: int, sms: int) -> list[int]:
    row_groups = -(-n // 4)  # ceil(n / 4): the kernel's 4-row groups
    tiles = -(-row_groups // block_nb)
    groups = k // 32
    trips = groups // block_g if groups % block_g == 0 else 0
    # Powers of two, and the splits into whole trips (112 groups at block_g 16: 7 slices of
    # one trip), where a power of two would leave each slice a masked partial trip.
    whole = [s for s in range(3, 17) if trips and trips % s == 0]
    out = [1]
    for s in sorted({2, 4, 8, 16, *whole}):
        if groups // s >= block_g and tiles * s <= 16 * sms and tiles < 4 * sms:
            out.append(s)
    return out


def _precompile(tname: str, k: int, kernel: str, cands: list, splits: list[int]) -> str:
    """Compile (into Triton's on-disk cache) every variant the timing loop will launch for
    one (type, K, kernel): the launch constants do not depend on N, so a small N does."""
    from minivllm.bench.kernels import random_weight
    from minivllm.kernels.gemv_configs import GemvConfig
    from minivllm.kernels.repacked_layout import repack
    from minivllm.kernels.triton import q8_gemv as q8
    from minivllm.kernels.triton.tiled_gemv import tiled_gemv, tiled_gemv_swiglu

    dev = torch.device("cuda")
    w = repack(random_weight(GGMLQuantizationType[tname], 64, k, device=dev, seed=0))
    x = torch.randn(1, k, device=dev).half()
    xq = q8.quantize_q8(x)
    for nb, g, nw, st in cands:
        for split in splits:
            cfg = GemvConfig(block_nb=nb, block_g=g, split=split, num_warps=nw, num_stages=st)
            try:
                if kernel == "float":
                    tiled_gemv(x, w, cfg, out_dtype=torch.float16)
                    if any(pk == k for _, pk in PAIRED_SHAPES):  # the gate+up launch with its epilogue
                        tiled_gemv_swiglu(x, w, cfg, mid_dtype=torch.float16, out_dtype=torch.float16)
                else:
                    q8.q8_gemv(x, w, cfg, out_dtype=torch.float16, xq=xq)
            except Exception:  # the timing loop records it
                pass
    torch.cuda.synchronize()
    return f"{tname} K={k} {kernel}"


def _precompile_all(types: list[str], quick: set[str], workers: int) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(t, k, kern, QUICK if t in quick else CANDIDATES, [1, 2])
            for t in types for k in sorted({k for _, k in SHAPES if not (t in K_QUANTS and k % 256)})
            for kern in ("float", "int8")]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in pool.map(_precompile, *zip(*jobs)):
            print(f"compiled {done}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--quick", default="", help="types (comma-separated) swept over 3 tile candidates instead of 8")
    ap.add_argument(
        "--compile-workers", type=int, default=8, help="processes that compile the variants first (0: none)"
    )
    ap.add_argument("--shapes", default="all", help="comma-separated shape sets (7b, fused, 0.5b) or NxK entries")
    args = ap.parse_args()
    global SHAPES
    SHAPES = parse_shapes(args.shapes)
    from minivllm.bench.kernels import copy_bandwidth_gbs, graph_us, random_weight
    from minivllm.kernels.gemv_configs import GemvConfig, default_config, lookup, shape_key
    from minivllm.kernels.gpu_profile import gpu_profile
    from minivllm.kernels.repacked_layout import repack
    from minivllm.kernels.triton import q8_gemv as q8
    from minivllm.kernels.triton.fused import swiglu
    from minivllm.kernels.triton.repacked_gemv import repacked_gemv
    from minivllm.kernels.triton.tiled_gemv import tiled_gemv, tiled_gemv_swiglu

    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    prof = gpu_profile(dev)
    name = torch.cuda.get_device_name(dev)
    if args.compile_workers:
        t0 = time.time()
        try:
            _precompile_all(args.types.split(","), set(args.quick.split(",")), args.compile_workers)
            print(f"precompiled in {time.time() - t0:.0f} s", flush=True)
        except Exception as exc:  # the timing loop compiles what is missing, one at a time
            print(f"precompile failed after {time.time() - t0:.0f} s: {type(exc).__name__}: {exc}", flush=True)
    copy_gbs = copy_bandwidth_gbs(dev)
    print(f"{name} ({prof.table_key}, {prof.sm_count} SMs): copy {copy_gbs:.0f} GB/s (read + write)", flush=True)
    rows, winners, winners_int8 = [], {}, {}
    t0 = time.time()
    for tname in args.types.split(","):
        gt = GGMLQuantizationType[tname]
        for n, k in SHAPES:
            if (n > 100_000 and tname not in LM_HEAD_TYPES) or (tname in K_QUANTS and k % 256):
                continue
            paired = (n, k) in PAIRED_SHAPES
            copies = max(2, -(-(160 << 20) // int(n * k * 0.6)))
            ws = [repack(random_weight(gt, n, k, device=dev, seed=i)) for i in range(copies)]
            nbytes = ws[0].nbytes
            x = torch.randn(1, k, device=dev).half()

            def frac(us, nbytes=nbytes):
                return nbytes / (us * 1e-6) / 1e9 / copy_gbs

            row = {"type": tname, "n": n, "k": k, "mbytes": nbytes / 1e6, "candidates": []}
            os.environ["MINIVLLM_GEMV_KERNEL"] = "legacy"
            row["legacy_us"] = graph_us(
                lambda i, x=x, ws=ws, copies=copies: lambda: repacked_gemv(
                    x, ws[i % copies], out_dtype=torch.float16, autotune=False),
                nbytes,
            )
            os.environ.pop("MINIVLLM_GEMV_KERNEL")
            cands = QUICK if tname in args.quick.split(",") else CANDIDATES
            xq = q8.quantize_q8(x)
            kernels = {
                "float": lambda cfg, i, x=x, ws=ws, copies=copies, paired=paired: (lambda: tiled_gemv_swiglu(
                    x, ws[i % copies], cfg, mid_dtype=torch.float16, out_dtype=torch.float16)) if paired else (
                    lambda: tiled_gemv(x, ws[i % copies], cfg, out_dtype=torch.float16)),
                "int8": lambda cfg, i, x=x, ws=ws, copies=copies, xq=xq: lambda: q8.q8_gemv(
                    x, ws[i % copies], cfg, out_dtype=torch.float16, xq=xq),
            }
            bests = {}
            for kernel, make in kernels.items():
                best = None
                configs = [GemvConfig(block_nb=nb, block_g=g, split=split, num_warps=nw, num_stages=st)
                           for nb, g, nw, st in cands for split in _splits(n, k, nb, g, prof.sm_count)]
                # The committed table's entry too, so a new table only differs where its
                # winner beat what the engine runs today.
                current = lookup(prof.table_key, tname, n, k, prof.sm_count, int8=kernel == "int8")
                row[f"current_{kernel}"] = current.as_dict()
                if current not in configs and not (paired and current.t_outer):
                    configs.append(current)
                for cfg in configs:
                    try:
                        us = graph_us(lambda i, make=make, cfg=cfg: make(cfg, i), nbytes)
                    except Exception as exc:  # a config that does not compile here (registers, shared memory)
                        row["candidates"].append({"kernel": kernel, **cfg.as_dict(),
                                                  "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                        continue
                    row["candidates"].append({"kernel": kernel, **cfg.as_dict(), "us": us})
                    if best is None or us < best[1]:
                        best = (cfg, us)
                bests[kernel] = best
            if not paired:  # the float winners again with the T-outer tile (tiled_gemv.gemv_trip_t_outer)
                bests["float"] = time_t_outer(row, kernels["float"], bests["float"], graph_us, nbytes)
            best = bests["float"]
            row["best_int8"] = bests["int8"][0].as_dict()
            row["best_int8_us"] = bests["int8"][1]
            row["best_int8_frac_of_copy"] = frac(bests["int8"][1])
            row["quantize_q8_us"] = graph_us(lambda i, x=x: (lambda: q8.quantize_q8(x)), 1 << 28)
            dflt = default_config(n, k, prof.sm_count)
            row["default"] = dflt.as_dict()
            row["best"] = best[0].as_dict()
            row["best_us"] = best[1]
            row["best_frac_of_copy"] = frac(best[1])
            row["legacy_frac_of_copy"] = frac(row["legacy_us"])
            # Correctness of the winner against the legacy kernel (same arithmetic per weight,
            # another sum order): a wrong config must not win on speed.
            os.environ["MINIVLLM_GEMV_KERNEL"] = "legacy"
            y_legacy = repacked_gemv(x, ws[0], autotune=False)
            os.environ.pop("MINIVLLM_GEMV_KERNEL")
            if paired:  # the epilogue against the legacy GEMV's halves through the swiglu kernel
                row["epilogue"] = "swiglu"
                y = tiled_gemv_swiglu(x, ws[0], best[0], mid_dtype=torch.float32, out_dtype=torch.float32)
                y_legacy = swiglu(y_legacy[:, :n // 2], y_legacy[:, n // 2:], torch.float32)
            else:
                y = tiled_gemv(x, ws[0], best[0])
            row["best_max_rel_diff_vs_legacy"] = float((y - y_legacy).abs().max() / y_legacy.abs().max())
            # The int8 winner against the float reference of its quantized activations.
            xw, dxs = xq
            xd = (q8.unpack_q8(xw).float().view(1, -1, 32) * dxs[:, :, None]).view(1, k)
            y8 = q8.q8_gemv(x, ws[0], bests["int8"][0], xq=xq)
            ref8 = xd @ ws[0].dequantize(torch.float32).T
            row["best_int8_max_rel_diff_vs_f32"] = float((y8 - ref8).abs().max() / ref8.abs().max())
            if not paired:  # the split configs again, summing their slices in the same launch (split_sum.py)
                time_fixup(row, kernels["float"], nbytes, frac, graph_us)
                time_deferred(row, x, ws, copies, best[0], frac, graph_us)
            if tname == "Q4_K" and not paired:  # the tensor-core kernel (opt-in: MINIVLLM_GEMV_KERNEL=mma)
                time_mma(row, x, ws, copies, nbytes, frac, prof.sm_count, graph_us, y_legacy)
            dense = [
                ws[i].dequantize(torch.float16) for i in range(min(copies, max(2, -(-(160 << 20) // (n * k * 2)))))
            ]
            row["f16_cublas_us"] = graph_us(
                lambda i, x=x, dense=dense: lambda: torch.nn.functional.linear(x, dense[i % len(dense)]), n * k * 2
            )
            row["f16_cublas_frac_of_copy"] = n * k * 2 / (row["f16_cublas_us"] * 1e-6) / 1e9 / copy_gbs
            time_same_bytes(row, nbytes, copies, dev, frac, graph_us)
            del dense, ws
            torch.cuda.empty_cache()
            winners[shape_key(tname, n, k)] = row["best"]
            winners_int8[shape_key(tname, n, k)] = row["best_int8"]
            rows.append(row)
            write(out, rows, winners, winners_int8, name, prof, copy_gbs)
            print(
                f"{tname:5s} {n:6d}x{k:<6d} {nbytes / 1e6:7.1f} MB  best {best[1]:7.1f} us "
                f"{row['best_frac_of_copy']:5.0%} {best[0]}  legacy {row['legacy_us']:7.1f} us "
                f"{row['legacy_frac_of_copy']:5.0%}  int8 {row['best_int8_us']:7.1f} us "
                f"{row['best_int8_frac_of_copy']:5.0%}  "
                f"f16 cuBLAS {row['f16_cublas_us']:7.1f} us  [{time.time() - t0:.0f} s]",
                flush=True,
            )
    write(out, rows, winners, winners_int8, name, prof, copy_gbs)
    print((out / f"gemv-sweep-{prof.table_key}.md").read_text())
    return 0


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    """'all', set names of SHAPE_SETS and NxK entries, comma-separated, in order, once each."""
    out: list[tuple[int, int]] = []
    for part in spec.split(","):
        part = part.strip()
        if part == "all":
            found = SHAPES
        elif part in SHAPE_SETS:
            found = SHAPE_SETS[part]
        else:
            try:
                n, k = (int(v) for v in part.lower().split("x"))
            except ValueError:
                sets = ", ".join(SHAPE_SETS)
                raise SystemExit(f"--shapes: {part!r} is neither a set ({sets}, all) nor NxK") from None
            found = [(n, k)]
        out += [shape for shape in found if shape not in out]
    return out


def time_mma(row: dict, x, ws: list, copies: int, nbytes: int, frac, sm_count: int, graph_us, y_legacy) -> None:
    """The tensor-core Q4_K kernel (kernels/triton/mma_gemv.py) at its engine launch and a
    few others (row groups a program, K slices): the best into `row`, every one in
    row["candidates"], and the best one's distance from the legacy kernel's result."""
    from minivllm.kernels.triton.mma_gemv import mma_gemv, mma_launch

    n, k = row["n"], row["k"]
    nb0, split0 = mma_launch(n, k, sm_count)
    best = None
    for nb, split in sorted({(nb, min(split, k // 256)) for nb, split in ((nb0, split0), (8, split0), (4, 1),
                                                                          (4, 2 * split0))}):
        try:
            us = graph_us(lambda i, nb=nb, split=split: lambda: mma_gemv(
                x, ws[i % copies], block_nb=nb, split=split, out_dtype=torch.float16), nbytes)
        except Exception as exc:  # a launch that does not compile here
            row["candidates"].append({"kernel": "mma", "block_nb": nb, "split": split,
                                      "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        row["candidates"].append({"kernel": "mma", "block_nb": nb, "split": split, "us": us})
        if best is None or us < best[2]:
            best = (nb, split, us)
    if best is not None:
        y = mma_gemv(x, ws[0], block_nb=best[0], split=best[1])
        row.update(mma_us=best[2], mma_frac_of_copy=frac(best[2]), mma_launch={"block_nb": best[0], "split": best[1]},
                   mma_engine_launch={"block_nb": nb0, "split": split0},
                   mma_max_rel_diff_vs_legacy=float((y - y_legacy).abs().max() / y_legacy.abs().max()))


def time_t_outer(row: dict, make, best: tuple, graph_us, nbytes: int) -> tuple:
    """The three fastest float configs of this row with the T-outer tile; the best of all
    (a T-outer one only where it is faster) is returned, and enters the config table."""
    import dataclasses

    from minivllm.kernels.gemv_configs import GemvConfig

    fields = ("block_nb", "block_g", "split", "num_warps", "num_stages")
    top = sorted((c for c in row["candidates"] if c["kernel"] == "float" and c.get("us")), key=lambda c: c["us"])[:3]
    for c in top:
        cfg = dataclasses.replace(GemvConfig(**{k: c[k] for k in fields}), t_outer=True)
        try:
            us = graph_us(lambda i, cfg=cfg: make(cfg, i), nbytes)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile here
            row["candidates"].append({"kernel": "float", **cfg.as_dict(), "error": f"{type(exc).__name__}"})
            continue
        row["candidates"].append({"kernel": "float", **cfg.as_dict(), "us": us})
        row["t_outer_us"] = min(us, row.get("t_outer_us", us))
        if us < best[1]:
            best = (cfg, us)
    return best


def time_fixup(row: dict, make, nbytes: int, frac, graph_us) -> None:
    """The three fastest split float configs of this row, timed again with
    MINIVLLM_SPLIT_FIXUP=1 (the tile's last program sums the slices: no second launch)."""
    from minivllm.kernels.gemv_configs import GemvConfig
    from minivllm.kernels.triton.split_sum import FIXUP_ENV

    split = sorted((c for c in row["candidates"] if c["kernel"] == "float" and c.get("us") and c["split"] > 1),
                   key=lambda c: c["us"])[:3]
    os.environ[FIXUP_ENV] = "1"
    try:
        for c in split:
            cfg = GemvConfig(**{k: c[k] for k in ("block_nb", "block_g", "split", "num_warps", "num_stages",
                                                  "t_outer")})
            us = graph_us(lambda i, cfg=cfg: make(cfg, i), nbytes)
            if "fixup_us" not in row or us < row["fixup_us"]:
                row.update(fixup_us=us, fixup_frac_of_copy=frac(us), fixup_config=cfg.as_dict(),
                           fixup_without_us=c["us"])
    finally:
        os.environ.pop(FIXUP_ENV)


def time_deferred(row: dict, x, ws: list, copies: int, cfg, frac, graph_us) -> None:
    """A split winner's first launch alone, slices unsummed: an o- or down-projection in the
    engine, whose next add+RMSNorm sums them (`defer_split_sum`)."""
    from minivllm.kernels.triton.tiled_gemv import tiled_gemv
    if cfg.split > 1:
        us = graph_us(lambda i: lambda: tiled_gemv(x, ws[i % copies], cfg, out_dtype=torch.float16,
                                                   defer_split_sum=True), ws[0].nbytes)
        row.update(deferred_us=us, deferred_frac_of_copy=frac(us))


def time_same_bytes(row: dict, nbytes: int, copies: int, dev, frac, graph_us) -> None:
    """What moving this weight's bytes costs with no GEMV at all, timed the same way: a
    kernel that only reads them (bench/read_roofline.py: the ceiling a GEMV of this size
    cannot pass) and a copy of them (read + write)."""
    from minivllm.bench.read_roofline import BLOCK, partial_sums

    words = nbytes // 4 // BLOCK * BLOCK  # whole blocks (wide loads); under 32 KB short of the weight
    flat = [torch.randint(0, 1 << 30, (words,), dtype=torch.int32, device=dev) for _ in range(copies)]
    dst, sums = torch.empty_like(flat[0]), partial_sums(flat[0])
    row["read_only_us"] = graph_us(lambda i: lambda: partial_sums(flat[i % copies], sums), nbytes)
    # launched as the GEMV is (PDL, reads before the wait): the ceiling for a GEMV chained that way
    row["read_only_pdl_us"] = graph_us(lambda i: lambda: partial_sums(flat[i % copies], sums, pdl=True), nbytes)
    row["read_only_pdl_frac_of_copy"] = frac(row["read_only_pdl_us"])
    row["copy_same_bytes_us"] = graph_us(lambda i: lambda: dst.copy_(flat[i % copies]), nbytes)
    row["read_only_frac_of_copy"] = frac(row["read_only_us"])


def write(out: Path, rows: list, winners: dict, winners_int8: dict, name: str, prof, copy_gbs: float) -> None:
    """The JSON, the Markdown table and the config table so far (rewritten after every row,
    so a run stopped early keeps what it measured)."""
    from minivllm.kernels.gemv_configs import TABLE_PATH

    meta = {"device": name, "profile": prof.table_key, "sm_count": prof.sm_count, "copy_GBps": copy_gbs,
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "commit": os.environ.get("MINIVLLM_COMMIT", "unknown"),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "timing": "median µs per call over 7 replays of a CUDA graph of 24 back-to-back calls, "
                      "weight copies > 160 MB (from DRAM); M = 1, f16 activations and output"}
    (out / f"gemv-sweep-{prof.table_key}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = json.loads(TABLE_PATH.read_text()) if TABLE_PATH.is_file() else {}
    kept = table.get(prof.table_key, {})  # rows of shapes this run did not measure stay
    table[prof.table_key] = {"device": name, "source": f"scripts/gemv_sweep.py, {meta['date']}, copy "
                             f"{copy_gbs:.0f} GB/s", "configs": {**kept.get("configs", {}), **winners},
                             "configs_int8": {**kept.get("configs_int8", {}), **winners_int8}}
    (out / "gemv_configs.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    md = [
        f"# GEMV sweep on {name} ({prof.table_key}), M = 1",
        "",
        f"copy bandwidth {copy_gbs:.0f} GB/s (read + write); fraction = weight bytes / time / copy bandwidth",
        "",
        "| type | N x K | MB | tiled µs | of copy | config (nb, g, split, warps, stages) | legacy µs | of copy "
        "| int8 µs | of copy | int8 config | f16 cuBLAS µs | of copy | mma µs | of copy | mma (nb, split) "
        "| read-only kernel µs | of copy | the same under PDL µs | of copy | copy of the bytes µs "
        "| split summed in-launch µs | of copy | same config, two launches µs "
        "| its first launch alone (the sum folded into the next norm) µs | of copy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["best"]
        b8 = r["best_int8"]
        q8s = (f"{r['best_int8_us']:.1f} | {r['best_int8_frac_of_copy']:.0%} | {b8['block_nb']}, {b8['block_g']}, "
               f"{b8['split']}, {b8['num_warps']}, {b8['num_stages']}")
        md.append(
            f"| {r['type']} | {r['n']}x{r['k']}{' gate+up, SwiGLU epilogue' if r.get('epilogue') else ''} "
            f"| {r['mbytes']:.1f} | {r['best_us']:.1f} "
            f"| {r['best_frac_of_copy']:.0%} "
            f"| {b['block_nb']}, {b['block_g']}, {b['split']}, {b['num_warps']}, {b['num_stages']}"
            f"{', T-outer' if b.get('t_outer') else ''} "
            f"| {r['legacy_us']:.1f} | {r['legacy_frac_of_copy']:.0%} | {q8s} "
            f"| {r['f16_cublas_us']:.1f} | {r['f16_cublas_frac_of_copy']:.0%} | {mma_cells(r)} "
            f"| {same_bytes_cells(r)} | {fixup_cells(r)} | {deferred_cells(r)} |"
        )
    (out / f"gemv-sweep-{prof.table_key}.md").write_text("\n".join(md) + "\n")


def fixup_cells(r: dict) -> str:
    if "fixup_us" not in r:
        return "— | — | —"
    return f"{r['fixup_us']:.1f} | {r['fixup_frac_of_copy']:.0%} | {r['fixup_without_us']:.1f}"


def deferred_cells(r: dict) -> str:
    return f"{r['deferred_us']:.1f} | {r['deferred_frac_of_copy']:.0%}" if "deferred_us" in r else "— | —"


def same_bytes_cells(r: dict) -> str:
    if "read_only_us" not in r:
        return "— | — | — | — | —"
    return (f"{r['read_only_us']:.1f} | {r['read_only_frac_of_copy']:.0%} | {r['read_only_pdl_us']:.1f} | "
            f"{r['read_only_pdl_frac_of_copy']:.0%} | {r['copy_same_bytes_us']:.1f}")


def mma_cells(r: dict) -> str:
    if "mma_us" not in r:
        return "— | — | —"
    lc = r["mma_launch"]
    return f"{r['mma_us']:.1f} | {r['mma_frac_of_copy']:.0%} | {lc['block_nb']}, {lc['split']}"


if __name__ == "__main__":
    sys.exit(main())
