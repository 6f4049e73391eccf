"""Instructions per weight in the tiled GEMV's K loop, from its SASS, without a GPU.

Why: at the 7B's small shapes (3584 x 3584 Q4_K: 7.4 MB) the decode GEMV is close to
issue-bound on an H100, not only memory-bound: 12.8 M weights at ~5.75 instructions each
is about 2.3 M warp instructions, ~2.5 us over 132 SMs x 4 schedulers, as long as the
reads themselves (issue 41, docs/gpu-decode-vs-llama-cpp.md). Every instruction taken out
of the loop is time, and this counts them on any machine: Triton compiles for sm_75 or
sm_90 here and its bundled nvdisasm disassembles the cubin.

    python scripts/gemv_sass.py                        # every type, the H100 table's configs
    python scripts/gemv_sass.py --arch 75 --types Q4_K --config 4,32,1,4,2

Pointers and strides are compiled 16-byte aligned, as Triton specializes them at a real
launch; without that the weights would load 4 bytes at a time (32-bit LDG) and the count
would describe a kernel that never runs.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

_PLANES = {"Q4_0": ("*fp16", "*i32", "*i32", "*i32"), "Q4_1": ("*fp16", "*fp16", "*i32", "*i32"),
           "Q5_0": ("*fp16", "*i32", "*i32", "*i32"), "Q8_0": ("*fp16", "*i32", "*i32", "*i32"),
           "Q4_K": ("*fp16", "*fp16", "*u8", "*u8"), "Q6_K": ("*fp16", "*i16", "*i8", "*i8")}
_ALIGNED = ("x_ptr", "q_ptr", "a_ptr", "b_ptr", "c_ptr", "e_ptr", "bias_ptr", "out_ptr", "stride_xm", "stride_om",
            "stride_os")
_OP = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def compile_tiled(type_name: str, arch: int, block_nb: int, block_g: int, split: int, warps: int, stages: int,
                  t_outer: bool = False, early: int = 0):
    """The tiled kernel compiled as a launch on a 3584-wide Q-type weight would be."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minivllm.kernels import repacked_layout
    from minivllm.kernels.repacked_layout import R
    from minivllm.kernels.triton.tiled_gemv import _tiled_gemv_kernel

    kind = int(getattr(repacked_layout, f"K_{type_name}"))
    a, b, c, e = _PLANES[type_name]
    sig = {"x_ptr": "*fp16", "q_ptr": "*i32", "a_ptr": a, "b_ptr": b, "c_ptr": c, "e_ptr": e, "bias_ptr": "*fp32",
           "out_ptr": "*fp32" if split > 1 else "*fp16", "M": "i32", "N": "i32", "stride_xm": "i32",
           "stride_om": "i32", "stride_os": "i32", "G_PER_SPLIT": "i32", "N_RB": "i32", "PAIR_RB": "i32",
           "ONES": "i32"}
    const = {"N_GROUPS": 112, "KIND": kind, "T": 8 if type_name == "Q8_0" else 4, "RR": R, "BLOCK_NB": block_nb,
             "BLOCK_G": block_g, "IS_SPLIT": split > 1, "HAS_BIAS": False, "PAIRED": False, "ROUND": 0,
             "PDL": arch >= 90, "EVEN_N": True, "EARLY": early if arch >= 90 else 0, "FIXUP": False, "SPLIT": 1,
             "ticket_ptr": None, "final_ptr": None, "T_OUTER": t_outer}
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _ALIGNED}
    return triton.compile(ASTSource(_tiled_gemv_kernel, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages}), const


def registers(cubin: bytes) -> int:
    """Registers a thread of the kernel takes (cuobjdump's resource usage): with 4 warps,
    65,536 // (128 x this) programs fit an SM (4 up to 128 registers, 3 up to 170)."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1))


def loop_ops(cubin: bytes) -> collections.Counter:
    """Opcode counts of the first loop in the SASS (the kernel's unmasked K loop: the
    backward branch to the first label)."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    lines = sass.splitlines()
    labels = [i for i, ln in enumerate(lines) if re.match(r"\.L_x_\d+:", ln)]
    for start in labels:
        name = lines[start].rstrip(":")
        end = next((i for i in range(start, len(lines)) if f"BRA `({name})" in lines[i]), None)
        if end is not None:
            ops = collections.Counter()
            for ln in lines[start:end + 1]:
                m = _OP.match(ln)
                if m:
                    ops[m.group(1)] += 1
            return ops
    raise RuntimeError("no loop found in the SASS")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--types", default="Q4_K,Q5_0,Q6_K,Q8_0")
    ap.add_argument("--config", default="8,32,2,8,2", help="row groups, groups, split, warps, stages")
    ap.add_argument("--t-outer", action="store_true", help="the T-outer tile (GemvConfig.t_outer)")
    ap.add_argument("--early", type=int, default=0, help="trips loaded before the PDL wait (sm_90: 0, 1, 2)")
    args = ap.parse_args()
    nb, g, split, warps, stages = (int(v) for v in args.config.split(","))
    print(f"tile: {'[T, NB, G, R] (t_outer)' if args.t_outer else '[NB, G, T, R]'}")
    print("| type | sm | config | loop instructions | per weight | weight loads | FFMA | FADD | LOP3 | registers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in args.types.split(","):
        k, const = compile_tiled(t, args.arch, nb, g, split, warps, stages, args.t_outer, args.early)
        ops = loop_ops(k.asm["cubin"])
        weights = nb * g * 32 * const["RR"]  # one trip: the tile's rows x 32 weights a group
        per_thread = weights / (warps * 32)
        wide = sum(n for op, n in ops.items() if op.startswith("LDG") and ".128" in op)
        print(f"| {t} | {args.arch} | {args.config} | {sum(ops.values())} | {sum(ops.values()) / per_thread:.2f} | "
              f"{wide} x 16 B | {ops['FFMA']} | {ops['FADD']} | {ops['LOP3.LUT']} | {registers(k.asm['cubin'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
