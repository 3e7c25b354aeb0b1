"""Step-level work of the bf16 path (``kernels/step_fusion.py``): weight casts once per optimizer step, weight
gradients written in float32 and accumulated inside their GEMM.

The cast cache must hand out a cast only while the weight is unchanged (same object, same ``_version``), and
training with it must give exactly the losses and gradients of training without (the same bf16 values reach the
same GEMMs). ``matmul_to`` must equal the product computed in float64 to float32 accuracy, and accumulation in the
GEMM the gradients of autograd's accumulation.
"""

import pytest
import torch
from kernel_check import assert_close_to_reference

from zero2all.config import ModelConfig, OpsConfig
from zero2all.kernels import step_fusion
from zero2all.kernels.step_fusion import CASTS, ComputeCasts, matmul_to
from zero2all.model.z2all import build_model


def marked(t):
    setattr(t, step_fusion.STEP_CAST, True)
    return t


def test_cache_hits_only_while_the_weight_is_unchanged():
    cache = ComputeCasts()
    w = marked(torch.randn(37, 19, requires_grad=True))
    a = cache.get(w, torch.bfloat16)
    assert a.dtype == torch.bfloat16 and torch.equal(a, w.detach().to(torch.bfloat16))
    assert cache.get(w, torch.bfloat16) is a                       # unchanged: the same copy
    assert cache.get(w, torch.float32) is w                        # no cast needed: the weight itself
    with torch.no_grad():
        w.add_(1.0)                                                # an in-place write bumps _version
    b = cache.get(w, torch.bfloat16)
    assert b is not a and torch.equal(b, w.detach().to(torch.bfloat16))
    other = torch.randn(37, 19)                                    # another tensor never hits
    assert torch.equal(cache.get(other, torch.bfloat16), other.to(torch.bfloat16))
    cache.clear()
    assert len(cache) == 0
    unmarked = torch.randn(8, 8)
    assert cache.get(unmarked, torch.bfloat16) is not cache.get(unmarked, torch.bfloat16) and len(cache) == 0


def test_an_entry_dies_with_its_weight():
    cache = ComputeCasts()
    w = marked(torch.randn(16, 8))
    cache.get(w, torch.bfloat16)
    assert len(cache) == 1
    del w
    assert len(cache) == 0


def test_optimizer_step_empties_the_cache():
    w = marked(torch.nn.Parameter(torch.randn(8, 8)))
    CASTS.get(w, torch.bfloat16)
    assert len(CASTS) == 1
    w.grad = torch.ones_like(w)
    torch.optim.SGD([w], lr=0.1).step()
    assert len(CASTS) == 0


def test_mark_sets_both_switches_on_matrices_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    assert step_fusion.mark(model, casts=True, accumulate=False) == 1
    w = model[0].weight
    assert getattr(w, step_fusion.STEP_CAST) and not getattr(w, step_fusion.GRAD_IN_GEMM)
    assert not hasattr(model[0].bias, step_fusion.STEP_CAST)


def _train(steps: int, accum: int, casts: bool):
    cfg = ModelConfig(vocab_size=96, hidden_dim=48, intermediate_size=72, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_seq_len=16, ops=OpsConfig(rmsnorm="triton", swiglu="triton", fused_linear="triton",
                                                    rope="torch", cross_entropy="torch", attention="sdpa"))
    model = build_model(cfg, seed=0)
    step_fusion.mark(model, casts=casts, accumulate=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        for _ in range(accum):
            tokens = torch.randint(0, 96, (2, 13), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:])[1]
            (loss / accum).backward()
            losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def test_training_with_cached_casts_is_identical():
    """Two optimizer steps of 2 micro-batches under bf16 autocast: the same losses and gradients, bit for bit."""
    want_losses, want_grads = _train(2, 2, casts=False)
    hits = CASTS.hits
    got_losses, got_grads = _train(2, 2, casts=True)
    assert CASTS.hits - hits == 2 * 4 * 3      # per step: 4 block weights, 4 uses each, the first one a miss
    assert got_losses == want_losses
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shape", [(33, 70, 45), (300, 1000, 129)])
def test_matmul_to_float32_matches_float64(device, shape):
    """The weight-gradient GEMM (a^T b with a transposed view, as in backward) in float32 from bf16 operands."""
    m, k, n = shape
    g = torch.Generator().manual_seed(m)
    a = torch.randn(k, m, generator=g).to(device, torch.bfloat16)
    b = torch.randn(k, n, generator=g).to(device, torch.bfloat16)
    got = matmul_to(a.t(), b, torch.float32)
    want = a.double().t() @ b.double()
    assert got.dtype == torch.float32
    assert_close_to_reference(got, want, rel_l2=1e-5 if device == "cuda" else 5e-3, what="a^T b in float32")


@pytest.mark.gpu
def test_gradient_accumulation_inside_the_gemm_gpu():
    """Three micro-batches with the gradients accumulated inside the GEMM give the gradients of autograd's
    accumulation (float32 sums of the same products, added in another place), and hooks on the accumulated
    gradient still run."""
    cfg = ModelConfig(vocab_size=256, hidden_dim=128, intermediate_size=352, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=64, ops=OpsConfig(rmsnorm="triton", swiglu="triton", fused_linear="triton",
                                                    rope="triton", cross_entropy="fused", attention="sdpa"))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 65), generator=g).cuda() for _ in range(3)]

    def grads(accumulate):
        model = build_model(cfg, device="cuda", seed=0)
        step_fusion.mark(model, casts=accumulate, accumulate=accumulate)
        seen = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: seen.append(p))
        for b in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(b[:, :-1], b[:, 1:])[1]
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, len(seen)

    want, n_want = grads(False)
    got, n_got = grads(True)
    assert n_got == n_want == 3 * len(want)
    for name in want:
        assert_close_to_reference(got[name], want[name], rel_l2=1e-5, what=name)


@pytest.mark.parametrize("setting", ["auto", "off"])
def test_the_trainer_marks_a_single_process_model(tmp_path, setting):
    from test_trainer import tiny_cfg

    from zero2all.train.trainer import Trainer

    trainer = Trainer(tiny_cfg(tmp_path, f"model.ops.step_fusion='{setting}'"), show_progress=False)
    w = trainer.raw_model.layers[0].self_attn.qkv_proj.weight
    assert getattr(w, step_fusion.STEP_CAST, False) == (setting == "auto")
    assert getattr(w, step_fusion.GRAD_IN_GEMM, False) == (setting == "auto")
