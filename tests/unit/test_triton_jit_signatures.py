"""Every `@triton.jit` function's constexpr parameters have defaults the oldest Triton we
run on accepts: no string defaults. Triton 3.6 (the lent GPU machines' torch 2.11 build)
hands a jit helper's string constexpr default over as a plain str, and the kernel fails to
compile ("'str' object has no attribute 'type'"); a layer then falls back to dequantize +
cuBLAS. Triton 3.9 (this machine's) compiles it, so only the source can catch it here.

Reference: the source itself, read with `ast`; the detector is first shown to find the
defect in a snippet, and to pass an int default.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def string_constexpr_defaults(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        if not any("jit" in ast.unparse(d) for d in node.decorator_list):
            continue
        args = node.args.args + node.args.kwonlyargs
        defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults + node.args.kw_defaults
        for arg, default in zip(args, defaults):
            constexpr = arg.annotation is not None and "constexpr" in ast.unparse(arg.annotation)
            if constexpr and isinstance(default, ast.Constant) and isinstance(default.value, str):
                found.append(f"{node.name}({arg.arg}={default.value!r})")
    return found


def test_the_detector_finds_a_string_constexpr_default():
    bad = "@triton.jit\ndef load(p, POLICY: tl.constexpr = ''):\n    pass\n"
    good = "@triton.jit\ndef load(p, EVICT: tl.constexpr = 0):\n    pass\n"
    assert string_constexpr_defaults(bad) == ["load(POLICY='')"]
    assert string_constexpr_defaults(good) == []


def test_no_jit_function_has_a_string_constexpr_default():
    found = {p.relative_to(ROOT).as_posix(): hits for p in sorted(ROOT.glob("minivllm/**/*.py"))
             if (hits := string_constexpr_defaults(p.read_text()))}
    assert found == {}
