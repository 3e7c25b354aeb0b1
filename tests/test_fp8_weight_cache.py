"""The FP8 weight casts are made once per optimizer step (``fp8_ref.WEIGHT_CASTS``): reused across the
micro-batches of a step, made again after any in-place change of the weight, after an optimizer step, and for
another tensor at the same shape."""

import torch

from zero2all.kernels import fp8_ref
from zero2all.kernels.fp8_ref import E4M3, WEIGHT_CASTS, FP8Linear, quantize_torch


class CountingQuant:
    def __init__(self):
        self.calls = []

    def __call__(self, x, dtype, scaling, want_q=True, want_qt=False):
        self.calls.append((tuple(x.shape), want_q, want_qt))
        return quantize_torch(x, dtype, scaling, want_q, want_qt)


def step(x, w, quant, recipe="fp8_rowwise"):
    y = FP8Linear.apply(x, w, None, recipe, torch.float32, quant, None)
    y.square().sum().backward()
    return y.detach()


def weight_casts(quant, w):
    return [c for c in quant.calls if c[0] in (tuple(w.shape),)]


def test_weight_cast_once_per_step_and_again_after_changes():
    WEIGHT_CASTS.clear()
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(24, 40, generator=g) / 40 ** 0.5).requires_grad_()
    opt = torch.optim.SGD([w], lr=0.1)
    quant = CountingQuant()
    xs = [torch.randn(7, 40, generator=g).requires_grad_() for _ in range(3)]
    ys = [step(x, w, quant) for x in xs]                      # three micro-batches of one step
    assert weight_casts(quant, w) == [((24, 40), True, False), ((24, 40), False, True)]
    # the cached casts give the same result as fresh ones
    WEIGHT_CASTS.enabled = False
    try:
        fresh = [step(x.detach().requires_grad_(), w, quantize_torch) for x in xs]
    finally:
        WEIGHT_CASTS.enabled = True
    assert all(torch.equal(a, b) for a, b in zip(ys, fresh))
    assert WEIGHT_CASTS._entries
    opt.step()                                                # the step hook empties the cache
    assert not WEIGHT_CASTS._entries
    step(xs[0], w, quant)
    assert len(weight_casts(quant, w)) == 4
    with torch.no_grad():
        w.mul_(2.0)                                           # an in-place write bumps _version
    y = step(xs[0], w, quant)
    assert len(weight_casts(quant, w)) == 6
    want = quantize_torch(w.detach(), E4M3, "axis")
    assert torch.equal(WEIGHT_CASTS.get(w, "axis", False, quant).q, want.q)
    w2 = w.detach().clone().requires_grad_()                  # another tensor, the same shape and values
    assert torch.equal(step(xs[0], w2, quant), y)
    assert len(weight_casts(quant, w)) == 8
    WEIGHT_CASTS.clear()


def test_tensorwise_and_disabled_cache():
    WEIGHT_CASTS.clear()
    w = torch.randn(16, 32).requires_grad_()
    x = torch.randn(5, 32).requires_grad_()
    quant = CountingQuant()
    step(x, w, quant, "fp8_tensorwise")
    step(x, w, quant, "fp8_tensorwise")
    assert len(weight_casts(quant, w)) == 2
    WEIGHT_CASTS.enabled = False
    try:
        step(x, w, quant, "fp8_tensorwise")
    finally:
        WEIGHT_CASTS.enabled = True
    assert len(weight_casts(quant, w)) == 4
    fp8_ref.WEIGHT_CASTS.clear()
    assert not WEIGHT_CASTS._entries
