"""One plan of what runs: ``plan = resolve(cfg, world_size)`` decides the parallel mode, the device mesh's shape
and dimension names, each rank's data-parallel coordinate, and refuses every combination that cannot run, before
any process group or model exists.

The rules are not written here: each parallel module declares what it needs and refuses, as a small function
``refusals(req) -> list[str]`` next to its code (``ddp.py``, ``fsdp.py``, ``zero1.py``, ``mesh.py``, ``tp.py``,
``cp.py``, ``pp.py``, ``ep.py``, ``graphs.py``), and :func:`resolve` gathers them in :data:`RULES`. A refusal is one
sentence saying why and what would work; :class:`PlanRefusal` (a ``ConfigError``: one line and exit status 2 from
the CLI) carries it with the name of the module whose rule it is.

Who reads the plan: the CLI (before the trainer starts), the trainer (before it joins the process group; the data
iterators take ``plan.dp_coords(rank)``), ``parallelize()`` (which executes it), ``z2all pretrain --dry-run`` and
``z2all estimate`` (their ``accounting.Layout`` is :meth:`Plan.layout`).

``resolve`` is pure: it reads the config sections, the number of processes and (when known) the device; it
changes nothing and builds nothing. With ``world_size = None`` (a config checked before the launch is known) the
rules that depend on the number of processes are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from zero2all.config import ConfigError, ParallelConfig
from zero2all.distributed import cp, ddp, ep, fsdp, graphs, mesh, pp, tp, zero1

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# every parallel module's declared refusals, in the order they are asked (the first reason found is raised)
RULES = (("mesh", mesh.refusals), ("ddp", ddp.refusals), ("fsdp", fsdp.refusals), ("zero1", zero1.refusals),
         ("tp", tp.refusals), ("cp", cp.refusals), ("pp", pp.refusals), ("ep", ep.refusals),
         ("graphs", graphs.refusals))


class PlanRefusal(ConfigError):
    """A combination the plan refuses: ``rule`` names the module whose declared rule it is."""

    def __init__(self, reason: str, rule: str):
        super().__init__(reason)
        self.reason, self.rule = reason, rule


@dataclass
class Request:
    """What the rules see: the config sections (``None`` where the caller has none: ``parallelize`` on a bare
    model knows no batch), the number of processes (``None``: not known yet), the resolved mode, the mesh shape
    (``None`` without a world size) and, when known, the device and whether the blocks are compiled."""

    parallel: ParallelConfig
    model: object | None
    train: object | None
    data: object | None
    post: object | None
    world_size: int | None
    mode: str
    shape: dict[str, int] | None
    device: torch.device | None = None
    compile_blocks: bool | None = None

    @property
    def seq_len(self) -> int | None:
        if self.data is not None and getattr(self.data, "seq_len", 0):
            return self.data.seq_len
        return self.model.max_seq_len if self.model is not None else None

    @property
    def moe(self) -> bool:
        return self.model is not None and self.model.moe.enabled

    def size(self, dim: str) -> int:
        """A mesh dimension's size: from the shape when the world size is known, else the configured one (dp_shard
        = -1 unknown: 1)."""
        if self.shape is not None:
            return self.shape[dim]
        value = getattr(self.parallel, dim)
        return max(value, 1)


@dataclass(frozen=True)
class Plan:
    """What ``parallelize()`` builds: the mode (none / ddp / zero1 / fsdp / mesh), the mesh's shape over
    :data:`DIMS` (outermost first) and its expert-parallel degree."""

    world_size: int
    mode: str
    shape: dict[str, int]
    ep: int = 1
    parallel: ParallelConfig = field(default_factory=ParallelConfig, compare=False, repr=False)

    @property
    def uses_mesh(self) -> bool:
        return self.mode == "mesh"

    @property
    def dim_names(self) -> tuple[str, ...]:
        """The mesh dimensions of more than one rank (empty: no mesh)."""
        return tuple(d for d in DIMS if self.shape[d] > 1) if self.uses_mesh else ()

    @property
    def dp_size(self) -> int:
        """How many slices each global batch is cut into (the data-parallel ranks)."""
        if not self.uses_mesh:
            return self.world_size
        return self.shape["dp_replicate"] * self.shape["dp_shard"]

    def dp_coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, dp_size) of global rank ``rank``: ``init_device_mesh`` lays ranks out row-major over
        :data:`DIMS`, so the data-parallel coordinate is ``(rank // (cp * tp)) % dp``; pipeline, tp and cp ranks
        of one replica read the same sequences. Plain DDP / FSDP / ZeRO-1: every rank is its own."""
        if not self.uses_mesh:
            return rank, self.world_size
        return (rank // (self.shape["cp"] * self.shape["tp"])) % self.dp_size, self.dp_size

    @property
    def zero(self) -> int:
        """The ZeRO stage the accounting assumes: 3 where FSDP2 shards the parameters, 1 for ZeRO-1, else 0."""
        if self.mode == "fsdp" or (self.uses_mesh and self.shape["dp_shard"] * self.shape["cp"] > 1):
            return 3
        return 1 if self.mode == "zero1" else 0

    def describe(self) -> str:
        dims = " x ".join(f"{d}={self.shape[d]}" for d in self.dim_names)
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        return f"{self.mode} on {self.world_size} process(es)" + (f": {dims}" if dims else "") + ep

    def layout(self, cfg, gpu: str = "h100", **overrides):
        """The ``accounting.Layout`` of this plan for ``cfg`` (``z2all estimate``, ``--dry-run``): the parallel
        settings come from the plan, the batch and kernels from the config; ``overrides`` replace fields."""
        from zero2all.accounting import Layout

        pc, ops = cfg.parallel, cfg.model.ops
        recompute = {"none": "none", "full": "full", "selective": "selective"}[pc.activation_checkpointing]
        fields = dict(gpus=self.world_size, gpu=gpu, zero=self.zero, tp=self.shape["tp"], pp=self.shape["pp"],
                      cp=self.shape["cp"], micro_batch_size=cfg.train.micro_batch_size,
                      seq_len=cfg.data.seq_len or cfg.model.max_seq_len, grad_accum_steps=cfg.train.grad_accum_steps,
                      recompute=recompute, sequence_parallel=pc.sequence_parallel if self.shape["tp"] > 1 else None,
                      fused_kernels=ops.rmsnorm != "torch" and ops.swiglu != "torch",
                      fused_cross_entropy=ops.cross_entropy != "torch", fused_linear=ops.fused_linear != "torch",
                      pp_microbatches=pc.pp_microbatches, pp_stages_per_rank=pc.pp_stages_per_rank,
                      residual_in_fp32=cfg.model.residual_in_fp32)
        fields.update(overrides)
        return Layout(**fields)


def sections(model_cfg=None, parallel: ParallelConfig | None = None):
    """A config-like object of the sections a caller has (``parallelize`` on a bare model: the model's config and
    the parallel section; no batch, so the batch rules are skipped)."""
    return SimpleNamespace(model=model_cfg, parallel=parallel or ParallelConfig(), train=None, data=None, post=None)


def request(cfg, world_size: int | None, device: torch.device | None = None,
            compile_blocks: bool | None = None) -> Request:
    pc = cfg.parallel
    pc.validate(None)      # each field on its own (ranges, choices): the config's part
    mode = pc.resolved_mode(world_size or 1)
    shape = None
    if world_size is not None:
        try:
            shape = pc.mesh_shape(world_size)
        except ConfigError as e:
            raise PlanRefusal(str(e), "mesh") from None
    train = getattr(cfg, "train", None)
    if compile_blocks is None and train is not None:
        compile_blocks = bool(train.compile)
    return Request(pc, getattr(cfg, "model", None), train, getattr(cfg, "data", None), getattr(cfg, "post", None),
                   world_size, mode, shape, device, compile_blocks)


def refusals(cfg, world_size: int | None, device: torch.device | None = None,
             compile_blocks: bool | None = None) -> list[tuple[str, str]]:
    """Every (rule, reason) the declared rules give for this run (empty: it runs)."""
    req = request(cfg, world_size, device, compile_blocks)
    return [(name, reason) for name, rule in RULES for reason in rule(req)]


def resolve(cfg, world_size: int | None, device: torch.device | None = None,
            compile_blocks: bool | None = None) -> Plan:
    """The plan of ``cfg`` (a ``Config``, or :func:`sections`) on ``world_size`` processes, or the first refusal
    of a declared rule as :class:`PlanRefusal`. ``device`` (when known) lets the rules that depend on it (CUDA
    graphs, async tp) decide; ``compile_blocks`` defaults to ``train.compile``."""
    req = request(cfg, world_size, device, compile_blocks)
    for name, rule in RULES:
        for reason in rule(req):
            raise PlanRefusal(reason, name)
    if req.shape is not None:
        world, shape = world_size, req.shape
    else:  # no launch known: the smallest world the configured sizes run on (dp_shard = -1: 1)
        shape = {d: req.size(d) for d in DIMS}
        world = max(shape["pp"] * shape["dp_replicate"] * shape["dp_shard"] * shape["cp"] * shape["tp"],
                    req.parallel.ep)
    return Plan(world, req.parallel.resolved_mode(world), shape, req.parallel.ep, req.parallel)


def launched_world_size(default: int = 1) -> int:
    """The number of processes of this run before joining the process group: the group's size when one exists,
    torchrun's ``WORLD_SIZE`` when launched by it, else ``default``."""
    import torch.distributed as dist

    from zero2all.distributed.env import _env_int, launched_by_torchrun

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if launched_by_torchrun():
        return _env_int("WORLD_SIZE", default)
    return default
