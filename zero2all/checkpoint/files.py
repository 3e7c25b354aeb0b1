"""The checkpoint directory on disk: names, the manifest, verification, listing, lines and pruning.

A checkpoint ``OUT/ckpt-000200/`` is complete when its ``manifest.json`` exists: it is written last, inside a
temporary directory that is then put in place with one atomic rename, and it lists every other file with its size
and SHA-256. :func:`verify` re-reads them; ``--resume auto`` takes the newest checkpoint that verifies and names
every newer one it skipped and why.

Lines: resuming from a checkpoint older than the newest starts a new line of the run. The abandoned line's later
checkpoints are moved aside to ``OUT/abandoned-<time>/`` (never deleted), so the new line's checkpoints never mix
with them; pruning (``keep_last``) then only ever sees the current line and never removes its newest checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from zero2all.config import ConfigError

CKPT_PATTERN = re.compile(r"^ckpt-(\d+)$")
MANIFEST = "manifest.json"
META = "z2all.json"
RUN_CONFIG = "config.json"
FORMAT = "zero2all-checkpoint"
FORMAT_VERSION = 2
# earlier formats, recognised to say how to convert them instead of misreading them
LEGACY_SINGLE_FILES = ("trainer_state.pt", "data_state.json", "model.safetensors")
LEGACY_SHARDED_FORMAT = "zero2all-sharded"


class CheckpointError(ConfigError):
    """A checkpoint is missing, incomplete, corrupt or of another format; the message names the file (the CLI
    prints it as one line, like a configuration error)."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def step_of(path: Path) -> int | None:
    m = CKPT_PATTERN.match(Path(path).name)
    return int(m.group(1)) if m else None


def sha256_of(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_threads() -> int:
    """Files are hashed (and DCP writes its shard files) on this many threads: hashlib releases the GIL, so a
    15 GB checkpoint split over 8 files hashes about 8x faster than one file on one thread."""
    return max(1, min(8, os.cpu_count() or 1))


def describe_files(root: Path, names: list[str]) -> dict[str, dict]:
    """``{relative name: {"bytes", "sha256"}}`` for ``names`` under ``root`` (hashed in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
        hashes = list(pool.map(lambda n: sha256_of(root / n), names))
    return {n: {"bytes": (root / n).stat().st_size, "sha256": h} for n, h in zip(names, hashes)}


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path, files: dict[str, dict]) -> None:
    from zero2all.fileio import save_json

    save_json({"format": FORMAT, "version": FORMAT_VERSION, "files": files}, root / MANIFEST)


def legacy_kind(path: Path) -> str | None:
    """'single-process' / 'sharded' for a checkpoint of an earlier format, else None."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return None
    meta = path / META
    if meta.exists():
        try:
            if json.loads(meta.read_text()).get("format") == LEGACY_SHARDED_FORMAT:
                return "sharded"
        except (OSError, json.JSONDecodeError):
            return None
    if all((path / f).exists() for f in LEGACY_SINGLE_FILES):
        return "single-process"
    return None


def legacy_message(path: Path, kind: str) -> str:
    return (f"{path}: a {kind} training checkpoint of an earlier zero2all version (no {MANIFEST}). Its weights "
            f"still load for inference and export (zero2all.load_model, `z2all export-hf`); to resume training "
            f"from it, convert it once: `z2all convert-checkpoint {path}` (writes {path}-v{FORMAT_VERSION} in the "
            f"current format)")


def verify(path: Path, hashes: bool = True) -> list[str]:
    """What is wrong with checkpoint ``path`` (empty list: it verifies): missing manifest, missing files, sizes,
    and with ``hashes`` the SHA-256 of every file."""
    path = Path(path)
    kind = legacy_kind(path)
    if kind is not None:
        return [legacy_message(path, kind)]
    manifest = path / MANIFEST
    if not manifest.exists():
        return [f"{manifest} is missing (the checkpoint was never completed)"]
    try:
        listed = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{manifest} is unreadable ({e})"]
    problems, to_hash = [], []
    for name, want in listed.items():
        f = path / name
        if not f.exists():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(f"{f} has {f.stat().st_size} bytes, the manifest says {want['bytes']}")
        elif hashes:
            to_hash.append(name)
    if to_hash:
        got = describe_files(path, to_hash)
        problems += [f"{path / n} does not match its SHA-256 in the manifest (corrupt)" for n in to_hash
                     if got[n]["sha256"] != listed[n]["sha256"]]
    return problems


def read_meta(path: Path) -> dict:
    f = Path(path) / META
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: not a training checkpoint") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f} is unreadable ({e})") from None
    if meta.get("format") != FORMAT:
        kind = legacy_kind(path)
        if kind is not None:
            raise CheckpointError(legacy_message(Path(path), kind))
        raise CheckpointError(f"{f}: format {meta.get('format')!r}, not a {FORMAT} training checkpoint")
    return meta


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint of the current format (no verification of the contents)."""
    path = Path(path)
    if not (path / MANIFEST).exists() or not (path / META).exists():
        return False
    try:
        return json.loads((path / META).read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Every ``ckpt-<step>`` directory in ``out_dir`` as (step, path), oldest first, complete or not."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    return sorted((step_of(p), p) for p in out_dir.iterdir() if p.is_dir() and step_of(p) is not None)


def newest_verified(out_dir: Path, hashes: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint that verifies, [(newer checkpoint, why it was skipped), ...]).
    A checkpoint of an earlier format raises :class:`CheckpointError` saying how to convert it."""
    skipped = []
    for _, path in reversed(list_checkpoints(out_dir)):
        kind = legacy_kind(path)
        if kind is not None:
            raise CheckpointError(legacy_message(path, kind))
        problems = verify(path, hashes=hashes)
        if not problems:
            return path, skipped
        skipped.append((path, "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3
                                                          else "")))
    return None, skipped


def move_aside_after(out_dir: Path, step: int) -> tuple[Path | None, list[Path]]:
    """Move every ``ckpt-<s>`` with s > ``step`` (a line being abandoned) into ``out_dir/abandoned-<time>/``;
    returns (that directory, the moved paths)."""
    later = [p for s, p in list_checkpoints(out_dir) if s > step]
    if not later:
        return None, []
    aside = Path(out_dir) / time.strftime("abandoned-%Y%m%d-%H%M%S")
    n = 1
    while aside.exists():
        n += 1
        aside = aside.with_name(f"{aside.name.split('.')[0]}.{n}")
    aside.mkdir()
    for p in later:
        os.replace(p, aside / p.name)
    return aside, later


def remove_stale_temporaries(out_dir: Path) -> None:
    """Delete temporary / half-deleted checkpoint directories left by a killed process."""
    for pattern in (".tmp-ckpt-*", ".trash-ckpt-*", ".ckpt-*.tmp", ".ckpt-*.old"):
        for p in Path(out_dir).glob(pattern):
            shutil.rmtree(p, ignore_errors=True)


def prune(out_dir: Path, keep_last: int, newest: Path) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (``keep_last`` <= 0 keeps all), never
    ``newest`` (the checkpoint just written)."""
    if keep_last <= 0:
        return []
    complete = [p for _, p in list_checkpoints(out_dir) if is_checkpoint(p)]
    removed = []
    for path in complete[:-keep_last]:
        if path.resolve() == Path(newest).resolve():
            continue
        trash = path.with_name(".trash-" + path.name)
        os.replace(path, trash)  # after this rename the checkpoint no longer counts
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    return removed
