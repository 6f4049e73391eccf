"""`bench activation-dtype` on the real small model (a child process per dtype), the dtype
checks, and `common.runs_until_stable`'s stopping rule with scripted measurements."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PROVENANCE_KEYS  # the results_dir fixture is in conftest too

from minivllm.bench.common import runs_until_stable
from minivllm.errors import ConfigError


def test_driver_rows_memory_and_agreement(results_dir, smollm2_path):
    from minivllm.bench.activation_dtype import run

    # 40 prompt tokens: two full 16-token KV pages that a prefix cache could hand the timed run
    rows = run(str(smollm2_path), "cpu", ["f32", "f16"], prompt_tokens=40, max_tokens=4, repeats=1, threads=2)
    (path,) = results_dir.glob("activation-dtype-*-cpu-*.json")
    assert path.with_name(path.name[:-5] + ".md").exists()
    data = json.loads(path.read_text())
    assert PROVENANCE_KEYS <= set(data["provenance"]) and len(data["provenance"]["model_sha256"]) == 64
    settings = data["provenance"]["settings"]
    assert settings["dtypes"] == ["f32", "f16"] and settings["prompt_tokens"] == 40
    assert settings["decode_tokens"] == 4 and settings["repeats"] == 1 and settings["threads"] == 2
    assert data["rows"] == json.loads(json.dumps(rows))
    f32, f16 = data["rows"]
    for r in (f32, f16):
        assert r["status"] == "ok" and r["runs"] == 1 and r["runs_info"]["stopped"] == "stable"
        assert r["ttft_ms_median"] > 0 and r["decode_tok_s_median"] > 0 and len(r["tokens"]) == 4
        assert r["cached_prompt_tokens"] == 0  # the warm-up's pages were not reused: TTFT is a whole prefill
        assert r["peak_mib"] >= max(r["load_peak_mib"], r["generate_peak_mib"]) > 0
        assert r["load_peak_mib"] >= r["after_load_mib"] > 0  # resident after the load, peak during it
        assert "VmHWM" in r["memory_method"] or "ru_maxrss" in r["memory_method"]
    assert f32["same_tokens_as_f32"] == 4 and 0 <= f16["same_tokens_as_f32"] <= 4
    assert f32["decode/f32"] == 1 and f16["ttft/f32"] == pytest.approx(f16["ttft_ms_median"] / f32["ttft_ms_median"])
    assert f16["kv_pool_mib"] == pytest.approx(f32["kv_pool_mib"] / 2)  # K/V are stored in the activation dtype


def test_an_unknown_dtype_is_refused_by_name(results_dir, smollm2_path):
    from minivllm.bench.activation_dtype import run

    with pytest.raises(ConfigError, match="'f8'.*f32, f16, bf16"):
        run(str(smollm2_path), "cpu", ["f32", "f8"], prompt_tokens=16, max_tokens=4, repeats=1)
    assert not list(results_dir.iterdir())  # refused before any child ran


def test_bf16_below_sm80_is_refused_with_the_fix(monkeypatch):
    from minivllm.bench.activation_dtype import checked_dtypes

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    t4 = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="activation_dtype='bf16'.*sm_80.*--activation-dtype f16"):
        checked_dtypes(t4, ["f32", "bf16"])
    assert checked_dtypes(t4, None) == ["f32", "f16"]  # the default: what the device supports
    assert checked_dtypes(torch.device("cpu"), ["float16", "f16", "bf16"]) == ["f16", "bf16"]


def test_decode_max_repeats_below_repeats_is_refused():
    from minivllm.bench.decode import run

    with pytest.raises(ConfigError, match="max_repeats"):
        run("smollm2-135m", ["cpu"], ["f32"], repeats=3, max_repeats=2)


# --- runs_until_stable -------------------------------------------------------------------


def _scripted(values):
    it = iter(values)
    return lambda: next(it)


def test_stops_at_min_runs_when_stable():
    out = runs_until_stable(_scripted([100.0, 101.0, 99.0, 500.0]), min_runs=3, max_runs=10)
    assert out.samples == [100.0, 101.0, 99.0] and out.stopped == "stable" and out.cv <= 0.05
    assert out.info() == {"runs": 3, "min_runs": 3, "max_runs": 10, "cv": out.cv, "cvs": [out.cv],
                          "cv_target": 0.05, "stopped": "stable"}


def test_keeps_going_while_the_cv_is_high():
    # Mean 105 throughout; sample std 8.66 after 3 runs (CV 0.082), then 7.07, 6.12, 5.48
    # (CV 0.052 at run 6) and 5.00 at run 7: CV 0.048, the first under 5%.
    values = [100.0, 115.0, 100.0] + [105.0] * 10
    out = runs_until_stable(_scripted(values), min_runs=3, max_runs=12, cv_target=0.05)
    assert out.runs == 7 and out.stopped == "stable" and out.cv == pytest.approx(5 / 105)


def test_stops_at_max_runs():
    out = runs_until_stable(_scripted([100.0, 200.0] * 10), min_runs=3, max_runs=5)
    assert out.runs == 5 and out.stopped == "max_runs" and out.cv > 0.05


def test_dict_samples_and_several_series():
    dicts = [{"tok_s": v, "ttft": 1.0} for v in (50.0, 50.0, 50.0)]
    assert runs_until_stable(_scripted(dicts), key="tok_s").runs == 3
    # One round of two engines per sample: the second engine is noisy, so rounds go on.
    rounds = [(10.0, 10.0), (10.0, 20.0), (10.0, 10.0), (10.0, 20.0)]
    out = runs_until_stable(_scripted(rounds), min_runs=2, max_runs=4, key=lambda r: list(r))
    assert out.runs == 4 and out.cvs[0] == 0 and out.cvs[1] > 0.05 and out.stopped == "max_runs"


def test_one_run_is_enough_when_one_is_asked_for():
    assert runs_until_stable(_scripted([3.0, 9.0]), min_runs=1, max_runs=3).runs == 1  # no spread to see yet


def test_max_runs_below_min_runs_is_an_error():
    with pytest.raises(ValueError, match="max_runs"):
        runs_until_stable(_scripted([1.0]), min_runs=3, max_runs=2)
