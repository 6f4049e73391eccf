"""`minivllm bench plot`: every figure draws a valid PNG from result files shaped like the
drivers' own, a figure without a result file is skipped and reported, the newest file by
the stamp in its name is the one drawn, and a missing matplotlib gives the install hint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from minivllm.bench import plots  # noqa: E402
from minivllm.cli.main import main  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(results: Path, name: str, stamp: str, rows: list[dict] | None = None, **top) -> Path:
    """A result file as results.write_results writes it: <name>-<stamp>.json."""
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}-{stamp}.json"
    data = {"benchmark": name, "provenance": {"commit": f"c-{stamp}", "device": "test-cpu (2 threads)",
                                              "date": "2026-12-01T00:00:00+00:00", "settings": {}}}
    if rows is not None:
        data["rows"] = rows
    data.update(top)
    path.write_text(json.dumps(data))
    return path


def _mean_std(key: str, mean: float, std: float = 1.0) -> dict:
    return {f"{key}_mean": mean, f"{key}_std": std, f"{key}_median": mean}


def _gemv_rows(scale: float = 1.0) -> list[dict]:
    return [{"concurrency": n, **_mean_std("sequential_tok_s", 10 * scale), **_mean_std("gemm_tok_s", 8 * n * scale),
             **_mean_std("gemv_tok_s", 12 * n * scale), **_mean_std("batch_invariant_tok_s", 9 * n * scale)}
            for n in (1, 2, 4, 8)]


def _routing_rows() -> list[dict]:
    return [{"burst": b, "policy": p, **_mean_std("completion_s", b * k)}
            for b in (8, 48) for p, k in (("forced-fastest", 2.0), ("cost", 1.5))]


def _engine_rows(**extra) -> list[dict]:
    return [{"engine": "minivllm", "status": "ok", **extra, **_mean_std("prefill_tok_s", 2000.0, 10.0),
             **_mean_std("decode_tok_s", 50.0, 0.5)},
            {"engine": "transformers", "status": "ok", **extra, **_mean_std("prefill_tok_s", 800.0, 20.0),
             **_mean_std("decode_tok_s", 30.0, 0.3)},
            {"engine": "llama.cpp (llama-cpp-python)", "status": "not installed (pip install llama-cpp-python)"}]


def _serve_summary(ttft: float) -> dict:
    return {"ttft_ms": {"median": ttft, "p99": 3 * ttft}, "tpot_ms": {"median": ttft / 10, "p99": ttft / 5}}


def _every_kind(results: Path) -> dict[str, Path]:
    """One result file per figure, rows as each driver writes them; figure name -> file."""
    stamp = "20261201T120000Z"
    spec = [{"table": "greedy", "case": c, "prompt": p, "policy": c, "tok_s_mean": v, "tok_s_std": 0.1,
             "speedup_e2e": v / 3.0} for p in ("code", "creative") for c, v in (("target-only", 3.0), ("fixed-4", 4.0))]
    spec += [{"table": "sampling", "case": c, "prompt": "creative", "policy": pol, "tv_budget": tv,
              "tok_s_mean": v, "tok_s_std": 0.1}
             for c, pol, tv, v in (("target-only", None, 0.0, 3.0), ("fixed:8 TV=0", "fixed:8", 0.0, 1.0),
                                   ("fixed:8 TV=1", "fixed:8", 1.0, 2.0), ("draft-only", "draft-only", 0.0, 7.0))]
    prefix = [{"table": "warm-prefix", "overlap_pct": pct, "ttft_off_s": 0.06, "ttft_off_s_std": 0.01,
               "ttft_on_s": 0.06 - pct / 5000, "ttft_on_s_std": 0.005} for pct in (0, 50, 100)]
    prefix += [{"table": "cold-burst", "strategy": s, "requests": 4, **_mean_std("mean_ttft_s", v, 0.01)}
               for s, v in (("cache off", 0.2), ("single-flight after_prefill", 0.05))]
    prefix += [{"table": "single-flight", "requests": n, "release": rel, **_mean_std("mean_ttft_s", v * n, 0.01)}
               for n in (2, 8) for rel, v in (("independent", 0.1), ("at_completion", 0.5), ("after_prefill", 0.03))]
    offline_runs = [{"run": i, "output_tok_s": 40.0 + i, "total_tok_s": 90.0 + i} for i in (1, 2, 3)]
    offline_runs.append(
        {"run": "mean ± std (n=3)", **_mean_std("output_tok_s", 42.0), **_mean_std("total_tok_s", 92.0)}
    )
    dtype_rows = [{"dtype": dt, **_mean_std("ttft_ms", 25.0), **_mean_std("decode_tok_s", v), "peak_mib": mib,
                   "after_load_mib": mib / 4, "memory_method": "torch.cuda.max_memory_allocated"}
                  for dt, v, mib in (("f32", 190.0, 840.0), ("f16", 170.0, 620.0), ("bf16", 165.0, 620.0))]
    gpu = {f"h200-{name}": _write(results, f"h200-{name}-smollm2-135m", stamp, rows) for name, rows in (
        ("paged-vs-contiguous", [{"decode_tokens": 512, **_mean_std("paged_decode_tok_s", 250.0),
                                  **_mean_std("contiguous_decode_tok_s", 249.0)}]),
        ("peers-gpu", [{"batch": 64, "engine": e, **_mean_std("output_tok_s", v)}
                       for e, v in (("minivllm", 4000.0), ("transformers", 3000.0))]),
        ("offline", offline_runs),
        ("activation-dtype", dtype_rows),
        ("decode", _engine_rows(device="cuda:0", dtype="f16")))}
    return {
        **gpu,
        "activation-dtype": _write(results, "activation-dtype-smollm2-135m-cpu", stamp, dtype_rows),
        "gemv-threshold": _write(results, "gemv-threshold-smollm2-135m", stamp, _gemv_rows()),
        "h200-gemv-threshold": _write(results, "h200-gemv-threshold-smollm2-135m", stamp, _gemv_rows(20.0)),
        "continuous-batching": _write(
            results,
            "continuous-batching-smollm2-135m",
            stamp,
            [
                {"concurrency": n, **_mean_std("batched_tok_s", 9.0 * n), **_mean_std("sequential_tok_s", 9.5)}
                for n in (1, 2, 4)
            ],
        ),
        "paged-vs-contiguous": _write(
            results,
            "paged-vs-contiguous-smollm2-135m",
            stamp,
            [
                {
                    "decode_tokens": n,
                    **_mean_std("paged_decode_tok_s", 9.7),
                    **_mean_std("contiguous_decode_tok_s", 9.8),
                }
                for n in (128, 512)
            ],
        ),
        "prefix-cache": _write(results, "prefix-cache-smollm2-135m-cuda", stamp, prefix),
        "speculative-greedy": _write(results, "speculative-a-from-b-cpu", stamp, spec),
        "routing": _write(results, "routing-smollm2-135m", stamp, _routing_rows()),
        "h200-routing": _write(results, "h200-routing-qwen", stamp, _routing_rows()),
        "peers": _write(results, "peers-smollm2-135m", stamp, _engine_rows()),
        "peers-gpu": _write(
            results,
            "peers-gpu-smollm2-135m",
            stamp,
            [
                {"batch": b, "engine": e, **_mean_std("output_tok_s", b * k)}
                for b in (1, 8, 32)
                for e, k in (("minivllm", 100.0), ("transformers", 60.0))
            ],
        ),
        "decode": _write(results, "decode-smollm2-135m", stamp, _engine_rows(device="cpu", dtype="f32")),
        "offline": _write(results, "offline-smollm2-135m", stamp, offline_runs),
        "serve": _write(
            results,
            "serve-compare-minivllm-vs-other",
            stamp,
            None,
            targets=[
                {"label": "minivllm", "summary": _serve_summary(50.0)},
                {"label": "other", "summary": _serve_summary(80.0)},
            ],
        ),
    }


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert 1000 < len(data) < 100_000, (path, len(data))


def test_every_figure_draws_a_png_from_driver_shaped_rows(tmp_path):
    results, out = tmp_path / "results", tmp_path / "plots"
    sources = _every_kind(results)
    # A per-server file of the same `bench serve` run (same stamp): the comparison is drawn.
    _write(results, "serve-minivllm", "20261201T120000Z", None, label="minivllm", summary=_serve_summary(50.0))
    drawn, skipped = plots.plot_all(results, out, progress=None)
    assert not skipped, [(s.figure.name, s.reason) for s in skipped]
    assert {d.figure.name for d in drawn} == {f.name for f in plots.FIGURES}
    by_name = {d.figure.name: d for d in drawn}
    for d in drawn:
        assert d.png == out / f"{d.figure.name}.png"
        _assert_png(d.png)
    # speculative-tv-budget and prefix-cache-single-flight draw other tables of the same files
    assert by_name["speculative-tv-budget"].source == sources["speculative-greedy"]
    assert by_name["prefix-cache-single-flight"].source == sources["prefix-cache"]
    for name, source in sources.items():
        assert by_name[name].source == source, name
    index = (out / "index.md").read_text()
    assert all(f"]({f.name}.png)" in index for f in plots.FIGURES)
    assert "(../results/serve-compare-minivllm-vs-other-20261201T120000Z.json)" in index


def test_missing_inputs_are_skipped_and_reported(tmp_path, capsys):
    results, out = tmp_path / "results", tmp_path / "plots"
    _write(results, "routing-smollm2-135m", "20261201T070130Z", _routing_rows())
    # the right prefix but not rows the figure draws (a GPU peers file for the CPU figure)
    _write(results, "peers-gpu-smollm2-135m", "20261201T070130Z", [{"batch": 1, "engine": "minivllm"}])
    drawn, skipped = plots.plot_all(results, out)
    assert [d.figure.name for d in drawn] == ["routing"]
    skipped_names = {s.figure.name for s in skipped}
    assert skipped_names == {f.name for f in plots.FIGURES} - {"routing"}
    printed = capsys.readouterr().out
    assert "skipped gemv-threshold: no gemv-threshold-*.json" in printed
    assert "skipped peers:" in printed and "wrote " in printed
    assert sorted(p.name for p in out.iterdir()) == ["index.md", "routing.png"]
    index = (out / "index.md").read_text()
    assert "- serve: no serve-*.json" in index and "- gemv-threshold:" in index


def test_the_newest_file_by_its_stamp_is_drawn(tmp_path):
    results, out = tmp_path / "results", tmp_path / "plots"
    # The older file sorts last by name and is touched last: only the stamp says which is newer.
    newer = _write(results, "gemv-threshold-aaa", "20261201T000001Z", _gemv_rows(2.0))
    older = _write(results, "gemv-threshold-zzz", "20261130T235959Z", _gemv_rows())
    os.utime(older, (newer.stat().st_mtime + 100, newer.stat().st_mtime + 100))
    drawn, _ = plots.plot_all(results, out, progress=None)
    (gemv,) = [d for d in drawn if d.figure.name == "gemv-threshold"]
    assert gemv.source == newer
    index = (out / "index.md").read_text()
    assert newer.name in index and older.name not in index


def test_stamp_key_reads_the_names_the_drivers_write():
    assert plots.stamp_key(Path("decode-qwen2.5-coder-0.5b-h200-20261130.json")) == ("20261130", "000000")
    assert plots.stamp_key(Path("decode-smollm2-135m-20261130T221127Z.json")) == ("20261130", "221127")
    assert plots.stamp_key(Path("serve-minivllm-20261201T010203Z-2.json")) == ("20261201", "010203")
    assert plots.stamp_key(Path("notes.json")) == ("", "")
    assert plots.stamp_key(Path("a-20261130.json")) < plots.stamp_key(Path("b-20261130T000001Z.json"))


def test_without_matplotlib_the_error_names_the_fix(tmp_path, monkeypatch, capsys):
    results, out = tmp_path / "results", tmp_path / "plots"
    _write(results, "routing-smollm2-135m", "20261201T070130Z", _routing_rows())
    # None in sys.modules makes the import fail, as on a machine without the package
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(plots.MatplotlibMissing, match=r"pip install 'minivllm\[bench\]'"):
        plots.plot_all(results, out)
    assert main(["bench", "plot", "--results", str(results), "--out", str(out)]) == 1
    assert "pip install 'minivllm[bench]'" in capsys.readouterr().err
    assert not out.exists()


def test_cli_entry_point(tmp_path):
    results, out = tmp_path / "results", tmp_path / "plots"
    _write(results, "routing-smollm2-135m", "20261201T070130Z", _routing_rows())
    proc = subprocess.run([sys.executable, "-m", "minivllm", "bench", "plot", "--results", str(results),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"wrote {out / 'routing.png'}" in proc.stdout and "skipped serve" in proc.stdout
    _assert_png(out / "routing.png")
    assert "routing-smollm2-135m-20261201T070130Z.json" in (out / "index.md").read_text()
