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
import torch.nn as nn

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
    The shape was checked against the model and the batch before (the plan, ``plan.resolve``)."""
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
    parallel coordinate is ``(rank // (cp * tp)) % dp``. Plain DDP / FSDP / ZeRO-1: every rank is its own. The
    plan's rule (``plan.Plan.dp_coords``), for callers holding a parallel section only."""
    from zero2all.distributed.plan import Plan

    return Plan(world_size, pc.resolved_mode(world_size), pc.mesh_shape(world_size), pc.ep, pc).dp_coords(rank)


def _spec(t: torch.Tensor):
    mesh = getattr(t, "device_mesh", None)
    return None if mesh is None else (mesh, tuple(t.placements))


def needs_mesh_norm(params) -> bool:
    """True when the gradients live on several meshes / layouts (tp shards, FSDP 2-D shards, plain replicated
    norms) or hold partial sums: torch's one-list norm does not apply then."""
    specs = {_spec(p.grad) for p in params if p.grad is not None}
    return len(specs) > 1 or any(s is not None and any(pl.is_partial() for pl in s[1]) for s in specs)


def mesh_grad_norm_and_clip(params, max_norm: float) -> torch.Tensor:
    """The global L2 norm of gradients spread over a device mesh, and clipping to ``max_norm`` (> 0).

    Partial gradients (sequence-parallel norm weights) are first summed into their parameter's layout. Then per
    group of one (mesh, placements): torch's total norm of the group, reduced over the mesh (``full_tensor``);
    the global norm is sqrt(sum of the groups' squares). Replicated gradients count once, as they should."""
    groups: dict = {}
    for p in params:
        if p.grad is None:
            continue
        if _spec(p.grad) is not None and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
        groups.setdefault(_spec(p.grad), []).append(p.grad)
    total = torch.zeros((), dtype=torch.float64)  # float64 sums of squares: exact enough for any precision
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, foreach=True)
        n = n.full_tensor() if hasattr(n, "full_tensor") else n
        total = total + n.double().cpu() ** 2
    total = total.sqrt()
    if max_norm > 0:
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        if coef < 1.0:
            for grads in groups.values():
                torch._foreach_mul_(grads, coef)
    return total


class MeshModel(nn.Module):
    """What the trainer calls on a tp / cp mesh: the (sharded) model, returning a plain loss tensor (loss parallel
    gives a replicated DTensor) and, under cp, called with the positions of this rank's sequence chunks (set by
    ``cp.context_parallel_batch`` for the current batch). Document masks are refused under cp."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.positions: torch.Tensor | None = None

    def forward(self, tokens, targets=None, **kwargs):
        if self.positions is not None:
            if kwargs.get("doc_ids") is not None:
                raise ValueError("context parallel (parallel.cp > 1): document masks (data.document_mask, packed "
                                 "samples) are not supported by ring attention; set data.document_mask = false or "
                                 "parallel.cp = 1")
            if kwargs.get("position_ids") is None:
                kwargs["position_ids"] = self.positions
        logits, loss = self.module(tokens, targets, **kwargs)
        if loss is not None and hasattr(loss, "to_local"):
            loss = loss.to_local()
        return logits, loss


def refusals(req) -> list[str]:
    """The mesh's declared rules (``plan.resolve`` gathers them): several processes for a data-parallel mode,
    FSDP2 as the data parallelism of a mesh (tp / pp / cp / dp_replicate), and the one-process-only kernels."""
    pc, out = req.parallel, []
    if req.world_size == 1 and req.mode in ("ddp", "fsdp", "zero1"):
        out.append(f"parallel.mode={req.mode!r} needs several processes: launch with torchrun "
                   f"(e.g. torchrun --nproc_per_node=2 -m zero2all.cli pretrain ...)")
    if pc.uses_mesh() and pc.mode not in ("auto", "fsdp"):
        out.append(f"parallel.mode={pc.mode!r} is plain data parallelism; with tp / pp / cp / dp_replicate the "
                   f"data-parallel ranks use FSDP2 (dp_shard) and HSDP (dp_replicate): set parallel.mode = auto or "
                   f"fsdp")
    if pc.uses_mesh() and (pc.cpu_offload or pc.comm_hook != "none"):
        out.append("parallel.cpu_offload / parallel.comm_hook are not available with tp / pp / cp / dp_replicate; "
                   "set them off or use plain data parallelism")
    model = req.model
    if model is not None and model.ops.step_fusion != "off" and req.mode != "none":
        out.append(f"model.ops.step_fusion={model.ops.step_fusion!r} needs training in one process without a "
                   f"data-parallel wrapper (parallel mode {req.mode!r}); set it to 'off'")
    return out
