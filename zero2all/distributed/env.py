"""The process environment: which rank this process is, its device, and the few collectives the trainer uses.

Every collective here is a no-op (or the identity) on one process, so the trainer and the checkpoint code call
them unconditionally instead of guarding each call with ``if distributed``. Launch several processes with torchrun
(``torchrun --nproc_per_node=N -m zero2all.cli pretrain ...``); it sets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT, which :func:`init_distributed` reads.
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class DistributedTimeoutError(RuntimeError):
    """A collective operation did not complete within ``parallel.timeout_s``."""


@dataclass
class DistEnv:
    """Where this process sits in the job. Without torchrun: rank 0 of 1, no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    timeout_s: float = 600.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None and dist.is_available() and dist.is_initialized()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def resolve_device(setting: str = "auto", local_rank: int = 0, option: str = "train.device") -> torch.device:
    """``auto``: this process's CUDA GPU if there is one, else the CPU; otherwise ``cpu``, ``cuda`` or ``cuda:N``.
    Errors (a ConfigError: one line) name ``option``, the setting that chose the device."""
    from zero2all.config import ConfigError

    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(setting)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{option}: {setting!r} is not auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{option}: {setting!r} was asked for but no CUDA GPU is available; use cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{option}: {setting!r}, but this machine has {torch.cuda.device_count()} CUDA GPU(s) "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
        if device.index is None:
            device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return device


_PROCESS_GROUP_USED = False  # set once init_distributed has created a process group in this process


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the process group that torchrun describes in the environment and bind this process to its GPU.

    ``backend = auto``: NCCL for CUDA tensors plus gloo for CPU tensors (``cpu:gloo,cuda:nccl``: CPU-offloaded
    shards and object collectives need gloo), gloo alone on a CPU machine. ``timeout_s`` bounds every
    collective: a rank that died or hangs makes the others fail after that long instead of waiting forever.
    Without torchrun this returns a single-process environment and creates no process group. Calling it again
    returns the current group.
    """
    global _PROCESS_GROUP_USED
    if not launched_by_torchrun() and not (dist.is_available() and dist.is_initialized()):
        return DistEnv(device=resolve_device(device, 0), timeout_s=timeout_s)
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, local_world, dev,
                       dist.get_backend(), timeout_s)
    if backend == "auto":
        backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                            **kwargs)
    _PROCESS_GROUP_USED = True
    return DistEnv(rank, world, local_rank, local_world, dev, backend, timeout_s)


def finish_process(code: int = 0) -> int:
    """End a worker process that used a process group, skipping the interpreter's teardown.

    After a completed run (everything written, the group destroyed), the C++ teardown of gloo's threads at
    interpreter exit sometimes aborts the process ("terminate called without an active exception", SIGABRT),
    which torchrun then reports as a failed worker although the work is done. ``os._exit`` leaves without that
    teardown. A process that never created a group just gets ``code`` back.
    """
    if not _PROCESS_GROUP_USED:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def destroy_distributed() -> None:
    """Leave the process group at the end of a run. The barrier first keeps one rank from tearing its
    connections down while another still uses them (gloo aborts the process when that happens)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


_TIMEOUT_PATTERN = re.compile(r"timed? ?out|timeout|watchdog", re.IGNORECASE)


@contextmanager
def collective_timeout(env: DistEnv, what: str = "a collective operation"):
    """Turn a backend's timeout error into :class:`DistributedTimeoutError` with a message that says what to do."""
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        if not _TIMEOUT_PATTERN.search(str(exc)):
            raise
        raise DistributedTimeoutError(
            f"rank {env.rank}/{env.world_size}: {what} did not complete within parallel.timeout_s="
            f"{env.timeout_s:g}s. Another process probably died or is stuck: look at the other ranks' logs "
            f"(a failed rank usually prints the real error first). Raise parallel.timeout_s if a step or a "
            f"checkpoint legitimately takes longer. Backend message: {exc}") from exc


# ------------------------------------------------------------------------------------------------------------
# collectives that are the identity on one process


def barrier(env: DistEnv) -> None:
    if env.is_distributed:
        with collective_timeout(env, "barrier"):
            dist.barrier()


def all_reduce_mean(value: float | torch.Tensor, env: DistEnv) -> float:
    """Mean of a scalar over all ranks (for logging the global loss)."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().reshape(1)
    if not env.is_distributed:
        return float(t)
    t = t.to(env.device if env.device.type == "cuda" else "cpu")
    with collective_timeout(env, "all_reduce of a logged metric"):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t) / env.world_size


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Element-wise sum of a tensor over all ranks (a new tensor; the identity on one process)."""
    if not env.is_distributed:
        return t
    t = t.detach().clone()
    with collective_timeout(env, "all_reduce of logged statistics"):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_true(flag: bool, env: DistEnv) -> bool:
    """True when ``flag`` is true on every rank (one all-reduce of the minimum)."""
    if not env.is_distributed:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=env.device if env.device.type == "cuda" else "cpu")
    with collective_timeout(env, "all_reduce of a flag"):
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def any_true(flag: bool, env: DistEnv) -> bool:
    """True when ``flag`` is true on some rank."""
    return not all_true(not flag, env)


def broadcast_object(obj: Any, env: DistEnv, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (a picklable value)."""
    if not env.is_distributed:
        return obj
    box = [obj]
    with collective_timeout(env, "broadcast of a value"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any, env: DistEnv) -> list:
    """Every rank's ``obj``, in rank order."""
    if not env.is_distributed:
        return [obj]
    out: list = [None] * env.world_size
    with collective_timeout(env, "all_gather of values"):
        dist.all_gather_object(out, obj)
    return out


def memory_stats(env: DistEnv) -> dict[str, float]:
    """This rank's peak memory in GiB: CUDA allocated/reserved, or the process's peak RSS on a CPU."""
    if env.device.type == "cuda":
        return {"peak_alloc_gib": torch.cuda.max_memory_allocated(env.device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(env.device) / 2**30}
    import resource

    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def gather_memory_stats(env: DistEnv) -> list[dict[str, float]]:
    """Every rank's :func:`memory_stats`, in rank order (a collective: all ranks must call it)."""
    return all_gather_object(memory_stats(env), env)


def format_memory(stats: list[dict[str, float]]) -> str:
    key = "peak_alloc_gib" if "peak_alloc_gib" in stats[0] else "peak_rss_gib"
    return " ".join(f"r{r}:{s[key]:.2f}G" for r, s in enumerate(stats))
