"""FP8 linears: the quantisation's error bounds, the FP8 linear against float64, the model wiring, the statistics.

Expected error: rounding to a format with m mantissa bits moves an element by at most u = 2^-(m+1) of itself
(E4M3: 1/16, E5M2: 1/8), or by half the subnormal spacing times the scale for the smallest ones. A GEMM of two
such operands then differs from the exact product by a relative L2 error of about sqrt(2) u / sqrt(3) (independent
rounding errors, uniform over +-u): 0.051 for E4M3 x E4M3. The bounds below are twice that; a wrong scale, a
transposed operand or a mis-scaled column gives errors of order 1.

On CPU the GEMMs are a float32 emulation of ``torch._scaled_mm`` (the operands dequantised); the last tests run
the real ``torch._scaled_mm`` on a GPU with FP8 (compute capability >= 8.9) and are skipped elsewhere.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_check import relative_l2_error

from zero2all.config import ConfigError, OpsConfig, load_config
from zero2all.kernels import fp8_ref
from zero2all.kernels.fp8_ref import E4M3, E5M2, fp8_linear, quantize_torch
from zero2all.model.z2all import build_model

U = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
SUBNORMAL = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}
GEMM_BOUND = {E4M3: 2 * math.sqrt(2 / 3) * U[E4M3], E5M2: 2 * math.sqrt(2 / 3) * U[E5M2]}


def rows_with_outliers(shape, seed, outlier=1e4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x[::5] *= outlier
    return x


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["axis", "tensor"])
def test_round_trip_error_bound(fp8, scaling):
    x = rows_with_outliers((29, 67), seed=1)
    qz = quantize_torch(x.float(), fp8, scaling, want_q=True, want_qt=True)
    for q, s, ref in ((qz.q, qz.q_scale, x), (qz.qt, qz.qt_scale, x.t())):
        s = s[:, None].double() if s.dim() else s.double()
        back = q.double() * s
        bound = ref.abs() * U[fp8] * (1 + 1e-6) + s * SUBNORMAL[fp8] / 2 + 1e-30
        assert torch.isfinite(back).all()
        assert ((back - ref).abs() <= bound).all(), ((back - ref).abs() / bound).max()


def linear_reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_tensorwise"])
@pytest.mark.parametrize("M,K,N", [(33, 48, 17), (5, 130, 71)])
def test_fp8_linear_forward_backward_against_float64(recipe, M, K, N):
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g).requires_grad_()
    w = (torch.randn(N, K, generator=g) * K ** -0.5).requires_grad_()
    b = torch.randn(N, generator=g).requires_grad_()
    gy = torch.randn(M, N, generator=g)
    gdt = fp8_ref.grad_dtype(recipe)
    for use_triton in (False, True):
        x.grad = w.grad = b.grad = None
        y = fp8_linear(x, w, b, recipe, use_triton=use_triton)
        y.backward(gy)
        xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
        yd = linear_reference(xd, wd, bd)
        yd.backward(gy.double())
        assert y.dtype == torch.float32 and torch.isfinite(y).all()
        assert relative_l2_error(y - b, yd - bd) < GEMM_BOUND[E4M3]
        # gradients: one E4M3 operand (the weight or the input) and one gradient operand
        bound = math.sqrt(1 / 3) * (U[E4M3] + U[gdt]) * 2
        assert relative_l2_error(x.grad, xd.grad) < bound
        assert relative_l2_error(w.grad, wd.grad) < bound
        assert relative_l2_error(b.grad, bd.grad) < 1e-6              # d b is summed in float32, not quantised


def test_gradient_format_choice_is_measured():
    """E4M3 gradients under rowwise scaling are about twice as accurate as E5M2 (one more mantissa bit; the
    per-row scale covers the range), which is why fp8_rowwise uses E4M3 for gradients."""
    g = torch.Generator().manual_seed(0)
    gy = torch.randn(256, 96, generator=g) * torch.logspace(-3, 3, 256)[:, None]
    w = torch.randn(96, 64, generator=g)
    exact = gy.double() @ w.double()
    errs = {}
    for fp8 in (E4M3, E5M2):
        qg = quantize_torch(gy, fp8, "axis")
        qw = quantize_torch(w, E4M3, "axis", want_q=False, want_qt=True)
        got = fp8_ref.fp8_mm(qg.q, qg.q_scale, qw.qt, qw.qt_scale, torch.float32)
        errs[fp8] = relative_l2_error(got, exact)
    assert errs[E4M3] < 0.75 * errs[E5M2], errs


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_tensorwise"])
def test_outlier_rows_stay_finite(recipe):
    x = rows_with_outliers((40, 64), seed=2).float().requires_grad_()
    w = (torch.randn(32, 64) * 0.1).requires_grad_()
    y = fp8_linear(x, w, None, recipe, use_triton=False)
    (y * torch.randn_like(y) * 1e4).sum().backward()
    for t in (y, x.grad, w.grad):
        assert torch.isfinite(t).all()
    # the rows of ordinary size are still computed to FP8 accuracy next to the 1e4 rows (rowwise scaling)
    if recipe == "fp8_rowwise":
        normal = torch.arange(40) % 5 != 0
        want = linear_reference(x.detach(), w.detach(), None)
        assert relative_l2_error(y.detach()[normal], want[normal]) < GEMM_BOUND[E4M3]


# ---------------------------------------------------------------------------------------------------- the model


def tiny(precision, fused_linear="triton"):
    cfg = load_config("tiny").model
    cfg.hidden_dim, cfg.intermediate_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads = 64, 96, 2, 4, 2
    cfg.ops = OpsConfig.plain()
    cfg.ops.fused_linear = fused_linear
    cfg.ops.linear_precision = precision
    return cfg


def loss_and_grads(cfg, tokens, autocast=False, stats=None):
    """(loss, gradients by name) of one forward + backward; ``stats``: a dict given the model's FP8 counts."""
    model = build_model(cfg, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, loss = model(tokens, tokens.roll(-1, 1))
    loss.backward()
    if stats is not None:
        stats.update(model.numerics.fp8_stats.read())
        assert model.numerics.fp8_stats.read() == {}            # read() starts a new window
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_tensorwise"])
def test_model_fp8_kernels_match_reference_path_and_stay_near_full_precision(recipe):
    torch.manual_seed(0)
    tokens = torch.randint(0, 8192, (2, 24))
    stats, ref_stats, full_stats = {}, {}, {}
    loss, grads = loss_and_grads(tiny(recipe, "triton"), tokens, stats=stats)      # our kernels (interpreter)
    ref_loss, ref_grads = loss_and_grads(tiny(recipe, "torch"), tokens, stats=ref_stats)  # the rule in PyTorch
    full_loss, full_grads = loss_and_grads(tiny("bf16", "torch"), tokens, stats=full_stats)  # no FP8 (float32)
    assert full_stats == {}                                                # bf16 casts nothing
    # measured (CPU): loss equal to the reference path's, 5.5e-5 from float32's; gradients within 3.8e-7 of the
    # reference path's (an unquantised output gradient in the kernels' backward: 0.065), the projections' 0.048 to
    # 0.096 from float32's
    assert abs(loss - ref_loss) < 1e-6 * abs(ref_loss)
    assert abs(loss - full_loss) < 5e-3 * abs(full_loss)
    for name, grad in grads.items():
        assert torch.isfinite(grad).all()
        # the same quantisation rule; the kernels' norm / SwiGLU differ from torch's in the last bit of float32
        assert relative_l2_error(grad, ref_grads[name]) < 3e-5, name
        if name.endswith("proj.weight"):
            assert 0.01 < relative_l2_error(grad, full_grads[name]) < 0.25, name  # quantised, within FP8's error
    assert set(stats) == {f"fp8_{what}_{kind}" for what in ("saturated", "underflow")
                          for kind in ("qkv", "o", "gate_up", "down")}
    for key, value in stats.items():
        assert 0.0 <= value < 0.2, (key, value)
    assert stats["fp8_saturated_qkv"] > 0                   # each row's or tensor's largest element lands on FMAX
    assert ref_stats.keys() == stats.keys()                 # the reference path counts the same casts
    assert all(abs(ref_stats[k] - stats[k]) < 0.01 for k in stats), (ref_stats, stats)


def test_model_fp8_under_bf16_autocast():
    torch.manual_seed(1)
    tokens = torch.randint(0, 8192, (2, 16))
    loss, grads = loss_and_grads(tiny("fp8_rowwise", "triton"), tokens, autocast=True)
    full_loss, _ = loss_and_grads(tiny("bf16", "torch"), tokens, autocast=True)
    assert abs(loss - full_loss) < 5e-3 * abs(full_loss)       # measured 5.4e-5
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())


def test_config_and_refusals(monkeypatch):
    with pytest.raises(ConfigError, match="linear_precision"):
        OpsConfig(linear_precision="fp8").validate()
    OpsConfig(linear_precision="fp8_tensorwise").validate()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"compute capability >= 8.9.*A100 has 8.0"):
        fp8_ref._device_check.__wrapped__(0)
    with pytest.raises(ValueError, match="not one of"):
        fp8_ref.scaling_of("fp8_blockwise")


def test_lora_projections_are_refused():
    from zero2all.model.lora import LoRAConfig, apply_lora

    model = build_model(tiny("fp8_rowwise"), seed=0)
    apply_lora(model, LoRAConfig(rank=2))
    with pytest.raises(ValueError, match="LoRA"):
        model(torch.randint(0, 8192, (1, 8)))


def test_moe_blocks_are_refused():
    cfg = load_config("tiny-moe").model
    cfg.ops.linear_precision = "fp8_rowwise"
    model = build_model(cfg, seed=0)
    with pytest.raises(ValueError, match="MoE"):
        model(torch.randint(0, 8192, (1, 8)))


# ---------------------------------------------------------------------------------------------------- GPU


def _has_fp8_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a GPU with FP8 (compute capability >= 8.9)")
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_tensorwise"])
@pytest.mark.parametrize("M,K,N", [(2048, 2048, 2560), (1000, 200, 72)])
def test_scaled_mm_matches_emulation_on_gpu(recipe, M, K, N):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).requires_grad_()
    gy = torch.randn(M, N, device="cuda", generator=g, dtype=torch.bfloat16)
    y = fp8_linear(x, w, None, recipe, out_dtype=torch.bfloat16)
    y.backward(gy)
    xc, wc = x.detach().cpu().float().requires_grad_(), w.detach().cpu().requires_grad_()
    yc = fp8_linear(xc, wc, None, recipe, use_triton=False)
    yc.backward(gy.cpu().float())
    assert relative_l2_error(y.float().cpu(), yc) < 1e-2           # the same operands; bf16 output, accumulation
    assert relative_l2_error(x.grad.float().cpu(), xc.grad) < 1e-2
    assert relative_l2_error(w.grad.cpu(), wc.grad) < 1e-2
    exact = linear_reference(xc.detach(), wc.detach(), None)
    assert relative_l2_error(y.float().cpu(), exact) < GEMM_BOUND[E4M3]


@pytest.mark.gpu
@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a GPU with FP8 (compute capability >= 8.9)")
def test_fused_fp8_model_on_gpu_compiles_and_tracks_bf16():
    cfg = tiny("fp8_rowwise", "triton")
    cfg.ops = OpsConfig(linear_precision="fp8_rowwise")
    torch.manual_seed(0)
    tokens = torch.randint(0, 8192, (4, 64), device="cuda")
    out = {}
    for name, precision, compiled in (("bf16", "bf16", False), ("fp8", "fp8_rowwise", False),
                                      ("fp8_compiled", "fp8_rowwise", True)):
        cfg.ops.linear_precision = precision
        model = build_model(cfg, device="cuda", seed=0)
        if compiled:
            for layer in model.layers:
                layer.compile(fullgraph=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(tokens, tokens.roll(-1, 1))
        loss.backward()
        out[name] = (loss.item(), model.layers[0].mlp.down_proj.weight.grad.float().cpu())
    assert abs(out["fp8"][0] - out["bf16"][0]) < 0.01 * out["bf16"][0]
    assert abs(out["fp8_compiled"][0] - out["fp8"][0]) < 1e-3 * out["fp8"][0]
    assert relative_l2_error(out["fp8"][1], out["bf16"][1]) < 0.15
    assert relative_l2_error(out["fp8_compiled"][1], out["fp8"][1]) < 1e-2


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_tensorwise"])
def test_maxima_handed_over_by_the_backward_kernels_change_nothing(monkeypatch, recipe):
    """The norm and SwiGLU backward kernels of the FP8 blocks write the maxima of what they produce (the gradients d
    x and d gate_up, the rebuilt inputs normed' and a), and the casts of those skip their amax pass
    (``model.ops.fp8_fused_amax``, the model's ``numerics.amax_hints``): the same losses and gradients bit for bit,
    with 6 amax passes per layer in backward instead of 12 (left: the 4 W^T casts, d qkv from attention, the
    attention output) and one for the last down projection. Tensorwise casts of forward inputs take one each (4 per
    layer) without the hand-over, and with it only the attention output's (the norm and SwiGLU forward kernels write
    the maxima of normed and a)."""
    import zero2all.kernels.fp8 as fp8

    calls = []
    real = fp8._amax_kernel
    monkeypatch.setattr(fp8, "_amax_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: (lambda *a, **k: (calls.append(1), real[grid](*a, **k)))})())
    tokens = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(3))
    cfg = tiny(recipe)
    cfg.ops.fp8_weight_cache = "transposed"                 # W^T once per step (tensorwise W: its transpose)
    results = {}
    for enabled in (True, False):
        cfg.ops.fp8_fused_amax = enabled                    # model.ops.fp8_fused_amax, read by build_model
        calls.clear()
        results[enabled] = loss_and_grads(cfg, tokens), len(calls)
    (loss, grads), n_on = results[True]
    (loss_off, grads_off), n_off = results[False]
    assert torch.equal(loss, loss_off)
    assert all(torch.equal(grads[k], grads_off[k]) for k in grads)
    fwd_on, fwd_off = (1, 4) if recipe == "fp8_tensorwise" else (0, 0)
    assert (n_on, n_off) == ((6 + fwd_on) * cfg.n_layers + 1, (12 + fwd_off) * cfg.n_layers)
