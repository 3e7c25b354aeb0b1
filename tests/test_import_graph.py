"""The package's import graph, read from the source (an AST walk, nothing imported): the model never imports the
parallel code (``zero2all/distributed/`` wraps a plain model from outside), and no import circle runs across
folders (modules that need each other live in one folder)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "zero2all"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at any depth of the file (lazy imports inside functions count):
    ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:   # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
            # Python runs every enclosing package's ``__init__`` first: those are imports too, save the packages
            # that enclose the importing module itself (they are already running when it runs).
            parent = t.rpartition(".")[0]
            while parent:
                if parent in modules and not (name + ".").startswith(parent + "."):
                    out.add(parent)
                parent = parent.rpartition(".")[0]
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    return {m: imports_of(p, modules) for m, p in files.items()}


def folder(module: str, g: dict) -> str:
    """The folder a module's file is in (a package's ``__init__`` is in the package's folder)."""
    path = module.replace(".", "/")
    return path if any(k.startswith(module + ".") for k in g) else path.rpartition("/")[0]


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
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
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_lazy_and_relative_imports():
    g = graph()
    assert "zero2all.distributed.tp" in g["zero2all.distributed.pp"]          # a lazy import inside a method
    assert "zero2all.accounting.moe" in g["zero2all.accounting"]              # from a package's __init__
    assert "zero2all.model.moe" in g["zero2all.model.z2all"]
    assert "zero2all.distributed" in g["zero2all.checkpoint"]                # a submodule runs its package first
    assert "zero2all.corpus" not in g["zero2all.corpus.decontam"]            # ... save the importer's own
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_model_does_not_import_the_parallel_code():
    g = graph()
    arrows = sorted(f"{m} -> {t}" for m, ts in g.items() if m.startswith("zero2all.model")
                    for t in ts if t.startswith("zero2all.distributed"))
    assert not arrows, arrows


def test_no_import_circle_crosses_folders():
    g = graph()
    crossing = [c for c in cycles(g) if len({folder(m, g) for m in c}) > 1]
    assert not crossing, crossing


def test_checkpoints_know_no_parallelism_kind():
    """The checkpoint code uses the process-group helpers (``distributed/env.py``) only: a parallel layout (tensor
    parallelism's fused rows) reaches it as objects with ``save_value`` / ``load_value``, never by import."""
    g = graph()
    arrows = sorted(f"{m} -> {t}" for m, ts in g.items() if m.startswith("zero2all.checkpoint")
                    for t in ts if t.startswith("zero2all.distributed.") and t != "zero2all.distributed.env")
    assert not arrows, arrows
