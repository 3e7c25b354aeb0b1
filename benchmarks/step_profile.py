"""Where one optimizer step of the bf16 ``use_all`` row spends its GPU time, and what each bf16-path option buys.

Trains z2all-1.1b as ``z2all bench train --rows use_all`` does (random tokens, seq 2048, micro-batch 8 x 4
accumulation, fp32 master weights + bf16 autocast, fused AdamW) once per variant, in one process, timing
``--iters`` steps after ``--warmup`` (median), then profiles one step of the ``--profile`` variant and sorts every GPU
kernel into a category:

    GEMMs (cuBLAS)           against 6 N tokens FLOPs          (N: non-embedding parameters with the LM head)
    attention fwd / bwd      against the causal FLOPs          (4 B H T^2 D / 2 forward, 2.5x that backward)
    our Triton kernels       norms, SwiGLU, RoPE, cross-entropy rows (bandwidth bound)
    casts / copies, adds, other element-wise, memsets, optimizer
    idle                     the step's GPU span minus the union of its kernels' intervals

Variants (``--variants``, comma separated; ``+`` combines): ``off`` (the default path), ``grads`` / ``all``
(``model.ops.step_fusion``: weight gradients summed inside their GEMMs in float32; ``all`` also casts the weights
once per optimizer step; ``kernels/step_fusion.py``), ``ce30`` / ``ce29`` (cross-entropy chunks of 2^30 / 2^29
logits instead of 2^28), ``flash`` (SDPA flash backend first), ``res16`` (the residual stream in bf16:
``residual_in_fp32 = false``, other numerics than the preset), ``graph`` (the micro-step captured once as a CUDA
graph and replayed; only with ``off``: the step fusion changes Python-side state per call), ``graphstep`` (the
whole optimizer step, every micro-batch and AdamW, captured as one CUDA graph; with any step fusion).

    python benchmarks/step_profile.py --variants off,grads,all --profile off --out DIR
    python benchmarks/step_profile.py --row use_all_fp8_tensorwise --variants off --profile off --out DIR
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from zero2all.kernels import cross_entropy

CATEGORIES = [  # (category, substrings of the kernel name, lower case); the first match wins
    ("attention bwd", ("bprop", "flash_bwd", "attention_backward", "fmha_bwd", "_attn_bwd")),
    ("attention fwd", ("fprop", "flash_fwd", "fmha_fwd", "attention_fwd", "_attn_fwd")),
    ("optimizer (fused AdamW)", ("adam",)),
    ("GEMMs", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "sm90_", "splitk")),
    ("add+RMSNorm (Triton)", ("rmsnorm", "norm_")),
    ("SwiGLU (Triton)", ("swiglu",)),
    ("RoPE (Triton)", ("rope",)),
    ("cross-entropy rows (Triton)", ("cross_entropy",)),
    ("memset", ("memset",)),
    ("memcpy", ("memcpy",)),
    ("casts / copies", ("copy",)),
    ("adds (grad accumulation etc.)", ("add",)),
    ("reductions", ("reduce",)),
    ("multiply / fill / other element-wise", ("elementwise", "mul", "fill", "vectorized")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def set_variant(variant: str):
    """Apply a variant's process-wide switches; returns the SDPA context it runs under."""
    parts = set(variant.split("+"))
    cross_entropy.CHUNK_ELEMENTS = 2 ** 30 if "ce30" in parts else 2 ** 29 if "ce29" in parts else 2 ** 28
    if "flash" in parts:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True)
    return contextlib.nullcontext()


def build(cfg, micro_batch, seq, accum, graph=False, fusion="off", row="use_all"):
    """(model, optimizer, step); with ``graph`` the micro-step (forward + backward, accumulating into static .grad
    buffers) is captured once as a CUDA graph and replayed for every micro-batch copied into a static input."""
    from zero2all.bench import _build_ours

    if graph == "micro" and fusion != "off":
        raise ValueError("step_profile: the graph variant runs with step fusion off")
    model, loss_fn = _build_ours(cfg, row, "cuda")
    model.numerics.mark(model, fusion)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True,
                            capturable=graph == "step")
    model.numerics.attach(opt)
    g = torch.Generator(device="cpu").manual_seed(1234)
    batches = [torch.randint(0, cfg.padded_vocab_size, (micro_batch, seq + 1), generator=g).cuda()
               for _ in range(accum)]

    def step():
        for b in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(b[:, :-1], b[:, 1:])
            (loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if not graph:
        return model, opt, step
    if graph == "step":
        return model, opt, _graph_whole_step(loss_fn, opt, batches, accum)
    static = batches[0].clone()

    def micro():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = loss_fn(static[:, :-1], static[:, 1:])
        (loss / accum).backward()

    cuda_graph = _capture(micro)
    opt.zero_grad(set_to_none=False)

    def graphed_step():
        for b in batches:
            static.copy_(b)
            cuda_graph.replay()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return model, opt, graphed_step


def _capture(fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """``fn`` run ``warmup`` times on a side stream (allocations and autotuning out of the capture), then captured
    as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _graph_whole_step(loss_fn, opt, batches, accum):
    """The whole optimizer step (every micro-batch's forward and backward, AdamW with ``capturable=True``, the
    gradients zeroed in place) captured once as one CUDA graph; each step copies its micro-batches into static
    inputs and replays it. The Python-side state that changes within a step (the weight-cast caches filled by the
    first micro-batch and emptied by the optimizer step) follows the same path at every step, so the capture
    records the step exactly as eager runs it."""
    statics = [b.clone() for b in batches]

    def eager():
        for b in statics:
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                loss = loss_fn(b[:, :-1], b[:, 1:])
            (loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    cuda_graph = _capture(eager)

    def graphed_step():
        for s, b in zip(statics, batches):
            s.copy_(b)
        cuda_graph.replay()

    return graphed_step


def time_steps(step, iters, warmup):
    times = []
    for _ in range(warmup + iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return times[warmup:]


def profile_step(step, cfg, tokens, seq, out_dir: Path, wall_ms: float):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from zero2all.accounting import param_counts

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
    per_cat, per_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    spans = []
    for e in kernels:
        us = e.duration_ns() / 1e3
        per_cat[category(e.name())] += us
        per_name[e.name()] += us
        count[e.name()] += 1
        spans.append((e.start_ns(), e.start_ns() + e.duration_ns()))
    spans.sort()
    busy, cur_s, cur_e = 0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    span_ms = (spans[-1][1] - spans[0][0]) / 1e6 if spans else 0.0
    idle_ms = span_ms - busy / 1e6
    c = cfg
    n_mm = param_counts(cfg).matmul
    gemm_flops = 6 * n_mm * tokens
    attn_fwd_flops = 2 * 2 * tokens * c.n_heads * seq * c.head_dim / 2 * c.n_layers
    rate = {"GEMMs": gemm_flops, "attention fwd": attn_fwd_flops, "attention bwd": 2.5 * attn_fwd_flops}
    lines = [f"one optimizer step: wall {wall_ms:.1f} ms (timed median), profiled GPU span {span_ms:.1f} ms, "
             f"kernels busy {busy / 1e6:.1f} ms, idle inside the span {idle_ms:.1f} ms; {len(kernels)} kernels",
             f"{'category':40s} {'ms':>8s} {'share':>7s}  achieved"]
    total = sum(per_cat.values()) / 1e3
    for cat, us in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        ms = us / 1e3
        extra = f"{rate[cat] / (ms / 1e3) / 1e12:6.0f} TFLOP/s" if cat in rate and ms else ""
        lines.append(f"{cat:40s} {ms:8.1f} {100 * ms / wall_ms:6.1f}%  {extra}")
    lines.append(f"{'sum of kernels':40s} {total:8.1f} {100 * total / wall_ms:6.1f}%")
    lines.append(f"{'idle gaps (span - busy)':40s} {idle_ms:8.1f} {100 * idle_ms / wall_ms:6.1f}%")
    lines.append(f"GEMM FLOPs 6 x {n_mm:,} x {tokens:,}; attention causal fwd FLOPs {attn_fwd_flops:.3e}")
    summary = "\n".join(lines)
    top = [f"{per_name[n] / 1e3:9.2f} ms {count[n]:6d}x  {category(n):30s} {n[:150]}"
           for n in sorted(per_name, key=lambda n: -per_name[n])[:120]]
    (out_dir / "profile_categories.txt").write_text(summary + "\n\ntop kernels:\n" + "\n".join(top) + "\n")
    return summary


def main() -> None:
    from zero2all.accounting import mfu
    from zero2all.config import load_config

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="off,grads,all")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--row", default="use_all", help="the z2all bench train row of ours to build (use_all, "
                   "use_all_fp8, use_all_fp8_tensorwise, ...)")
    p.add_argument("--profile", default="", help="the variant to profile one step of (default: none)")
    p.add_argument("--out", default=".")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config("z2all-1.1b", []).model
    tokens = a.micro_batch * a.seq * a.accum
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = {}
    for variant in [v for v in a.variants.split(",") if v]:
        model = opt = step = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            with set_variant(variant):
                vcfg = dataclasses.replace(cfg, residual_in_fp32=False) if "res16" in variant.split("+") else cfg
                parts = variant.split("+")
                fusion = "all" if "all" in parts else "grads" if "grads" in parts else "off"
                model, opt, step = build(vcfg, a.micro_batch, a.seq, a.accum, graph="step" if "graphstep" in parts
                                             else "micro" if "graph" in parts else None, fusion=fusion,
                                             row=a.row)
                times = time_steps(step, a.iters, a.warmup)
                ms = statistics.median(times)
                tps = tokens / (ms / 1e3)
                peak = torch.cuda.max_memory_allocated() / 1e9
                reserved = torch.cuda.max_memory_reserved() / 1e9
                results[variant] = {"step_ms": ms, "tok_s": tps, "mfu": mfu(tps, cfg, a.seq, 989e12),
                                    "peak_gb": peak, "reserved_gb": reserved, "times": times}
                print(f"{variant:22s} step {ms:7.1f} ms  {tps:8.0f} tok/s  MFU {100 * results[variant]['mfu']:.1f} %"
                      f"  peak {peak:.1f} GB (reserved {reserved:.1f})  steps {[round(t, 1) for t in times]}",
                      flush=True)
                if variant == a.profile:
                    print(profile_step(step, cfg, tokens, a.seq, out, ms), flush=True)
        except Exception as e:
            print(f"{variant:22s} failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                  flush=True)
        del model, opt, step
        gc.collect()
        (out / "step_variants.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
