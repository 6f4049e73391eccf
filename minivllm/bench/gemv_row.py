"""Issue 41's GEMV row, measured as a decode step runs it: `minivllm bench kernels --row`.

Why a mode of its own: the GEMV sweep (scripts/gemv_sweep.py) searches launch shapes and
times a dozen kernels per matrix, minutes a type; `bench kernels` without `--row` times
the legacy kernel and cuBLAS with the L2 flushed. The row asks one thing per weight type:
at the 7B's matrices, what fraction of the copy bandwidth does the GEMV the engine launches
reach? So each (type, role) here is timed exactly as a decode step launches it:

* `qkv` (4608 x 3584, fused q+k+v): `repacked_gemv`, its split-K slices summed before the
  caller sees them;
* `o` (3584 x 3584) and `down` (3584 x 18944): the first launch alone, slices unsummed
  (`defer_split_sum`: the next add+RMSNorm sums them, `QuantLinear.partials`);
* `gate+up` (2 x 18944 x 3584): one launch with SwiGLU in its epilogue;

with the launch shape the committed table gives this GPU (`repacked_gemv.tiled_config`),
under PDL when the GPU has it, and with each asked-for count of weight trips loaded before
the PDL wait (`--early`, MINIVLLM_GEMV_EARLY_LOAD; the engine's default is the first). Beside
each: a kernel that only reads the same bytes (`read_roofline.partial_sums`), launched plainly
and under PDL, the ceiling for any reader of that many bytes timed this way. Timing:
`kernels.graph_us` (a CUDA graph of 24 back-to-back launches, each on its own copy of the
weight, the copies past 160 MB so they come from DRAM; median of 7 replays).
"""

from __future__ import annotations

import os
import statistics

import torch

ROLES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate+up": (37888, 3584), "down": (3584, 18944)}
ROW_TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q5_0"]  # the row's four; Q4_0 and Q4_1 on request


def launcher(role: str, x: torch.Tensor, w):
    """The call a decode step makes for this role's weight (see the module docstring)."""
    from minivllm.kernels.triton.repacked_gemv import repacked_gemv, tiled_config
    from minivllm.kernels.triton.tiled_gemv import tiled_gemv_swiglu

    config = tiled_config(x, w, invariant=False)
    if role == "qkv":
        return lambda: repacked_gemv(x, w, out_dtype=torch.float16)
    if role == "gate+up":
        if config is None:  # the int8 path (the T4 profile): the GEMV, then the swiglu kernel
            from minivllm.kernels.triton.fused import swiglu

            half = w.shape[0] // 2

            def two_launches():
                gu = repacked_gemv(x, w, out_dtype=torch.float16)
                return swiglu(gu[:, :half], gu[:, half:], torch.float16)

            return two_launches
        return lambda: tiled_gemv_swiglu(x, w, config, mid_dtype=torch.float16, out_dtype=torch.float16)
    return lambda: repacked_gemv(x, w, out_dtype=torch.float16, defer_split_sum=True)


def measure(types: list[str], early: list[int], device: torch.device) -> tuple[list[dict], float]:
    """One row per (type, role): the GEMV's µs and fraction of copy at each early count, and
    the read-only ceilings. Returns (rows, copy GB/s)."""
    from minivllm.bench.kernels import copy_bandwidth_gbs

    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for name in types:
        for role in ROLES:
            row = time_role(name, role, early, device, copy_gbs)
            rows.append(row)
            print(f"{name:5s} {role:8s} {row['n']:6d}x{row['k']:<6d} {row['mbytes']:6.1f} MB  "
                  + "  ".join(f"early={e} {row[f'early{e}_us']:6.1f} us {row[f'early{e}_frac_of_copy']:4.0%}"
                              for e in early)
                  + f"  read-only {row['read_only_us']:5.1f} / PDL {row['read_only_pdl_us']:5.1f} us", flush=True)
    return rows, copy_gbs


def time_role(name: str, role: str, early: list[int], device: torch.device, copy_gbs: float) -> dict:
    from gguf import GGMLQuantizationType

    from minivllm.bench.kernels import graph_us, random_weight
    from minivllm.bench.read_roofline import BLOCK, partial_sums
    from minivllm.kernels.repacked_layout import repack
    from minivllm.kernels.triton import pdl
    from minivllm.kernels.triton.repacked_gemv import tiled_config

    n, k = ROLES[role]
    copies = max(2, -(-(160 << 20) // int(n * k * 0.6)))  # past the L2 from the first
    ws = [repack(random_weight(GGMLQuantizationType[name], n, k, device=device, seed=i)) for i in range(copies)]
    nbytes = ws[0].nbytes
    x = torch.randn(1, k, device=device, dtype=torch.float16)
    cfg = tiled_config(x, ws[0], invariant=False)
    row = {"type": name, "role": role, "n": n, "k": k, "mbytes": nbytes / 1e6,
           "config": None if cfg is None else cfg.as_dict()}

    def frac(us: float) -> float:
        return nbytes / (us * 1e-6) / 1e9 / copy_gbs

    for e in early:
        os.environ[pdl.EARLY_ENV] = str(e)
        pdl.reset()
        us = graph_us(lambda i: launcher(role, x, ws[i % copies]), nbytes)
        row[f"early{e}_us"], row[f"early{e}_frac_of_copy"] = us, frac(us)
    ws.clear()  # the weights freed before the read-only copies are made
    words = nbytes // 4 // BLOCK * BLOCK  # whole blocks (wide loads); under 32 KB short of the weight
    flat = [torch.randint(0, 1 << 30, (words,), dtype=torch.int32, device=device) for _ in range(copies)]
    sums = partial_sums(flat[0])
    for tag, on in (("read_only", False), ("read_only_pdl", True)):
        us = graph_us(lambda i, on=on: lambda: partial_sums(flat[i % copies], sums, pdl=on), nbytes)
        row[f"{tag}_us"], row[f"{tag}_frac_of_copy"] = us, frac(us)
    flat.clear()
    torch.cuda.empty_cache()
    return row


def summary(rows: list[dict], early: list[int]) -> dict:
    """Per type and early count: the lowest fraction over the roles (the row's figure: every
    7B shape at 60% or more) and the median."""
    out = {}
    for name in dict.fromkeys(r["type"] for r in rows):
        mine = [r for r in rows if r["type"] == name]
        out[name] = {f"early{e}": {"min": min(r[f"early{e}_frac_of_copy"] for r in mine),
                                   "median": statistics.median(r[f"early{e}_frac_of_copy"] for r in mine),
                                   "lowest_role": min(mine, key=lambda r: r[f"early{e}_frac_of_copy"])["role"]}
                     for e in early}
    return out


def run(types: list[str] | None, early: list[int], device: str) -> list[dict]:
    from minivllm.bench.common import provenance
    from minivllm.bench.results import write_results
    from minivllm.kernels.triton import pdl

    dev = torch.device(device)
    torch.cuda.set_device(dev)
    types = types or ROW_TYPES
    before = os.environ.get(pdl.EARLY_ENV)
    try:
        rows, copy_gbs = measure(types, early, dev)
    finally:  # the process's own setting back
        os.environ.pop(pdl.EARLY_ENV, None) if before is None else os.environ.__setitem__(pdl.EARLY_ENV, before)
        pdl.reset()
    summ = summary(rows, early)
    meta = provenance(str(dev), None, {"types": types, "roles": ROLES, "early": early, "copy_bandwidth_GBps": copy_gbs,
                                       "pdl": bool(pdl.pdl_args(dev)), "summary_frac_of_copy": summ,
                                       "timing": "kernels.graph_us: median of 7 replays of a CUDA graph of 24 "
                                                 "launches, weight copies past 160 MB (from DRAM); M = 1, f16"})
    cols = ["type", "role", "n", "k", "mbytes", *[f"early{e}_{c}" for e in early for c in ("us", "frac_of_copy")],
            "read_only_us", "read_only_frac_of_copy", "read_only_pdl_us", "read_only_pdl_frac_of_copy", "config"]
    lows = "; ".join(f"{t} {v[f'early{early[0]}']['min']:.0%} ({v[f'early{early[0]}']['lowest_role']})"
                     for t, v in summ.items())
    notes = (f"Issue 41's GEMV row: each 7B role's GEMV as a decode step launches it (bench/gemv_row.py), weight "
             f"bytes / time against the copy bandwidth ({copy_gbs:.0f} GB/s, read + write). Lowest role per type "
             f"at early={early[0]}: {lows}. The read-only columns: a kernel that only reads the same bytes.")
    _, md = write_results("kernels-gemv-row", meta, rows, cols, notes)
    print(md.read_text())
    return rows
