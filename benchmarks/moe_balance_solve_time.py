"""GPU time of the per-batch balanced selection bias (``model.moe.balance_iters``, ``model/moe.py:
balanced_bias``) at a preset's router shape, against its rounds: CUDA events around 50 calls after 5 warm-up ones.

    python benchmarks/moe_balance_solve_time.py [--tokens 8192] [--experts 16] [--top-k 2]
"""
from __future__ import annotations

import argparse

import torch

from zero2all.model import moe
from zero2all.model.moe import balanced_bias, expert_counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--iters", default="0,4,8,16")
    ap.add_argument("--methods", default="sort,topk,kthvalue", help="moe.EDGE_METHOD values to time")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    # clustered scores, as a language model's router gives: a low-rank part plus per-expert offsets
    low = torch.randn(a.tokens, 16, device="cuda", generator=g) @ torch.randn(16, a.experts, device="cuda",
                                                                               generator=g)
    scores = torch.sigmoid(0.8 * low + torch.linspace(-1, 1, a.experts, device="cuda"))
    bias = torch.zeros(a.experts, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {a.tokens} tokens x {a.experts} experts, "
          f"top-{a.top_k}")
    for method, iters in ((m, int(i)) for m in a.methods.split(",") for i in a.iters.split(",")):
        moe.EDGE_METHOD = method
        b = balanced_bias(scores, bias, a.top_k, iters)
        c = expert_counts((scores + b).topk(a.top_k, dim=-1).indices, a.experts).float()
        for _ in range(5):
            balanced_bias(scores, bias, a.top_k, iters)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            balanced_bias(scores, bias, a.top_k, iters)
        end.record()
        torch.cuda.synchronize()
        print(f"{method:8s} rounds {iters:3d}: {start.elapsed_time(end) / 50 * 1e3:8.1f} us per call, max / mean load "
              f"{(c.max() / c.mean()).item():.3f}", flush=True)


if __name__ == "__main__":
    main()
