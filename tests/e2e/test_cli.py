"""The `minivllm` command line, run as a user would: a subprocess of the installed entry point."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def _run(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "minivllm", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_generate_streams_a_greedy_completion(smollm2_path):
    from minivllm import LLM, SamplingParams

    expected = LLM(str(smollm2_path), progress=False).generate(
        "The capital of France is", SamplingParams(temperature=0.0, max_tokens=12))[0].text
    r = _run("generate", "--model", str(smollm2_path), "--max-tokens", "12", "--quiet", "The capital of France is")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is" + expected + "\n"


def test_generate_chat_uses_the_template(smollm2_path):
    r = _run("generate", "--model", str(smollm2_path), "--chat", "--max-tokens", "24", "--quiet",
             "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "<|im_" not in r.stdout


def test_unknown_model_is_one_clear_line():
    r = _run("generate", "--model", "no-such-model", "hello")
    assert r.returncode == 2
    assert "unknown model 'no-such-model'" in r.stderr and "smollm2-135m" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_gpu_request_without_gpu_is_one_clear_line(smollm2_path):
    r = _run("generate", "--model", str(smollm2_path), "--inference-device", "gpu", "hello")
    assert r.returncode == 2 and "--inference-device cpu" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.cuda
def test_generate_on_gpu_matches_cpu_greedy(smollm2_path):
    cpu = _run("generate", "--model", str(smollm2_path), "--max-tokens", "16", "--quiet", "Once upon a time")
    gpu = _run("generate", "--model", str(smollm2_path), "--inference-device", "gpu", "--max-tokens", "16",
               "--quiet", "Once upon a time")
    assert cpu.returncode == 0 and gpu.returncode == 0, gpu.stderr
    assert gpu.stdout == cpu.stdout


def test_models_list_names_the_default():
    r = _run("models", "list")
    assert r.returncode == 0 and "smollm2-135m *" in r.stdout and "qwen2.5-coder-0.5b" in r.stdout


def test_generate_with_a_draft_model_prints_the_target_text_and_the_speculation_stats(smollm2_path):
    """SmolLM2 drafting for itself: greedy output equal to the plain run's, 100% acceptance.

    Both sides in batch-invariant mode: a verify round scores several rows at once and the
    draft one at a time, which round differently in the default mode (a near-tie may then
    flip, on some CPUs and not others); bit-identity across those paths is that mode's contract."""
    from minivllm import LLM, SamplingParams

    expected = LLM(str(smollm2_path), progress=False, batch_invariant=True).generate(
        "The capital of France is", SamplingParams(temperature=0.0, max_tokens=12))[0].text
    r = _run("generate", "--model", str(smollm2_path), "--draft-model", str(smollm2_path), "--draft-policy", "fixed:3",
             "--batch-invariant", "--max-tokens", "12", "The capital of France is")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is" + expected + "\n"
    assert "[speculative: fixed:3, tv_budget 0.0]" in r.stderr and "(100.0%)" in r.stderr, r.stderr


def test_a_draft_with_another_vocabulary_is_one_clear_line(smollm2_path, qwen05_path):
    r = _run("generate", "--model", str(qwen05_path), "--draft-model", str(smollm2_path), "--max-tokens", "4",
             "--quiet", "Hi")
    assert r.returncode == 2 and "draft_model" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_generate_and_bench_need_no_serve_extra(smollm2_path):
    """A plain install (no [serve] extra: no uvicorn, fastapi, h11 or prometheus-client, as
    a Kaggle `--no-deps` install may leave it) still generates; only `serve` needs them."""
    blocker = (
        "import sys, runpy\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('uvicorn', 'fastapi', 'starlette', 'h11', 'prometheus_client'):\n"
        "            raise ImportError('not installed: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv = ['minivllm'] + sys.argv[1:]\n"
        "runpy.run_module('minivllm', run_name='__main__')\n")
    for args in (["generate", "--model", str(smollm2_path), "--max-tokens", "3", "--quiet", "Hi"], ["bench", "--help"]):
        r = subprocess.run([sys.executable, "-c", blocker, *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (args, r.stderr[-2000:])
