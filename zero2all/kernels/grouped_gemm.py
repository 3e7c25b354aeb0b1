"""Grouped GEMM for mixture-of-experts with SwiGLU fused in: every expert's MLP over its own tokens in two kernels.

Tokens arrive sorted by expert: rows ``offs[e] .. offs[e+1]`` of ``x`` (M, H) belong to expert e. With the expert
weights in ``nn.Linear`` layout, ``w1`` (E, 2I, H) = [gate | up] and ``w2`` (E, H, I)::

    gate_up = x_e @ w1[e]^T                 (M_e, 2I)      forward kernel 1, both halves in one pass
    h       = silu(gate) * up               (M_e, I)       its epilogue (float32, from the accumulators)
    y_e     = h @ w2[e]^T                   (M_e, H)       forward kernel 2

Backward, with dy = dL/dy and s = sigmoid(gate)::

    dh      = dy_e @ w2[e]                                  kernel 1 again, SwiGLU's backward as its epilogue:
    dgate   = dh * up * s * (1 + gate (1 - s)),  dup = dh * gate * s
    dx_e    = [dgate | dup] @ w1[e]
    dw2[e]  = dy_e^T h_e,   dw1[e] = [dgate | dup]_e^T x_e          (the weight-gradient kernel)

Scheduling: the row tiles of all experts form one flat list (tile t -> expert, first row, end row), computed on
the device from the per-expert counts without a host sync, sized for the worst case (ceil(M / BLOCK_M) + E); the
real tile count stays on the device and the kernels read it. Work items (row tile, column tile) run in grouped
order for L2 reuse, one program each or a persistent grid looping over them; tiles load through pointers or TMA
descriptors, per product (``GPU_CONFIG``). An expert with no tokens has no tiles and a zero weight gradient. Every
product accumulates in float32; outputs are stored in the input dtype.

``grouped_swiglu_mlp(x, counts, w1, w2, impl)`` picks the implementation: ``triton`` (this file), ``torch``
(``torch._grouped_mm``, two grouped GEMMs with SwiGLU between) or ``loop`` (one plain matmul per expert: the
readable reference the tests compare against).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch and loop paths need no Triton
    triton = None


# --------------------------------------------------------------------------------------------------------------
# the plain references


def swiglu_mlp_loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The reference: for each expert, ``silu(x_e w1_gate^T) * (x_e w1_up^T) @ w2^T`` on its rows (a host sync
    for the counts). Experts without tokens are skipped."""
    out = x.new_zeros(x.shape[0], w2.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = F.linear(x[start:start + n], w1[e]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(F.silu(gate) * up, w2[e])
        start += n
    return out


def swiglu_mlp_grouped_mm(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (needs 16-byte aligned rows; on CUDA, bf16 on sm90+): two grouped GEMMs, SwiGLU
    between them (unfused)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gate, up = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs here (it exists from torch 2.8; CUDA needs sm90+ for bf16)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        return torch.cuda.get_device_capability(x.device)[0] >= 9 and x.dtype == torch.bfloat16
    return True


def triton_usable(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# ``auto`` on a GPU: torch._grouped_mm (0.85x a dense MLP of equal FLOPs, forward + backward, at the 1B preset's
# shapes on an H100; our forward matches it, our backward is not yet measured at par: BENCHMARKS.md); Triton where
# _grouped_mm cannot run (older torch, pre-sm90)
AUTO_GPU = "torch"


def grouped_swiglu_mlp(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       impl: str = "auto") -> torch.Tensor:
    """Experts' SwiGLU MLPs on expert-sorted rows: x (M, H), counts (E,) summing to M, w1 (E, 2I, H),
    w2 (E, H, I) -> (M, H). Under autocast the inputs run in the autocast dtype (the casts are differentiable,
    so master weights get float32 gradients)."""
    if torch.is_autocast_enabled(x.device.type):
        dt = torch.get_autocast_dtype(x.device.type)
        x, w1, w2 = x.to(dt), w1.to(dt), w2.to(dt)
    with torch.autocast(x.device.type, enabled=False):
        if x.dtype == torch.float64 and impl in ("auto", "triton", "torch"):
            impl = "loop"  # float64 (train.precision = "fp64"): the plain per-expert reference
        if impl == "auto":
            impl = AUTO_GPU if x.is_cuda and triton is not None else "loop"
            if impl == "torch" and not grouped_mm_available(x):
                impl = "triton"
        if impl == "triton":
            if not triton_usable(x):
                raise RuntimeError("grouped_gemm 'triton' needs a CUDA tensor (or TRITON_INTERPRET=1)")
            return GroupedSwiGLU.apply(x, counts, w1, w2)
        if impl == "torch":
            return swiglu_mlp_grouped_mm(x, counts, w1, w2)
        if impl == "loop":
            return swiglu_mlp_loop(x, counts, w1, w2)
    raise ValueError(f"grouped_gemm impl {impl!r} is not one of auto, triton, torch, loop")


# --------------------------------------------------------------------------------------------------------------
# kernels

if triton is not None:

    @triton.jit
    def _tile_of(pid, n_m, n_n, GROUP_M: tl.constexpr):
        """Work item ``pid`` -> (row tile, column tile) in grouped order: GROUP_M consecutive row tiles (mostly of
        one expert, so they share its weight tiles) sweep all column tiles before the next group starts, which
        keeps the A rows and the weight columns of the programs running together in L2."""
        width = GROUP_M * n_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        return first_m + (pid % width) % size_m, (pid % width) // size_m

    @triton.jit
    def _epilogue(acc, acc_up, C, AUX, rm64, rn, mask, N, s_cm, s_cn, s_xm, s_xn, MODE: tl.constexpr):
        """MODE 0: C = acc.  MODE 1 (SwiGLU forward): AUX (M, 2N) gets [gate | up] = [acc | acc_up], C (M, N)
        gets silu(gate) * up.  MODE 2 (SwiGLU backward): acc = dh, AUX holds [gate | up], C (M, 2N) gets
        [dgate | dup]."""
        c = C + rm64[:, None] * s_cm + rn[None, :] * s_cn
        if MODE == 0:
            tl.store(c, acc.to(C.dtype.element_ty), mask=mask)
        elif MODE == 1:
            aux = AUX + rm64[:, None] * s_xm + rn[None, :] * s_xn
            tl.store(aux, acc.to(AUX.dtype.element_ty), mask=mask)
            tl.store(aux + N * s_xn, acc_up.to(AUX.dtype.element_ty), mask=mask)
            tl.store(c, (acc * tl.sigmoid(acc) * acc_up).to(C.dtype.element_ty), mask=mask)
        else:
            aux = AUX + rm64[:, None] * s_xm + rn[None, :] * s_xn
            gate = tl.load(aux, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(aux + N * s_xn, mask=mask, other=0.0).to(tl.float32)
            s = tl.sigmoid(gate)
            tl.store(c, (acc * up * s * (1.0 + gate * (1.0 - s))).to(C.dtype.element_ty), mask=mask)
            tl.store(c + N * s_cn, (acc * gate * s).to(C.dtype.element_ty), mask=mask)

    @triton.jit
    def _grouped_kernel(A, B, C, AUX, TILE_E, TILE_ROW, TILE_END, N_TILES, N, K,
                        s_am, s_ak, s_be, s_bk, s_bn, s_cm, s_cn, s_xm, s_xn,
                        MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN: tl.constexpr):
        """C[rows of a tile] = epilogue(A[rows] @ B[e]), B[e][k, n] at B + e s_be + k s_bk + n s_bn; in MODE 1 B
        has 2N columns [gate | up] and both halves accumulate in one pass.

        The work items (row tile, column tile) are numbered 0 .. N_TILES * cdiv(N, BLOCK_N); program p takes
        items p, p + P, ... (P programs: one item each, or a persistent grid of a few per SM). Rows past a
        tile's expert are loaded (their indices clamped into the tile's range: no row mask) but never stored;
        EVEN (BLOCK_K | K and BLOCK_N | N) drops the column masks of the main loop. (Clamping a *contiguous*
        index instead of masking it hides its contiguity from the compiler: scalar loads, ~10x slower.)"""
        n_n = tl.cdiv(N, BLOCK_N)
        n_m = tl.load(N_TILES)
        for pid in range(tl.program_id(0), n_m * n_n, tl.num_programs(0)):
            pid_m, pid_n = _tile_of(pid, n_m, n_n, GROUP_M)
            row0 = tl.load(TILE_ROW + pid_m)
            row_end = tl.load(TILE_END + pid_m)
            e = tl.load(TILE_E + pid_m).to(tl.int64)
            rm = row0 + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rk = tl.arange(0, BLOCK_K)
            rm64 = rm.to(tl.int64)
            n_ok = rn < N
            a_ptr = A + tl.minimum(rm, row_end - 1).to(tl.int64)[:, None] * s_am + rk[None, :] * s_ak
            b_ptr = B + e * s_be + rk[:, None] * s_bk + rn[None, :] * s_bn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if EVEN:
                    a = tl.load(a_ptr)
                    b = tl.load(b_ptr)
                else:
                    k_ok = (k0 + rk) < K
                    a = tl.load(a_ptr, mask=k_ok[None, :], other=0.0)
                    b = tl.load(b_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                acc += tl.dot(a, b)
                if MODE == 1:
                    if EVEN:
                        b_up = tl.load(b_ptr + N * s_bn)
                    else:
                        b_up = tl.load(b_ptr + N * s_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                    acc_up += tl.dot(a, b_up)
                a_ptr += BLOCK_K * s_ak
                b_ptr += BLOCK_K * s_bk
            mask = (rm < row_end)[:, None] & n_ok[None, :]
            _epilogue(acc, acc_up, C, AUX, rm64, rn, mask, N, s_cm, s_cn, s_xm, s_xn, MODE)

    @triton.jit
    def _grouped_kernel_tma(a_desc, b_desc, C, AUX, TILE_E, TILE_ROW, TILE_END, N_TILES, N, K, B_ROWS,
                            s_cm, s_cn, s_xm, s_xn,
                            MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, B_NK: tl.constexpr):
        """The same product with the tiles fetched by the tensor-memory accelerator: ``a_desc`` over A (M, K),
        ``b_desc`` over the weights as one 2-D tensor of E * B_ROWS rows, expert e's block at rows e * B_ROWS:
        (N', K) blocks [BLOCK_N, BLOCK_K] when B_NK (``nn.Linear`` layout, used transposed), else (K, N) blocks
        [BLOCK_K, BLOCK_N]. Only for BLOCK_K | K and BLOCK_N | N (no tile crosses into the next expert's
        weights); rows past A's end read as zeros, rows of the next expert are computed and not stored."""
        n_n = tl.cdiv(N, BLOCK_N)
        n_m = tl.load(N_TILES)
        for pid in range(tl.program_id(0), n_m * n_n, tl.num_programs(0)):
            pid_m, pid_n = _tile_of(pid, n_m, n_n, GROUP_M)
            row0 = tl.load(TILE_ROW + pid_m)
            row_end = tl.load(TILE_END + pid_m)
            e = tl.load(TILE_E + pid_m)
            n0 = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([row0, k0])
                if B_NK:
                    acc += tl.dot(a, b_desc.load([e * B_ROWS + n0, k0]).T)
                    if MODE == 1:
                        acc_up += tl.dot(a, b_desc.load([e * B_ROWS + N + n0, k0]).T)
                else:
                    acc += tl.dot(a, b_desc.load([e * B_ROWS + k0, n0]))
            rm = row0 + tl.arange(0, BLOCK_M)
            rn = n0 + tl.arange(0, BLOCK_N)
            mask = (rm < row_end)[:, None] & (rn < N)[None, :]
            _epilogue(acc, acc_up, C, AUX, rm.to(tl.int64), rn, mask, N, s_cm, s_cn, s_xm, s_xn, MODE)

    @triton.jit
    def _weight_grad_kernel(A, B, C, OFFS, P, Q, s_am, s_ap, s_bm, s_bq, s_ce, s_cp, s_cq,
                            BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                            GROUP_P: tl.constexpr):
        """C[e] (P, Q) = A[rows_e]^T @ B[rows_e] for A (M, P), B (M, Q): the reduction runs over one expert's rows;
        an expert without rows gets zeros. Grid (output tiles, E): the tiles of one expert run together and
        share its rows in L2."""
        e = tl.program_id(1)
        pid_p, pid_q = _tile_of(tl.program_id(0), tl.cdiv(P, BLOCK_P), tl.cdiv(Q, BLOCK_Q), GROUP_P)
        rp = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        rq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        start = tl.load(OFFS + e)
        end = tl.load(OFFS + e + 1)
        p_ok = rp < P
        q_ok = rq < Q
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            m_ok = rm < end
            rm64 = rm.to(tl.int64)
            a = tl.load(A + rm64[None, :] * s_am + rp[:, None] * s_ap, mask=p_ok[:, None] & m_ok[None, :], other=0.0)
            b = tl.load(B + rm64[:, None] * s_bm + rq[None, :] * s_bq, mask=m_ok[:, None] & q_ok[None, :], other=0.0)
            acc += tl.dot(a, b)
        c = C + e.to(tl.int64) * s_ce + rp[:, None] * s_cp + rq[None, :] * s_cq
        tl.store(c, acc.to(C.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :])


# Launch configuration on a GPU: one row-tile height for the tile table; per product (block_n, block_k, warps,
# stages, TMA descriptors or pointer loads); the weight gradient's (block_p, block_q, block_m, warps, stages);
# GROUP_M; a persistent grid of ``persistent`` programs per SM (0: one program per work item). From the H100
# sweep at the 1B preset's shapes (BENCHMARKS.md, ``benchmarks/moe_bench.py``): the forward products with pointer
# loads (TMA was ~10% faster on the GPU, but encoding its descriptors on the host each call made the whole forward
# slower in eager timing), the backward products with TMA (3-10x faster there than pointer loads were).
GPU_CONFIG = {"block_m": 128, "gate_up": (128, 64, 8, 4, False), "down": (256, 64, 8, 3, False),
              "dh": (128, 64, 8, 4, True), "dx": (256, 64, 8, 4, True), "wgrad": (128, 128, 64, 8, 3),
              "group_m": 8, "persistent": 0}
# the CPU interpreter: small tiles (its cost grows with the tile)
INTERPRET_CONFIG = {"block_m": 16, "gate_up": (16, 16, 1, 1, False), "down": (16, 16, 1, 1, False),
                    "dh": (16, 16, 1, 1, False), "dx": (16, 16, 1, 1, False), "wgrad": (16, 16, 16, 1, 1),
                    "group_m": 2, "persistent": 0}


def _config(x: torch.Tensor) -> dict:
    return GPU_CONFIG if x.is_cuda else INTERPRET_CONFIG


def expert_tiles(counts: torch.Tensor, block_m: int, n_rows: int):
    """Flat row-tile list over the experts, on the device: (expert, first row, end row) per tile, int32, sized
    ceil(n_rows / block_m) + E (the most tiles any split of n_rows rows can need); the first ``n_tiles`` are
    used, the rest have first == end. Returns (expert, first, end, offsets (E + 1,), n_tiles (1,))."""
    E = counts.numel()
    counts = counts.to(torch.int64)
    offs = torch.zeros(E + 1, dtype=torch.int64, device=counts.device)
    offs[1:] = torch.cumsum(counts, 0)
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    n_tiles = -(-n_rows // block_m) + E
    t = torch.arange(n_tiles, device=counts.device)
    e = torch.searchsorted(tile_end, t, right=True)
    valid = e < E
    ec = e.clamp(max=E - 1)
    first = offs[ec] + (t - (tile_end[ec] - tiles[ec])) * block_m
    end = offs[ec + 1]
    first = torch.where(valid, first, 0)
    end = torch.where(valid, end, 0)
    return (ec.to(torch.int32), first.to(torch.int32), end.to(torch.int32), offs.to(torch.int32),
            tile_end[-1:].to(torch.int32))


def _n_programs(a: torch.Tensor, items: int, per_sm: int) -> int:
    """One program per work item, or ``per_sm`` per multiprocessor (the interpreter counts as one) looping over
    them."""
    if not per_sm:
        return items
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 1
    return min(items, per_sm * sms)


def _grouped(a, w, nk, n, k, tiles, mode, c, aux=None, which="down"):
    """Launch the grouped product C = epilogue(A @ W[e]) over the tile table. ``w`` (E, R, S) as stored: ``nk``
    when w[e] is (N', K) (``nn.Linear`` layout, used transposed), else (K, N)."""
    tile_e, first, end, _, n_tiles = tiles
    cfg = _config(a)
    bm = cfg["block_m"]
    bn, bk, warps, stages, tma = cfg[which]
    aux_t = aux if aux is not None else c
    items = tile_e.numel() * triton.cdiv(n, bn)
    grid = (_n_programs(a, items, cfg["persistent"]),)
    even = k % bk == 0 and n % bn == 0
    if tma and even and w.is_contiguous() and a.is_contiguous():
        from triton.tools.tensor_descriptor import TensorDescriptor

        # the descriptors are encoded through the driver before the launch: make the device's primary context
        # current on this thread first (autograd runs the backward on a thread of its own)
        if a.is_cuda:
            torch.cuda.current_stream(a.device).query()
        w2d = w.view(-1, w.shape[-1])
        a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(w2d, [bn, bk] if nk else [bk, bn])
        _grouped_kernel_tma[grid](a_desc, b_desc, c, aux_t, tile_e, first, end, n_tiles, n, k, w.shape[1],
                                  c.stride(0), c.stride(1), aux_t.stride(0), aux_t.stride(1),
                                  MODE=mode, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["group_m"], B_NK=nk,
                                  num_warps=warps, num_stages=stages)
        return c
    b = w.transpose(1, 2) if nk else w  # b[e][k, n]
    _grouped_kernel[grid](a, b, c, aux_t, tile_e, first, end, n_tiles, n, k,
                          a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
                          c.stride(0), c.stride(1), aux_t.stride(0), aux_t.stride(1),
                          MODE=mode, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["group_m"], EVEN=even,
                          num_warps=warps, num_stages=stages)
    return c


def _weight_grad(a, b, offs, n_experts, dtype):
    """(E, P, Q) with [e] = a[rows_e]^T b[rows_e]."""
    P, Q = a.shape[1], b.shape[1]
    out = torch.empty(n_experts, P, Q, dtype=dtype, device=a.device)
    cfg = _config(a)
    bp, bq, bmm, warps, stages = cfg["wgrad"]
    grid = (triton.cdiv(P, bp) * triton.cdiv(Q, bq), n_experts)
    _weight_grad_kernel[grid](a, b, out, offs, P, Q, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                              out.stride(0), out.stride(1), out.stride(2),
                              BLOCK_M=bmm, BLOCK_P=bp, BLOCK_Q=bq, GROUP_P=cfg["group_m"],
                              num_warps=warps, num_stages=stages)
    return out


class GroupedSwiGLU(torch.autograd.Function):
    """The Triton grouped SwiGLU MLP (see the module docstring for the formulas)."""

    @staticmethod
    def forward(ctx, x, counts, w1, w2):
        x = x.contiguous()
        M, H = x.shape
        E, I2, _ = w1.shape
        I = I2 // 2
        tiles = expert_tiles(counts, _config(x)["block_m"], M)
        gate_up = torch.empty(M, 2 * I, dtype=x.dtype, device=x.device)
        h = torch.empty(M, I, dtype=x.dtype, device=x.device)
        y = torch.empty(M, w2.shape[1], dtype=x.dtype, device=x.device)
        if M:
            _grouped(x, w1, True, I, H, tiles, 1, h, gate_up, which="gate_up")   # w1[e] (2I, H): (N', K)
            _grouped(h, w2, True, w2.shape[1], I, tiles, 0, y, which="down")      # w2[e] (H, I): (N, K)
        ctx.save_for_backward(x, w1, w2, gate_up, h, *tiles)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, gate_up, h, *tiles = ctx.saved_tensors
        dy = dy.contiguous()
        M, H = x.shape
        E, I2, _ = w1.shape
        I = I2 // 2
        offs = tiles[3]
        dgu = torch.empty(M, 2 * I, dtype=x.dtype, device=x.device)
        dx = torch.empty_like(x)
        if M:
            _grouped(dy, w2, False, I, H, tiles, 2, dgu, gate_up, which="dh")   # w2[e] (H, I): (K, N)
            _grouped(dgu, w1, False, H, 2 * I, tiles, 0, dx, which="dx")        # w1[e] (2I, H): (K, N)
        dw1 = _weight_grad(dgu, x, offs, E, w1.dtype)          # (E, 2I, H)
        dw2 = _weight_grad(dy, h, offs, E, w2.dtype)           # (E, H, I)
        return dx, None, dw1, dw2
