"""No import circles in hf_polyattn/: every arrow between two of its modules points one way.

An arrow A -> B is any ``import``/``from ... import`` in A's source that names B, at module level or inside a
function (a function-level import only defers the circle to the first call; it does not remove it). Found by parsing
with ``ast``, never by importing, so optional dependencies do not matter. ``from X import name`` is an arrow to the
submodule X.name when there is one, else to X. The implicit import of a module's parent packages is not an arrow
(Python imports a package before its submodules; that is not a circle of the code's making).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_polyattn"


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's __init__) for every .py under ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``root``'s package it imports (anywhere in its source)."""
    mods = modules(root)
    graph = {}
    for name, (path, is_package) in mods.items():
        package = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                if source in mods:
                    targets.update(f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source
                                   for a in node.names)
        targets.discard(name)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def test_hf_polyattn_has_no_import_cycles():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and graph["hf_polyattn.bench"]  # the walk saw the package and its arrows
    found = cycles(graph)
    detail = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c) for c in found]
    assert not found, "\n".join(detail)


def test_the_finder_sees_function_level_and_relative_arrows(tmp_path):
    """The check can fail: a circle closed only by a function-level relative import is found, and so is one
    through ``from package import submodule``; a package importing its own submodule is not a circle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("from pkg import d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    (pkg / "e.py").write_text("import os\n")
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.a"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"], ["pkg.c", "pkg.d"]]
