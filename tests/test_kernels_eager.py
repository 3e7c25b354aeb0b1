"""The eager dispatch of the fused ops (kernels/eager.py) against their custom ops.

Both run the same bodies, so outputs and every gradient must be bit-identical, in float32 and under bf16 autocast,
with and without the per-step cache of the weights' compute-dtype copies. The cache must cast each weight once per
span, hand the gradients back in the master weights' dtype, and forget its copies when the span ends.
"""

import contextlib

import pytest
import torch

from zero2all.kernels import eager
from zero2all.kernels import fused_linear as fl
from zero2all.model import ops


def leaf(shape, g, dtype=torch.float32, scale=1.0, shift=0.0):
    return (shift + scale * torch.randn(shape, generator=g)).to(dtype).requires_grad_()


def cases(g, mode):
    """(eager function, custom-op function, inputs) for the three projections, odd sizes."""
    x_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    x, res = leaf((2, 5, 36), g, x_dtype), leaf((2, 5, 36), g)
    norm_w, w_qkv, b = leaf((36,), g, scale=0.2, shift=1.0), leaf((44, 36), g, scale=0.2), leaf((44,), g)
    gu, w_down = leaf((2, 5, 2 * 23), g, x_dtype), leaf((36, 23), g, scale=0.2)
    y, w_o, b_o = leaf((2, 5, 36), g, x_dtype), leaf((36, 36), g, scale=0.2), leaf((36,), g)
    return [
        (eager.norm_linear, fl.triton_norm_linear, (x, res, norm_w, 1e-5, True, w_qkv, b)),
        (eager.norm_linear, fl.triton_norm_linear, (x, None, norm_w, 1e-5, False, w_qkv, None)),
        (eager.swiglu_linear, fl.triton_swiglu_linear, (gu, w_down, None)),
        (eager.lean_linear, fl.lean_linear, (y, w_o, b_o)),
    ]


def run(fn, inputs, mode, upstream):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
        out = fn(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    leaves = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    grads = torch.autograd.grad(out, leaves, [u.to(o.dtype) for u, o in zip(upstream, out)])
    return out, grads


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("cached", [False, True])
def test_eager_matches_custom_ops_bit_for_bit(mode, cached):
    g = torch.Generator().manual_seed(3)
    for fn, op, inputs in cases(g, mode):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            shapes = [o.shape for o in (lambda r: r if isinstance(r, tuple) else (r,))(op(*inputs))]
        upstream = [torch.randn(s, generator=g) for s in shapes]
        want_out, want_grads = run(op, inputs, mode, upstream)
        with eager.cached_weight_casts() if cached else contextlib.nullcontext():
            got_out, got_grads = run(fn, inputs, mode, upstream)
        for a, b in zip(got_out + got_grads, want_out + want_grads):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b), f"{fn.__name__}: max difference {(a.float() - b.float()).abs().max()}"


def test_cache_casts_each_weight_once_and_forgets_it():
    g = torch.Generator().manual_seed(4)
    w = leaf((12, 20), g)
    x = leaf((3, 20), g, torch.bfloat16)
    casts = []
    real = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        if self.data_ptr() == w.data_ptr() and torch.bfloat16 in args:
            casts.append(1)
        return real(self, *args, **kwargs)

    torch.Tensor.to = counting_to
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), ops.weight_cast_cache():
            outs = [eager.lean_linear(x, w) for _ in range(3)]
            torch.autograd.grad(sum(o.float().sum() for o in outs), [w])
        assert len(casts) == 1                      # one copy for 3 forwards and 3 backwards
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (dw,) = torch.autograd.grad(eager.lean_linear(x, w).float().sum(), [w])
        assert len(casts) == 3                      # outside the span: cast in forward and again in backward
        assert dw.dtype == torch.float32            # the master weight's dtype, cache or not
        assert eager._CASTS is None
    finally:
        torch.Tensor.to = real


def test_cache_is_bypassed_for_compute_dtype_weights_fp8_and_biases():
    g = torch.Generator().manual_seed(5)
    w = leaf((8, 16), g, torch.bfloat16)
    with eager.cached_weight_casts():
        assert eager._compute_weight(w, None, torch.bfloat16, "bf16") is w
        assert eager._compute_weight(w.float(), None, torch.bfloat16, "fp8_rowwise").dtype == torch.float32
        assert eager._compute_weight(w.float(), w[0], torch.bfloat16, "bf16").dtype == torch.float32
        assert not eager._CASTS


def test_eager_rope_matches_custom_op_bit_for_bit():
    from zero2all.kernels.rope import triton_apply_rope

    g = torch.Generator().manual_seed(6)
    B, T, H, Hkv, D = 2, 7, 4, 2, 10
    qkv = leaf((B, T, (H + 2 * Hkv) * D), g)
    angles = torch.randn(T, D // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()
    results = []
    for fn in (eager.apply_rope, triton_apply_rope):
        q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)   # strided views, as in the model
        q, k = q.view(B, T, H, D), k.view(B, T, Hkv, D)
        out = fn(q, k, cos, sin)
        results.append((*out, *torch.autograd.grad(out, [qkv], [torch.ones_like(o) * 0.5 for o in out])))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cos/sin"):
        eager.apply_rope(q, k, cos[:3], sin[:3])
