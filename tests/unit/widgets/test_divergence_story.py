"""The explorer's sentences (widgets/divergence_story.py) against hand-computed numbers:
the magnitude in words, one token numbering, the slider's start, infinite margins."""

from __future__ import annotations

import math

from test_chart_data import _report

from minivllm.obs.machine import numerics_differences, same_cpu_numerics
from minivllm_widgets.divergence_story import (
    magnitude_words,
    starting_position,
    summary_sentence,
)
from minivllm_widgets.divergence_views import layers_html, tokens_html, topk_html


def test_magnitude_words_name_the_rounding_level():
    assert magnitude_words(4.6e-6).startswith("4.6e-06, at the level of float32 rounding")
    assert magnitude_words(1.2e-3).startswith("about 0.12%, at the level of float16 rounding")
    assert magnitude_words(0.023).startswith("about 2.3%, at the level of bfloat16 rounding")
    assert magnitude_words(0.4).startswith("about 40%: more than rounding")
    assert magnitude_words(0.0).startswith("identical") and magnitude_words(math.nan) == "not measured"


def test_the_summary_states_the_largest_drawn_difference_in_words():
    # hand-computed: the largest whole-prefix relative L2 the chart draws is layer 1's 2.6e-2
    report = _report([2.0, 0.5], [2.0, 0.5], split=None,
                     layer_values=[("embedding", 0.0, 0.0), ("layer 0", 4.6e-6, 1e-5), ("layer 1", 2.6e-2, 3e-2)])
    text = summary_sentence(report)
    assert "The runs agree on all 2 generated tokens" in text
    assert "closest call was generated token 2" in text and "a margin of 0.5 logits" in text
    assert "about 2.6%, at the level of bfloat16 rounding" in text and "after layer 1" in text
    f32 = _report([2.0], [2.0], split=None, layer_values=[("layer 0", 4.6e-6, 1e-5)])
    assert "4.6e-06, at the level of float32 rounding" in summary_sentence(f32)  # not the same shape as bf16


def test_one_numbering_in_sentence_chips_and_topk():
    report = _report([3.0, 2.0, 0.1, 1.0], [3.0, 2.0, 0.2, 1.0], split=2)
    report.records[2].b.token_id = 9
    text = summary_sentence(report)
    assert "at generated token 3 side a picks" in text
    assert "first divergence at generated token 3" in tokens_html(report)
    assert "top-k logits at generated token 3" in topk_html(report, 2)
    assert starting_position(report) == 2  # the slider opens at the split


def test_slider_starts_at_the_closest_call_without_a_split():
    report = _report([3.0, 0.01, 2.0], [3.0, 0.01, 2.0], split=None)
    assert starting_position(report) == 1


def test_a_constrained_split_never_says_inf():
    report = _report([2.0], [math.inf], split=0)
    report.records[0].b.token_id = 9
    text = summary_sentence(report)
    assert "inf" not in text.replace("infinite", "") and "only token allowed" in text
    assert text.startswith("The runs part at once: at generated token 1")
    assert "the per-layer replay did not run" in layers_html(report)  # not "no divergence"


def test_machine_lines_show_only_what_differs():
    here = {"cpu": "EPYC", "isa": ["avx2", "avx512f", "avx512_bf16"], "torch": "2.5", "torch_cpu_capability": "avx512",
            "blas": "mkl", "torch_threads": 2}
    there = {**here, "isa": ["avx2", "avx512f"]}
    assert numerics_differences(here, there) == [
        "isa: only the first has avx512_bf16; only the second has nothing more"
    ]
    assert not same_cpu_numerics(here, there) and numerics_differences(here, dict(here)) == []
