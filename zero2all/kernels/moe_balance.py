"""One round of the per-batch balanced selection bias (``model/moe.py: balanced_bias``) in two Triton kernels.

A round, for router scores s (N tokens x E experts, float32), the current bias b (E,), top-k routing and the
per-expert target n = N k / E::

    biased  = s + b
    t1, t2  = the k-th and (k+1)-th largest biased score of each token (with multiplicity, as ``topk``)
    chosen  = biased >= t1                                  the token's top k (ties: all of them)
    load_e  = sum over tokens of chosen                     (E,)
    margin  = s - (t2 where chosen else t1)                 how far each score is from its rival
    hi, lo  = the n-th and (n+1)-th largest margin of each expert's column

``_rows_kernel`` takes a block of tokens per program: the k + 1 largest values of each row by k + 1 maxima (one
occurrence removed each time: the same multiset as ``topk``), the loads by one atomic add per column and
program, and the margins written expert-major (E, N) so that each column is contiguous. ``_edges_kernel`` takes
one expert per program and selects the n-th and (n+1)-th largest margin exactly: a float32 maps to an unsigned
32-bit key in the same order, and the n-th largest key is built bit by bit from the top (32 counting passes over
the column, which a program holds in its registers up to ``EDGE_BLOCK`` tokens and otherwise reads in blocks
from cache); the (n+1)-th is the same key when more than n reach it, else the largest key below it. Both kernels
compute with the reference's float32 operations (an addition, a comparison, a subtraction), so the round equals
the PyTorch one bit for bit (``tests/test_moe.py``).

The reference (``model/moe.py``) spends a few dozen small PyTorch operations per round, among them a top-(n+1)
over each column; here a round is two launches and the caller's handful of (E,)-sized operations.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

EDGE_BLOCK = 8192       # tokens a column program holds at once (larger columns are read in blocks)


@triton.jit
def _rows_kernel(S, B, MARGIN_T, LOAD, N, E, K: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    cols = tl.arange(0, BE)
    rmask = rows < N
    cmask = cols < E
    mask = rmask[:, None] & cmask[None, :]
    s = tl.load(S + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=mask, other=0.0)
    b = tl.load(B + cols, mask=cmask, other=0.0)
    biased = s + b[None, :]
    work = tl.where(mask, biased, float("-inf"))
    t1 = tl.zeros([BN], dtype=tl.float32)
    t2 = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(K + 1):            # the j-th largest, one occurrence removed each time
        top = tl.max(work, 1)
        at = tl.argmax(work, 1)
        if j == K - 1:
            t1 = top
        if j == K:
            t2 = top
        work = tl.where(cols[None, :] == at[:, None], float("-inf"), work)
    chosen = (biased >= t1[:, None]) & mask
    tl.atomic_add(LOAD + cols, tl.sum(chosen.to(tl.int32), 0), mask=cmask)
    rival = tl.where(chosen, t2[:, None], t1[:, None])
    margin = s - rival
    tl.store(MARGIN_T + cols.to(tl.int64)[None, :] * N + rows[:, None], margin, mask=mask)


@triton.jit
def _key(x):
    # float32 -> uint32 in the same order (negative numbers: all bits flipped; others: the sign bit set)
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) == 1, ~u, u | 0x80000000)


@triton.jit
def _value(key):
    u = tl.where((key >> 31) == 1, key ^ 0x80000000, ~key)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _count_at_least(X, N, cand, BLOCK: tl.constexpr):
    total = tl.zeros([], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        m = idx < N
        k = _key(tl.load(X + idx, mask=m, other=0.0))
        total += tl.sum((m & (k >= cand)).to(tl.int32), 0)
    return total


@triton.jit
def _edges_kernel(MARGIN_T, HI, LO, N, n, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    X = MARGIN_T + e.to(tl.int64) * N
    step = tl.full([], 0x80000000, tl.uint32)
    hi_key = tl.zeros([], dtype=tl.uint32)
    for _ in range(32):                         # the n-th largest key, from its top bit down
        cand = hi_key | step
        if _count_at_least(X, N, cand, BLOCK) >= n:
            hi_key = cand
        step = step >> 1
    # the (n+1)-th: the same key when more than n reach it, else the largest key below it
    below = tl.zeros([], dtype=tl.uint32)
    for start in range(0, N, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        m = idx < N
        k = _key(tl.load(X + idx, mask=m, other=0.0))
        below = tl.maximum(below, tl.max(tl.where(m & (k < hi_key), k, tl.zeros_like(k)), 0))
    lo_key = tl.where(_count_at_least(X, N, hi_key, BLOCK) > n, hi_key, below)
    tl.store(HI + e, _value(hi_key))
    tl.store(LO + e, _value(lo_key))


def balance_round(s: torch.Tensor, b: torch.Tensor, k: int, n: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(load (E,) int32, hi (E,), lo (E,)) of one round (module docstring) for float32 ``s`` (N, E), contiguous,
    and ``b`` (E,); 1 <= k < E, 1 <= n < N."""
    N, E = s.shape
    if s.dtype != torch.float32 or b.dtype != torch.float32 or not s.is_contiguous():
        raise ValueError(f"balance_round: float32 contiguous scores and bias expected, got {s.dtype} "
                         f"(contiguous: {s.is_contiguous()}) and {b.dtype}")
    if not (1 <= k < E and 1 <= n < N):
        raise ValueError(f"balance_round: need 1 <= k < E and 1 <= n < N (k={k}, E={E}, n={n}, N={N})")
    load = torch.zeros(E, dtype=torch.int32, device=s.device)
    margin_t = torch.empty((E, N), dtype=torch.float32, device=s.device)
    hi = torch.empty(E, dtype=torch.float32, device=s.device)
    lo = torch.empty(E, dtype=torch.float32, device=s.device)
    BE = triton.next_power_of_2(E)
    BN = max(1, min(128, 4096 // BE))
    _rows_kernel[(triton.cdiv(N, BN),)](s, b.contiguous(), margin_t, load, N, E, K=k, BN=BN, BE=BE, num_warps=4)
    block = min(EDGE_BLOCK, triton.next_power_of_2(N))
    _edges_kernel[(E,)](margin_t, hi, lo, N, n, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return load, hi, lo
