"""Tokenizer training under a memory cap vs uncapped: peak RSS, time and compression on a large generated corpus.

    python benchmarks/tokenizer_memory.py --size-mb 1000 --cap-gb 1.0 --vocab-size 32768 [--backend hf]

The corpus (written once to ``--corpus``, a .jsonl) mixes, by bytes, ~1/3 each of
* the standard library's code, every copy perturbed: a random share of its identifiers renamed with a per-copy
  suffix and its numbers redrawn (new distinct words, as a larger code corpus would have);
* generated Chinese: words of 1-4 characters drawn Zipf-like from the 3,500 most common characters' block, with
  punctuation every few words (every CJK run is one pre-token: the memory-heaviest kind of text);
* generated English-like text: Zipf-distributed pseudo-words over a 300k-word vocabulary, digits, punctuation.

Each configuration trains in its own subprocess (so peak RSS is that run's alone) and reports: seconds, peak RSS,
MB of text fed, and bytes per token on a held-out sample: the 8 MB of documents generated right after the corpus
(same distribution, unseen documents; higher = better compression). The acceptance bar: capped compression
within 1 % of uncapped, with peak RSS under the cap.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")
_NUMBER = re.compile(r"\b\d+\b")
_ZH_PUNCT = "，。、；：？！"
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "ea")]


def _zipf_sampler(rng: random.Random, n: int, s: float = 1.1):
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    cum, total = [], 0.0
    for w in weights:
        total += w
        cum.append(total)
    import bisect

    return lambda: bisect.bisect_left(cum, rng.random() * total)


def generate_documents(size_bytes: int, seed: int):
    """Yield (kind, text) until ~size_bytes of UTF-8 text."""
    from zero2all.corpus.readers import iter_texts

    rng = random.Random(seed)
    code = list(iter_texts("stdlib"))
    zh_chars = [chr(0x4E00 + i) for i in range(3500)]
    zh_words = ["".join(rng.choice(zh_chars) for _ in range(rng.choice((1, 2, 2, 2, 3, 4)))) for _ in range(60000)]
    en_words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))) for _ in range(300000)]
    zh_pick, en_pick = _zipf_sampler(rng, len(zh_words)), _zipf_sampler(rng, len(en_words))
    produced, copy = 0, 0
    while produced < size_bytes:
        kind = ("code", "zh", "en")[copy % 3]
        copy += 1
        if kind == "code":
            src = code[rng.randrange(len(code))]
            suffix = f"_{rng.randrange(16**4):04x}"
            renamed = {}

            def rename(m):
                w = m.group(0)
                if w not in renamed:
                    renamed[w] = w + suffix if rng.random() < 0.3 else w
                return renamed[w]

            text = _NUMBER.sub(lambda m: str(rng.randrange(10 ** len(m.group(0)))), _IDENT.sub(rename, src))
        elif kind == "zh":
            parts = []
            for _ in range(rng.randrange(200, 2000)):
                parts.append("".join(zh_words[zh_pick()] for _ in range(rng.randrange(1, 6))))
                parts.append(rng.choice(_ZH_PUNCT))
                if rng.random() < 0.05:
                    parts.append("\n")
            text = "".join(parts)
        else:
            sents = []
            for _ in range(rng.randrange(50, 500)):
                words = [en_words[en_pick()] for _ in range(rng.randrange(4, 20))]
                if rng.random() < 0.2:
                    words.insert(rng.randrange(len(words)), str(rng.randrange(100000)))
                sents.append(" ".join(words).capitalize() + rng.choice((".", ".", "?", "!", ",")))
            text = " ".join(sents) + "\n"
        produced += len(text.encode("utf-8"))
        yield kind, text


def write_corpus(path: str, size_mb: float, seed: int, heldout_mb: float = 0.0) -> None:
    """Write ~size_mb of documents to ``path``; with ``heldout_mb``, the documents that follow them in the same
    generated stream (same vocabularies, unseen documents) go to ``path + ".heldout.jsonl"``."""
    from zero2all.corpus.readers import write_jsonl

    stream = generate_documents(int((size_mb + heldout_mb) * 1e6), seed)
    state = {"bytes": 0}

    def take(limit):
        for i, (kind, text) in enumerate(stream):
            yield {"id": str(i), "category": kind, "content": text}
            state["bytes"] += len(text.encode("utf-8"))
            if state["bytes"] >= limit:
                return

    n = write_jsonl(take(size_mb * 1e6), path)
    print(f"wrote {path}: {n:,} documents, {os.path.getsize(path) / 1e6:,.0f} MB", flush=True)
    if heldout_mb:
        n = write_jsonl(take((size_mb + heldout_mb) * 1e6), path + ".heldout.jsonl")
        print(f"wrote {path}.heldout.jsonl: {n:,} documents", flush=True)


def run_one(args) -> dict:
    """Child process: train one configuration and measure it."""
    from zero2all.tokenizer.train import peak_rss_mb, train_tokenizer

    cap = args.cap_gb[0] if isinstance(args.cap_gb, list) else args.cap_gb
    t0 = time.time()
    tok = train_tokenizer([args.corpus], args.vocab_size, None, backend=args.backend,
                          max_memory_gb=cap or None, log=lambda *a: None)
    seconds = time.time() - t0
    rss = peak_rss_mb()
    nbytes = ntok = 0
    from zero2all.corpus.readers import iter_texts

    for text in iter_texts(args.corpus + ".heldout.jsonl"):
        nbytes += len(text.encode("utf-8"))
        ntok += len(tok.encode(text))
    t = tok.meta["training"]
    return {"cap_gb": cap, "seconds": round(seconds, 1), "peak_rss_mb": round(rss, 0),
            "fed_mb": round(t["fed_bytes"] / 1e6, 1),
            "corpus_mb": round((t["corpus_bytes"] or t["fed_bytes"]) / 1e6, 1),
            "sampling_rate": t["sampling_rate"], "vocab": tok.vocab_size,
            "heldout_bytes_per_token": round(nbytes / ntok, 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="/tmp/z2all_tok_bench.jsonl")
    ap.add_argument("--size-mb", type=float, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--backend", default="hf", choices=["hf", "spm"])
    ap.add_argument("--cap-gb", type=float, nargs="+", default=[1.0], help="capped runs (0 = uncapped is always run)")
    ap.add_argument("--no-uncapped", action="store_true",
                    help="skip the uncapped run (a corpus whose uncapped training does not fit in RAM)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(args)))
        return
    if not os.path.exists(args.corpus + ".heldout.jsonl"):
        write_corpus(args.corpus, args.size_mb, args.seed, heldout_mb=8)
    rows = []
    for cap in ([] if args.no_uncapped else [0.0]) + list(args.cap_gb):
        cmd = [sys.executable, __file__, "--child", "--corpus", args.corpus, "--vocab-size", str(args.vocab_size),
               "--backend", args.backend, "--cap-gb", str(cap)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["heldout_bytes_per_token"]  # the uncapped run, else the first capped one
    print(f"\nmachine: {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, "
          f"load {os.getloadavg()[0]:.1f}; backend {args.backend}, vocab {args.vocab_size}")
    print(f"{'cap':>8} {'fed MB':>8} {'rate':>6} {'time s':>7} {'peak RSS MB':>12} {'bytes/token':>12} "
          f"{'vs first row':>12}")
    for r in rows:
        cap = f"{r['cap_gb']:.2f} GB" if r["cap_gb"] else "none"
        print(f"{cap:>8} {r['fed_mb']:>8.0f} {r['sampling_rate']:>6.3f} {r['seconds']:>7.1f} {r['peak_rss_mb']:>12.0f} "
              f"{r['heldout_bytes_per_token']:>12.4f} {100 * (r['heldout_bytes_per_token'] / base - 1):>+11.2f}%")


if __name__ == "__main__":
    main()
