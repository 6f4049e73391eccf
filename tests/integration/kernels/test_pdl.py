"""Programmatic dependent launch (kernels/triton/pdl.py).

Which launches get PDL is checked against the rule (sm_90+ only, unless turned off, never
on the T4 profile, never on the CPU path). On an sm_90+ GPU the decode of a small
synthetic Qwen2 file, CUDA graphs on, gives the same logits bit for bit and the same
greedy tokens with PDL as without, solo, batched and batch-invariant: a kernel that read
its producer's output before the producer finished would change them, and the compiled
kernels are checked to have been launched with PDL at all. The same again with the GEMV's
first trip's weights loaded before its wait (MINIVLLM_GEMV_EARLY_LOAD=1).
"""

from __future__ import annotations

import pytest
import torch
from triton_devices import INTERPRETED  # noqa: F401  (sets TRITON_INTERPRET before any kernel module loads)

from minivllm.kernels.gpu_profile import PROFILE_ENV  # noqa: E402
from minivllm.kernels.triton import pdl  # noqa: E402

ON = {"PDL": True, "launch_pdl": True}


@pytest.fixture
def fresh(monkeypatch):
    pdl.reset()
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield monkeypatch
    pdl.reset()


def _as_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_on_by_default_and_off_when_asked(fresh):
    _as_gpu(fresh, (9, 0))
    fresh.delenv(pdl.PDL_ENV, raising=False)
    assert pdl.pdl_args(torch.device("cuda", 0)) == ON
    fresh.setenv(pdl.PDL_ENV, "0")
    pdl.reset()
    assert pdl.pdl_args(torch.device("cuda", 0)) == {}


def test_on_when_asked_on_sm90_and_later(fresh):
    fresh.setenv(pdl.PDL_ENV, "1")
    for cap in ((9, 0), (10, 0)):
        _as_gpu(fresh, cap)
        pdl.reset()
        assert pdl.pdl_args(torch.device("cuda", 0)) == ON, cap


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 9)])
def test_never_before_hopper(fresh, capability):
    fresh.setenv(pdl.PDL_ENV, "1")
    _as_gpu(fresh, capability)
    assert pdl.pdl_args(torch.device("cuda", 0)) == {}


def test_never_on_the_t4_profile_or_the_cpu_path(fresh):
    fresh.setenv(pdl.PDL_ENV, "1")
    _as_gpu(fresh, (9, 0))
    fresh.setenv(PROFILE_ENV, "sm75")
    assert pdl.pdl_args(torch.device("cuda", 0)) == {}
    fresh.delenv(PROFILE_ENV)
    pdl.reset()
    assert pdl.pdl_args(torch.device("cuda", 0)) == ON  # the check that each case below can fail
    assert pdl.pdl_args(torch.device("cpu")) == {}
    fresh.setenv("TRITON_INTERPRET", "1")
    pdl.reset()
    assert pdl.pdl_args(torch.device("cuda", 0)) == {}


def test_gemv_early_load_only_when_asked_and_with_pdl(fresh):
    """The GEMV's first trip loaded before its wait: on by default where PDL is on (timed at
    h100-s57), off under MINIVLLM_GEMV_EARLY_LOAD=0, never on the CPU or a T4."""
    _as_gpu(fresh, (9, 0))
    gpu = torch.device("cuda", 0)
    fresh.setenv(pdl.PDL_ENV, "1")
    fresh.setenv(pdl.EARLY_ENV, "0")
    assert pdl.early_weights(gpu) == 0
    fresh.delenv(pdl.EARLY_ENV, raising=False)
    pdl.reset()
    assert pdl.early_weights(gpu) == 1 and pdl.early_weights(torch.device("cpu")) == 0
    fresh.setenv(pdl.PDL_ENV, "0")  # no PDL: nothing starts before its producer ends
    pdl.reset()
    assert pdl.early_weights(gpu) == 0
    _as_gpu(fresh, (7, 5))
    fresh.setenv(pdl.PDL_ENV, "1")
    pdl.reset()
    assert pdl.early_weights(gpu) == 0


def test_gemv_early_trips_are_a_bounded_count(fresh):
    """MINIVLLM_GEMV_EARLY_LOAD=2 holds two trips before the wait; a launch never takes more
    trips than its slice has; anything but 0, 1 or 2 is refused by name."""
    _as_gpu(fresh, (9, 0))
    gpu = torch.device("cuda", 0)
    fresh.setenv(pdl.PDL_ENV, "1")
    fresh.setenv(pdl.EARLY_ENV, "2")
    pdl.reset()
    assert pdl.early_weights(gpu) == 2
    assert pdl.early_trips(gpu, 7) == 2 and pdl.early_trips(gpu, 1) == 1
    for bad in ("3", "yes", "-1"):
        fresh.setenv(pdl.EARLY_ENV, bad)
        pdl.reset()
        with pytest.raises(ValueError, match="MINIVLLM_GEMV_EARLY_LOAD"):
            pdl.early_weights(gpu)


def _launched_with_pdl(kernel) -> bool:
    """Whether any compiled variant of a Triton kernel carries launch_pdl (Triton 3.6's
    JITFunction.device_caches: (kernel cache, ...) per device)."""
    return any(getattr(k.metadata, "launch_pdl", False)
               for caches in kernel.device_caches.values() for k in caches[0].values())


needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                  reason="programmatic dependent launch needs an sm_90+ GPU")


@pytest.mark.cuda
@needs_hopper
def test_decode_with_pdl_gives_the_same_bits(tiny_qwen_gguf, monkeypatch):
    from conftest import TINY_QWEN_PROMPTS
    from synthetic_gguf import minivllm_logits

    from minivllm.engine.llm import LLM
    from minivllm.kernels.triton.fused import _add_rms_norm_kernel
    from minivllm.kernels.triton.paged_attention import _paged_attention_split_kernel
    from minivllm.kernels.triton.tiled_gemv import _tiled_gemv_kernel
    from minivllm.sampling.sampling_params import SamplingParams

    monkeypatch.delenv(PROFILE_ENV, raising=False)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    runs = {}
    # "1": PDL alone; "early": PDL with the GEMV's first trip loaded before its wait (the
    # default); "early2": its first two trips (opt-in)
    for flag in ("0", "1", "early", "early2"):
        monkeypatch.setenv(pdl.PDL_ENV, "0" if flag == "0" else "1")
        monkeypatch.setenv(pdl.EARLY_ENV, {"early": "1", "early2": "2"}.get(flag, "0"))
        pdl.reset()
        llm = LLM(str(tiny_qwen_gguf), progress=False, max_model_len=256, device="cuda", dtype="f16")
        ids = llm.tokenizer.encode(TINY_QWEN_PROMPTS[2])
        inv = llm.fork(batch_invariant=True)
        runs[flag] = (minivllm_logits(llm.model, ids),
                      [o.token_ids for o in llm.generate(TINY_QWEN_PROMPTS * 3, params)],
                      [o.token_ids for o in inv.generate(TINY_QWEN_PROMPTS, params)],
                      [llm.generate([p], params)[0].token_ids for p in TINY_QWEN_PROMPTS])
        del llm, inv
        torch.cuda.empty_cache()
    for kernel in (_tiled_gemv_kernel, _add_rms_norm_kernel, _paged_attention_split_kernel):
        assert _launched_with_pdl(kernel), kernel.__name__
    (logits0, toks0, inv0, solo0), (logits1, toks1, inv1, solo1) = runs["0"], runs["1"]
    assert torch.equal(logits0, logits1)
    assert toks0 == toks1 and inv0 == inv1 and solo0 == solo1
    logits2, toks2, inv2, solo2 = runs["early"]
    assert torch.equal(logits0, logits2) and toks0 == toks2 and inv0 == inv2 and solo0 == solo2
    logits3, toks3, inv3, solo3 = runs["early2"]
    assert torch.equal(logits0, logits3) and toks0 == toks3 and inv0 == inv3 and solo0 == solo3
    assert toks1[:3] == toks1[3:6] == toks1[6:]  # the same prompt thrice in one batch: the same tokens
