"""The synthetic Qwen2.5-7B Q4_K_M writer (minivllm/bench/synthetic_model.py).

References, all independent of the writer:
* the published Qwen2.5-7B numbers (model card / config.json: hidden 3584, intermediate
  18944, 28 layers, 28 heads / 4 KV heads, vocab 152064, untied head; 7.61B parameters,
  6.53B without the embeddings; the Q4_K_M file is 4.68 GB);
* llama.cpp's Q4_K_M rule, written out here as the layer list it gives for 28 layers;
* a real Qwen2.5 GGUF (the 0.5B model): the same tensor names and shapes for its sizes;
* gguf-py's numpy dequantization for the random blocks; the real file's tokenizer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import quants as gq
from synthetic_gguf import minivllm_logits

from minivllm.bench.synthetic_model import (
    QWEN25_7B,
    SyntheticSpec,
    T,
    plan_tensors,
    q4_k_blocks,
    q6_k_blocks,
    scaled_down,
    write_synthetic_model,
)
from minivllm.errors import ConfigError
from minivllm.gguf.reader import GGUFFile

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 3584, 18944, 28, 28, 4, 152064
Q6_K_LAYERS = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27}  # use_more_bits(i, 28) in llama-quant.cpp


def test_full_size_plan_matches_published_qwen25_7b():
    plan = {t.name: t for t in plan_tensors(QWEN25_7B)}
    head_dim = HIDDEN // HEADS
    expected = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        expected.update(
            {
                p + "attn_norm.weight": (HIDDEN,),
                p + "ffn_norm.weight": (HIDDEN,),
                p + "attn_q.weight": (HIDDEN, HIDDEN),
                p + "attn_q.bias": (HIDDEN,),
                p + "attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                p + "attn_k.bias": (KV_HEADS * head_dim,),
                p + "attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                p + "attn_v.bias": (KV_HEADS * head_dim,),
                p + "attn_output.weight": (HIDDEN, HIDDEN),
                p + "ffn_gate.weight": (FFN, HIDDEN),
                p + "ffn_up.weight": (FFN, HIDDEN),
                p + "ffn_down.weight": (HIDDEN, FFN),
            }
        )
    assert {n: t.shape for n, t in plan.items()} == expected
    n_params = sum(math.prod(t.shape) for t in plan.values())
    assert 7.61e9 <= n_params < 7.62e9  # "7.61B"
    assert round((n_params - 2 * VOCAB * HIDDEN) / 1e9, 2) == 6.53  # "Non-Embedding: 6.53B"
    for name, t in plan.items():
        if name.endswith(("norm.weight", "bias")):
            want = T.F32
        elif name == "output.weight":
            want = T.Q6_K
        elif name.endswith(("attn_v.weight", "ffn_down.weight")):
            want = T.Q6_K if int(name.split(".")[1]) in Q6_K_LAYERS else T.Q4_K
        else:
            want = T.Q4_K
        assert t.ggml_type == want, name
    assert sum(t.nbytes for t in plan.values()) == pytest.approx(4.68e9, rel=0.01)


def test_plan_names_and_shapes_match_a_real_qwen2_file(qwen05_path):
    """Same naming and orientation as llama.cpp's converter, checked on the 0.5B file's sizes."""
    with GGUFFile(qwen05_path) as gf:
        real = {name: t.shape for name, t in gf.tensors.items()}
    spec = SyntheticSpec(name="qwen05-sizes", n_layers=24, d_model=896, n_heads=14, n_kv_heads=2, d_ff=4864,
                         vocab_size=151936)
    assert {t.name: t.shape for t in plan_tensors(spec)} == real


@pytest.mark.parametrize("qtype, make", [(T.Q4_K, q4_k_blocks), (T.Q6_K, q6_k_blocks)])
@pytest.mark.parametrize("std", [0.0167, 0.00727])
def test_random_blocks_decode_to_the_requested_spread(qtype, make, std):
    blocks = make(np.random.default_rng(1), 4096, std)
    values = gq.dequantize(blocks, qtype)
    assert np.isfinite(values).all()
    assert values.std() == pytest.approx(std, rel=0.03)
    assert abs(values.mean()) < 0.02 * std


def test_write_refuses_rows_that_are_not_whole_k_quant_blocks(tmp_path, qwen05_path):
    with pytest.raises(ConfigError, match="d_model"):
        write_synthetic_model(tmp_path / "x.gguf", scaled_down(d_model=896, n_heads=7, n_kv_heads=1),
                              tokenizer_source=qwen05_path)
    assert not list(tmp_path.iterdir())


def test_scaled_down_file_loads_and_generates(tmp_path, qwen05_path):
    """All 28 layers (so activations must stay finite through the full depth), small widths."""
    from minivllm.engine.llm import LLM
    from minivllm.gguf.tokenizer import Tokenizer
    from minivllm.sampling.sampling_params import SamplingParams

    spec = scaled_down(name="tiny", d_model=256, n_heads=2, n_kv_heads=1, d_ff=512)
    path = write_synthetic_model(tmp_path / "tiny.gguf", spec, tokenizer_source=qwen05_path)
    assert not path.with_name(path.name + ".partial").exists()

    with GGUFFile(path) as gf:
        written = {name: (t.shape, t.ggml_type) for name, t in gf.tensors.items()}
        assert gf.get("general.file_type") == 15 and gf.get("tokenizer.chat_template").startswith("{%- if tools %}")
    assert written == {t.name: (t.shape, t.ggml_type) for t in plan_tensors(spec)}

    tok = Tokenizer.from_gguf(GGUFFile(path))
    real_tok = Tokenizer.from_gguf(GGUFFile(qwen05_path))
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 你好 <|im_start|>"
    assert tok.encode(text) == real_tok.encode(text)
    assert tok.vocab_size == VOCAB and tok.decode([VOCAB - 1]) == ""  # padding rows decode to nothing

    llm = LLM(str(path), progress=False, max_model_len=64)
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and all(0 <= t < VOCAB for t in out.token_ids)

    ids = tok.encode("Once upon a time, in a land far away,")
    ours = minivllm_logits(llm.model, ids)
    assert torch.isfinite(ours).all()
    assert 0.1 < float(ours.std()) < 100  # unit-spread by construction: neither vanished nor blown up
