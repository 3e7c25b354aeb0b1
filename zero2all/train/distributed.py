"""Training on several processes (GPUs, machines) with PyTorch's own engine: torchrun, DDP, FSDP2, DCP.

The model code knows nothing of parallelism. A trainer builds a plain model and asks this module to
parallelize it from the outside::

    env = init_distributed(timeout_s=cfg.train.dist_timeout_s)      # reads torchrun's RANK / WORLD_SIZE / ...
    model = parallelize(build_model(cfg.model, env.device), cfg.train, env)
    optimizer = shard_optimizer(build_optimizer(model, ...), cfg.train, env)   # ZeRO-1 only; else unchanged
    for step ...:
        for micro in range(accum):
            with gradient_sync(model, enabled=micro == accum - 1):   # DDP: no all-reduce before the last one
                loss = model(x, y)[1] / accum; loss.backward()
        clip_grad_norm(model, 1.0); optimizer.step(); optimizer.zero_grad()
    save_sharded_checkpoint(dir, model, optimizer, meta, rank_state)   # torch.distributed.checkpoint

Modes (``TrainConfig.parallel``):

``ddp``    DistributedDataParallel: every rank holds the whole model and optimizer; gradients are all-reduced in
           buckets that overlap the backward pass. Optional comm hooks (torch's own): ``bf16`` (NCCL) / ``fp16``
           compress each bucket to 16 bits (half the bytes), ``powersgd`` sends a rank-r approximation with error feedback
           (Vogels et al. 2019) after ``powersgd_start_iter`` plain steps.
``zero1``  DDP + ``ZeroRedundancyOptimizer``: the optimizer state (AdamW's two moments, 8 bytes/param) is
           partitioned over ranks; each rank steps its partition and broadcasts the new parameters.
``fsdp``   FSDP2 ``fully_shard`` on every transformer block, then on the root: parameters, gradients and optimizer
           state are sharded (DTensor). ``reshard_after_forward = true`` frees each block's gathered parameters
           after its forward and gathers them again in backward (ZeRO-3-like, least memory); ``false`` keeps them
           until the backward (ZeRO-2-like, one all-gather per step less). With bf16 the mixed-precision policy
           casts parameters to bf16 for compute and reduce-scatters gradients in fp32 (``fsdp_reduce_fp32``).
           ``cpu_offload`` keeps the shards and the optimizer step on the CPU (FSDP2's CPUOffloadPolicy).
           FSDP reduces gradients every micro-step (sharded gradients are the point of ZeRO-2/3);
           ``fsdp_accum_no_sync`` instead accumulates unsharded gradients and keeps the gathered parameters
           until the last micro-step: one reduce-scatter and one all-gather per update, DDP-like memory for them.

Memory per GPU for P parameters, N ranks, fp32 master weights + AdamW (bytes): ddp 16P; zero1 8P + 8P/N;
fsdp 16P/N + one or two gathered blocks in bf16.

Activation checkpointing (``activation_checkpointing``) wraps blocks with torch's ``checkpoint_wrapper``:
``full`` every block (keeps only each block's input; one extra forward, ~+33 % compute); ``selective`` with
``ac_selective = blocks`` every ``ac_every``-th block, or ``attention``: every block, but torch's selective
checkpoint policy recomputes only the attention core (SDPA / QK^T-softmax-V) and keeps every other op's output,
as in Megatron's selective recomputation (Korthikanti et al. 2022): the attention core's activations grow as
T^2 with the naive kernel and it has few FLOPs to redo.

Checkpoints are written with ``torch.distributed.checkpoint``: each rank writes its own shards, the metadata
records global shapes, and a later run with a different number of processes (or a different mode) reads the
pieces it needs. Keys are the plain model's names (``layers.0.mlp.down_proj.weight``), so DDP, FSDP and ZeRO-1
checkpoints are interchangeable. ``export_sharded_to_hf`` turns one into a single HF directory.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from zero2all.config import ConfigError
from zero2all.fileio import replace_dir

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp", "zero1")
COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")
AC_MODES = ("none", "full", "selective")
AC_SELECTIVE = ("blocks", "attention")
SHARDED_META = "z2all.json"       # written last: a checkpoint directory with this file is complete
SHARDED_FORMAT = "zero2all-sharded"


class DistributedTimeoutError(RuntimeError):
    """A collective operation did not complete within ``train.dist_timeout_s``."""


# --------------------------------------------------------------------------------------------------------------
# process group


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


def _resolve_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device(device)


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the process group that torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) and bind this process to its GPU.

    ``backend = auto``: NCCL for CUDA tensors plus gloo for CPU tensors (``cpu:gloo,cuda:nccl``: CPU-offloaded
    shards and object collectives need gloo), gloo alone on a CPU machine. ``timeout_s`` bounds every
    collective: a rank that died or hangs makes the others fail after that long instead of waiting forever
    (NCCL: the watchdog aborts the communicator; gloo: the call raises). Without torchrun this returns a
    single-process environment and creates no process group. Calling it again returns the current group.
    """
    if not launched_by_torchrun() and not (dist.is_available() and dist.is_initialized()):
        try:
            single = _resolve_device(device, 0)
        except RuntimeError:  # an unknown device name: the trainer's own check reports it
            single = torch.device("cpu")
        return DistEnv(device=single, timeout_s=timeout_s)
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    dev = _resolve_device(device, local_rank)
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
    global _PROCESS_GROUP_USED
    _PROCESS_GROUP_USED = True
    return DistEnv(rank, world, local_rank, local_world, dev, backend, timeout_s)


_PROCESS_GROUP_USED = False  # set once init_distributed has created a process group in this process


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


def barrier(env: DistEnv) -> None:
    if env.is_distributed:
        with collective_timeout(env, "barrier"):
            dist.barrier()


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
            f"rank {env.rank}/{env.world_size}: {what} did not complete within train.dist_timeout_s="
            f"{env.timeout_s:g}s. Another process probably died or is stuck: look at the other ranks' logs "
            f"(a failed rank usually prints the real error first). Raise train.dist_timeout_s if a step or a "
            f"checkpoint legitimately takes longer. Backend message: {exc}") from exc


def all_reduce_mean(value: float | torch.Tensor, env: DistEnv) -> float:
    """Mean of a scalar over all ranks (for logging the global loss)."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().reshape(1)
    if not env.is_distributed:
        return float(t)
    t = t.to(env.device if env.device.type == "cuda" else "cpu")
    with collective_timeout(env, "all_reduce of a logged metric"):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t) / env.world_size


def memory_stats(env: DistEnv) -> dict[str, float]:
    """This rank's peak memory in GiB: CUDA allocated/reserved, or the process's peak RSS on a CPU."""
    if env.device.type == "cuda":
        return {"peak_alloc_gib": torch.cuda.max_memory_allocated(env.device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(env.device) / 2**30}
    import resource

    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def gather_memory_stats(env: DistEnv) -> list[dict[str, float]]:
    """Every rank's :func:`memory_stats`, in rank order (a collective: all ranks must call it)."""
    mine = memory_stats(env)
    if not env.is_distributed:
        return [mine]
    out: list = [None] * env.world_size
    with collective_timeout(env, "all_gather of memory statistics"):
        dist.all_gather_object(out, mine)
    return out


def format_memory(stats: list[dict[str, float]]) -> str:
    key = "peak_alloc_gib" if "peak_alloc_gib" in stats[0] else "peak_rss_gib"
    return " ".join(f"r{r}:{s[key]:.2f}G" for r, s in enumerate(stats))


# --------------------------------------------------------------------------------------------------------------
# configuration


def resolve_parallel(mode: str, env: DistEnv) -> str:
    """``auto`` -> ddp when several processes run, else none."""
    if mode not in PARALLEL_MODES:
        raise ConfigError(f"train.parallel: {mode!r} is not one of {', '.join(PARALLEL_MODES)}")
    if mode == "auto":
        return "ddp" if env.world_size > 1 else "none"
    return mode


def validate_parallel_config(tc, env: DistEnv) -> str:
    """Check the distributed fields of a TrainConfig; return the resolved mode. Messages name the field."""
    mode = resolve_parallel(tc.parallel, env)
    if tc.comm_hook not in COMM_HOOKS:
        raise ConfigError(f"train.comm_hook: {tc.comm_hook!r} is not one of {', '.join(COMM_HOOKS)}")
    if tc.activation_checkpointing not in AC_MODES:
        raise ConfigError(f"train.activation_checkpointing: {tc.activation_checkpointing!r} is not one of "
                         f"{', '.join(AC_MODES)}")
    if tc.ac_selective not in AC_SELECTIVE:
        raise ConfigError(f"train.ac_selective: {tc.ac_selective!r} is not one of {', '.join(AC_SELECTIVE)}")
    if tc.ac_every < 1:
        raise ConfigError(f"train.ac_every: must be >= 1, got {tc.ac_every}")
    if tc.comm_hook != "none" and mode not in ("ddp", "zero1"):
        raise ConfigError(f"train.comm_hook={tc.comm_hook!r} needs train.parallel = ddp or zero1 (got {mode!r}); "
                         f"FSDP reduces in its mixed-precision policy's reduce dtype instead")
    if tc.cpu_offload and mode != "fsdp":
        raise ConfigError(f"train.cpu_offload needs train.parallel = fsdp (got {mode!r})")
    if tc.powersgd_rank < 1:
        raise ConfigError(f"train.powersgd_rank: must be >= 1, got {tc.powersgd_rank}")
    if tc.comm_hook == "powersgd" and tc.powersgd_start_iter < 2:
        raise ConfigError("train.powersgd_start_iter: must be >= 2 (PowerSGD's error feedback needs warm-up "
                         "steps of plain all-reduce)")
    if tc.dist_timeout_s <= 0:
        raise ConfigError(f"train.dist_timeout_s: must be positive, got {tc.dist_timeout_s}")
    if mode in ("ddp", "fsdp", "zero1") and not env.is_distributed:
        raise ConfigError(f"train.parallel={mode!r} needs a process group: launch with torchrun "
                         f"(e.g. torchrun --nproc_per_node=2 -m zero2all.cli pretrain ...)")
    return mode


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: bf16/fp16 when asked (or ``auto`` on a GPU with bf16), else fp32."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    if precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


# --------------------------------------------------------------------------------------------------------------
# activation checkpointing


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks: ``model.layers`` (ours) or ``model.model.layers`` (HF Llama)."""
    for candidate in (model, getattr(model, "model", None)):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise TypeError(f"{type(model).__name__}: no .layers ModuleList of transformer blocks to wrap")


def _attention_core_ops() -> set:
    """ATen ops of the attention core: the SDPA kernels and the naive path's batched matmuls / softmax."""
    aten = torch.ops.aten
    names = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable", "bmm", "_softmax", "baddbmm"]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


# view-like ops cost nothing to redo and their outputs alias saved tensors anyway
_FREE_OPS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "split", "split_with_sizes",
             "select", "slice", "unsqueeze", "squeeze", "detach", "alias", "as_strided"}


def attention_core_policy():
    """A selective-checkpoint policy: recompute the attention core (and free view ops), save everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    core = _attention_core_ops()

    def policy(ctx, op, *args, **kwargs):
        if op in core or op.__name__.split(".")[0] in _FREE_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", selective: str = "blocks",
                                   every: int = 2) -> list[int]:
    """Wrap transformer blocks of ``model`` in place with torch's ``checkpoint_wrapper`` (non-reentrant).

    Returns the indices of the wrapped blocks. The wrapper only changes what autograd keeps: the loss and the
    gradients are the same as without it (recomputation replays the same ops, dropout RNG included).
    """
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode == "none":
        return []
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {', '.join(AC_MODES)}")
    blocks = transformer_blocks(model)
    kwargs: dict[str, Any] = {"preserve_rng_state": True}
    if mode == "full":
        chosen = list(range(len(blocks)))
    elif selective == "blocks":
        chosen = [i for i in range(len(blocks)) if i % every == 0]
    elif selective == "attention":
        chosen = list(range(len(blocks)))
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, attention_core_policy())
    else:
        raise ValueError(f"selective checkpointing {selective!r} is not one of {', '.join(AC_SELECTIVE)}")
    for i in chosen:
        blocks[i] = checkpoint_wrapper(blocks[i], **kwargs)
    return chosen


# --------------------------------------------------------------------------------------------------------------
# wrapping


def parallelize(model: nn.Module, tc, env: DistEnv | None = None, param_dtype: torch.dtype | None = None,
                compile_blocks: bool = False) -> nn.Module:
    """Apply activation checkpointing and the data-parallel mode of TrainConfig ``tc`` to a plain model.

    The model must already be on ``env.device`` with its initial weights (every rank builds it from the same seed;
    DDP also broadcasts rank 0's weights). ``param_dtype`` is the FSDP compute dtype (default from
    ``tc.precision``). ``compile_blocks`` compiles each block with torch.compile before wrapping (the pattern
    that keeps FSDP's hooks outside the compiled regions). Returns the module to call (DDP wraps; FSDP2 changes
    the model's class in place and returns it).
    """
    env = env or init_distributed(timeout_s=tc.dist_timeout_s)
    mode = validate_parallel_config(tc, env)
    apply_activation_checkpointing(model, tc.activation_checkpointing, tc.ac_selective, tc.ac_every)
    if compile_blocks:
        for block in transformer_blocks(model):
            block.compile()
    if mode == "none":
        return model
    if mode in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        device_ids = [env.device.index] if env.device.type == "cuda" else None
        ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
        _register_comm_hook(ddp, tc)
        return ddp
    # fsdp
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dtype = param_dtype or compute_dtype(tc.precision, env.device)
    if dtype == torch.float32:
        mp = MixedPrecisionPolicy()
    else:
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if tc.fsdp_reduce_fp32 else dtype)
    offload = CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if tc.cpu_offload else OffloadPolicy()
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again at once by the backward: never free them in between
        reshard = tc.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, offload_policy=offload, reshard_after_forward=tc.reshard_after_forward)
    model.z2all_fsdp_accum_no_sync = tc.fsdp_accum_no_sync  # read by gradient_sync
    return model


def _register_comm_hook(ddp: nn.Module, tc) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if tc.comm_hook == "bf16":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ConfigError("train.comm_hook=bf16: torch's bf16 all-reduce hook needs CUDA + NCCL; "
                              "use fp16 on CPU/gloo")
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif tc.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif tc.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=tc.powersgd_rank,
            start_powerSGD_iter=tc.powersgd_start_iter, use_error_feedback=True, warm_start=True,
            random_seed=tc.seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        ddp.z2all_powersgd_state = state


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


def is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def shard_optimizer(optimizer: torch.optim.Optimizer, tc, env: DistEnv) -> torch.optim.Optimizer:
    """ZeRO-1: rebuild ``optimizer`` as a ZeroRedundancyOptimizer with the same parameter groups and
    hyper-parameters (each rank keeps the state of about 1/N of the parameters). Other modes: unchanged."""
    if resolve_parallel(tc.parallel, env) != "zero1":
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls = type(optimizer)
    accepted = set(inspect.signature(cls.__init__).parameters)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(g) for g in optimizer.param_groups]
    for g in groups:
        for k in list(g):
            if k != "params" and k not in accepted:
                del g[k]
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **defaults)


def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-step: DDP skips its all-reduce (``no_sync``) unless ``enabled`` (the last
    micro-step of an accumulation). FSDP reduce-scatters every micro-step, unless ``fsdp_accum_no_sync``: then
    gradients accumulate unsharded and parameters stay gathered until the last micro-step (FSDP2's
    ``set_requires_gradient_sync`` / ``set_reshard_after_backward``). Single-process models: no-op."""
    plain = unwrap(model)
    if is_fsdp(plain):
        if getattr(plain, "z2all_fsdp_accum_no_sync", False):
            plain.set_requires_gradient_sync(enabled)
            plain.set_reshard_after_backward(enabled)
        return nullcontext()
    if not enabled and hasattr(model, "no_sync"):
        return model.no_sync()
    return nullcontext()


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all shards for FSDP) to ``max_norm``; return the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm and max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


# --------------------------------------------------------------------------------------------------------------
# sharded checkpoints


def comm_hook_state(model: nn.Module) -> dict | None:
    """The PowerSGD state (error feedback, warm-start matrices, iteration) of a DDP model, or None."""
    state = getattr(model, "z2all_powersgd_state", None)
    if state is None:
        return None
    return {slot: getattr(state, slot) for slot in state.__slots__ if slot != "process_group"}


def load_comm_hook_state(model: nn.Module, saved: dict | None) -> bool:
    """Restore :func:`comm_hook_state` (same world size only: error feedback is per rank). Returns True if
    restored."""
    state = getattr(model, "z2all_powersgd_state", None)
    if state is None or not saved:
        return False
    for slot, value in saved.items():
        if slot in state.__slots__ and slot != "process_group":
            setattr(state, slot, value)
    return True


def _fqn_by_param(model: nn.Module) -> dict[nn.Parameter, str]:
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out = {}
    for name, p in unwrap(model).named_parameters():
        out[p] = next(iter(_get_fqns(unwrap(model), name)))
    return out


def _zero1_local_state(model: nn.Module, optimizer) -> dict:
    """This rank's part of a ZeroRedundancyOptimizer, in the FQN-keyed layout of torch's
    ``get_optimizer_state_dict`` (``{"state": {fqn: {...}}, "param_groups": [...]}``)."""
    fqn = _fqn_by_param(model)
    state = {fqn[p]: dict(s) for p, s in optimizer.optim.state.items()}
    groups = []
    for g in optimizer.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [fqn[p] for p in g["params"]]})
    return {"state": state, "param_groups": groups}


def _zero1_load(model: nn.Module, optimizer, path: Path) -> None:
    """Load the optimizer state of this rank's ZeRO-1 partition from any sharded checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    fqn = _fqn_by_param(model)
    local_params = [p for g in optimizer.optim.param_groups for p in g["params"]]
    template: dict[str, Any] = {}
    for p in local_params:
        prefix = f"optim.state.{fqn[p]}."
        entries = {}
        for key, meta in metadata.items():
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
                entries[key[len(prefix):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
        if entries:
            template[fqn[p]] = entries
    # param groups are stored flattened as optim.param_groups.{i}.{key}; request them all
    groups_template: dict[int, dict[str, Any]] = {}
    for key in metadata:
        m = re.fullmatch(r"optim\.param_groups\.(\d+)\.(\w+)", key)
        if m:
            groups_template.setdefault(int(m.group(1)), {})[m.group(2)] = None
    loaded = {"optim": {"state": template,
                        "param_groups": [groups_template[i] for i in sorted(groups_template)]}}
    dcp.load(loaded, checkpoint_id=str(path))
    saved_groups = loaded["optim"]["param_groups"]
    local = optimizer.optim.state_dict()
    index = {id(p): i for i, p in enumerate(local_params)}
    local["state"] = {index[id(p)]: template[fqn[p]] for p in local_params if fqn[p] in template}
    if saved_groups and len(saved_groups) == len(optimizer.param_groups):
        # ZeRO keeps one local group per global group, in the same order
        for full, local_group, saved in zip(optimizer.param_groups, local["param_groups"], saved_groups):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            full.update(hyper)
            local_group.update(hyper)
    optimizer.optim.load_state_dict(local)


def save_sharded_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                            env: DistEnv, meta: dict | None = None, rank_state: dict | None = None,
                            write_extra=None) -> Path:
    """Write a sharded checkpoint directory (a collective: every rank calls it with the same ``path``).

    Layout: DCP files (``__0_0.distcp``, ..., ``.metadata``) holding ``model.*`` and ``optim.*``; ``rank{r}.pt`` with
    each rank's own state (data position, RNG, PowerSGD error feedback); ``z2all.json`` with ``meta``, the model
    config and the world size, written last. The directory is assembled under a temporary name and renamed, so
    a crash never leaves a directory that looks complete. ``write_extra(tmp_dir)`` runs on rank 0 before the
    rename (run config, tokenizer files). Multi-node: ``path`` must be on a shared filesystem.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-sharded")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    with collective_timeout(env, f"saving checkpoint {path}"):
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optim"] = _zero1_local_state(model, optimizer) if is_zero1(optimizer) else \
                get_optimizer_state_dict(model, optimizer)
        dcp.save(state, checkpoint_id=str(tmp))
    own = dict(rank_state or {})
    hook = comm_hook_state(model)
    if hook is not None:
        own["comm_hook"] = hook
    tmp_file = tmp / f".rank{env.rank}.pt.tmp"
    torch.save(own, tmp_file)
    os.replace(tmp_file, tmp / f"rank{env.rank}.pt")
    barrier(env)
    if env.is_main:
        from zero2all.config import save_json, to_dict

        plain = unwrap(model)
        info = {"format": SHARDED_FORMAT, "world_size": env.world_size, **(meta or {})}
        if hasattr(plain, "cfg"):
            info.setdefault("model", to_dict(plain.cfg))
        if write_extra is not None:
            write_extra(tmp)
        save_json(info, tmp / SHARDED_META)
        replace_dir(tmp, path)
    barrier(env)
    return path


def is_sharded_checkpoint(path: str | Path) -> bool:
    meta = Path(path) / SHARDED_META
    if not meta.exists() or not (Path(path) / ".metadata").exists():
        return False
    try:
        return json.loads(meta.read_text()).get("format") == SHARDED_FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def read_checkpoint_meta(path: str | Path) -> dict:
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path}: not a complete sharded checkpoint ({SHARDED_META} or .metadata missing)")
    return json.loads((path / SHARDED_META).read_text())


def load_sharded_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                            env: DistEnv) -> tuple[dict, dict | None]:
    """Load a checkpoint written by :func:`save_sharded_checkpoint` into ``model`` / ``optimizer``, whatever the
    number of processes or the mode that wrote it. Returns ``(meta, rank_state)``; ``rank_state`` is this rank's
    own state when the world size is unchanged, else None (the caller re-derives data positions from the global
    step). PowerSGD state is restored only for an unchanged world size (it is per-rank error feedback)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    path = Path(path)
    meta = read_checkpoint_meta(path)
    with collective_timeout(env, f"loading checkpoint {path}"):
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        zero1 = optimizer is not None and is_zero1(optimizer)
        if optimizer is not None and not zero1:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        if zero1:
            _zero1_load(model, optimizer, path)
        elif optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optim"])
    rank_state = None
    own = path / f"rank{env.rank}.pt"
    if meta.get("world_size") == env.world_size and own.exists():
        rank_state = torch.load(own, map_location="cpu", weights_only=False)
        load_comm_hook_state(model, rank_state.pop("comm_hook", None))
    return meta, rank_state


def read_rank_state(path: str | Path, rank: int = 0) -> dict | None:
    """``rank{rank}.pt`` of a sharded checkpoint (e.g. rank 0's data position when the world size changed)."""
    f = Path(path) / f"rank{rank}.pt"
    return torch.load(f, map_location="cpu", weights_only=False) if f.exists() else None


def rescale_data_state(saved: dict, current: dict, old_world: int, new_world: int) -> dict:
    """Move a data iterator's state to a different number of processes (``current``: the new iterator's state).

    Synthetic data (sample ``i`` of rank ``r`` = global sample ``i * world + r``): the global position
    ``next_sample * old_world`` is kept exactly, so the run continues the same sequence of global batches.
    Packed data (each rank shuffles its own windows): the same fraction of the epoch is kept; the window order
    after the change is that of the new layout (an unchanged world size resumes exactly).
    """
    if old_world == new_world:
        return saved
    out = dict(saved)
    if "next_sample" in saved:
        consumed = int(saved["next_sample"]) * old_world
        if consumed % new_world:
            raise ValueError(f"data position: {consumed} samples consumed by {old_world} processes cannot be split "
                             f"evenly over {new_world}")
        out["next_sample"] = consumed // new_world
        return out
    if "position" in saved and "num_windows" in current:
        out["position"] = min(int(saved["position"]) * old_world // new_world, int(current["num_windows"]) - 1)
        for key in ("world_size", "num_windows", "rank"):
            if key in current:
                out[key] = current[key]
        return out
    raise ValueError(f"data iterator state with keys {sorted(saved)}: cannot move it from {old_world} to "
                     f"{new_world} processes")


def gather_plain_model(model: nn.Module, env: DistEnv) -> nn.Module | None:
    """The plain model for saving / sampling: itself unless FSDP-sharded; then every rank gathers the full
    weights (a collective) and rank 0 gets a plain CPU copy (other ranks None)."""
    plain = unwrap(model)
    if not is_fsdp(plain):
        return plain
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from zero2all.model.z2all import build_model

    with collective_timeout(env, "gathering the full model"):
        sd = get_model_state_dict(plain, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not env.is_main:
        return None
    copy = build_model(plain.cfg, device="meta").to_empty(device="cpu")
    copy.load_state_dict(sd)
    if plain.cfg.tie_word_embeddings:
        copy.lm_head.weight = copy.embed_tokens.weight
    return copy


def latest_complete_checkpoint(out_dir: str | Path, prefix: str = "ckpt-") -> Path | None:
    """The newest complete sharded checkpoint ``out_dir/{prefix}NNNNNN`` (by step number), or None."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return None
    found = []
    for d in out_dir.iterdir():
        m = re.fullmatch(re.escape(prefix) + r"(\d+)", d.name)
        if m and d.is_dir() and is_sharded_checkpoint(d):
            found.append((int(m.group(1)), d))
    return max(found)[1] if found else None


def load_model_from_sharded(path: str | Path, device: str = "cpu"):
    """Rebuild the plain model from a sharded checkpoint in one process (no process group needed)."""
    import torch.distributed.checkpoint as dcp

    from zero2all.config import from_dict, ModelConfig
    from zero2all.model.z2all import build_model

    meta = read_checkpoint_meta(path)
    if "model" not in meta:
        raise ValueError(f"{Path(path) / SHARDED_META}: no 'model' section to rebuild the model from")
    cfg = from_dict(ModelConfig, meta["model"], "model")
    model = build_model(cfg, device="meta").to_empty(device=device)
    sd = model.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(path))
    model.load_state_dict(sd)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def export_sharded_to_hf(path: str | Path, out: str | Path, dtype: str = "float32",
                         tokenizer_dir: str | Path | None = None) -> Path:
    """Gather a sharded checkpoint into one HF ``LlamaForCausalLM`` directory."""
    from zero2all.model.io import export_hf

    model = load_model_from_sharded(path)
    return export_hf(None, out, dtype=dtype, tokenizer_dir=tokenizer_dir, model=model)
