"""Peers of the benchmark suite: llama-cpp-python's server under `bench serve --start-peer`,
and the refusals of the GPU batched-generation comparison (`bench peers --inference-device
cuda:N`) on a machine it cannot run on.

The real serve comparison needs llama-cpp-python built from its sdist (`make peers`); it is
skipped where that has not been done (CI does not build it: minutes of C++ on two cores).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from minivllm.errors import ConfigError

pytestmark = pytest.mark.timeout(600)


def _llama_server_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None
               for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings"))


def test_start_peer_without_llama_cpp_names_the_fix(monkeypatch):
    from minivllm.bench import llama_cpp_server

    real = importlib.util.find_spec
    monkeypatch.setattr(llama_cpp_server.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        llama_cpp_server.check_installed()
    assert "llama_cpp" in str(err.value) and "make peers" in str(err.value)


def test_start_peer_needs_a_started_server_and_a_known_peer():
    from minivllm.bench.serve_load import run

    with pytest.raises(ValueError, match="--start-server"):
        run(urls=["http://127.0.0.1:9"], start_peer="llama-cpp-python", write=False, progress=False)
    with pytest.raises(ValueError, match="only peer"):
        run(start_server="smollm2-135m", start_peer="vllm", write=False, progress=False)


def test_gpu_peers_refuse_a_cpu_device():
    from minivllm.bench.peers_gpu import run

    with pytest.raises(ConfigError, match="CUDA"):
        run("smollm2-135m", "cpu")


def test_gpu_peers_prompts_are_distinct_and_exact(smollm2_path):
    from minivllm.bench.peers_gpu import batch_prompts
    from minivllm.gguf.reader import GGUFFile
    from minivllm.gguf.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(smollm2_path))
    prompts = batch_prompts(tok, 5, 40)
    assert [len(p) for p in prompts] == [40] * 5
    assert len({tuple(p) for p in prompts}) == 5  # no two identical: no accidental prefix-cache wins


@pytest.mark.skipif(not _llama_server_installed(), reason="llama-cpp-python[server] not installed (make peers)")
def test_serve_minivllm_and_llama_cpp_server_same_run(results_dir, smollm2_path):
    from minivllm.bench.serve_load import LoadSettings, run

    settings = LoadSettings(num_prompts=4, request_rate=float("inf"), max_concurrency=2, input_len=16, output_len=4)
    out = run(settings=settings, start_server=str(smollm2_path), inference_devices=["cpu:1"],
              start_peer="llama-cpp-python", peer_threads=1, out_dir=results_dir, progress=False)
    labels = [t["label"] for t in out["targets"]]
    assert labels == ["minivllm", "llama-cpp-python"]
    for t in out["targets"]:
        s = t["summary"]
        assert s["completed"] == 4 and s["failed"] == 0, (t["label"], s["errors"])
        assert s["total_output_tokens"] == 16 and s["output_len_mismatch"] == 0  # min_tokens holds EOS back
        assert len(t["provenance"]["model_sha256"]) == 64
    peer = out["targets"][1]["target"]
    assert "llama_cpp.server" in " ".join(peer["started_here"]) and "--n_threads" in peer["started_here"]
    compare = [f for f in out["files"] if "serve-compare-minivllm-vs-llama-cpp-python" in f and f.endswith(".json")]
    assert compare and json.loads(open(compare[0]).read())["labels"] == labels
