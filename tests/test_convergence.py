"""Training with every fused kernel follows the same loss curve as training with the plain PyTorch ops.

A small Llama (2 layers, hidden 64, GQA, vocab 257) learns a synthetic language (each sequence counts upward from a
random start with a random stride, so the next token is predictable from the two before) for STEPS AdamW steps
from the same seed and the same batches, once with ops = torch and once with ops = triton/fused. Per step, the
losses and every parameter's gradient norm (before clipping) must agree, and so must the final parameters; both
runs must actually learn. AdamW normalises each parameter's update and clipping rescales all of them, so a
gradient wrong by a constant factor (all of them x16, one projection's halved) leaves the loss curve almost
unchanged: the gradient norms are what see it.

Measured on CPU (float32, 20 steps): losses within 4.8e-7, gradient norms within 6.2e-6 relative, final parameters
within 7.1e-6 relative; the bounds are about 30-40x that.
"""

import os

import pytest
import torch

from zero2all.config import ModelConfig, OpsConfig
from zero2all.model.z2all import build_model

# CPU: few steps at 32 tokens each (the interpreter runs every Triton program in Python); the GPU test runs 200
STEPS = int(os.environ.get("Z2ALL_CONVERGENCE_STEPS", "20"))
LOSS_TOL = 2e-5          # |loss_fused - loss_plain| per step, float32 on CPU
GRAD_NORM_RTOL = 2e-4    # each parameter's gradient norm per step, relative, float32 on CPU
PARAM_RTOL = 2e-4        # each final parameter, relative L2, float32 on CPU
LOSS_TOL_BF16 = 5e-2     # bf16 autocast on a GPU


def batches(steps, B, T, V, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, V, (B, 1), generator=g)
        stride = torch.randint(1, 4, (B, 1), generator=g)
        seq = (start + stride * torch.arange(T + 1)) % V
        yield seq[:, :-1].to(device), seq[:, 1:].to(device)


def train(ops: OpsConfig, steps, device="cpu", dtype=None, B=2, T=16, lr=3e-3, cfg_kw=None, grads=False):
    """Per-step losses; with ``grads`` also (per-step gradient norms of each parameter (steps, n_params), the
    final parameters)."""
    cfg = ModelConfig(vocab_size=257, hidden_dim=64, intermediate_size=100, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=T, ops=ops, **(cfg_kw or {}))
    model = build_model(cfg, device=device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses, norms = [], []
    for tokens, targets in batches(steps, B, T, cfg.vocab_size, device=device):
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            _, loss = model(tokens, targets)
        loss.backward()
        if grads:
            norms.append(torch.stack([p.grad.norm() for p in model.parameters()]))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if grads:
        return torch.tensor(losses), torch.stack(norms), dict(model.named_parameters())
    return torch.tensor(losses)


FUSED = OpsConfig(rmsnorm="triton", rope="triton", swiglu="triton", cross_entropy="fused", attention="sdpa",
                  fused_linear="triton")


@pytest.mark.slow
def test_convergence_fused_vs_plain_cpu():
    plain, plain_norms, plain_params = train(OpsConfig.plain(), STEPS, grads=True)
    fused, fused_norms, fused_params = train(FUSED, STEPS, grads=True)
    assert plain[-5:].mean() < plain[:5].mean() - 0.2, "the plain model did not learn"
    diff = (plain - fused).abs()
    assert diff.max() < LOSS_TOL, f"max |loss difference| {diff.max():.2e} at step {int(diff.argmax())}"
    rel = (fused_norms - plain_norms).abs() / plain_norms
    step, i = divmod(int(rel.argmax()), rel.shape[1])
    assert rel.max() < GRAD_NORM_RTOL, \
        f"step {step}: {list(plain_params)[i]} gradient norm {fused_norms[step, i]:.6g} vs {plain_norms[step, i]:.6g}"
    for name, want in plain_params.items():
        error = ((fused_params[name] - want).norm() / want.norm()).item()
        assert error < PARAM_RTOL, f"{name}: relative L2 {error:.2e}"


@pytest.mark.gpu
def test_convergence_fused_vs_plain_gpu_200_steps():
    ops_gpu = OpsConfig(rmsnorm="triton", rope="triton", swiglu="triton", cross_entropy="fused", attention="flex",
                        fused_linear="triton")
    plain = train(OpsConfig.plain(), 200, device="cuda", dtype=torch.bfloat16, B=8, T=128, lr=3e-3)
    fused = train(ops_gpu, 200, device="cuda", dtype=torch.bfloat16, B=8, T=128, lr=3e-3)
    assert plain[-10:].mean() < plain[:10].mean() - 1.0
    diff = (plain - fused).abs()
    print(f"200 steps bf16: loss {plain[0]:.4f} -> {plain[-1]:.4f} (plain), {fused[-1]:.4f} (fused); "
          f"max |diff| {diff.max():.3e}, mean {diff.mean():.3e}")
    assert diff.max() < LOSS_TOL_BF16
