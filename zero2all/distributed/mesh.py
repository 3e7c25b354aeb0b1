"""The device mesh: every process's place along each parallelism dimension, as one torch ``DeviceMesh``.

The processes form a 5-D grid, outermost first::

    pp  x  dp_replicate  x  dp_shard  x  cp  x  tp          (product = world size)

``tp`` is innermost so that a tensor-parallel group is made of neighbouring ranks (one node's GPUs, on NVLink:
TP exchanges activations twice per layer and needs the fastest links); ``pp`` is outermost (point-to-point
activations between stages, the least traffic, fine across nodes). Sub-meshes by name::

    mesh["tp"]            the tensor-parallel group (DTensor parallelize_module)
    mesh["cp"]            the context-parallel ring (ring attention)
    mesh["pp"]            the pipeline (torch.distributed.pipelining)
    mesh["dp"]            dp_replicate x dp_shard flattened: ranks that read different sequences (data loading)
    mesh["dp_shard_cp"]   dp_shard x cp flattened: FSDP2 shards parameters over it (cp ranks hold the same
                          weights and compute gradients on different chunks of the same sequences)
    mesh["dp_cp"]         dp x cp flattened: the ranks whose losses are averaged for logging

Batch semantics do not depend on the mesh: a step's global batch is dp x grad_accum_steps x micro_batch_size
sequences; the tp and cp ranks of one data-parallel replica read the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zero2all.config import ParallelConfig
from zero2all.distributed.env import DistEnv, collective_timeout

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}


@dataclass
class ParallelDims:
    """The mesh shape and, on several processes, the ``DeviceMesh`` with its named and flattened sub-meshes.

    On one process (or with plain DDP / FSDP / ZeRO-1, where every rank is a data-parallel rank) ``mesh`` is None
    and the sizes say so: ``dp`` is the world, every other dimension 1."""

    shape: dict[str, int]
    mesh: object | None = None              # torch.distributed.device_mesh.DeviceMesh
    env: DistEnv = field(default_factory=DistEnv)
    flat: dict = field(default_factory=dict)  # the flattened sub-meshes by name (kept here, not sliced again)

    def size(self, name: str) -> int:
        """Size of a dimension or of a flattened one (``dp``, ``dp_shard_cp``, ``dp_cp``)."""
        parts = FLATTENED.get(name, (name,))
        n = 1
        for p in parts:
            n *= self.shape[p]
        return n

    def rank(self, name: str) -> int:
        """This process's coordinate along a dimension (0 without a mesh or for a dimension of size 1)."""
        if self.mesh is None:
            return self.env.rank if name in ("dp", "dp_shard", "dp_shard_cp", "dp_cp") else 0
        return self[name].get_local_rank()

    def __getitem__(self, name: str):
        if self.mesh is None:
            raise KeyError(f"no device mesh on this run (dimension {name!r})")
        return self.flat[name] if name in self.flat else self.mesh[name]

    def enabled(self, name: str) -> bool:
        return self.size(name) > 1

    @property
    def dp_rank(self) -> int:
        """Which slice of every global batch this process reads (the same for the tp and cp ranks of a replica)."""
        return self.rank("dp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    def describe(self) -> str:
        return " x ".join(f"{d}={self.shape[d]}" for d in DIMS if self.shape[d] > 1) or "one process"

    def reduce_mean(self, value: float | torch.Tensor, over: str = "dp_cp") -> float:
        """Mean of a scalar over a (flattened) dimension: a loss averaged over the data-parallel and context-
        parallel ranks (tp ranks hold the same value). Without a mesh: over all ranks."""
        from zero2all.distributed.env import all_reduce_mean

        if self.mesh is None:
            return all_reduce_mean(value, self.env)
        t = torch.as_tensor(value, dtype=torch.float64).detach().reshape(1)
        t = t.to(self.env.device if self.env.device.type == "cuda" else "cpu")
        with collective_timeout(self.env, f"all_reduce of a logged metric over {over}"):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self[over].get_group())
        return float(t) / self.size(over)


def plain_dims(env: DistEnv) -> ParallelDims:
    """Data parallelism only (DDP / FSDP / ZeRO-1, or one process): every rank reads its own sequences."""
    return ParallelDims({"pp": 1, "dp_replicate": 1, "dp_shard": env.world_size, "cp": 1, "tp": 1}, None, env)


def build_mesh(pc: ParallelConfig, env: DistEnv) -> ParallelDims:
    """``init_device_mesh`` over the whole job with the five named dimensions, plus the flattened ones.
    The shape was checked against the model and the batch before (``config.check_mesh``)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = pc.mesh_shape(env.world_size)
    if not pc.uses_mesh():
        return plain_dims(env)
    mesh = init_device_mesh(env.device.type, tuple(shape[d] for d in DIMS), mesh_dim_names=DIMS)
    flat = {name: mesh[parts]._flatten(name) for name, parts in FLATTENED.items()}
    return ParallelDims(shape, mesh, env, flat)


def data_parallel_rank(pc: ParallelConfig, rank: int, world_size: int) -> tuple[int, int]:
    """(dp_rank, dp_size) of global rank ``rank`` without building the mesh (the data iterators are made first):
    ``init_device_mesh`` lays ranks out row-major over (pp, dp_replicate, dp_shard, cp, tp), so the data-
    parallel coordinate is ``(rank // (cp * tp)) % dp``. Plain DDP / FSDP / ZeRO-1: every rank is its own."""
    if not pc.uses_mesh():
        return rank, world_size
    shape = pc.mesh_shape(world_size)
    dp = shape["dp_replicate"] * shape["dp_shard"]
    return (rank // (shape["cp"] * shape["tp"])) % dp, dp
