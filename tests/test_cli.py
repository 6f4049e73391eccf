"""The `minivllm` command line, run as a user would: a subprocess of the installed entry point."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def _run(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "minivllm", *args], capture_output=True, text=True, timeout=300, env=env)


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
