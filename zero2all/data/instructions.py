"""A small instruction set built from Python source files (the demo's SFT stage): "write the docstring of X".

For every public function, method and class with a docstring in the given files (default: the running Python's
standard library, the demo's corpus), one record in the instruction format of ``zero2all/data/chat.py``::

    {"instruction": "Write the docstring of the function `join(a, *p)` in module `posixpath`.",
     "output": "Join two or more pathname components, inserting '/' as needed. ..."}

The signature comes from the syntax tree (``ast.unparse`` of the arguments), the docstring from
``ast.get_docstring`` (indentation cleaned). Files that do not parse are skipped and counted. Records are
shuffled with a seed, so a prefix of the list is a fair sample.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from zero2all.fileio import atomic_write


@dataclass
class BuildStats:
    files: int = 0
    unparsable: int = 0
    records: int = 0


def stdlib_source_files() -> list[Path]:
    """The standard library's .py files, without its tests and installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def _module_name(path: Path, root: Path | None) -> str:
    rel = path.relative_to(root) if root and path.is_relative_to(root) else Path(path.name)
    parts = list(rel.with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or path.stem


def docstring_records(source: str, module: str, min_chars: int = 20, max_chars: int = 800) -> list[dict]:
    """Instruction records for the documented public functions / methods / classes of one module's source."""
    tree = ast.parse(source)
    out = []

    def visit(node, prefix: str, in_class: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = child.name
                public = not name.startswith("_")
                doc = ast.get_docstring(child, clean=True)
                qual = f"{prefix}{name}"
                if public and doc and min_chars <= len(doc) <= max_chars:
                    if isinstance(child, ast.ClassDef):
                        what, shown = "class", qual
                    else:
                        what = "method" if in_class else "function"
                        shown = f"{qual}({ast.unparse(child.args)})"
                    out.append({"instruction": f"Write the docstring of the {what} `{shown}` in module `{module}`.",
                                "output": doc})
                if isinstance(child, ast.ClassDef) and public:
                    visit(child, qual + ".", True)

    visit(tree, "", False)
    return out


def build_docstring_instructions(paths: Iterable[str | Path] | None = None, max_records: int | None = 2000,
                                 seed: int = 0, min_chars: int = 20, max_chars: int = 800
                                 ) -> tuple[list[dict], BuildStats]:
    """Records from ``paths`` (default: the stdlib), shuffled with ``seed``, at most ``max_records``."""
    stats = BuildStats()
    root = None
    if paths is None:
        paths = stdlib_source_files()
        root = Path(sysconfig.get_paths()["stdlib"])
    records: list[dict] = []
    for p in paths:
        p = Path(p)
        stats.files += 1
        try:
            source = p.read_text(encoding="utf-8")
            records += docstring_records(source, _module_name(p, root), min_chars, max_chars)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            stats.unparsable += 1
    random.Random(seed).shuffle(records)
    if max_records is not None:
        records = records[:max_records]
    stats.records = len(records)
    return records, stats


def write_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    """One JSON object per line, written atomically (``fileio.atomic_write``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path
