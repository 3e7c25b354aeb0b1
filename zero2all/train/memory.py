"""What holds device memory when a run runs out of it: one line against ``z2all estimate``'s prediction, and
torch's allocation snapshot on request (``train.memory_snapshot``)."""

from __future__ import annotations

from pathlib import Path

import torch

GB = 1e9


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_breakdown(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards)."""
    params = list(model.parameters())
    out = {"parameters": sum(_local_bytes(p) for p in params),
           "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None), "optimizer": 0}
    if optimizer is not None:
        for state in getattr(optimizer, "state", {}).values():
            out["optimizer"] += sum(_local_bytes(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return out


def predicted_peak(cfg, world_size: int) -> dict | None:
    """``z2all estimate``'s peak memory parts for this run's layout (None where it cannot say)."""
    try:
        from zero2all.accounting import _memory_kwargs, peak_memory_bytes
        from zero2all.distributed.dryrun import layout_of

        model_cfg = cfg.model
        if cfg.model.moe.enabled:
            from zero2all.accounting_moe import active_dense_config

            model_cfg = active_dense_config(cfg.model)
        L = layout_of(cfg, world_size, "h100")
        return peak_memory_bytes(model_cfg, L.micro_batch_size, L.seq_len // L.cp, **_memory_kwargs(L))
    except Exception:
        return None


def start_snapshot(device: torch.device) -> bool:
    """Record every allocation from now on (CUDA only); True when recording."""
    if device.type != "cuda":
        return False
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    return True


def oom_line(where: str, device: torch.device, breakdown: dict[str, int], predicted: dict | None,
             snapshot: Path | None) -> str:
    """One line: allocated by category against the prediction, and what to change."""
    held = sum(breakdown.values())
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        head = f"{allocated / GB:.1f} of {total / GB:.1f} GB allocated"
        rest = f", the rest (activations, buffers) {(allocated - held) / GB:.1f}"
    else:
        head, rest = f"device {device}", ""
    parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in breakdown.items())
    line = f"out of memory {where}: {head}: {parts}{rest} GB"
    if predicted:
        line += (f"; z2all estimate predicted a peak of {predicted['total'] / GB:.1f} GB (model states "
                 f"{predicted['model_states'] / GB:.1f}, activations {predicted['activations'] / GB:.1f})")
    line += ("; lower train.micro_batch_size (raising train.grad_accum_steps keeps the batch), set "
             "parallel.activation_checkpointing = 'full', or shard with parallel.mode = 'fsdp' "
             "(`z2all estimate` prints a layout that fits)")
    if snapshot is not None:
        line += f"; allocation snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)"
    return line


def dump_snapshot(path: Path) -> Path | None:
    try:
        torch.cuda.memory._dump_snapshot(str(path))
        return path
    except Exception:
        return None
