"""Time every attention backend at the training shape: forward, backward, and forward + backward.

z2all-1.1b's attention (micro-batch 8, seq 2048, 32 query heads of 64, 4 key/value heads, causal, bf16) through
``scaled_dot_product_attention`` with each backend forced (cuDNN, flash, memory-efficient; grouped-query attention
native through ``enable_gqa`` or with K/V repeated to 32 heads), plus FlexAttention (compiled) and whatever the
model's own path picks (``ops.attention``, our layouts: q and k from RoPE, v a strided view of the fused qkv
output). Each case is timed with CUDA events over ``--reps`` calls after warm-up; the median is reported with the
achieved rate on the causal FLOPs:

    forward FLOPs = 2 * 2 * B * H * T^2 * D / 2          (QK^T and PV, half the tiles under the causal mask)
    backward      = 2.5 x forward                          (dV, dP, dS->dQ, dK; QK^T recomputed)

    python benchmarks/attention_backends.py [--batch 8] [--seq 2048] [--heads 32] [--kv-heads 4] [--reps 20]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls (CUDA events, after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_inputs(B, H, Hkv, T, D, layout: str):
    """q (B, H, T, D), k/v (B, Hkv, T, D) requiring grad. ``layout``: ``bhtd`` contiguous, or ``ours`` -- q and k
    (B, T, heads, D) tensors seen transposed (as RoPE writes them), v a strided view of a packed qkv buffer."""
    dev, dt = "cuda", torch.bfloat16
    if layout == "bhtd":
        q = torch.randn(B, H, T, D, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(B, Hkv, T, D, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(B, Hkv, T, D, device=dev, dtype=dt, requires_grad=True)
        return (q, k, v), (q, k, v)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, device=dev, dtype=dt)
    q = qkv[..., :H * D].reshape(B, T, H, D).clone().requires_grad_()
    k = qkv[..., H * D:(H + Hkv) * D].reshape(B, T, Hkv, D).clone().requires_grad_()
    vbuf = qkv.clone().requires_grad_()
    v = vbuf[..., (H + Hkv) * D:].view(B, T, Hkv, D)
    return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), (q, k, vbuf)


def case(name, attn, B, H, Hkv, T, D, layout, reps):
    (q, k, v), leaves = make_inputs(B, H, Hkv, T, D, layout)
    fwd_flops = 2 * 2 * B * H * T * T * D / 2
    try:
        out = attn(q, k, v)
        grad = torch.randn_like(out)
        t_f = timed(lambda: attn(q, k, v), reps)

        def fwd_bwd():
            for t in leaves:
                t.grad = None
            attn(q, k, v).backward(grad)

        t_fb = timed(fwd_bwd, reps)
    except Exception as e:  # a backend that refuses the inputs is reported, not fatal
        return f"{name:44s} {layout:5s} not available: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    t_b = t_fb - t_f
    return (f"{name:44s} {layout:5s} fwd {t_f:6.3f} ms ({fwd_flops / t_f / 1e9:5.0f} TF/s)  "
            f"bwd {t_b:6.3f} ms ({2.5 * fwd_flops / t_b / 1e9:5.0f} TF/s)  "
            f"fwd+bwd {t_fb:6.3f} ms ({3.5 * fwd_flops / t_fb / 1e9:5.0f} TF/s)")


def sdpa(backend, gqa: bool):
    def fn(q, k, v):
        with sdpa_kernel([backend]):
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            g = q.size(1) // k.size(1)
            return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                                  is_causal=True)
    return fn


def ours(q, k, v):
    from zero2all.model import ops

    return ops.attention(q, k, v, impl="sdpa")


def chosen_backend(B, H, Hkv, T, D) -> str:
    """The backend SDPA's dispatcher picks for our call (``torch._fused_sdp_choice``)."""
    (q, k, v), _ = make_inputs(B, H, Hkv, T, D, "ours")
    try:
        idx = torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)
        return SDPBackend(idx).name
    except Exception as e:
        return f"unknown ({type(e).__name__})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--flex", action="store_true", help="also FlexAttention (compiles: tens of seconds)")
    a = p.parse_args()
    shape = (a.batch, a.heads, a.kv_heads, a.seq, a.head_dim)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; B{a.batch} H{a.heads}/{a.kv_heads} "
          f"T{a.seq} D{a.head_dim} causal bf16; SDPA picks {chosen_backend(*shape)} for our call", flush=True)
    cases = [("ours (ops.attention, sdpa)", ours, "ours")]
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            for layout in ("ours", "bhtd"):
                cases.append((f"{backend.name} {'native GQA' if gqa else 'K/V repeated'}", sdpa(backend, gqa),
                              layout))
    for name, fn, layout in cases:
        print(case(name, fn, *shape, layout, a.reps), flush=True)
    if a.flex:
        from zero2all.kernels.attention import flex_causal_attention

        for layout in ("ours", "bhtd"):
            print(case("FlexAttention (compiled)", flex_causal_attention, *shape, layout, a.reps), flush=True)


if __name__ == "__main__":
    main()
