"""Crash-safe writes: whatever is written appears complete under its final name, or not at all.

Every output of the project (configs, checkpoints, tokenizers, token shards) is first written under a temporary
name in the same directory, flushed to disk, then renamed: ``os.replace`` is atomic within a file system, so a
kill at any moment leaves either the old version or the new one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def save_json(obj: Any, path: str | Path) -> None:
    """Write JSON atomically (temporary file, fsync, rename); dataclasses are written as dicts, non-ASCII as is."""
    from zero2all.config import to_dict

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(to_dict(obj), f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_dir(tmp: str | Path, target: str | Path) -> Path:
    """Move the finished directory ``tmp`` to ``target``, replacing an existing ``target``.

    A directory cannot be renamed over a non-empty one, so the old one is first renamed aside (``.NAME.old``),
    the new one renamed in, and the old one deleted: at every moment one complete version exists under either
    ``target`` or the aside name.
    """
    tmp, target = Path(tmp), Path(target)
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return target


def fsync_tree(root: str | Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
