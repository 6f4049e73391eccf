"""GEMV kernel speed on the GPU: GB/s of weight read against the device's copy bandwidth.

A decode step's matmuls are memory-bound: at M = 1 every weight byte is used for two
flops, so the only question is how close a kernel comes to streaming the weight at the
memory's speed. Per weight type and Qwen2.5-7B matrix shape this reports

* the fused dequantize-GEMV's median kernel time at M = 1 (autotuned configuration),
  its weight bytes / time, and that as a fraction of the measured copy bandwidth;
* the batch-invariant configuration at M = 1 and both at M = 8 (the invariant mode's
  cost: one row per program, so M rows decode the weight M times);
* the F16 cuBLAS GEMV (`F.linear`) on the same shape, the dense baseline;
* for the types with a repacked layout (kernels/repacked_layout.py and kernels/triton/repacked_gemv.py: Q4_0, Q4_1,
  Q5_0, Q8_0, Q4_K, Q6_K), the repacked GEMV at M = 1 (autotuned and invariant) and at
  M = batch_rows, its GB/s counted over the bytes it reads (the repacked planes; the
  file's bytes within 3%), as a fraction of the copy bandwidth: the path decode takes.

Copy bandwidth: a large device-to-device `copy_`, bytes read + written / time.
Times are medians of `triton.testing.do_bench`: CUDA events around each call, after a
warm-up, with the L2 flushed (a 256 MB memset) before every call, so the weight comes
from DRAM as it does in a real decode step, where the other layers' weights evict it.
"""

from __future__ import annotations

import statistics

import torch

from minivllm.bench.common import provenance
from minivllm.bench.results import write_results
from minivllm.errors import DeviceError

# Qwen2.5-7B's linear shapes (N = out_features, K = in_features): attn_q/attn_output,
# attn_k/attn_v, ffn_gate/ffn_up, ffn_down.
SHAPES_7B = [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)]
DEFAULT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F32", "F16", "BF16"]


# Byte offsets of the f16 scale fields (d, and m/dmin where there is one) in each block.
_F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def random_weight(ggml_type, n: int, k: int, *, device: torch.device, seed: int):
    """An (n, k) QuantizedWeight of random valid blocks, made on `device`: random quant
    bits, small finite f16 scales (speed does not depend on the values, NaNs would hide bugs)."""
    from minivllm.gguf.quant_types import SUPPORTED_TYPES
    from minivllm.kernels.quant_weight import QuantizedWeight

    gen = torch.Generator(device=device).manual_seed(seed)
    name = ggml_type.name
    if name in _FLOAT_DTYPES:
        raw = torch.randn(n, k, generator=gen, device=device).to(_FLOAT_DTYPES[name]).view(torch.uint8)
    else:
        qt = SUPPORTED_TYPES[ggml_type]
        n_blocks = n * k // qt.block_size
        raw = torch.randint(0, 256, (n_blocks, qt.type_size), dtype=torch.uint8, generator=gen, device=device)
        for off in _F16_FIELDS[name]:
            scale = (torch.rand(n_blocks, 1, generator=gen, device=device) * 0.02 + 1e-3).half()
            raw[:, off:off + 2] = scale.view(torch.uint8)
    return QuantizedWeight(raw.reshape(n, -1), ggml_type, (n, k), name=f"bench.{name}")


def _median_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_us(make_call, nbytes: int, calls: int = 24) -> float:
    """Median µs per call of `calls` back-to-back launches replayed from one CUDA graph, the
    way a captured decode step runs them (no host launch cost between kernels). Each call
    reads its own copy of the operands (`make_call(i)` returns the i-th call), with enough
    copies that they outgrow the L2, so the weights come from DRAM."""
    copies = max(2, -(-(160 << 20) // max(nbytes, 1)))
    fns = [make_call(i) for i in range(copies)]
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % copies]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _compile_one_type(name: str, ks: list[int], batch_rows: int, device: str) -> str:
    """Compile every kernel variant the timing loop will launch for `name` (into Triton's
    on-disk cache): the autotune candidates, the invariant and the multi-row config."""
    from gguf import GGMLQuantizationType

    from minivllm.kernels.triton.dequant_gemv import triton_gemv

    dev = torch.device(device)
    t = GGMLQuantizationType[name]
    for k in ks:
        w = random_weight(t, 64, k, device=dev, seed=0)
        for m in (1, batch_rows):
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            triton_gemv(x, w)
            triton_gemv(x, w, invariant=True)
    torch.cuda.synchronize(dev)
    return name


def _precompile(types: list[str], ks: list[int], batch_rows: int, device: str) -> None:
    """Triton compiles one kernel at a time; ~60 variants would take minutes. Compiling
    them in parallel processes first leaves the timing loop only cache hits."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(len(types), (os.cpu_count() or 2) // 2))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for name in pool.map(_compile_one_type, types, *zip(*[(ks, batch_rows, device)] * len(types))):
            print(f"compiled {name}", flush=True)


def run(types: list[str] | None = None, shapes: list[tuple[int, int]] | None = None, device: str = "cuda",
        batch_rows: int = 8, write: bool = True) -> list[dict]:
    if not torch.cuda.is_available():
        raise DeviceError("`minivllm bench kernels` times the Triton GEMV kernels and needs a CUDA device; "
                          f"torch sees none here (torch {torch.__version__}). Run it on a machine with an NVIDIA GPU.")
    from gguf import GGMLQuantizationType

    from minivllm.kernels.triton.dequant_gemv import SUPPORTED_GEMV_TYPES, triton_gemv
    from minivllm.kernels.triton.repacked_gemv import REPACKED_TYPES, repack, repacked_gemv

    dev = torch.device(device)
    torch.cuda.set_device(dev)
    types = types or DEFAULT_TYPES
    shapes = shapes or SHAPES_7B
    _precompile(types, sorted({k for _, k in shapes}), batch_rows, str(dev))
    copy_gbs = copy_bandwidth_gbs(dev)
    print(f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s", flush=True)

    rows = []
    for n, k in shapes:
        x1 = torch.randn(1, k, device=dev, dtype=torch.float16)
        xb = torch.randn(batch_rows, k, device=dev, dtype=torch.float16)
        dense = torch.randn(n, k, device=dev, dtype=torch.float16)
        cublas_ms = _median_ms(lambda x1=x1, dense=dense: torch.nn.functional.linear(x1, dense))
        cublas_gbs = n * k * 2 / (cublas_ms * 1e-3) / 1e9
        denses = [dense] + [torch.randn(n, k, device=dev, dtype=torch.float16)
                            for _ in range(max(2, -(-(160 << 20) // (n * k * 2))) - 1)]
        cublas_graph_us = graph_us(
            lambda i, x1=x1, denses=denses: (lambda: torch.nn.functional.linear(x1, denses[i])), n * k * 2
        )
        print(f"CUBLAS f16 {n:6d}x{k:<6d} graph M=1 {cublas_graph_us:6.1f} us", flush=True)
        del dense, denses
        for name in types:
            t = GGMLQuantizationType[name]
            if t not in SUPPORTED_GEMV_TYPES:
                raise DeviceError(f"bench kernels: {name} has no Triton GEMV kernel; "
                                  f"supported: {', '.join(sorted(s.name for s in SUPPORTED_GEMV_TYPES))}")
            w = random_weight(t, n, k, device=dev, seed=0)
            triton_gemv(x1, w)  # autotune (M = 1) and compile outside the timed region
            triton_gemv(x1, w, invariant=True)
            triton_gemv(xb, w)
            triton_gemv(xb, w, invariant=True)
            ms = {
                "m1": _median_ms(lambda x1=x1, w=w: triton_gemv(x1, w)),
                "m1_inv": _median_ms(lambda x1=x1, w=w: triton_gemv(x1, w, invariant=True)),
                f"m{batch_rows}": _median_ms(lambda xb=xb, w=w: triton_gemv(xb, w)),
                f"m{batch_rows}_inv": _median_ms(lambda xb=xb, w=w: triton_gemv(xb, w, invariant=True)),
            }
            gbs = w.nbytes / (ms["m1"] * 1e-3) / 1e9
            row = {
                "type": name, "N": n, "K": k, "weight_MB": w.nbytes / 1e6,
                "m1_us": ms["m1"] * 1e3, "m1_GBps": gbs, "m1_frac_of_copy": gbs / copy_gbs,
                "m1_invariant_us": ms["m1_inv"] * 1e3,
                f"m{batch_rows}_us": ms[f"m{batch_rows}"] * 1e3,
                f"m{batch_rows}_invariant_us": ms[f"m{batch_rows}_inv"] * 1e3,
                "f16_cublas_us": cublas_ms * 1e3, "f16_cublas_GBps": cublas_gbs,
                "f16_cublas_frac_of_copy": cublas_gbs / copy_gbs,
                "f16_cublas_graph_us": cublas_graph_us,
                "f16_cublas_graph_frac_of_copy": n * k * 2 / (cublas_graph_us * 1e-6) / 1e9 / copy_gbs,
            }
            rows.append(row)
            if t in REPACKED_TYPES:
                rw = repack(w)
                for xx in (x1, xb):
                    repacked_gemv(xx, rw, out_dtype=torch.float16)  # autotune and compile outside the timing
                    repacked_gemv(xx, rw, invariant=True, out_dtype=torch.float16)
                rms = {
                    "m1": _median_ms(lambda x1=x1, rw=rw: repacked_gemv(x1, rw, out_dtype=torch.float16)),
                    "m1_inv": _median_ms(
                        lambda x1=x1, rw=rw: repacked_gemv(x1, rw, invariant=True, out_dtype=torch.float16)
                    ),
                    "mb": _median_ms(lambda xb=xb, rw=rw: repacked_gemv(xb, rw, out_dtype=torch.float16)),
                }
                rgbs = rw.nbytes / (rms["m1"] * 1e-3) / 1e9
                copies = max(2, -(-(160 << 20) // rw.nbytes))
                rws = [rw] + [repack(random_weight(t, n, k, device=dev, seed=1 + i)) for i in range(copies - 1)]
                g_us = graph_us(
                    lambda i, x1=x1, rws=rws: (lambda: repacked_gemv(x1, rws[i], out_dtype=torch.float16)), rw.nbytes
                )
                g_inv_us = graph_us(
                    lambda i, x1=x1, rws=rws: (
                        lambda: repacked_gemv(x1, rws[i], invariant=True, out_dtype=torch.float16)
                    ),
                    rw.nbytes,
                )
                del rws
                row.update({"repacked_m1_graph_us": g_us,
                            "repacked_m1_graph_frac_of_copy": rw.nbytes / (g_us * 1e-6) / 1e9 / copy_gbs,
                            "repacked_m1_invariant_graph_us": g_inv_us,
                            "repacked_m1_invariant_graph_frac_of_copy": rw.nbytes / (g_inv_us * 1e-6) / 1e9 / copy_gbs})
                row.update({"repacked_MB": rw.nbytes / 1e6, "repacked_m1_us": rms["m1"] * 1e3,
                            "repacked_m1_GBps": rgbs, "repacked_m1_frac_of_copy": rgbs / copy_gbs,
                            "repacked_m1_invariant_us": rms["m1_inv"] * 1e3,
                            "repacked_m1_invariant_frac_of_copy": rw.nbytes / (rms["m1_inv"] * 1e-3) / 1e9 / copy_gbs,
                            f"repacked_m{batch_rows}_us": rms["mb"] * 1e3})
                print(f"REPACKED {name:5s} {n:6d}x{k:<6d} graph M=1 {g_us:6.1f} us "
                      f"({row['repacked_m1_graph_frac_of_copy']:.0%} of copy), invariant {g_inv_us:6.1f} us "
                      f"({row['repacked_m1_invariant_graph_frac_of_copy']:.0%})", flush=True)
                print(
                    f"      repacked {row['repacked_MB']:7.1f} MB  M=1 {row['repacked_m1_us']:7.1f} us "
                    f"{rgbs:6.0f} GB/s "
                    f"({row['repacked_m1_frac_of_copy']:.0%})  inv {row['repacked_m1_invariant_us']:7.1f} us "
                    f"({row['repacked_m1_invariant_frac_of_copy']:.0%})  M={batch_rows} "
                    f"{row[f'repacked_m{batch_rows}_us']:7.1f} us",
                    flush=True,
                )
                del rw
            print(f"{name:5s} {n:6d}x{k:<6d} {row['weight_MB']:7.1f} MB  M=1 {row['m1_us']:7.1f} us "
                  f"{gbs:6.0f} GB/s ({row['m1_frac_of_copy']:.0%})  inv {row['m1_invariant_us']:7.1f} us  "
                  f"M={batch_rows} {row[f'm{batch_rows}_us']:7.1f} / inv {row[f'm{batch_rows}_invariant_us']:7.1f} us  "
                  f"f16 cuBLAS {cublas_gbs:6.0f} GB/s", flush=True)
            del w

    if write:
        summary = {name: statistics.median(r["m1_frac_of_copy"] for r in rows if r["type"] == name)
                   for name in dict.fromkeys(r["type"] for r in rows)}
        summary_repacked = {
            name: statistics.median(r["repacked_m1_graph_frac_of_copy"] for r in rows if r["type"] == name)
            for name in dict.fromkeys(r["type"] for r in rows if "repacked_m1_us" in r)
        }
        big = {name: statistics.median(r["repacked_m1_graph_frac_of_copy"] for r in rows
                                       if r["type"] == name and r["N"] * r["K"] >= 3584 * 18944)
               for name in summary_repacked}
        meta = provenance(str(dev), None, {"types": types, "shapes": shapes, "batch_rows": batch_rows,
                                           "copy_bandwidth_GBps": copy_gbs, "activation_dtype": "f16",
                                           "median_frac_of_copy_by_type": summary,
                                           "repacked_median_frac_of_copy_by_type (graph timing)": summary_repacked,
                                           "repacked_ffn_shapes_frac_of_copy_by_type": big,
                                           "timing": "triton.testing.do_bench median (CUDA events, L2 flushed "
                                                     "before every call)"})
        cols = ["type", "N", "K", "weight_MB", "m1_us", "m1_GBps", "m1_frac_of_copy", "m1_invariant_us",
                f"m{batch_rows}_us", f"m{batch_rows}_invariant_us", "f16_cublas_us", "f16_cublas_GBps",
                "f16_cublas_frac_of_copy", "repacked_m1_us", "repacked_m1_GBps", "repacked_m1_frac_of_copy",
                "repacked_m1_invariant_us", "repacked_m1_invariant_frac_of_copy", f"repacked_m{batch_rows}_us",
                "repacked_m1_graph_us", "repacked_m1_graph_frac_of_copy", "repacked_m1_invariant_graph_us",
                "repacked_m1_invariant_graph_frac_of_copy", "f16_cublas_graph_us", "f16_cublas_graph_frac_of_copy"]
        notes = (f"Fused dequantize-GEMV (Triton) on Qwen2.5-7B shapes; weight bytes / median kernel time vs the "
                 f"device's copy bandwidth ({copy_gbs:.0f} GB/s, read + write). M=1 uses the autotuned config; "
                 f"'invariant' is the batch-invariant config (one row per program). Activations f16.")
        _, md = write_results("kernels-gemv", meta, rows, cols, notes)
        print(md.read_text())
    return rows
