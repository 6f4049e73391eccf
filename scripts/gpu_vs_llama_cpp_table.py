"""The issue-41 table of minivllm against llama.cpp on one GPU, from the archives the two
device runs of scripts/gpu_vs_llama_cpp.sh leave (run1.tgz, run2.tgz).

    python3 scripts/gpu_vs_llama_cpp_table.py PREFIX run1.tgz run2.tgz --device "..." --commit SHA

Copies each run's raw result files into benchmarks/results as PREFIX + run<N>- + a short
name (the part of the name before "--"), then writes PREFIX + vs-llama-cpp.{json,md}: every
target row with both engines' raw figures and `ratio_vs_llama_cpp`, the step profiles
(kernels per step, GPU busy and idle), the async-scheduling and batch-invariant costs, the
T4 profile and int8 rows, the GEMV/GEMM crossover and the CUDA test results.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tarfile
import tempfile
from pathlib import Path

RES = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
SIZES = ("0.5b", "7b")


class Table:
    def __init__(self, prefix: str):
        self.prefix, self.rows = prefix, []

    def row(self, target, what, llama, minivllm, ratio, source, note=""):
        self.rows.append({"target": target, "row": what, "llama_cpp": llama, "minivllm": minivllm,
                          "ratio_vs_llama_cpp": None if ratio is None else round(ratio, 3),
                          "source": source, "note": note})


def copy_raw(prefix: str, run: int, archive: Path) -> dict[str, Path]:
    """Unpack `archive` and copy its result files into RES; short name -> copied path."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        for f in sorted(Path(tmp).rglob("*")):
            if not f.is_file() or f.suffix not in (".json", ".md", ".txt", ".log", ".cmd"):
                continue
            short = f.name.split("--")[0] + (f.suffix if "--" in f.name else "")
            if "--" in f.name and f.suffix == ".md":
                continue  # the JSON beside it holds the same figures
            if f.suffix == ".log" and not short.startswith("pytest"):
                continue
            if f.parent.name == "profile":
                short = f.name
            dest = RES / f"{prefix}run{run}-{short}"
            shutil.copyfile(f, dest)
            out[short] = dest
    return out


def minivllm_row(path: Path, engine: str = "minivllm") -> dict:
    return next(r for r in json.loads(path.read_text())["rows"] if r["engine"] == engine)


def llama_bench(f: Path) -> dict[tuple[int, int, int], dict]:
    """llama-bench -o json rows by (n_prompt, n_gen, n_depth)."""
    return {(x["n_prompt"], x["n_gen"], x["n_depth"]): x for x in json.loads(f.read_text())}


def peer_text(x: dict) -> str:
    return f"{x['avg_ts']:.1f} ± {x['stddev_ts']:.1f} (median {statistics.median(x['samples_ts']):.1f})"


def once_rows(t: Table, once: dict[str, Path], alone: dict[str, Path]) -> None:
    """Rows of a `once` run: minivllm's decode JSONs hold minivllm alone and llama-bench wrote
    its own JSON (depths 0, 512 and 4096 for the 7B). minivllm's tg128 after a 512-token prompt
    is set against llama-bench's tg128 at depth 512; ratios of medians. `alone` is an `early-ab`
    run on the same warm machine (minivllm alone, nothing else running): its default rows are
    set against the same llama.cpp figures, named so."""
    runs = {"once": once, "early-ab": alone}
    for s in SIZES:
        lb = once.get(f"llama-bench-{s}.json")
        if not lb:
            continue
        peer = llama_bench(lb)
        for depth, mine in ((512, f"decode-qwen2.5-{s}-q4_k_m.json"), (4096, f"decode-{s}-4096.json"),
                            (512, f"decode-nopdl-qwen2.5-{s}-q4_k_m.json"), (4096, f"decode-nopdl-{s}-4096.json"),
                            (512, f"decode-noearly-qwen2.5-{s}-q4_k_m.json"),
                            (512, f"decode-early1-{s}-512.json" if s == "7b" else f"decode-early1-{s}.json"),
                            (4096, f"decode-early1-{s}-4096.json"),
                            (512, f"decode-early2-{s}-512.json" if s == "7b" else f"decode-early2-{s}.json"),
                            (4096, f"decode-early2-{s}-4096.json")):
            p = peer.get((0, 128, depth))
            for label, run in runs.items():
                f = run.get(mine)
                if not (f and p):
                    continue
                m = minivllm_row(f)
                t.row(f"{s} batch-1 decode after {depth} tokens", f"{mine.split('.json')[0]} ({label} run), tok/s",
                      f"tg128 at depth {depth}: {peer_text(p)}",
                      f"{m['decode_tok_s']} (median {m['decode_tok_s_median']:.1f})",
                      m["decode_tok_s_median"] / statistics.median(p["samples_ts"]), f.name,
                      "ratio of medians" + ("" if label == "once" else "; minivllm timed alone in the call before"))
        p, f = peer.get((512, 0, 0)), once.get(f"decode-qwen2.5-{s}-q4_k_m.json") or alone.get(
            f"decode-early1-{s}-512.json" if s == "7b" else f"decode-early1-{s}.json")
        if p and f:
            m = minivllm_row(f)
            t.row(f"pp512 {s}", "prefill of a 512-token prompt, tok/s", peer_text(p), m["prefill_tok_s"],
                  m["prefill_tok_s_median"] / statistics.median(p["samples_ts"]), f.name,
                  "minivllm: prompt submitted -> first token; llama.cpp: pp512")


def build(prefix: str, r1: dict[str, Path], r2: dict[str, Path], device: str, commit: str) -> Table:
    t = Table(prefix)
    name = {s: f"qwen2.5-{s}-q4_k_m" for s in SIZES}
    if r1.get("llama-bench-7b.json") and not r2.get("llama-bench-7b.json"):
        once_rows(t, r1, r2)
    for s, target in (("7b", "7B Q4_K_M batch-1 decode"), ("0.5b", "0.5B Q4_K_M batch-1 decode")):
        f = r2.get(f"decode-{name[s]}.json")
        if f:
            m, p = minivllm_row(f), minivllm_row(f, "llama.cpp-cuda")
            t.row(target, "tg128 after a 512-token prompt, tok/s",
                  f"{p['decode_tok_s']} (depth 0: {p['decode_tok_s_from_empty_context']:.1f})",
                  f"{m['decode_tok_s']} (median {m['decode_tok_s_median']:.1f})", m["ratio_vs_llama_cpp"], f.name)
    for s in SIZES:
        f = r2.get(f"batched-{s}.json")
        if f:
            for r in (x for x in json.loads(f.read_text())["rows"] if x["engine"] == "minivllm"):
                t.row(f"batched decode {s}", f"{r['sequences']} sequences, 128 + 128, S_TG tok/s",
                      f"{r['llama_cpp_decode_tok_s']:.1f}", f"{r['decode_tok_s']:.1f}", r["ratio_vs_llama_cpp"], f.name)
    for s in SIZES:
        f = r2.get(f"decode-{name[s]}.json")
        if f:
            m, p = minivllm_row(f), minivllm_row(f, "llama.cpp-cuda")
            t.row(
                f"pp512 {s}",
                "prefill of a 512-token prompt, tok/s",
                p["prefill_tok_s"],
                m["prefill_tok_s"],
                m["ratio_vs_llama_cpp_prefill"],
                f.name,
                "minivllm: prompt submitted -> first token; llama.cpp: pp512",
            )
    f512, f4096, fdepth = r2.get(f"decode-{name['7b']}.json"), r2.get("decode-7b-4096.json"), \
        r2.get("llama-bench-7b-depth.json")
    if f512 and f4096 and fdepth:
        m512, m4096 = minivllm_row(f512)["decode_tok_s_median"], minivllm_row(f4096)["decode_tok_s_median"]
        d = {(x["n_prompt"], x["n_gen"], x["n_depth"]): x["avg_ts"] for x in json.loads(fdepth.read_text())}
        l512, l4096 = d[(0, 128, 512)], d[(0, 128, 4096)]
        t.row("decode after 4096 ÷ after 512, 7B", "tg128 after 4096 / after 512",
              f"{l4096:.1f} / {l512:.1f} = {l4096 / l512:.3f}", f"{m4096:.1f} / {m512:.1f} = {m4096 / m512:.3f}",
              None, f"{f4096.name}, {fdepth.name}", "the target is minivllm's own ratio (>= 0.95)")
        for tag, label in (("mma", "MINIVLLM_ATTENTION_MMA=1 (s48-s49: opt-in)"),
                           ("plainattn", "plain attention body (MINIVLLM_ATTENTION_MMA=0)")):
            g512, g4096 = r2.get(f"decode-{tag}-{name['7b']}.json"), r2.get(f"decode-{tag}-7b-4096.json")
            if g512 and g4096:  # the same ratio with the other attention body
                v512, v4096 = minivllm_row(g512)["decode_tok_s_median"], minivllm_row(g4096)["decode_tok_s_median"]
                t.row(f"decode after 4096 ÷ after 512, 7B, {label}", "tg128 after 4096 / after 512",
                      f"{l4096:.1f} / {l512:.1f} = {l4096 / l512:.3f}",
                      f"{v4096:.1f} / {v512:.1f} = {v4096 / v512:.3f}",
                      None, f"{g4096.name}, {fdepth.name}", "the target is minivllm's own ratio (>= 0.95)")
    for s in SIZES:
        native = r2.get(f"decode-{name[s]}.json")
        if not native:
            continue
        n, p = minivllm_row(native), minivllm_row(native, "llama.cpp-cuda")
        for kind, label in (("sync", "async scheduling off"), ("sm75", "T4 profile (MINIVLLM_GPU_PROFILE=sm75)"),
                            ("int8", "int8 GEMV (MINIVLLM_Q8_GEMV=1)"),
                            ("unfolded", "split-K sums launched apart (MINIVLLM_FOLD_SPLIT_SUM=0)"),
                            ("pdl", "programmatic dependent launch (MINIVLLM_PDL=1)"),
                            ("mma", "tensor-core attention body (MINIVLLM_ATTENTION_MMA=1)"),
                            ("mmapdl", "MMA attention and PDL (MINIVLLM_ATTENTION_MMA=1 MINIVLLM_PDL=1)"),
                            ("plainattn", "plain attention body (MINIVLLM_ATTENTION_MMA=0)"),
                            ("nopdl", "PDL off (MINIVLLM_PDL=0)"),
                            ("noearly", "GEMV first trip after the PDL wait (MINIVLLM_GEMV_EARLY_LOAD=0)"),
                            ("early", "GEMV first trip loaded before the PDL wait (MINIVLLM_GEMV_EARLY_LOAD=1)"),
                            ("mmagemv", "tensor-core Q4_K GEMV (MINIVLLM_GEMV_KERNEL=mma)")):
            f = r2.get(f"decode-{kind}-{name[s]}.json")
            if f:
                v = minivllm_row(f)["decode_tok_s_median"]
                t.row(f"{label}, {s} batch-1 decode", "tg128 after 512, tok/s", p["decode_tok_s"],
                      f"{v:.1f} (native, same run: {n['decode_tok_s_median']:.1f})",
                      v / p["decode_tok_s_median"], f.name)
        f = r2.get(f"decode-eagerprefill-{name[s]}.json")
        if f:
            v = minivllm_row(f)["prefill_tok_s_median"]
            t.row(f"prefill graphs off, {s} pp512", "prefill of a 512-token prompt, tok/s", p["prefill_tok_s"],
                  f"{v:.0f} (graphs, same run: {n['prefill_tok_s_median']:.0f})", v / p["prefill_tok_s_median"],
                  f.name)
    dflt = r2.get("batched-7b.json")
    for kind, label in (("pdl", "programmatic dependent launch (MINIVLLM_PDL=1)"),
                        ("mma", "tensor-core attention body (MINIVLLM_ATTENTION_MMA=1)"),
                        ("early", "GEMV first trip loaded before the PDL wait (MINIVLLM_GEMV_EARLY_LOAD=1)")):
        var = r2.get(f"batched-{kind}-7b.json")
        if not (var and dflt):
            continue
        base = {r["sequences"]: r for r in json.loads(dflt.read_text())["rows"] if r["engine"] == "minivllm"}
        for a in json.loads(var.read_text())["minivllm"]:
            b = base.get(a["sequences"])
            if b:
                t.row(f"{label}, batched decode 7b",
                      f"{a['sequences']} sequences, 128 + 128, decode tok/s", f"{b['llama_cpp_decode_tok_s']:.1f}",
                      f"{a['decode_tok_s']:.1f} (default, same run: {b['decode_tok_s']:.1f})",
                      a["decode_tok_s"] / b["llama_cpp_decode_tok_s"], var.name)
    inv, dflt = r2.get("batched-invariant-0.5b.json"), r2.get("batched-default-0.5b.json")
    if inv and dflt:
        for a, b in zip(json.loads(inv.read_text())["minivllm"], json.loads(dflt.read_text())["minivllm"]):
            t.row("batch-invariant cost (0.5B)", f"{a['sequences']} sequences, decode tok/s", "—",
                  f"invariant {a['decode_tok_s']:.1f} / default {b['decode_tok_s']:.1f} = "
                  f"{a['decode_tok_s'] / b['decode_tok_s']:.3f}", None, inv.name)
    for short, f in sorted(r2.items()):
        if short.startswith("profile-") and short.endswith(".json"):
            p = json.loads(f.read_text())
            if "error" in p:
                continue
            top = ", ".join(f"{k['kernel']} {k['calls_per_step']:.0f}×{k['us_per_call']:.1f} µs"
                            for k in p["kernels"][:4])
            t.row(
                f"step profile {p['model']}, context {p['context']}, {p.get('rows', 1)} row(s)"
                f"{', PDL (MINIVLLM_PDL=1)' if p.get('pdl') else ''}"
                f"{', MMA attention' if p.get('mma') else ''}{', GEMV early first trip' if p.get('early') else ''}"
                f"{', MMA GEMV' if p.get('gemv_kernel') == 'mma' else ''}",
                f"µs per {p['context']}-token prefill (eager)" if p.get("prefill")
                else "µs per decode step, " + ("eager" if p["eager"] else "CUDA graphs"),
                "—",
                f"step {p['untraced_step_us']:.0f}; GPU busy {p['gpu_busy_us_per_step']:.0f}, idle "
                f"{p['gpu_idle_us_per_step']:.0f}; {p['gpu_events_per_step']:.0f} kernels/step",
                None,
                f.name,
                f"top: {top}",
            )
    for short, f in sorted(r2.items()):
        if short.startswith("gemv-threshold") and short.endswith(".json"):
            d = json.loads(f.read_text())
            rec = d.get("meta", {}).get("recommended_gemv_max_rows", d.get("recommended_gemv_max_rows"))
            ratios = ", ".join(f"N={r['concurrency']}: {r.get('gemv/gemm_median', r.get('gemv/gemm'))}"
                               for r in d.get("rows", []))
            t.row("GEMV/GEMM crossover", f.name, "—", f"GEMV/GEMM median by N: {ratios}", None, f.name,
                  f"recommended gemv_max_rows: {rec}")
    for run in (r1, r2):  # issue 41's GEMV row (bench kernels --row): each type's lowest 7B role
        f = run.get("gemv-row.json")
        if f:
            for name, by_early in json.loads(f.read_text())["provenance"]["settings"]["summary_frac_of_copy"].items():
                t.row("GEMV GB/s ÷ copy GB/s, 7B roles", f"{name}: lowest role / median, by trips before the wait",
                      "—", "; ".join(f"{e}: {v['min']:.0%} ({v['lowest_role']}) / {v['median']:.0%}"
                                     for e, v in by_early.items()), None, f.name, "floor: every role >= 60%")
    tests = {}
    for run in (r1, r2):
        for short, f in run.items():
            if short.startswith("pytest-cuda"):
                lines = [x for x in f.read_text().splitlines() if x.strip()]
                tests[short] = lines[-1] if lines else "empty log"
    t.meta = {"device": device, "minivllm_commit": commit,
              "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f, built for this GPU on the same machine "
              "(../shared/peers/llama-cpp-cuda/build_on_gpu.sh)",
              "files": "synthetic Qwen2.5 0.5B / 7B Q4_K_M GGUFs written on the GPU machine "
              "(bench/synthetic_model.py), both engines reading the same file",
              "commands": {"runs": "scripts/gpu_vs_llama_cpp.sh stage DEST; ... 1; ... 2 (same warm machine)",
                           "llama-bench": "llama-bench -m FILE -ngl 99 -p 512 -n 128 -d 0,512 -r 5 -o json (inside "
                           "bench decode --llama-bench); depth: -p 0 -n 128 -d 0,512,4096 -r 3",
                           "llama-batched-bench": "llama-batched-bench -m FILE -ngl 99 -c 8448 -npp 128 -ntg 128 "
                           "-npl 1,8,32 --output-format jsonl",
                           "minivllm": "minivllm bench decode --synthetic NAME --activation-dtype f16 "
                           "--inference-device cuda:0 --runs 3 --max-tokens 128 --prompt-tokens 512 --no-eager-row; "
                           "minivllm bench offline --model FILE --llama-batched-bench PATH"},
              "pytest -m cuda": tests}
    return t


def write(t: Table) -> Path:
    (RES / f"{t.prefix}vs-llama-cpp.json").write_text(json.dumps({"meta": t.meta, "rows": t.rows}, indent=1))
    md = [f"# minivllm vs llama.cpp, {t.meta['device']} (issue 41)", "",
          "Raw figures of both engines, same machine, same files, one sitting; ratio = minivllm / llama.cpp. Native "
          "minivllm = f16, CUDA graphs, async scheduling, the float GEMV; the int8 GEMV, the T4 profile and async off "
          "are separate rows (their ratio against the same llama.cpp median).", "",
          "| target | row | llama.cpp | minivllm | ratio | source | note |", "|---|---|---|---|---|---|---|"]
    for r in t.rows:
        ratio = "" if r["ratio_vs_llama_cpp"] is None else r["ratio_vs_llama_cpp"]
        md.append(f"| {r['target']} | {r['row']} | {r['llama_cpp']} | {r['minivllm']} | {ratio} | "
                  f"{r['source']} | {r['note']} |")
    md += ["", "Provenance:", "", "```json", json.dumps(t.meta, indent=1, ensure_ascii=False), "```", ""]
    out = RES / f"{t.prefix}vs-llama-cpp.md"
    out.write_text("\n".join(md))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix")
    ap.add_argument("run1", type=Path)
    ap.add_argument("run2", type=Path)
    ap.add_argument("--device", required=True)
    ap.add_argument("--commit", required=True)
    a = ap.parse_args()
    r1, r2 = copy_raw(a.prefix, 1, a.run1), copy_raw(a.prefix, 2, a.run2)
    print(write(build(a.prefix, r1, r2, a.device, a.commit)).read_text())


if __name__ == "__main__":
    main()
