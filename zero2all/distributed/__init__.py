"""Training on several processes (GPUs, machines) with PyTorch's own engine: torchrun, DDP, FSDP2, DCP.

The model code knows nothing of parallelism. A trainer builds a plain model and this package parallelizes it
from the outside, according to the ``[parallel]`` config section::

    env = init_distributed(device, timeout_s=cfg.parallel.timeout_s)   # torchrun's RANK / WORLD_SIZE / ...
    run = parallelize(build_model(cfg.model, env.device), cfg.parallel, env, precision="bf16")
    optimizer = run.shard_optimizer(build_optimizer(run.plain, ...))     # ZeRO-1 only; else unchanged
    for step ...:
        for micro in range(accum):
            with run.gradient_sync(micro == accum - 1):    # DDP: no all-reduce before the last micro-step
                loss = run.model(x, y)[1] / accum; loss.backward()
        clip; optimizer.step(); optimizer.zero_grad()

One module per parallelism kind: ``ddp.py``, ``fsdp.py``, ``zero1.py`` (tensor, pipeline, context and expert
parallelism will sit beside them), ``ac.py`` for activation checkpointing, ``env.py`` for the process group and
the collectives, which are the identity on one process. What a parallelized run needs later (the comm hook's
per-rank state, FSDP's accumulation mode) lives on the :class:`Parallelized` object, not on the torch modules.
Checkpoints of every mode are one format (``zero2all/checkpoint/``): parameter and optimizer-state names are the
plain model's, so DDP, FSDP2, ZeRO-1 and one process read each other's checkpoints.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from zero2all.config import ParallelConfig
from zero2all.distributed.ac import apply_activation_checkpointing, attention_core_policy, transformer_blocks
from zero2all.distributed.ddp import CommHook, apply_ddp
from zero2all.distributed.env import (
    DistEnv,
    DistributedTimeoutError,
    all_gather_object,
    all_reduce_mean,
    all_reduce_sum,
    all_true,
    any_true,
    barrier,
    broadcast_object,
    collective_timeout,
    destroy_distributed,
    finish_process,
    format_memory,
    gather_memory_stats,
    init_distributed,
    launched_by_torchrun,
    memory_stats,
    resolve_device,
)
from zero2all.distributed.mesh import (
    MeshModel,
    ParallelDims,
    build_mesh,
    data_parallel_rank,
    mesh_grad_norm_and_clip,
    needs_mesh_norm,
    plain_dims,
)
from zero2all.distributed.zero1 import is_zero1, local_optimizer

if TYPE_CHECKING:
    from zero2all.distributed.plan import Plan
    from zero2all.distributed.pp import PipelineRun

__all__ = ["DistEnv", "DistributedTimeoutError", "Parallelized", "all_gather_object", "all_reduce_mean",
           "all_reduce_sum", "all_true", "any_true", "apply_activation_checkpointing", "attention_core_policy",
           "barrier", "broadcast_object",
           "clip_grad_norm", "collective_timeout", "compute_dtype", "destroy_distributed", "finish_process",
           "format_memory", "gather_memory_stats", "init_distributed", "is_fsdp", "is_zero1",
           "launched_by_torchrun", "local_optimizer", "memory_stats", "parallelize", "resolve_device", "ParallelDims",
           "data_parallel_rank",
           "build_mesh",
           "transformer_blocks", "unwrap"]


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: bf16/fp16 when asked (or ``auto`` on a GPU with bf16), float64 for ``fp64`` (the
    whole model in float64, CPU only), else fp32."""
    if precision == "fp64":
        return torch.float64
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    if precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under DDP / torch.compile wrappers (FSDP2 keeps the module itself)."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


@dataclass
class Parallelized:
    """A model with its parallelism applied: ``model`` is what to call (a DDP wrapper, the FSDP-sharded module or
    the plain model), ``plain`` the model underneath (the same parameters; FSDP's are DTensor shards)."""

    model: nn.Module
    plain: nn.Module
    mode: str
    env: DistEnv
    config: ParallelConfig = field(default_factory=ParallelConfig)
    comm_hook: CommHook = field(default_factory=CommHook)
    dims: ParallelDims | None = None       # the device mesh (mesh.py); data-parallel rank/size for the data
    fused_rows: dict = field(default_factory=dict)  # tensor parallel: fused parameters' row layouts (tp.py)
    pipeline: "PipelineRun | None" = None  # pipeline parallelism (pp.py): this rank's stages and their schedule

    def __post_init__(self):
        if self.dims is None:
            self.dims = plain_dims(self.env)

    @property
    def fsdp(self) -> bool:
        return self.mode == "fsdp" or (self.mode == "mesh" and is_fsdp(self.plain))

    def gradient_sync(self, enabled: bool):
        """Context for one micro-step: DDP skips its all-reduce (``no_sync``) unless ``enabled`` (the last
        micro-step of an accumulation). FSDP reduce-scatters every micro-step, unless ``fsdp_accum_no_sync``:
        then gradients accumulate unsharded and parameters stay gathered until the last micro-step. One process:
        nothing to do."""
        if self.fsdp:
            if self.config.accum_no_sync():
                from zero2all.distributed.fsdp import set_fsdp_gradient_sync

                set_fsdp_gradient_sync(self.plain, enabled)
            return nullcontext()
        if not enabled and self.mode in ("ddp", "zero1"):
            return self.model.no_sync()
        return nullcontext()

    def train_context(self, batch: dict):
        """Context for a forward + backward (or an evaluation forward) of ``batch``: loss parallel under tp (the
        cross-entropy of vocab-sharded logits), ring attention and the sequence split under cp."""
        from contextlib import ExitStack

        stack = ExitStack()
        if self.dims.enabled("tp"):
            from zero2all.distributed.tp import loss_parallel_context

            stack.enter_context(loss_parallel_context())
        if self.dims.enabled("cp"):
            from zero2all.distributed.cp import context_parallel_batch

            stack.enter_context(context_parallel_batch(self.dims["cp"], self.model, batch))
        return stack

    def optimizer_context(self):
        """Context for ``optimizer.step()``. Under tp without sequence parallel the norm weights stay plain tensors
        (every tp rank computes the same gradient for them) beside DTensor shards: the foreach / fused optimizer
        kernels then take the plain ones as replicated (DTensor's ``implicit_replication``)."""
        if self.dims.enabled("tp"):
            from torch.distributed.tensor.experimental import implicit_replication

            return implicit_replication()
        return nullcontext()

    def release_graphs(self) -> int:
        """Free the CUDA graphs of ``parallel.tp_graphs`` (none elsewhere): they must be gone before the process
        group is destroyed (``graphs.BlockGraphs.release``). Returns how many graphs were freed."""
        if not self.dims.enabled("tp"):
            return 0
        from zero2all.distributed.tp import block_graphs

        graphs = block_graphs(self.plain)
        return graphs.release() if graphs is not None else 0

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """ZeRO-1: the optimizer partitioned over ranks; other modes: unchanged."""
        if self.mode != "zero1":
            return optimizer
        from zero2all.distributed.zero1 import shard_optimizer

        return shard_optimizer(optimizer)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (CPU tensors under FSDP, gathered by every rank), None elsewhere."""
        if self.pipeline is not None or self.fsdp or self.fused_rows:
            from zero2all.distributed.fsdp import gather_full_state_dict

            sd = self.pipeline.full_state_dict() if self.pipeline is not None else \
                gather_full_state_dict(self.plain, self.env)
            if sd is not None:  # tensor parallel: fused rows back in the canonical layout
                sd = {k: self.fused_rows[k].to_canonical(v) if k in self.fused_rows else v for k, v in sd.items()}
            return sd
        return self.plain.state_dict() if self.env.is_main else None

    def gather_plain_model(self) -> nn.Module | None:
        """A plain model holding the full weights, on rank 0 (others None): the model itself unless it is
        FSDP-sharded; then a CPU copy gathered by every rank (a collective)."""
        if not self.fsdp and not self.fused_rows and self.pipeline is None:
            return self.plain if self.env.is_main else None
        sd = self.full_state_dict()
        if sd is None:
            return None
        from zero2all.model.z2all import build_model

        floats = [v.dtype for v in sd.values() if v.is_floating_point()]
        copy = build_model(self.plain.cfg, device="meta").to_empty(device="cpu")
        if floats:  # the weights' own dtype (float64 under train.precision = "fp64")
            copy = copy.to(floats[0])
        copy.load_state_dict(sd)
        copy.tie_weights()
        return copy


def parallelize(model: nn.Module, pc: ParallelConfig, env: DistEnv, precision: str = "auto",
                compile_blocks: bool = False, seed: int = 0, plan: "Plan | None" = None) -> Parallelized:
    """Apply activation checkpointing and the configured data-parallel mode to a plain model.

    The model must already be on ``env.device`` with its initial weights (every rank builds it from the same
    seed; DDP also broadcasts rank 0's weights). ``precision`` sets FSDP's compute dtype. ``compile_blocks``
    compiles each block with torch.compile before wrapping (the pattern that keeps FSDP's hooks outside the
    compiled regions). ``seed`` seeds PowerSGD's random projections.

    ``plan`` (``plan.resolve``) is what to build; without it the plan is resolved here from the model's config and
    ``pc`` (no batch: the batch rules were the caller's). Every refusal is the plan's, before any mesh is built.
    """
    from zero2all.config import ConfigError
    from zero2all.distributed.plan import resolve, sections

    if plan is None:
        plan = resolve(sections(getattr(model, "cfg", None), pc), env.world_size, env.device, compile_blocks)
    mode = plan.mode
    if mode != "none" and not env.is_distributed:
        raise ConfigError(f"parallel.mode={mode!r} needs a process group: launch with torchrun "
                          f"(e.g. torchrun --nproc_per_node=2 -m zero2all.cli pretrain ...)")
    if mode != "mesh":
        apply_activation_checkpointing(model, pc.activation_checkpointing, pc.ac_selective, pc.ac_every)
    if compile_blocks and mode != "mesh":
        for block in transformer_blocks(model):
            block.compile()
    if mode == "mesh":
        return _parallelize_mesh(model, pc, env, precision, compile_blocks, plan)
    if mode in ("ddp", "zero1"):
        wrapped, hook = apply_ddp(model, pc, env, seed)
        return Parallelized(wrapped, model, mode, env, pc, hook)
    if mode == "fsdp" and pc.ep > 1:
        from zero2all.distributed.ep import apply_expert_parallel

        apply_expert_parallel(model, pc, env, compute_dtype(precision, env.device))
        return Parallelized(model, model, mode, env, pc)
    if mode == "fsdp":
        from zero2all.distributed.fsdp import apply_fsdp

        apply_fsdp(model, pc, env, compute_dtype(precision, env.device))
        return Parallelized(model, model, mode, env, pc)
    return Parallelized(model, model, mode, env, pc)


def _parallelize_mesh(model: nn.Module, pc: ParallelConfig, env: DistEnv, precision: str,
                      compile_blocks: bool, plan: "Plan") -> Parallelized:
    """tp / cp / HSDP on one device mesh, applied in the order that composes: tensor parallel on the blocks,
    activation checkpointing around them, compile per block, then FSDP2 over the data-parallel (x cp) ranks.
    What combines was decided by the plan."""
    from zero2all.distributed.graphs import tp_graphs_wanted

    tp_graphs, why_not = tp_graphs_wanted(env.device, pc, env.world_size, compile_blocks)
    if why_not and env.device.type == "cuda" and env.is_main:
        print(f"parallel.tp_graphs = auto: the blocks run eagerly, since {why_not}", flush=True)
    dims = build_mesh(pc, env)
    if pc.async_tp:
        enable_async_tp(dims, compile_blocks, env)
    fused_rows = {}
    if dims.enabled("tp"):
        from zero2all.distributed.tp import apply_tp, describe_tp_ops

        fused_rows = apply_tp(model, dims["tp"], pc.sequence_parallel, pc.tp_impl, pc.tp_chunks, tp_graphs)
        if env.is_main:
            print(describe_tp_ops(model.cfg, env.device, pc.sequence_parallel, pc.tp_impl, pc.tp_chunks,
                                  tp_graphs), flush=True)
    apply_activation_checkpointing(model, pc.activation_checkpointing, pc.ac_selective, pc.ac_every)
    if compile_blocks:
        for block in transformer_blocks(model):
            block.compile()
    if dims.enabled("pp"):  # stages (of tp-sharded blocks) over the pp ranks, FSDP2 on each stage (pp.py)
        from zero2all.distributed.pp import PipelineRun

        pipe = PipelineRun(model, pc, env, dims, compute_dtype(precision, env.device))
        return Parallelized(pipe.plain, pipe.plain, "mesh", env, pc, dims=dims, fused_rows=fused_rows,
                            pipeline=pipe)
    if dims.size("dp_shard_cp") > 1 or dims.enabled("dp_replicate"):
        from zero2all.distributed.fsdp import apply_fsdp

        mesh = dims.mesh["dp_replicate", "dp_shard_cp"] if dims.enabled("dp_replicate") else dims["dp_shard_cp"]
        apply_fsdp(model, pc, env, compute_dtype(precision, env.device), mesh=mesh)
    wrapped = MeshModel(model) if dims.enabled("cp") or dims.enabled("tp") else model
    return Parallelized(wrapped, model, "mesh", env, pc, dims=dims, fused_rows=fused_rows)


def enable_async_tp(dims, compile_blocks: bool, env: DistEnv) -> None:
    """``parallel.async_tp``: inductor's micro-pipelined tensor parallel for the compiled blocks. It rewrites each
    all-gather + matmul and matmul + reduce-scatter pair it finds in a compiled graph into chunked collectives over
    symmetric memory, so the transfers run beside the GEMMs; the tp group's symmetric memory is enabled here.
    Inductor's switch is a torch-wide setting: it stays on for the rest of the process."""
    from zero2all.config import ConfigError

    if not compile_blocks or env.device.type != "cuda":  # the plan refuses these (tp.refusals); a direct caller
        raise ConfigError("parallel.async_tp needs train.compile = true and CUDA devices")
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(dims["tp"].get_group().group_name)


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all shards for FSDP) to ``max_norm``; return the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if needs_mesh_norm(params):
        return float(mesh_grad_norm_and_clip(params, max_norm))
    if max_norm and max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
