"""`prepare` throughput vs a plain single-process `tokenizers` loop over the same corpus.

    python benchmarks/pretokenize.py --size-mb 24 --repeats 2

Corpus: the generated mixed corpus of benchmarks/tokenizer_memory.py (perturbed stdlib code, Chinese, English),
``--size-mb`` of text as .jsonl. Tokenizer: byte-level BPE, ``--vocab-size`` tokens, trained on the first 8 MB.
Variants, each writing uint16 token files of the whole corpus:

* ``plain loop``: one process reads the records and calls ``Tokenizer.encode(text).ids`` per document, appending
  to a list, then writes it (what a first script does);
* ``encode_batch``: the same with `tokenizers`' own Rust thread pool (``encode_batch`` on 256-document batches);
* ``prepare, N workers``: ``zero2all.data.pretokenize.prepare`` with N processes (split, index, meta, shards).

The variants run round-robin ``--repeats`` times; the fastest run of each counts (other processes on the machine
only ever slow a run down). CPU seconds (this process and its workers) are shown too: they barely depend on load.
Speedups are against the plain loop of the same invocation. All variants must produce the same number of tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def plain_loop(corpus: str, tok_dir: str, out: str) -> int:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import numpy as np
    from tokenizers import Tokenizer

    from zero2all.corpus.readers import iter_texts

    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for text in iter_texts(corpus):
        ids.extend(tok.encode(text, add_special_tokens=False).ids)
        ids.append(eos)
    np.array(ids, dtype=np.uint16).tofile(out)
    return len(ids)


def batch_loop(corpus: str, tok_dir: str, out: str) -> int:
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    import numpy as np
    from tokenizers import Tokenizer

    from zero2all.corpus.readers import iter_texts

    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    batch: list[str] = []

    def flush():
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos)
        batch.clear()

    for text in iter_texts(corpus):
        batch.append(text)
        if len(batch) == 256:
            flush()
    flush()
    np.array(ids, dtype=np.uint16).tofile(out)
    return len(ids)


def run_prepare(corpus: str, tok_dir: str, out: str, workers: int) -> int:
    from zero2all.data.pretokenize import prepare

    shutil.rmtree(out, ignore_errors=True)
    meta = prepare(corpus, tok_dir, out, workers=workers, valid_fraction=0.0, progress=False, log=lambda *a: None)
    return meta["splits"]["train"]["tokens"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=24)
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="default: 1 .. all cores")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    from benchmarks.tokenizer_memory import write_corpus
    from zero2all.tokenizer.train import train_tokenizer

    work = args.workdir or tempfile.mkdtemp(prefix="z2all_pretok_bench_")
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, f"corpus_{args.size_mb:g}mb.jsonl")
    if not os.path.exists(corpus):
        write_corpus(corpus, args.size_mb, seed=0)
    tok_dir = os.path.join(work, f"tok_{args.vocab_size}")
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        sample = os.path.join(work, "sample.jsonl")
        write_corpus(sample, 8, seed=1)
        train_tokenizer(sample, args.vocab_size, tok_dir, log=lambda *a: None)
    from zero2all.corpus.readers import ReadStats, iter_records

    stats = ReadStats()
    for _ in iter_records(corpus, stats=stats):
        pass
    text_mb = stats.bytes / 1e6
    cores = os.cpu_count() or 1
    variants = [("plain loop (1 process)", lambda: plain_loop(corpus, tok_dir, os.path.join(work, "plain.bin"))),
                (f"encode_batch ({cores} threads)", lambda: batch_loop(corpus, tok_dir, os.path.join(work, "b.bin")))]
    for w in args.workers or range(1, cores + 1):
        variants.append((f"prepare, {w} worker{'s' if w > 1 else ''}",
                         lambda w=w: run_prepare(corpus, tok_dir, os.path.join(work, f"prep{w}"), w)))
    # round-robin: each repeat runs every variant once, so a burst of load elsewhere hits all of them alike
    walls: dict = {name: [] for name, _ in variants}
    cpus: dict = {name: [] for name, _ in variants}
    tokens: dict = {}
    for r in range(args.repeats):
        for name, fn in variants:
            c0 = _cpu_seconds()
            t0 = time.perf_counter()
            tokens[name] = fn()
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(_cpu_seconds() - c0)
            print(f"repeat {r}: {name:28s} {walls[name][-1]:7.2f} s wall, {cpus[name][-1]:7.2f} s CPU", flush=True)
    counts = set(tokens.values())
    assert len(counts) == 1, f"variants disagree on the token count: {tokens}"
    base = min(walls[variants[0][0]])
    print(f"\ncorpus {text_mb:.1f} MB of text ({stats.records:,} docs, {counts.pop():,} tokens), vocab "
          f"{args.vocab_size}; {platform.node()}, {cores} cores, python {platform.python_version()}, load average "
          f"{os.getloadavg()[0]:.1f}; fastest of {args.repeats} round-robin repeats")
    print("| variant | seconds (wall) | CPU seconds | MB/s | M tokens/s | speedup vs plain loop |")
    print("|---|---|---|---|---|---|")
    for name, _ in variants:
        t = min(walls[name])
        print(f"| {name} | {t:.2f} | {min(cpus[name]):.2f} | {text_mb / t:.2f} | {tokens[name] / t / 1e6:.3f} | "
              f"{base / t:.2f}x |")


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the prepare workers)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

if __name__ == "__main__":
    main()
