"""The second embedded corpus: the Python sources (code and docstrings) of the installed site-packages.

Where the standard library gives ~12 MB of code, the packages installed beside it give hundreds of MB on a machine
with a deep-learning stack: enough for scaling ladders whose larger rungs would repeat the stdlib many times over.
Nothing is downloaded; the corpus is whatever this machine has installed, read in place.

How it is built (all deterministic for a given set of installed files and settings):

* **Packages.** Each site-packages directory (``site.getsitepackages()`` plus the user site, or the roots given) is
  listed: a folder holding ``.py`` files is one package, a top-level ``module.py`` is a package of one file, a
  namespace folder (no ``__init__.py``) yields one package per sub-folder (``google.protobuf``). Metadata folders
  (``*.dist-info``, ``*.egg-info``), caches, hidden folders and files over ``max_file_bytes`` (generated tables)
  are skipped, and so is a file that is not UTF-8. A package name found in two roots is read from the first (as
  ``import`` would).
* **Split by package.** A package is wholly train or wholly validation: validation holds the packages named in
  ``valid_packages`` if given, else those whose ``blake2b(seed, name)`` falls below ``valid_fraction``, so the
  validation text is code the model never saw (not another file of a package it trained on). The manifest lists
  the validation packages.
* **Deduplication across packages.** Vendored copies (``pip/_vendor/requests`` beside ``requests``) would put the same
  text in both splits. Files are keyed by a hash of their text without import lines and whitespace (vendoring
  rewrites imports; a file of imports only, a re-export stub, is dropped); train packages are read first, so a
  copy is kept once, in train, and dropped from validation. Near-copies (a vendored file edited beyond its imports)
  are not caught.
* **Byte cap.** ``max_bytes`` bounds the total: each split gets its share (validation ``valid_fraction`` of it, or
  its natural share when packages are listed); packages are taken in a seeded order, files in path order, and a
  file that would overflow its split's budget is skipped.

Licences: each package keeps its own licence; this corpus is read only to train models locally on the machine where
the packages are installed, and is never redistributed by this project. Check the licences of the packages before
publishing a model or the text (the manifest lists every package used).

Records follow the readers' schema with ``data_src = "site-packages"``, ``id`` / ``title`` = ``package/relpath``,
``category = "code"`` and ``others = {"package": name, "split": "train" | "valid"}``; ``z2all prepare`` honours the
``split`` field, so the by-package split survives tokenization.
"""

from __future__ import annotations

import hashlib
import os
import re
import site
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["SitePackagesCorpus", "build_site_packages_corpus", "find_packages", "site_packages_dirs",
           "split_packages"]

_SKIP_DIRS = {"__pycache__", "node_modules"}
_IMPORT_LINE = re.compile(rb"^\s*(import\s|from\s+\S+\s+import\s).*$", re.MULTILINE)
_SPACE = re.compile(rb"\s+")


def site_packages_dirs() -> list[Path]:
    """The running Python's site-packages directories that exist (the user site last), without duplicates."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        dirs.append(site.getusersitepackages())
    out, seen = [], set()
    for d in dirs:
        real = os.path.realpath(d)
        if os.path.isdir(real) and real not in seen:
            seen.add(real)
            out.append(Path(d))
    return out


@dataclass
class Package:
    name: str                 # import name; "ns.sub" inside a namespace folder
    root: Path                # the package folder, or the module file itself
    files: list = field(default_factory=list)  # sorted Paths of its .py files

    def relpath(self, path: Path) -> str:
        base = self.root.parent if self.root.is_file() else self.root
        return f"{self.name}/{path.relative_to(base).as_posix()}" if not self.root.is_file() else path.name


def _py_files(folder: Path, max_file_bytes: int) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")
                             and not d.endswith((".dist-info", ".egg-info")))
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if f.endswith(".py") and p.is_file() and p.stat().st_size <= max_file_bytes:
                out.append(p)
    return out


def find_packages(roots: Iterable[str | os.PathLike] | None = None, max_file_bytes: int = 1 << 20) -> list[Package]:
    """The packages of ``roots`` (default: :func:`site_packages_dirs`), sorted by name; see the module docstring."""
    found: dict[str, Package] = {}

    def add(pkg: Package):
        if pkg.files and pkg.name not in found:
            found[pkg.name] = pkg

    for root in (site_packages_dirs() if roots is None else [Path(r) for r in roots]):
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: no such site-packages directory")
        for entry in sorted(root.iterdir(), key=lambda p: p.name):
            name = entry.name
            if name.startswith(".") or name in _SKIP_DIRS or name.endswith((".dist-info", ".egg-info")):
                continue
            if entry.is_file():
                if name.endswith(".py") and entry.stat().st_size <= max_file_bytes:
                    add(Package(name[:-3], entry, [entry]))
                continue
            if not entry.is_dir() or not name.isidentifier():
                continue
            if (entry / "__init__.py").exists():
                add(Package(name, entry, _py_files(entry, max_file_bytes)))
                continue
            # a namespace folder: one package per sub-package, its loose modules as the namespace's own package
            loose = [p for p in sorted(entry.iterdir(), key=lambda p: p.name)
                     if p.is_file() and p.name.endswith(".py") and p.stat().st_size <= max_file_bytes]
            add(Package(name, entry, loose))
            for sub in sorted(entry.iterdir(), key=lambda p: p.name):
                if sub.is_dir() and sub.name.isidentifier() and sub.name not in _SKIP_DIRS:
                    add(Package(f"{name}.{sub.name}", sub, _py_files(sub, max_file_bytes)))
    return [found[k] for k in sorted(found)]


def _unit(seed: int, name: str) -> float:
    h = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0 ** 64


def split_packages(names: Iterable[str], valid_fraction: float = 0.05, seed: int = 0,
                   valid_packages: Iterable[str] | None = None) -> set[str]:
    """The names held out for validation: ``valid_packages`` if given (each must be among ``names``), else those
    whose seeded hash falls below ``valid_fraction``; never all of them when there are two or more."""
    names = sorted(set(names))
    if valid_packages is not None:
        chosen = set(valid_packages)
        missing = sorted(chosen - set(names))
        if missing:
            raise ValueError(f"valid packages {', '.join(missing)}: not installed in the site-packages read "
                             f"({len(names)} packages); name installed packages")
        return chosen
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid fraction: must be in [0, 1), got {valid_fraction}")
    chosen = {n for n in names if _unit(seed, n) < valid_fraction}
    if len(chosen) == len(names) and len(names) > 1:
        chosen.discard(max(chosen, key=lambda n: _unit(seed, n)))
    return chosen


def _dedup_key(raw: bytes) -> bytes | None:
    """Text without import lines and whitespace: a vendored copy whose imports were rewritten keys the same. None
    for a file of imports only (a re-export stub), which is dropped rather than taken for a copy of another."""
    core = _SPACE.sub(b"", _IMPORT_LINE.sub(b"", raw))
    return hashlib.blake2b(core, digest_size=16).digest() if core else None


@dataclass
class SitePackagesCorpus:
    """The built corpus: ``files[split]`` lists (package, relpath, path, bytes); ``manifest`` is JSON-ready."""

    files: dict
    manifest: dict

    def records(self, split: str | None = None) -> Iterator[dict]:
        """Reader-schema records of one split (``"train"`` / ``"valid"``) or both (train first)."""
        gid = 0
        for s in ([split] if split else ["train", "valid"]):
            for pkg, rel, path, _ in self.files[s]:
                text = Path(path).read_bytes().decode("utf-8")
                yield {"gid": gid, "id": rel, "data_src": "site-packages", "category": "code", "title": rel,
                       "content": text, "desc": "", "others": {"package": pkg, "split": s}}
                gid += 1


def build_site_packages_corpus(roots: Iterable[str | os.PathLike] | None = None, *, valid_fraction: float = 0.05,
                               seed: int = 0, max_bytes: int | None = None,
                               valid_packages: Iterable[str] | None = None,
                               max_file_bytes: int = 1 << 20) -> SitePackagesCorpus:
    """Find, split, deduplicate and cap the site-packages corpus (see the module docstring). Reads every file once
    (to hash it); the records are read again when iterated."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max bytes: must be > 0, got {max_bytes}")
    packages = find_packages(roots, max_file_bytes=max_file_bytes)
    if not packages:
        raise FileNotFoundError(f"no Python packages found in {', '.join(map(str, roots or site_packages_dirs()))}")
    valid = split_packages([p.name for p in packages], valid_fraction, seed, valid_packages)
    seen: dict[bytes, str] = {}
    kept: dict[str, list] = {"train": [], "valid": []}
    dropped = {"duplicate": 0, "duplicate_bytes": 0, "not_utf8": 0, "empty": 0, "imports_only": 0, "over_cap": 0,
               "over_cap_bytes": 0}
    examples = []
    by_split: dict[str, list] = {"train": [], "valid": []}
    for pkg in sorted(packages, key=lambda p: (p.name in valid, p.name)):  # train first: copies stay in train
        s = "valid" if pkg.name in valid else "train"
        files = []
        for path in pkg.files:
            raw = path.read_bytes()
            rel = pkg.relpath(path)
            if not raw.strip():
                dropped["empty"] += 1
                continue
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                dropped["not_utf8"] += 1
                continue
            key = _dedup_key(raw)
            if key is None:
                dropped["imports_only"] += 1
                continue
            if key in seen:
                dropped["duplicate"] += 1
                dropped["duplicate_bytes"] += len(raw)
                if len(examples) < 20:
                    examples.append({"dropped": rel, "copy_of": seen[key]})
                continue
            seen[key] = rel
            files.append((pkg.name, rel, str(path), len(raw)))
        by_split[s].append((pkg.name, files))
    natural = {s: sum(b for _, fs in by_split[s] for *_, b in fs) for s in by_split}
    total = natural["train"] + natural["valid"]
    if max_bytes is not None and total > max_bytes:
        share = valid_fraction if valid_packages is None else natural["valid"] / max(total, 1)
        budget = {"valid": int(max_bytes * share)}
        budget["train"] = max_bytes - budget["valid"]
    else:
        budget = {"train": None, "valid": None}
    for s in ("train", "valid"):
        used = 0
        for name, files in sorted(by_split[s], key=lambda item: _unit(seed + 1, item[0])):
            for item in files:
                if budget[s] is not None and used + item[3] > budget[s]:
                    dropped["over_cap"] += 1
                    dropped["over_cap_bytes"] += item[3]
                    continue
                used += item[3]
                kept[s].append(item)
        kept[s].sort(key=lambda item: (item[0], item[1]))
    manifest = {
        "corpus": "site-packages", "seed": seed, "valid_fraction": valid_fraction, "max_bytes": max_bytes,
        "roots": [str(r) for r in (roots if roots is not None else site_packages_dirs())],
        "packages": {s: sorted({f[0] for f in kept[s]}) for s in kept},
        "files": {s: len(kept[s]) for s in kept}, "bytes": {s: sum(f[3] for f in kept[s]) for s in kept},
        "dropped": dropped, "duplicate_examples": examples,
        "licence": "each package under its own licence; read in place for local training only, not redistributed",
    }
    return SitePackagesCorpus(kept, manifest)
