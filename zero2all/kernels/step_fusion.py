"""Opt-in step-level work for single-process bf16 training (``model.ops.step_fusion``): weight gradients
summed inside their GEMMs, weight casts made once per optimizer step.

The lean projections (``kernels/fused_linear.py``) keep float32 master weights. Per micro-batch and weight W
(P parameters) the default path costs, beyond its three GEMMs:

* two casts of W to bf16 (forward, and again in backward for d input): 2 x 6 P bytes;
* the weight gradient: the GEMM writes d W in bf16, a cast widens it to float32 (2 P + 6 P bytes), then
  autograd's accumulation ``W.grad += d W`` reads both and writes the sum (12 P bytes).

With gradient accumulation over ``a`` micro-batches the weights do not change between the casts, and the
gradient's only reader before the optimizer step is the next micro-batch's sum. For the weights marked in the
model's numerics context (``kernels/numerics.py``: ``model.numerics.mark(model, setting)``, which the trainer
calls; the marks, like the cached casts, belong to that one model):

* ``grads``: ``weight_grad(g^T, x, W, numerics)`` computes ``W.grad + g^T x`` in one GEMM that reads
  the accumulated gradient and writes float32 from bf16 operands (``addmm`` with beta = 1, ``out_dtype``: 8 P
  bytes instead of 20 P, and the product is never rounded to bf16), then clears ``W.grad`` so that autograd
  installs the sum as the new gradient (its post-accumulate hooks still run). The first micro-batch's GEMM
  writes float32 directly (``matmul_to``). The LM head's weight enters the fused loss as stored and its float32
  gradient is summed over the loss's chunks the same way (``kernels/cross_entropy.py``).
* ``all`` adds the step casts: ``cast(W, bf16, numerics)`` keeps the first cast of a step and hands it to the
  other ``2 a - 1`` GEMMs (the context's ``compute_casts``); it holds 2 bytes per parameter from the first forward
  to the step (the copies autocast keeps anyway on the plain path). An entry is used only while it describes the
  very same tensor object (a weak reference) at the same ``_version`` (every in-place write, the optimizer's
  included, bumps it), so a stale copy is never read; a step of the optimizer the context is attached to (the
  trainer's) empties the cache.

The float32-output GEMMs (``aten::mm`` / ``addmm`` with ``out_dtype``) exist on CUDA only; on the CPU the marked
path computes the same sums with a bf16 product and a cast. Both need one process owning plain parameters:
under FSDP the gathered weights are freed after each use (a cache would keep them), and DDP keeps gradients in
its own buckets: ``Config.validate`` refuses the setting with any data-parallel mode (and ``fully_shard`` would
replace the parameters, the marks going with the old objects). Off by default: the speed has not been measured on a
GPU yet (``benchmarks/bf16_gpu_check.sh`` measures it).
"""
from __future__ import annotations

import weakref

import torch

SETTINGS = ("off", "grads", "all")   # model.ops.step_fusion


class ComputeCasts:
    """The compute-dtype casts of the weights marked ``all``, kept until the optimizer step (one per model, on
    its numerics context)."""

    def __init__(self):
        self.hits = 0                       # casts served from the cache (for tests and benchmarks)
        self._entries: dict[tuple, tuple] = {}

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight.to(dtype)``, from the cache when the entry is current (the caller checks the mark)."""
        if weight.dtype == dtype or weight.is_inference():
            return weight.to(dtype)
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, dtype)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            self.hits += 1
            return entry[2]
        cast = weight.detach().to(dtype)
        # the entry dies with its weight (a model dropped before any optimizer step leaves no copy behind)
        self._entries[key] = (weakref.ref(weight, lambda _ref, key=key: self._drop(key, _ref)), weight._version,
                              cast)
        return cast

    def _drop(self, key, ref) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry[0] is ref:
            del self._entries[key]

    def clear(self, *_args) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def cast(weight: torch.Tensor, dtype: torch.dtype, numerics=None) -> torch.Tensor:
    """The weight in the compute dtype (a copy cached in ``numerics``, the model's context, for weights marked
    ``all`` there)."""
    if numerics is not None and numerics.step_cast(weight):
        return numerics.compute_casts.get(weight, dtype)
    return weight.to(dtype)


def grad_in_gemm(weight: torch.Tensor, numerics=None) -> bool:
    """Whether ``weight`` is marked in ``numerics`` for its gradient to be summed inside the GEMM."""
    return numerics is not None and numerics.grad_in_gemm(weight)


def matmul_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(a @ b).to(dtype)`` without autocast. A bf16/fp16 GEMM on CUDA writes a float32 ``dtype`` itself (the
    float32 accumulator unrounded: more exact, and no second pass over the result); the CPU has no such GEMM
    (``aten::mm.dtype`` is CUDA only)."""
    with torch.autocast(a.device.type, enabled=False):
        if a.is_cuda and dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype:
            return torch.mm(a, b, out_dtype=dtype)
        return (a @ b).to(dtype)


def addmm_to(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` in float32 (``a @ b`` when ``acc`` is None), without autocast: one GEMM reading ``acc`` on
    CUDA for bf16/fp16 operands; ``acc`` may be updated in place."""
    if acc is None:
        return matmul_to(a, b, torch.float32)
    with torch.autocast(a.device.type, enabled=False):
        if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype:
            return torch.addmm(acc, a, b, out_dtype=torch.float32)
        if a.dtype == torch.float32 and b.dtype == torch.float32:
            return acc.addmm_(a, b)
        return acc.add_(a @ b)


def weight_grad(g_t: torch.Tensor, inp: torch.Tensor, weight: torch.Tensor, numerics=None) -> torch.Tensor:
    """d W = g^T inp in W's dtype. Unmarked W: a product in the operands' dtype, then a cast. A W marked in
    ``numerics`` (the model's context) for ``grads`` or ``all``: the product in float32, and on CUDA with a float32
    ``.grad`` already there, returns ``W.grad + g^T inp`` (one GEMM) and clears ``W.grad``, so that autograd
    installs the sum instead of adding."""
    if not grad_in_gemm(weight, numerics):
        with torch.autocast(g_t.device.type, enabled=False):
            return (g_t @ inp).to(weight.dtype)
    acc = weight.grad if g_t.is_cuda and weight.is_leaf else None
    if (acc is not None and type(acc) is torch.Tensor and acc.dtype == weight.dtype == torch.float32
            and acc.shape == weight.shape and acc.is_contiguous() and g_t.dtype in (torch.bfloat16, torch.float16)
            and inp.dtype == g_t.dtype):
        weight.grad = None
        with torch.autocast(g_t.device.type, enabled=False):
            return torch.addmm(acc, g_t, inp, out_dtype=torch.float32)
    return matmul_to(g_t, inp, weight.dtype)
