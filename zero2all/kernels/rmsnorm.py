"""Residual add fused with RMSNorm: one read of (x, residual), one write of (normed, new residual).

Semantics are those of ``ops.add_rmsnorm_torch``::

    r      = residual + x            (float32 when residual_in_fp32, else x's dtype; r = x when residual is None)
    rstd   = 1 / sqrt(mean(r^2) + eps)
    normed = (weight * round_r(r * rstd)).to(x.dtype)      round_r: cast to r's dtype (Llama/HF order of casts)

Backward, with y = r * rstd, g = d normed and gr = d r (from the residual stream's later uses)::

    dy = g * weight
    dr = rstd * (dy - y * mean(dy * y)) + gr          -> d residual = dr,  d x = dr.to(x.dtype)
    dweight = sum over rows of g * y

The forward saves only r (needed anyway as the residual stream) and rstd (one float per row). The weight gradient
is reduced in two stages: each of P persistent programs sums its rows into a float32 partial, then a (P, N) sum.

The same kernels serve the lean ``norm_linear`` of ``fused_linear.py``: the forward can also write y (rounded to
the projection's compute dtype) and the backward can start from that saved y instead of r (and write
weight * y again, the projection's input, for its weight gradient).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from zero2all.kernels import grid_programs


@triton.jit
def add_rmsnorm_row(X, RES, RES_OUT, RSTD, row, cols, mask, N, eps, HAS_RESIDUAL: tl.constexpr):
    """One row of the residual add + RMSNorm: stores the new residual and rstd, returns y = round_c(r * rstd) in
    float32 (before the norm weight). Shared by the plain kernel below and the FP8 cast of kernels/fp8.py."""
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(RES + row * N + cols, mask=mask, other=0.0).to(tl.float32) + x
    else:
        r = x
    r_stored = r.to(RES_OUT.dtype.element_ty)
    tl.store(RES_OUT + row * N + cols, r_stored, mask=mask)
    r = r_stored.to(tl.float32)  # the stream as stored is what later layers and the norm see
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    return (r * rstd).to(RES_OUT.dtype.element_ty).to(tl.float32)


@triton.jit
def _add_rmsnorm_fwd_kernel(X, RES, W, OUT, RES_OUT, RSTD, Y, N, eps,
                            HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, WRITE_Y: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    y = add_rmsnorm_row(X, RES, RES_OUT, RSTD, row, cols, mask, N, eps, HAS_RESIDUAL)
    if WRITE_Y:  # the lean norm_linear keeps y (in Y's dtype) for its backward instead of r
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * N + cols, (w * y).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _add_rmsnorm_bwd_kernel(G, GRES, R, W, RSTD, DX, DRES, DW_PARTIAL, NORMED, n_rows, N,
                            HAS_GRES: tl.constexpr, WRITE_DRES: tl.constexpr, BLOCK: tl.constexpr,
                            FROM_Y: tl.constexpr = False, WRITE_NORMED: tl.constexpr = False,
                            AMAX_PARTS=None, AMAX_STRIDE=0, AMAX: tl.constexpr = False):
    # FROM_Y: R holds the saved normalised y = r * rstd (lean norm_linear) instead of r.
    # WRITE_NORMED: also write weight * y (in NORMED's dtype), the recomputed input of the following projection.
    # AMAX (FP8 projections, kernels/fp8.py): also the maxima of |dx| and |normed| as written, for their casts:
    # per row (exact) and per column over this program's rows. AMAX_PARTS: float32 (4, AMAX_STRIDE) = the rows'
    # maxima of dx, of normed (n_rows each), the columns' of dx, of normed (n_prog x N each)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    cmax_dx = tl.zeros([BLOCK], dtype=tl.float32)
    cmax_n = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, n_rows, n_prog):
        base = tl.cast(row, tl.int64) * N
        g = tl.load(G + base + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if FROM_Y:
            y = tl.load(R + base + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            y = tl.load(R + base + cols, mask=mask, other=0.0).to(tl.float32) * rstd
        if WRITE_NORMED:
            normed = (w * y).to(NORMED.dtype.element_ty)
            tl.store(NORMED + base + cols, normed, mask=mask)
            if AMAX:
                an = tl.abs(normed.to(tl.float32))
                cmax_n = tl.maximum(cmax_n, an)
                tl.store(AMAX_PARTS + AMAX_STRIDE + row, tl.max(an, 0))
        dw += g * y
        dy = g * w
        dr = rstd * (dy - y * (tl.sum(dy * y, axis=0) / N))
        if HAS_GRES:
            dr += tl.load(GRES + base + cols, mask=mask, other=0.0).to(tl.float32)
        dx = dr.to(DX.dtype.element_ty)
        tl.store(DX + base + cols, dx, mask=mask)
        if AMAX:
            adx = tl.abs(dx.to(tl.float32))
            cmax_dx = tl.maximum(cmax_dx, adx)
            tl.store(AMAX_PARTS + row, tl.max(adx, 0))
        if WRITE_DRES:
            tl.store(DRES + base + cols, dr.to(DRES.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)
    if AMAX:
        tl.store(AMAX_PARTS + 2 * AMAX_STRIDE + pid * N + cols, cmax_dx, mask=mask)
        if WRITE_NORMED:
            tl.store(AMAX_PARTS + 3 * AMAX_STRIDE + pid * N + cols, cmax_n, mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def _residual_dtype(x: torch.Tensor, residual: Optional[torch.Tensor], residual_in_fp32: bool) -> torch.dtype:
    """The new residual's dtype, by torch's promotion rules applied to ``residual + x.float()`` (or ``+ x``)."""
    added = torch.float32 if residual_in_fp32 else x.dtype
    return added if residual is None else torch.promote_types(residual.dtype, added)


@torch.library.custom_op("z2all::add_rmsnorm_fwd", mutates_args=())
def _add_rmsnorm_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                     residual_in_fp32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    res_dtype = _residual_dtype(x, residual, residual_in_fp32)
    res2 = residual.reshape(-1, N).contiguous() if residual is not None else x2
    out = torch.empty_like(x2)
    res_out = torch.empty(x2.shape, dtype=res_dtype, device=x.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(N)
        _add_rmsnorm_fwd_kernel[(x2.shape[0],)](x2, res2, weight.contiguous(), out, res_out, rstd, out, N, eps,
                                                HAS_RESIDUAL=residual is not None, BLOCK=block,
                                                num_warps=_warps(block))
    return out.view(x.shape), res_out.view(x.shape), rstd


@_add_rmsnorm_fwd.register_fake
def _(x, residual, weight, eps, residual_in_fp32):
    res_dtype = _residual_dtype(x, residual, residual_in_fp32)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (torch.empty_like(x), torch.empty(x.shape, dtype=res_dtype, device=x.device),
            x.new_empty((rows,), dtype=torch.float32))


@torch.library.custom_op("z2all::add_rmsnorm_bwd", mutates_args=())
def _add_rmsnorm_bwd(grad_out: torch.Tensor, grad_res: Optional[torch.Tensor], res_out: torch.Tensor,
                     weight: torch.Tensor, rstd: torch.Tensor, x_dtype: torch.dtype,
                     want_dres: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N = res_out.shape[-1]
    g2 = grad_out.reshape(-1, N).contiguous()
    r2 = res_out.reshape(-1, N)
    n_rows = r2.shape[0]
    dx = torch.empty(r2.shape, dtype=x_dtype, device=r2.device)
    write_dres = want_dres and res_out.dtype != x_dtype
    dres = torch.empty(r2.shape, dtype=res_out.dtype, device=r2.device) if write_dres else dx
    n_prog = grid_programs(r2.device, max(n_rows, 1))
    partial = torch.zeros((n_prog, N), dtype=torch.float32, device=r2.device)
    if n_rows:
        gres = grad_res.reshape(-1, N).contiguous() if grad_res is not None else g2
        block = triton.next_power_of_2(N)
        _add_rmsnorm_bwd_kernel[(n_prog,)](g2, gres, r2, weight.contiguous(), rstd, dx, dres, partial, dx,
                                          n_rows, N,
                                          HAS_GRES=grad_res is not None, WRITE_DRES=write_dres, BLOCK=block,
                                          AMAX_PARTS=partial, AMAX_STRIDE=0, num_warps=_warps(block))
    dw = partial.sum(0).to(weight.dtype)
    dres_out = dres.view(res_out.shape) if write_dres else dx.view(res_out.shape).clone() if want_dres else \
        dx.new_empty((0,))
    return dx.view(res_out.shape), dres_out, dw


@_add_rmsnorm_bwd.register_fake
def _(grad_out, grad_res, res_out, weight, rstd, x_dtype, want_dres):
    dx = torch.empty(res_out.shape, dtype=x_dtype, device=res_out.device)
    dres = torch.empty_like(res_out) if want_dres else dx.new_empty((0,))
    return dx, dres, torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, residual, weight, eps, residual_in_fp32 = inputs
    _, res_out, rstd = output
    ctx.save_for_backward(res_out, weight, rstd)
    ctx.x_dtype = x.dtype
    ctx.has_residual = residual is not None


def _backward(ctx, grad_out, grad_res, grad_rstd):
    res_out, weight, rstd = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros(res_out.shape, dtype=ctx.x_dtype, device=res_out.device)
    dx, dres, dw = _add_rmsnorm_bwd(grad_out, grad_res, res_out, weight, rstd, ctx.x_dtype, ctx.has_residual)
    return dx, (dres if ctx.has_residual else None), dw, None, None


_add_rmsnorm_fwd.register_autograd(_backward, setup_context=_setup_context)


def triton_add_rmsnorm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                       residual_in_fp32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, new_residual)`` exactly as ``ops.add_rmsnorm_torch`` computes them, in one fused kernel.

    x (..., N) in the compute dtype; residual (..., N) or None; weight (N,). ``normed`` has x's dtype; the new
    residual is float32 when ``residual_in_fp32``, else the promotion of the residual's and x's dtypes.
    """
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rmsnorm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rmsnorm: weight shape {tuple(weight.shape)} != ({x.shape[-1]},)")
    normed, res_out, _ = _add_rmsnorm_fwd(x, residual, weight, float(eps), bool(residual_in_fp32))
    return normed, res_out
