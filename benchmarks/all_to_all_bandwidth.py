"""All-to-all time between the GPUs of one host, at the sizes expert parallelism exchanges.

    torchrun --standalone --nproc_per_node=2 benchmarks/all_to_all_bandwidth.py --tokens 32768 --top-k 2 --hidden 1024

An ep rank's MoE layer sends its N k expert-sorted rows (N tokens of the micro-batch, k experts per token, H bf16
values per row) to the ranks holding the experts, 1/ep of them to itself, and gets as many back: the dispatch, the
combine, and both again in the backward (``distributed/ep.py``). This script times ``all_to_all_single`` of N k
rows with equal splits (balanced routing) with CUDA events (median of ``--iters`` after ``--warmup``) and reports

    sent    = N k H x 2 bytes x (ep - 1) / ep           bytes each rank sends to the other ranks
    GB/s    = sent / time                                per rank and direction

Multiplied by the exchanges per step (4 per MoE layer and micro-batch) it is the all-to-all time of a training
step when nothing else runs, to set against ``z2all estimate --ep`` (bytes) and the step's profile (time).
Rank 0 prints one table.
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
    p.add_argument("--tokens", default="8192,16384,32768", help="tokens per micro-batch (comma-separated)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    n, rank = dist.get_world_size(), dist.get_rank()
    rows_out = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows = tokens * args.top_k // n * n
        x = torch.randn(rows, args.hidden, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        splits = [rows // n] * n
        t = _time(lambda: dist.all_to_all_single(y, x, splits, splits), args.warmup, args.iters)
        sent = rows * args.hidden * x.element_size() * (n - 1) / n
        rows_out.append((tokens, rows, sent, t))
    if rank == 0:
        print(f"{torch.cuda.get_device_name()} x {n}, torch {torch.__version__}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}, NCCL_PROTO={os.environ.get('NCCL_PROTO', '')}")
        print(f"{'tokens':>7s} {'rows':>7s} {'sent MiB':>9s} {'time us':>9s} {'GB/s':>7s}")
        for tokens, rows, sent, t in rows_out:
            print(f"{tokens:7d} {rows:7d} {sent / 2**20:9.1f} {t * 1e6:9.1f} {sent / t / 1e9:7.1f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
