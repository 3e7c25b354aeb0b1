"""The FP8 weight casts of a model's numerics context (``numerics.weight_casts``): W^T is cast once per optimizer
step, reused across the micro-batches of a step, made again after any in-place change of the weight, after an
optimizer step, and for another tensor at the same shape; the forward cast W is made per micro-batch (rowwise) or
transposed back from the cached W^T (tensorwise: the same codes) with ``keep_forward = False``
(``model.ops.fp8_weight_cache = "transposed"``); by default W is kept as well."""

import pytest
import torch

from zero2all.kernels.fp8_ref import E4M3, FP8Linear, quantize_torch
from zero2all.kernels.numerics import Numerics


class CountingQuant:
    def __init__(self):
        self.calls = []

    def __call__(self, x, dtype, scaling, want_q=True, want_qt=False, **kwargs):
        self.calls.append((tuple(x.shape), want_q, want_qt))
        return quantize_torch(x, dtype, scaling, want_q, want_qt, **kwargs)


def step(x, w, quant, recipe="fp8_rowwise", numerics=None):
    """One micro-batch through an FP8 linear; ``numerics`` None: no cache (every cast made afresh)."""
    y = FP8Linear.apply(x, w, None, recipe, torch.float32, quant, None, numerics)
    y.square().sum().backward()
    return y.detach()


def weight_casts(quant, w):
    return [c for c in quant.calls if c[0] in (tuple(w.shape),)]


def test_weight_cast_once_per_step_and_again_after_changes():
    nx = Numerics()                                           # model.ops.fp8_weight_cache = "transposed"
    casts = nx.weight_casts
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(24, 40, generator=g) / 40 ** 0.5).requires_grad_()
    opt = torch.optim.SGD([w], lr=0.1)
    nx.attach(opt)
    quant = CountingQuant()
    xs = [torch.randn(7, 40, generator=g).requires_grad_() for _ in range(3)]
    ys = [step(x, w, quant, numerics=nx) for x in xs]        # three micro-batches of one step
    assert weight_casts(quant, w) == [((24, 40), True, False), ((24, 40), False, True)] + \
        [((24, 40), True, False)] * 2                         # W per micro-batch, W^T once
    # the cached casts give the same result as fresh ones
    fresh = [step(x.detach().requires_grad_(), w, quantize_torch) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(ys, fresh))
    assert casts._entries
    opt.step()                                                # the hook on this optimizer empties the cache
    assert not casts._entries
    step(xs[0], w, quant, numerics=nx)
    assert len(weight_casts(quant, w)) == 6
    with torch.no_grad():
        w.mul_(2.0)                                           # an in-place write bumps _version
    y = step(xs[0], w, quant, numerics=nx)
    assert len(weight_casts(quant, w)) == 8
    want = quantize_torch(w.detach(), E4M3, "axis")
    assert torch.equal(casts.get(w, "axis", False, quant).q, want.q)
    w2 = w.detach().clone().requires_grad_()                  # another tensor, the same shape and values
    assert torch.equal(step(xs[0], w2, quant, numerics=nx), y)
    assert len(weight_casts(quant, w)) == 11                 # (the get above cast W once more)


def test_keep_forward_caches_both_casts():
    w = torch.randn(24, 40).requires_grad_()
    xs = [torch.randn(7, 40).requires_grad_() for _ in range(3)]
    quant = CountingQuant()
    transposed = Numerics()
    plain = [step(x, w, quant, numerics=transposed) for x in xs]
    both = Numerics(weight_cache="both")
    kept = [step(x, w, quant, numerics=both) for x in xs]
    assert weight_casts(quant, w)[4:] == [((24, 40), True, False), ((24, 40), False, True)]
    assert all(torch.equal(a, b) for a, b in zip(plain, kept))


def test_tensorwise_and_disabled_cache():
    nx = Numerics()
    w = torch.randn(16, 32).requires_grad_()
    x = torch.randn(5, 32).requires_grad_()
    quant = CountingQuant()
    y = step(x, w, quant, "fp8_tensorwise", nx)
    step(x, w, quant, "fp8_tensorwise", nx)
    assert weight_casts(quant, w) == [((16, 32), False, True)]      # W^T only; W is its transpose
    fwd = nx.weight_casts.get(w, "tensor", False, quant)
    want = quantize_torch(w.detach(), E4M3, "tensor")
    assert torch.equal(fwd.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(fwd.q_scale, want.q_scale)
    fresh = step(x, w, quant, "fp8_tensorwise")                     # no context: no cache
    assert len(weight_casts(quant, w)) == 3 and torch.equal(fresh, y)
    nx.clear()
    assert not nx.weight_casts._entries


def test_config_options_set_the_switches():
    from zero2all.config import ConfigError, ModelConfig, OpsConfig
    from zero2all.model.z2all import build_model

    kw = dict(vocab_size=64, hidden_dim=32, intermediate_size=48, n_layers=1, n_heads=2, n_kv_heads=1,
              max_seq_len=16)
    both = build_model(ModelConfig(**kw, ops=OpsConfig(linear_precision="fp8_rowwise", fp8_weight_cache="both",
                                                        fp8_fused_amax=True)), seed=0)
    plain = build_model(ModelConfig(**kw, ops=OpsConfig(linear_precision="fp8_rowwise")), seed=0)
    assert both.numerics.weight_casts.keep_forward and both.numerics.amax_hints.enabled
    assert not plain.numerics.weight_casts.keep_forward and not plain.numerics.amax_hints.enabled  # the defaults
    assert all(block.numerics is both.numerics for block in both.layers)
    with pytest.raises(ConfigError, match="fp8_weight_cache"):
        OpsConfig(fp8_weight_cache="none").validate()
    with pytest.raises(ValueError, match="fp8_weight_cache"):
        Numerics(weight_cache="none")
