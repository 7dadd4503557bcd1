"""The integration package imports one way: no cycles, and no cycle hidden in a function-level import."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_polyattn.integration

PACKAGE = Path(hf_polyattn.integration.__file__).parent


def _sibling_imports(tree: ast.Module, *, top_level: bool) -> set[str]:
    nodes = tree.body if top_level else [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:  # from . import hub
                found.update(alias.name for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {p.stem: ast.parse(p.read_text()) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return {name: _sibling_imports(tree, top_level=True) & set(modules) for name, tree in modules.items()}


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join([*path, node, dep])}"
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_no_function_level_sibling_imports():
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        hidden = _sibling_imports(tree, top_level=False) - _sibling_imports(tree, top_level=True)
        assert not hidden, f"{path.name} imports {sorted(hidden)} inside a function (a hidden import cycle?)"


def test_settings_and_compatibility_import_no_module_state():
    graph = _graph()
    assert graph["settings"] == set()
    assert graph["compatibility"] <= {"settings"}
    assert "modules" not in graph  # split into settings / compatibility / state / model_methods / construction
