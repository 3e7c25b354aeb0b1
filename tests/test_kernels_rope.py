"""The RoPE kernel against a float64 reference, forward and backward, on strided views of a fused qkv output."""

import pytest
import torch
from kernel_check import assert_close_to_reference

from zero2all.kernels.rope import triton_apply_rope
from zero2all.model.ops import apply_rope_torch, rope_frequencies

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def reference(x, cos, sin):
    """float64: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin over halves of the last dimension."""
    x = x.double()
    c, s = cos.double()[None, :, None, :], sin.double()[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def run_case(B, T, H, Hkv, D, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = torch.randn(B, T, H + 2 * Hkv, D, generator=g).to(device, dtype).requires_grad_()
    q, k, _ = qkv.split([H, Hkv, Hkv], dim=2)        # strided views, as the model's fused projection gives
    assert not q.is_contiguous()
    cos, sin = rope_frequencies(D, 10000.0, torch.arange(3, 3 + T, device=device))
    q_out, k_out = triton_apply_rope(q, k, cos, sin)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    tq, tk = apply_rope_torch(q, k, cos, sin)
    assert_close_to_reference(q_out, reference(q, cos, sin), dtype, rel_l2=TOL, what="q")
    assert_close_to_reference(k_out, reference(k, cos, sin), dtype, rel_l2=TOL, what="k")
    assert_close_to_reference(q_out, tq, dtype, rel_l2=TOL, what="q vs apply_rope_torch")
    assert_close_to_reference(k_out, tk, dtype, rel_l2=TOL, what="k vs apply_rope_torch")

    gq = torch.randn(q.shape, generator=g).to(device, dtype)
    gk = torch.randn(k.shape, generator=g).to(device, dtype)
    (dqkv,) = torch.autograd.grad((q_out.float() * gq.float()).sum() + (k_out.float() * gk.float()).sum(), qkv)
    ref_qkv = qkv.detach().double().requires_grad_()
    rq, rk, _ = ref_qkv.split([H, Hkv, Hkv], dim=2)
    (want,) = torch.autograd.grad((reference(rq, cos, sin) * gq.double()).sum()
                                  + (reference(rk, cos, sin) * gk.double()).sum(), ref_qkv)
    assert_close_to_reference(dqkv[:, :, :H + Hkv], want[:, :, :H + Hkv], dtype, rel_l2=TOL, what="grad qk")
    assert dqkv[:, :, H + Hkv:].abs().max() == 0  # v received no gradient from RoPE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,H,Hkv,D", [(2, 7, 4, 2, 64), (1, 5, 6, 6, 100), (2, 3, 3, 1, 2), (1, 9, 8, 2, 96)])
def test_rope_matches_reference(B, T, H, Hkv, D, dtype):
    run_case(B, T, H, Hkv, D, dtype, seed=D + T)


def test_rope_contiguous_inputs_and_bad_shapes():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
    cos, sin = rope_frequencies(8, 10000.0, torch.arange(4))
    a, b = triton_apply_rope(q, k, cos, sin)
    ra, rb = apply_rope_torch(q, k, cos, sin)
    assert_close_to_reference(a, ra, atol=1e-6, rtol=1e-5, what="q")  # torch.allclose's default rtol
    assert_close_to_reference(b, rb, atol=1e-6, rtol=1e-5, what="k")
    with pytest.raises(ValueError, match="even"):
        triton_apply_rope(torch.randn(1, 4, 2, 7), torch.randn(1, 4, 1, 7), cos, sin)
    with pytest.raises(ValueError, match="cos/sin"):
        triton_apply_rope(q, k, cos[:3], sin[:3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_gpu_real_shapes(dtype):
    run_case(8, 2048, 32, 8, 64, dtype, device="cuda")


def test_rope_views_of_any_layout():
    """q read through its strides, k with a strided last dimension (copied first), the tables as transposed
    copies, and an incoming gradient that is a transposed view: the float64 reference's values."""
    g = torch.Generator().manual_seed(9)
    B, T, H, Hkv, D = 2, 5, 3, 2, 16
    q = torch.randn(B, H, T, D, generator=g).transpose(1, 2).requires_grad_()    # (B, T, H, D), stride(-1) 1
    k = torch.randn(B, T, D, Hkv, generator=g).transpose(2, 3)                  # stride(-1) Hkv
    assert not q.is_contiguous() and k.stride(-1) != 1
    cos, sin = rope_frequencies(D, 10000.0, torch.arange(T))
    q_out, k_out = triton_apply_rope(q, k, cos.t().contiguous().t(), sin.t().contiguous().t())
    # float32 against float64: measured relative L2 errors <= 1e-7
    assert_close_to_reference(q_out, reference(q, cos, sin), rel_l2=3e-6, what="q")
    assert_close_to_reference(k_out, reference(k, cos, sin), rel_l2=3e-6, what="k")
    grad = torch.randn(B, T, D, H, generator=g).transpose(2, 3)                 # stride(-1) H
    (got,) = torch.autograd.grad(q_out, q, grad)
    rq = q.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(reference(rq, cos, sin), rq, grad.double())
    assert_close_to_reference(got, want, rel_l2=3e-6, what="grad q")
