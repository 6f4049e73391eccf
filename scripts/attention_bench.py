"""Decode attention and the per-layer K/V write, timed as the engine runs them: inside a
CUDA graph, one call per layer over that layer's own cache, L2 flushed between replays.

    python scripts/attention_bench.py OUT_JSON [--sweep] [--baseline-module PATH]
    TRITON_INTERPRET=1 python scripts/attention_bench.py OUT_JSON --smoke   # no GPU: tiny shapes

Rows: Qwen2.5-7B and -0.5B attention shapes (f16 cache, float32 queries as rope_qk makes
them), context 512 and 4096, batch 1, 8 and 32, block tables as wide as a CUDA graph's
(max_model_len 8448 / page 16 = 528 pages). Each row reports µs per call (median over
replays of a graph holding one call per layer, divided by the layers), the effective GB/s
of KV read, and each kernel's largest error against float64 softmax attention.

The old kernel (the paged_attention.py of commit b738059) is timed in the same run: from
--baseline-module PATH, else .gpu/paged_attention_b738059.py when staged there (write it
with `git show b738059:minivllm/kernels/triton/paged_attention.py > PATH` where git is
at hand), else from `git show` in a git checkout; without any of them the baseline rows
are skipped and the JSON says why.

K/V write rows: torch's two index_copy_ per layer (the old path), the one-launch
`store_kv`, rope_qk alone, and rope_qk storing K and V itself (the new path), with a
check that both leave the cache bit for bit the same.

--sweep adds the new kernel at other split lengths / warps / programs per SM (a
split length changes the bits, so only the default is the engine's; the others inform
the next choice of SPLIT_TOKENS).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BASELINE_COMMIT = "b738059"
# Where a copy without git (an offline GPU machine) finds the old kernel when it was
# staged: `git show b738059:minivllm/kernels/triton/paged_attention.py > .gpu/...` (.gpu/
# is git-ignored; carry it to the machine).
STAGED_BASELINE = REPO / ".gpu" / "paged_attention_b738059.py"
SHAPES = {"7B": dict(heads=28, kv_heads=4, head_dim=128, layers=28),
          "0.5B": dict(heads=14, kv_heads=2, head_dim=64, layers=24)}
PAGE_SIZE = 16
MAX_MODEL_LEN = 8448


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_json")
    p.add_argument("--baseline-module", help="a copy of the old paged_attention.py (default: git show "
                                             f"{BASELINE_COMMIT}:minivllm/kernels/triton/paged_attention.py)")
    p.add_argument("--sweep", action="store_true", help="also time other split lengths, warps, programs per SM")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--shapes", help="comma-separated model shapes to time (default: all: 7B,0.5B)")
    p.add_argument("--contexts", help="comma-separated context lengths (default 512,4096)")
    p.add_argument("--batches", help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--sweep-only", action="store_true", help="with --sweep: skip the new-vs-old table and K/V writes")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1 (no GPU)")
    return p.parse_args(argv)


def load_baseline(path: str | None):
    """(module or None, where it came from or why it is missing)."""
    if path is None and STAGED_BASELINE.is_file():
        path = str(STAGED_BASELINE)
    if path is None:
        try:
            src = subprocess.run(["git", "-C", str(REPO), "show",
                                  f"{BASELINE_COMMIT}:minivllm/kernels/triton/paged_attention.py"],
                                 capture_output=True, text=True, check=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"no baseline: git show {BASELINE_COMMIT} failed ({exc}); pass --baseline-module PATH"
        # Kept until exit: Triton reads a kernel's source from its file when compiling.
        fd, path = tempfile.mkstemp(prefix="paged_attention_b738059_", suffix=".py")
        with os.fdopen(fd, "w") as fh:
            fh.write(src)
        origin = f"git show {BASELINE_COMMIT}"
    else:
        origin = path
    spec = importlib.util.spec_from_file_location("attention_bench_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, origin


def make_case(torch, shape: dict, ctx: int, batch: int, layers: int, width: int, device, seed: int = 0):
    """One layer stack of K/V pages (each sequence on its own consecutive pages, page 0 the
    graph's scratch page), graph-wide block tables, decode rows at position ctx - 1."""
    kvh, d, h = shape["kv_heads"], shape["head_dim"], shape["heads"]
    per_seq = -(-ctx // PAGE_SIZE)
    n_pages = 1 + batch * per_seq
    gen = torch.Generator(device=device).manual_seed(seed)
    dims = (layers, n_pages, PAGE_SIZE, kvh, d)
    k = torch.randn(dims, generator=gen, device=device, dtype=torch.float16)
    v = torch.randn(dims, generator=gen, device=device, dtype=torch.float16)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    for b in range(batch):
        tables[b, :per_seq] = torch.arange(1 + b * per_seq, 1 + (b + 1) * per_seq, dtype=torch.int32)
    q = torch.randn(batch, h, d, generator=gen, device=device, dtype=torch.float32)
    # f16 queries too: the tensor-core body (SplitLaunch(mma=True)) takes f16 only, as the
    # engine's f16 activations give it.
    return dict(k=k, v=v, tables=tables.to(device), q=q, out=torch.empty_like(q), q16=q.half(),
                out16=torch.empty(q.shape, dtype=torch.float16, device=device),
                row_seq=torch.arange(batch, dtype=torch.int32, device=device),
                row_pos=torch.full((batch,), ctx - 1, dtype=torch.int32, device=device),
                kv_bytes=batch * ctx * kvh * d * 2 * k.element_size())


def reference_rows(torch, case: dict, layer: int, rows: list[int], q_key: str = "q"):
    """float64 softmax attention over each row's dense keys (its pages gathered in order),
    for the queries case[q_key] (the f32 ones, or their f16 rounding)."""
    out = {}
    for r in rows:
        n = int(case["row_pos"][r]) + 1
        pages = case["tables"][r, :-(-n // PAGE_SIZE)].long()
        ks = case["k"][layer][pages].reshape(-1, *case["k"].shape[-2:])[:n].double()
        vs = case["v"][layer][pages].reshape(-1, *case["v"].shape[-2:])[:n].double()
        q = case[q_key][r].double()
        g = q.shape[0] // ks.shape[1]
        ks, vs = ks.repeat_interleave(g, dim=1), vs.repeat_interleave(g, dim=1)
        scores = torch.einsum("hd,shd->hs", q, ks) / q.shape[-1] ** 0.5
        out[r] = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), vs)
    return out


class Timer:
    """Per-call µs of `fn(layer)` for every layer in one CUDA graph (the engine's way),
    L2 flushed before each replay; on CPU (smoke) one eager pass, wall clock."""

    def __init__(self, torch, device, replays: int):
        self.torch, self.device, self.replays = torch, device, replays
        self.flush = torch.empty(64 << 20, dtype=torch.float32, device=device) if device.type == "cuda" else None
        self.last_kernels: dict | str | None = None

    def per_call_us(self, fn, layers: int) -> float:
        torch = self.torch
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for layer in range(layers):
                fn(layer)
            return (time.perf_counter() - t0) * 1e6 / layers
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            for layer in range(layers):
                fn(layer)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for layer in range(layers):
                fn(layer)
        events = []
        for i in range(self.replays + 3):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            if i >= 3:
                events.append((start, end))
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in events)
        self.last_kernels = self._kernels_per_layer(graph, layers)
        del graph
        return times[len(times) // 2] * 1e3 / layers

    def _kernels_per_layer(self, graph, layers: int, replays: int = 3) -> dict | str:
        """µs per layer of each kernel the graph runs (split vs merge, say), from a
        torch.profiler trace of a few replays; an error string if the profiler fails."""
        torch = self.torch
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(replays):
                    self.flush.zero_()  # as in the timed replays (its fill kernel is left out below)
                    graph.replay()
                torch.cuda.synchronize()
            fd, path = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            prof.export_chrome_trace(path)
            events = json.loads(Path(path).read_text())["traceEvents"]
            os.unlink(path)
        except Exception as exc:  # the timing stands without the breakdown
            return f"profiler failed: {type(exc).__name__}: {exc}"[:200]
        per: dict[str, float] = {}
        for e in events:
            if e.get("ph") == "X" and e.get("cat") == "kernel" and "FillFunctor" not in e["name"]:
                name = e["name"].split("(")[0][:60]
                per[name] = per.get(name, 0.0) + float(e["dur"]) / (replays * layers)
        return {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def sweep_launches(pa) -> list[tuple[str, object]]:
    """The new kernel's other launches (--sweep): query heads per program (one, all of a
    KV head's, or chosen per row: `adaptive`) × split length × warps. (The sweep of split ×
    warps, programs per SM, stages and a register cap at all heads per program is
    benchmarks/results/h100-s40-attention-sweep.json; heads one or all,
    h100-s47-attention-sweep.json.)"""
    heads = [(1, False), (None, False), (None, True)]
    return [(f"new heads={'adaptive' if a else h or 'all'} split={s} warps={w}",
             pa.SplitLaunch(split_tokens=s, num_warps=w, heads_per_program=h, adaptive_heads=a))
            for h, a in heads for s in (32, 64) for w in (1, 2, 4)] + mma_launches(pa)


def mma_launches(pa) -> list[tuple[str, object]]:
    """The tensor-core body (attend_split_mma.py), f16 queries: split × warps, all heads."""
    return [(f"mma split={s} warps={w}", pa.SplitLaunch(split_tokens=s, num_warps=w, mma=True))
            for s in (32, 64) for w in (1, 2, 4)] + [
        (f"mma split={s} warps=4 programs/SM={p} stages={st}",
         pa.SplitLaunch(split_tokens=s, num_warps=4, programs_per_sm=p, num_stages=st, mma=True))
        for s in (32, 64) for p in (1, 4, 8) for st in (1, 3)] + [
        (f"mma split=64 warps=4 programs/SM=4 merge={c}",
         pa.SplitLaunch(split_tokens=64, num_warps=4, programs_per_sm=4, mma=True, merge_splits=c))
        for c in (32, 128)]


def attention_rows(torch, pa, old, timer, device, contexts, batches, width, layer_limit, variants, rows, save):
    """Every case for each (label, launch) in `variants`; launch "old" is the baseline."""
    for name, shape in SHAPES.items():
        layers = min(shape["layers"], layer_limit)
        for ctx in contexts:
            for batch in batches:
                case = make_case(torch, shape, ctx, batch, layers, width, device)
                last = layers - 1
                check = sorted({0, batch - 1})
                ref = reference_rows(torch, case, last, check)
                half = {label: getattr(launch, "mma", False) for label, launch in variants}  # f16 queries
                ref16 = reference_rows(torch, case, last, check, "q16") if any(half.values()) else None
                kernels = [(label, lambda layer, c=case, ln=launch, h=half[label]: pa.paged_attention(
                    c["q16" if h else "q"], c["k"][layer], c["v"][layer], c["tables"], c["row_seq"], c["row_pos"],
                    out=c["out16" if h else "out"], launch=ln)) for label, launch in variants if launch != "old"]
                if any(launch == "old" for _, launch in variants):
                    kernels.append(("old", lambda layer, c=case: old.paged_attention(
                        c["q"], c["k"][layer], c["v"][layer], c["tables"], c["row_seq"], c["row_pos"], out=c["out"])))
                launch_of = {label: launch for label, launch in variants if launch != "old"}
                for label, fn in kernels:
                    us = timer.per_call_us(fn, layers)
                    fn(last)
                    out = case["out16" if half[label] else "out"]
                    err = max(float((out[r].double() - (ref16 if half[label] else ref)[r]).abs().max()) for r in check)
                    row = dict(model=name, context=ctx, batch=batch, kernel=label, layers=layers,
                               us_per_call=round(us, 2), kv_gb_per_s=round(case["kv_bytes"] / us / 1e3, 1),
                               max_abs_err_vs_f64=err)
                    if label in ("new", "old") and timer.last_kernels is not None:
                        row["kernels_us_per_call"] = timer.last_kernels
                    if launch_of.get(label) is not None and launch_of[label].split_tokens is not None \
                            and not half[label]:
                        # one head a program (or adaptive) against all heads a program at the same
                        # split: may a launch choose per row in batch-invariant mode on this GPU?
                        got = case["out"].clone()
                        pa.paged_attention(case["q"], case["k"][last], case["v"][last], case["tables"],
                                           case["row_seq"], case["row_pos"], out=case["out"],
                                           launch=pa.SplitLaunch(split_tokens=launch_of[label].split_tokens))
                        row["bits_equal_all_heads"] = bool(torch.equal(got, case["out"]))
                    if label == "new":  # the last row alone: the same bits as in the batch
                        batched = case["out"][batch - 1].clone()
                        r = slice(batch - 1, batch)
                        alone = pa.paged_attention(case["q"][r].contiguous(), case["k"][last], case["v"][last],
                                                   case["tables"][r].contiguous(), case["row_seq"][:1],
                                                   case["row_pos"][r].contiguous(), launch=launch_of[label])
                        row["row_alone_bitwise_equal"] = bool(torch.equal(alone[0], batched))
                    rows.append(row)
                    print(f"attention {name:5s} ctx {ctx:5d} batch {batch:3d} {label:28s} {us:9.2f} µs/call "
                          f"{row['kv_gb_per_s']:8.1f} GB/s  err {err:.1e}", flush=True)
                del case
                save()  # what is measured survives a run cut short


def kv_write_rows(torch, timer, device, batches, layer_limit, rows, save):
    for name, shape in SHAPES.items():
        for batch in batches:
            rows += kv_write_case(torch, timer, device, name, shape, batch, min(shape["layers"], layer_limit))
            save()


def kv_write_case(torch, timer, device, name: str, shape: dict, batch: int, layers: int) -> list[dict]:
    """One decode step's K/V writes per layer, four ways, and whether the caches agree."""
    from minivllm.kernels.rope import RotaryEmbedding
    from minivllm.kernels.triton.fused import rope_qk
    from minivllm.kernels.triton.kv_store import store_kv

    kvh, d, h = shape["kv_heads"], shape["head_dim"], shape["heads"]
    gen = torch.Generator(device=device).manual_seed(1)
    n_slots = 64 * PAGE_SIZE
    caches = {key: (torch.zeros(layers, n_slots, kvh, d, dtype=torch.float16, device=device),
                    torch.zeros(layers, n_slots, kvh, d, dtype=torch.float16, device=device))
              for key in ("index", "store", "rope")}
    k = torch.randn(batch, kvh, d, generator=gen, device=device).half()
    v = torch.randn(batch, kvh, d, generator=gen, device=device).half()
    q = torch.randn(batch, h, d, generator=gen, device=device).half()
    slots = torch.randperm(n_slots, generator=gen, device=device)[:batch]
    cos, sin = RotaryEmbedding(d, 1e6, "halves", device=device).cos_sin(torch.full((batch,), 511, device=device))
    ko = rope_qk(q, k, cos, sin, "halves")[1]

    def index_writes(layer):
        caches["index"][0][layer].index_copy_(0, slots, ko)
        caches["index"][1][layer].index_copy_(0, slots, v)

    variants = {
        "2 x index_copy_ (old)": index_writes,
        "store_kv (one launch)": lambda layer: store_kv(ko, v, caches["store"][0][layer], caches["store"][1][layer],
                                                        slots),
        "rope_qk alone": lambda layer: rope_qk(q, k, cos, sin, "halves"),
        "rope_qk + store (new)": lambda layer: rope_qk(q, k, cos, sin, "halves", store=(
            caches["rope"][0][layer], caches["rope"][1][layer], slots, v)),
    }
    rows = []
    for label, fn in variants.items():
        us = timer.per_call_us(fn, layers)
        rows.append(dict(model=name, batch=batch, variant=label, us_per_layer=round(us, 2),
                         kernels_us_per_layer=timer.last_kernels))
        print(f"kv write  {name:5s} batch {batch:3d} {label:24s} {us:9.2f} µs/layer", flush=True)
    exact = all(torch.equal(caches["index"][i], caches[key][i]) for key in ("store", "rope") for i in (0, 1))
    rows.append(dict(model=name, batch=batch, variant="cache bits equal (store, rope+store vs index)",
                     exact=bool(exact)))
    return rows


def summary(attn: list[dict], kv: list[dict]) -> dict:
    out = {}
    by = {(r["model"], r["context"], r["batch"], r["kernel"]): r for r in attn}
    for (model, ctx, batch, kernel), r in by.items():
        if kernel != "new":
            continue
        key = f"{model} ctx {ctx} batch {batch}"
        old = by.get((model, ctx, batch, "old"))
        out[key] = dict(new_us=r["us_per_call"], old_us=old and old["us_per_call"],
                        speedup=old and round(old["us_per_call"] / r["us_per_call"], 2))
    for r in kv:
        if "us_per_layer" in r:
            out.setdefault(f"kv write {r['model']} batch {r['batch']}", {})[r["variant"]] = r["us_per_layer"]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import triton

    if not args.smoke and not torch.cuda.is_available():
        print("attention_bench: no CUDA device; run with --smoke (and TRITON_INTERPRET=1) on CPU", file=sys.stderr)
        return 2
    from minivllm.kernels.triton import paged_attention as pa

    device = torch.device("cpu" if args.smoke else "cuda")
    old, origin = load_baseline(args.baseline_module)
    print(f"baseline: {origin}", flush=True)
    if args.smoke:  # tiny: every path once, under the interpreter
        global SHAPES
        SHAPES = {"7B": dict(SHAPES["7B"], layers=2), "0.5B": dict(SHAPES["0.5B"], layers=2)}
        contexts, batches, width, layer_limit = [40, 100], [1, 3], 128 // PAGE_SIZE, 2
    else:
        contexts, batches, width, layer_limit = [512, 4096], [1, 8, 32], MAX_MODEL_LEN // PAGE_SIZE, 99
    if args.shapes:
        SHAPES = {k: v for k, v in SHAPES.items() if k in args.shapes.split(",")}
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else contexts
    batches = [int(b) for b in args.batches.split(",")] if args.batches else batches
    timer = Timer(torch, device, args.replays)
    started = time.time()
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    attn, kv = [], []
    result = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        torch=torch.__version__, triton=triton.__version__, commit=commit, baseline=origin,
        page_size=PAGE_SIZE, block_table_pages=width, split_tokens=pa.SPLIT_TOKENS, replays=args.replays,
        complete=False, attention=attn, kv_write=kv,
    )

    def save() -> None:
        result.update(seconds=round(time.time() - started, 1), summary=summary(attn, kv))
        Path(args.out_json).write_text(json.dumps(result, indent=1))

    # The new kernel beside the old one first, then the K/V writes, the sweep last: a
    # run cut short keeps the main table.
    main_pair = [("new", pa.SplitLaunch())] + ([("old", "old")] if old is not None else [])
    if not (args.sweep and args.sweep_only):
        attention_rows(torch, pa, old, timer, device, contexts, batches, width, layer_limit, main_pair, attn, save)
        kv_write_rows(torch, timer, device, batches, layer_limit, kv, save)
    if args.sweep:
        attention_rows(torch, pa, old, timer, device, contexts, batches, width, layer_limit, sweep_launches(pa),
                       attn, save)
    result["complete"] = True
    save()
    print(json.dumps(result["summary"], indent=1))
    bad = [r for r in attn if r["max_abs_err_vs_f64"] > 1e-3 or r.get("row_alone_bitwise_equal") is False]
    bad += [r for r in kv if r.get("exact") is False]
    for r in bad:
        print(f"CHECK FAILED: {r}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
