"""Rotary position embedding of q and k in one kernel (the "rotate half" layout of Llama in HF).

For each head vector x of length d, split into halves x1 = x[:d/2], x2 = x[d/2:], and the position's angles
(cos, sin of shape (d/2,))::

    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin          (computed in float32, stored in x's dtype)

The rotation is orthogonal, so the backward is the rotation by the opposite angle (sin -> -sin)::

    dx1 =  g1 * cos + g2 * sin
    dx2 =  g2 * cos - g1 * sin

One program handles one token (b, t): it loads that position's cos/sin once and rotates all H query heads and all
Hkv key heads. q and k may be strided views of the fused qkv projection's output (B, T, H + 2 Hkv, D): the kernel
reads them through their strides, so no copy is made first; it writes contiguous (B, T, heads, D) outputs.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, OUT, b, t, sxb, sxt, sxh, n_heads, T, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (cols < HALF)
    src = X + b * sxb + t * sxt + heads * sxh + cols               # last dimension has stride 1
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = OUT + ((b * T + t) * n_heads + heads) * (2 * HALF) + cols
    tl.store(dst, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, COS, SIN, QOUT, KOUT, T, n_q_heads, n_k_heads,
                 sqb, sqt, sqh, skb, skt, skh,
                 BACKWARD: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b = token // T
    t = token % T
    d = tl.arange(0, BLOCK_D)[None, :]
    cos = tl.load(COS + t * HALF + d, mask=d < HALF, other=0.0)
    sin = tl.load(SIN + t * HALF + d, mask=d < HALF, other=0.0)
    if BACKWARD:
        sin = -sin
    _rotate_heads(Q, QOUT, b, t, sqb, sqt, sqh, n_q_heads, T, cos, sin, HALF, BLOCK_HQ, BLOCK_D)
    _rotate_heads(K, KOUT, b, t, skb, skt, skh, n_k_heads, T, cos, sin, HALF, BLOCK_HK, BLOCK_D)


def _launch(q, k, cos, sin, backward: bool):
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((B, T, Hkv, D), dtype=k.dtype, device=k.device)
    if B * T:
        half = D // 2
        cos = cos.to(torch.float32).contiguous()
        sin = sin.to(torch.float32).contiguous()
        block_d = triton.next_power_of_2(half)
        block_hq, block_hk = triton.next_power_of_2(H), triton.next_power_of_2(Hkv)
        warps = 4 if block_hq * block_d <= 2048 else 8
        _rope_kernel[(B * T,)](q, k, cos, sin, q_out, k_out, T, H, Hkv,
                               q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                               BACKWARD=backward, HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
                               BLOCK_D=block_d, num_warps=warps)
    return q_out, k_out


@torch.library.custom_op("z2all::rope", mutates_args=())
def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, cos, sin, backward)


@_rope.register_fake
def _(q, k, cos, sin, backward):
    return (q.new_empty(q.shape), k.new_empty(k.shape))


def _setup_context(ctx, inputs, output):
    _, _, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    dq, dk = _rope(grad_q, grad_k, cos, sin, not ctx.backward)
    return dq, dk, None, None, None


_rope.register_autograd(_backward, setup_context=_setup_context)


def triton_apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q (B, T, H, D) and k (B, T, Hkv, D) by the angles cos/sin (T, D/2); returns new (q, k) tensors,
    contiguous in (B, T, heads, D), equal to ``ops.apply_rope_torch``."""
    check_rope_shapes(q, k, cos, sin)
    return _rope(q, k, cos, sin, False)


def check_rope_shapes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rope: q and k must be (B, T, heads, head_dim), got {tuple(q.shape)}, {tuple(k.shape)}")
    B, T, _, D = q.shape
    if D % 2:
        raise ValueError(f"rope: head_dim {D} must be even")
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"rope: k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if cos.shape != (T, D // 2) or sin.shape != (T, D // 2):
        raise ValueError(f"rope: cos/sin must be ({T}, {D // 2}), got {tuple(cos.shape)}, {tuple(sin.shape)}")
