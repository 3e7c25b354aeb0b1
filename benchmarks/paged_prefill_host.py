"""Host time of a graphed paged prefill chunk's inputs: ``PagedSession._forward_bucketed`` with the CUDA graph's
replay taken out, on CPU (tiny model, a 16-row session of 2,048 slots, the prefill buckets 32 ... 2048).

    python benchmarks/paged_prefill_host.py [--repeats 200]

Two cases of a 1,032-token prompt: the 24 tokens left after a 1,008-token prefix-cache hit (bucket 32), and all
1,032 tokens (bucket 2,048). What it times is what the host does before the graph can run: the chunk's tokens,
positions and cache slots, the row's block table, and their upload. Min / median / max over the repeats, in us.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from standin_tokenizer import tiny_model_config

    from zero2all.infer.generate import PREFILL_BUCKETS
    from zero2all.infer.paged import PagedSession
    from zero2all.model.z2all import build_model

    m = build_model(tiny_model_config(max_seq_len=2048), seed=0).eval()
    S = PagedSession(m, rows=16, max_len=2048, prefill_buckets=PREFILL_BUCKETS)

    class NoGraph:  # the replay costs the host one call; what is timed is everything before it
        def replay(self):
            pass

    for L in S.prefill_buckets:
        S.prefill_graphs[L], S._pf_out[L] = NoGraph(), torch.zeros(1, m.cfg.vocab_size)
    prompt = [3 + i % 250 for i in range(1032)]
    for first, n, L in ((1008, 24, 32), (0, 1032, 2048)):
        times = []
        for _ in range(args.repeats):
            S.start(0, prompt)
            S.rows[0].computed = first
            t0 = time.perf_counter()
            S._forward_bucketed(S.rows[0], n, L)
            times.append(1e6 * (time.perf_counter() - t0))
            S.release(0)
        print(f"{n} new tokens after {first} cached, bucket {L}: {min(times):.0f} / {statistics.median(times):.0f} / "
              f"{max(times):.0f} us (min / median / max of {args.repeats})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
