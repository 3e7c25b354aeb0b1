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
from zero2all.kernels.numerics import Numerics
from zero2all.kernels.step_fusion import ComputeCasts, matmul_to
from zero2all.model.z2all import build_model


def test_cache_hits_only_while_the_weight_is_unchanged():
    cache = ComputeCasts()
    w = torch.randn(37, 19, requires_grad=True)
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
    nx = Numerics()                                                # a context that marked nothing: no cache
    unmarked = torch.randn(8, 8)
    cast = step_fusion.cast
    assert cast(unmarked, torch.bfloat16, nx) is not cast(unmarked, torch.bfloat16, nx)
    assert len(nx.compute_casts) == 0


def test_an_entry_dies_with_its_weight():
    cache = ComputeCasts()
    w = torch.randn(16, 8)
    cache.get(w, torch.bfloat16)
    assert len(cache) == 1
    del w
    assert len(cache) == 0


def test_a_step_of_the_attached_optimizer_empties_the_cache():
    model = torch.nn.Linear(8, 8, bias=False)
    nx = Numerics()
    nx.mark(model, "all")
    w = model.weight
    assert step_fusion.cast(w, torch.bfloat16, nx) is step_fusion.cast(w, torch.bfloat16, nx)
    assert len(nx.compute_casts) == 1
    w.grad = torch.ones_like(w)
    torch.optim.SGD([w], lr=0.1).step()                            # not attached: the cache stays
    assert len(nx.compute_casts) == 1
    opt = torch.optim.SGD([w], lr=0.1)
    nx.attach(opt)
    opt.step()
    assert len(nx.compute_casts) == 0


def test_mark_sets_the_switches_on_matrices_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    w = model[0].weight
    nx = Numerics()
    for setting, grads, casts in (("grads", True, False), ("all", True, True), ("off", False, False)):
        assert nx.mark(model, setting) == (setting != "off")
        assert nx.grad_in_gemm(w) == grads and nx.step_cast(w) == casts
        assert not nx.grad_in_gemm(model[0].bias) and not nx.step_cast(model[0].bias)
        assert not Numerics().grad_in_gemm(w)                      # the marks belong to that context only
    assert not any(vars(p) for p in model.parameters())            # nothing hung on the parameters
    with pytest.raises(ValueError, match="step_fusion: 'auto' is not one of off, grads, all"):
        nx.mark(model, "auto")


def _train(steps: int, accum: int, casts: bool):
    cfg = ModelConfig(vocab_size=96, hidden_dim=48, intermediate_size=72, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_seq_len=16, ops=OpsConfig(rmsnorm="triton", swiglu="triton", fused_linear="triton",
                                                    rope="torch", cross_entropy="torch", attention="sdpa"))
    model = build_model(cfg, seed=0)
    model.numerics.mark(model, "all" if casts else "off")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.numerics.attach(opt)
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
    return losses, grads, model.numerics.compute_casts.hits


def test_training_with_cached_casts_is_identical():
    """Two optimizer steps of 2 micro-batches under bf16 autocast: the same losses and gradients, bit for bit."""
    want_losses, want_grads, no_hits = _train(2, 2, casts=False)
    got_losses, got_grads, hits = _train(2, 2, casts=True)
    assert no_hits == 0 and hits == 2 * 4 * 3  # per step: 4 block weights, 4 uses each, the first one a miss
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
@pytest.mark.parametrize("setting", ["grads", "all"])
def test_gradient_accumulation_inside_the_gemm_gpu(setting):
    """Three micro-batches with the gradients summed inside the GEMMs give the sum of the three micro-batches'
    gradients taken one at a time (float32 sums of the same float32 products, added in another order), every
    hook on the accumulated gradient still runs, and against the default path (bf16 products) the gradients
    differ by bf16 rounding only."""
    cfg = ModelConfig(vocab_size=256, hidden_dim=128, intermediate_size=352, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=64, ops=OpsConfig(rmsnorm="triton", swiglu="triton", fused_linear="triton",
                                                    rope="triton", cross_entropy="fused", attention="sdpa"))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 65), generator=g).cuda() for _ in range(3)]

    def grads(mark, one_at_a_time):
        model = build_model(cfg, device="cuda", seed=0)
        model.numerics.mark(model, mark)
        seen, total = [], {}
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: seen.append(p))
        for b in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(b[:, :-1], b[:, 1:])[1]
            loss.backward()
            if one_at_a_time:  # each micro-batch's own gradient (no .grad before it: nothing to sum into)
                for n, p in model.named_parameters():
                    total[n] = total[n] + p.grad if n in total else p.grad.clone()
                    p.grad = None
        if not one_at_a_time:
            total = {n: p.grad.clone() for n, p in model.named_parameters()}
        return total, len(seen)

    summed, n_summed = grads(setting, one_at_a_time=False)
    separate, _ = grads(setting, one_at_a_time=True)
    default, n_default = grads("off", one_at_a_time=False)
    assert n_summed == n_default == 3 * len(default)
    for name in default:
        assert summed[name].dtype == torch.float32
        assert_close_to_reference(summed[name], separate[name], rel_l2=1e-5, what=name)
        assert_close_to_reference(summed[name], default[name], rel_l2=4e-3, what=f"{name} vs the default path")


@pytest.mark.parametrize("setting", ["off", "grads", "all"])
def test_the_trainer_marks_a_single_process_model(tmp_path, setting):
    from test_trainer import tiny_cfg

    from zero2all.train.trainer import Trainer

    trainer = Trainer(tiny_cfg(tmp_path, f"model.ops.step_fusion='{setting}'"), show_progress=False)
    w = trainer.raw_model.layers[0].self_attn.qkv_proj.weight
    assert trainer.raw_model.numerics.grad_in_gemm(w) == (setting != "off")
    assert trainer.raw_model.numerics.step_cast(w) == (setting == "all")


def test_config_refuses_an_unknown_setting_and_data_parallel_runs(tmp_path):
    from test_trainer import tiny_cfg

    from zero2all.config import ConfigError
    from zero2all.distributed.plan import resolve

    with pytest.raises(ConfigError, match="model.ops.step_fusion: 'on' is not one of off, grads, all"):
        tiny_cfg(tmp_path, "model.ops.step_fusion='on'").validate()
    with pytest.raises(ConfigError, match="step_fusion='grads' needs training in one process .*mode 'ddp'"):
        resolve(tiny_cfg(tmp_path, "model.ops.step_fusion='grads'").validate(), 2)
    with pytest.raises(ConfigError, match="step_fusion='all' needs training in one process .*mode 'fsdp'"):
        resolve(tiny_cfg(tmp_path, "model.ops.step_fusion='all'", "parallel.mode='fsdp'").validate(), None)
    resolve(tiny_cfg(tmp_path, "model.ops.step_fusion='all'").validate(), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [2 ** 10, 2 ** 28])
def test_fused_loss_with_a_marked_weight_matches_float64(monkeypatch, dtype, chunk_elements):
    """The LM head under step fusion: the stored float32 weight enters the fused loss, which casts it and returns
    its gradient in float32; loss and gradients against a float64 reference, with several chunks and with one."""
    from zero2all.kernels import cross_entropy as ce

    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 11, 96, generator=g).to(dtype).requires_grad_()
    weight = torch.nn.Parameter(0.1 * torch.randn(257, 96, generator=g))
    targets = torch.randint(0, 257, (3, 11), generator=g)
    targets[0, :2] = -100
    nx = Numerics()
    assert nx.mark(torch.nn.ParameterList([weight]), "all") == 1
    loss = ce.fused_linear_cross_entropy(hidden, weight, targets, numerics=nx)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert gw.dtype == torch.float32 and gh.dtype == dtype
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().to(dtype).double().requires_grad_()   # the weight as the GEMMs see it
    want = torch.nn.functional.cross_entropy((h64 @ w64.t()).reshape(-1, 257), targets.reshape(-1))
    wh, ww = torch.autograd.grad(want, (h64, w64))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close_to_reference(loss, want, rel_l2=tol / 4, what="loss")
    assert_close_to_reference(gh, wh, rel_l2=tol, what="grad hidden")
    assert_close_to_reference(gw, ww, rel_l2=tol, what="grad weight")
