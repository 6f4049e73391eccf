"""The issue-41 table of minivllm against llama.cpp on one H100, from the raw files the
device runs of scripts/gpu_vs_llama_cpp.sh wrote (copied into benchmarks/results with an
`h100-issue41-` prefix). Writes benchmarks/results/h100-issue41-vs-llama-cpp.{json,md}.

    python3 scripts/gpu_vs_llama_cpp_table.py
"""

from __future__ import annotations

import json
from pathlib import Path

RES = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
P = "h100-issue41-"


def load(name: str):
    return json.loads((RES / f"{P}{name}").read_text())


def mv(rows, engine="minivllm"):
    return next(r for r in rows if r["engine"] == engine)


def llama_tests(name: str) -> dict:
    return {(t["n_prompt"], t["n_gen"], t["n_depth"]): t for t in load(name)}


def fmt(t) -> str:
    return f"{t['avg_ts']:.1f} ± {t['stddev_ts']:.1f}"


def main() -> None:
    rows = []

    def row(target, what, llama, minivllm, ratio, source, note=""):
        rows.append({"target": target, "row": what, "llama_cpp": llama, "minivllm": minivllm,
                     "ratio_vs_llama_cpp": None if ratio is None else round(ratio, 3), "source": source, "note": note})

    dec = {s: load(f"run2-decode-{s}.json")["rows"] for s in ("0.5b", "7b")}
    for s, target in (("7b", "7B Q4_K_M batch-1 decode"), ("0.5b", "0.5B Q4_K_M batch-1 decode")):
        m, p = mv(dec[s]), mv(dec[s], "llama.cpp-cuda")
        row(target, "tg128 after a 512-token prompt, tok/s", f"{p['decode_tok_s']} (depth 0: "
            f"{p['decode_tok_s_from_empty_context']:.1f})", f"{m['decode_tok_s_median']:.1f}",
            m["ratio_vs_llama_cpp"], f"{P}run2-decode-{s}.json")
    for s in ("0.5b", "7b"):
        b = load(f"run2-batched-{s}.json")["rows"]
        for r in (x for x in b if x["engine"] == "minivllm"):
            row(f"batched decode {s}", f"{r['sequences']} sequences, 128 + 128, S_TG tok/s",
                f"{r['llama_cpp_decode_tok_s']:.1f}", f"{r['decode_tok_s']:.1f}", r["ratio_vs_llama_cpp"],
                f"{P}run2-batched-{s}.json")
    for s in ("0.5b", "7b"):
        m, p = mv(dec[s]), mv(dec[s], "llama.cpp-cuda")
        row(f"pp512 {s}", "prefill of a 512-token prompt, tok/s", p["prefill_tok_s"],
            f"{m['prefill_tok_s_median']:.0f}", m["ratio_vs_llama_cpp_prefill"], f"{P}run2-decode-{s}.json",
            "minivllm: prompt submitted -> first token; llama.cpp: pp512")
    m512 = mv(dec["7b"])["decode_tok_s_median"]
    m4096 = mv(load("run2-decode-7b-after4096.json")["rows"])["decode_tok_s_median"]
    d = llama_tests("run2-llama-bench-7b-depth.json")
    l512, l4096 = d[(0, 128, 512)]["avg_ts"], d[(0, 128, 4096)]["avg_ts"]
    row("decode after 4096 ÷ after 512, 7B", "tg128 after 4096 / after 512",
        f"{l4096:.1f} / {l512:.1f} = {l4096 / l512:.3f}", f"{m4096:.1f} / {m512:.1f} = {m4096 / m512:.3f}", None,
        f"{P}run2-decode-7b-after4096.json, {P}run2-llama-bench-7b-depth.json",
        "the target is minivllm's own ratio (>= 0.95)")
    sweep = json.loads((RES / "h100-gemv-sweep-sm90-20261205.json").read_text())
    for r in sweep["rows"]:
        row("GEMV GB/s ÷ copy GB/s", f"{r['type']} {r['n']}x{r['k']} ({r['mbytes']:.1f} MB)", "—",
            f"float {r['best_frac_of_copy']:.0%} ({r['best_us']:.1f} µs), int8 {r['best_int8_frac_of_copy']:.0%} "
            f"({r['best_int8_us']:.1f} µs); before: {r['legacy_frac_of_copy']:.0%} ({r['legacy_us']:.1f} µs)", None,
            "h100-gemv-sweep-sm90-20261205.json", f"copy {sweep['meta']['copy_GBps']:.0f} GB/s; f16 cuBLAS "
            f"{r['f16_cublas_frac_of_copy']:.0%}")
    inv, dflt = load("run2-batched-invariant-0.5b.json")["minivllm"], load("run2-batched-default-0.5b.json")["minivllm"]
    for a, b in zip(inv, dflt):
        row("batch-invariant cost (0.5B)", f"{a['sequences']} sequences, decode tok/s", "—",
            f"invariant {a['decode_tok_s']:.1f} / default {b['decode_tok_s']:.1f} = "
            f"{a['decode_tok_s'] / b['decode_tok_s']:.3f}", None, f"{P}run2-batched-invariant-0.5b.json")
    l7, l05 = llama_tests("run3-llama-bench-7b.json"), llama_tests("run3-llama-bench-0.5b.json")
    for s, lt in (("7b", l7), ("0.5b", l05)):
        n = mv(load(f"run3-decode-native-{s}.json")["rows"])["decode_tok_s_median"]
        for kind, label in (
            ("int8", "int8 GEMV (MINIVLLM_Q8_GEMV=1)"),
            ("sm75", "T4 profile (MINIVLLM_GPU_PROFILE=sm75)"),
        ):
            v = mv(load(f"run3-decode-{kind}-{s}.json")["rows"])["decode_tok_s_median"]
            row(
                f"{label}, {s} batch-1 decode",
                "tg128 after 512, tok/s",
                fmt(lt[(0, 128, 512)]),
                f"{v:.1f} (native same run: {n:.1f})",
                v / lt[(0, 128, 512)]["avg_ts"],
                f"{P}run3-decode-{kind}-{s}.json",
                "run 3: minivllm timed while llama.cpp built in the background (16 cores busy); llama-bench after it",
            )
    b8 = load("run3-batched-int8-7b.json")["rows"]
    for r in (x for x in b8 if x["engine"] == "minivllm"):
        row(
            "batched decode 7B, int8 GEMV",
            f"{r['sequences']} sequences, S_TG tok/s",
            f"{r['llama_cpp_decode_tok_s']:.1f}",
            f"{r['decode_tok_s']:.1f}",
            r["ratio_vs_llama_cpp"],
            f"{P}run3-batched-int8-7b.json",
        )
    meta = {
        "device": "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs), lent machine (Firecracker); one warm machine for "
        "runs 1-2 (sitting A), another for run 3 (sitting B)",
        "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f, built for sm_90 on each machine "
        "(../shared/peers/llama-cpp-cuda/build_on_gpu.sh)",
        "minivllm_commit": "run 2: c7897e9 (float GEMV with the sweep's table); "
        "run 3: 7cca898 (+ int8 fix, committed table)",
        "files": "synthetic Qwen2.5 0.5B / 7B Q4_K_M GGUFs written on the GPU machine (bench/synthetic_model.py), "
        "both engines reading the same file",
        "commands": {
            "stage + runs": "scripts/gpu_vs_llama_cpp.sh stage DEST; ... 1; ... 2; ... 3",
            "llama-bench": "llama-bench -m FILE -ngl 99 -p 512 -n 128 -d 0,512 -r 5 -o json (inside "
            "bench decode --llama-bench); depth: -p 0 -n 128 -d 0,512,4096 -r 3",
            "llama-batched-bench": "llama-batched-bench -m FILE -ngl 99 -c 8448 -npp 128 -ntg 128 "
            "-npl 1,8,32 --output-format jsonl",
            "minivllm": "minivllm bench decode --synthetic NAME --activation-dtype f16 --inference-device "
            "cuda:0 --runs 3 --max-tokens 128 --prompt-tokens 512 --no-eager-row; minivllm "
            "bench offline --model FILE --llama-batched-bench PATH",
        },
        "pytest": {
            "run 3 native": "149 passed, 33 skipped, 10 errors",
            "run 3 MINIVLLM_GPU_PROFILE=sm75": "146 passed, 36 skipped, 10 errors",
            "errors": "collection ImportErrors of modules the stage "
            "did not carry (jsonschema, uvicorn, openai): tests/integration/serving/*, "
            "tests/unit/serving/test_tool_calls.py, tests/integration/engine/test_structured_output.py",
        },
    }
    (RES / "h100-issue41-vs-llama-cpp.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = ["# minivllm vs llama.cpp on one H100 (issue 41)", "",
          "Raw figures of both engines; ratio = minivllm / llama.cpp. Native minivllm = f16, CUDA graphs, the tiled "
          "float GEMV with the H100 sweep's launch table; int8 GEMV and the T4 profile are separate rows.", "",
          "| target | row | llama.cpp | minivllm | ratio | source | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(
            f"| {r['target']} | {r['row']} | {r['llama_cpp']} | {r['minivllm']} | "
            f"{'' if r['ratio_vs_llama_cpp'] is None else r['ratio_vs_llama_cpp']} | {r['source']} | {r['note']} |"
        )
    md += ["", "Provenance:", "", "```json", json.dumps(meta, indent=1), "```", ""]
    (RES / "h100-issue41-vs-llama-cpp.md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
