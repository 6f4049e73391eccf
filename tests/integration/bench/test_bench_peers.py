"""`minivllm bench peers`: minivllm vs transformers (and llama-cpp-python when importable) at tiny sizes."""

from __future__ import annotations

import json

import pytest
from conftest import PROVENANCE_KEYS  # the results_dir fixture is in conftest too


def test_peers_driver_tiny(results_dir, smollm2_path):
    pytest.importorskip("transformers")
    from minivllm.bench.peers import AGREE_COL, DECODE_COL, PREFILL_COL, run

    out = run(str(smollm2_path), prompt_len=16, decode_tokens=4, runs=1, threads=2)
    files = sorted(results_dir.glob("peers-*.json"))
    assert len(files) == 1
    md_path = files[0].with_name(files[0].name[:-5] + ".md")
    assert md_path.exists() and sorted(out["files"]) == sorted(map(str, (files[0], md_path)))
    data = json.loads(files[0].read_text())
    meta = data["provenance"]
    assert PROVENANCE_KEYS <= set(meta) and len(meta["model_sha256"]) == 64
    assert meta["settings"]["threads"] == 2 and meta["settings"]["prompt_len"] == 16
    rows = {r["engine"].split(" ")[0]: r for r in data["rows"]}
    assert {"minivllm", "transformers", "llama.cpp"} <= set(rows)
    ours, hf = rows["minivllm"], rows["transformers"]
    for r in (ours, hf):
        assert r["status"] == "ok" and r["prefill_tok_s_mean"] > 0 and r["decode_tok_s_mean"] > 0
        assert r["samples"]["prefill_tok_s"] and r["samples"]["decode_tok_s"]
        assert len(r["greedy_tokens"]) == 4
    # Both f32 on the same GGUF file: the same greedy tokens (a real check that they ran the same model).
    assert hf["greedy_tokens"] == ours["greedy_tokens"] and hf[AGREE_COL] == 4
    assert ours["decode_vs_minivllm"] == 1.0
    assert hf["decode_vs_minivllm"] == pytest.approx(hf["decode_tok_s_mean"] / ours["decode_tok_s_mean"])
    assert hf["prefill_vs_minivllm"] == pytest.approx(hf["prefill_tok_s_mean"] / ours["prefill_tok_s_mean"])
    llama = rows["llama.cpp"]
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        assert llama["status"].startswith(("not installed", "not importable"))
    else:
        assert llama["status"] == "ok" and llama["decode_tok_s_mean"] > 0
    assert isinstance(ours["kernels"], dict) and "gemv_max_rows" in ours["kernels"]
    # The Markdown table: a row per engine with the rates and the ratio columns.
    table = out["table"]
    header = table.splitlines()[0]
    assert PREFILL_COL in header and DECODE_COL in header and "ratio vs minivllm" in header
    lines = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "minivllm" in lines and "transformers" in lines
    assert " ± " in lines["transformers"] and md_path.read_text().count(table) == 1


def test_peers_fast_mode_row(results_dir, smollm2_path):
    """dtypes=("f32", "bf16"): a second minivllm row for the fast mode, measured in the same
    rounds, with its own kernels (the q8 GEMV where this CPU has AVX512-VNNI)."""
    pytest.importorskip("transformers")
    from minivllm.bench.peers import run
    from minivllm.kernels import cpu_gemv

    out = run(str(smollm2_path), prompt_len=16, decode_tokens=4, runs=1, threads=2, dtypes=("f32", "bf16"))
    rows = {r["engine"]: r for r in out["rows"]}
    exact, fast = rows["minivllm"], rows["minivllm bf16 (fast mode)"]
    assert fast["status"] == "ok" and fast["decode_tok_s_mean"] > 0 and fast["dtype"] == "bf16"
    assert fast["decode_vs_minivllm"] == pytest.approx(fast["decode_tok_s_mean"] / exact["decode_tok_s_mean"])
    kinds = fast["kernels"]["gemv_kinds"]
    ext = cpu_gemv.extension()
    if ext is not None and ext.has_packed_q8():
        assert any(k.startswith("cpu-q8") for k in kinds), kinds
    assert not any(k.startswith("cpu-q8") for k in exact["kernels"]["gemv_kinds"])
