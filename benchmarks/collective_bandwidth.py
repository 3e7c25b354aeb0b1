"""Collective bandwidth between the GPUs of one host, at the message sizes tensor and sequence parallelism send.

    torchrun --standalone --nproc_per_node=2 benchmarks/collective_bandwidth.py
    NCCL_DEBUG=INFO torchrun ... 2>&1 | grep -E "via|Channel"      # which transport NCCL picked (P2P, SHM, NET)

Tensor parallelism cannot hide its communication unless the link is fast: tp2 + SP on z2all-1.1b at micro-batch 8
sends about 25 GB per rank and step (``z2all estimate --tp 2``); at bus bandwidth B the collectives alone take
25 GB / B. This script measures B for all-gather, reduce-scatter and all-reduce with CUDA events (median of
``--iters`` after ``--warmup``), reporting, as nccl-tests does,

    algbw = bytes of the full (gathered) tensor / time
    busbw = algbw x (n - 1) / n            all-gather, reduce-scatter
    busbw = algbw x 2 (n - 1) / n          all-reduce

so busbw is comparable with the link's peak whatever the number of ranks. Rank 0 prints one table.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist


def _time(fn, warmup: int, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` calls, CUDA events around each, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="8,32,64,256", help="full-tensor sizes in MiB (bf16)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for mb in (int(s) for s in args.sizes_mb.split(",")):
        numel = mb * 2**20 // 2 // n * n               # bf16 elements, divisible by the world size
        full = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        shard = torch.empty(numel // n, device="cuda", dtype=torch.bfloat16)
        nbytes = full.numel() * full.element_size()
        ops = {
            "all_gather": (lambda: dist.all_gather_into_tensor(full, shard), (n - 1) / n),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, full), (n - 1) / n),
            "all_reduce": (lambda: dist.all_reduce(full), 2 * (n - 1) / n),
        }
        for name, (fn, factor) in ops.items():
            t = _time(fn, args.warmup, args.iters)
            rows.append((name, nbytes, t, nbytes / t / 1e9, nbytes / t / 1e9 * factor))
    if rank == 0:
        print(f"{torch.cuda.get_device_name()} x {n}, torch {torch.__version__}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
        print(f"{'collective':15s} {'MiB':>6s} {'time us':>9s} {'algbw GB/s':>11s} {'busbw GB/s':>11s}")
        for name, nbytes, t, alg, bus in rows:
            print(f"{name:15s} {nbytes / 2**20:6.0f} {t * 1e6:9.1f} {alg:11.1f} {bus:11.1f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
