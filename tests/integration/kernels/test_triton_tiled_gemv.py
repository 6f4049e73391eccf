"""The tiled decode GEMV (kernels/triton/tiled_gemv.py) against the torch dequant reference.

Reference: `x.float() @ w.dequantize(float32).T` (plain torch dequantization of the
file's blocks). Every launch shape the sweep may pick (row groups per program, groups
per trip, split-K with its in-order reduction) must compute the same function; CPU
variants run Triton's interpreter at small shapes, `cuda` ones the compiled kernels at
Qwen2.5-7B shapes. Batch invariance: a row's result is the same bits whatever the batch.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_triton_gemv import assert_close_to_reference, random_weight, reference  # noqa: E402
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.gemv_configs import GemvConfig, default_config  # noqa: E402
from minivllm.kernels.repacked_layout import repack  # noqa: E402
from minivllm.kernels.triton.tiled_gemv import tiled_gemv  # noqa: E402

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")
CONFIGS = [GemvConfig(block_nb=1, block_g=8, split=1), GemvConfig(block_nb=2, block_g=4, split=3),
           GemvConfig(block_nb=4, block_g=2, split=2),
           # the tile's T axis outermost (gemv_trip_t_outer): another thread layout, the same function
           GemvConfig(block_nb=2, block_g=4, split=2, t_outer=True), GemvConfig(block_nb=1, block_g=8, t_outer=True)]


@cpu_only
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda c: f"nb{c.block_nb}-g{c.block_g}-s{c.split}{'-t_outer' if c.t_outer else ''}")
def test_matches_reference_interpreted(ggml_type, config):
    # N = 21: not a multiple of 4 rows nor of the row groups per program; K = 512: 16 groups
    # (two Q4_K/Q6_K super-blocks), so splits end inside a super-block.
    n, k = 21, 512
    w = random_weight(ggml_type, n, k, seed=41)
    rw = repack(w)
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(2, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    assert_close_to_reference(tiled_gemv(x, rw, config), reference(x, w), k)
    assert_close_to_reference(tiled_gemv(x, rw, config, bias=bias), reference(x, w) + bias, k)
    y16 = tiled_gemv(x.half(), rw, config, out_dtype=torch.float16)
    assert y16.dtype == torch.float16
    torch.testing.assert_close(
        y16.float(), reference(x.half(), w), rtol=2e-3, atol=2e-3 * reference(x, w).abs().max().item()
    )


@cpu_only
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("split", [1, 2])
def test_whole_trips_unmasked_then_a_partial_one_interpreted(ggml_type, split):
    """24 rows in row groups that fill every program (whole trips load without masks), and
    K = 768: 24 groups, so each slice ends in a partial trip of 8 groups, masked."""
    n, k = 24, 768
    w = random_weight(ggml_type, n, k, seed=48)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(49))
    config = GemvConfig(block_nb=2, block_g=16, split=split)
    assert_close_to_reference(tiled_gemv(x, repack(w), config), reference(x, w), k)
    _check_invariance(repack(w), w, k, config, "cpu")


@cpu_only
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_first_trip_loaded_early_gives_the_same_bits_interpreted(ggml_type, monkeypatch):
    """EARLY (pdl.early_weights: the first one or two trips' weight words loaded before the
    PDL wait) peels those trips off the loop: whole slices, slices shorter than a trip, partial
    last trips, both tile orders and the paired SwiGLU launch give the same bits as
    without, and the reference."""
    from minivllm.kernels.triton import tiled_gemv as tg

    n, k = 24, 768  # 24 groups: trips of 16 leave a partial one; split 4 leaves slices of 6 (< a trip)
    w = random_weight(ggml_type, n, k, seed=50)
    rw = repack(w)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(51))
    # (1, 4, 1) and the second T-outer tile: six trips a slice, so the loop runs after two
    configs = [GemvConfig(2, 16, 1), GemvConfig(2, 16, 2), GemvConfig(1, 4, 4), GemvConfig(2, 8, 2, t_outer=True),
               GemvConfig(1, 4, 1), GemvConfig(2, 4, 1, t_outer=True)]
    for early in (0, 1, 2):  # 2: slices of one trip or less take one (pdl.early_trips)
        monkeypatch.setattr(tg, "early_trips", lambda device, trips, early=early: min(early, trips))
        ys = [tg.tiled_gemv(x, rw, c) for c in configs]
        ys.append(tg.tiled_gemv_swiglu(x.half(), rw, GemvConfig(2, 16, 1), mid_dtype=torch.float16,
                                       out_dtype=torch.float16))
        if early == 0:
            plain = ys
        for c, y, y0 in zip(configs + ["paired"], ys, plain):
            assert torch.equal(y, y0), (early, c)
        for y in ys[:-1]:
            assert_close_to_reference(y, reference(x, w), k)


def _check_invariance(rw, w, k, config, device):
    gen = torch.Generator().manual_seed(43)
    batch = torch.randn(5, k, generator=gen).to(device)
    other = torch.randn(5, k, generator=gen).to(device) * 100
    full = tiled_gemv(batch, rw, config)
    for r in (0, 4):
        alone = tiled_gemv(batch[r:r + 1].contiguous(), rw, config)
        assert torch.equal(full[r], alone[0]), f"row {r}: batch of 5 differs from the row alone"
        mixed = other.clone()
        mixed[r] = batch[r]
        assert torch.equal(tiled_gemv(mixed, rw, config)[r], alone[0]), f"row {r}: depends on other rows"
    assert_close_to_reference(full, reference(batch, w), k)


@cpu_only
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("t_outer", [False, True])
def test_rows_bitwise_independent_of_batch_interpreted(ggml_type, t_outer):
    w = random_weight(ggml_type, 9, 512, seed=44)
    _check_invariance(repack(w), w, 512, GemvConfig(block_nb=2, block_g=4, split=2, t_outer=t_outer), "cpu")


def _committed_small_k_entries() -> list[tuple[str, int, dict]]:
    """The committed table's float entries whose K is the 0.5B's (896, or 4864 for its down
    projection): (type, K, config), one per distinct triple."""
    import json

    from minivllm.kernels.gemv_configs import TABLE_PATH

    seen = {}
    for profile in json.loads(TABLE_PATH.read_text()).values():
        for key, entry in profile.get("configs", {}).items():
            name, shape = key.split(":")
            k = int(shape.split("x")[1])
            if k in (896, 4864) and name in {t.name for t in TYPES}:
                seen[(name, k, tuple(sorted(entry.items())))] = (name, k, entry)
    return sorted(seen.values(), key=lambda e: (e[0], e[1], sorted(e[2].items())))


@cpu_only
@pytest.mark.parametrize("name,k,entry", _committed_small_k_entries(),
                         ids=lambda v: v if isinstance(v, (str, int)) else "-".join(f"{a}{b}" for a, b in
                                                                                  sorted(v.items())))
def test_committed_entries_at_the_small_model_widths_compute_the_gemv_interpreted(name, k, entry):
    """Each launch the committed table gives at K = 896 or 4864 (the 0.5B's rows, its down
    projection's 4864 cut into the entry's slices) computes the reference: 19 rows, K as in
    the model."""
    ggml_type = T[name]
    w = random_weight(ggml_type, 19, k, seed=57)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(58))
    assert_close_to_reference(tiled_gemv(x, repack(w), GemvConfig(**entry)), reference(x, w), k)


def test_default_config_splits_narrow_matrices_only():
    wide = default_config(18944, 3584, sm_count=132)
    narrow = default_config(512, 3584, sm_count=132)
    assert wide.split == 1 and wide.block_nb == 4
    assert narrow.split > 1
    # Each slice still has at least one loop trip of groups.
    assert (3584 // 32) // narrow.split >= narrow.block_g


SHAPES_7B = [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)]


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matches_reference_cuda(ggml_type):
    gen = torch.Generator().manual_seed(45)
    for n, k in SHAPES_7B:
        w = random_weight(ggml_type, n, k, device="cuda", seed=46)
        rw = repack(w)
        for config in (default_config(n, k), GemvConfig(block_nb=2, block_g=32, split=4, num_warps=8),
                       GemvConfig(block_nb=8, block_g=32, split=2, num_warps=8, t_outer=True)):
            x = torch.randn(2, k, generator=gen).cuda()
            ref = reference(x, w)
            assert_close_to_reference(tiled_gemv(x, rw, config), ref, k)
            y16 = tiled_gemv(x.half(), rw, config, out_dtype=torch.float16)
            torch.testing.assert_close(
                y16.float(), reference(x.half(), w), rtol=2e-3, atol=2e-3 * ref.abs().max().item()
            )


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_rows_bitwise_independent_of_batch_cuda(ggml_type):
    w = random_weight(ggml_type, 512, 3584, device="cuda", seed=47)
    _check_invariance(repack(w), w, 3584, default_config(512, 3584), "cuda")


# --- T4 (sm_75) compilation, checked without a GPU -------------------------------------

_COMPILE_FOR_SM75 = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton.tiled_gemv import _tiled_gemv_kernel, _sum_splits_kernel
planes = {0: ("*fp16", "*i32", "*i32", "*i32"), 1: ("*fp16", "*fp16", "*i32", "*i32"),
          2: ("*fp16", "*i32", "*i32", "*i32"), 3: ("*fp16", "*i32", "*i32", "*i32"),
          4: ("*fp16", "*fp16", "*u8", "*u8"), 5: ("*fp16", "*i16", "*i8", "*i8")}
import sys
target = GPUTarget("cuda", int(sys.argv[1]), 32)
out = {}
for kind, (a, b, c, e) in planes.items():
    for split in (False, True):
        for paired in (False, True):  # paired: the gate+up launch with its SwiGLU epilogue
            sig = {"x_ptr": "*fp16", "q_ptr": "*i32", "a_ptr": a, "b_ptr": b, "c_ptr": c, "e_ptr": e,
                   "bias_ptr": "*fp32", "out_ptr": "*fp32" if split else "*fp16", "M": "i32", "N": "i32",
                   "stride_xm": "i32", "stride_om": "i32", "stride_os": "i32", "G_PER_SPLIT": "i32", "N_RB": "i32",
                   "PAIR_RB": "i32", "ONES": "i32"}
            hopper = int(sys.argv[1]) >= 90
            const = {"N_GROUPS": 112, "KIND": kind, "T": 8 if kind == 3 else 4, "RR": 4, "BLOCK_NB": 4,
                     "BLOCK_G": 32, "IS_SPLIT": split, "HAS_BIAS": True, "PAIRED": paired, "ROUND": 16,
                     "PDL": hopper, "EVEN_N": split,  # both the masked and the unmasked trips
                     # the first trip's (split: first two trips') words loaded before the wait
                     "EARLY": (1 + split) * int(hopper and paired),
                     "FIXUP": False, "SPLIT": 1, "ticket_ptr": None, "final_ptr": None,  # test_split_fixup.py's
                     "T_OUTER": False}
            sig.update({k: "constexpr" for k in const})
            k = triton.compile(ASTSource(_tiled_gemv_kernel, sig, const), target=target,
                               options={"num_warps": 4, "num_stages": 2})
            out[f"tiled/{kind}/{split}/{paired}"] = k.asm["ptx"]
for paired in (False, True):
    sig = {"ws_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*fp16", "MN": "i32", "N": "i32", "stride_ws": "i32",
           "SPLIT": "constexpr", "HAS_BIAS": "constexpr", "BLOCK": "constexpr", "PAIRED": "constexpr",
           "ROUND": "constexpr", "PDL": "constexpr"}
    k = triton.compile(ASTSource(_sum_splits_kernel, sig, {"SPLIT": 4, "HAS_BIAS": True, "BLOCK": 1024,
                                                          "PAIRED": paired, "ROUND": 16,
                                                          "PDL": int(sys.argv[1]) >= 90}), target=target)
    out[f"sum_splits/{paired}"] = k.asm["ptx"]
def loads_before_wait(p):  # global loads the kernel makes before its PDL wait (None: no wait)
    i = p.find("griddepcontrol.wait")
    return p[:i].count("ld.global") if i > 0 else None
print(json.dumps({key: {"target": f".target sm_{sys.argv[1]}" in p, "bf16": "bf16" in p, "mma": "mma." in p,
                         "gdc": "griddepcontrol.wait" in p and "griddepcontrol.launch_dependents" in p,
                         "early": loads_before_wait(p)}
                  for key, p in out.items()}))
"""


@pytest.mark.parametrize("arch", ["75", "90"])
def test_tiled_kernels_compile_for_t4_sm75_and_sm90_without_bf16_or_mma(arch):
    """Every kind, split or not, plain or paired with the SwiGLU epilogue (the gate+up
    launch), and both split sums, compile for a T4 and an H100 without a device; for
    the H100 with programmatic dependent launch (kernels/triton/pdl.py) compiled in:
    nothing is loaded before the wait, except in the paired launches compiled with EARLY,
    whose first trip's quantized bits are (pdl.early_weights: words and high-bit plane),
    twice as many with EARLY=2 (the split ones here)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM75, arch], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 24 + 2
    earlies = {key: r.pop("early") for key, r in result.items()}
    for key, r in result.items():
        early = earlies[key]
        assert r == {"target": True, "bf16": False, "mma": False, "gdc": arch == "90"}, key
        if arch == "75":
            assert early is None, key  # no PDL on a T4: no wait to load before
        elif key.startswith("tiled/") and key.endswith("/True"):  # paired, compiled with EARLY
            assert early >= 1, key
        else:
            assert early == 0, key
    if arch == "90":
        for kind in range(6):  # EARLY=2 (split) loads both trips' words before the wait
            one, two = (earlies[f"tiled/{kind}/{split}/True"] for split in (False, True))
            assert two == 2 * one, (kind, one, two)
        # the high-bit planes come early too (pdl.early_weights): Q5_0 loads more there than
        # Q4_0, Q6_K more than Q4_K (same tile, same words a trip)
        assert earlies["tiled/2/False/True"] > earlies["tiled/0/False/True"]
        assert earlies["tiled/5/False/True"] > earlies["tiled/4/False/True"]


@pytest.mark.parametrize("arch", ["75", "90"])
@pytest.mark.parametrize("t_outer", [False, True])
def test_tiled_gemv_loads_its_weights_16_bytes_at_a_time(arch, t_outer):
    """scripts/gemv_sass.py compiles the kernel as a real launch specializes it (aligned
    pointers) and counts its K loop's SASS: each thread's tile words must arrive in
    128-bit loads (Q4_K: 4 a trip of 16 words; Q8_0: 8 a trip of 32), the layout's whole
    point. A change that breaks the vector loads (a non-contiguous row axis, an offset
    Triton cannot prove aligned) quadruples the load instructions; this fails then."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "gemv_sass.py"), "--arch", arch, "--types",
                           "Q4_K,Q8_0", "--config", "4,32,1,4,2"] + (["--t-outer"] if t_outer else []),
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[1:-1]]
            for r in proc.stdout.splitlines() if r.startswith("| Q")}
    # 4 row groups x 32 groups x 4 rows x (Q4_K: 4 words, Q8_0: 8 words) over 128 threads
    assert rows["Q4_K"][5] == "4 x 16 B", rows
    assert rows["Q8_0"][5] == "8 x 16 B", rows
    assert 2.0 < float(rows["Q4_K"][4]) < 12.0, rows  # a loop was found and it is the K loop, not a tail
