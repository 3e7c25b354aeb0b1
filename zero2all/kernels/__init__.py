"""Fused Triton kernels, one file per op, each registered as a torch custom op (``z2all::*``).

Every op has Triton forward and backward kernels, a ``torch.library.custom_op`` with a fake (meta) implementation
and registered autograd, so ``torch.compile(fullgraph=True)`` traces through it without graph breaks. The plain
PyTorch reference each kernel must match lives in ``zero2all/model/ops.py`` (``*_torch``). The kernels also run on
CPU tensors under ``TRITON_INTERPRET=1`` (that is how the CI tests run them).

    rmsnorm.py        residual add + RMSNorm          triton_add_rmsnorm
    rope.py           rotary embedding of q and k     triton_apply_rope
    swiglu.py         silu(gate) * up                 triton_swiglu
    fused_linear.py   lean block projections          triton_norm_linear, triton_swiglu_linear, lean_linear
                      (norm + linear, SwiGLU + linear, linear; keep far less for backward)
    fp8.py            FP8 amax + scale + cast         quantize (rowwise in one pass; transposed, column-scaled
                      copies for backward); quantize_swiglu / norm_quantize (the rowwise cast inside the
                      SwiGLU / add + RMSNorm pass); fp8_ref.py: the PyTorch reference of the rule, the
                      torch._scaled_mm GEMMs, the per-step weight casts and the FP8 linear
    cross_entropy.py  LM head + cross-entropy         fused_linear_cross_entropy
    attention.py      FlexAttention, document masks   flex_causal_attention
    decode.py         the decode step (inference only: plain Triton launches, no autograd or custom op)
                      norm/SwiGLU + matrix-vector     fused_gemv
                      RoPE + cache write + attention  decode_attention
    eager.py          the lean projections and RoPE through plain autograd Functions (eager mode: less host
                      time per call than the custom-op path; model/ops.py picks it when not compiling)
    step_fusion.py    opt-in per-step work for one-process training (model.ops.step_fusion): weight gradients
                      summed inside their GEMMs in float32, weight casts once per optimizer step
    numerics.py       the per-model numerics context (model.numerics): FP8 weight casts, amax histories and
                      hints, step-fusion casts and marks; nothing of it is module state
"""

from __future__ import annotations

import torch


def grid_programs(device: torch.device, n_items: int, per_sm: int = 4) -> int:
    """How many programs a persistent kernel launches: a few per multiprocessor on a GPU (enough to hide latency
    without many partial results to reduce), a handful under the CPU interpreter."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_items, sms * per_sm))
    return max(1, min(n_items, 4))
