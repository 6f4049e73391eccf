"""Every script under scripts/ and every module with a `__main__` block runs its main only
after all of its top-level definitions: a function defined below the guard does not exist
yet when main() runs as a script, though importing the module (as tests do) defines it.
That is how run 1's GEMV sweep of 2026-12-06 lost every row after the first
(scripts/gemv_sweep.py called `mma_cells` from main, defined under the guard)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("minivllm/**/*.py"), *ROOT.glob("widgets/**/*.py")])


def is_main_guard(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def guarded(path: Path) -> bool:
    return "__main__" in path.read_text() and any(is_main_guard(n) for n in ast.parse(path.read_text()).body)


@pytest.mark.parametrize("path", [p for p in FILES if guarded(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_main_guard_comes_last(path):
    body = ast.parse(path.read_text()).body
    guards = [i for i, node in enumerate(body) if is_main_guard(node)]
    assert guards == [len(body) - 1], (f"{path.name}: what follows `if __name__ == '__main__'` is not defined "
                                       f"yet when it runs as a script; move the guard to the end")


def test_the_check_sees_the_scripts():
    assert sum(guarded(p) for p in FILES if p.parent.name == "scripts") >= 5
