"""`bench decode --llama-bench PATH` (minivllm/bench/llama_bench.py): llama.cpp's llama-bench
on the same file in the same run, its raw figures, command and commit in the peer row,
and ratio_vs_llama_cpp on minivllm's GPU rows. A fake llama-bench (a script printing
llama-bench's JSON for the arguments it got) stands in for the CUDA build."""

from __future__ import annotations

import stat
import sys

import pytest

from minivllm.bench.llama_bench import add_ratios, llama_bench_command, llama_bench_rows
from minivllm.errors import ConfigError

FAKE = r'''#!{python}
import json, sys
a = sys.argv[1:]
get = lambda flag: a[a.index(flag) + 1]
assert get("-ngl") == "99" and get("-o") == "json"
p, n = int(get("-p")), int(get("-n"))
depths = [int(d) for d in get("-d").split(",")]
out = []
for d in depths:
    out.append(dict(build_commit="{commit}", gpu_info="FakeGPU", n_prompt=p, n_gen=0, n_depth=d,
                    avg_ts=1000.0 - d, stddev_ts=5.0, model_filename=get("-m")))
    out.append(dict(build_commit="{commit}", gpu_info="FakeGPU", n_prompt=0, n_gen=n, n_depth=d,
                    avg_ts=300.0 - d / 100, stddev_ts=1.0, model_filename=get("-m")))
print(json.dumps(out))
sys.exit({code})
'''


def _fake(tmp_path, commit="abc123", code=0):
    path = tmp_path / "llama-bench"
    path.write_text(FAKE.format(python=sys.executable, commit=commit, code=code))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_peer_row_carries_raw_figures_command_and_commit(tmp_path):
    (row,) = llama_bench_rows(_fake(tmp_path), tmp_path / "m.gguf", 512, 128, repetitions=3)
    assert row["status"] == "ok" and row["engine"] == "llama.cpp-cuda"
    assert row["prefill_tok_s_median"] == 1000.0  # pp512 at depth 0
    assert row["decode_tok_s_median"] == pytest.approx(300.0 - 5.12)  # tg128 after the 512-token prompt
    assert row["decode_tok_s_from_empty_context"] == 300.0
    assert row["llama_cpp_commit"] == "abc123" and row["gpu_info"] == "FakeGPU"
    assert row["llama_bench_command"].endswith("-p 512 -n 128 -d 0,512 -r 3 -o json")
    assert row["raw"]["tg_after_prompt"]["n_depth"] == 512


def test_unknown_build_commit_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_COMMIT", "0c1e570")
    (row,) = llama_bench_rows(_fake(tmp_path, commit="unknown"), "m.gguf", 64, 16)
    assert row["llama_cpp_commit"] == "0c1e570"


def test_ratios_on_gpu_rows_only(tmp_path):
    rows = [{"engine": "minivllm", "device": "cuda:0", "status": "ok", "decode_tok_s_median": 147.5,
             "prefill_tok_s_median": 2000.0},
            {"engine": "minivllm", "device": "cpu", "status": "ok", "decode_tok_s_median": 40.0,
             "prefill_tok_s_median": 100.0}]
    rows += llama_bench_rows(_fake(tmp_path), "m.gguf", 512, 128)
    add_ratios(rows)
    assert rows[0]["ratio_vs_llama_cpp"] == pytest.approx(147.5 / (300.0 - 5.12))
    assert rows[0]["ratio_vs_llama_cpp_prefill"] == pytest.approx(2.0)
    assert rows[0]["llama_cpp_command"] == rows[2]["llama_bench_command"]
    assert "ratio_vs_llama_cpp" not in rows[1]


def test_failures_are_rows_that_say_why(tmp_path):
    (row,) = llama_bench_rows(_fake(tmp_path, code=3), "m.gguf", 512, 128)
    assert row["status"].startswith("failed: llama-bench exit 3")
    with pytest.raises(ConfigError, match="llama-bench"):
        llama_bench_rows(str(tmp_path / "missing"), "m.gguf", 512, 128)
    assert llama_bench_command("lb", "f.gguf", 8, 4, 2) == ["lb", "-m", "f.gguf", "-ngl", "99", "-p", "8", "-n", "4",
                                                            "-d", "0,8", "-r", "2", "-o", "json"]


def test_cli_accepts_the_flag():
    from minivllm.cli.main import build_parser

    args = build_parser().parse_args(["bench", "decode", "--llama-bench", "/x/llama-bench"])
    assert args.llama_bench == "/x/llama-bench"
