"""The package layout stays what docs/architecture.md draws: no import circles inside ``specd``
(lazy imports inside functions count too), nothing below the CLI imports it, and no function in
``specd/``, ``eval/`` or the kernel launchers grows past 60 lines (``@triton.jit`` kernels excepted;
the engine step's stages stay within 40)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict:
    """``specd.x.y`` -> parsed module, for every file of the package."""
    out = {}
    for p in sorted((ROOT / "specd").rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if ".proto." in name + ".":
            continue  # generated gRPC code
        out[name] = ast.parse(p.read_text(), str(p))
    return out


def _imports(name: str, tree: ast.Module, known: set) -> set:
    """The ``specd`` modules ``name`` imports anywhere in its body (a ``from pkg import mod`` names the
    module itself when it is one)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("specd"):
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    out.discard(name)
    return {m for m in out if m in known}


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return comps


def _graph() -> dict:
    mods = _modules()
    known = set(mods)
    # a package's __init__ is imported by each of its modules: only its own imports are edges
    return {
        name: _imports(name, tree, known) - {p for p in known if name.startswith(p + ".")}
        for name, tree in mods.items()
    }


def test_no_import_circles_in_the_package():
    assert _cycles(_graph()) == []


def test_cycle_finder_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_below_the_cli_imports_it():
    users = sorted(m for m, deps in _graph().items() if "specd.cli" in deps)
    assert users == ["specd.__main__"]


def test_lower_layers_do_not_import_the_serving_layer():
    g = _graph()
    bad = sorted(
        (m, d)
        for m, deps in g.items()
        if m.startswith(("specd.engine", "specd.model", "specd.speculation", "specd.training"))
        for d in deps
        if d.startswith(("specd.serving", "specd.options"))
    )
    assert bad == []
