"""The exact Qwen2.5-0.5B Q4_K_M synthetic layout (bench/synthetic_model.py: QWEN25_05B).

Rows of 896 elements are not whole k-quant super-blocks, so llama.cpp falls back to
Q5_0 / Q8_0 there; the layers with extra bits follow the quantizer's lexicographic
tensor order. Checked against the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file when it
is cached, and against its recorded type table always.
"""

from __future__ import annotations

import json
import lzma

import gguf.quants as gq
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from minivllm.bench.synthetic_model import QWEN25_05B, plan_tensors, q5_0_blocks, q8_0_blocks
from minivllm.gguf.reader import GGUFFile

# From the real file: layers whose attn_v is Q8_0 and ffn_down Q6_K (the rest Q5_0 / Q4_K).
MORE_BITS = [0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21]


def test_plan_types_are_the_published_q4_k_m_recipe():
    plan = {t.name: t for t in plan_tensors(QWEN25_05B)}
    assert plan["token_embd.weight"].ggml_type == T.Q5_0 and plan["output.weight"].ggml_type == T.Q8_0
    for i in range(24):
        more = i in MORE_BITS
        assert plan[f"blk.{i}.attn_v.weight"].ggml_type == (T.Q8_0 if more else T.Q5_0)
        assert plan[f"blk.{i}.ffn_down.weight"].ggml_type == (T.Q6_K if more else T.Q4_K)
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert plan[f"blk.{i}.{name}.weight"].ggml_type == T.Q5_0
    assert sum(t.nbytes for t in plan.values()) == 485_452_288


def test_plan_equals_the_real_file(qwen05_path):
    with GGUFFile(qwen05_path) as gf:
        real = {n: (tuple(i.shape), i.ggml_type) for n, i in gf.tensors.items()}
    assert {t.name: (tuple(t.shape), t.ggml_type) for t in plan_tensors(QWEN25_05B)} == real


@pytest.mark.parametrize("qtype, make", [(T.Q5_0, q5_0_blocks), (T.Q8_0, q8_0_blocks)])
def test_legacy_random_blocks_decode_to_the_requested_spread(qtype, make):
    std = 1 / 896 ** 0.5
    values = gq.dequantize(make(np.random.default_rng(2), 4096, std), qtype)
    assert np.isfinite(values).all()
    assert values.std() == pytest.approx(std, rel=0.03)
    assert abs(values.mean()) < 0.06 * std


def test_tokenizer_fields_from_json_xz(tmp_path, qwen05_path):
    """The writer takes the tokenizer from a JSON (.json.xz) of `tokenizer.*` fields too,
    the form that travels to an offline GPU machine."""
    from minivllm.bench.synthetic_model import _tokenizer_fields

    fields = _tokenizer_fields(qwen05_path)
    path = tmp_path / "fields.json.xz"
    plain = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fields.items()}
    with lzma.open(path, "wt", encoding="utf-8") as f:
        json.dump(plain, f)
    again = _tokenizer_fields(path)
    assert set(again) == set(fields)
    assert again["tokenizer.ggml.tokens"] == list(fields["tokenizer.ggml.tokens"])
    assert np.array_equal(again["tokenizer.ggml.token_type"], fields["tokenizer.ggml.token_type"])
    assert again["tokenizer.ggml.token_type"].dtype == np.int32
