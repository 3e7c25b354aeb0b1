"""ONE training-checkpoint format for every run: a torch.distributed.checkpoint (DCP) directory.

One process is simply world size 1: the same files, the same code path. Layout of ``OUT/ckpt-000200/``::

    .metadata, __<rank>_<i>.distcp   DCP: the parts below, each rank writing its own shards
        model.*                      the plain model's parameters by name (ModelState)
        optim.state.*                per-parameter optimizer state by the same names (OptimizerState)
        trainer.json                 step, tokens seen, skipped updates, time, LR schedule, loss scaler
        data.rank<r>, rng.rank<r>    each rank's data iterator position and RNG states
        comm_hook.rank<r>            DDP PowerSGD error feedback (only when used)
    z2all.json                       format, version, step, world size, parallel mode, model config, tokenizer hash
    config.json                      the whole run config
    tokenizer files, adapter/        copied for self-contained use (``zero2all.load_model`` reads this directory)
    manifest.json                    every other file's size and SHA-256; written last

Crash safety: everything is written into a hidden temporary directory beside the final name, fsynced, and put
in place with one atomic directory swap, never skipped (an existing ``ckpt-<step>`` of an abandoned line is
replaced whole). A process killed at any moment leaves the previous checkpoints as they were.

Resuming reads the pieces each rank needs whatever wrote them: saved by DDP, resumed by FSDP2 or one process, or
the reverse, with any number of processes. Model and optimizer tensors are resharded by DCP; the data iterator
rescales its own position (``zero2all/data/protocol.py``); RNG states of ranks that did not exist come from rank
0. Files: ``state.py`` (the Stateful parts), ``files.py`` (manifest, verification, lines, pruning), ``compat.py``
(what must match to resume). Converting earlier formats: ``zero2all/train/convert.py``.
"""

from __future__ import annotations

import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from zero2all.checkpoint.files import (
    FORMAT,
    FORMAT_VERSION,
    META,
    RUN_CONFIG,
    CheckpointError,
    all_files,
    checkpoint_name,
    describe_files,
    hash_threads,
    is_checkpoint,
    legacy_kind,
    list_checkpoints,
    move_aside_after,
    newest_verified,
    prune,
    read_meta,
    remove_stale_temporaries,
    step_of,
    verify,
    write_manifest,
)
from zero2all.checkpoint.state import (
    JsonState,
    LoadTemplate,
    ModelState,
    OptimizerState,
    RankStates,
    capture_rng_state,
    restore_rng_state,
)
from zero2all.distributed.env import DistEnv, all_gather_object, barrier, collective_timeout

__all__ = ["CheckpointError", "FORMAT", "FORMAT_VERSION", "JsonState", "ModelState", "OptimizerState", "RankStates",
           "RUN_CONFIG", "capture_rng_state", "checkpoint_name", "is_checkpoint", "legacy_kind", "list_checkpoints",
           "load", "move_aside_after", "newest_verified", "prune", "read_meta", "read_run_config",
           "restore_rng_state", "save",
           "step_of", "verify"]


@contextmanager
def _one_process_is_fine():
    """DCP warns when no process group exists; one process is world size 1 here, by design."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(path: Path, parts: dict[str, Any], env: DistEnv, meta: dict,
         write_extra: Callable[[Path], None] | None = None) -> Path:
    """Write checkpoint ``path`` from the Stateful ``parts`` (a collective: every rank calls it with the same
    arguments). ``meta`` goes into ``z2all.json`` (with format, version and world size added); ``write_extra(tmp)``
    runs on rank 0 before the manifest (run config, tokenizer files, adapter). Multi-node: ``path`` must be on a
    shared filesystem."""
    import torch.distributed.checkpoint as dcp

    from zero2all.fileio import fsync_tree, replace_dir, save_json

    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    if env.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        tmp.mkdir()
    barrier(env)
    try:
        with collective_timeout(env, f"saving checkpoint {path}"), _one_process_is_fine():
            # several shard files per rank, written and then hashed in parallel
            dcp.save(parts, checkpoint_id=str(tmp),
                     storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=hash_threads()))
        # each rank hashes the shard files it wrote (DCP names them __<rank>_<i>.distcp), in parallel
        mine = describe_files(tmp, sorted(p.name for p in tmp.glob(f"__{env.rank}_*.distcp")))
        described: dict[str, dict] = {}
        for part in all_gather_object(mine, env):
            described.update(part)
        if env.is_main:
            if write_extra is not None:
                write_extra(tmp)
            save_json({"format": FORMAT, "version": FORMAT_VERSION, "world_size": env.world_size, **meta},
                      tmp / META)
            rest = [n for n in all_files(tmp) if n not in described]
            described.update(describe_files(tmp, rest))
            write_manifest(tmp, described)
            fsync_tree(tmp)
            replace_dir(tmp, path)
    except BaseException:
        # a failed write (a full disk) leaves no half-written .tmp-ckpt-* behind: it would only take more space
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier(env)
    return path


def load(path: Path, parts: dict[str, Any], env: DistEnv) -> None:
    """Load the Stateful ``parts`` from checkpoint ``path`` in place (a collective). A :class:`RankStates` part is
    read for every rank of the run that wrote the checkpoint (its ``saved_world``)."""
    import torch.distributed.checkpoint as dcp

    request = {k: LoadTemplate(v) if isinstance(v, RankStates) else v for k, v in parts.items()}
    with collective_timeout(env, f"loading checkpoint {path}"), _one_process_is_fine():
        dcp.load(request, checkpoint_id=str(path))


def read_run_config(path: Path) -> dict:
    """The run config (``config.json``) a checkpoint was written with."""
    import json

    f = Path(path) / RUN_CONFIG
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f} is unreadable ({e})") from None
