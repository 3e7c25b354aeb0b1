"""ZeRO-1: DDP for the gradients + torch's ``ZeroRedundancyOptimizer``: the optimizer state (AdamW's two moments,
8 bytes/parameter) is partitioned over ranks by whole parameters; each rank steps its partition and broadcasts
the new parameters. Memory per GPU for P parameters, N ranks: 8P + 8P/N bytes.

For checkpoints each rank contributes the state of the parameters it owns, keyed by parameter name like every
other mode's optimizer state, so a ZeRO-1 checkpoint loads into DDP, FSDP2 or one process and the reverse.
"""

from __future__ import annotations

import inspect

import torch


def shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Rebuild ``optimizer`` as a ZeroRedundancyOptimizer with the same parameter groups and hyper-parameters
    (each rank keeps the state of about 1/N of the parameters)."""
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


def is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO-1's local partition, else the optimizer itself."""
    return optimizer.optim if is_zero1(optimizer) else optimizer


def refusals(req) -> list[str]:
    """ZeRO-1's declared rules (``plan.resolve``): its partitioned optimizer is AdamW."""
    if req.mode == "zero1" and req.train is not None and req.train.optimizer == "muon":
        return ["train.optimizer = 'muon' with parallel.mode = 'zero1': ZeRO-1's partitioned optimizer takes "
                "AdamW's arguments only; use parallel.mode = 'fsdp' or 'ddp'"]
    return []
