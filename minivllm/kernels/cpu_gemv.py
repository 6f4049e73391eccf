"""The compiled f32 GEMV over GGUF blocks (cpu_gemv.cpp), built once per machine.

`extension()` returns the loaded module, or None when it cannot be had: not x86-64 with
AVX2/FMA/F16C, no C++ compiler, or the build failed. `unavailable_reason()` then says
why, and the caller runs the pure-torch float32 path instead (the dequantized matrix
through the float32 BLAS), which is slower but computes the same thing.

The build goes through `torch.utils.cpp_extension.load_inline`, which caches the shared
library in torch's extensions directory (TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions) keyed by the source text, so only the first process on a
machine compiles (about half a minute on two cores). The instruction set is chosen here
from the CPU's flags: AVX-512 (F + BW) when present, else AVX2 + FMA + F16C.

Measurements behind the choice (moved here from ARCHITECTURE.md):

What was tried for the GEMV, and what each gave (SmolLM2's Q4_1 `ffn_up`, 1536 x 576, one
thread, process CPU time on the shared 2-core machine): the C++ extension 41-63 µs;
`torch.compile` of the same dequantize-and-multiply in torch ops 435 µs (and 30 s of
compilation per shape); numba (`prange` over rows, float32 sums without fastmath, scales
pre-converted since numba has no float16) 1233 µs; torch's int4 pack (bf16, the old
default) about 1.5x the extension's time over a whole token (14.0 vs 9.2 ms for all 211
projections). So the extension it is, with the torch code as the fallback.
Batch-1 decode on SmolLM2 at one thread went from 28 to 14.5 ms of CPU time per step
(profiled: what remains is mostly Python and small torch ops between the kernels).

The fast mode (`cpu_gemv="q8"`, chosen by `dtype="bfloat16"` on a CPU) is the second
source, cpu_gemv_q8.cpp, in the same module: activations rounded to int8 per block of 32
(llama.cpp's q8 activations) and each block's products summed exactly in int32 by
vpdpbusd. On AVX512-VNNI it reads Q4_0/Q4_1/Q5_0 weights repacked (`pack_q8`: nibbles,
scales and fifth bits in separate planes, two blocks per 512-bit register, four
accumulators per row); elsewhere a portable AVX2/AVX-VNNI kernel reads the file's blocks
(measured with the AVX2 build on the same CPU, which has AVX-VNNI: Q5_0 1.5x the float32
kernel, Q4_1 1.0x, Q8_0 0.83x).
Measured per call at one thread on SmolLM2's decode shapes (AMD EPYC, AVX-512): fused
Q/K/V 26 -> 15 us, o 16 -> 9, gate/up 78 -> 38, down 38 -> 16 (float32 kernel -> packed
q8). Q8_0 weights keep the float32 kernel in the fast mode: it already streams them at
the memory's speed (45 GB/s at two threads), and the portable q8 kernel was slower on
them (0.6x). Those per-call figures are with the weights in cache; in decode every weight
streams from memory once per token, and there the packed kernel first lost (SmolLM2's 30
layers, DRAM-resident: 6.4 ms vs 5.4-6.1 one thread, 4.1 vs 3.5 ms two threads) until
both kernels prefetched the row four ahead: float32 3.5 -> 3.1-3.2 ms, q8 4.1 -> 2.4-2.55 ms
at two threads (4.3 vs 5.2 ms at one). End-to-end numbers: benchmarks/README.md, "Peers
measured side by side".
"""

from __future__ import annotations

import os
import platform
import shutil
import threading
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

_T = GGMLQuantizationType

# The types cpu_gemv.cpp decodes (keep in sync with its `pick`).
F32_GEMV_TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q8_0, _T.Q4_K, _T.Q6_K})

_SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
_Q8_SOURCE = Path(__file__).with_name("cpu_gemv_q8.cpp")  # the int8-activation GEMV, same module

# The types cpu_gemv_q8.cpp takes (keep in sync with its `pick`); the others run the
# float32 kernel when the q8 mode is asked for.
Q8_GEMV_TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q8_0})
_LOCK = threading.Lock()
_STATE: dict = {}  # "module", "reason", "isa": filled on the first call


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _isa() -> tuple[str | None, list[str]]:
    """(name, compiler flags) of the widest instruction set the kernel has for this CPU."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, []
    flags = _cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        return None, []
    base = ["-mavx2", "-mfma", "-mf16c"]
    if {"avx512f", "avx512bw"} <= flags and os.environ.get("MINIVLLM_CPU_GEMV_ISA", "") != "avx2":
        # VNNI: the q8 GEMV's byte dot products in one instruction (else AVX2's two).
        vnni = ["-mavx512vl", "-mavx512vnni"] if {"avx512vl", "avx512_vnni"} <= flags else []
        return "avx512", base + ["-mavx512f", "-mavx512bw", *vnni]
    return "avx2", base + (["-mavxvnni"] if "avx_vnni" in flags else [])


def extension():
    """The compiled module (functions `gemv`, `supports`, `vector_width`), or None."""
    if "reason" in _STATE:
        return _STATE.get("module")
    with _LOCK:
        if "reason" not in _STATE:
            _STATE["module"], _STATE["reason"] = _build()
    return _STATE["module"]


def unavailable_reason() -> str | None:
    """Why `extension()` is None (None when it loaded)."""
    extension()
    return _STATE["reason"]


def isa() -> str | None:
    """The instruction set the loaded kernel was built for ("avx512", "avx2"), or None."""
    return _STATE.get("isa") if extension() is not None else None


def _build():
    if os.environ.get("MINIVLLM_CPU_GEMV", "") == "torch":
        return None, "disabled by MINIVLLM_CPU_GEMV=torch"
    name, flags = _isa()
    if name is None:
        return None, "the CPU lacks AVX2/FMA/F16C (or is not x86-64)"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return None, "no C++ compiler on PATH (install g++, as `make setup` does)"
    # The VNNI flags only serve the q8 kernel: a compiler too old for them (-mavxvnni needs
    # GCC 11) gets a second try without, rather than losing the float32 kernel too.
    attempts = [flags] + ([[f for f in flags if "vnni" not in f]] if any("vnni" in f for f in flags) else [])
    for i, attempt in enumerate(attempts):
        try:
            return _load(name, attempt), None
        except Exception as err:  # a compiler error, a missing header, a read-only cache dir
            if i + 1 == len(attempts):
                return (
                    None,
                    f"building the extension failed: {type(err).__name__}: {str(err).strip().splitlines()[-1:]}",
                )


def _load(name: str, flags: list[str]):
    from torch.utils.cpp_extension import load_inline

    ext_name = _extension_name(name, flags)
    _remove_stale_lock(ext_name)
    module = load_inline(
        name=ext_name,
        cpp_sources=[_SOURCE.read_text(), _Q8_SOURCE.read_text()],
        functions=[
            "gemv",
            "gemv_q8",
            "attend_decode",
            "attend_decode_slots",
            "rms_norm_f32",
            "rope_f32",
            "supports",
            "supports_q8",
            "gemv_q8_packed",
            "has_packed_q8",
            "vector_width",
        ],
        extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", *flags],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    _STATE["isa"] = name
    return module


def _extension_name(isa_name: str, flags: list[str]) -> str:
    """A cache name per ISA, source, flags and torch install. Two virtual environments
    (two torch include paths) sharing one name would rebuild each other's module in the
    shared cache directory on every first load, and could race on its lock."""
    import hashlib

    key = "\0".join(
        [_SOURCE.read_text(), _Q8_SOURCE.read_text(), *flags, torch.__version__, os.path.dirname(torch.__file__)]
    )
    return f"minivllm_cpu_gemv_{isa_name}_{hashlib.sha256(key.encode()).hexdigest()[:10]}"


# A build takes about 40 s on two cores; a lock file older than this was left by a build
# that was killed (Ctrl-C, OOM, a test timeout), and torch would wait on it forever.
_STALE_LOCK_S = 600


def _remove_stale_lock(ext_name: str) -> None:
    import time
    import warnings

    try:  # torch's own rule for the directory (a private helper: if it moves, skip the check)
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(ext_name, verbose=False)) / "lock"
    except (ImportError, TypeError):
        return
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > _STALE_LOCK_S:
        warnings.warn(f"removing {lock}: a build of the CPU kernels left it {age:.0f} s ago and did not finish",
                      stacklevel=3)
        lock.unlink(missing_ok=True)


def gemv(x: torch.Tensor, weights: list) -> list[torch.Tensor]:
    """[x @ w.dequantize(float32).T for w in weights], in one parallel call.

    `x` is (M, K) float32 on the CPU; each weight a `QuantizedWeight` of a type in
    F32_GEMV_TYPES with the same K. Needs `extension()` to be loaded.
    """
    return run(x, prepare(weights))


def prepare(weights: list) -> tuple:
    """The kernel's arguments for these weights, made once (callers keep them: a decode
    step makes ~120 calls, and building the lists each time costs microseconds)."""
    return ([w.raw for w in weights], [int(w.ggml_type) for w in weights], [w.shape[0] for w in weights])


def run(x: torch.Tensor, args: tuple) -> list[torch.Tensor]:
    """`gemv` with arguments from `prepare`."""
    ext = _STATE.get("module") or extension()
    return ext.gemv(x if x.is_contiguous() else x.contiguous(), *args)


def run_q8(x: torch.Tensor, args: tuple) -> list[torch.Tensor]:
    """`run` through the int8-activation kernel (cpu_gemv_q8.cpp): every weight of a type
    in Q8_GEMV_TYPES; low precision, so only where the user chose it by name."""
    ext = _STATE.get("module") or extension()
    return ext.gemv_q8(x if x.is_contiguous() else x.contiguous(), *args)


# Types the AVX512-VNNI kernel takes repacked (cpu_gemv_q8.cpp `packed_rows`).
Q8_PACKED_TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q5_0})
_BLOCK_BYTES = {_T.Q4_0: 18, _T.Q4_1: 20, _T.Q5_0: 22}
_NIBBLES_AT = {_T.Q4_0: 2, _T.Q4_1: 4, _T.Q5_0: 6}


def pack_q8(weight) -> tuple:
    """A Q4_0/Q4_1/Q5_0 weight's blocks separated for the packed q8 kernel: (qs, d, mins,
    qh), the same bytes as the file's blocks plus one zero block per row when a row has an
    odd number of them (see cpu_gemv_q8.cpp). Costs about the weight's size again."""
    t = weight.ggml_type
    n, k = weight.shape
    nbk = k // 32
    blocks = weight.raw.reshape(n, nbk, _BLOCK_BYTES[t])
    if nbk % 2:
        blocks = torch.cat([blocks, torch.zeros((n, 1, _BLOCK_BYTES[t]), dtype=torch.uint8)], dim=1)
    nb = blocks.shape[1]
    qs = blocks[:, :, _NIBBLES_AT[t]:_NIBBLES_AT[t] + 16].contiguous().reshape(n, nb * 16)
    d = blocks[:, :, 0:2].contiguous().view(torch.int16).reshape(n, nb)
    empty = torch.empty(0, dtype=torch.int16)
    mins = blocks[:, :, 2:4].contiguous().view(torch.int16).reshape(n, nb) if t == _T.Q4_1 else empty
    qh = empty
    if t == _T.Q5_0:
        # Fifth bits of a block pair in the kernel's byte order: b0 el 0-15, b1 el 0-15,
        # b0 el 16-31, b1 el 16-31 (bit i of the 64 = byte i of the register).
        bits = blocks[:, :, 2:6].contiguous().view(torch.int32).reshape(n, nb // 2, 2).to(torch.int64) & 0xFFFFFFFF
        b0, b1 = bits[..., 0], bits[..., 1]
        qh = (b0 & 0xFFFF) | ((b1 & 0xFFFF) << 16) | ((b0 >> 16) << 32) | ((b1 >> 16) << 48)
        qh = qh.contiguous()
    return qs, d, mins, qh


def run_q8_packed(x: torch.Tensor, packs: list[tuple], types: list[int], ns: list[int]) -> list[torch.Tensor]:
    """y_i = x @ w_i.T over weights packed by `pack_q8` (AVX512-VNNI builds: has_packed_q8())."""
    ext = _STATE.get("module") or extension()
    return ext.gemv_q8_packed(x if x.is_contiguous() else x.contiguous(), types, [p[0] for p in packs],
                              [p[1] for p in packs], [p[2] for p in packs], [p[3] for p in packs], ns)


def q8_weight_args(weight) -> tuple:
    """What `run_q8_weights` passes for this weight: ("packed", planes) on AVX512-VNNI
    builds, else ("blocks", the file's blocks) for the portable kernel."""
    ext = _STATE.get("module") or extension()
    if ext.has_packed_q8():
        return ("packed", pack_q8(weight), int(weight.ggml_type), weight.shape[0])
    return ("blocks", weight.raw, int(weight.ggml_type), weight.shape[0])


def run_q8_weights(x: torch.Tensor, linears) -> list[torch.Tensor]:
    """y_i = x @ w_i.T in the q8 mode for linears of one input (their `q8_args()`), one
    kernel call."""
    args = [lin.q8_args() for lin in linears]
    types, ns = [a[2] for a in args], [a[3] for a in args]
    if args[0][0] == "packed":
        return run_q8_packed(x, [a[1] for a in args], types, ns)
    ext = _STATE.get("module") or extension()
    return ext.gemv_q8(x if x.is_contiguous() else x.contiguous(), [a[1] for a in args], types, ns)


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """One decode row's attention in float32 (attention._one_query's math: scores scaled by
    D^-0.5, softmax, weighted values) as one compiled call; None where the kernel does not
    apply (no extension, D not a multiple of the vector width, rows not contiguous)."""
    ext = extension()
    _, h, d = q.shape
    if (
        ext is None
        or d % ext.vector_width()
        or d > 16 * ext.vector_width()
        or k.stride(2) != 1
        or k.stride(1) != d
        or v.stride(2) != 1
        or v.stride(1) != d
    ):
        return None
    q2 = q.reshape(h, d)
    if q2.dtype != torch.float32 or not q2.is_contiguous():
        q2 = q2.float().contiguous()
    out = ext.attend_decode(q2, k, v, d ** -0.5).view(1, h, d)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def attend_decode_slots(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor | None:
    """`attend_decode` reading keys/values through pool slots (a request's page table),
    wherever its pages lie: q (1, H, D), pools (slots, KVH, D) float32, slots (S,) int64.
    The arithmetic is attend_decode's, so page placement never changes the result. None
    where the kernel does not apply."""
    ext = extension()
    _, h, d = q.shape
    if (ext is None or d % ext.vector_width() or d > 16 * ext.vector_width() or k_pool.dtype != torch.float32
            or not k_pool.is_contiguous() or not v_pool.is_contiguous()):
        return None
    q2 = q.reshape(h, d)
    if q2.dtype != torch.float32 or not q2.is_contiguous():
        q2 = q2.float().contiguous()
    out = ext.attend_decode_slots(q2, k_pool, v_pool, slots, d ** -0.5).view(1, h, d)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """rmsnorm.rms_norm for float32 (T, D) CPU rows as one compiled call; None without the kernel."""
    ext = extension()
    if ext is None:
        return None
    return ext.rms_norm_f32(x if x.is_contiguous() else x.contiguous(), weight, float(eps))


def rope_f32(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, adjacent: bool
) -> torch.Tensor | None:
    """RotaryEmbedding.apply's rotation of float32 (T, heads, head_dim) CPU rows, bit for bit
    (the same products and sums, no contraction); None without the kernel."""
    ext = extension()
    if ext is None or cos.dtype != torch.float32:
        return None
    return ext.rope_f32(x if x.is_contiguous() else x.contiguous(), cos if cos.is_contiguous() else cos.contiguous(),
                        sin if sin.is_contiguous() else sin.contiguous(), int(rope_dim), bool(adjacent))
