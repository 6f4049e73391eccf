"""The record of kernels that could not run here (kernels/fallbacks.py): one warning and one
entry per (kernel, key), whatever the number of failing calls, in a stable order; a bench
row timed after one is marked degraded (bench/decode.py reads `fallbacks()`).

Reference: the warnings pytest captures and the entries written out by hand.
"""

from __future__ import annotations

import warnings

import pytest

from minivllm.kernels import fallbacks


@pytest.fixture(autouse=True)
def empty(monkeypatch):
    monkeypatch.setattr(fallbacks, "_failed", {})


def test_a_failure_is_recorded_and_warned_once_per_kernel_and_key():
    assert fallbacks.fallbacks() == [] and not fallbacks.failed("repacked_gemv", ("Q4_K", 3584, "f16"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            fallbacks.record("repacked_gemv", ("Q4_K", 3584, "f16"), "cuda:0", RuntimeError("ptxas died"),
                             "Q4_K layers fall back to dequantize + cuBLAS")
        fallbacks.record("tiled_gemv_swiglu", ("Q4_K", 3584, "f16"), "cuda:0", ValueError("x"), "unfused")
    assert [str(w.message).split(" (")[0] for w in caught] == [
        "Triton kernel repacked_gemv[Q4_K] could not run on cuda:0",
        "Triton kernel tiled_gemv_swiglu[Q4_K] could not run on cuda:0"]
    assert "ptxas died" in str(caught[0].message) and str(caught[0].message).endswith("dequantize + cuBLAS")
    assert fallbacks.failed("repacked_gemv", ("Q4_K", 3584, "f16"))
    assert not fallbacks.failed("repacked_gemv", ("Q6_K", 3584, "f16"))
    assert fallbacks.fallbacks() == ["repacked_gemv[Q4_K, 3584, f16]: RuntimeError",
                                     "tiled_gemv_swiglu[Q4_K, 3584, f16]: ValueError"]
