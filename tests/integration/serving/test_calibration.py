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


def test_calibration_measures_the_context_term_where_a_long_context_fits(llm, monkeypatch):
    from minivllm.serving import calibration

    timed = []  # (prompt lengths, median step seconds) of every decode measurement
    real = calibration._decode_step_s

    def spy(engine, prompts, decode_steps):
        step_s = real(engine, prompts, decode_steps)
        timed.append(([len(p) for p in prompts], step_s))
        return step_s

    monkeypatch.setattr(calibration, "_decode_step_s", spy)
    rates = calibrate(llm.engine, decode_steps=4, long_context=1024)
    assert rates.known and rates.source == "calibration"
    assert rates.calibration_context == 128
    # the term is the documented formula over the two batch-1 measurements, 128 and 1024 tokens
    short = next(s for lengths, s in timed if lengths == [128])
    long = next(s for lengths, s in timed if lengths == [1024])
    assert math.isclose(1 / rates.decode_points[1], short, rel_tol=1e-12)
    assert math.isclose(rates.context_s, max(0.0, (long - short) / (1024 - 128)), rel_tol=1e-9, abs_tol=1e-15)
    assert not llm.engine.has_unfinished()
    free_equals_total(llm.engine)


def test_calibration_leaves_the_term_out_when_no_long_context_fits(llm):
    rates = calibrate(llm.engine, decode_steps=4, long_context=256)  # < 4 x 128: not measured
    assert rates.known and rates.context_s == 0.0 and rates.calibration_context == 128
