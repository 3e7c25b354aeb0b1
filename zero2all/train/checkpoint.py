"""Crash-safe training checkpoints: everything needed to continue a run bit for bit.

Layout of ``OUT/ckpt-000200/`` (one directory per saved step)::

    z2all.json, model.safetensors     the model, as ``zero2all.model.io.save_model`` writes it (``load_model`` works)
    tokenizer files                   copied from the run's tokenizer, so ``load_tokenizer(ckpt)`` works on it
    config.json                       the whole run config (model / train / data sections)
    trainer_state.pt                  optimizer, loss scaler, schedule, step, token count, every RNG state
                                      (tensors, numbers and strings only: loaded with ``weights_only=True``)
    data_state.json                   the data iterator's ``state_dict()`` (where the next batch starts)

Crash safety: a checkpoint is written into a hidden temporary directory ``OUT/.tmp-ckpt-000200-<random>``, every
file and the directory are fsynced, then the directory is renamed to ``ckpt-000200`` (atomic on POSIX) and the
parent fsynced. Readers only ever consider ``ckpt-<digits>`` directories, so a process killed at any moment -
``kill -9`` half-way through writing the weights included - leaves either the old set of checkpoints or the old set
plus the complete new one; leftover temporary directories are removed by the next save. Old checkpoints beyond
``keep_last`` are first renamed to a hidden name and then deleted, for the same reason.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from zero2all.config import Config, ConfigError, save_json, to_dict
from zero2all.model.io import OUR_CONFIG, WEIGHTS, load_state, save_model

CKPT_PATTERN = re.compile(r"^ckpt-(\d+)$")
TRAINER_STATE = "trainer_state.pt"
RUN_CONFIG = "config.json"
DATA_STATE = "data_state.json"
REQUIRED_FILES = (OUR_CONFIG, WEIGHTS, TRAINER_STATE, RUN_CONFIG, DATA_STATE)
_OUR_NAMES = set(REQUIRED_FILES)

# Fields that must agree between a checkpoint and the run resuming from it: the architecture (weights would not
# fit, or mean something else) and everything that decides which tokens the next batch holds.
MUST_MATCH_TRAIN = ("micro_batch_size", "grad_accum_steps", "seed")
MUST_MATCH_DATA = ("seq_len",)


class CheckpointMismatch(ConfigError):
    """A checkpoint does not fit the run that tries to load it; the message names every mismatched field."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``out_dir`` as (step, path), oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for p in out_dir.iterdir():
        m = CKPT_PATTERN.match(p.name)
        if m and p.is_dir() and (all((p / f).exists() for f in REQUIRED_FILES) or _is_sharded(p)):
            found.append((int(m.group(1)), p))
    return sorted(found)


def _is_sharded(path: Path) -> bool:
    """A complete multi-process checkpoint (torch.distributed.checkpoint shards, see train/distributed.py)."""
    from zero2all.train.distributed import is_sharded_checkpoint

    return is_sharded_checkpoint(path) and (path / RUN_CONFIG).exists()


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


# --------------------------------------------------------------------------------------------------------------
# RNG states


def capture_rng_state() -> dict:
    """Python, NumPy, torch CPU and every CUDA device's generator state (tensors and plain values only)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:  # a different number of visible GPUs: restore the ones both runs have
            for i, s in enumerate(cuda_states[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)


# --------------------------------------------------------------------------------------------------------------
# writing


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


def copy_tokenizer_dir(src: str | Path, dst: str | Path) -> list[str]:
    """Copy every regular file of a tokenizer directory (names that clash with our own files are skipped)."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and f.name not in _OUR_NAMES:
            shutil.copy2(f, Path(dst) / f.name)
            copied.append(f.name)
    return copied


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"data iterator state: {type(obj).__name__} is not JSON-serialisable")


def remove_stale_temporaries(out_dir: Path) -> None:
    """Delete temporary / half-deleted checkpoint directories left by a killed process."""
    for p in out_dir.glob(".tmp-ckpt-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in out_dir.glob(".trash-ckpt-*"):
        shutil.rmtree(p, ignore_errors=True)


def prune_checkpoints(out_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (``keep_last`` <= 0 keeps all)."""
    if keep_last <= 0:
        return []
    removed = []
    for _, path in list_checkpoints(out_dir)[:-keep_last]:
        trash = path.with_name(".trash-" + path.name)
        os.replace(path, trash)  # after this rename the checkpoint no longer counts as complete
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    _fsync_dir(out_dir)
    return removed


def save_checkpoint(out_dir: str | Path, step: int, model: torch.nn.Module, trainer_state: dict, config: Config,
                    data_state: dict, tokenizer_dir: str | Path | None = None, tokenizer_hash: str | None = None,
                    keep_last: int = 0) -> Path:
    """Write ``OUT/ckpt-<step>`` atomically (see the module docstring) and prune old ones; returns its path.

    ``model`` is the plain (unwrapped) model. If a checkpoint of this step already exists it is left as is.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / checkpoint_name(step)
    if final.exists():
        return final
    remove_stale_temporaries(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{checkpoint_name(step)}-", dir=out_dir))
    save_model(model, tmp, extra={"step": step, "tokenizer_hash": tokenizer_hash}, atomic=False)
    if tokenizer_dir is not None:
        copy_tokenizer_dir(tokenizer_dir, tmp)
    torch.save(trainer_state, tmp / TRAINER_STATE)
    save_json(to_dict(config), tmp / RUN_CONFIG)
    (tmp / DATA_STATE).write_text(json.dumps(data_state, default=_json_default, indent=1) + "\n", encoding="utf-8")
    _fsync_tree(tmp)
    os.replace(tmp, final)
    _fsync_dir(out_dir)
    prune_checkpoints(out_dir, keep_last)
    return final


# --------------------------------------------------------------------------------------------------------------
# reading


def read_run_config(ckpt: str | Path) -> dict:
    return json.loads((Path(ckpt) / RUN_CONFIG).read_text(encoding="utf-8"))


def check_compatible(ckpt: str | Path, saved: dict, current: Config, seq_len: int, world_size: int,
                     saved_world_size: int, saved_tokenizer_hash: str | None,
                     tokenizer_hash: str | None) -> list[str]:
    """Raise :class:`CheckpointMismatch` naming every field that must match and does not.

    Returns the list of other train-section fields that changed (allowed, e.g. a longer ``max_steps`` or a new
    learning rate), for the trainer to print.
    """
    problems = []
    cur = to_dict(current)
    for key, old in saved.get("model", {}).items():
        if key == "ops":  # kernel choices change speed, not the function
            continue
        new = cur["model"].get(key)
        if old != new:
            problems.append(f"model.{key}: {old!r} in the checkpoint, {new!r} now")
    resized = saved_world_size != world_size
    for key in MUST_MATCH_TRAIN:
        if resized and key in ("micro_batch_size", "grad_accum_steps"):
            continue  # another number of processes: the global batch must match instead (below)
        old, new = saved.get("train", {}).get(key), cur["train"][key]
        if old != new:
            problems.append(f"train.{key}: {old!r} in the checkpoint, {new!r} now")
    saved_seq = saved.get("data", {}).get("seq_len") or saved.get("model", {}).get("max_seq_len")
    if saved_seq != seq_len:
        problems.append(f"data.seq_len: {saved_seq!r} in the checkpoint, {seq_len!r} now")
    if resized:
        old_t, new_t = saved.get("train", {}), cur["train"]
        old_batch = old_t.get("micro_batch_size", 0) * old_t.get("grad_accum_steps", 0) * saved_world_size
        new_batch = new_t["micro_batch_size"] * new_t["grad_accum_steps"] * world_size
        if old_batch != new_batch:
            problems.append(f"global batch: {old_batch} sequences per update in the checkpoint ({saved_world_size} "
                            f"processes), {new_batch} now ({world_size}); keep micro_batch_size x grad_accum_steps "
                            f"x processes the same")
    if saved_tokenizer_hash != tokenizer_hash:
        problems.append(f"tokenizer: hash {saved_tokenizer_hash!r} in the checkpoint, {tokenizer_hash!r} for this "
                        f"run's data ({current.data.path or 'synthetic'})")
    if problems:
        raise CheckpointMismatch(f"checkpoint {ckpt} does not match this run:\n  " + "\n  ".join(problems))
    changed = []
    for key, new in cur["train"].items():
        old = saved.get("train", {}).get(key)
        if key not in ("resume", "out_dir") and old != new:
            changed.append(f"train.{key}: {old!r} -> {new!r}")
    return changed


def read_trainer_state(ckpt: str | Path) -> dict:
    return torch.load(Path(ckpt) / TRAINER_STATE, map_location="cpu", weights_only=True)


def load_checkpoint(ckpt: str | Path, model: torch.nn.Module, trainer_state: dict | None = None) -> dict:
    """Load weights into ``model`` (plain, unwrapped) and return ``{"trainer_state", "config", "data_state"}``.

    Call :func:`check_compatible` first; this function only reads.
    """
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    missing = [f for f in REQUIRED_FILES if not (ckpt / f).exists()]
    if missing:
        raise FileNotFoundError(f"{ckpt}: not a complete training checkpoint (missing {', '.join(missing)})")
    device = next(model.parameters()).device
    sd = load_file(str(ckpt / WEIGHTS), device=str(device))
    load_state(model, sd, str(ckpt))
    if trainer_state is None:
        trainer_state = read_trainer_state(ckpt)
    data_state = json.loads((ckpt / DATA_STATE).read_text(encoding="utf-8"))
    return {"trainer_state": trainer_state, "config": read_run_config(ckpt), "data_state": data_state}
