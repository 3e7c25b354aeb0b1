"""Lean projections: the block's linears fused with their neighbours so that autograd keeps far less.

Per token and layer, a block on the plain path keeps for backward: the residual stream twice (the new residual r
of each add+RMSNorm, float32 with ``residual_in_fp32``), both normed outputs (the inputs of the qkv and gate|up
projections), the SwiGLU output (the down projection's input), and under autocast a bf16 copy of every weight
until backward. The three functions below keep only what their backward cannot cheaply rebuild.

``norm_linear(x, residual, norm_weight, eps, residual_in_fp32, weight, bias) -> (out, new_residual)``::

    r      = residual + x                  float32 when residual_in_fp32; r = x when residual is None
    rstd   = 1 / sqrt(mean(r^2) + eps)
    y      = round_r(r * rstd)             round_r / round_c: cast to r's dtype / the compute dtype c
    normed = round_c(norm_weight * y)      exactly ``ops.add_rmsnorm_torch``'s value (then cast to c)
    out    = normed @ W_c^T (+ b_c)        W_c, b_c: the parameters cast to c (not kept)

It saves yhat = round_c(y) (2 bytes per element in bf16, instead of r in float32 plus normed in bf16), rstd (one
float per row) and the parameters themselves. Backward, with g = d out and gr = d new_residual::

    d normed      = g @ W_c                                  (W cast again)
    dy            = d normed * norm_weight
    dr            = rstd * (dy - yhat * mean(dy * yhat)) + gr    -> d x = round_x(dr), d residual = dr
    d norm_weight = sum over rows of d normed * yhat
    normed'       = round_c(norm_weight * yhat)              written by the same kernel (costs one write)
    d W           = g^T normed',  d b = sum over rows of g

The backward's normed' rounds y twice (to c, then the product) where the forward rounded once: it only enters
d W, and in float32 it is exact.

``swiglu_linear(gate_up, weight, bias) -> out``::

    a = silu(gate) * up ;  out = a @ W_c^T (+ b_c)

saves gate_up (which SwiGLU's own backward needs anyway) and the parameter, not a. Backward: d a = g @ W_c; one
kernel reads gate_up and d a and writes d gate_up and the recomputed a; then d W = g^T a. The recompute costs
only the write of a.

``lean_linear(x, weight, bias) -> out``: out = x @ W_c^T (+ b_c), saving x and the parameter; W is cast again in
backward instead of keeping autocast's copy.

Compute dtype c: ``torch.get_autocast_dtype`` when autocast is on for the tensor's device type, else the weight's
dtype. The functions turn autocast off inside and cast themselves, in forward and again in backward, so no cast
copy of a weight outlives its matmul (autocast would keep one per weight until backward: 2 bytes per parameter).
Gradients of the parameters come back in the parameters' dtypes. Each function is a torch custom op pair
(``z2all::*_fwd`` / ``z2all::*_bwd``, fake implementations, registered autograd): under torch.compile they stay
opaque, so what is saved is exactly what is listed above.

FP8: each function takes ``precision`` (``bf16`` = the compute dtype, or ``fp8_rowwise`` / ``fp8_tensorwise``).
With FP8 the three GEMMs of each projection run on FP8 operands (``kernels/fp8.py``): the forward casts its input
and W rowwise (with rowwise scaling the SwiGLU output a is cast straight from gate_up by ``fp8.quantize_swiglu``
and never written in bf16), backward quantises d out once (row-scaled for d input, transposed and column-scaled
for d W), W as W^T, and the rebuilt input (normed', a, or x) transposed. The weights' casts are made once per
optimizer step (the model's ``fp8_ref.WeightCasts``). With ``model.ops.fp8_fused_amax`` the norm and SwiGLU
kernels write the maxima of what they produce (dx, normed', d gate_up, a; with tensorwise scaling also normed and
a in forward) for those casts (the model's ``fp8_ref.AmaxHints``). Both, the recorded maxima of delayed scaling
and the step-fusion marks live on the model's numerics context (``kernels/numerics.py``); the custom ops receive
its integer handle (``numerics``, 0 for none). What is saved for backward is unchanged. The ops
also return the casts' saturation / underflow counts, which the wrappers add to the model's ``numerics.fp8_stats`` under
``kind`` (qkv, o, gate_up, down).

For z2all-1.1b in bf16 a block then keeps 46,216 instead of 73,864 bytes per token, and none of the 1.98 GB of
weight copies (``accounting.activation_bytes_per_token_per_layer(..., fused_linear=True)``).
"""

from typing import Optional

import torch
import triton

from zero2all.kernels import fp8, fp8_ref, grid_programs, step_fusion
from zero2all.kernels.numerics import Numerics, handle_of, lookup
from zero2all.kernels.rmsnorm import _add_rmsnorm_bwd_kernel, _add_rmsnorm_fwd_kernel, _residual_dtype, _warps
from zero2all.kernels.swiglu import _BLOCK as _SWIGLU_BLOCK
from zero2all.kernels.swiglu import _rows, _swiglu_bwd_kernel, _swiglu_fwd_kernel


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when it is on for x's device type, else the weight's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with torch.autocast(a.device.type, enabled=False):
        return a @ b


def _no_counts(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty((0,), dtype=torch.int64)


def _fake_counts(t: torch.Tensor, precision: str) -> torch.Tensor:
    return t.new_empty((0,) if precision == "bf16" else (2,), dtype=torch.int64)


def _linear(a: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype,
            lead_shape, precision: str = "bf16", nx: Optional[Numerics] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """a (..., K) @ W^T + b in ``dtype`` as a new (*lead_shape, M) tensor, the parameters cast here (the copies
    die with this call). The result is written into its own buffer (not a view of a flattened GEMM output), so
    that autograd, and FSDP's hooks on a block's outputs, see a plain tensor. With an FP8 ``precision`` the GEMM
    runs on FP8 operands (``kernels/fp8.py``); ``a`` may then be given already cast (an ``fp8_ref.Quantized``).
    ``nx``: the model's numerics context (weight casts, delayed scaling, step fusion; None: none).
    Returns (out, FP8 cast counts; empty in bf16)."""
    M = weight.shape[0]
    out = torch.empty((*lead_shape, M), dtype=dtype, device=weight.device)
    if precision != "bf16":
        a2 = a if isinstance(a, fp8_ref.Quantized) else a.reshape(-1, a.shape[-1])
        _, counts = fp8_ref.linear_forward(a2, weight, precision, dtype, quant=fp8.quantize, out=out.view(-1, M),
                                           numerics=nx)
        if bias is not None:
            out += bias.to(dtype)
        return out, counts
    a2, w_t = a.reshape(-1, a.shape[-1]).to(dtype), step_fusion.cast(weight, dtype, nx).t()
    with torch.autocast(a.device.type, enabled=False):
        if bias is None:
            torch.mm(a2, w_t, out=out.view(-1, M))
        else:
            torch.addmm(bias.to(dtype), a2, w_t, out=out.view(-1, M))
    return out, _no_counts(a)


class _Backward:
    """The backward GEMMs of ``out = inp @ W^T`` from the output gradient ``g2`` (rows, M): in the compute dtype
    ``cdt``, or with FP8 operands (the gradient quantised once for both GEMMs). Parameter gradients come back in
    the parameters' dtypes, d b summed in float32; ``counts`` are the FP8 casts' (empty in bf16)."""

    def __init__(self, g2: torch.Tensor, weight: torch.Tensor, cdt: torch.dtype, precision: str, want_dinp: bool,
                 want_dweight: bool, nx: Optional[Numerics] = None):
        self.weight, self.cdt, self.nx = weight, cdt, nx
        self.fp8 = None if precision == "bf16" else fp8_ref.LinearBackward(g2, precision, want_dinp, want_dweight,
                                                                           quant=fp8.quantize, weight=weight,
                                                                           numerics=nx)
        self.g2 = g2 if self.fp8 is not None else g2.to(cdt)
        self.counts = self.fp8.counts if self.fp8 is not None else _no_counts(g2)

    def grad_input(self) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.grad_input(self.weight, self.cdt)
        return _matmul(self.g2, step_fusion.cast(self.weight, self.cdt, self.nx))

    def param_grads(self, inp: torch.Tensor, want_dweight: bool, want_dbias: bool):
        """d W = g^T inp and d b = sum over rows of g."""
        weight = self.weight
        if not want_dweight:
            dw = weight.new_empty((0,))
        elif self.fp8 is not None:
            dw = self.fp8.grad_weight(inp, weight.dtype)
        else:
            dw = step_fusion.weight_grad(self.g2.t(), inp, weight, self.nx)
        db = self.g2.sum(0, dtype=torch.float32).to(weight.dtype) if want_dbias else weight.new_empty((0,))
        return dw, db


def _fake_param_grads(weight, want_dweight, want_dbias):
    dw = torch.empty_like(weight) if want_dweight else weight.new_empty((0,))
    db = weight.new_empty((weight.shape[0],)) if want_dbias else weight.new_empty((0,))
    return dw, db


def _out_grad(grad_out, shape, dtype, device):
    # outputs that were not used downstream come back as None (grads are not materialised)
    return grad_out if grad_out is not None else torch.zeros(shape, dtype=dtype, device=device)


def _check_precision(precision: str, x: torch.Tensor) -> None:
    if precision != "bf16":
        fp8_ref.scaling_of(precision)
        fp8_ref.check_fp8_device(x.device)


# --------------------------------------------------------------------------------------------------------------
# norm_linear: residual add + RMSNorm + projection


@torch.library.custom_op("z2all::norm_linear_fwd", mutates_args=())
def _norm_linear_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                     residual_in_fp32: bool, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     compute_dtype: torch.dtype, precision: str, kind: str, numerics: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    nx = lookup(numerics)
    hints = fp8_ref.hints_of(nx)
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    rows = x2.shape[0]
    res2 = residual.reshape(-1, N).contiguous() if residual is not None else x2
    # outputs allocated in x's shape (contiguous: the kernel addresses row * N + col)
    yhat = torch.empty(x.shape, dtype=compute_dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=_residual_dtype(x, residual, residual_in_fp32), device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if precision == "fp8_rowwise":      # the norm writes the rowwise FP8 cast of normed, never normed itself
        qn = fp8.norm_quantize(x2, res2 if residual is not None else None, norm_weight.contiguous(), eps,
                               res_out.view(-1, N), rstd, yhat.view(-1, N), compute_dtype,
                               _warps(triton.next_power_of_2(N)))
        out, counts = _linear(qn, weight, bias, compute_dtype, x.shape[:-1], precision, nx)
        return out, res_out, yhat, rstd, counts
    if precision == "fp8_tensorwise" and hints is not None:   # normed with its amax: one read less
        normed = fp8.norm_quantize(x2, res2 if residual is not None else None, norm_weight.contiguous(), eps,
                                   res_out.view(-1, N), rstd, yhat.view(-1, N), compute_dtype,
                                   _warps(triton.next_power_of_2(N)), store_normed=True, hints=hints).q
        out, counts = _linear(normed, weight, bias, compute_dtype, x.shape[:-1], precision, nx)
        return out, res_out, yhat, rstd, counts
    normed = torch.empty_like(yhat)
    if rows:
        block = triton.next_power_of_2(N)
        _add_rmsnorm_fwd_kernel[(rows,)](x2, res2, norm_weight.contiguous(), normed, res_out, rstd, yhat, N, eps,
                                         HAS_RESIDUAL=residual is not None, BLOCK=block, WRITE_Y=True,
                                         num_warps=_warps(block))
    out, counts = _linear(normed, weight, bias, compute_dtype, x.shape[:-1], precision, nx)     # normed dies here
    return out, res_out, yhat, rstd, counts


@_norm_linear_fwd.register_fake
def _(x, residual, norm_weight, eps, residual_in_fp32, weight, bias, compute_dtype, precision, kind, numerics=0):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=compute_dtype),
            x.new_empty(x.shape, dtype=_residual_dtype(x, residual, residual_in_fp32)),
            x.new_empty(x.shape, dtype=compute_dtype), x.new_empty((rows,), dtype=torch.float32),
            _fake_counts(x, precision))


@torch.library.custom_op("z2all::norm_linear_bwd", mutates_args=())
def _norm_linear_bwd(grad_out: torch.Tensor, grad_res: Optional[torch.Tensor], yhat: torch.Tensor,
                     rstd: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, x_dtype: torch.dtype,
                     residual_dtype: torch.dtype, want_dres: bool, want_dweight: bool, want_dbias: bool,
                     precision: str, numerics: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    nx = lookup(numerics)
    hints = fp8_ref.hints_of(nx)
    N = yhat.shape[-1]
    y2 = yhat.reshape(-1, N)
    rows, cdt = y2.shape[0], yhat.dtype
    bwd = _Backward(grad_out.reshape(rows, -1), weight, cdt, precision, True, want_dweight, nx)
    grad_normed = bwd.grad_input()                                          # (rows, N), the cast dies here
    dx = torch.empty(yhat.shape, dtype=x_dtype, device=y2.device)
    dres = torch.empty(yhat.shape, dtype=residual_dtype, device=y2.device) if want_dres else dx.new_empty((0,))
    normed = torch.empty((rows, N), dtype=cdt, device=y2.device) if want_dweight else grad_normed
    n_prog = grid_programs(y2.device, max(rows, 1))
    partial = torch.zeros((n_prog, N), dtype=torch.float32, device=y2.device)
    # FP8: the kernel also writes the maxima of dx and normed' for their casts (the model's AmaxHints)
    amax = precision != "bf16" and hints is not None and rows > 0
    stride = max(rows, n_prog * N)
    parts = torch.empty((4, stride) if amax else (0,), dtype=torch.float32, device=y2.device)
    if rows:
        gres = grad_res.reshape(-1, N).contiguous() if grad_res is not None else grad_normed
        block = triton.next_power_of_2(N)
        _add_rmsnorm_bwd_kernel[(n_prog,)](grad_normed, gres, y2.contiguous(), norm_weight.contiguous(), rstd, dx,
                                          dres if want_dres else dx, partial, normed, rows, N,
                                          HAS_GRES=grad_res is not None, WRITE_DRES=want_dres, BLOCK=block,
                                          FROM_Y=True, WRITE_NORMED=want_dweight, AMAX_PARTS=parts,
                                          AMAX_STRIDE=stride, AMAX=amax, num_warps=_warps(block))
    if amax:
        cols = fp8_ref.scaling_of(precision) == "axis"
        col_parts = parts[2:, :n_prog * N].view(2, n_prog, N)
        hints.put(dx.view(rows, N), parts[0, :rows].view(1, rows), col_parts[0] if cols else None)
        if want_dweight:
            hints.put(normed, parts[1, :rows].view(1, rows), col_parts[1] if cols else None)
    dnorm_w = partial.sum(0).to(norm_weight.dtype)
    dw, db = bwd.param_grads(normed, want_dweight, want_dbias)
    return dx, dres, dnorm_w, dw, db, bwd.counts


@_norm_linear_bwd.register_fake
def _(grad_out, grad_res, yhat, rstd, norm_weight, weight, x_dtype, residual_dtype, want_dres, want_dweight,
      want_dbias, precision, numerics=0):
    dx = yhat.new_empty(yhat.shape, dtype=x_dtype)
    dres = yhat.new_empty(yhat.shape, dtype=residual_dtype) if want_dres else dx.new_empty((0,))
    return (dx, dres, torch.empty_like(norm_weight), *_fake_param_grads(weight, want_dweight, want_dbias),
            _fake_counts(yhat, precision))


def _norm_linear_setup(ctx, inputs, output):
    x, residual, norm_weight, _, _, weight, bias, _, precision, kind, numerics = inputs
    _, _, yhat, rstd, counts = output
    ctx.save_for_backward(yhat, rstd, norm_weight, weight)
    ctx.mark_non_differentiable(yhat, rstd, counts)
    ctx.precision, ctx.kind, ctx.numerics = precision, kind, numerics
    ctx.set_materialize_grads(False)
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.has_bias = bias is not None


def _norm_linear_backward(ctx, grad_out, grad_res, _grad_yhat, _grad_rstd, _grad_counts):
    yhat, rstd, norm_weight, weight = ctx.saved_tensors
    need = ctx.needs_input_grad       # x, residual, norm_weight, eps, residual_in_fp32, weight, bias, dtype, ...
    grad_out = _out_grad(grad_out, (*yhat.shape[:-1], weight.shape[0]), yhat.dtype, yhat.device)
    has_res = ctx.residual_dtype is not None
    dx, dres, dnorm_w, dw, db, counts = _norm_linear_bwd(
        grad_out, grad_res, yhat, rstd, norm_weight, weight, ctx.x_dtype,
        ctx.residual_dtype if has_res else ctx.x_dtype, has_res, need[5], ctx.has_bias and need[6], ctx.precision,
        ctx.numerics)
    _record(ctx.kind, grad_out.numel() * (1 + need[5]), counts, ctx.numerics)
    return (dx, dres if has_res else None, dnorm_w, None, None, dw if need[5] else None,
            db if ctx.has_bias and need[6] else None, None, None, None, None)


_norm_linear_fwd.register_autograd(_norm_linear_backward, setup_context=_norm_linear_setup)


def check_norm_linear_args(x, residual, norm_weight, weight, precision: str) -> None:
    """The shapes and the precision of a norm + linear call (shared by both dispatch paths)."""
    N = x.shape[-1]
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"norm_linear: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if norm_weight.shape != (N,):
        raise ValueError(f"norm_linear: norm weight shape {tuple(norm_weight.shape)} != ({N},)")
    if weight.dim() != 2 or weight.shape[1] != N:
        raise ValueError(f"norm_linear: weight shape {tuple(weight.shape)} does not take inputs of width {N}")
    _check_precision(precision, x)


def triton_norm_linear(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                       residual_in_fp32: bool, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       precision: str = "bf16", kind: str = "", numerics: Optional[Numerics] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, new_residual)``: ``ops.add_rmsnorm_torch`` followed by ``F.linear(normed, weight, bias)``, keeping
    only round_c(y), rstd and the parameters for backward (see the module docstring).

    x (..., N); residual (..., N) or None; norm_weight (N,); weight (M, N); bias (M,) or None. ``out`` is
    (..., M) in the compute dtype; the new residual as in ``triton_add_rmsnorm``. ``precision``: bf16 (the
    compute dtype) or an FP8 recipe for the GEMMs; ``kind`` names the projection in the FP8 statistics;
    ``numerics``: the model's numerics context (``kernels/numerics.py``; None: none).
    """
    check_norm_linear_args(x, residual, norm_weight, weight, precision)
    out, res_out, _, _, counts = _norm_linear_fwd(x, residual, norm_weight, float(eps), bool(residual_in_fp32),
                                                  weight, bias, compute_dtype(x, weight), precision, kind,
                                                  handle_of(numerics))
    _record(kind, x.numel() + weight.numel(), counts, handle_of(numerics))
    return out, res_out


# --------------------------------------------------------------------------------------------------------------
# swiglu_linear: silu(gate) * up + the down projection


@torch.library.custom_op("z2all::swiglu_linear_fwd", mutates_args=())
def _swiglu_linear_fwd(gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       compute_dtype: torch.dtype, precision: str, kind: str, numerics: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    nx = lookup(numerics)
    hints = fp8_ref.hints_of(nx)
    I = gate_up.shape[-1] // 2
    gu = _rows(gate_up)
    if precision == "fp8_rowwise":      # the rowwise FP8 cast of a made from gate_up directly: a is never written
        return _linear(fp8.quantize_swiglu(gu, compute_dtype), weight, bias, compute_dtype, gate_up.shape[:-1],
                       precision, nx)
    if precision == "fp8_tensorwise" and hints is not None:   # a with its amax: one read less
        return _linear(fp8.swiglu_amax(gu, compute_dtype, hints), weight, bias, compute_dtype, gate_up.shape[:-1],
                       precision, nx)
    a = torch.empty((gu.shape[0], I), dtype=compute_dtype, device=gate_up.device)
    if gu.shape[0] and I:
        block = min(_SWIGLU_BLOCK, triton.next_power_of_2(I))
        _swiglu_fwd_kernel[(gu.shape[0], triton.cdiv(I, block))](gu, a, I, gu.stride(0), BLOCK=block, num_warps=4)
    return _linear(a, weight, bias, compute_dtype, gate_up.shape[:-1], precision, nx)   # a dies here


@_swiglu_linear_fwd.register_fake
def _(gate_up, weight, bias, compute_dtype, precision, kind, numerics=0):
    return (gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0]), dtype=compute_dtype),
            _fake_counts(gate_up, precision))


@torch.library.custom_op("z2all::swiglu_linear_bwd", mutates_args=())
def _swiglu_linear_bwd(grad_out: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor,
                       compute_dtype: torch.dtype, want_dweight: bool, want_dbias: bool, precision: str,
                       numerics: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    nx = lookup(numerics)
    hints = fp8_ref.hints_of(nx)
    I = gate_up.shape[-1] // 2
    gu = _rows(gate_up)
    rows = gu.shape[0]
    bwd = _Backward(grad_out.reshape(rows, -1), weight, compute_dtype, precision, True, want_dweight, nx)
    grad_a = bwd.grad_input().contiguous()                                  # (rows, I)
    if precision != "bf16" and hints is not None:   # the same values, with the maxima of d gate_up and a
        dgu, a = fp8.swiglu_backward(grad_a, gu, gate_up.dtype, compute_dtype, fp8_ref.scaling_of(precision),
                                     want_dweight, hints)
        dw, db = bwd.param_grads(a, want_dweight, want_dbias)
        return dgu.view(gate_up.shape), dw, db, bwd.counts
    dgu = torch.empty((rows, 2 * I), dtype=gate_up.dtype, device=gate_up.device)
    a = torch.empty((rows, I), dtype=compute_dtype, device=gate_up.device) if want_dweight else grad_a
    if rows and I:
        block = min(_SWIGLU_BLOCK, triton.next_power_of_2(I))
        _swiglu_bwd_kernel[(rows, triton.cdiv(I, block))](grad_a, gu, dgu, a, I, gu.stride(0), BLOCK=block,
                                                          WRITE_A=want_dweight, num_warps=4)
    dw, db = bwd.param_grads(a, want_dweight, want_dbias)
    return dgu.view(gate_up.shape), dw, db, bwd.counts


@_swiglu_linear_bwd.register_fake
def _(grad_out, gate_up, weight, compute_dtype, want_dweight, want_dbias, precision, numerics=0):
    return (gate_up.new_empty(gate_up.shape), *_fake_param_grads(weight, want_dweight, want_dbias),
            _fake_counts(gate_up, precision))


def _save_input_and_weight(ctx, inputs, output):
    """setup_context of swiglu_linear and lean_linear: both keep their input (gate_up / x) and the weight."""
    x, weight, bias, cdt, precision, kind, numerics = inputs
    ctx.save_for_backward(x, weight)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.compute_dtype, ctx.precision, ctx.kind, ctx.numerics = cdt, precision, kind, numerics
    ctx.has_bias = bias is not None


def _swiglu_linear_backward(ctx, grad_out, _grad_counts):
    gate_up, weight = ctx.saved_tensors
    need = ctx.needs_input_grad                                 # gate_up, weight, bias, dtype, precision, kind
    want_db = ctx.has_bias and need[2]
    grad_out = _out_grad(grad_out, (*gate_up.shape[:-1], weight.shape[0]), ctx.compute_dtype, gate_up.device)
    dgu, dw, db, counts = _swiglu_linear_bwd(grad_out, gate_up, weight, ctx.compute_dtype, need[1], want_db,
                                             ctx.precision, ctx.numerics)
    _record(ctx.kind, grad_out.numel() * (1 + need[1]), counts, ctx.numerics)
    return dgu, (dw if need[1] else None), (db if want_db else None), None, None, None, None


_swiglu_linear_fwd.register_autograd(_swiglu_linear_backward, setup_context=_save_input_and_weight)


def triton_swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         precision: str = "bf16", kind: str = "", numerics: Optional[Numerics] = None
                         ) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)`` for ``gate_up`` (..., 2 I) laid out as [gate | up], weight
    (M, I); keeps only gate_up and the parameters for backward. Returns (..., M) in the compute dtype."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_linear: last dimension {gate_up.shape[-1]} must be even ([gate | up])")
    if weight.dim() != 2 or weight.shape[1] != gate_up.shape[-1] // 2:
        raise ValueError(f"swiglu_linear: weight shape {tuple(weight.shape)} does not take inputs of width "
                         f"{gate_up.shape[-1] // 2}")
    _check_precision(precision, gate_up)
    out, counts = _swiglu_linear_fwd(gate_up, weight, bias, compute_dtype(gate_up, weight), precision, kind,
                                     handle_of(numerics))
    _record(kind, gate_up.numel() // 2 + weight.numel(), counts, handle_of(numerics))
    return out


# --------------------------------------------------------------------------------------------------------------
# lean_linear: a linear that casts its weight again in backward


@torch.library.custom_op("z2all::lean_linear_fwd", mutates_args=())
def _lean_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     compute_dtype: torch.dtype, precision: str, kind: str, numerics: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return _linear(x, weight, bias, compute_dtype, x.shape[:-1], precision, lookup(numerics))


@_lean_linear_fwd.register_fake
def _(x, weight, bias, compute_dtype, precision, kind, numerics=0):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=compute_dtype), _fake_counts(x, precision)


@torch.library.custom_op("z2all::lean_linear_bwd", mutates_args=())
def _lean_linear_bwd(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, compute_dtype: torch.dtype,
                     want_dx: bool, want_dweight: bool, want_dbias: bool, precision: str, numerics: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    bwd = _Backward(grad_out.reshape(-1, weight.shape[0]), weight, compute_dtype, precision, want_dx, want_dweight,
                    lookup(numerics))
    dx = bwd.grad_input().to(x.dtype).view(x.shape) if want_dx else x.new_empty((0,))
    x2 = x.reshape(-1, x.shape[-1])
    dw, db = bwd.param_grads(x2 if precision != "bf16" else x2.to(compute_dtype), want_dweight, want_dbias)
    return dx, dw, db, bwd.counts


@_lean_linear_bwd.register_fake
def _(grad_out, x, weight, compute_dtype, want_dx, want_dweight, want_dbias, precision, numerics=0):
    dx = x.new_empty(x.shape) if want_dx else x.new_empty((0,))
    return (dx, *_fake_param_grads(weight, want_dweight, want_dbias), _fake_counts(x, precision))


def _lean_linear_backward(ctx, grad_out, _grad_counts):
    x, weight = ctx.saved_tensors
    need = ctx.needs_input_grad                                 # x, weight, bias, dtype, precision, kind
    want_db = ctx.has_bias and need[2]
    grad_out = _out_grad(grad_out, (*x.shape[:-1], weight.shape[0]), ctx.compute_dtype, x.device)
    dx, dw, db, counts = _lean_linear_bwd(grad_out, x, weight, ctx.compute_dtype, need[0], need[1], want_db,
                                          ctx.precision, ctx.numerics)
    _record(ctx.kind, grad_out.numel() * (need[0] + need[1]), counts, ctx.numerics)
    return (dx if need[0] else None), (dw if need[1] else None), (db if want_db else None), None, None, None, None


_lean_linear_fwd.register_autograd(_lean_linear_backward, setup_context=_save_input_and_weight)


def lean_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, precision: str = "bf16",
                kind: str = "", numerics: Optional[Numerics] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in the compute dtype, keeping x and the parameters (not a cast copy)."""
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"lean_linear: weight shape {tuple(weight.shape)} does not take inputs of width "
                         f"{x.shape[-1]}")
    _check_precision(precision, x)
    out, counts = _lean_linear_fwd(x, weight, bias, compute_dtype(x, weight), precision, kind, handle_of(numerics))
    _record(kind, x.numel() + weight.numel(), counts, handle_of(numerics))
    return out


def _record(kind: str, numel: int, counts: torch.Tensor, numerics: int = 0) -> None:
    """Add an FP8 op's saturation / underflow counts to the statistics of the model whose context has the handle
    ``numerics`` (nothing in bf16, nothing without a context)."""
    if counts.numel() and numerics:       # both static under torch.compile: the bf16 path traces nothing here
        _add_counts(kind, numel, counts, numerics)


@torch.compiler.disable
def _add_counts(kind: str, numel: int, counts: torch.Tensor, numerics: int) -> None:
    """The context lookup (a weak reference) stays out of compiled graphs."""
    nx = lookup(numerics)
    if nx is not None:
        nx.fp8_stats.add(kind or None, numel, counts)
