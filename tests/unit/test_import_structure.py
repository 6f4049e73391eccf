"""The package's import graph stays a tree of layers: no cycles, no reaching into privates.

Walks every module of `minivllm/` and `widgets/minivllm_widgets/` with `ast` (nothing is
imported, so this runs in a second and sees lazy imports inside functions too):

- an import cycle between modules fails, naming the modules of the cycle;
- importing an underscore name from another module (`from x import _helper`) fails,
  naming the importer and the name: a helper that two modules need is public API of
  one of them, or lives in a shared module.

Also the size rule of ARCHITECTURE.md: no module over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO_ROOT

PACKAGES = {"minivllm": REPO_ROOT / "minivllm", "minivllm_widgets": REPO_ROOT / "widgets" / "minivllm_widgets"}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    mods = {}
    for top, root in PACKAGES.items():
        for f in root.rglob("*.py"):
            parts = [top, *f.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> tuple[set[str], list[str]]:
    """(modules of the package that `name` imports, underscore names it takes from others)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps, private = set(), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" in mods:  # `from pkg import module`
                    deps.add(f"{source}.{alias.name}")
                    continue
                deps.add(source)
                if alias.name.startswith("_") and not alias.name.startswith("__") and source != name:
                    private.append(f"{name} imports {alias.name} from {source} (line {node.lineno})")
    return {d for d in deps if d in mods and d != name}, private


def _graph():
    mods = _modules()
    edges, private = {}, []
    for name, path in mods.items():
        edges[name], p = _imports(name, path, mods)
        private += p
    return mods, edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_sees_a_cycle_and_a_private_import(tmp_path):
    """The checks can fail: a two-module cycle and a private import are both reported."""
    edges = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _cycles(edges) == [["a", "b"]]
    pkg = tmp_path / "minivllm"
    pkg.mkdir()
    (pkg / "one.py").write_text("from minivllm.two import _helper\n")
    (pkg / "two.py").write_text("def _helper(): ...\n")
    mods = {"minivllm.one": pkg / "one.py", "minivllm.two": pkg / "two.py"}
    deps, private = _imports("minivllm.one", pkg / "one.py", mods)
    assert deps == {"minivllm.two"} and private and "_helper" in private[0]


def test_no_import_cycles():
    _, edges, _ = _graph()
    cycles = _cycles(edges)
    assert not cycles, "import cycles (break them by moving the shared piece into a lower module): " + \
        "; ".join(" <-> ".join(c) for c in cycles)


def test_no_underscore_names_imported_across_modules():
    _, _, private = _graph()
    assert not private, "private names used across modules (make them public or move them):\n" + "\n".join(private)


def test_no_module_is_over_500_lines():
    mods = _modules()
    long = {
        str(p.relative_to(REPO_ROOT)): n for p in mods.values() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


def test_architecture_page_cites_only_files_in_the_repository():
    text = (REPO_ROOT / "ARCHITECTURE.md").read_text()
    assert "../" not in text, "ARCHITECTURE.md points outside the repository"
