"""Where a paged prefill's time goes, on the device side: one row's prompt through ``PagedSession``, without the
server or the scheduler around it.

    python benchmarks/ttft_profile.py [--config z2all-1.1b] [--prefix 1000] [--new 32] [--repeats 5] [--profile]

Per case (prefix-cache hit or not, prefill graphs or eager): the host time of ``prefill_step`` (until it returns),
the time until the GPU has finished it (a synchronize), then the same two for the first decode step after it.
Times are min / median / max over ``--repeats`` runs after one warm-up. ``--profile``: the CUDA kernels of one
prefill + decode of each graphed case, by total time (torch.profiler).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, sync: bool) -> tuple[float, float]:
    """(host ms until fn returns, ms until the device is done), from the same start."""
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    if sync:
        torch.cuda.synchronize()
    return 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t0)


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="z2all-1.1b")
    ap.add_argument("--prefix", type=int, default=1000, help="shared prompt tokens (the cached part on a hit)")
    ap.add_argument("--new", type=int, default=32, help="distinct prompt tokens after the prefix")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)

    from zero2all.config import load_config
    from zero2all.infer.generate import PREFILL_BUCKETS
    from zero2all.infer.paged import PagedSession
    from zero2all.model.z2all import build_model

    on_cuda = torch.cuda.is_available()
    device = "cuda" if on_cuda else "cpu"
    cfg = load_config(args.config).model
    model = build_model(cfg, device=device, seed=0).to(torch.bfloat16 if on_cuda else torch.float32).eval()
    print(f"ttft_profile: {args.config} on {torch.cuda.get_device_name(0) if on_cuda else 'cpu'}, torch "
          f"{torch.__version__}; prompt {args.prefix} shared + {args.new} new tokens, {args.rows} rows", flush=True)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, cfg.vocab_size, (args.prefix,), generator=g).tolist()

    def prompt(key: int) -> list[int]:
        return shared + torch.randint(0, cfg.vocab_size, (args.new,), generator=g).tolist()

    print("| case | prefill host ms | prefill done ms | first decode host ms | first decode done ms | cached |")
    print("|---|---|---|---|---|---|")
    for graphs in (False, True):
        t0 = time.perf_counter()
        S = PagedSession(model, args.rows, cfg.max_seq_len, cuda_graph=on_cuda,
                         prefill_buckets=PREFILL_BUCKETS if graphs else ())
        setup = time.perf_counter() - t0
        for caching in (False, True):
            S.pool.prefix_caching = caching
            rows = {k: [] for k in ("ph", "pd", "dh", "dd")}
            cached = 0
            for i in range(args.repeats + 1):
                cached = S.start(0, prompt(i), cfg.max_seq_len)
                ph, pd = timed(lambda: S.prefill_step([0], [4096]), on_cuda)
                tokens = torch.zeros(args.rows, dtype=torch.long, device=device)
                dh, dd = timed(lambda: S.decode(tokens), on_cuda)
                S.release(0)
                if i:
                    for k, v in zip(rows, (ph, pd, dh, dd)):
                        rows[k].append(v)
            name = f"{'graphs' if graphs else 'eager'}, {'hit' if cached else 'no hit'}"
            print(f"| {name} | {spread(rows['ph'])} | {spread(rows['pd'])} | {spread(rows['dh'])} | "
                  f"{spread(rows['dd'])} | {cached} |", flush=True)
            if args.profile and on_cuda:
                S.start(0, prompt(99), cfg.max_seq_len)
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                        torch.profiler.ProfilerActivity.CPU]) as prof:
                    S.prefill_step([0], [4096])
                    S.decode(torch.zeros(args.rows, dtype=torch.long, device=device))
                    torch.cuda.synchronize()
                S.release(0)
                print(f"-- {name}: kernels by CUDA time (set up {setup:.1f} s)")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
