"""The fused residual-add + RMSNorm kernel against a float64 reference, forward and backward."""

import pytest
import torch
from kernel_check import assert_close_to_reference

from zero2all.kernels.rmsnorm import triton_add_rmsnorm
from zero2all.model.ops import add_rmsnorm_torch

# ||out - ref|| / ||ref|| allowed per dtype (float32 arithmetic vs float64; bf16 storage rounds at 2^-9)
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.2e-2}


def reference(x, residual, weight, eps):
    """float64 ground truth: r = residual + x; normed = weight * r / sqrt(mean(r^2) + eps)."""
    r = x.double() if residual is None else residual.double() + x.double()
    return weight.double() * r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps), r


def run_case(shape, dtype, has_residual, residual_in_fp32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    N = shape[-1]
    x = torch.randn(shape, generator=g).to(device, dtype).requires_grad_()
    res_dtype = torch.float32 if residual_in_fp32 else dtype
    residual = (3 * torch.randn(shape, generator=g)).to(device, res_dtype).requires_grad_() if has_residual else None
    weight = (1 + 0.3 * torch.randn(N, generator=g)).to(device).requires_grad_()
    grad_normed = torch.randn(shape, generator=g).to(device, dtype)
    grad_res = torch.randn(shape, generator=g).to(device)

    normed, new_res = triton_add_rmsnorm(x, residual, weight, 1e-5, residual_in_fp32)
    ref_normed, ref_res = reference(x, residual, weight, 1e-5)
    torch_normed, torch_res = add_rmsnorm_torch(x, residual, weight, 1e-5, residual_in_fp32)
    assert normed.dtype == torch_normed.dtype == dtype
    assert new_res.dtype == torch_res.dtype
    assert normed.shape == new_res.shape == x.shape
    tol = TOL[dtype]
    assert_close_to_reference(normed, ref_normed, dtype, rel_l2=TOL, what="normed")
    assert_close_to_reference(new_res, ref_res, new_res.dtype, rel_l2=TOL, what="new residual")

    leaves = [t for t in (x, residual, weight) if t is not None]

    def grads(normed_, res_):
        return torch.autograd.grad((normed_.double() * grad_normed.double()).sum()
                                   + (res_.double() * grad_res.double()).sum(), leaves)

    got = grads(normed, new_res)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(ref_leaves)
    rx = next(it)
    rres = next(it) if residual is not None else None
    rw = next(it)
    want_normed, want_res = reference(rx, rres, rw, 1e-5)
    want = torch.autograd.grad((want_normed * grad_normed.double()).sum() + (want_res * grad_res.double()).sum(),
                               ref_leaves)
    for name, a, b in zip(["x", "residual", "weight"][:len(got)] if residual is not None else ["x", "weight"],
                          got, want):
        # the weight gradient sums over all rows: float32 accumulation; bf16 inputs round y first
        assert_close_to_reference(a, b, dtype, rel_l2=tol * (2 if name == "weight" else 1), what=f"grad {name}")


@pytest.mark.parametrize("hidden", [96, 100, 2048, 5632])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_widths(hidden, dtype):
    rows = 6 if hidden < 2048 else 3
    run_case((rows // 3, 3, hidden) if rows >= 3 else (rows, hidden), dtype, has_residual=True,
             residual_in_fp32=True, seed=hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_residual", [True, False])
@pytest.mark.parametrize("residual_in_fp32", [True, False])
def test_add_rmsnorm_modes(dtype, has_residual, residual_in_fp32):
    run_case((2, 5, 100), dtype, has_residual, residual_in_fp32, seed=7)


def test_add_rmsnorm_rejects_bad_shapes():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight shape"):
        triton_add_rmsnorm(x, None, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="residual shape"):
        triton_add_rmsnorm(x, torch.randn(2, 9), torch.ones(8), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [2048, 5632, 100])
def test_add_rmsnorm_gpu_real_shapes(dtype, hidden):
    run_case((8, 2048, hidden) if hidden != 5632 else (2, 2048, hidden), dtype, True, True, device="cuda")


def test_add_rmsnorm_views_of_any_layout():
    """A transposed x, a residual broadcast over rows (stride 0), a weight of stride 2 and transposed incoming
    gradients: the float64 reference's values and gradients (the kernels read rows at stride N: the wrapper
    copies views first)."""
    g = torch.Generator().manual_seed(8)
    M, N = 6, 40
    x = torch.randn(N, M, generator=g).t().requires_grad_()
    res_row = (3 * torch.randn(N, generator=g)).requires_grad_()
    residual = res_row.expand(M, N)
    w_wide = (1 + 0.3 * torch.randn(N, 2, generator=g)).requires_grad_()
    weight = w_wide[:, 0]
    normed, new_res = triton_add_rmsnorm(x, residual, weight, 1e-5, True)
    ref_normed, ref_res = reference(x, residual, weight, 1e-5)
    # float32 against float64: measured relative L2 errors <= 1e-7
    assert_close_to_reference(normed, ref_normed, rel_l2=3e-6, what="normed")
    assert_close_to_reference(new_res, ref_res, rel_l2=3e-6, what="new residual")
    gn, gr = torch.randn(N, M, generator=g).t(), torch.randn(N, M, generator=g).t()
    leaves = [x, res_row, w_wide]
    got = torch.autograd.grad((normed * gn).sum() + (new_res * gr).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rn, rr = reference(ref_leaves[0], ref_leaves[1].expand(M, N), ref_leaves[2][:, 0], 1e-5)
    want = torch.autograd.grad((rn * gn.double()).sum() + (rr * gr.double()).sum(), ref_leaves)
    for name, a, b in zip(("x", "residual", "weight"), got, want):
        assert_close_to_reference(a, b, rel_l2=3e-6, what=f"grad {name}")
