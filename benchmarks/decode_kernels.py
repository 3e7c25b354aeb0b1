"""The decode step's matrix-vector products in isolation: our fused kernels against cuBLAS (``F.linear``).

For every weight shape of a layer of the model (and the LM head) and each batch size, times with
``triton.testing.do_bench`` (which clears the L2 cache before every run, so weights come from HBM as in a decode
step) and reports microseconds and the weight bytes read per second:

    ours    fused_gemv with the prologue the decode step uses (norm for qkv / gate|up / LM head, SwiGLU for down)
    cuBLAS  F.linear on the already-prepared input (no prologue: the norm / SwiGLU would be one more kernel)

    python benchmarks/decode_kernels.py                  # z2all-1.1b, bf16, batch 1 and 16, on CUDA
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="z2all-1.1b")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    import triton.testing

    from zero2all.config import load_config
    from zero2all.kernels import decode as K

    cfg = load_config(args.config).model
    h, i = cfg.hidden_dim, cfg.intermediate_size
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    shapes = [("qkv (norm)", qkv, h, K.PROLOGUE_NORM), ("o", h, cfg.n_heads * cfg.head_dim, K.PROLOGUE_NONE),
              ("gate|up (norm)", 2 * i, h, K.PROLOGUE_NORM), ("down (swiglu)", h, i, K.PROLOGUE_SWIGLU),
              ("lm_head (norm)", cfg.padded_vocab_size, h, K.PROLOGUE_NORM)]
    dev, dt = "cuda", torch.bfloat16
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}; {args.config}, bf16")
    print("| weight | N x K | MB | batch | ours us | ours TB/s | cuBLAS us | cuBLAS TB/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, N, Kd, prologue in shapes:
        w = torch.randn(N, Kd, device=dev, dtype=dt) * 0.02
        mb = w.numel() * 2 / 1e6
        for M in args.batch_sizes:
            x = torch.randn(M, 2 * Kd if prologue == K.PROLOGUE_SWIGLU else Kd, device=dev, dtype=dt)
            res = torch.randn(M, Kd, device=dev)
            res_out = torch.empty_like(res)
            nw = torch.ones(Kd, device=dev, dtype=dt)
            out = torch.empty(M, N, device=dev, dtype=dt)
            kw = dict(prologue=prologue, residual=res if prologue == K.PROLOGUE_NORM else None, norm_weight=nw,
                      residual_out=res_out, eps=1e-5)
            ours = triton.testing.do_bench(lambda: K.fused_gemv(x, w, out, **kw), warmup=50, rep=200)
            x_plain = torch.randn(M, Kd, device=dev, dtype=dt)
            cublas = triton.testing.do_bench(lambda: F.linear(x_plain, w), warmup=50, rep=200)
            print(f"| {name} | {N} x {Kd} | {mb:.1f} | {M} | {ours * 1e3:.1f} | {mb / 1e6 / (ours * 1e-3):.2f} | "
                  f"{cublas * 1e3:.1f} | {mb / 1e6 / (cublas * 1e-3):.2f} |", flush=True)
    for key, c in K.tuned_configs().items():
        print(f"tuned {key}: {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
