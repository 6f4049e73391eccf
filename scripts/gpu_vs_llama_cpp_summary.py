"""One table of minivllm vs llama.cpp on a GPU (the H200 runs) from the raw result files.

Reads the files the GPU decode runs wrote (docs/gpu-decode-vs-llama-cpp.md) (copied into
benchmarks/results with an `h200-` prefix: `bench decode` / `bench kernels` JSON from
minivllm, `llama-bench -o json` output and the command that produced it) and writes
benchmarks/results/h200-issue19-vs-llama-cpp-<stamp>.{json,md}: every row with both raw
figures, `ratio_vs_llama_cpp`, the llama.cpp commit and command, and the source files.

    python scripts/gpu_vs_llama_cpp_summary.py
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
LLAMA_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # ../shared/peers/README.md (llama-cpp-python 0.3.36)

# Each GPU run: the minivllm code it ran and its files.
RUNS = {
    "run1": {
        "minivllm_commit": "c56a420 (repacked GEMV + flash-decoding attention; torch elementwise steps)",
        "decode": {"0.5b": "h200-decode-synthetic-qwen2.5-0.5b-q4_k_m-20261201T225304Z.json",
                   "7b": "h200-decode-synthetic-qwen2.5-7b-q4_k_m-20261201T225411Z.json",
                   "7b@4096": "h200-decode-synthetic-qwen2.5-7b-q4_k_m-20261201T225612Z.json"},
        "kernels": "h200-kernels-gemv-20261201T225533Z.json",
    },
    "run2": {
        "minivllm_commit": "f3b6bb1 (run1 + fused add+RMSNorm / RoPE / SwiGLU kernels, I2F-free scales)",
        "decode": {"0.5b": "h200-decode-synthetic-qwen2.5-0.5b-q4_k_m-20261201T230744Z.json",
                   "7b": "h200-decode-synthetic-qwen2.5-7b-q4_k_m-20261201T230843Z.json",
                   "7b@4096": "h200-decode-synthetic-qwen2.5-7b-q4_k_m-20261201T231039Z.json"},
        "kernels": "h200-kernels-gemv-20261201T230935Z.json",
    },
}
FILES = {"0.5b": "qwen2.5-0.5b-q4_k_m", "7b": "qwen2.5-7b-q4_k_m"}


def _load(name: str):
    return json.loads((RESULTS / name).read_text())


def _llama(run: str, key: str) -> tuple[list[dict], str]:
    stem = f"h200-{run}-llama-bench-{key}"
    return _load(stem + ".json"), (RESULTS / (stem + ".cmd")).read_text().strip()


def _minivllm(run: str, which: str) -> dict:
    doc = _load(RUNS[run]["decode"][which])
    row = next(r for r in doc["rows"] if r["engine"] == "minivllm")
    return {"file": RUNS[run]["decode"][which], "row": row, "provenance": doc["provenance"]}


def rows_for(run: str) -> list[dict]:
    out = []
    for short, key in FILES.items():
        llama, cmd = _llama(run, key)
        mv = _minivllm(run, short)
        r = mv["row"]
        for metric, n_prompt, n_gen, ours_key in (("pp512 tok/s", 512, 0, "prefill_tok_s"),
                                                  ("tg128 tok/s (batch 1)", 0, 128, "decode_tok_s")):
            peer = next(x for x in llama if x["n_prompt"] == n_prompt and x["n_gen"] == n_gen)
            ours = r[f"{ours_key}_median"]
            out.append({
                "run": run, "file": key, "metric": metric,
                "llama_cpp": round(peer["avg_ts"], 2), "llama_cpp_std": round(peer["stddev_ts"], 2),
                "minivllm": round(ours, 2), "minivllm_mean_std": r[ours_key], "minivllm_runs": r["runs"],
                "ratio_vs_llama_cpp": round(ours / peer["avg_ts"], 3),
                "llama_cpp_command": cmd, "llama_cpp_commit": LLAMA_COMMIT,
                "minivllm_commit": RUNS[run]["minivllm_commit"], "minivllm_source": mv["file"],
                "note": ("minivllm: 512-token prompt then 128 greedy tokens (decode after 512), f16, CUDA graphs; "
                         "llama-bench tg128 decodes from an empty context" if ours_key == "decode_tok_s" else
                         "minivllm: TTFT of a 512-token prompt (one request); llama-bench pp512"),
            })
    llama, cmd = _llama(run, "ctx")
    mv512, mv4096 = _minivllm(run, "7b")["row"], _minivllm(run, "7b@4096")["row"]
    for depth, ours_row in ((512, mv512), (4096, mv4096)):
        peer = next(x for x in llama if x.get("n_depth") == depth)
        out.append({
            "run": run, "file": FILES["7b"], "metric": f"tg128 tok/s after {depth} tokens",
            "llama_cpp": round(peer["avg_ts"], 2), "llama_cpp_std": round(peer["stddev_ts"], 2),
            "minivllm": round(ours_row["decode_tok_s_median"], 2), "minivllm_mean_std": ours_row["decode_tok_s"],
            "minivllm_runs": ours_row["runs"],
            "ratio_vs_llama_cpp": round(ours_row["decode_tok_s_median"] / peer["avg_ts"], 3),
            "llama_cpp_command": cmd, "llama_cpp_commit": LLAMA_COMMIT, "minivllm_commit": RUNS[run]["minivllm_commit"],
            "minivllm_source": RUNS[run]["decode"]["7b" if depth == 512 else "7b@4096"],
        })
    zero = next(x for x in llama if x.get("n_depth") == 0)["avg_ts"]
    far = next(x for x in llama if x.get("n_depth") == 4096)["avg_ts"]
    out.append({"run": run, "file": FILES["7b"], "metric": "decode after 4096 / after 512 (context flatness)",
                "llama_cpp": round(far / next(x for x in llama if x.get("n_depth") == 512)["avg_ts"], 3),
                "llama_cpp_after_0": round(zero, 2),
                "minivllm": round(mv4096["decode_tok_s_median"] / mv512["decode_tok_s_median"], 3),
                "minivllm_commit": RUNS[run]["minivllm_commit"]})
    return out


def kernel_rows(run: str) -> list[dict]:
    doc = _load(RUNS[run]["kernels"])
    keep = ("type", "N", "K", "repacked_MB", "repacked_m1_us", "repacked_m1_frac_of_copy", "repacked_m1_invariant_us",
            "repacked_m8_us", "repacked_m1_graph_us", "repacked_m1_graph_frac_of_copy",
            "repacked_m1_invariant_graph_us", "repacked_m1_invariant_graph_frac_of_copy", "m1_us", "m1_frac_of_copy",
            "f16_cublas_graph_us", "f16_cublas_graph_frac_of_copy")
    return [{"run": run, **{k: r[k] for k in keep if k in r}} for r in doc["rows"]]


# run3: the same code as run2 on another machine, batch-invariant mode off / on (0.5B, batch 1).
INVARIANT = {"off": "h200-decode-synthetic-qwen2.5-0.5b-q4_k_m-20261201T231728Z.json",
             "on": "h200-decode-synthetic-qwen2.5-0.5b-q4_k_m-20261201T231752Z.json"}


def invariant_rows() -> list[dict]:
    got = {k: next(r for r in _load(f)["rows"] if r["engine"] == "minivllm") for k, f in INVARIANT.items()}
    out = []
    for metric, key in (("tg128 tok/s (batch 1)", "decode_tok_s"), ("512-token prompt tok/s (TTFT)", "prefill_tok_s")):
        off, on = got["off"][f"{key}_median"], got["on"][f"{key}_median"]
        out.append({"run": "run3", "file": FILES["0.5b"], "metric": f"batch_invariant=True cost, {metric}",
                    "minivllm_default": round(off, 2), "minivllm_invariant": round(on, 2),
                    "invariant/default": round(on / off, 3), "sources": INVARIANT,
                    "minivllm_commit": RUNS["run2"]["minivllm_commit"]})
    return out


def main() -> None:
    rows = rows_for("run1") + rows_for("run2")
    inv = invariant_rows()
    kernels = kernel_rows("run1") + kernel_rows("run2")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    copy = {run: _load(RUNS[run]["kernels"])["provenance"]["settings"]["copy_bandwidth_GBps"] for run in RUNS}
    meta = {"device": "NVIDIA H200 (sm_90), one per run, lent machine (Firecracker)", "llama_cpp_commit": LLAMA_COMMIT,
            "llama_cpp_build": ".gpu19/build_on_gpu.sh (../shared/peers/llama-cpp-cuda) for sm_90 on the same machine",
            "runs": RUNS, "copy_bandwidth_GBps": copy,
            "files": "synthetic GGUFs written on the GPU machine by minivllm.bench.synthetic_model "
                     "(qwen2.5-0.5b-q4_k_m: the exact tensor table of Qwen2.5(-Coder)-0.5B-Instruct Q4_K_M; "
                     "qwen2.5-7b-q4_k_m), both engines reading the same file",
            "caveats": ["run2's minivllm 7B decode rows ran while the llama.cpp build used all 16 CPU cores "
                        "(load average 16.6 at the start); llama-bench ran after the build",
                        "the result files' own 'commit' field reads 57d4dba-dirty (the GPU copy has no git "
                        "history); minivllm_commit here is the commit the run's working tree was at"]}
    (RESULTS / f"h200-gpu-vs-llama-cpp-{stamp}.json").write_text(
        json.dumps({"benchmark": "gpu-vs-llama-cpp", "provenance": meta, "rows": rows, "kernels": kernels,
                    "batch_invariant_cost": inv},
                   indent=2))
    lines = ["# minivllm vs llama.cpp on one H200 (issue 19)", "",
             "Same synthetic GGUF files for both engines, written on the GPU machine. llama.cpp "
             f"{LLAMA_COMMIT[:10]} built there for sm_90; its raw figures are llama-bench's avg ± std "
             "(5 repetitions; 3 for the depth sweep). minivllm: medians of `bench decode` rounds (f16, CUDA graphs). "
             "run1 = repacked GEMV + flash-decoding attention; run2 = run1 + fused elementwise kernels.", "",
             "| run | file | metric | llama.cpp | minivllm | ratio_vs_llama_cpp |", "|---|---|---|---|---|---|"]
    for r in rows:
        peer = f"{r['llama_cpp']}" + (f" ± {r['llama_cpp_std']}" if "llama_cpp_std" in r else "")
        lines.append(f"| {r['run']} | {r['file']} | {r['metric']} | {peer} | {r['minivllm']} | "
                     f"{r.get('ratio_vs_llama_cpp', '')} |")
    lines += ["", "Batch-invariant mode at batch 1 (run3, 0.5B file, same code as run2):", "",
              "| metric | default | batch_invariant=True | ratio |", "|---|---|---|---|"]
    for r in inv:
        lines.append(
            f"| {r['metric']} | {r['minivllm_default']} | {r['minivllm_invariant']} | {r['invariant/default']} |"
        )
    lines += [
        "",
        "GEMV at M = 1, repacked layout, timed from CUDA-graph replays over weight copies larger than the L2 "
        "(run2); fraction of the copy bandwidth "
        f"({copy['run2']:.0f} GB/s read + write):",
        "",
        "| type | N x K | MB | µs | of copy | invariant µs | f16 cuBLAS dense µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in kernels:
        if k["run"] == "run2" and "repacked_m1_graph_us" in k:
            lines.append(
                f"| {k['type']} | {k['N']}x{k['K']} | {k['repacked_MB']:.1f} | {k['repacked_m1_graph_us']:.1f} "
                f"| {k['repacked_m1_graph_frac_of_copy']:.0%} | {k['repacked_m1_invariant_graph_us']:.1f} | "
                f"{k.get('f16_cublas_graph_us', float('nan')):.1f} |"
            )
    lines += ["", "Provenance:", "", "```json", json.dumps(meta, indent=2), "```", ""]
    (RESULTS / f"h200-gpu-vs-llama-cpp-{stamp}.md").write_text("\n".join(lines))
    print("\n".join(lines[:40]))


if __name__ == "__main__":
    main()
