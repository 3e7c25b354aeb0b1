"""FP8 linears for training: dynamic scaling, our fused amax + scale + cast kernels, GEMMs on ``torch._scaled_mm``.

Formats (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``)::

    E4M3: 3 mantissa bits, largest 448,   smallest normal 2^-6,  smallest subnormal 2^-9
    E5M2: 2 mantissa bits, largest 57344, smallest normal 2^-14, smallest subnormal 2^-16

Scaling rule (dynamic, recomputed from the operand itself at every cast). For a group G of elements (one row for
axiswise scaling, the whole tensor for tensorwise) with amax = max |x| over G (clamped below at 1e-12)::

    r = FMAX / amax                 the multiplier (FMAX = 448 or 57344)
    q = round_fp8(clamp(x * r, -FMAX, FMAX))     round to nearest, ties to even
    s = amax / FMAX                 the dequantisation scale: x ~= q * s

The GEMM ``out = (A_q * s_A) @ (B_q * s_B)^T`` runs on FP8 tensor cores (``torch._scaled_mm``, float32
accumulation, the scales applied in its epilogue). Every operand is quantised along its *contraction* axis, so
each of the three GEMMs of a linear ``y = x W^T`` (x: M x K tokens, W: N x K) gets its own casts::

    forward       y  = x  @ W^T       x: per row (token) over K          W: per row (output channel) over K
    grad input    dx = dy @ W         dy: per row over N                  W^T: per column of W, over N
    grad weight   dW = dy^T @ x       dy^T: per column of dy, over M      x^T: per column of x, over M

"Rowwise" (``fp8_rowwise``, the default FP8 recipe) scales axiswise as above; "tensorwise" (``fp8_tensorwise``)
uses one scale per tensor for every cast. Forward operands are E4M3. Gradients: E4M3 with rowwise scaling (a
per-row scale already absorbs the gradients' range across tokens, so the extra mantissa bit buys precision:
about half the quantisation error of E5M2), E5M2 with tensorwise scaling (one scale for a whole gradient tensor
needs the range: E4M3 would flush the small rows to zero). ``tests/test_fp8_numerics.py`` measures both.

Kernels (one read of the operand from memory each, where the scales allow it):

    _rowwise_cast_kernel   a few rows per program (8192 elements): amax, scale, cast, write q and s. A row up to
                           8192 elements stays in registers (one read); a longer one is read again from cache.
                           SWIGLU: the operand is a = silu(gate) * up, made from gate_up in the same pass
                           (``quantize_swiglu``: a is never written)
    _norm_rowwise_cast_kernel   residual add + RMSNorm (as kernels/rmsnorm.py) with the rowwise cast of its
                           output in the same pass (``norm_quantize``: normed is never written)
    _amax_kernel           per-row and per-column (or whole-tensor) amax. Program (i, j) takes a band of BM rows
                           and every S-th tile of BK columns (S programs per band, enough to fill the GPU); it
                           stores its bands' column maxima and its rows' partial maxima without atomics, and two
                           small reductions finish them
    _cast_kernel           the same grid: cast each tile once and write it twice, q (row or tensor scaled) and
                           the transposed copy q^T (column or tensor scaled, BK rows of BM contiguous bytes), the
                           layout the backward GEMMs consume
    _swiglu_bwd_amax_kernel   SwiGLU's backward (as kernels/swiglu.py) on the same grid, writing with d gate_up
                           and the rebuilt a their partial maxima (``swiglu_backward``)

Tiles are 64 x 128 (rows x columns; measured, see ``TILE``). So a rowwise cast of a forward input is one
pass (none of its own for the normed inputs and the SwiGLU output); where backward needs the transposed,
column-scaled copy (the gradient dy for both backward GEMMs, the inputs and W for their transposes) the amax pass
comes first and one cast pass writes both copies. With ``model.ops.fp8_fused_amax`` the kernel that produced
the operand writes its maxima (the model's ``fp8_ref.AmaxHints``: the norm backward for dx and normed', the
SwiGLU backward for d gate_up and a, and with tensorwise scaling the norm and SwiGLU forward for normed and a) and
the amax pass is skipped. The weights' casts are made once per optimizer step (the model's
``fp8_ref.WeightCasts``; both live on its numerics context, ``kernels/numerics.py``).

Monitoring: each cast counts its saturated elements (|q| = FMAX) and its underflows (x != 0 but q = 0) with two
atomic adds per program; the model's ``numerics.fp8_stats`` sums them per layer kind (qkv, o, gate_up, down) and the
trainer reads them once per logging window. Under torch.compile the counts are not collected (they are accumulated
outside the ops). The GEMMs, the reference quantiser ``quantize_torch`` and the autograd Function ``FP8Linear`` are
in ``fp8_ref.py`` (no Triton needed there).

Bit exactness: on a GPU the kernels round with the hardware's FP8 conversion (round to nearest even, as torch's
float8 casts); under the Triton interpreter they round to the FP8 grid in float32 arithmetic first (``_to_grid``:
the value is then exactly representable, so the cast is exact). Either way they agree bit for bit with
``fp8_ref.quantize_torch`` (tests/test_kernels_fp8.py, on CPU and on a GPU). The float32 rounding on a GPU
(``NATIVE_CAST = False``) made the casts ALU-bound: 1.4x slower over the z2all-1.1b casts.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from zero2all.kernels import grid_programs
from zero2all.kernels.fp8_ref import AMAX_FLOOR, E4M3, E5M2, AmaxHints, AmaxSite, Quantized, _rows2d
from zero2all.kernels.rmsnorm import add_rmsnorm_row

# (mantissa bits, smallest normal exponent) of each format, for the rounding in the kernels
_GRID = {E4M3: (3, -6), E5M2: (2, -14)}


# --------------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _to_grid(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 ``y`` (already within +-FMAX) to the nearest FP8 value, ties to even: the spacing of the grid
    at y is ulp = 2^(max(e, MIN_EXP) - MANT) (e: y's binary exponent), and (v + 1.5 * 2^23) - 1.5 * 2^23 rounds
    v = y / ulp to an integer in float32's round-to-nearest-even."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    inv_ulp = ((127 + MANT - e) << 23).to(tl.float32, bitcast=True)
    ulp = ((127 - MANT + e) << 23).to(tl.float32, bitcast=True)
    return ((y * inv_ulp + 12582912.0) - 12582912.0) * ulp


@triton.jit
def _round(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr, NATIVE: tl.constexpr, TY: tl.constexpr):
    """y (within +-FMAX) rounded to the FP8 grid, as float32. NATIVE (a GPU): the hardware conversion to the FP8
    type, which rounds to nearest even like torch's casts; otherwise (the interpreter) ``_to_grid``."""
    if NATIVE:
        return y.to(TY).to(tl.float32)
    return _to_grid(y, MANT, MIN_EXP)


@triton.jit
def _load_rows(X, rows64, cols, mask, stride_x, K, SWIGLU: tl.constexpr, A_DTYPE: tl.constexpr):
    """A tile of the operand in float32. SWIGLU: X holds rows [gate | up] (K each) and the operand is
    a = silu(gate) * up rounded to A_DTYPE, exactly as ``kernels/swiglu.py`` writes it."""
    if SWIGLU:
        gate = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + rows64[:, None] * stride_x + K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        return (gate * tl.sigmoid(gate) * up).to(A_DTYPE).to(tl.float32)
    return tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rowwise_cast_kernel(X, Q, S, CNT, M, K, stride_x, FMAX: tl.constexpr, MANT: tl.constexpr,
                         MIN_EXP: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                         COUNT: tl.constexpr, NATIVE: tl.constexpr, SWIGLU: tl.constexpr = False,
                         A_DTYPE: tl.constexpr = tl.bfloat16, STORE_X: tl.constexpr = False):
    # BM rows per program, BLOCK columns at a time; ONE_PASS (K <= BLOCK): the rows stay in registers between the
    # amax and the cast, else they are read a second time (from cache). SWIGLU: see _load_rows. STORE_X: no
    # cast; the operand itself goes to Q (in Q's dtype) and its rows' amax to S (``swiglu_amax``)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = rmask[:, None] & (cols < K)[None, :]
    x = _load_rows(X, rows64, cols, mask, stride_x, K, SWIGLU, A_DTYPE)
    amax = tl.max(tl.abs(x), 1)
    if not ONE_PASS:
        for k0 in range(BLOCK, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            mask = rmask[:, None] & (cols < K)[None, :]
            xk = _load_rows(X, rows64, cols, mask, stride_x, K, SWIGLU, A_DTYPE)
            amax = tl.maximum(amax, tl.max(tl.abs(xk), 1))
    if STORE_X:
        tl.store(S + rows, amax, mask=rmask)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            mask = rmask[:, None] & (cols < K)[None, :]
            if not ONE_PASS:
                x = _load_rows(X, rows64, cols, mask, stride_x, K, SWIGLU, A_DTYPE)
            tl.store(Q + rows64[:, None] * K + cols[None, :], x.to(Q.dtype.element_ty), mask=mask)
    else:
        a = tl.maximum(amax, 1e-12)
        fmax = tl.zeros([BM], dtype=tl.float32) + FMAX
        r = tl.math.div_rn(fmax, a)
        tl.store(S + rows, tl.math.div_rn(a, fmax), mask=rmask)
        sat = tl.zeros([BM], dtype=tl.int32)
        under = tl.zeros([BM], dtype=tl.int32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            mask = rmask[:, None] & (cols < K)[None, :]
            if not ONE_PASS:
                x = _load_rows(X, rows64, cols, mask, stride_x, K, SWIGLU, A_DTYPE)
            q = _round(tl.clamp(x * r[:, None], -FMAX, FMAX), MANT, MIN_EXP, NATIVE, Q.dtype.element_ty)
            tl.store(Q + rows64[:, None] * K + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
            if COUNT:
                sat += tl.sum(((tl.abs(q) >= FMAX) & mask).to(tl.int32), 1)
                under += tl.sum(((x != 0.0) & (q == 0.0)).to(tl.int32), 1)
        if COUNT:
            tl.atomic_add(CNT, tl.sum(sat, 0).to(tl.int64))
            tl.atomic_add(CNT + 1, tl.sum(under, 0).to(tl.int64))


@triton.jit
def _amax_kernel(X, ROW_PART, COL_PART, M, K, stride_x, ROWS: tl.constexpr, COLS: tl.constexpr,
                 BM: tl.constexpr, BK: tl.constexpr):
    # program (i, j): the band of rows i, column tiles j, j + S, j + 2 S, ... (S programs along axis 1). Writes,
    # without atomics, the band's amax per column tile into COL_PART[i, :] and its rows' amax over its tiles into
    # ROW_PART[j, :]; the partial maxima are reduced afterwards (over S, and over the bands)
    pid_m, pid_s, n_split = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    ramax = tl.zeros([BM], dtype=tl.float32)
    for t in range(pid_s, tl.cdiv(K, BK), n_split):
        cols = t * BK + tl.arange(0, BK)
        cmask = cols < K
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0)
        x = tl.abs(x.to(tl.float32))
        if ROWS:
            ramax = tl.maximum(ramax, tl.max(x, 1))
        if COLS:
            tl.store(COL_PART + pid_m.to(tl.int64) * K + cols, tl.max(x, 0), mask=cmask)
    if ROWS:
        tl.store(ROW_PART + pid_s.to(tl.int64) * M + rows, ramax, mask=rmask)


@triton.jit
def _cast_kernel(X, Q, QT, ROW_AMAX, COL_AMAX, ROW_S, COL_S, CNT, HIST, SLOT, NEXT, HIST_LEN, M, K, stride_x,
                 FMAX: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, WRITE_Q: tl.constexpr,
                 WRITE_QT: tl.constexpr, TENSOR: tl.constexpr, COUNT: tl.constexpr, BM: tl.constexpr,
                 BK: tl.constexpr, NATIVE: tl.constexpr, HISTORY: tl.constexpr, OBSERVE: tl.constexpr,
                 HIST_BLOCK: tl.constexpr, SEEN_ROWS: tl.constexpr = True):
    # Q (M, K): rows scaled by ROW_AMAX (or the tensor's amax, ROW_AMAX[0]); QT (K, M): the transposed copy,
    # scaled per column of X by COL_AMAX (or the tensor's amax). Program (i, j) casts the tiles of band i as in
    # _amax_kernel; the transposed tile is stored as BK rows of BM contiguous bytes. The dequantisation scales
    # amax / FMAX go to ROW_S (by the programs j = 0; ROW_S[0] for a tensor) and COL_S (by the programs i = 0).
    # HISTORY (tensorwise, delayed scaling): the tensor's amax is the maximum of HIST[0 .. HIST_LEN) except
    # HIST[SLOT] and HIST[NEXT]; with OBSERVE each program adds the amax of its tiles to HIST[SLOT] (an atomic
    # maximum; the slot holds 0) and program (0, 0) zeroes HIST[NEXT], the slot of the site's next cast
    pid_m, pid_s, n_split = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    fmax = tl.full([], FMAX, tl.float32)
    if SEEN_ROWS:           # the running maxima per row, reduced once at the end
        seen = tl.zeros([BM], dtype=tl.float32)
    else:                   # one running maximum, each tile reduced to a scalar
        seen = tl.zeros([], dtype=tl.float32)
    if TENSOR:
        if HISTORY:
            hidx = tl.arange(0, HIST_BLOCK)
            h = tl.load(HIST + hidx, mask=(hidx < HIST_LEN) & (hidx != SLOT) & (hidx != NEXT), other=0.0)
            ta = tl.maximum(tl.max(h, 0), 1e-12)
            if OBSERVE and (pid_m == 0) & (pid_s == 0):
                tl.store(HIST + NEXT, 0.0)
        else:
            ta = tl.maximum(tl.load(ROW_AMAX), 1e-12)
        r = tl.math.div_rn(fmax, ta)
        if (pid_m == 0) & (pid_s == 0):
            tl.store(ROW_S, tl.math.div_rn(ta, fmax))
    elif WRITE_Q:
        ra = tl.maximum(tl.load(ROW_AMAX + rows, mask=rmask, other=1.0), 1e-12)
        fmax_m = tl.zeros([BM], dtype=tl.float32) + fmax
        r = tl.math.div_rn(fmax_m, ra)
        if pid_s == 0:
            tl.store(ROW_S + rows, tl.math.div_rn(ra, fmax_m), mask=rmask)
    sat = tl.zeros([BM], dtype=tl.int32)
    under = tl.zeros([BM], dtype=tl.int32)
    for t in range(pid_s, tl.cdiv(K, BK), n_split):
        cols = t * BK + tl.arange(0, BK)
        cmask = cols < K
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if OBSERVE:
            if SEEN_ROWS:
                seen = tl.maximum(seen, tl.max(tl.abs(x), 1))
            else:
                seen = tl.maximum(seen, tl.max(tl.max(tl.abs(x), 1), 0))
        if WRITE_Q:
            if TENSOR:
                q = _round(tl.clamp(x * r, -FMAX, FMAX), MANT, MIN_EXP, NATIVE, Q.dtype.element_ty)
            else:
                q = _round(tl.clamp(x * r[:, None], -FMAX, FMAX), MANT, MIN_EXP, NATIVE, Q.dtype.element_ty)
            tl.store(Q + rows64[:, None] * K + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
            if COUNT:
                sat += tl.sum(((tl.abs(q) >= FMAX) & mask).to(tl.int32), 1)
                under += tl.sum(((x != 0.0) & (q == 0.0)).to(tl.int32), 1)
        if WRITE_QT:
            if TENSOR:
                qt = _round(tl.clamp(x * r, -FMAX, FMAX), MANT, MIN_EXP, NATIVE, QT.dtype.element_ty)
            else:
                ca = tl.maximum(tl.load(COL_AMAX + cols, mask=cmask, other=1.0), 1e-12)
                fmax_k = tl.zeros([BK], dtype=tl.float32) + fmax
                c = tl.math.div_rn(fmax_k, ca)
                if pid_m == 0:
                    tl.store(COL_S + cols, tl.math.div_rn(ca, fmax_k), mask=cmask)
                qt = _round(tl.clamp(x * c[None, :], -FMAX, FMAX), MANT, MIN_EXP, NATIVE,
                            QT.dtype.element_ty)
            tl.store(QT + cols.to(tl.int64)[:, None] * M + rows64[None, :], tl.trans(qt.to(QT.dtype.element_ty)),
                     mask=tl.trans(mask))
            if COUNT:
                sat += tl.sum(((tl.abs(qt) >= FMAX) & mask).to(tl.int32), 1)
                under += tl.sum(((x != 0.0) & (qt == 0.0)).to(tl.int32), 1)
    if COUNT:
        tl.atomic_add(CNT, tl.sum(sat, 0).to(tl.int64))
        tl.atomic_add(CNT + 1, tl.sum(under, 0).to(tl.int64))
    if OBSERVE:
        if SEEN_ROWS:
            tl.atomic_max(HIST + SLOT, tl.max(seen, 0))
        else:
            tl.atomic_max(HIST + SLOT, seen)


@triton.jit
def _norm_rowwise_cast_kernel(X, RES, W, RES_OUT, RSTD, Y, Q, S, CNT, M, N, eps, HAS_RESIDUAL: tl.constexpr,
                              BLOCK: tl.constexpr, NORMED_DTYPE: tl.constexpr, FMAX: tl.constexpr,
                              MANT: tl.constexpr, MIN_EXP: tl.constexpr, NATIVE: tl.constexpr,
                              STORE_NORMED: tl.constexpr = False):
    # one row: kernels/rmsnorm.py's add_rmsnorm_row (as _add_rmsnorm_fwd_kernel with WRITE_Y), then, instead of
    # storing normed = round_c(w * y), its rowwise FP8 cast; the row's counters go to CNT[row] and CNT[M + row].
    # STORE_NORMED: normed itself goes to Q (in Q's dtype) and the row's amax to S, no cast (``norm_amax``)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    y = add_rmsnorm_row(X, RES, RES_OUT, RSTD, row, cols, mask, N, eps, HAS_RESIDUAL)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (w * y).to(NORMED_DTYPE).to(tl.float32)
    if STORE_NORMED:
        tl.store(Q + row * N + cols, normed.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + row, tl.max(tl.abs(normed), 0))
    else:
        a = tl.maximum(tl.max(tl.abs(normed), 0), 1e-12)
        fmax = tl.full([], FMAX, tl.float32)
        ratio = tl.math.div_rn(fmax, a)
        tl.store(S + row, tl.math.div_rn(a, fmax))
        q = _round(tl.clamp(normed * ratio, -FMAX, FMAX), MANT, MIN_EXP, NATIVE, Q.dtype.element_ty)
        tl.store(Q + row * N + cols, q.to(Q.dtype.element_ty), mask=mask)
        tl.store(CNT + row, tl.sum(((tl.abs(q) >= FMAX) & mask).to(tl.int32), 0))
        tl.store(CNT + M + row, tl.sum(((normed != 0.0) & (q == 0.0)).to(tl.int32), 0))


@triton.jit
def _swiglu_bwd_amax_kernel(G, GU, DGU, A, DGU_ROW, DGU_COL, A_ROW, A_COL, M, I, stride_gu, BM: tl.constexpr,
                            BK: tl.constexpr, WRITE_A: tl.constexpr, COLS: tl.constexpr):
    # kernels/swiglu.py's backward (the same arithmetic, so the same values) over the tiles of _amax_kernel's
    # grid, which also writes the partial maxima of what it stores: |d gate_up| per row (DGU_ROW[j, :]) and per
    # column (DGU_COL[i, :], COLS), and the same of a = silu(gate) * up (A_ROW, A_COL) when WRITE_A
    pid_m, pid_s, n_split = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    ramax_d = tl.zeros([BM], dtype=tl.float32)
    ramax_a = tl.zeros([BM], dtype=tl.float32)
    for t in range(pid_s, tl.cdiv(I, BK), n_split):
        cols = t * BK + tl.arange(0, BK)
        cmask = cols < I
        mask = rmask[:, None] & cmask[None, :]
        g = tl.load(G + rows64[:, None] * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(GU + rows64[:, None] * stride_gu + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(GU + rows64[:, None] * stride_gu + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(gate)
        d_up = (g * gate * s).to(DGU.dtype.element_ty)
        d_gate = (g * up * s * (1.0 + gate * (1.0 - s))).to(DGU.dtype.element_ty)
        tl.store(DGU + rows64[:, None] * (2 * I) + cols[None, :], d_gate, mask=mask)
        tl.store(DGU + rows64[:, None] * (2 * I) + I + cols[None, :], d_up, mask=mask)
        ad_gate, ad_up = tl.abs(d_gate.to(tl.float32)), tl.abs(d_up.to(tl.float32))
        ramax_d = tl.maximum(ramax_d, tl.maximum(tl.max(ad_gate, 1), tl.max(ad_up, 1)))
        if COLS:
            tl.store(DGU_COL + pid_m.to(tl.int64) * (2 * I) + cols, tl.max(ad_gate, 0), mask=cmask)
            tl.store(DGU_COL + pid_m.to(tl.int64) * (2 * I) + I + cols, tl.max(ad_up, 0), mask=cmask)
        if WRITE_A:
            a = (gate * s * up).to(A.dtype.element_ty)
            tl.store(A + rows64[:, None] * I + cols[None, :], a, mask=mask)
            aa = tl.abs(a.to(tl.float32))
            ramax_a = tl.maximum(ramax_a, tl.max(aa, 1))
            if COLS:
                tl.store(A_COL + pid_m.to(tl.int64) * I + cols, tl.max(aa, 0), mask=cmask)
    tl.store(DGU_ROW + pid_s.to(tl.int64) * M + rows, ramax_d, mask=rmask)
    if WRITE_A:
        tl.store(A_ROW + pid_s.to(tl.int64) * M + rows, ramax_a, mask=rmask)


# --------------------------------------------------------------------------------------------------------------
# quantisation with the kernels

# tile shapes (chosen on an H100 by ``benchmarks/fp8_cast_bench.py --choose``, BENCHMARKS.md): the rowwise
# kernel's elements per program, and the transposed cast's tile (BM x BK; 64 x 128 measured faster than 128 x 128
# and 64 x 64: 2.42 / 2.86 / 2.68 ms over the z2all-1.1b casts)
ROWWISE_TILE = 8192
TILE = {"BM": 64, "BK": 128, "num_warps": 4}
SEEN_ROWS = False       # delayed casts: their own amax per tile into one running maximum (True: per row;
                        # measured 0.8 % slower over a z2all-1.1b step on an H100)
NATIVE_CAST = True      # on a GPU, round with the hardware's FP8 conversion (False: the float32 rounding, _to_grid)


def _split(device: torch.device, bands: int, tiles_k: int) -> int:
    """Programs per band of rows: enough bands x splits to fill the GPU a few times over (few partial maxima)."""
    return max(1, min(tiles_k, -(-grid_programs(device, bands * tiles_k) // bands)))


@dataclass
class _Cast:
    """One quantisation: the 2-D input, its FP8 format's grid, what is wanted, and the buffers the kernels fill
    (q (M, K) and qt (K, M) where wanted; ``counts``: [saturated, flushed to zero])."""

    x: torch.Tensor
    dtype: torch.dtype
    want_q: bool
    want_qt: bool
    q: Optional[torch.Tensor] = None
    qt: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None

    def __post_init__(self):
        M, K, dev = *self.x.shape, self.x.device
        self.counts = torch.zeros(2, dtype=torch.int64, device=dev)
        self.q = torch.empty((M, K), dtype=self.dtype, device=dev) if self.want_q else None
        self.qt = torch.empty((K, M), dtype=self.dtype, device=dev) if self.want_qt else None

    @property
    def grid(self) -> dict:
        """The kernels' format arguments: largest value, mantissa bits, smallest exponent, native rounding."""
        mant, min_exp = _GRID[self.dtype]
        return dict(FMAX=float(torch.finfo(self.dtype).max), MANT=mant, MIN_EXP=min_exp,
                    NATIVE=self.x.is_cuda and NATIVE_CAST)

    @functools.cached_property
    def tiles(self) -> tuple[int, int, int]:
        """(bands of BM rows, tiles of BK columns, programs per band) of the tiled kernels."""
        M, K = self.x.shape
        bands, tiles_k = triton.cdiv(M, TILE["BM"]), triton.cdiv(K, TILE["BK"])
        return bands, tiles_k, _split(self.x.device, bands, tiles_k)

    def out(self, q_s, qt_s) -> Quantized:
        return Quantized(self.q, q_s, self.qt, qt_s, self.counts)


def quantize(x: torch.Tensor, dtype: torch.dtype, scaling: str, want_q: bool = True, want_qt: bool = False,
             history: Optional[AmaxSite] = None, observe: bool = True,
             hints: Optional[AmaxHints] = None) -> Quantized:
    """Quantise a 2-D tensor with the Triton kernels. ``scaling``: ``axis`` (q per row, qt per column) or
    ``tensor`` (one scale for both). Where the kernel that produced ``x`` left its partial maxima in ``hints``
    (the model's ``AmaxHints``), the amax pass is skipped. ``history`` (tensorwise): delayed scaling, the scale
    from that site's recorded maxima and no amax pass (``fp8_ref.AmaxHistory``); ``observe``: record x's own
    amax there.

    The recipes, each its own function: rows only (one pass per row, :func:`_quantize_rows`); nothing to cast
    (:func:`_floor_scales`); delayed tensorwise scaling (one pass, :func:`_quantize_delayed`); otherwise the
    maxima (handed over or from an amax pass) and then the cast (:func:`_quantize_two_pass`)."""
    cast = _Cast(_rows2d(x), dtype, want_q, want_qt)
    tensor = scaling == "tensor"
    if not tensor:
        history = None
    if scaling == "axis" and not want_qt:
        return _quantize_rows(cast)
    M, K = cast.x.shape
    if not (M and K):
        return _floor_scales(cast, tensor)
    hint = hints.take(cast.x) if hints is not None else None
    if history is not None and not history.empty and hint is None:
        return _quantize_delayed(cast, history, observe)
    return _quantize_two_pass(cast, tensor, hint, history if observe else None)


def _quantize_rows(cast: _Cast) -> Quantized:
    """Axis scaling of the rows only: each program finds its rows' maxima and casts them (one read of x)."""
    x, (M, K) = cast.x, cast.x.shape
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M and K:
        block = min(ROWWISE_TILE, triton.next_power_of_2(K))
        bm = max(1, ROWWISE_TILE // block)
        _rowwise_cast_kernel[(triton.cdiv(M, bm),)](x, cast.q, s, cast.counts, M, K, x.stride(0), BM=bm,
                                                    BLOCK=block, ONE_PASS=K <= block, COUNT=True, num_warps=8,
                                                    **cast.grid)
    return cast.out(s, None)


def _floor_scales(cast: _Cast, tensor: bool) -> Quantized:
    """Nothing to cast (M or K is 0): the scales of all-zero groups, AMAX_FLOOR / the format's largest value."""
    M, K = cast.x.shape
    floor = torch.full((), AMAX_FLOOR, dtype=torch.float32, device=cast.x.device)
    floor = floor / torch.full_like(floor, cast.grid["FMAX"])
    if tensor:
        return cast.out(floor if cast.want_q else None, floor if cast.want_qt else None)
    return cast.out(floor.expand(M).clone() if cast.want_q else None, floor.expand(K).clone() if cast.want_qt else None)


def _quantize_delayed(cast: _Cast, history: AmaxSite, observe: bool) -> Quantized:
    """Delayed tensorwise scaling: the scale from the site's recorded maxima, cast in one pass (which records
    x's own amax in the site's open slot when ``observe``)."""
    x, (M, K) = cast.x, cast.x.shape
    bands, _, n_split = cast.tiles
    q_s = torch.empty((), dtype=torch.float32, device=x.device)
    slot, nxt = history.open_slot() if observe else (-1, -1)
    L = history.buf.numel()
    _cast_kernel[(bands, n_split)](x, cast.q if cast.want_q else x, cast.qt if cast.want_qt else x, q_s, q_s, q_s,
                                   q_s, cast.counts, history.buf, slot, nxt, L, M, K, x.stride(0),
                                   WRITE_Q=cast.want_q, WRITE_QT=cast.want_qt, TENSOR=True, COUNT=True,
                                   BM=TILE["BM"], BK=TILE["BK"], HISTORY=True, OBSERVE=observe,
                                   HIST_BLOCK=triton.next_power_of_2(L), SEEN_ROWS=SEEN_ROWS,
                                   num_warps=TILE["num_warps"], **cast.grid)
    return cast.out(q_s if cast.want_q else None, q_s if cast.want_qt else None)


def _partial_maxima(cast: _Cast, rows: bool, cols: bool, hint) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial maxima of |x|: (programs per band, M) over rows and (bands, K) over columns (empty where not
    wanted), handed over in ``hint`` by the kernel that produced x, or from one amax pass."""
    if hint is not None and (hint[1] is not None or not cols):
        return hint
    x, (M, K) = cast.x, cast.x.shape
    bands, _, n_split = cast.tiles
    # every partial maximum is written by exactly one program: no initialisation needed
    row_part = torch.empty((n_split, M) if rows else (0,), dtype=torch.float32, device=x.device)
    col_part = torch.empty((bands, K) if cols else (0,), dtype=torch.float32, device=x.device)
    _amax_kernel[(bands, n_split)](x, row_part, col_part, M, K, x.stride(0), ROWS=rows, COLS=cols, BM=TILE["BM"],
                                   BK=TILE["BK"], num_warps=TILE["num_warps"])
    return row_part, col_part


def _quantize_two_pass(cast: _Cast, tensor: bool, hint, record: Optional[AmaxSite]) -> Quantized:
    """The maxima (:func:`_partial_maxima`) reduced to the tensor's, the rows' and the columns' amax, then the
    cast. ``record``: the delayed-scaling site whose first cast this is (or whose maxima were handed over),
    which records the tensor's amax."""
    x, (M, K), want_q, want_qt = cast.x, cast.x.shape, cast.want_q, cast.want_qt
    cols_wanted = want_qt and not tensor
    row_part, col_part = _partial_maxima(cast, want_q or tensor, cols_wanted, hint)
    if tensor:
        row_amax = row_part.amax().reshape(1)
        if record is not None:
            record.record(row_amax)
    else:
        row_amax = (row_part.amax(0) if row_part.shape[0] > 1 else row_part[0]) if want_q else row_part
    col_amax = (col_part.amax(0) if col_part.shape[0] > 1 else col_part[0]) if cols_wanted else col_part
    q_s = torch.empty(() if tensor else M, dtype=torch.float32, device=x.device) if want_q or tensor else None
    qt_s = torch.empty(K, dtype=torch.float32, device=x.device) if cols_wanted else None
    bands, _, n_split = cast.tiles
    _cast_kernel[(bands, n_split)](x, cast.q if want_q else x, cast.qt if want_qt else x, row_amax, col_amax,
                                   q_s if q_s is not None else row_amax, qt_s if qt_s is not None else col_amax,
                                   cast.counts, row_amax, -1, -1, 1, M, K, x.stride(0), WRITE_Q=want_q,
                                   WRITE_QT=want_qt, TENSOR=tensor, COUNT=True, BM=TILE["BM"], BK=TILE["BK"],
                                   HISTORY=False, OBSERVE=False, HIST_BLOCK=1, num_warps=TILE["num_warps"],
                                   **cast.grid)
    if tensor:
        return cast.out(q_s if want_q else None, q_s if want_qt else None)
    return cast.out(q_s, qt_s)


def swiglu_backward(grad_a: torch.Tensor, gate_up: torch.Tensor, dgu_dtype: torch.dtype, a_dtype: torch.dtype,
                    scaling: str, want_a: bool, hints: Optional[AmaxHints] = None
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """SwiGLU's backward for FP8 projections: ``(d gate_up (M, 2 I), a (M, I) or None)`` from ``grad_a``
    (M, I) and ``gate_up`` (M, 2 I) (row-major), with the values of ``kernels/swiglu.py``'s backward. The same
    pass writes the partial maxima of d gate_up and of a for their next ``quantize`` (into ``hints``; the
    scaling, ``axis`` or ``tensor``, says which are needed), so that neither is read again for its amax."""
    M, I = grad_a.shape
    if gate_up.shape != (M, 2 * I) or gate_up.stride(1) != 1 or not grad_a.is_contiguous():
        raise ValueError(f"fp8 swiglu_backward: grad_a {tuple(grad_a.shape)} (contiguous) and gate_up "
                         f"{tuple(gate_up.shape)} (row-major, 2 x its width) expected")
    dgu = torch.empty((M, 2 * I), dtype=dgu_dtype, device=grad_a.device)
    a = torch.empty((M, I), dtype=a_dtype, device=grad_a.device) if want_a else None
    if not (M and I):
        return dgu, a
    BM, BK = TILE["BM"], TILE["BK"]
    bands, tiles = triton.cdiv(M, BM), triton.cdiv(I, BK)
    n_split = _split(grad_a.device, bands, tiles)
    cols = scaling == "axis"
    f32 = dict(dtype=torch.float32, device=grad_a.device)
    dgu_row, dgu_col = torch.empty((n_split, M), **f32), torch.empty((bands, 2 * I) if cols else (0,), **f32)
    a_row = torch.empty((n_split, M) if want_a else (0,), **f32)
    a_col = torch.empty((bands, I) if want_a and cols else (0,), **f32)
    _swiglu_bwd_amax_kernel[(bands, n_split)](grad_a, gate_up, dgu, a if want_a else dgu, dgu_row, dgu_col, a_row,
                                              a_col, M, I, gate_up.stride(0), BM=BM, BK=BK, WRITE_A=want_a,
                                              COLS=cols, num_warps=TILE["num_warps"])
    if hints is not None:
        hints.put(dgu, dgu_row, dgu_col if cols else None)
        if want_a:
            hints.put(a, a_row, a_col if cols else None)
    return dgu, a


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def quantize_swiglu(gate_up: torch.Tensor, a_dtype: torch.dtype, dtype: torch.dtype = E4M3) -> Quantized:
    """The rowwise cast of a = silu(gate) * up (rounded to ``a_dtype``) for ``gate_up`` (M, 2 I) = [gate | up],
    computed from gate_up in the cast's own pass: a is never written to memory. Equal bit for bit to
    ``quantize(triton_swiglu(gate_up).to(a_dtype), dtype, "axis")``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"fp8 quantize_swiglu: expected a row-major (M, 2 I) tensor, got shape "
                         f"{tuple(gate_up.shape)}, strides {gate_up.stride()}")
    M, K = gate_up.shape[0], gate_up.shape[1] // 2
    mant, min_exp = _GRID[dtype]
    counts = torch.zeros(2, dtype=torch.int64, device=gate_up.device)
    q = torch.empty((M, K), dtype=dtype, device=gate_up.device)
    s = torch.empty(M, dtype=torch.float32, device=gate_up.device)
    if M and K:
        block = min(ROWWISE_TILE, triton.next_power_of_2(K))
        bm = max(1, ROWWISE_TILE // block)
        _rowwise_cast_kernel[(triton.cdiv(M, bm),)](gate_up, q, s, counts, M, K, gate_up.stride(0),
                                                    FMAX=float(torch.finfo(dtype).max), MANT=mant, MIN_EXP=min_exp,
                                                    BM=bm, BLOCK=block, ONE_PASS=K <= block, COUNT=True,
                                                    SWIGLU=True, A_DTYPE=_TL_DTYPES[a_dtype],
                                                    NATIVE=gate_up.is_cuda and NATIVE_CAST, num_warps=8)
    return Quantized(q, s, None, None, counts)


def swiglu_amax(gate_up: torch.Tensor, a_dtype: torch.dtype, hints: Optional[AmaxHints] = None) -> torch.Tensor:
    """a = silu(gate) * up (rounded to ``a_dtype``, the values of ``kernels/swiglu.py``) for ``gate_up`` (M, 2 I),
    written with its rows' amax in the same pass, handed to a's next ``quantize`` (``hints``: tensorwise
    scaling then needs no amax pass of its own)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"fp8 swiglu_amax: expected a row-major (M, 2 I) tensor, got shape "
                         f"{tuple(gate_up.shape)}, strides {gate_up.stride()}")
    M, K = gate_up.shape[0], gate_up.shape[1] // 2
    a = torch.empty((M, K), dtype=a_dtype, device=gate_up.device)
    amax = torch.empty(M, dtype=torch.float32, device=gate_up.device)
    if M and K:
        block = min(ROWWISE_TILE, triton.next_power_of_2(K))
        bm = max(1, ROWWISE_TILE // block)
        _rowwise_cast_kernel[(triton.cdiv(M, bm),)](gate_up, a, amax, amax, M, K, gate_up.stride(0), FMAX=448.0,
                                                    MANT=3, MIN_EXP=-6, BM=bm, BLOCK=block, ONE_PASS=K <= block,
                                                    COUNT=False, SWIGLU=True, A_DTYPE=_TL_DTYPES[a_dtype],
                                                    NATIVE=False, STORE_X=True, num_warps=8)
        if hints is not None:
            hints.put(a, amax.view(1, M), None)
    return a


def norm_quantize(x2: torch.Tensor, res2: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                  res_out: torch.Tensor, rstd: torch.Tensor, yhat: torch.Tensor, normed_dtype: torch.dtype,
                  warps: int, dtype: torch.dtype = E4M3, store_normed: bool = False,
                  hints: Optional[AmaxHints] = None) -> Quantized:
    """The residual add + RMSNorm of ``kernels/rmsnorm.py`` (writing res_out, rstd and yhat as its forward kernel
    with WRITE_Y does) with the rowwise FP8 cast of normed = round_c(norm_weight * y) in the same pass, instead
    of normed itself: normed is never written to memory. x2, res2 (or None): (M, N) and norm_weight (N,), any
    layout (a view is copied first: the kernel reads them at row stride N); res_out, yhat (M, N) and rstd (M,),
    which it writes: contiguous (checked). ``warps``: the norm kernel's own choice, so that the row sums are added
    in the same order. ``store_normed``: no cast; ``q`` is normed itself (in ``normed_dtype``), ``q_scale`` its
    rows' amax, handed to normed's next ``quantize`` (``hints``: tensorwise scaling then needs no amax pass of its
    own)."""
    M, N = x2.shape
    if (res2 is not None and res2.shape != (M, N)) or norm_weight.shape != (N,):
        raise ValueError(f"fp8 norm_quantize: x {tuple(x2.shape)}, residual "
                         f"{None if res2 is None else tuple(res2.shape)}, norm weight {tuple(norm_weight.shape)} "
                         f"do not match")
    if any(t.shape != shape or not t.is_contiguous() for t, shape in ((res_out, (M, N)), (yhat, (M, N)),
                                                                       (rstd, (M,)))):
        raise ValueError(f"fp8 norm_quantize: res_out, yhat ({M}, {N}) and rstd ({M},) must be contiguous, got "
                         f"{tuple(res_out.shape)}, {tuple(yhat.shape)}, {tuple(rstd.shape)}")
    x2, norm_weight = x2.contiguous(), norm_weight.contiguous()   # no copy for what the projections pass
    res2 = res2.contiguous() if res2 is not None else None
    mant, min_exp = _GRID[dtype]
    q = torch.empty((M, N), dtype=normed_dtype if store_normed else dtype, device=x2.device)
    s = torch.empty(M, dtype=torch.float32, device=x2.device)
    per_row = torch.empty((2, M), dtype=torch.int32, device=x2.device)
    if M and N:
        _norm_rowwise_cast_kernel[(M,)](x2, res2 if res2 is not None else x2, norm_weight, res_out, rstd, yhat, q,
                                        s, per_row, M, N, eps, HAS_RESIDUAL=res2 is not None,
                                        BLOCK=triton.next_power_of_2(N), NORMED_DTYPE=_TL_DTYPES[normed_dtype],
                                        FMAX=float(torch.finfo(dtype).max), MANT=mant, MIN_EXP=min_exp,
                                        NATIVE=x2.is_cuda and NATIVE_CAST, STORE_NORMED=store_normed,
                                        num_warps=warps)
    if store_normed:
        if M and N and hints is not None:
            hints.put(q, s.view(1, M), None)
        return Quantized(q, s, None, None, torch.zeros(2, dtype=torch.int64, device=x2.device))
    return Quantized(q, s, None, None, per_row.sum(1, dtype=torch.int64))
