"""Throughput, memory and agreement of ``z2all clean`` against datatrove's and datasketch's MinHash dedup.

Generates mixed text on the fly (the standard library's code, synthetic English and Chinese documents, perturbed
copies as near duplicates, exact copies, a few low-quality pages) as jsonl, then runs, each in its own process
(peak RSS = that process and its workers):

* ours, full pipeline (normalise, rules, PII, exact + near dedup, write), at ``--mb`` and half of it;
* ours, near dedup alone (every rule, PII and exact dedup off), on the ``--compare-mb`` subset, 1 worker, with
  candidate verification on (the default) and off (``verify = false``: every LSH candidate removed, as the peers do);
* datatrove's full pipeline on the same subset: JsonlReader -> Gopher quality, Gopher repetition, C4 quality filters
  (English documents; parameters set to our defaults) -> PII formatter (email + IP) -> JsonlWriter + MinHash
  signatures, then buckets, cluster, filter -> JsonlWriter, 1 task at a time;
* datatrove's 4-stage MinHash pipeline (signatures, buckets, cluster, filter), 1 task at a time, same subset,
  same bands x rows and 5-gram shingles over the same tokens;
* datasketch's MinHashLSH (``update_batch`` per document, query-then-insert in input order), same subset,
  same permutations and bands x rows.

Agreement: the sets of documents each tool removes as near duplicates, compared with each other and with the
planted near duplicates (recall) and planted dissimilar documents (false removals).

    python benchmarks/clean_throughput.py --mb 500 --compare-mb 50 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STOP = np.array(["the", "be", "to", "of", "and", "that", "have", "with"])
TOKEN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]|[^\W_\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")


def _vocab(rng, n=20000):
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return np.array(["".join(rng.choice(letters, rng.integers(3, 10))) for _ in range(n)])


def english(rng, vocab, n_words):
    toks = vocab[rng.integers(0, len(vocab), n_words)].astype(object)
    toks[1::6] = STOP[rng.integers(0, 8, len(toks[1::6]))]
    toks[11::12] = [t + "." for t in toks[11::12]]
    toks[-1] = toks[-1].rstrip(".") + "."
    paras = [" ".join(toks[i:i + 48]) for i in range(0, n_words, 48)]
    return "\n\n".join(p[0].upper() + p[1:] for p in paras)


def chinese(rng, cjk, n_chars):
    chars = cjk[rng.integers(0, len(cjk), n_chars)].astype(object)
    chars[19::20] = "。"
    return "".join(chars)


def perturb(text, frac, rng, vocab):
    words = text.split(" ")
    k = max(1, int(len(words) * frac))
    for i in rng.integers(0, len(words), k):
        words[i] = str(vocab[rng.integers(0, len(vocab))])
    return " ".join(words)


def perturb_zh(text, frac, rng, cjk):
    chars = list(text)
    for i in rng.integers(0, len(chars), max(1, int(len(chars) * frac))):
        chars[i] = str(cjk[rng.integers(0, len(cjk))])
    return "".join(chars)


def generate(out_dir: Path, total_mb: float, seed: int = 0, part_mb: float = 25.0) -> dict:
    """jsonl parts under ``out_dir``; returns {id: [kind, original id]} (kinds: base, near, far, exact, junk)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from zero2all.corpus.readers import iter_records

    rng = np.random.default_rng(seed)
    vocab = _vocab(rng)
    cjk = np.array([chr(c) for c in range(0x4E00, 0x4E00 + 3000)])
    code = [r["content"] for r in iter_records("stdlib")]
    truth, part, size, total, n = {}, None, 0, 0, 0
    out_dir.mkdir(parents=True, exist_ok=True)
    recent = []

    def emit(text, kind, of=None, lang=None):
        nonlocal part, size, total, n
        if part is None or size >= part_mb * 1e6:
            if part:
                part.close()
            part = open(out_dir / f"part-{len(list(out_dir.glob('part-*.jsonl'))):04d}.jsonl", "w")
            size = 0
        doc_id = f"{kind}-{n}"
        rec = {"id": doc_id, "text": text}
        if lang:
            rec["lang"] = lang
        line = json.dumps(rec, ensure_ascii=False) + "\n"
        part.write(line)
        b = len(text.encode())
        size, total, n = size + len(line), total + b, n + 1
        truth[doc_id] = [kind, of]
        return doc_id

    ci = 0
    while total < total_mb * 1e6:
        r = rng.random()
        if r < 0.45:
            text, lang = english(rng, vocab, int(rng.integers(400, 1200))), "en"
        elif r < 0.70:
            text, lang = chinese(rng, cjk, int(rng.integers(600, 2000))), "zh"
        elif r < 0.80:
            text, lang = code[ci % len(code)], "code"
            if ci >= len(code):  # after one pass over the stdlib, code documents are perturbed copies
                text = perturb(text, 0.01, rng, vocab)
            ci += 1
        else:
            text, lang = None, None
        if text is not None:
            doc_id = emit(text, "base", lang=lang)
            recent.append((doc_id, text, lang))
            recent = recent[-200:]
            continue
        if not recent:
            continue
        of, base, lang = recent[int(rng.integers(0, len(recent)))]
        r = rng.random()
        if r < 0.6:  # near duplicate: 1-3 % of the words / characters replaced (Jaccard ~0.75-0.95)
            f = float(rng.uniform(0.005, 0.02))
            emit(perturb_zh(base, f, rng, cjk) if lang == "zh" else perturb(base, f, rng, vocab), "near", of, lang)
        elif r < 0.75:  # dissimilar variant: 40 % replaced (Jaccard well below 0.5)
            emit(perturb_zh(base, 0.4, rng, cjk) if lang == "zh" else perturb(base, 0.4, rng, vocab), "far", of,
                 lang)
        elif r < 0.95:
            emit(base, "exact", of, lang)
        else:
            emit("Click here to subscribe!\n" * int(rng.integers(3, 30)), "junk", None, "en")
    part.close()
    (out_dir.parent / f"truth-{out_dir.name}.json").write_text(json.dumps(truth))
    return truth


def peak_rss_mb() -> tuple[float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return round(me, 1), round(kids, 1)


def input_ids(data: Path) -> list[str]:
    ids = []
    for p in sorted(data.glob("part-*.jsonl")):
        with open(p) as f:
            ids += [json.loads(line)["id"] for line in f]
    return ids


def input_mb(data: Path) -> float:
    total = 0
    for p in sorted(data.glob("part-*.jsonl")):
        with open(p) as f:
            total += sum(len(json.loads(line)["text"].encode()) for line in f)
    return total / 1e6


# ---------------------------------------------------------------------------------------------------- runners


def run_ours(data: Path, out: Path, workers: int, near_only: bool, num_perm: int, threshold: float,
             verify: bool = True) -> dict:
    from zero2all.corpus.clean import CleanConfig, clean

    cfg = CleanConfig(workers=workers)
    cfg.dedup.num_perm, cfg.dedup.threshold, cfg.dedup.verify = num_perm, threshold, verify
    if near_only:
        for sec in (cfg.gopher, cfg.repetition, cfg.c4, cfg.zh, cfg.code, cfg.pii):
            sec.enabled = False
        cfg.dedup.exact = False
    t = time.time()
    rep = clean([str(data)], out, cfg, verbose=False)
    secs = time.time() - t
    kept = set()
    for shard in sorted(out.glob("clean-*.jsonl")):
        with open(shard) as f:
            kept |= {json.loads(line)["id"] for line in f}
    removed = sorted(set(input_ids(data)) - kept) if near_only else []
    return {"seconds": secs, "removed": removed, "report_removed": rep["removed"], "dedup": rep["dedup"],
            "stage_seconds": rep["seconds"], "kept": len(kept)}


class _Tokens:
    """The same tokens for datatrove: CJK characters one by one, other words as runs of letters/digits."""

    def __init__(self):
        from datatrove.utils.word_tokenizers import WordTokenizer

        class Tok(WordTokenizer):
            def word_tokenize(self, text):
                return TOKEN.findall(text.lower())

            def sent_tokenize(self, text):
                return text.split(". ")

            def span_tokenize(self, text):
                return [m.span() for m in TOKEN.finditer(text)]

        self.tok = Tok("custom")


def _minhash_config(bands: int, rows: int):
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.text import TextNormConfig

    return MinhashConfig(n_grams=5, num_buckets=bands, hashes_per_bucket=rows, seed=1,
                         # sha1: its xxhash path passes str, which xxhash 4.x refuses
                         hash_config=HashConfig(hash_fc="sha1", precision=64),
                         norm_config=TextNormConfig(lowercase=True, norm_whitespace=True, remove_punctuation=True))


def run_datatrove_full(data: Path, work: Path, bands: int, rows: int) -> dict:
    """datatrove's closest equivalent of our full pipeline, timed as a whole.

    Filters (English documents only, as ours; Chinese and code pass through, datatrove has no rules of ours for
    them), parameters set to our defaults where the two differ:

    * GopherQualityFilter: its defaults (= ours): 50..100,000 words, mean word length 3..10, symbol/word <= 0.1,
      bullet lines <= 0.9, ellipsis lines <= 0.3, alphabetic words >= 0.8, >= 2 stop words;
    * GopherRepetitionFilter: its defaults (= ours): duplicate lines / paragraphs 0.3 / 0.3, their characters
      0.2 / 0.2, top 2/3/4-gram 0.20/0.18/0.16, duplicate 5..10-gram 0.15..0.10;
    * C4QualityFilter: min_words_per_line=5, min_num_sentences=3 (ours; its defaults 3 and 5), split_paragraph,
      terminal punctuation, lorem ipsum, javascript, curly bracket on; remove_citations and filter_policy off
      (no such rules in ours);
    * PIIFormatter: email + public IP (its defaults);

    then JsonlWriter (the filtered text) + MinhashDedupSignature in the same pass, buckets, cluster, and
    JsonlReader -> MinhashDedupFilter -> JsonlWriter. Word tokenizer: the regex one of the dedup comparison for
    every step (datatrove's English tokenizer needs spaCy, which is slower).
    """
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.filters.base_filter import BaseFilter
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    class EnglishOnly(BaseFilter):
        """Applies ``inner`` to documents whose ``lang`` is English; others pass."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.name = inner, inner.name

        def filter(self, doc):
            return doc.metadata.get("lang", "en") != "en" or self.inner.filter(doc)

    cfg = _minhash_config(bands, rows)
    tok = _Tokens().tok
    filters = [GopherQualityFilter(language=tok), GopherRepetitionFilter(language=tok),
               C4QualityFilter(min_words_per_line=5, min_num_sentences=3, remove_citations=False,
                               filter_policy=False, language=tok)]
    t = time.time()
    LocalPipelineExecutor([JsonlReader(str(data)), *[EnglishOnly(f) for f in filters], PIIFormatter(),
                           JsonlWriter(str(work / "filtered"), compression=None),
                           MinhashDedupSignature(str(work / "sigs"), config=cfg, language=tok)],
                          tasks=1, workers=1, logging_dir=str(work / "logs1")).run()
    t1 = time.time()
    LocalPipelineExecutor([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=cfg)],
                          tasks=bands, workers=1, logging_dir=str(work / "logs2")).run()
    LocalPipelineExecutor([MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=cfg)],
                          tasks=1, workers=1, logging_dir=str(work / "logs3")).run()
    LocalPipelineExecutor([JsonlReader(str(work / "filtered")), MinhashDedupFilter(str(work / "remove")),
                           JsonlWriter(str(work / "out"), compression=None)],
                          tasks=1, workers=1, logging_dir=str(work / "logs4")).run()
    secs = time.time() - t
    kept = 0
    for p in (work / "out").glob("*.jsonl"):
        with open(p) as f:
            kept += sum(1 for _ in f)
    return {"seconds": secs, "removed": [], "kept": kept, "stage_seconds": {"filters+signatures": t1 - t,
                                                                           "dedup": time.time() - t1}}


def run_datatrove(data: Path, work: Path, bands: int, rows: int) -> dict:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    cfg = _minhash_config(bands, rows)
    tok = _Tokens().tok
    t = time.time()
    LocalPipelineExecutor([JsonlReader(str(data)), MinhashDedupSignature(str(work / "sigs"), config=cfg,
                                                                         language=tok)],
                          tasks=1, workers=1, logging_dir=str(work / "logs1")).run()
    LocalPipelineExecutor([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=cfg)],
                          tasks=bands, workers=1, logging_dir=str(work / "logs2")).run()
    LocalPipelineExecutor([MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=cfg)],
                          tasks=1, workers=1, logging_dir=str(work / "logs3")).run()
    LocalPipelineExecutor([JsonlReader(str(data)), MinhashDedupFilter(str(work / "remove")),
                           JsonlWriter(str(work / "out"), compression=None)],
                          tasks=1, workers=1, logging_dir=str(work / "logs4")).run()
    secs = time.time() - t
    kept = set()
    for p in (work / "out").glob("*.jsonl"):
        with open(p) as f:
            kept |= {json.loads(line)["id"] for line in f}
    return {"seconds": secs, "removed": sorted(set(input_ids(data)) - kept)}


def run_datasketch(data: Path, num_perm: int, bands: int, rows: int, threshold: float) -> dict:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, params=(bands, rows))
    removed = []
    t = time.time()
    for p in sorted(data.glob("part-*.jsonl")):
        with open(p) as f:
            for line in f:
                rec = json.loads(line)
                toks = TOKEN.findall(rec["text"].lower())
                n = min(5, len(toks))
                sh = {" ".join(toks[i:i + n]).encode() for i in range(len(toks) - n + 1)}
                m = MinHash(num_perm=num_perm, seed=1)
                if sh:
                    m.update_batch(list(sh))
                if lsh.query(m):
                    removed.append(rec["id"])
                else:
                    lsh.insert(rec["id"], m)
    return {"seconds": time.time() - t, "removed": sorted(removed)}


def child(args) -> None:
    data, out = Path(args.data), Path(args.work)
    tool = args.child
    if tool == "ours":
        res = run_ours(data, out, args.workers, False, args.num_perm, args.threshold)
    elif tool == "ours-near":
        res = run_ours(data, out, 1, True, args.num_perm, args.threshold)
    elif tool == "ours-near-noverify":
        res = run_ours(data, out, 1, True, args.num_perm, args.threshold, verify=False)
    elif tool == "datatrove":
        res = run_datatrove(data, out, args.bands, args.rows)
    elif tool == "datatrove-full":
        res = run_datatrove_full(data, out, args.bands, args.rows)
    else:
        res = run_datasketch(data, args.num_perm, args.bands, args.rows, args.threshold)
    res["peak_rss_mb"], res["peak_rss_workers_mb"] = peak_rss_mb()
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    res["cpu_seconds"] = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime  # includes reading the ids back
    print("RESULT " + json.dumps(res))


def run_child(tool: str, data: Path, work: Path, args, workers: int = 1) -> dict:
    cmd = [sys.executable, __file__, "--child", tool, "--data", str(data), "--work", str(work),
           "--workers", str(workers), "--num-perm", str(args.num_perm), "--threshold", str(args.threshold),
           "--bands", str(args.bands), "--rows", str(args.rows)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(line[len("RESULT "):])


def agreement(a: list, b: list) -> str:
    sa, sb = set(a), set(b)
    return f"{len(sa & sb) / max(len(sa | sb), 1):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=500.0)
    ap.add_argument("--compare-mb", type=float, default=50.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--num-perm", type=int, default=128)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--bands", type=int, default=0)
    ap.add_argument("--rows", type=int, default=0)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--skip", default="", help="comma-separated: full,half,ours-near,ours-near-noverify,"
                    "datatrove,datasketch,ours-small,datatrove-full")
    ap.add_argument("--child", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if not args.bands:
        from zero2all.corpus.clean.minhash import choose_bands

        args.bands, args.rows = choose_bands(args.threshold, args.num_perm)
    if args.child:
        return child(args)
    skip = set(filter(None, args.skip.split(",")))
    root = Path(args.dir or tempfile.mkdtemp(prefix="clean-bench-"))
    results, t0 = {}, time.time()
    sets = {"small": args.compare_mb, "half": args.mb / 2, "full": args.mb}
    for name, mb in sets.items():
        if name not in skip and not (root / name).exists():
            t = time.time()
            generate(root / name, mb, seed={"small": 1, "half": 2, "full": 3}[name])
            print(f"generated {name}: {mb:.0f} MB in {time.time() - t:.0f} s", flush=True)
    load = os.getloadavg()
    print(f"load average before the runs: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    small = root / "small"
    small_mb = input_mb(small)
    truth = json.loads((root / "truth-small.json").read_text())
    for tool in ("ours-near", "ours-near-noverify", "datatrove", "datasketch", "ours-small", "datatrove-full"):
        if tool in skip:
            continue
        w = root / f"work-{tool}"
        res = run_child("ours" if tool == "ours-small" else tool, small, w, args, workers=1)
        results[tool] = res
        print(tool, {k: v for k, v in res.items() if k != "removed"}, flush=True)
    for name in ("half", "full"):
        if name in skip:
            continue
        res = run_child("ours", root / name, root / f"work-{name}", args, workers=args.workers)
        res["mb"] = input_mb(root / name)
        results[name] = res
        print(name, {k: v for k, v in res.items() if k != "removed"}, flush=True)
    load2 = os.getloadavg()
    near = {i for i, (k, _) in truth.items() if k == "near"}
    far = {i for i, (k, _) in truth.items() if k == "far"}
    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; python "
          f"{platform.python_version()}; load average {load[0]:.2f} before, {load2[0]:.2f} after; total "
          f"{time.time() - t0:.0f} s")
    print(f"near dedup: threshold {args.threshold}, {args.num_perm} permutations, {args.bands} bands x {args.rows} "
          f"rows, 5-gram shingles; compare subset {small_mb:.1f} MB, {len(truth):,} docs, {len(near):,} planted near "
          f"duplicates, {len(far):,} planted dissimilar variants")
    print()
    print("| run | data | MB/s (wall) | MB per CPU-second | peak RSS (main / workers) | near-dup recall | "
          "false removals |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for tool, label in (("ours-small", "ours, full pipeline, 1 worker"),
                        ("datatrove-full", "datatrove, full pipeline (filters + PII + MinHash), 1 task"),
                        ("ours-near", "ours, near dedup alone, verify on, 1 worker"),
                        ("ours-near-noverify", "ours, near dedup alone, verify off, 1 worker"),
                        ("datatrove", "datatrove MinHash (4 stages), 1 task"),
                        ("datasketch", "datasketch MinHashLSH, 1 process")):
        r = results.get(tool)
        if not r:
            continue
        if "error" in r:
            print(f"| {label} | {small_mb:.0f} MB | failed: {r['error']} | | | | |")
            continue
        rem = set(r.get("removed", []))
        full = tool in ("ours-small", "datatrove-full")
        rec = "-" if full else f"{len(rem & near) / max(len(near), 1):.3f}"
        fr = "-" if full else f"{len(rem & far) / max(len(far), 1):.4f}"
        mbs = small_mb / r["seconds"]
        print(f"| {label} | {small_mb:.0f} MB | {mbs:.2f} | {small_mb / r['cpu_seconds']:.2f} | "
              f"{r['peak_rss_mb']:.0f} / {r['peak_rss_workers_mb']:.0f} MB | {rec} | {fr} |")
    for name in ("half", "full"):
        r = results.get(name)
        if not r or "error" in r:
            if r:
                print(f"| ours, full pipeline, {args.workers} workers | {name} | failed: {r['error']} | | | | |")
            continue
        mbs = r["mb"] / r["seconds"]
        print(f"| ours, full pipeline, {args.workers} workers | {r['mb']:.0f} MB | {mbs:.2f} | "
              f"{r['mb'] / r['cpu_seconds']:.2f} | {r['peak_rss_mb']:.0f} / {r['peak_rss_workers_mb']:.0f} MB "
              "| - | - |")
    print()
    for tool in ("ours-small", "datatrove-full"):
        if tool in results and "error" not in results[tool]:
            print(f"{tool}: {results[tool]['kept']:,} documents kept of {len(truth):,}; stage seconds "
                  f"{results[tool]['stage_seconds']}")
    tools = [t for t in ("ours-near", "ours-near-noverify", "datatrove", "datasketch")
             if t in results and "error" not in results[t]]
    for i, a in enumerate(tools):
        for b in tools[i + 1:]:
            print(f"agreement of removed near duplicates (Jaccard of the removed-id sets), {a} vs {b}: "
                  f"{agreement(results[a]['removed'], results[b]['removed'])} "
                  f"({len(results[a]['removed']):,} vs {len(results[b]['removed']):,} removed)")
    if "full" in results and "error" not in results["full"]:
        print("full run removals:", results["full"]["report_removed"])
        print("full run stage seconds:", results["full"]["stage_seconds"])
    (root / "results.json").write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "removed"}
                                                   for k, v in results.items()}, indent=1))
    print(f"results in {root}/results.json")


if __name__ == "__main__":
    main()
