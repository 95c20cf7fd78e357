"""The package layout stays what docs/architecture.md draws: no import circles inside ``specd`` or
``specd_kernels`` (lazy and relative imports count too), no module imports a higher layer (cli ->
serving/training -> options -> engine -> speculation -> sampling/structured -> model -> config ->
specd_kernels), nothing below
the CLI imports it, and no function in
``specd/``, ``eval/`` or the kernel launchers grows past 60 lines (``@triton.jit`` kernels excepted;
the engine step's stages stay within 40)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


PACKAGES = ("specd", "specd_kernels")
# the layers, top to bottom (docs/architecture.md): a module imports only its own package or a package
# of a lower layer; packages sharing a layer never import each other
LAYERS = (
    ("specd.__main__",),
    ("specd.cli",),
    ("specd.serving", "specd.training"),
    ("specd.options",),
    ("specd.engine",),
    ("specd.speculation",),
    ("specd.sampling", "specd.structured"),
    ("specd.model",),
    ("specd.config", "specd"),
    ("specd_kernels",),
)


def _modules() -> dict:
    """``specd.x.y`` -> (parsed module, is a package ``__init__``), for every file of both packages."""
    out = {}
    for base in PACKAGES:
        for p in sorted((ROOT / base).rglob("*.py")):
            rel = p.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            name = ".".join(parts)
            if ".proto." in name + ".":
                continue  # generated gRPC code
            out[name] = (ast.parse(p.read_text(), str(p)), is_pkg)
    return out


def _absolute(name: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (``from .x import y`` in ``a.b`` -> ``a.x``)."""
    if node.level == 0:
        return node.module or ""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, tree: ast.Module, known: set, is_pkg: bool = False) -> set:
    """The modules of ``known`` that ``name`` imports anywhere in its body, relative imports and
    imports inside functions included (a ``from pkg import mod`` names the module itself when it is one)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            mod = _absolute(name, is_pkg, node)
            if not mod.startswith(PACKAGES):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in known else mod)
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
        name: _imports(name, tree, known, is_pkg) - {p for p in known if name.startswith(p + ".")}
        for name, (tree, is_pkg) in mods.items()
    }


def _package(module: str) -> str:
    """The layer entry ``module`` belongs to (the longest one that names it or a package above it)."""
    names = [n for layer in LAYERS for n in layer]
    return max((n for n in names if module == n or module.startswith(n + ".")), key=len)


def _rank(module: str) -> int:
    pkg = _package(module)
    return next(i for i, layer in enumerate(LAYERS) if pkg in layer)


def _upward(graph: dict) -> list:
    """(importer, imported) pairs that break the layering: an import of a higher layer, or of
    another package of the same layer."""
    bad = []
    for m, deps in graph.items():
        for d in deps:
            same = _package(m) == _package(d)
            if not same and _rank(d) <= _rank(m):
                bad.append((m, d))
    return sorted(bad)


def test_no_import_circles_in_the_packages():
    assert _cycles(_graph()) == []


def test_cycle_finder_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_imports_upward():
    assert _upward(_graph()) == []


def test_the_layer_check_sees_upward_and_sideways_imports():
    g = {
        "specd.speculation.drafter": {"specd.engine.kv_cache", "specd.sampling.probs"},
        "specd.sampling.verify": {"specd.structured.matcher"},
        "specd.engine.engine": {"specd.speculation.policy", "specd.engine.ledger"},
        "specd_kernels._common": {"specd.model.cpu"},
    }
    assert _upward(g) == [
        ("specd.sampling.verify", "specd.structured.matcher"),
        ("specd.speculation.drafter", "specd.engine.kv_cache"),
        ("specd_kernels._common", "specd.model.cpu"),
    ]


def test_relative_imports_are_seen():
    tree = ast.parse("from . import kv_ops\nfrom ._common import x\nfrom .. import config\n")
    known = {"specd_kernels.kv_ops", "specd_kernels._common", "specd_kernels", "specd.config"}
    assert _imports("specd_kernels.aot", tree, known) == {"specd_kernels.kv_ops", "specd_kernels._common"}
    assert _imports("specd.model.cpu", ast.parse("from ..config import X\n"), known) == {"specd.config"}
    assert _imports("specd_kernels", ast.parse("from .kv_ops import y\n"), known, is_pkg=True) == {
        "specd_kernels.kv_ops"
    }


def test_nothing_below_the_cli_imports_it():
    users = sorted(m for m, deps in _graph().items() if "specd.cli" in deps)
    assert users == ["specd.__main__"]


# function length --------------------------------------------------------------------------------
MAX_LINES = 60
STEP_MAX_LINES = 40  # the engine step's stages (engine.py, stages.py, ledger.py)
STEP_FILES = ("specd/engine/engine.py", "specd/engine/stages.py", "specd/engine/ledger.py")


def _is_triton_kernel(fn: ast.AST) -> bool:
    for d in getattr(fn, "decorator_list", []):
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr in ("jit", "autotune"):
            return True
    return False


def _function_lengths() -> dict:
    """``"path:qualified name" -> lines`` for every function in specd/, eval/ and specd_kernels/."""
    out = {}
    for base in ("specd", "eval", "specd_kernels"):
        for p in sorted((ROOT / base).rglob("*.py")):
            if "proto" in p.parts:
                continue
            rel = p.relative_to(ROOT).as_posix()

            def walk(node, prefix, rel=rel):
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(child):
                        name = prefix + child.name
                        out[f"{rel}:{name}"] = child.end_lineno - child.lineno + 1
                        walk(child, name + ".")
                    elif isinstance(child, ast.ClassDef):
                        walk(child, prefix + child.name + ".")

            walk(ast.parse(p.read_text()), "")
    return out


def test_no_function_is_longer_than_60_lines():
    lengths = _function_lengths()
    long = sorted(k for k, n in lengths.items() if n > MAX_LINES)
    assert long == [], "split these functions (by meaning: a phase, a section, a concern)"


def test_the_engine_step_stages_stay_within_40_lines():
    lengths = _function_lengths()
    long = sorted(k for k, n in lengths.items() if k.split(":")[0] in STEP_FILES and n > STEP_MAX_LINES)
    assert long == []


def test_the_length_check_sees_long_functions_and_skips_triton_kernels():
    src = "import triton\n@triton.jit\ndef k():\n" + "    x = 1\n" * 70 + "def f():\n" + "    y = 2\n" * 70
    tree = ast.parse(src)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert [_is_triton_kernel(f) for f in fns] == [True, False]
    assert fns[1].end_lineno - fns[1].lineno + 1 == 71


# KV state ownership -----------------------------------------------------------------------------
KV_FIELDS = ("num_computed", "draft_computed", "blocks", "draft_blocks", "pc_state", "pc_draft_state")
KV_OWNERS = ("specd/engine/ledger.py", "specd/engine/kv_cache.py", "specd/engine/sequence.py")
KV_MUTATORS = ("reserve", "truncate", "free")


def _kv_writes(tree: ast.AST) -> list:
    """Assignments to a sequence's KV fields and calls that move its block tables, outside the ledger."""
    bad = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in KV_FIELDS and not _is_self(t.value):
                bad.append((node.lineno, t.attr))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KV_MUTATORS:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr in ("blocks", "draft_blocks"):
                bad.append((node.lineno, f"{owner.attr}.{node.func.attr}"))
    return bad


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def test_only_the_ledger_changes_a_sequences_kv_state():
    bad = {}
    for p in sorted((ROOT / "specd").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel in KV_OWNERS or "proto" in p.parts:
            continue
        found = _kv_writes(ast.parse(p.read_text()))
        if found:
            bad[rel] = found
    assert bad == {}


def test_the_ownership_check_sees_a_write():
    tree = ast.parse("seq.num_computed += 1\nseq.blocks.truncate(3)\nself.blocks = []\nn = seq.blocks.capacity\n")
    assert _kv_writes(tree) == [(1, "num_computed"), (2, "blocks.truncate")]
