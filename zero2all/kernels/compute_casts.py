"""Compute-dtype copies of the weights, made once per optimizer step instead of twice per micro-batch.

The lean projections (``kernels/fused_linear.py``) keep float32 master weights and cast each one to the compute
dtype (bf16) in their forward and again in their backward, so that no copy outlives its GEMM. With gradient
accumulation over ``a`` micro-batches that is ``2 a`` casts of every weight per optimizer step, each reading
4 bytes and writing 2 per parameter, while the weights change only at the step. ``COMPUTE_CASTS`` keeps the first
cast and hands it to the other ``2 a - 1`` GEMMs, at the price of holding 2 bytes per parameter from the first
forward to the step (the copies autocast would keep anyway on the plain path).

An entry is keyed by the weight's storage address, shape, strides and the dtypes, and used only while it describes
the very same tensor object (a weak reference) at the same ``_version`` (every in-place write, the optimizer's
included, bumps it), so a stale copy is never read. Every ``torch.optim.Optimizer.step`` also empties the cache
(a global step hook), which releases the copies' memory. Off by default (``COMPUTE_CASTS.enabled``): under
FSDP the gathered weights are freed after each use, and a cache would keep them alive.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


class ComputeCasts:
    def __init__(self):
        self.enabled = False
        self.hits = 0                       # casts served from the cache (for tests and benchmarks)
        self._entries: dict[tuple, tuple] = {}

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight.to(dtype)``, from the cache when it is current (and caching is on)."""
        if weight.dtype == dtype or not self.enabled or weight.is_inference():
            return weight.to(dtype)
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, dtype)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            self.hits += 1
            return entry[2]
        cast = weight.detach().to(dtype)
        self._entries[key] = (weakref.ref(weight), weight._version, cast)
        return cast

    def clear(self, *_args) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


COMPUTE_CASTS = ComputeCasts()
register_optimizer_step_post_hook(COMPUTE_CASTS.clear)
