"""Only the scheduler changes KV tables: no module but engine/scheduler.py calls a
`KVManager` mutator (`kv_manager.MUTATORS`), on the target's manager or the draft pool's.

Reference: the source itself, read with `ast` — every call `<anything>.<mutator>(...)` in
minivllm/ and widgets/ (kv_manager.py's own internal calls aside). The detector is first
shown to find such a call in a snippet, and to find the scheduler's.
"""

from __future__ import annotations

import ast
from pathlib import Path

from minivllm.cache.kv_manager import MUTATORS, KVManager

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {"minivllm/engine/scheduler.py"}
DEFINED_IN = "minivllm/cache/kv_manager.py"


def mutator_calls(source: str) -> list[str]:
    return [node.func.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS]


def callers() -> dict[str, list[str]]:
    found = {}
    for path in sorted([*ROOT.glob("minivllm/**/*.py"), *ROOT.glob("widgets/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        calls = mutator_calls(path.read_text())
        if calls and rel != DEFINED_IN:
            found[rel] = calls
    return found


def test_the_mutators_are_kv_manager_methods():
    assert MUTATORS and all(callable(getattr(KVManager, name, None)) for name in MUTATORS)


def test_the_detector_finds_a_mutator_call():
    assert mutator_calls("def f(engine, req):\n    engine._kv.free(req)\n    x = req.spec\n") == ["free"]
    assert mutator_calls("def f(d, s):\n    d.kv.allocate_slots(s, 3)\n") == ["allocate_slots"]


def test_only_the_scheduler_calls_kv_manager_mutators():
    found = callers()
    assert set(found) == ALLOWED, {k: v for k, v in found.items() if k not in ALLOWED}
    # The scheduler drives all of them (the detector reads the file it must).
    assert set(found["minivllm/engine/scheduler.py"]) == MUTATORS
