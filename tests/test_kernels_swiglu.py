"""The SwiGLU kernel against a float64 reference, forward and backward, reading a fused [gate | up] input."""

import pytest
import torch
from kernel_check import assert_close_to_reference

from zero2all.kernels.swiglu import triton_swiglu
from zero2all.model.ops import swiglu_torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def reference(gate_up):
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def run_case(shape, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    gate_up = (2 * torch.randn(shape, generator=g)).to(device, dtype).requires_grad_()
    out = triton_swiglu(gate_up)
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close_to_reference(out, reference(gate_up), dtype, rel_l2=TOL, what="out")
    assert_close_to_reference(out, swiglu_torch(gate_up), dtype, rel_l2=TOL, what="out vs swiglu_torch")
    grad = torch.randn(out.shape, generator=g).to(device, dtype)
    (got,) = torch.autograd.grad(out, gate_up, grad)
    ref_in = gate_up.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(reference(ref_in), ref_in, grad.double())
    assert got.dtype == dtype
    assert_close_to_reference(got, want, dtype, rel_l2=TOL, what="grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [96, 100, 2048, 5632, 1])
def test_swiglu_widths(intermediate, dtype):
    rows = 2 if intermediate >= 2048 else 7
    run_case((rows, 2 * intermediate) if intermediate != 96 else (2, rows, 2 * intermediate), dtype,
             seed=intermediate)


def test_swiglu_strided_rows_and_odd_width_error():
    base = torch.randn(5, 3, 40)
    gate_up = base[:, 1, :]                           # rows with stride 120: read in place
    # torch.allclose's default rtol
    assert_close_to_reference(triton_swiglu(gate_up), swiglu_torch(gate_up), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="even"):
        triton_swiglu(torch.randn(2, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_gpu_real_shapes(dtype):
    run_case((8, 2048, 2 * 5632), dtype, device="cuda")


def test_swiglu_views_of_any_layout():
    """gate|up with a strided last dimension (copied first) and an incoming gradient that is a transposed view:
    the float64 reference's values, forward and backward."""
    g = torch.Generator().manual_seed(4)
    gate_up = (2 * torch.randn(14, 3, 5, generator=g)).transpose(0, 2).requires_grad_()     # (5, 3, 14)
    assert gate_up.stride(-1) != 1
    out = triton_swiglu(gate_up)
    # float32 against float64: measured relative L2 errors <= 1e-7
    assert_close_to_reference(out, reference(gate_up), rel_l2=3e-6, what="out")
    grad = torch.randn(5, 7, 3, generator=g).transpose(1, 2)                                 # (5, 3, 7)
    (got,) = torch.autograd.grad(out, gate_up, grad)
    ref_in = gate_up.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(reference(ref_in), ref_in, grad.double())
    assert_close_to_reference(got, want, rel_l2=3e-6, what="grad")
