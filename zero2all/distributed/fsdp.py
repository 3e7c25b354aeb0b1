"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded over the ranks as DTensors.

Every transformer block is one FSDP unit, then the root (embeddings, final norm, LM head).
``reshard_after_forward = true`` frees each block's gathered parameters after its forward and gathers them again
in backward (ZeRO-3-like, least memory); ``false`` keeps them until the backward (ZeRO-2-like, one all-gather per
step less). With bf16 the mixed-precision policy casts parameters to bf16 for compute and reduce-scatters
gradients in fp32 (``fsdp_reduce_fp32``). ``cpu_offload`` keeps the shards and the optimizer step on the CPU.
FSDP reduces gradients every micro-step (sharded gradients are the point of ZeRO-2/3); ``fsdp_accum_no_sync``
instead accumulates unsharded gradients and keeps the gathered parameters until the last micro-step: one
reduce-scatter and one all-gather per update, DDP-like memory for them.
Memory per GPU for P parameters, N ranks: 16P/N bytes + one or two gathered blocks in bf16.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zero2all.config import ParallelConfig
from zero2all.distributed.ac import transformer_blocks
from zero2all.distributed.env import DistEnv, collective_timeout


def apply_fsdp(model: nn.Module, pc: ParallelConfig, env: DistEnv, param_dtype: torch.dtype,
               mesh=None) -> nn.Module:
    """Shard ``model`` in place (FSDP2 changes the module's class) and return it. ``mesh``: the data-parallel
    sub-mesh of a device mesh (1-D: shard over it; 2-D (replicate, shard): HSDP); None = all ranks."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if param_dtype in (torch.float32, torch.float64):  # no casts: the parameters' own dtype
        mp = MixedPrecisionPolicy()
    else:
        mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=torch.float32 if pc.fsdp_reduce_fp32 else param_dtype)
    offload = CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if pc.cpu_offload else OffloadPolicy()
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again at once by the backward: never free them in between
        reshard = pc.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload,
               reshard_after_forward=pc.reshard_after_forward)
    return model


def set_fsdp_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """``fsdp_accum_no_sync``: reduce-scatter and reshard only on the last micro-step of an update."""
    model.set_requires_gradient_sync(enabled)
    model.set_reshard_after_backward(enabled)


def gather_full_state_dict(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor] | None:
    """Every rank takes part in gathering the full weights; rank 0 gets them as CPU tensors, others None."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with collective_timeout(env, "gathering the full model"):
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if env.is_main else None


def refusals(req) -> list[str]:
    """FSDP2's declared rules (``plan.resolve``): CPU offload is FSDP2's; LoRA adapters are not sharded."""
    pc, out = req.parallel, []
    if pc.cpu_offload and req.mode != "fsdp" and (req.world_size or pc.mode != "auto") and not pc.uses_mesh():
        out.append(f"parallel.cpu_offload needs parallel.mode = fsdp (got {req.mode!r})")
    post = req.post
    if post is not None and getattr(post, "lora_rank", 0) and req.mode == "fsdp":
        out.append("post.lora_rank: LoRA runs use parallel.mode=ddp (or none), not fsdp: the adapters are a small "
                   "share of the memory")
    return out
