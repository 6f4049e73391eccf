"""Micro-benchmark: CpuPackedWeight.matmul against the float32 GEMM it replaces.

Three parts, all on SmolLM2-135M's real weights (Q4_1 projections, Q8_0 tied LM head):

1. Per shape and row count M: microseconds per call, packed vs `x @ W_f32.T`. Each
   weight is cloned until the rotation set is several times the L3 cache, so every
   call streams its weight from DRAM as it does in a real decode step (where the whole
   model passes between two uses of one matrix). The best of several passes is kept.
   The crossover column is the smallest M at which float32 is at least as fast.
2. A whole decode step's matmuls: the 30 layers x 7 projections + LM head of the real
   model, in order, at M=1 and a few M, both representations (every call included,
   so per-call overhead is in the number).
3. Accuracy on real tensors: packed vs the float64 product of the float32 dequant.

Run on a quiet machine: `python scripts/cpu_packed_microbench.py --threads 2`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from minivllm.gguf.reader import GGUFFile
from minivllm.kernels.cpu_packed import CpuPackedWeight
from minivllm.kernels.quant_weight import QuantizedWeight

DEFAULT_MODEL = "/tmp/models/smollm2.gguf"
# (label, tensor name, uses per decode step)
SHAPES = [
    ("attn_q/o 576x576", "blk.0.attn_q.weight", 60),
    ("attn_k/v 192x576", "blk.0.attn_k.weight", 60),
    ("ffn_gate/up 1536x576", "blk.0.ffn_gate.weight", 60),
    ("ffn_down 576x1536", "blk.0.ffn_down.weight", 30),
    ("lm_head 49152x576", "token_embd.weight", 1),
]
PROJECTIONS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def load(f: GGUFFile, name: str) -> QuantizedWeight:
    info = f.tensor_info(name)
    return QuantizedWeight(f.tensor_bytes(name).clone(), info.ggml_type, tuple(info.shape), name)


def clone_packed(p: CpuPackedWeight) -> CpuPackedWeight:
    """A copy with its own memory (so the copies do not share cache lines)."""
    q = object.__new__(type(p))
    q.__dict__.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in p.__dict__.items()})
    return q


def time_calls(fns, x: torch.Tensor, passes: int) -> float:
    """Best over `passes` of the mean µs per call, cycling once through `fns` per pass."""
    for fn in fns[: min(3, len(fns))]:
        fn(x)
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for fn in fns:
            fn(x)
        best = min(best, (time.perf_counter() - t0) / len(fns))
    return best * 1e6


def copies_for(nbytes: int, min_bytes: int) -> int:
    return max(2, -(-min_bytes // nbytes))


def per_shape(f: GGUFFile, rows: list[int], min_bytes: int, passes: int) -> list[dict]:
    results = []
    for label, name, uses in SHAPES:
        w = load(f, name)
        packed = CpuPackedWeight.from_quantized(w)
        dense = w.dequantize(torch.float32)
        packs = [packed] + [clone_packed(packed) for _ in range(copies_for(packed.nbytes, min_bytes) - 1)]
        denses = [dense] + [dense.clone() for _ in range(copies_for(dense.numel() * 4, min_bytes) - 1)]
        row = {"shape": label, "type": w.type_name, "kind": packed.kind, "uses_per_step": uses,
               "packed_copies": len(packs), "f32_copies": len(denses), "us": {}}
        for m in rows:
            x = torch.randn(m, w.shape[1])
            t_packed = time_calls([p.matmul for p in packs], x, passes)
            t_f32 = time_calls([(lambda x, d=d: x @ d.T) for d in denses], x, passes)
            row["us"][m] = {"packed": round(t_packed, 1), "f32": round(t_f32, 1)}
            print(f"  {label:22s} {packed.kind:13s} M={m:3d}  packed {t_packed:9.1f} µs   f32 {t_f32:9.1f} µs"
                  f"   ({t_f32 / t_packed:4.2f}x)", flush=True)
        faster = [m for m in rows if row["us"][m]["f32"] <= row["us"][m]["packed"]]
        row["f32_wins_from_M"] = faster[0] if faster else None
        results.append(row)
        del packs, denses
    return results


def decode_step(f: GGUFFile, n_layers: int, rows: list[int], passes: int) -> dict:
    """All matmuls of one decode step, real weights in model order, both paths."""
    names = [f"blk.{i}.{p}.weight" for i in range(n_layers) for p in PROJECTIONS] + ["token_embd.weight"]
    weights = [load(f, n) for n in names]
    packed = [CpuPackedWeight.from_quantized(w) for w in weights]
    dense = [w.dequantize(torch.float32) for w in weights]
    out = {}
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}

        def run_packed(xs=xs):
            for p in packed:
                p.matmul(xs[p.shape[1]])

        def run_f32(xs=xs):
            for d in dense:
                xs[d.shape[1]] @ d.T

        def best(fn):
            fn()
            t = float("inf")
            for _ in range(passes):
                t0 = time.perf_counter()
                fn()
                t = min(t, time.perf_counter() - t0)
            return t * 1e3

        out[m] = {"packed_ms": round(best(run_packed), 2), "f32_ms": round(best(run_f32), 2)}
        print(f"  decode-step matmuls M={m:3d}: packed {out[m]['packed_ms']:7.2f} ms   "
              f"f32 {out[m]['f32_ms']:7.2f} ms   ({len(names)} matmuls)", flush=True)
    head = packed[-1]
    x1 = torch.randn(1, head.shape[1])
    out["lm_head_packed_ms_M1"] = round(time_calls([head.matmul], x1, passes * 3) / 1e3, 2)
    out["packed_bytes"] = sum(p.nbytes for p in packed)
    out["f32_bytes"] = sum(d.numel() * 4 for d in dense)
    return out


def call_overhead(passes: int) -> dict:
    """Per-call fixed cost: the same calls on a tiny (16 x 32) weight that sits in L1."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (16, 20), dtype=np.uint8)
    blocks[:, 0:4] = np.full(32, 0.01, np.float16).view(np.uint8).reshape(16, 4)
    q4 = CpuPackedWeight.from_quantized(QuantizedWeight(torch.from_numpy(blocks), T.Q4_1, (16, 32), "tiny"))
    h = CpuPackedWeight.from_quantized(
        QuantizedWeight(torch.randn(16, 32).half().view(torch.uint8), T.F16, (16, 32), "tiny")
    )
    d = torch.randn(16, 32)
    x = torch.randn(1, 32)
    fns = {"int4pack": q4.matmul, "f16": h.matmul, "f32": lambda x: x @ d.T}
    return {k: round(time_calls([fn] * 200, x, passes), 2) for k, fn in fns.items()}


def accuracy(f: GGUFFile) -> list[dict]:
    out = []
    for name in ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"]:
        w = load(f, name)
        p = CpuPackedWeight.from_quantized(w)
        x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(0))
        ref = x.double() @ w.dequantize(torch.float32).double().T
        err = p.matmul(x).double() - ref
        out.append({"tensor": name, "type": w.type_name, "kind": p.kind,
                    "max_abs_err/max_abs_ref": float(err.abs().max() / ref.abs().max()),
                    "rms_err/rms_ref": float(err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())})
        print(f"  {name:24s} {w.type_name:5s} {p.kind:13s} max|err|/max|ref| {out[-1]['max_abs_err/max_abs_ref']:.2e}"
              f"   rms err/rms ref {out[-1]['rms_err/rms_ref']:.2e}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--step-rows", default="1,4,8")
    ap.add_argument("--min-mb", type=int, default=128, help="rotation set per measurement (>> L3)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    f = GGUFFile(args.model)
    n_layers = int(f.require(f"{f.architecture}.block_count"))
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    print("accuracy vs float64(x @ dequant_f32.T), x ~ N(0, 1), M=8:")
    acc = accuracy(f)
    print("per-call overhead, tiny weight, M=1 (µs):")
    ovh = call_overhead(args.passes)
    print("  ", ovh)
    print(f"per shape (weights cycled through >= {args.min_mb} MB so they stream from DRAM):")
    shapes = per_shape(f, rows, args.min_mb << 20, args.passes)
    print("decode step, all matmuls of the real model:")
    step = decode_step(f, n_layers, [int(r) for r in args.step_rows.split(",")], args.passes)
    print(json.dumps({k: v for k, v in step.items() if not isinstance(k, int)}))
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "threads": args.threads, "accuracy": acc,
                                         "call_overhead_us": ovh, "shapes": shapes, "decode_step": step}, indent=1))


if __name__ == "__main__":
    main()
