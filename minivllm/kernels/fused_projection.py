"""Projections of one input in one weight: a layer's Q/K/V, its gate/up (GPU path).

Why: a decode step launched one GEMV per projection, 7 per layer; on Qwen2.5-0.5B the
small ones (896 x 896, 128 x 896) are launch- and latency-bound, so a 0.5B step was
mostly launches (benchmarks/results/h100-gemv-sweep-sm90-20261205.md, issue 41). Here
the projections that share a quantization type and K are concatenated along the output
rows at load, in the repacked layout: one weight, one launch, the outputs handed back
as views of one tensor, the biases concatenated the same way. The separate
`QuantLinear`s stay (the model's structure, the CPU-side helpers, debug hooks), their
planes now views of the fused weight's rows, so the device holds one copy.

Gate and up, fused, also take SwiGLU: at one activation row (decode) and in batch-
invariant mode the tiled GEMV's epilogue computes silu(g) * u from the same program's
gate and up rows (`tiled_gemv.tiled_gemv_swiglu`), so the swiglu kernel and the gate/up
output round trip go; other row counts (the several-rows kernel, cuBLAS) run the fused
GEMV and the swiglu kernel over its two halves.

In Q4_K_M files V and down are Q6_K in some layers (llama.cpp's `use_more_bits`) and Q4_K
in the others, so a layer fuses what matches: Q|K|V, or Q|K with V alone. Same
arithmetic per row as the separate calls with the same launch shape (the rows never meet
in a sum); the launch shape comes from the fused shape's row of the GPU table
(`gemv_configs.lookup`, nearest measured N until a sweep measures it).

`MINIVLLM_FUSED_PROJECTIONS=0` (read at load) keeps the separate weights: the A/B switch.
`MINIVLLM_FOLD_SPLIT_SUM=0` (read per forward) keeps the split-K sum of the o- and
down-projections in its own launch instead of inside the next add_rms_norm, and the
Q|K(|V) GEMV's in its own launch even where MINIVLLM_FOLD_QKV_SUM=1 would fold it into
rope_qk (`qk_v_outputs`; opt-in, it lost on an H100).
"""

from __future__ import annotations

import os

import torch

from minivllm.kernels import fallbacks
from minivllm.kernels.linear import QuantLinear
from minivllm.obs.trace import trace_scope

FUSED_PROJECTIONS_ENV = "MINIVLLM_FUSED_PROJECTIONS"
# The o- and down-projections' split-K partials summed inside the next add_rms_norm, the
# fused Q|K(|V)'s inside rope_qk (`triton/split_sum.py`), instead of by their GEMV's second
# launch; read per forward.
FOLD_SPLIT_SUM_ENV = "MINIVLLM_FOLD_SPLIT_SUM"
# 1: the fused Q|K(|V)'s split sum folded into RoPE too (`qk_v_outputs`); read per forward.
# Off by default: it lost at h100-s58 (7B batch-1 decode 340.1 tok/s with it against 348.7
# without, the 0.5B level at 1,240.7 / 1,241.2): RoPE's two programs a row then read every
# slice of the partials (74 KB of float32 for the 7B's Q|K|V split 4) where the sum kernel
# spreads them over programs. RoPE now gives partials 4 query heads a program
# (`fused._PARTIAL_Q_HEADS`): untimed, so the fold stays opt-in until a GPU A/B says.
FOLD_QKV_SUM_ENV = "MINIVLLM_FOLD_QKV_SUM"


def fusion_enabled() -> bool:
    return os.environ.get(FUSED_PROJECTIONS_ENV, "1") != "0"


def fold_split_sum_enabled() -> bool:
    return os.environ.get(FOLD_SPLIT_SUM_ENV, "1") != "0"


def fold_qkv_sum_enabled() -> bool:
    """Whether a forward folds the fused Q|K(|V)'s split sum into RoPE (both switches on)."""
    return fold_split_sum_enabled() and os.environ.get(FOLD_QKV_SUM_ENV, "0") == "1"


def qk_v_outputs(q: QuantLinear, k: QuantLinear, v: QuantLinear, x: torch.Tensor):
    """(the fused Q|K or Q|K|V GEMV's output, V's) for `triton.fused.rope_qk_partials`,
    each a split GEMV's unsummed partials where its GEMV splits K (`QuantLinear.partials`);
    V's is the first one itself where Q|K|V share the weight. None where q and k do not
    share one: the caller projects them as usual (`project_many`). The caller asks only
    where `fold_qkv_sum_enabled()`, read once a forward."""
    group = q.fused
    if group is None or group.parts[:2] != (q, k):
        return None
    if group.parts == (q, k, v):
        qk = group.linear.partials(x)
        return qk, qk
    if group.parts == (q, k) and v.fused is None:
        return group.linear.partials(x), v.partials(x)
    return None


def _can_share(a: QuantLinear, b: QuantLinear) -> bool:
    ra, rb = a.repacked, b.repacked
    return (ra is not None and rb is not None and ra.ggml_type == rb.ggml_type and ra.shape[1] == rb.shape[1]
            and a.compute_dtype == b.compute_dtype and a.out_dtype == b.out_dtype and ra.device == rb.device
            and a._default_options is b._default_options and a.fused is None and b.fused is None)


def fusable_runs(linears) -> list[tuple[QuantLinear, ...]]:
    """The linears in order, as runs that can share one weight (same type, K and dtypes,
    each a whole number of 4-row groups); a run of one stays alone."""
    runs: list[list[QuantLinear]] = []
    for lin in linears:
        rw = lin.repacked
        whole = rw is not None and rw.shape[0] % 4 == 0
        if runs and whole and _can_share(runs[-1][-1], lin) and runs[-1][-1].repacked.shape[0] % 4 == 0:
            runs[-1].append(lin)
        else:
            runs.append([lin])
    return [tuple(r) for r in runs]


class FusedProjection:
    """Several `QuantLinear`s of one input as one weight (see the module docstring)."""

    def __init__(self, parts: tuple[QuantLinear, ...], name: str):
        from minivllm.kernels.repacked_layout import concat_rows
        from minivllm.kernels.triton.repacked_gemv import RepackedQuantizedWeight

        self.parts = parts
        self.name = name
        self.sizes = [p.out_features for p in parts]
        first = parts[0]
        fused = concat_rows([p.repacked for p in parts], name)
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([p.bias if p.bias is not None else torch.zeros(n, device=fused.device)
                              for p, n in zip(parts, self.sizes)]).float()
        self.linear = QuantLinear(RepackedQuantizedWeight(fused), bias, options=first._default_options,
                                  compute_dtype=first.compute_dtype, name=name, out_dtype=first.out_dtype)
        row = 0
        for p, n in zip(parts, self.sizes):  # the parts' own planes go: views of the fused rows
            p.take_rows_of(fused, row, self)
            row += n

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[part(x) for part in parts], as views of one (M, sum N) output."""
        return list(self.linear(x).split(self.sizes, dim=1))

    def swiglu(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """silu(gate(x)) * up(x) in float32, rounded once to `out_dtype` (parts: gate, up)."""
        lin = self.linear
        y = self._swiglu_epilogue(x, out_dtype)
        if y is not None:
            return y
        from minivllm.kernels.triton.fused import swiglu

        gu = lin(x)
        half = self.sizes[0]
        return swiglu(gu[:, :half], gu[:, half:], out_dtype)

    def _swiglu_epilogue(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
        """The gate+up GEMV with SwiGLU in its epilogue, where the separate call would run
        the tiled kernel (one row, or batch-invariant mode); None elsewhere or where the
        kernel failed to compile here (then the fused GEMV and the swiglu kernel, warned once)."""
        from minivllm.kernels.triton.repacked_gemv import tiled_config

        lin = self.linear
        path = lin.path(x.shape[0])
        if (path == "gemm" or x.shape[0] == 0 or self.sizes[0] != self.sizes[1]
                or fallbacks.failed(_EPILOGUE, lin.kernel_key())):
            return None
        config = tiled_config(x, lin.repacked, invariant=path == "gemv-invariant")
        if config is None or not lin.kernel_usable():
            return None
        from minivllm.kernels.triton.mma_gemv import mma_gemv_applies
        from minivllm.kernels.triton.tiled_gemv import tiled_gemv_swiglu

        if mma_gemv_applies(x, lin.repacked):  # opt-in: the tensor-core GEMV, then the swiglu kernel
            return None

        lin.options.path_counts[path] += 1
        with trace_scope("qmatmul", self.name, path=path, epilogue="swiglu"):
            try:
                # x as the separate GEMVs take it (the kernel reads any float dtype)
                return tiled_gemv_swiglu(x, lin.repacked, config, mid_dtype=lin.compute_dtype, out_dtype=out_dtype,
                                         bias=lin.bias)
            except Exception as exc:  # a Triton compile/launch failure on this GPU
                lin.options.path_counts[path] -= 1
                fallbacks.record(_EPILOGUE, lin.kernel_key(), x.device, exc,
                                 "gate+up take the GEMV then the swiglu kernel")
                return None


_EPILOGUE = "tiled_gemv_swiglu"


def fuse_projections(linears, name: str) -> list[FusedProjection]:
    """Fuse each run of `fusable_runs(linears)` longer than one (nothing when
    MINIVLLM_FUSED_PROJECTIONS=0); the linears of a run then read the fused weight."""
    if not fusion_enabled():
        return []
    groups = []
    for run in fusable_runs(linears):
        if len(run) > 1:
            groups.append(FusedProjection(run, "+".join(p.name for p in run) if len(run) < len(linears) else name))
    return groups


def project_swiglu(gate: QuantLinear, up: QuantLinear, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """silu(gate(x)) * up(x) (float32 math, rounded once to out_dtype) on the GPU path: one
    launch where gate and up are fused, else the two GEMVs and the swiglu kernel."""
    group = gate.fused
    if group is not None and group.parts == (gate, up):
        return group.swiglu(x, out_dtype)
    from minivllm.kernels.triton.fused import swiglu

    return swiglu(gate(x), up(x), out_dtype)
