"""How long opening a GGUF file takes: metadata + tensor index + tokenizer.

The issue target is ≤ 1 s for the Qwen 0.5B file (gguf.GGUFReader needs ~8 s there,
measured alongside as the baseline when --baseline is given).
"""

from __future__ import annotations

import time

from minivllm.bench.common import provenance, summarize
from minivllm.bench.results import write_results
from minivllm.gguf.reader import GGUFFile
from minivllm.gguf.tokenizer import Tokenizer
from minivllm.models import resolve_model
from minivllm.models.cache import sha256_file


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run(models: list[str], repeats: int = 5, baseline: bool = False) -> list[dict]:
    rows = []
    hashes = {}
    for name in models:
        path = resolve_model(name)
        hashes[name] = sha256_file(path)
        reader = summarize(_time(lambda path=path: GGUFFile(path), repeats))
        full = summarize(_time(lambda path=path: Tokenizer.from_gguf(GGUFFile(path)), repeats))
        row = {
            "model": name,
            "open_median_s": reader["median"],
            "open_mean_s": reader["mean"],
            "open_std_s": reader["std"],
            "open+tokenizer_median_s": full["median"],
            "open+tokenizer_mean_s": full["mean"],
            "open+tokenizer_std_s": full["std"],
            "repeats": repeats,
        }
        if baseline:
            import gguf

            ref = summarize(_time(lambda path=path: gguf.GGUFReader(path), max(1, repeats // 2)))
            row["gguf.GGUFReader_median_s"] = ref["median"]
            row["speedup_vs_GGUFReader"] = ref["median"] / reader["median"]
        rows.append(row)
    meta = provenance("cpu", None, {"models": models, "repeats": repeats, "model_sha256": hashes})
    cols = ["model", "open_median_s", "open_mean_s", "open_std_s", "open+tokenizer_median_s",
            "open+tokenizer_std_s", "gguf.GGUFReader_median_s", "speedup_vs_GGUFReader"]
    j, m = write_results("gguf-open", meta, rows, cols,
                         "Time to open a GGUF file (metadata + tensor index), and to build its tokenizer too. Seconds.")
    print(m.read_text())
    return rows
