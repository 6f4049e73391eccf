"""A worker's start-up calibration on a real engine (SmolLM2-135M, CPU): the context term
is measured where a context 4x calibration's fits, and left out where it does not.

Speed itself is not asserted (benchmarks measure speed); what is checked is what the
rates are made of: the calibration context, a finite non-negative context term, and an
engine left as a user finds it (no requests, every page free).
"""

from __future__ import annotations

import math

import pytest

from minivllm.serving.calibration import calibrate
from tests.engine_invariants import free_equals_total


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from minivllm import LLM

    return LLM(str(smollm2_path), device="cpu", max_model_len=2048, progress=False)


def test_calibration_measures_the_context_term_where_a_long_context_fits(llm):
    rates = calibrate(llm.engine, decode_steps=4, long_context=1024)
    assert rates.known and rates.source == "calibration"
    assert rates.calibration_context == 128
    assert math.isfinite(rates.context_s) and rates.context_s >= 0.0
    assert not llm.engine.has_unfinished()
    free_equals_total(llm.engine)


def test_calibration_leaves_the_term_out_when_no_long_context_fits(llm):
    rates = calibrate(llm.engine, decode_steps=4, long_context=256)  # < 4 x 128: not measured
    assert rates.known and rates.context_s == 0.0 and rates.calibration_context == 128
