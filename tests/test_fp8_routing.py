"""Where the plain path's FP8 linear (``ops.linear_torch``: ``model.ops.fused_linear = torch`` or the ablation rows
without the lean projections) quantises: our Triton casts next to ``torch._scaled_mm`` on a GPU, the PyTorch
reference with the float32 GEMM emulation on CPU. The GPU test (``-k gpu``) is skipped elsewhere."""

import os

import pytest
import torch
from kernel_check import relative_l2_error

from zero2all.kernels import fp8_ref
from zero2all.model import ops


def _spy_fp8_linear(monkeypatch):
    calls = []
    real = fp8_ref.fp8_linear

    def spy(*args, **kwargs):
        calls.append(kwargs["use_triton"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_ref, "fp8_linear", spy)
    return calls


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton casts on CPU tensors")
def test_cpu_keeps_the_reference_casts_and_cuda_takes_the_triton_ones(monkeypatch):
    x, w = torch.randn(6, 32), torch.randn(24, 32) / 32 ** 0.5
    assert not ops.fp8_casts_use_triton(x)
    calls = _spy_fp8_linear(monkeypatch)
    y_ref = ops.linear_torch(x, w, precision="fp8_rowwise")
    assert calls == [False]
    # the decision a GPU makes, taken here on CPU (the Triton casts then run under the interpreter); the two
    # quantisers agree bit for bit, so the outputs are equal
    monkeypatch.setattr(ops, "fp8_casts_use_triton", lambda t: True)
    y_tri = ops.linear_torch(x, w, precision="fp8_rowwise")
    assert calls == [False, True]
    assert torch.equal(y_ref, y_tri)
    assert relative_l2_error(y_ref, x @ w.t()) < 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs a GPU with FP8 (compute capability >= 8.9)")
def test_plain_path_fp8_on_gpu_uses_triton_casts_and_matches_lean_path(monkeypatch):
    from zero2all.kernels.fused_linear import lean_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(257, 192, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(80, 192, device="cuda", generator=g) / 192 ** 0.5).requires_grad_()
    gy = torch.randn(257, 80, device="cuda", generator=g, dtype=torch.bfloat16)
    calls = _spy_fp8_linear(monkeypatch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = ops.linear_torch(x, w, precision="fp8_rowwise")
    y.backward(gy)
    assert calls == [True]
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y2 = lean_linear(x, w, precision="fp8_rowwise")
    y2.backward(gy)
    assert torch.equal(y, y2)                                   # the same casts and the same GEMM
    assert relative_l2_error(grads[0].float(), x.grad.float()) < 1e-2
    assert relative_l2_error(grads[1], w.grad) < 1e-2
