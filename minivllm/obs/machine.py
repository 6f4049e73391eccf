"""The processor and math libraries a CPU result came from.

Two CPU kernels that compute "the same" float32 matmul round differently, and how they
round depends on the machine: the BLAS (MKL picks AVX2, AVX-512 or AMX code at run
time), the ISA torch's own kernels were dispatched to (`ATEN_CPU_CAPABILITY`) and the
thread count (how a reduction is split). So a divergence position or a benchmark figure
recorded on one machine is a fact about that machine; this record says which.
"""

from __future__ import annotations

import os
import platform
import re

# ISA features that change which vector code MKL and torch run.
_ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx_vnni", "amx_bf16", "amx_int8", "amx_tile", "asimd", "sve")


def cpu_model() -> str:
    """The processor's marketing name, as /proc/cpuinfo gives it (platform's guess elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_flags() -> list[str]:
    """The vector-ISA features of `_ISA_FLAGS` this CPU reports (sorted, lower case)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return []
    m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.MULTILINE)
    have = set(m.group(1).split()) if m else set()
    return sorted(flag for flag in _ISA_FLAGS if flag in have)


def blas_info() -> str:
    """Which BLAS torch was built with, and its version line when torch names one."""
    import torch

    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    version = re.search(r"^\s*- (Intel\(R\) oneAPI Math Kernel Library Version [^\n]*|OpenBLAS[^\n]*)", config,
                        re.MULTILINE)
    return f"{blas.group(1) if blas else 'unknown'}" + (f" ({version.group(1).strip()})" if version else "")


def cpu_fingerprint() -> dict:
    """A JSON-ready record of what decides CPU float rounding in this process."""
    import torch

    return {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "isa": isa_flags(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
        "blas": blas_info(),
        "torch_threads": torch.get_num_threads(),
    }


NUMERICS_KEYS = ("cpu", "isa", "torch", "torch_cpu_capability", "blas", "torch_threads", "cpu_gemv_isa")


def same_cpu_numerics(a: dict, b: dict) -> bool:
    """Whether two fingerprints would run the same CPU kernels (same model, ISA, torch, BLAS,
    capability, thread count and minivllm's own CPU GEMV build where recorded): only then is
    an exact float outcome expected to repeat."""
    return not numerics_differences(a, b)


def numerics_differences(a: dict, b: dict) -> list[str]:
    """One line per field of `NUMERICS_KEYS` on which two fingerprints differ, naming only
    what differs (for the ISA flags: the flags one side has and the other lacks)."""
    lines = []
    for key in NUMERICS_KEYS:
        va, vb = a.get(key), b.get(key)
        if va == vb:
            continue
        if isinstance(va, list) and isinstance(vb, list):
            only_a, only_b = sorted(set(va) - set(vb)), sorted(set(vb) - set(va))
            lines.append(f"{key}: only the first has {', '.join(only_a) or 'nothing more'}; "
                         f"only the second has {', '.join(only_b) or 'nothing more'}")
        else:
            lines.append(f"{key}: {va!r} vs {vb!r}")
    return lines
