"""Delayed scaling (``model.ops.fp8_amax_history``, ``fp8_ref.AmaxHistory``): a tensorwise cast takes its scale
from the largest amax recorded by the previous casts at its site and records its own in the same pass.

Checked: the Triton cast against the PyTorch reference over a sequence of casts (codes, scales, counts and the
recorded maxima bit for bit, odd shapes, both formats, with and without the transposed copy, reading without
recording); the rule itself against maxima computed here; growth beyond the recorded range saturates, is
counted and stays finite; in a model, two sites per linear found again through the custom ops and autograd's
saved tensors, no amax pass left after the first micro-batch, values near dynamic scaling; the config refusals.
Runs on CPU under TRITON_INTERPRET=1.
"""

import pytest
import torch
from test_kernels_fp8 import assert_same

from zero2all.config import ConfigError, OpsConfig
from zero2all.kernels import fp8_ref
from zero2all.kernels.fp8 import quantize
from zero2all.kernels.fp8_ref import E4M3, E5M2, AmaxSite, quantize_torch
from zero2all.kernels.numerics import Numerics


def operands(shape, dtype, n, seed):
    """n operands of one shape whose ranges drift up and down (a 30x jump at the fourth)."""
    g = torch.Generator().manual_seed(seed)
    scales = [1.0, 0.5, 2.0, 60.0, 0.2, 1.0, 3.0][:n]
    out = []
    for s in scales:
        x = torch.randn(shape, generator=g) * s
        x[0, : shape[1] // 3] *= 1e-7                    # tiny values next to normal ones (underflow)
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("shape,dtype", [((7, 33), torch.bfloat16), ((65, 130), torch.float32),
                                         ((3, 300), torch.bfloat16)])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("want_q,want_qt", [(True, False), (True, True), (False, True)])
def test_kernel_matches_reference_over_a_sequence_of_casts(shape, dtype, fp8, want_q, want_qt):
    mine, ref = AmaxSite(None, 3, torch.device("cpu")), AmaxSite(None, 3, torch.device("cpu"))
    for i, x in enumerate(operands(shape, dtype, 7, seed=shape[0] + shape[1])):
        observe = i != 5                                 # one cast that only reads the site (as backward's x^T)
        got = quantize(x, fp8, "tensor", want_q, want_qt, history=mine, observe=observe)
        want = quantize_torch(x, fp8, "tensor", want_q, want_qt, history=ref, observe=observe)
        for name in ("q", "q_scale", "qt", "qt_scale"):
            assert_same(getattr(got, name), getattr(want, name), f"cast {i}: {name}")
        assert torch.equal(got.counts, want.counts), (i, got.counts, want.counts)
        assert torch.equal(mine.buf, ref.buf) and mine.n == ref.n, (i, mine.buf, ref.buf)
    assert mine.n == 6


def test_the_rule_scale_from_the_previous_maxima():
    length = 4
    site = AmaxSite(None, length, torch.device("cpu"))
    xs = operands((9, 70), torch.float32, 7, seed=1)
    seen = []
    fmax = torch.finfo(E4M3).max
    for i, x in enumerate(xs):
        got = quantize(x, E4M3, "tensor", True, False, history=site)
        own = x.abs().max().item()
        used = own if not seen else max(seen[-(length - 1):])   # the first cast: its own amax
        assert got.q_scale.item() == pytest.approx(used / fmax, rel=1e-6), i
        seen.append(own)
        assert site.buf.max().item() == pytest.approx(max(seen[-length:]), rel=1e-6)
        # the codes: x scaled by fmax / used, clamped, rounded (the reference with that amax)
        want = fp8_ref._cast_torch(x.float(), torch.tensor(used), E4M3)[0]
        assert torch.equal(got.q.float(), want.float()), i


def test_growth_beyond_the_recorded_range_saturates_and_is_counted():
    site = AmaxSite(None, 4, torch.device("cpu"))
    x = torch.randn(33, 65, generator=torch.Generator().manual_seed(0))
    quantize(x, E5M2, "tensor", True, True, history=site)
    big = x * 1e4
    got = quantize(big, E5M2, "tensor", True, True, history=site)
    fmax = torch.finfo(E5M2).max
    over = (big.abs() > x.abs().max() * (1 + 1e-6)).sum().item()
    assert torch.isfinite(got.q.float()).all() and torch.isfinite(got.qt.float()).all()
    assert got.q.float().abs().max().item() == fmax
    assert got.counts[0].item() >= 2 * over > 0           # saturated in q and in q^T
    again = quantize(big, E5M2, "tensor", True, False, history=site)      # now recorded: no saturation beyond
    assert again.counts[0].item() <= 2                      # the amax itself lands on FMAX


def tiny(history, fused_linear="triton"):
    from zero2all.config import load_config

    cfg = load_config("tiny").model
    cfg.hidden_dim, cfg.intermediate_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads = 64, 96, 2, 4, 2
    cfg.ops = OpsConfig.plain()
    cfg.ops.fused_linear = fused_linear
    cfg.ops.linear_precision = "fp8_tensorwise"
    cfg.ops.fp8_amax_history = history
    return cfg


@pytest.mark.parametrize("fused_linear", ["triton", "torch"])
def test_model_sites_found_again_and_no_amax_pass_after_the_first_micro_batch(monkeypatch, fused_linear):
    import zero2all.kernels.fp8 as fp8
    from zero2all.model.z2all import build_model

    calls = []
    real = fp8._amax_kernel
    monkeypatch.setattr(fp8, "_amax_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: (lambda *a, **k: (calls.append(1), real[grid](*a, **k)))})())
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 8192, (2, 24), generator=gen) for _ in range(3)]
    losses = {}
    for history in (0, 4):
        model = build_model(tiny(history, fused_linear), seed=0)
        per_batch = []
        for tokens in batches:                              # three micro-batches of one optimizer step
            calls.clear()
            _, loss = model(tokens, tokens.roll(-1, 1))
            loss.backward()
            per_batch.append((loss.item(), len(calls)))
        losses[history] = per_batch
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert all(torch.isfinite(g).all() for g in grads)
        sites = model.numerics.amax_history._sites
        assert model.numerics.amax_history.length == history
        if history:
            n_linears = 4 * model.cfg.n_layers
            assert len(sites) == 2 * n_linears              # (weight, "x") and (weight, "g") per linear
            assert sorted({s.n for s in sites.values()}) == [3]    # recorded once per micro-batch each
        else:
            assert not sites
    if fused_linear == "triton":
        # dynamic: an amax pass per cast; delayed: only in the first micro-batch (no site has a record yet, and
        # the W^T casts, made once per step); none after
        assert all(n > 0 for _, n in losses[0])
        assert losses[4][0][1] > 0 and [n for _, n in losses[4][1:]] == [0, 0]
    first_dyn, first_delayed = losses[0][0][0], losses[4][0][0]
    assert first_delayed == first_dyn                       # the first casts scale from their own amax
    for (dyn, _), (delayed, _) in zip(losses[0][1:], losses[4][1:]):
        assert abs(dyn - delayed) < 3e-3 * abs(dyn)         # measured 4.3e-5 .. 6.5e-5


def test_config_refusals():
    OpsConfig(linear_precision="fp8_tensorwise", fp8_amax_history=16).validate()
    for n in (1, 1025, -2, True, 2.0):
        with pytest.raises(ConfigError, match="fp8_amax_history"):
            OpsConfig(linear_precision="fp8_tensorwise", fp8_amax_history=n).validate()
    for precision in ("fp8_rowwise", "bf16"):
        with pytest.raises(ConfigError, match="fp8_tensorwise"):
            OpsConfig(linear_precision=precision, fp8_amax_history=16).validate()
    with pytest.raises(ConfigError, match="fp8_fused_amax"):
        OpsConfig(linear_precision="fp8_tensorwise", fp8_amax_history=16, fp8_fused_amax=True).validate()
    with pytest.raises(ValueError, match="fp8_amax_history"):
        Numerics(amax_history=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gpu_kernel_matches_reference_over_a_sequence_of_casts(fp8):
    """On the GPU (hardware rounding, many programs adding to the recorded amax at once): the same codes, scales,
    counts and recorded maxima as the reference, and a delayed cast never waits for the device."""
    dev = torch.device("cuda")
    mine, ref = AmaxSite(None, 16, dev), AmaxSite(None, 16, dev)
    for i, x in enumerate(operands((4099, 2560), torch.bfloat16, 7, seed=11)):
        x = x.to(dev)
        torch.cuda.set_sync_debug_mode("error" if i else "default")    # no host-device synchronisation
        try:
            got = quantize(x, fp8, "tensor", True, True, history=mine, observe=i != 5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = quantize_torch(x, fp8, "tensor", True, True, history=ref, observe=i != 5)
        for name in ("q", "q_scale", "qt", "qt_scale"):
            assert_same(getattr(got, name), getattr(want, name), f"cast {i}: {name}")
        assert torch.equal(got.counts, want.counts), (i, got.counts, want.counts)
        assert torch.equal(mine.buf, ref.buf), (i, mine.buf, ref.buf)
