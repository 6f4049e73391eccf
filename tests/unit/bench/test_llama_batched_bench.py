"""bench/llama_batched_bench.py: the peer's command and the parsing of its jsonl output.

The sample lines are llama-batched-bench's own format (tools/batched-bench/batched-bench.cpp
prints one JSON object per (pp, tg, pl) with these keys), with figures worked by hand:
S_TG = pl * tg / t_tg.
"""

from __future__ import annotations

import pytest

from minivllm.bench.llama_batched_bench import batched_bench_command, llama_batched_rows, parse_jsonl
from minivllm.errors import ConfigError

SAMPLE = """llama_context: n_ctx = 8448
{"n_kv_max": 8448, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": 99, "n_threads": 16, "n_threads_batch": 16}
{"pp": 128, "tg": 128, "pl": 1, "n_kv": 256, "t_pp": 0.010000, "speed_pp": 12800.000000, "t_tg": 0.500000, "speed_tg": 256.000000, "t": 0.510000, "speed": 501.960784}
{"pp": 128, "tg": 128, "pl": 8, "n_kv": 2048, "t_pp": 0.040000, "speed_pp": 25600.000000, "t_tg": 1.024000, "speed_tg": 1000.000000, "t": 1.064000, "speed": 1924.812030}
"""


def test_command_asks_for_the_issue_shape_with_room_for_every_sequence():
    cmd = batched_bench_command("/b/llama-batched-bench", "/m.gguf")
    assert cmd[cmd.index("-npp") + 1] == "128" and cmd[cmd.index("-ntg") + 1] == "128"
    assert cmd[cmd.index("-npl") + 1] == "1,8,32"
    assert int(cmd[cmd.index("-c") + 1]) >= 32 * 256  # 32 sequences of 128 + 128 tokens, unshared prompts
    assert cmd[-2:] == ["--output-format", "jsonl"] and cmd[cmd.index("-ngl") + 1] == "99"


def test_parse_keeps_result_lines_only():
    rows = parse_jsonl(SAMPLE)
    assert [r["pl"] for r in rows] == [1, 8]
    for r in rows:  # S_TG = pl * tg / t_tg
        assert r["speed_tg"] == pytest.approx(r["pl"] * r["tg"] / r["t_tg"])


def test_missing_binary_names_the_setting():
    with pytest.raises(ConfigError, match="llama_batched_bench"):
        llama_batched_rows("/nonexistent/llama-batched-bench", "/m.gguf")


def test_rows_from_a_fake_binary(tmp_path):
    fake = tmp_path / "llama-batched-bench"
    fake.write_text("#!/bin/sh\ncat <<'X'\n" + SAMPLE + "X\n")
    fake.chmod(0o755)
    rows = llama_batched_rows(str(fake), "/m.gguf")
    assert [(r["sequences"], r["decode_tok_s"], r["status"]) for r in rows] == [(1, 256.0, "ok"), (8, 1000.0, "ok")]
    assert "-npl 1,8,32" in rows[0]["command"]
