"""Decode attention over a paged KV cache: one query token per row, keys and values read through a block table.

The cache of one layer is a pool of fixed-size blocks, ``k_cache`` and ``v_cache`` of shape
(n_blocks, block_size, n_kv_heads, head_dim); a row's tokens live in the blocks its block table names, in order::

    token t of row b  ->  k_cache[block_tables[b, t // block_size], t % block_size]

so rows of any length share one pool, a row grows a block at a time, and rows with a common prefix can point at
the same blocks. For each row b and query head h (grouped-query attention: key/value head h // (H / Hkv))::

    out[b, h] = softmax(q[b, h] . K[b, :len_b, h']^T * scale) @ V[b, :len_b, h']

The Triton kernel runs one program per (row, key/value head, split): it loads the row's G = H / Hkv query heads
as one tile and walks its share of the row's blocks once (each block of keys and values is read once for all G
heads, which is what grouped-query attention saves), keeping a running maximum and sum (the online softmax of
FlashAttention) in float32. With one split a program walks the whole row and writes the output. A few rows give
few programs (one row of a model with 4 key/value heads: 4 programs on a GPU of 132 multiprocessors, each walking
a long row alone), so the row's blocks are then divided among S splits (split-K, "flash-decoding"): split s takes
blocks [s c, (s + 1) c) of the row's n, c = ceil(n / S), and leaves its maximum m_s, sum l_s and unnormalised sum
a_s = sum_t exp(score_t - m_s) v_t; a second kernel combines them per head with M = max_s m_s::

    out = sum_s exp(m_s - M) a_s / sum_s exp(m_s - M) l_s

(a split with no blocks has m_s = -inf and adds nothing). The number of splits is chosen on the host from the rows
and heads alone (so a CUDA graph of a decode step keeps one grid): enough programs for about two per
multiprocessor. A row of length 0 (a free batch slot) gets zeros. The plain PyTorch function
``paged_decode_attention_torch`` computes the same thing by gathering each row's blocks; it is the CPU path and the
kernel's reference.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch path still works
    triton = tl = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def paged_decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, lengths: torch.Tensor,
                                 scale: float | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, D); k_cache, v_cache (n_blocks, block_size, Hkv, D); block_tables (B, max_blocks) ints; lengths
    (B,) ints, each <= max_blocks * block_size. Returns (B, H, D) in q's dtype (computed in float32, or float64
    for float64 inputs); rows of length 0 give zeros. ``visible``: :func:`visible_keys` of the lengths, when the
    caller computed it already (a decode step's layers share it)."""
    B, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    nb = block_tables.size(1)
    idx = block_tables.long()
    k = k_cache[idx].reshape(B, nb * bs, Hkv, D).to(work)                                 # (B, T, Hkv, D)
    v = v_cache[idx].reshape(B, nb * bs, Hkv, D).to(work)
    qg = q.to(work).view(B, Hkv, G, D)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * (scale if scale is not None else 1.0 / math.sqrt(D))
    if visible is None:
        visible = visible_keys(lengths, nb * bs)                                            # (B, T)
    scores = torch.where(visible[:, None, None, :], scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                                   # empty rows: zeros
    out = torch.einsum("bhgt,bthd->bhgd", probs, v)
    return out.reshape(B, H, D).to(q.dtype)


def visible_keys(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) bool: key position t of row b is visible when t < lengths[b]."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def uses_triton(q: torch.Tensor, impl: str = "auto") -> bool:
    """Whether :func:`paged_decode_attention` runs the Triton kernel for this query and ``impl``."""
    return impl == "triton" or (impl == "auto" and q.is_cuda and triton is not None and q.dtype != torch.float64)


MAX_SPLITS = 64  # the most pieces a row is walked in (the combine kernel's tile)

if triton is not None:
    # the integers that vary between calls are not specialised on (Triton compiles a variant per value class
    # otherwise: a compilation in the middle of serving the first time a table width or split count comes up)
    @triton.jit(do_not_specialize=["stride_tb", "stride_len", "SPLITS"])
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, table_ptr, len_ptr, scale,
                             stride_qb, stride_qh, stride_kn, stride_kt, stride_kh, stride_ob, stride_oh,
                             stride_tb, stride_len, SPLITS, G: tl.constexpr, D: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                             UPCAST: tl.constexpr, SPLIT: tl.constexpr):
        b = tl.program_id(0)
        hkv = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        t = tl.arange(0, BLOCK_SIZE)
        g_ok = g < G
        d_ok = d < D
        heads = hkv * G + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)                          # (G_PAD, D_PAD)
        if UPCAST:
            q = q.to(tl.float32)
        length = tl.load(len_ptr + b * stride_len)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        s = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        n_blocks = tl.cdiv(length, BLOCK_SIZE)
        per = tl.cdiv(n_blocks, SPLITS)                  # this split's blocks: [lo, hi)
        lo = split * per
        hi = tl.minimum(lo + per, n_blocks)
        for i in range(lo, hi):
            block = tl.load(table_ptr + b * stride_tb + i).to(tl.int64)
            pos = i * BLOCK_SIZE + t
            t_ok = pos < length
            off = block * stride_kn + t[:, None] * stride_kt + hkv * stride_kh + d[None, :]
            kv_mask = t_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + off, mask=kv_mask, other=0.0)                              # (BLOCK_SIZE, D_PAD)
            v = tl.load(v_ptr + off, mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if UPCAST:  # float32 products in full precision (not TF32)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale             # (G_PAD, BLOCK_SIZE)
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(t_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            s = s * alpha + tl.sum(p, axis=1)
            if UPCAST:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        if SPLIT:  # partials (B, H, SPLITS, D_PAD + 2) float32: a_s, then m_s and l_s
            row = part_ptr + ((b * (G * tl.num_programs(1)) + heads) * SPLITS + split) * (D_PAD + 2)
            tl.store(row[:, None] + d[None, :], acc, mask=g_ok[:, None])
            tl.store(row + D_PAD, m, mask=g_ok)
            tl.store(row + D_PAD + 1, s, mask=g_ok)
        else:
            out = acc / tl.where(s > 0, s, 1.0)[:, None]
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit(do_not_specialize=["H", "SPLITS"])
    def _paged_combine_kernel(part_ptr, out_ptr, stride_ob, stride_oh, H, SPLITS, D: tl.constexpr,
                              S_PAD: tl.constexpr, D_PAD: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        s_ok = sp < SPLITS
        rows = part_ptr + ((b * H + h) * SPLITS + sp) * (D_PAD + 2)
        m = tl.load(rows + D_PAD, mask=s_ok, other=float("-inf"))                           # (S_PAD,)
        big = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - tl.where(big > float("-inf"), big, 0.0)), 0.0)
        l_sum = tl.sum(w * tl.load(rows + D_PAD + 1, mask=s_ok, other=0.0), axis=0)
        a = tl.load(rows[:, None] + d[None, :], mask=s_ok[:, None], other=0.0)               # (S_PAD, D_PAD)
        out = tl.sum(w[:, None] * a, axis=0) / tl.where(l_sum > 0, l_sum, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index
                                            ).multi_processor_count


def decode_splits(rows: int, kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """How many splits of each row's blocks a decode step uses: about two programs per multiprocessor over
    rows x kv_heads x splits (a power of two, at most 64 and at most the table's width); 1 once the rows and heads
    alone give that many. Off CUDA (the interpreter), 1."""
    if device.type != "cuda":
        return 1
    want = -(-2 * _multiprocessors(device.index) // max(1, rows * kv_heads))
    if want <= 1:
        return 1
    return max(1, min(MAX_SPLITS, max_blocks, triton.next_power_of_2(want)))


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, lengths: torch.Tensor,
                                  scale: float | None = None, splits: int | None = None) -> torch.Tensor:
    """The Triton kernel: the arguments and result of :func:`paged_decode_attention_torch`. Needs the cache's
    last dimension contiguous, the same strides for keys and values, and a block size that is a power of two
    >= 16 (the kernel's tile is one block). ``splits``: the number of pieces each row's blocks are walked in
    (combined after; default :func:`decode_splits`), at most the table's width."""
    B, H, D = q.shape
    n, bs, Hkv, Dk = k_cache.shape
    if Dk != D or H % Hkv or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"paged attention: q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"paged attention: the block size must be a power of two >= 16, got {bs}")
    q = q.contiguous() if q.stride(-1) != 1 else q
    out = torch.empty_like(q)
    G = H // Hkv
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    # the kernel loads a length of either width at its stride: no conversion (one launch fewer per layer) for the
    # session's int64 lengths, a column of its (position, slot, length) buffer
    lens = lengths if lengths.dtype in (torch.int32, torch.int64) else lengths.to(torch.int32)
    upcast = _INTERPRET or q.dtype == torch.float32
    if splits is None:
        splits = decode_splits(B, Hkv, tables.size(1), q.device)
    splits = max(1, min(int(splits), tables.size(1), MAX_SPLITS))
    D_PAD = max(16, triton.next_power_of_2(D))
    parts = out if splits == 1 else torch.empty(B, H, splits, D_PAD + 2, device=q.device, dtype=torch.float32)
    _paged_decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, out, parts, tables, lens, scale if scale is not None else 1.0 / math.sqrt(D),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), tables.stride(0), lens.stride(0), splits,
        G=G, D=D, BLOCK_SIZE=bs, G_PAD=max(16, triton.next_power_of_2(G)), D_PAD=D_PAD, UPCAST=upcast,
        SPLIT=splits > 1)
    if splits > 1:
        _paged_combine_kernel[(B, H)](parts, out, out.stride(0), out.stride(1), H, splits, D=D,
                                      S_PAD=MAX_SPLITS, D_PAD=D_PAD)
    return out


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, dtype: torch.dtype):
    """Compile the kernel's two variants (whole rows, and splits with the combine) for this cache and query dtype
    now, on one empty row, rather than at the first request that needs each."""
    q = torch.zeros(1, n_heads, k_cache.size(-1), device=k_cache.device, dtype=dtype)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=k_cache.device)
    lengths = torch.zeros(1, dtype=torch.int64, device=k_cache.device)
    for splits in (1, 2):
        paged_decode_attention_triton(q, k_cache, v_cache, tables, lengths, splits=splits)


def paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, scale=None, impl: str = "auto",
                           splits: int | None = None):
    """``impl``: "triton", "torch", or "auto" (the kernel on CUDA, the PyTorch path elsewhere and for float64);
    ``splits``: the kernel's (:func:`paged_decode_attention_triton`)."""
    if uses_triton(q, impl):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, lengths, scale, splits)
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, lengths, scale)
