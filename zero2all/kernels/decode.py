"""Decode-step kernels: a few fused, bandwidth-bound kernels per layer for generating one token per row.

A decode step of a small batch is a chain of matrix-vector products: every weight is read once and used for a few
rows, so the step's floor is (weight bytes / HBM bandwidth). Library GEMMs are tuned for large matrices; at one
row they reach 1.5-3.5 TB/s on an H200 and the elementwise ops between them add a kernel each. Here each layer is
four kernels at batch 1, each reading its weight once:

    norm_gemv(x, residual) -> q|k|v          r = residual + x;  out = (w_norm * r * rstd(r)) @ W_qkv^T
    decode_attention(q|k|v, cache)            rotate q and k at the row's position, write k and v into the cache,
                                              softmax(q K^T / sqrt(d)) V over the row's visible cache slots
    gemv(attn) -> o                           attn @ W_o^T
    norm_gemv(o, r) -> gate|up                r' = r + o;  out = (w_norm * r' * rstd(r')) @ W_gate_up^T
    swiglu_gemv(gate|up) -> down              (silu(gate) * up) @ W_down^T

One row (``_gemv_row_kernel``): each program owns BLOCK_N output features and walks the whole input dimension K
in BLOCK_K steps, loading a (BLOCK_N, BLOCK_K) tile of W (contiguous along K, so coalesced) and summing the
products on the CUDA cores. The prologue builds the input slice on the fly, in the same single pass:

    norm:    the program sees all of r = residual + x while it walks K, so it sums r^2 as it goes and applies
             1/rms at the end:  out[n] = rstd * sum_k W[n, k] * (w_norm[k] * r[k])   (rstd is a per-row scalar)
    swiglu:  input[k] = silu(gate[k]) * up[k], from the fused [gate | up] vector

Several rows (2..16, ``_gemv_rows_kernel``): the prologue runs first as its own kernel (the fused add+RMSNorm or
SwiGLU kernel of ``zero2all/kernels``), then a tensor-core kernel with a 16-row tile and pipelined weight loads:
a fused prologue would be recomputed by every program for every row, and at 16 rows that re-reading costs more
than the two small kernels.

Numerics: float32 statistics and sums, as the model's plain path (``ops.add_rmsnorm_torch``, ``ops.swiglu_torch``,
``F.linear``, SDPA). With one row, the normed input is not rounded to the weight dtype before the product (the
1/rms factor is applied after the sum): the result is as close to the exact value as the rounded path or closer,
but not bit for bit the same; sums run in another order than cuBLAS. Results agree to the dtype's rounding.

The new residual (float32 when ``residual_in_fp32``) is written by the first program alone, into a buffer that is
not the one being read (the caller alternates two buffers), so no program reads a half-updated residual.

Everything reads the cache slot and the rows' left padding from device tensors, so one captured CUDA graph serves
every step. At one row on Hopper and later GPUs the kernels use programmatic dependent launch: a kernel is
launched while the previous one drains, issues the load of its first weight tile, and only then waits for the
previous kernel's results (``gdc_wait``), so launches and ramp-ups overlap the previous kernel's tail (measured
on an H200: 1.05 -> 1.02 ms per step at batch 1; at batch 16 it cost 7 %, so it is off there). The attention
kernel likewise loads the slot, the RoPE tables and its block of cached keys and values before it waits for the
qkv product; at batch 1 the keys are split one block per program so that all of them are loaded then
(0.97 -> 0.91 ms per step on an H200, same invocation).

Tiles: the one-row kernel's are chosen by ``FusedDecodeStep.tune`` inside the whole step captured as a CUDA graph
(products overlap their neighbours, so timing one alone ranks tiles differently), once per shape and device;
the several-row kernel is autotuned per (N, K) by Triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_SWIGLU = 0, 1, 2
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the CPU interpreter's tl.dot mishandles bfloat16 inputs, so there the products are taken in float32
_DOT_UPCAST = _INTERPRET




def _pdl_supported() -> bool:
    """Programmatic dependent launch (Hopper+): each kernel is launched while the previous one drains, loads its
    first weight tile, then waits (``gdc_wait``) for the previous kernel's results. Z2ALL_DECODE_PDL=0 turns it
    off; this Triton must know the launch option and the instructions."""
    if _INTERPRET or os.environ.get("Z2ALL_DECODE_PDL", "1") == "0":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda
    except Exception:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(tl_cuda, "gdc_wait")


_PDL_SUPPORTED = _pdl_supported()
_HOPPER: dict = {}


def _hopper(t: torch.Tensor) -> bool:
    """A CUDA tensor on a Hopper or later GPU (compute capability 9+)."""
    if not t.is_cuda:
        return False
    if t.device not in _HOPPER:
        _HOPPER[t.device] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return _HOPPER[t.device]


def _use_pdl(t: torch.Tensor) -> bool:
    return _PDL_SUPPORTED and _hopper(t)


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """Let the next kernel launch as this one's programs finish."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible (before reading its outputs)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


# Z2ALL_DECODE_AUTOTUNE=0: fixed tiles per kernel instead of tuning (quick tests on a GPU)
_TUNE = os.environ.get("Z2ALL_DECODE_AUTOTUNE", "1") != "0"


def tuning_enabled() -> bool:
    return _TUNE


RowTiles = tuple  # the one-row kernel's (BLOCK_N, BLOCK_K, warps)


def _tiles_from_env(value: str) -> list[RowTiles]:
    """"bn:bk:warps,bn:bk:warps,..." -> the one-row kernel's candidate tiles (Z2ALL_DECODE_ROW_TILES)."""
    try:
        tiles = [tuple(int(v) for v in item.split(":")) for item in value.split(",") if item.strip()]
    except ValueError:
        tiles = []
    if not tiles or any(len(t) != 3 for t in tiles):
        raise ValueError(f"Z2ALL_DECODE_ROW_TILES={value!r}: expected bn:bk:warps[,bn:bk:warps...]")
    return tiles


def row_tile_candidates() -> list[RowTiles]:
    """The one-row kernel's tiles that ``FusedDecodeStep.tune`` tries for each product shape."""
    if _INTERPRET:
        return [(16, 64, 4), (8, 32, 4)]
    if os.environ.get("Z2ALL_DECODE_ROW_TILES"):  # e.g. "4:512:4,8:1024:8"
        return _tiles_from_env(os.environ["Z2ALL_DECODE_ROW_TILES"])
    return [(8, 512, 4), (4, 512, 4), (8, 1024, 8), (4, 1024, 8), (16, 256, 4), (16, 512, 8)]


# tiles chosen per (device, N, K, prologue) by FusedDecodeStep.tune (or set by hand); others get default_row_tiles
ROW_TILES: dict = {}


def default_row_tiles() -> RowTiles:
    """Untuned tiles (Z2ALL_DECODE_AUTOTUNE=0, or before tuning)."""
    return (16, 64, 4) if _INTERPRET else (8, 1024, 8)


def _rows_configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4)]
    if not _TUNE:
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 256}, num_warps=4, num_stages=4)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in ((32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3),
                                  (32, 256, 4, 4), (128, 64, 4, 5))]


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with float32 accumulation; float32 inputs in full precision (no TF32)."""
    if UPCAST or a.dtype == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _row_inputs(X, RES, NORM_W, kk, K, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):
    """The raw input loads of one K tile, float32: (x, residual, norm weight) for the norm prologue, (gate, up, -)
    for SwiGLU, (x, -, -) without a prologue."""
    k_mask = kk < K
    a = tl.load(X + kk, mask=k_mask, other=0.0).to(tl.float32)
    b = a
    c = a
    if PROLOGUE == 2:
        b = tl.load(X + K + kk, mask=k_mask, other=0.0).to(tl.float32)
    elif PROLOGUE == 1:
        if HAS_RES:
            b = tl.load(RES + kk, mask=k_mask, other=0.0).to(tl.float32)
        c = tl.load(NORM_W + kk, mask=k_mask, other=0.0).to(tl.float32)
    return a, b, c


@triton.jit
def _gemv_row_kernel(X, TOK, RES, NORM_W, W, BIAS, OUT, RES_OUT, N, K, eps,
                     PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr,
                     PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _pdl_start(PDL)
    pid = tl.program_id(0)
    rl = tl.arange(0, BLOCK_N)
    rn = pid * BLOCK_N + rl
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    # this program's first row in int64 (an LM head may hold more than 2**31 elements), the tile's rows from it
    w_rows = W + (pid * BLOCK_N).to(tl.int64) * K + rl[:, None] * K
    # weight tiles are double-buffered: the next tile's load is in flight while this one is used; the first is
    # loaded before waiting for the previous kernel (weights never depend on it)
    w_next = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
    _pdl_wait(PDL)
    if GATHER:  # X is an embedding table: the input row is the token's
        X = X + tl.load(TOK).to(tl.int64) * K
    # the input slices too: the next one's loads are issued with the next weight tile's, so that no step waits
    # on an L2 round trip for its input (measured on an H200: 829 -> 808 us per step)
    a_next, b_next, c_next = _row_inputs(X, RES, NORM_W, rk, K, PROLOGUE, HAS_RES)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed over K once, after the loop: no per-step
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)             # cross-warp reduction between the weight loads
    writes_res = rk < tl.where(pid == 0, BLOCK_K, 0)         # only the first program writes the residual
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        w = w_next
        nk = kk + BLOCK_K
        w_next = tl.load(w_rows + nk[None, :], mask=n_mask[:, None] & (nk < K)[None, :], other=0.0)
        a, b, c = a_next, b_next, c_next
        a_next, b_next, c_next = _row_inputs(X, RES, NORM_W, nk, K, PROLOGUE, HAS_RES)
        if PROLOGUE == 2:  # swiglu: X is [gate | up] of width 2K
            s = (a * tl.sigmoid(a)).to(W.dtype.element_ty).to(tl.float32)  # F.silu rounds to the input dtype
            x = (s * b).to(W.dtype.element_ty).to(tl.float32)
        elif PROLOGUE == 1:  # residual add; the norm's weight now, its 1/rms after the sum
            r = a + b if HAS_RES else a
            r = r.to(RES_OUT.dtype.element_ty)                    # the stream as stored
            tl.store(RES_OUT + kk, r, mask=k_mask & writes_res)
            r = r.to(tl.float32)
            sq += r * r
            x = c * r
        else:
            x = a
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, axis=1)
    if PROLOGUE == 1:
        out = out / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
    if HAS_BIAS:
        out += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(OUT + rn, out.to(OUT.dtype.element_ty), mask=n_mask)


@triton.autotune(configs=_rows_configs(), key=["N", "K"])
@triton.jit
def _gemv_rows_kernel(X, W, BIAS, OUT, M, N, K, stride_x, stride_out,
                      HAS_BIAS: tl.constexpr, DOT_UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rl = tl.arange(0, BLOCK_N)
    rn = pid * BLOCK_N + rl
    w_rows = W + (pid * BLOCK_N).to(tl.int64) * K + rl[:, None] * K    # int64 row offsets, as in the one-row kernel
    rm = tl.arange(0, 16)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        x = tl.load(X + rm[:, None] * stride_x + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _dot(x.to(W.dtype.element_ty), tl.trans(w), acc, DOT_UPCAST)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rm[:, None] * stride_out + rn[None, :], acc.to(OUT.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, bias: torch.Tensor | None = None,
               prologue: int = PROLOGUE_NONE, residual: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
               eps: float = 1e-5, token: torch.Tensor | None = None, tiles: RowTiles | None = None) -> torch.Tensor:
    """out (M, N) = input(x) @ weight.T (+ bias), for M <= 16 rows; weight, x and out contiguous (checked); bias,
    residual and norm_weight of any layout (a view is copied first: the kernels read them at stride 1).

    ``token`` (one element, on the device): x is an embedding table (V, K) and the input row is x[token] (the
    first layer of a batch-1 step reads its embedding row inside the product, no gather kernel).

    ``prologue``: PROLOGUE_NONE (input = x, (M, K)); PROLOGUE_NORM (input = RMSNorm(x + residual) with
    ``norm_weight``, the sum written to ``residual_out``, which must not alias ``residual`` or ``x``; its dtype
    is the residual stream's); PROLOGUE_SWIGLU (x is (M, 2K) = [gate | up], input = silu(gate) * up).

    ``tiles`` (one row): the kernel's (BLOCK_N, BLOCK_K, warps); default: the ones
    ``FusedDecodeStep.tune`` chose for this shape, else ``default_row_tiles``.
    """
    M = x.shape[0] if token is None else token.numel()
    N, K = weight.shape
    if token is not None and M != 1:
        raise ValueError(f"fused_gemv: an embedding gather takes one token, got {M}")
    if M > 16:
        raise ValueError(f"fused_gemv: at most 16 rows, got {M}")
    if not weight.is_contiguous() or not x.is_contiguous() or not out.is_contiguous():
        raise ValueError("fused_gemv: weight, x and out must be contiguous")
    if token is not None and prologue != PROLOGUE_NORM:
        raise ValueError("fused_gemv: the embedding gather is for the first norm prologue")
    width = 2 * K if prologue == PROLOGUE_SWIGLU else K
    if x.shape[-1] != width or out.shape != (M, N) or (token is None and x.dim() != 2):
        raise ValueError(f"fused_gemv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)} "
                         f"do not fit (prologue {prologue})")
    if prologue == PROLOGUE_NORM:
        if norm_weight is None or residual_out is None:
            raise ValueError("fused_gemv: the norm prologue needs norm_weight and residual_out")
        if residual is not None and residual.data_ptr() == residual_out.data_ptr():
            raise ValueError("fused_gemv: residual_out must not be the residual being read")
        if residual_out.shape != (M, K) or not residual_out.is_contiguous():
            raise ValueError(f"fused_gemv: residual_out {tuple(residual_out.shape)} must be contiguous like x")
    if bias is not None:
        if bias.shape != (N,):
            raise ValueError(f"fused_gemv: bias {tuple(bias.shape)} is not ({N},)")
        bias = bias.contiguous()                # the kernels read it at stride 1 (no copy for a parameter)
    if prologue == PROLOGUE_NORM:
        if norm_weight.shape != (K,) or (residual is not None and residual.shape != (M, K)):
            raise ValueError(f"fused_gemv: norm_weight {tuple(norm_weight.shape)} and residual "
                             f"{None if residual is None else tuple(residual.shape)} must be ({K},) and ({M}, {K})")
        norm_weight = norm_weight.contiguous()  # the one-row kernel reads both at stride 1
        residual = residual.contiguous() if residual is not None else None
    if M == 1:
        bn, bk, warps = tiles or ROW_TILES.get(row_tiles_key(weight, prologue)) or default_row_tiles()
        pdl = _use_pdl(weight)  # one row only: measured +3 % per step at one row, -7 % at 16 (H200)
        launch = {"launch_pdl": True} if pdl else {}
        _gemv_row_kernel[(triton.cdiv(N, bn),)](
            x, token if token is not None else x, residual if residual is not None else x,
            norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight, out,
            residual_out if residual_out is not None else out, N, K, float(eps), PROLOGUE=prologue,
            HAS_RES=residual is not None, HAS_BIAS=bias is not None, GATHER=token is not None,
            PDL=pdl, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **launch)
        return out
    if prologue == PROLOGUE_NORM:
        from zero2all.kernels.rmsnorm import triton_add_rmsnorm

        normed, new_residual = triton_add_rmsnorm(x, residual, norm_weight, eps,
                                                  residual_out.dtype == torch.float32)
        residual_out.copy_(new_residual)
        x = normed
    elif prologue == PROLOGUE_SWIGLU:
        from zero2all.kernels.swiglu import triton_swiglu

        x = triton_swiglu(x)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_rows_kernel[grid](x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0),
                            out.stride(0), HAS_BIAS=bias is not None, DOT_UPCAST=_DOT_UPCAST)
    return out


def row_tiles_key(weight: torch.Tensor, prologue: int) -> tuple:
    return (str(weight.device), weight.shape[0], weight.shape[1], prologue)


def tuned_configs() -> dict[str, str]:
    """The tiles chosen so far, per kernel and shape (for benchmark reports)."""
    found = {f"row {key[1:]}": "BLOCK_N {}, BLOCK_K {}, warps {}".format(*cfg)
             for key, cfg in ROW_TILES.items()}
    for key, cfg in getattr(_gemv_rows_kernel, "cache", {}).items():
        found[f"rows {key[:2]}"] = str(cfg)
    return found


# --------------------------------------------------------------------------------------------------------------
# attention of one new token per row: RoPE, the KV-cache write, split keys and their combination in one kernel


@triton.jit
def _rotate(X, cos, sin, HALF: tl.constexpr, rows, row_mask, d):
    """Rotated halves (o1, o2), float32, of the head vectors at X + rows * 2 HALF (the "rotate half" layout)."""
    x1 = tl.load(X + rows[:, None] * (2 * HALF) + d[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(X + rows[:, None] * (2 * HALF) + HALF + d[None, :], mask=row_mask[:, None],
                 other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _load_keys(KC, VC, base, j, lo, hi, rh, rd, HALF: tl.constexpr):
    """The cached key halves and values at slots j (a block), zero outside [lo, hi)."""
    ok = ((j >= lo) & (j < hi))[:, None]
    kp = KC + base + j[:, None] * (2 * HALF) + rh[None, :]
    c1 = tl.load(kp, mask=ok, other=0.0)
    c2 = tl.load(kp + HALF, mask=ok, other=0.0)
    v = tl.load(VC + base + j[:, None] * (2 * HALF) + rd[None, :], mask=ok, other=0.0)
    return c1, c2, v


@triton.jit
def _decode_attn_kernel(QKV, COS, SIN, KC, VC, PAD, SLOT, OUT, PART_ACC, PART_ML, COUNTER, stride_qkv,
                        stride_cos, stride_sin, stride_pad, n_heads, n_kv, max_len, chunk, scale,
                        G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
                        SPLITS: tl.constexpr, DOT_UPCAST: tl.constexpr, PDL: tl.constexpr):
    _pdl_start(PDL)
    D: tl.constexpr = 2 * HALF
    bh = tl.program_id(0).to(tl.int64)               # b * n_kv + kv head
    split = tl.program_id(1)
    b = bh // n_kv
    hk = bh % n_kv
    rg = tl.arange(0, BLOCK_G)
    rh = tl.arange(0, HALF)
    rd = tl.arange(0, D)
    rn = tl.arange(0, BLOCK_N)
    g_mask = rg < G
    # Before waiting for the qkv product: everything that does not depend on it. The slot, the padding and the
    # RoPE tables are set before the step; the cached keys and values at slots < slot were written by earlier
    # steps (this step's key goes to the slot itself, which no split reads from the cache).
    slot = tl.load(SLOT).to(tl.int64)
    pad = tl.load(PAD + b * stride_pad)
    pos = tl.maximum(slot - pad, 0)
    cos = tl.load(COS + pos * stride_cos + rh)
    sin = tl.load(SIN + pos * stride_sin + rh)
    base = bh * max_len * D
    # cached keys of this split: slots [lo, min(lo + chunk, slot)), visible from the row's padding on; the
    # first block's loads are issued now, each next block's while the current one is used
    lo = (split * chunk).to(tl.int64)
    hi = tl.minimum(lo + chunk, slot)
    c1_next, c2_next, v_next = _load_keys(KC, VC, base, lo + rn, lo, hi, rh, rd, HALF)
    _pdl_wait(PDL)
    row = QKV + b * stride_qkv
    # the G query heads of this KV head and the new key, rotated at the row's position, rounded as stored
    q1, q2 = _rotate(row, cos, sin, HALF, hk * G + rg, g_mask, rh)
    dt = KC.dtype.element_ty
    q1, q2 = q1.to(dt), q2.to(dt)
    one = tl.arange(0, 1)
    k1, k2 = _rotate(row, cos, sin, HALF, n_heads + hk + one, one < 1, rh)           # (1, HALF)
    k1, k2 = k1.to(dt), k2.to(dt)
    v_new = tl.load(row + (n_heads + n_kv + hk) * D + rd)                           # (D,)
    if split == 0:                                   # the new key and value go into the cache at the slot
        tl.store(KC + base + slot * D + one[:, None] * 0 + rh[None, :], k1)
        tl.store(KC + base + slot * D + HALF + one[:, None] * 0 + rh[None, :], k2)
        tl.store(VC + base + slot * D + rd, v_new)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + rn
        c1, c2, v = c1_next, c2_next, v_next
        c1_next, c2_next, v_next = _load_keys(KC, VC, base, j + BLOCK_N, lo, hi, rh, rd, HALF)
        s = _dot(q1, tl.trans(c1), tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32), DOT_UPCAST)
        s = _dot(q2, tl.trans(c2), s, DOT_UPCAST) * scale                          # (BLOCK_G, BLOCK_N)
        s = tl.where(((j < hi) & (j >= pad))[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                       # a fully masked block
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_UPCAST)
        m = m_new
    # the new key itself (slot >= pad always: a row sees its own token), counted by split 0 only
    s_new = (tl.sum(q1.to(tl.float32) * k1.to(tl.float32), axis=1)
             + tl.sum(q2.to(tl.float32) * k2.to(tl.float32), axis=1)) * scale
    s_new = tl.where(split == 0, s_new, float("-inf"))
    m_new = tl.maximum(m, s_new)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p_new = tl.exp(s_new - m_safe)
    l = l * alpha + p_new
    acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
    m = m_new
    heads = b * n_heads + hk * G + rg
    if SPLITS == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(OUT + heads[:, None] * D + rd[None, :], out.to(OUT.dtype.element_ty), mask=g_mask[:, None])
    else:
        part = heads * SPLITS + split
        tl.store(PART_ACC + part[:, None] * D + rd[None, :], acc, mask=g_mask[:, None])
        tl.store(PART_ML + part * 2, m, mask=g_mask)
        tl.store(PART_ML + part * 2 + 1, l, mask=g_mask)
        # the last split of this (row, KV head) to finish combines all of them (the atomic is acq_rel: the
        # others' partial results are visible to it), then re-arms the counter for the next layer and step
        done = tl.atomic_add(COUNTER + bh, 1)
        if done == SPLITS - 1:
            m_all = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
            for i in tl.static_range(SPLITS):
                m_all = tl.maximum(m_all, tl.load(PART_ML + (heads * SPLITS + i) * 2, mask=g_mask,
                                                  other=float("-inf"), cache_modifier=".cg"))
            m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
            num = tl.zeros([BLOCK_G, D], dtype=tl.float32)
            den = tl.zeros([BLOCK_G], dtype=tl.float32)
            for i in tl.static_range(SPLITS):
                part_i = heads * SPLITS + i
                w = tl.exp(tl.load(PART_ML + part_i * 2, mask=g_mask, other=float("-inf"),
                                   cache_modifier=".cg") - m_all)
                den += w * tl.load(PART_ML + part_i * 2 + 1, mask=g_mask, other=0.0, cache_modifier=".cg")
                num += w[:, None] * tl.load(PART_ACC + part_i[:, None] * D + rd[None, :], mask=g_mask[:, None],
                                            other=0.0, cache_modifier=".cg")
            out = num / tl.where(den > 0, den, 1.0)[:, None]
            tl.store(OUT + heads[:, None] * D + rd[None, :], out.to(OUT.dtype.element_ty), mask=g_mask[:, None])
            tl.atomic_xchg(COUNTER + bh, 0)


ATTN_BLOCK_N = 64  # cached keys per step of the attention loop (the splits' lengths are multiples of it)


def attention_splits(batch: int, n_kv: int, max_len: int, block_n: int = ATTN_BLOCK_N) -> tuple[int, int]:
    """(splits, keys per split). A large batch occupies the GPU with one program per (row, KV head). A small one
    splits the keys into up to 256 programs (32 splits at most), one block of keys per split where that allows:
    a split's keys are then all loaded before the kernel waits for the qkv product."""
    programs = batch * n_kv
    if programs >= 64:
        return 1, triton.cdiv(max_len, block_n) * block_n
    splits = max(1, min(triton.cdiv(max_len, block_n), 256 // programs, 32))
    chunk = triton.cdiv(triton.cdiv(max_len, splits), block_n) * block_n
    return triton.cdiv(max_len, chunk), chunk


class AttentionScratch:
    """Float32 partial results and the per-(row, KV head) arrival counters of ``decode_attention``."""

    def __init__(self, batch: int, n_heads: int, n_kv: int, head_dim: int, max_len: int, device):
        self.splits, self.chunk = attention_splits(batch, n_kv, max_len)
        rows = batch * n_heads * self.splits
        self.acc = torch.empty(rows, head_dim, device=device, dtype=torch.float32)
        self.ml = torch.empty(rows, 2, device=device, dtype=torch.float32)
        self.counter = torch.zeros(batch * n_kv, device=device, dtype=torch.int32)


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, pad_len: torch.Tensor, slot: torch.Tensor, out: torch.Tensor,
                     scratch: AttentionScratch, block_n: int = ATTN_BLOCK_N) -> torch.Tensor:
    """Attention of one new token per row, RoPE and the KV-cache write included.

    qkv (B, (H + 2 Hkv) D): the qkv projection of the new tokens. Row b's position is max(slot - pad_len[b], 0);
    its q and k are rotated there (cos/sin: (positions >= L, D/2) float32 tables), k and v are written into the
    caches (B, Hkv, L, D) at ``slot`` (a 1-element device tensor), and out (B, H, D) = softmax(q k^T / sqrt(D)) v
    over the keys at slots pad_len[b] .. slot. The cached keys are split over ``scratch.splits`` programs per
    (row, KV head); the last one to finish combines the partial softmaxes. ``pad_len`` (B,) integers and the
    tables' rows are read at their strides: a column of a wider buffer or a view of a wider table needs no copy.
    """
    B, H, D = out.shape
    n_kv, max_len = k_cache.shape[1], k_cache.shape[2]
    if D & (D - 1) or D < 32:
        raise ValueError(f"decode_attention: head_dim {D} must be a power of two >= 32")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous() and qkv.stride(-1) == 1):
        raise ValueError("decode_attention: the caches and out must be contiguous, qkv along its last dimension")
    if qkv.shape != (B, (H + 2 * n_kv) * D):
        raise ValueError(f"decode_attention: qkv {tuple(qkv.shape)} is not ({B}, {(H + 2 * n_kv) * D})")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != D // 2 or cos.shape[0] < max_len:
        raise ValueError(f"decode_attention: the RoPE tables {tuple(cos.shape)}, {tuple(sin.shape)} must both be "
                         f"(positions >= {max_len}, {D // 2})")
    if pad_len.shape != (B,) or pad_len.dtype.is_floating_point or slot.numel() != 1:
        raise ValueError(f"decode_attention: pad_len {tuple(pad_len.shape)} must be ({B},) integers and slot one "
                         f"element, got {slot.numel()}")
    # the padding and the tables' rows are read at their strides (a column of a wider buffer, a view of a wider
    # table); a table's columns must be adjacent (a copy otherwise, which a real caller never needs)
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    G = H // n_kv
    pdl = _use_pdl(qkv) and B == 1  # as for the products: programmatic launch pays at one row only
    _decode_attn_kernel[(B * n_kv, scratch.splits)](
        qkv, cos, sin, k_cache, v_cache, pad_len, slot, out, scratch.acc, scratch.ml, scratch.counter,
        qkv.stride(0), cos.stride(0), sin.stride(0), pad_len.stride(0), H, n_kv, max_len, scratch.chunk,
        1.0 / D ** 0.5, G=G,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n, HALF=D // 2, SPLITS=scratch.splits,
        DOT_UPCAST=_DOT_UPCAST, PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out
