"""DistributedDataParallel: every rank holds the whole model and optimizer; gradients are all-reduced in buckets
that overlap the backward pass.

Optional gradient compression with torch's own comm hooks (``parallel.comm_hook``): ``bf16`` (NCCL) / ``fp16``
send each bucket in 16 bits (half the bytes); ``powersgd`` sends a rank-r approximation with error feedback
(Vogels et al. 2019) after ``powersgd_start_iter`` plain steps. PowerSGD's state (error feedback, warm-start
matrices, iteration) belongs to this rank: :class:`CommHook` keeps it and hands it to checkpoints.
Memory per GPU for P parameters with fp32 master weights + AdamW: 16P bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from zero2all.config import ConfigError, ParallelConfig
from zero2all.distributed.env import DistEnv


class CommHook:
    """The comm hook registered on a DDP module, with its per-rank state (PowerSGD) for checkpoints."""

    def __init__(self, kind: str = "none", powersgd_state=None):
        self.kind, self.powersgd_state = kind, powersgd_state

    def state_dict(self) -> dict | None:
        s = self.powersgd_state
        if s is None:
            return None
        return {slot: getattr(s, slot) for slot in s.__slots__ if slot != "process_group"}

    def load_state_dict(self, saved: dict | None) -> bool:
        """Restore :meth:`state_dict` (same world size only: error feedback is per rank); True if restored."""
        s = self.powersgd_state
        if s is None or not saved:
            return False
        for slot, value in saved.items():
            if slot in s.__slots__ and slot != "process_group":
                setattr(s, slot, value)
        return True


def apply_ddp(model: nn.Module, pc: ParallelConfig, env: DistEnv, seed: int = 0) -> tuple[nn.Module, CommHook]:
    """Wrap ``model`` (already on ``env.device``) in DDP and register the configured comm hook. DDP broadcasts
    rank 0's weights, so every rank starts from the same model."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [env.device.index] if env.device.type == "cuda" else None
    ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    hook = CommHook(pc.comm_hook)
    if pc.comm_hook == "bf16":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ConfigError("parallel.comm_hook=bf16: torch's bf16 all-reduce hook needs CUDA + NCCL; "
                              "use fp16 on CPU/gloo")
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif pc.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif pc.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=pc.powersgd_rank,
            start_powerSGD_iter=pc.powersgd_start_iter, use_error_feedback=True, warm_start=True,
            random_seed=seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        hook.powersgd_state = state
    return ddp, hook
