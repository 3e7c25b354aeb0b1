"""The fused linear + cross-entropy against a float64 reference and ops.linear_cross_entropy_torch."""

import pytest
import torch
import torch.nn.functional as F
from kernel_check import assert_close_to_reference

from zero2all.kernels import cross_entropy as ce
from zero2all.kernels.cross_entropy import fused_linear_cross_entropy
from zero2all.model.ops import linear_cross_entropy_torch

# loss and gradients; bf16 rounds the logits (and their gradient) to 8 bits of mantissa before the softmax
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def reference(hidden, weight, targets, ignore_index=-100, z_loss=0.0):
    logits = hidden.double() @ weight.double().t()
    logits = logits.view(-1, logits.size(-1))
    t = targets.reshape(-1)
    loss = F.cross_entropy(logits, t, ignore_index=ignore_index)
    if z_loss:
        lse = torch.logsumexp(logits[t != ignore_index], dim=-1)
        loss = loss + z_loss * lse.pow(2).mean()
    return loss


def run_case(tokens_shape, H, V, dtype, z_loss=0.0, n_ignored=2, device="cpu", seed=0, ignore_index=-100):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(*tokens_shape, H, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H ** 0.5 * 2).to(device).requires_grad_()  # fp32 master weight
    targets = torch.randint(0, V, tokens_shape, generator=g)
    flat = targets.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[:n_ignored]] = ignore_index
    targets = targets.to(device)

    loss = fused_linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index, z_loss=z_loss)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    gh, gw = torch.autograd.grad(loss * 1.7, [hidden, weight])        # a non-unit incoming gradient
    assert gh.dtype == dtype and gw.dtype == torch.float32

    w_in = weight.detach().to(dtype)  # autocast's view of the weight: the reference sees the same rounded values
    rh = hidden.detach().double().requires_grad_()
    rw = w_in.double().requires_grad_()
    want = reference(rh, rw, targets, ignore_index, z_loss)
    wh, ww = torch.autograd.grad(want * 1.7, [rh, rw])
    tol = TOL[dtype]
    # a scalar's relative L2 error is |loss - want| / |want|
    assert_close_to_reference(loss, want, dtype, rel_l2=tol / 4, what="loss")
    assert_close_to_reference(gh, wh, dtype, rel_l2=tol, what="grad hidden")
    assert_close_to_reference(gw, ww, dtype, rel_l2=tol, what="grad weight")
    # the switchboard's plain path gives the same loss
    plain = linear_cross_entropy_torch(hidden.detach(), w_in, targets, ignore_index, z_loss)
    assert_close_to_reference(loss, plain, dtype, rel_l2=tol / 4, what="loss vs linear_cross_entropy_torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,V", [(96, 257), (100, 257), (64, 64320)])
def test_linear_cross_entropy(H, V, dtype):
    run_case((2, 3), H, V, dtype, seed=H + V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_chunks_z_loss_and_ignore_index(monkeypatch, dtype):
    # 2^10 logits per chunk at V=257: 3 tokens per chunk, so 11 tokens take 4 chunks (one partial)
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", 2 ** 10)
    assert ce._chunk_rows(11, 257) == 3
    run_case((11,), 100, 257, dtype, z_loss=1e-2, n_ignored=4, seed=3)
    run_case((1, 11), 96, 257, dtype, n_ignored=0, seed=4, ignore_index=0)


def test_linear_cross_entropy_no_grad_and_errors():
    h, w = torch.randn(4, 16), torch.randn(33, 16)
    t = torch.tensor([1, 5, -100, 32])
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h, w, t)
    assert_close_to_reference(loss, reference(h, w, t), atol=1e-5, what="loss under no_grad")
    with pytest.raises(ValueError, match="targets shape"):
        fused_linear_cross_entropy(h, w, t[:3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused_linear_cross_entropy(h, w, torch.tensor([1, 5, 33, 0]))
    with pytest.raises(ValueError, match="weight shape"):
        fused_linear_cross_entropy(h, torch.randn(33, 15), t)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_gpu_real_shapes(dtype):
    run_case((8, 2048), 2048, 64320, dtype, z_loss=1e-4, n_ignored=100, device="cuda")


def test_linear_cross_entropy_views_of_any_layout():
    """Transposed hidden states and head weight, and int32 targets taken as a column of a wider buffer: the
    float64 reference's loss and gradients (the row kernel reads each row's target at stride 1: the wrapper
    copies the column first)."""
    g = torch.Generator().manual_seed(6)
    N, H, V = 7, 24, 41
    hidden = torch.randn(H, N, generator=g).t().requires_grad_()
    weight = (torch.randn(H, V, generator=g) / H ** 0.5 * 2).t().requires_grad_()
    buf = torch.randint(0, V, (N, 3), generator=g, dtype=torch.int32)
    buf[2, 1] = -100
    targets = buf[:, 1]
    assert targets.stride(0) == 3
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    rh, rw = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = reference(rh, rw, targets.long())
    wh, ww = torch.autograd.grad(want, [rh, rw])
    # float32 against float64: measured relative L2 errors <= 2e-7 (the loss 2e-9)
    assert_close_to_reference(loss, want, rel_l2=1e-7, what="loss")
    assert_close_to_reference(gh, wh, rel_l2=3e-6, what="grad hidden")
    assert_close_to_reference(gw, ww, rel_l2=3e-6, what="grad weight")
