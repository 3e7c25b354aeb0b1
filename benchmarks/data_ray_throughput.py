"""Throughput of `z2all clean` and `z2all prepare`, local processes vs Ray, 1 and 2 workers, on a generated corpus.

    python benchmarks/data_ray_throughput.py --mb 64 --repeats 3 --out /tmp/raybench

The corpus: English-like documents (random words from a 5,000-word vocabulary with stop words, paragraphs of
sentences; every quality rule passes), 5 % exact copies and 5 % near copies (two words changed) planted. Prints one
row per variant: MB of input text per second (min / median / max over the repeats) and per worker, and checks that
every variant wrote the same shards as the first (clean: kept documents; prepare: the token shards). The local
1-worker row also gives MB per CPU-second (the work runs in this process): the per-core figure on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import time
from pathlib import Path

STOP = ["the", "be", "to", "of", "and", "that", "have", "with", "in", "is"]


def make_corpus(path: Path, mb: float, seed: int = 0) -> int:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
             for _ in range(5000)]
    target, size, n = int(mb * 1e6), 0, 0
    docs: list[str] = []
    with open(path, "w") as f:
        while size < target:
            r = rng.random()
            if docs and r < 0.05:
                text = rng.choice(docs)
            elif docs and r < 0.10:
                words = rng.choice(docs).split(" ")
                for i in rng.sample(range(len(words)), 2):
                    words[i] = rng.choice(vocab)
                text = " ".join(words)
            else:
                paras = []
                for _ in range(rng.randint(3, 8)):
                    sents = []
                    for _ in range(4):
                        w = [rng.choice(vocab) for _ in range(rng.randint(8, 16))]
                        w[1], w[5] = rng.choice(STOP), rng.choice(STOP)
                        sents.append(" ".join(w).capitalize() + ".")
                    paras.append(" ".join(sents))
                text = "\n\n".join(paras)
                if len(docs) < 2000:
                    docs.append(text)
            line = json.dumps({"id": f"doc{n}", "text": text}) + "\n"
            f.write(line)
            size += len(line)
            n += 1
    return n


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): the CPU figure is the per-core cost where the work runs in
    this process (local, 1 worker), whatever else the machine is doing."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="/tmp/raybench")
    ap.add_argument("--skip", nargs="*", default=[], help="variants to leave out, e.g. prepare")
    ap.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.jsonl"
    if not corpus.exists():
        n = make_corpus(corpus, args.mb)
        print(f"generated {corpus}: {n:,} documents, {corpus.stat().st_size / 1e6:.1f} MB")
    mb = corpus.stat().st_size / 1e6

    try:
        import ray
    except ImportError:
        ray = None
        print("ray is not installed: local rows only")

    from zero2all.corpus.clean import CleanConfig, clean
    from zero2all.data.pretokenize import prepare
    from zero2all.tokenizer import train_tokenizer

    tok = out / "tok"
    if not tok.exists():
        train_tokenizer([str(corpus)], 4096, tok, log=lambda *a: None, max_memory_gb=2)
    rows = []
    for command in ("clean", "prepare"):
        if command in args.skip:
            continue
        ref = None
        for engine in ("local", "ray") if ray is not None else ("local",):
            for workers in args.workers:
                if engine == "ray":
                    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, configure_logging=False)
                times, cpu = [], []
                for _ in range(args.repeats):
                    dst = out / f"{command}-{engine}-{workers}"
                    shutil.rmtree(dst, ignore_errors=True)
                    if command == "clean":
                        cfg = CleanConfig(workers=workers)
                        w, c = timed(lambda: clean([str(corpus)], dst, cfg, verbose=False, ray=engine == "ray"))
                        got = sorted(p.read_bytes() for p in dst.glob("clean-*.jsonl"))
                    else:
                        w, c = timed(lambda: prepare([str(corpus)], tok, dst, workers=workers, ray=engine == "ray",
                                                     log=lambda *a: None, progress=False))
                        got = sorted(p.read_bytes() for p in dst.glob("*.bin"))
                    times.append(w)
                    cpu.append(c)
                    ref = got if ref is None else ref
                    assert got == ref, f"{command} {engine} {workers}: output differs from the first variant"
                if engine == "ray":
                    ray.shutdown()
                rates = sorted(mb / t for t in times)
                per_cpu = mb / statistics.median(cpu) if engine == "local" and workers == 1 else None
                rows.append((command, engine, workers, rates[0], statistics.median(rates), rates[-1], per_cpu))
                print(f"{command:8s} {engine:5s} workers={workers}: {rates[0]:.2f} / {statistics.median(rates):.2f} / "
                      f"{rates[-1]:.2f} MB/s (min/median/max), {statistics.median(rates) / workers:.2f} MB/s per "
                      f"worker" + (f", {per_cpu:.2f} MB per CPU-second" if per_cpu else "")
                      + f"; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\ncorpus {mb:.1f} MB, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; same output: yes")
    print("| command | engine | workers | MB/s min | median | max | median per worker | MB per CPU-second |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for c, e, w, lo, med, hi, pc in rows:
        print(f"| {c} | {e} | {w} | {lo:.2f} | {med:.2f} | {hi:.2f} | {med / w:.2f} | "
              f"{f'{pc:.2f}' if pc else '-'} |")


if __name__ == "__main__":
    main()
