"""Eager dispatch of the block's fused ops, and compute-dtype weight copies made once per schedule step.

``kernels/fused_linear.py`` registers each lean projection as a torch custom op pair (``z2all::*_fwd`` /
``z2all::*_bwd``) with registered autograd, and ``kernels/rope.py`` its rotation (``z2all::rope``): what
torch.compile needs, so that the functions stay opaque and keep exactly what they list for backward. In eager
mode that registration costs host time on every call: the dispatcher enters a Python autograd kernel, which
builds an autograd Function, re-dispatches below autograd and checks the schema before the body runs; the
backward op takes the same path again. ``benchmarks/dispatch_overhead.py`` measures it with a trivial body: on
one core of a busy development VM (torch 2.13) the custom op adds 290-500 us per forward + backward pair over
plain ops, a plain ``torch.autograd.Function`` 50-180 us (BENCHMARKS.md). With one sequence per pipeline
microbatch a 1.1B block's GEMMs take only tens of microseconds each, so that overhead, paid by 5 ops x every
block x every microbatch, left the first pipeline stage CPU-bound (its GPU idle half of the step).

The classes below run the SAME bodies (the custom ops' own Python functions and their setup / FP8 bookkeeping;
for RoPE the kernel launcher) from a plain ``torch.autograd.Function``: identical values and gradients, less host
time. ``model/ops.py`` takes this path in eager mode and the custom ops when torch.compile traces
(``torch.compiler.is_compiling()``).

Weight casts: each projection casts its (float32 master) weight to the compute dtype in forward and again in
backward, so that no cast copy lives until backward (the memory saving of the lean path). A pipeline schedule
step runs every microbatch of an update through the same weights, so it casts each weight 2 x M times. Inside
:func:`cached_weight_casts` (``distributed/pp.py`` opens it around a schedule step, while the weights cannot
change) the first cast of a weight is kept and reused by every later forward and backward; the copies die when
the context closes, before the optimizer step. Values are unchanged: the GEMMs read the same rounded weights
(``W.to(c)`` is deterministic), and the weight gradients are rounded to c by the GEMM in both cases before being
returned in the parameter's dtype. Only the bf16 path uses the copies (the FP8 recipes quantise from the master
weight), and only for projections without a bias; parameters already in the compute dtype (FSDP2's mixed
precision) are used as they are.
"""

from __future__ import annotations

import contextlib

import torch

from zero2all.kernels import fused_linear as fl
from zero2all.kernels import rope
from zero2all.kernels.numerics import handle_of

# the custom ops' bodies: the functions torch.library.custom_op wrapped (CustomOpDef keeps them; torch offers
# no public accessor)
_norm_linear_fwd = fl._norm_linear_fwd._init_fn
_norm_linear_bwd = fl._norm_linear_bwd._init_fn
_swiglu_linear_fwd = fl._swiglu_linear_fwd._init_fn
_swiglu_linear_bwd = fl._swiglu_linear_bwd._init_fn
_lean_linear_fwd = fl._lean_linear_fwd._init_fn
_lean_linear_bwd = fl._lean_linear_bwd._init_fn

_CASTS: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None   # id(weight) -> (weight, its cast copy)


@contextlib.contextmanager
def cached_weight_casts(store: dict | None = None):
    """Within the block, each weight is cast to the compute dtype once and the copy reused (see the module
    docstring). Only for spans in which no weight changes: the copies are not refreshed. ``store``: a dict kept
    by the caller across spans (CUDA graphs read its copies at fixed addresses; :func:`refresh_weight_casts`
    brings them up to date in place); by default a new one per span."""
    global _CASTS
    previous, _CASTS = _CASTS, ({} if store is None else store)
    try:
        yield
    finally:
        _CASTS = previous


def refresh_weight_casts(store: dict) -> None:
    """Every cast copy of a :func:`cached_weight_casts` store rewritten in place from its (changed) weight."""
    with torch.no_grad():
        for weight, copy in store.values():
            copy.copy_(weight)


def _compute_weight(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                    precision: str) -> torch.Tensor:
    """The weight the GEMMs read: the cached cast copy inside :func:`cached_weight_casts` (bf16 path, weight not
    already in ``dtype``, no bias: the bodies return the bias gradient in the weight's dtype), else the weight
    itself (the bodies cast it per call)."""
    if _CASTS is None or precision != "bf16" or weight.dtype == dtype or bias is not None:
        return weight
    hit = _CASTS.get(id(weight))
    if hit is None or hit[0] is not weight:
        hit = (weight, weight.detach().to(dtype))
        _CASTS[id(weight)] = hit
    return hit[1]


class _NormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, norm_weight, eps, residual_in_fp32, weight, bias, cdt, precision, kind, numerics):
        w = _compute_weight(weight, bias, cdt, precision)
        output = _norm_linear_fwd(x, residual, norm_weight, eps, residual_in_fp32, w, bias, cdt, precision, kind,
                                  numerics)
        fl._norm_linear_setup(ctx, (x, residual, norm_weight, eps, residual_in_fp32, w, bias, cdt, precision,
                                    kind, numerics), output)
        ctx.weight_dtype = weight.dtype
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_res, _grad_yhat, _grad_rstd, _grad_counts):
        # fused_linear._norm_linear_backward, calling the body instead of the op
        yhat, rstd, norm_weight, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_out = fl._out_grad(grad_out, (*yhat.shape[:-1], weight.shape[0]), yhat.dtype, yhat.device)
        has_res = ctx.residual_dtype is not None
        dx, dres, dnorm_w, dw, db, counts = _norm_linear_bwd(
            grad_out, grad_res, yhat, rstd, norm_weight, weight, ctx.x_dtype,
            ctx.residual_dtype if has_res else ctx.x_dtype, has_res, need[5], ctx.has_bias and need[6],
            ctx.precision, ctx.numerics)
        fl._record(ctx.kind, grad_out.numel() * (1 + need[5]), counts, ctx.numerics)
        return (dx, dres if has_res else None, dnorm_w, None, None, dw.to(ctx.weight_dtype) if need[5] else None,
                db if ctx.has_bias and need[6] else None, None, None, None, None)


class _SwigluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, weight, bias, cdt, precision, kind, numerics):
        w = _compute_weight(weight, bias, cdt, precision)
        output = _swiglu_linear_fwd(gate_up, w, bias, cdt, precision, kind, numerics)
        fl._save_input_and_weight(ctx, (gate_up, w, bias, cdt, precision, kind, numerics), output)
        ctx.weight_dtype = weight.dtype
        return output

    @staticmethod
    def backward(ctx, grad_out, _grad_counts):
        gate_up, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        want_db = ctx.has_bias and need[2]
        grad_out = fl._out_grad(grad_out, (*gate_up.shape[:-1], weight.shape[0]), ctx.compute_dtype, gate_up.device)
        dgu, dw, db, counts = _swiglu_linear_bwd(grad_out, gate_up, weight, ctx.compute_dtype, need[1], want_db,
                                                 ctx.precision, ctx.numerics)
        fl._record(ctx.kind, grad_out.numel() * (1 + need[1]), counts, ctx.numerics)
        return dgu, (dw.to(ctx.weight_dtype) if need[1] else None), (db if want_db else None), None, None, None, None


class _LeanLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cdt, precision, kind, numerics):
        w = _compute_weight(weight, bias, cdt, precision)
        output = _lean_linear_fwd(x, w, bias, cdt, precision, kind, numerics)
        fl._save_input_and_weight(ctx, (x, w, bias, cdt, precision, kind, numerics), output)
        ctx.weight_dtype = weight.dtype
        return output

    @staticmethod
    def backward(ctx, grad_out, _grad_counts):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        want_db = ctx.has_bias and need[2]
        grad_out = fl._out_grad(grad_out, (*x.shape[:-1], weight.shape[0]), ctx.compute_dtype, x.device)
        dx, dw, db, counts = _lean_linear_bwd(grad_out, x, weight, ctx.compute_dtype, need[0], need[1], want_db,
                                              ctx.precision, ctx.numerics)
        fl._record(ctx.kind, grad_out.numel() * (need[0] + need[1]), counts, ctx.numerics)
        return ((dx if need[0] else None), (dw.to(ctx.weight_dtype) if need[1] else None),
                (db if want_db else None), None, None, None, None)


def norm_linear(x, residual, norm_weight, eps, residual_in_fp32, weight, bias=None, precision="bf16", kind="",
                numerics=None):
    """``fused_linear.triton_norm_linear`` through a plain autograd Function (same checks, values, gradients)."""
    fl.check_norm_linear_args(x, residual, norm_weight, weight, precision)
    out, res_out, _, _, counts = _NormLinear.apply(x, residual, norm_weight, float(eps), bool(residual_in_fp32),
                                                   weight, bias, fl.compute_dtype(x, weight), precision, kind,
                                                   handle_of(numerics))
    fl._record(kind, x.numel() + weight.numel(), counts, handle_of(numerics))
    return out, res_out


def swiglu_linear(gate_up, weight, bias=None, precision="bf16", kind="", numerics=None):
    """``fused_linear.triton_swiglu_linear`` through a plain autograd Function."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_linear: last dimension {gate_up.shape[-1]} must be even ([gate | up])")
    if weight.dim() != 2 or weight.shape[1] != gate_up.shape[-1] // 2:
        raise ValueError(f"swiglu_linear: weight shape {tuple(weight.shape)} does not take inputs of width "
                         f"{gate_up.shape[-1] // 2}")
    fl._check_precision(precision, gate_up)
    out, counts = _SwigluLinear.apply(gate_up, weight, bias, fl.compute_dtype(gate_up, weight), precision, kind,
                                      handle_of(numerics))
    fl._record(kind, gate_up.numel() // 2 + weight.numel(), counts, handle_of(numerics))
    return out


def lean_linear(x, weight, bias=None, precision="bf16", kind="", numerics=None):
    """``fused_linear.lean_linear`` through a plain autograd Function."""
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"lean_linear: weight shape {tuple(weight.shape)} does not take inputs of width "
                         f"{x.shape[-1]}")
    fl._check_precision(precision, x)
    out, counts = _LeanLinear.apply(x, weight, bias, fl.compute_dtype(x, weight), precision, kind,
                                    handle_of(numerics))
    fl._record(kind, x.numel() + weight.numel(), counts, handle_of(numerics))
    return out


class _Rope(torch.autograd.Function):
    """RoPE's backward is the rotation by the negated angle: the same kernel with ``backward=True``."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope._launch(q, k, cos, sin, False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        dq, dk = rope._launch(grad_q, grad_k, cos, sin, True)
        return dq, dk, None, None


def apply_rope(q, k, cos, sin):
    """``rope.triton_apply_rope`` through a plain autograd Function."""
    rope.check_rope_shapes(q, k, cos, sin)
    return _Rope.apply(q, k, cos, sin)
