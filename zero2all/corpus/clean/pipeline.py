"""``clean()``: the whole cleaning run, streaming and parallel, resumable after a kill.

Stage 1 (parallel, one work unit = ``chunk_docs`` records or ``chunk_mb`` of text, in input order): normalise,
pick the language (``en`` / ``zh`` / ``code``), apply that language's quality rules, mask PII, then compute each
surviving document's exact-content hash (64-bit BLAKE2b of the final text) and MinHash signature. A unit writes
``.work/chunk-NNNNNN.jsonl`` (its surviving records), ``.npz`` (hashes, signatures, source indices) and last
``.json`` (its counts: the done marker), each atomically. A rerun skips units whose marker exists.

Stage 2 (one process): exact duplicates (sort of the hashes; the first occurrence in input order is kept), then
near duplicates among the rest (:func:`zero2all.corpus.clean.minhash.find_clusters` over a memory-mapped
signature file). Memory: about 60 bytes per document (hash, source, size, decision, union-find parent, one
band's keys and sort order at a time), plus the mapped signatures (``num_perm * 4`` bytes per document on disk).

Stage 3: the kept records go to ``clean-NNNNN.jsonl`` shards (``shard_chunks`` units each, written atomically),
then ``report.json``, ``report.md`` and ``report.png``; ``.work`` is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from zero2all.config import ConfigError
from zero2all.corpus.clean.config import CleanConfig
from zero2all.corpus.clean.filters import filter_document
from zero2all.corpus.clean.minhash import (
    MinHasher,
    band_candidates,
    choose_bands,
    find_clusters,
    s_curve,
    verify_bar,
    verify_pairs,
)
from zero2all.corpus.clean.normalize import detect_language, normalize_text
from zero2all.corpus.clean.pii import mask_pii
from zero2all.corpus.decontam import build_index, load_index_cached
from zero2all.corpus.mixture import temperature_weights
from zero2all.corpus.readers import ReadStats, SourceSpec, check_out_outside_inputs, iter_records
from zero2all.fileio import (
    atomic_write,
    claim_output_dir,
    locked_output_dir,
    read_output_marker,
    save_json,
    temporary_target,
    write_output_marker,
)

__all__ = ["clean", "clean_chunk", "lsh_parameters"]

_SNIPPET = 160
DECONTAM_INDEX = "decontam.npz"


def lsh_parameters(cfg: CleanConfig) -> dict:
    d = cfg.dedup
    bands, rows = (d.bands, d.rows) if d.bands else choose_bands(d.threshold, d.num_perm)
    return {"threshold": d.threshold, "num_perm": d.num_perm, "bands": bands, "rows": rows,
            "curve_at_threshold": round(float(s_curve(d.threshold, bands, rows)), 4),
            "curve_at_0.5": round(float(s_curve(0.5, bands, rows)), 4),
            "verify_bar": round(verify_bar(d.threshold, d.num_perm), 4) if d.verify else None,
            "word_ngram": d.word_ngram, "char_ngram": d.char_ngram}


# ---------------------------------------------------------------------------------------------------- stage 1

_HASHER: dict = {}


def _hasher(cfg: CleanConfig) -> MinHasher:
    d = cfg.dedup
    key = (d.num_perm, d.word_ngram, d.char_ngram, d.seed, d.lowercase)
    if key not in _HASHER:
        _HASHER.clear()
        _HASHER[key] = MinHasher(d.num_perm, d.word_ngram, d.char_ngram, d.seed, d.lowercase)
    return _HASHER[key]


def _example(rec: dict, text: str) -> dict:
    return {"id": rec["id"], "data_src": rec["data_src"], "text": text[:_SNIPPET]}


def clean_chunk(index: int, records: list[dict], work: str, cfg: CleanConfig, sources: list[str]) -> dict:
    """Stage 1 for one work unit; writes its files into ``work`` and returns its counts."""
    hasher = _hasher(cfg) if cfg.dedup.near else None
    dindex = load_index_cached(Path(work) / DECONTAM_INDEX) if cfg.decontam.sets else None
    contaminated: dict = {}  # set name -> {"docs": n, "examples": [...]}
    per_src: dict = {}
    examples: dict = {}
    kept, hashes, sigs, has_sig, src_idx = [], [], [], [], []
    for rec in records:
        src = rec["data_src"]
        s = per_src.setdefault(src, {"docs_in": 0, "bytes_in": 0, "removed": {}, "pii": {}, "c4_lines_dropped": 0,
                                     "langs": {}})
        text = rec["content"]
        s["docs_in"] += 1
        s["bytes_in"] += len(text.encode("utf-8", "surrogatepass"))
        lang = detect_language(rec, text)
        s["langs"][lang] = s["langs"].get(lang, 0) + 1
        n = cfg.normalize
        norm = normalize_text(text, n.form, n.strip_control, n.collapse_spaces, n.max_blank_lines, code=lang == "code")
        out, rule, dropped = filter_document(norm, lang, cfg)
        s["c4_lines_dropped"] += dropped
        if rule:
            s["removed"][rule] = s["removed"].get(rule, 0) + 1
            ex = examples.setdefault(rule, [])
            if len(ex) < cfg.examples:
                ex.append(_example(rec, norm))
            continue
        hits = dindex.match(out) if dindex is not None else {}
        for name, ngram in hits.items():
            c = contaminated.setdefault(name, {"docs": 0, "examples": []})
            c["docs"] += 1
            if len(c["examples"]) < cfg.examples:
                c["examples"].append({**_example(rec, out), "ngram": ngram})
        if hits:
            # report-only: counted under "flagged" (the document stays); else removed like any rule's match
            counts = s.setdefault("flagged", {}) if cfg.decontam.report_only else s["removed"]
            counts["contaminated"] = counts.get("contaminated", 0) + 1
            if not cfg.decontam.report_only:
                continue
        if cfg.pii.enabled:
            out, counts = mask_pii(out, cfg.pii.email, cfg.pii.ip, cfg.pii.phone)
            for k, v in counts.items():
                s["pii"][k] = s["pii"].get(k, 0) + v
        raw = out.encode("utf-8", "surrogatepass")
        hashes.append(int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little"))
        sig = hasher.signature(out, "char" if lang == "zh" else "word") if hasher is not None else None
        has_sig.append(sig is not None)
        sigs.append(sig if sig is not None else np.zeros(cfg.dedup.num_perm, dtype=np.uint32))
        src_idx.append(sources.index(src) if src in sources else len(sources))
        rec = dict(rec)
        rec["content"] = out
        kept.append(rec)
    base = Path(work) / f"chunk-{index:06d}"
    with atomic_write(f"{base}.jsonl", "wb") as f:
        for rec in kept:
            f.write(json.dumps(rec, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
    with atomic_write(f"{base}.npz", "wb") as f:
        np.savez(f, hash=np.array(hashes, dtype=np.uint64), has_sig=np.array(has_sig, dtype=bool),
                 sig=np.array(sigs, dtype=np.uint32).reshape(len(kept), cfg.dedup.num_perm),
                 src=np.array(src_idx, dtype=np.int32),
                 nbytes=np.array([len(r["content"].encode("utf-8", "surrogatepass")) for r in kept], dtype=np.int64))
    done = {"index": index, "docs": len(records), "kept": len(kept), "sources": per_src, "examples": examples,
            "contaminated": contaminated}
    save_json(done, f"{base}.json")
    return done


def _chunks(records, cfg: CleanConfig):
    limit = int(cfg.chunk_mb * (1 << 20))
    batch, size, index = [], 0, 0
    for rec in records:
        batch.append(rec)
        size += len(rec["content"])
        if len(batch) >= cfg.chunk_docs or size >= limit:
            yield index, batch
            batch, size, index = [], 0, index + 1
    if batch:
        yield index, batch


def _stage1(inputs, work: Path, cfg: CleanConfig, sources: list[str], read_kwargs: dict, stats: ReadStats,
            workers: int, max_docs: int | None, on_chunk_done: Callable | None, use_ray: bool = False) -> int:
    records = iter_records(inputs, stats=stats, **read_kwargs)
    if max_docs is not None:
        records = (r for r, _ in zip(records, range(max_docs)))
    n_chunks = 0
    if use_ray:  # the same units and the same clean_chunk, as Ray tasks (retried if a worker dies or one raises)
        from zero2all.corpus.on_ray import RETRIES, connect, ordered_map, ray_workers

        ray = connect()
        task = ray.remote(clean_chunk).options(max_retries=RETRIES, retry_exceptions=True)

        def todo():
            nonlocal n_chunks
            for index, batch in _chunks(records, cfg):
                n_chunks = index + 1
                if not (work / f"chunk-{index:06d}.json").exists():
                    yield index, batch

        def done(item, _result):
            if on_chunk_done:
                on_chunk_done(item[0])

        ordered_map(lambda item, _: task.remote(item[0], item[1], str(work), cfg, sources), todo(),
                    2 * ray_workers(ray, cfg.workers), done, ray.get)
        return n_chunks
    if workers <= 1:
        for index, batch in _chunks(records, cfg):
            n_chunks = index + 1
            if not (work / f"chunk-{index:06d}.json").exists():
                clean_chunk(index, batch, str(work), cfg, sources)
                if on_chunk_done:
                    on_chunk_done(index)
        return n_chunks
    from zero2all.corpus.on_ray import local_pool_context

    with ProcessPoolExecutor(workers, mp_context=local_pool_context()) as pool:
        pending: deque = deque()
        for index, batch in _chunks(records, cfg):
            n_chunks = index + 1
            if (work / f"chunk-{index:06d}.json").exists():
                continue
            pending.append((index, pool.submit(clean_chunk, index, batch, str(work), cfg, sources)))
            while len(pending) >= 2 * workers:  # bounded: at most 2 units per worker in flight
                i, fut = pending.popleft()
                fut.result()
                if on_chunk_done:
                    on_chunk_done(i)
        while pending:
            i, fut = pending.popleft()
            fut.result()
            if on_chunk_done:
                on_chunk_done(i)
    return n_chunks


# ---------------------------------------------------------------------------------------------------- stage 2


def _band_task(sig_path: str, idx: np.ndarray, band: int, rows: int, bar: float | None):
    """One LSH band on a Ray worker: its candidate pairs over the memory-mapped signatures, each verified."""
    sigs = np.load(sig_path, mmap_mode="r")
    a, b = band_candidates(sigs, idx, band, rows)
    return a, b, verify_pairs(sigs, a, b, bar)


def _ray_bands(sig_path: Path, alive: np.ndarray, bands: int, rows: int, bar: float | None, workers: int):
    """The bands' (a, b, ok) from Ray tasks, in band order, at most two per worker in flight."""
    from zero2all.corpus.on_ray import RETRIES, connect

    ray = connect()
    task = ray.remote(_band_task).options(max_retries=RETRIES, retry_exceptions=True)
    idx = ray.put(np.flatnonzero(alive))
    pending: deque = deque()
    for band in range(bands):
        pending.append(task.remote(str(sig_path), idx, band, rows, bar))
        if len(pending) >= 2 * workers:
            yield ray.get(pending.popleft())
    while pending:
        yield ray.get(pending.popleft())


def _stage2(work: Path, n_chunks: int, cfg: CleanConfig, lsh: dict, use_ray: bool = False, workers: int = 1):
    hashes, has_sig, srcs, nbytes, counts = [], [], [], [], []
    for i in range(n_chunks):
        with np.load(work / f"chunk-{i:06d}.npz") as z:
            hashes.append(z["hash"])
            has_sig.append(z["has_sig"])
            srcs.append(z["src"])
            nbytes.append(z["nbytes"])
            counts.append(len(z["hash"]))
    hashes = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    n = len(hashes)
    removed = np.zeros(n, dtype=np.int8)  # 0 kept, 1 exact duplicate, 2 near duplicate
    dup_of = np.arange(n, dtype=np.int64)
    if cfg.dedup.exact and n:
        order = np.argsort(hashes, kind="stable")
        sh = hashes[order]
        same = np.concatenate([[False], sh[1:] == sh[:-1]])
        first = np.maximum.accumulate(np.where(~same, np.arange(n), 0))
        removed[order[same]] = 1
        dup_of[order[same]] = order[first[same]]
        del order, sh, same, first
    stats = {"candidate_pairs": 0, "verified_pairs": 0, "near_clusters": 0, "exact_clusters": 0}
    stats["exact_clusters"] = int(len(np.unique(dup_of[removed == 1]))) if n else 0
    if cfg.dedup.near and n:
        sig_path = work / "signatures.npy"
        sigs = np.lib.format.open_memmap(sig_path, mode="w+", dtype=np.uint32, shape=(n, cfg.dedup.num_perm))
        at = 0
        for i in range(n_chunks):
            with np.load(work / f"chunk-{i:06d}.npz") as z:
                sigs[at:at + counts[i]] = z["sig"]
            at += counts[i]
        sigs.flush()
        alive = (removed == 0) & np.concatenate(has_sig)
        bar = lsh["verify_bar"]
        # on Ray each band's keys, sort and verification run on a worker; the union stays here (same clusters)
        bands = _ray_bands(sig_path, alive, lsh["bands"], lsh["rows"], bar, workers) if use_ray else None
        parent, st = find_clusters(sigs, alive, lsh["bands"], lsh["rows"], bar, band_results=bands)
        del sigs
        sig_path.unlink()
        stats.update(st)
        near = alive & (parent != np.arange(n))
        removed[near] = 2
        dup_of[near] = parent[near]
        stats["near_clusters"] = int(len(np.unique(parent[near])))
    return removed, dup_of, np.concatenate(srcs) if srcs else np.zeros(0, np.int32), \
        np.concatenate(nbytes) if nbytes else np.zeros(0, np.int64), counts, stats


# ---------------------------------------------------------------------------------------------------- driver


def _fingerprint(inputs, cfg: CleanConfig, read_kwargs: dict, max_docs, decontam_digest: str | None = None) -> str:
    settings = {k: v for k, v in cfg.to_dict().items() if k not in ("workers", "examples", "dry_run_docs")}
    blob = json.dumps({"inputs": list(map(str, inputs)), "cfg": settings, "read": read_kwargs,
                       "max_docs": max_docs, "decontam": decontam_digest}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def clean(inputs: list[str] | str, out: str | os.PathLike, cfg: CleanConfig | None = None,
          text_field: str | None = None, txt_mode: str = "file", strict: bool = False, dry_run: bool = False,
          max_docs: int | None = None, on_chunk_done: Callable[[int], None] | None = None,
          verbose: bool = True, ray: bool | None = None) -> dict:
    """Clean ``inputs`` (paths, globs, ``NAME=PATH`` or ``stdlib``) into ``out``; returns the report dict.

    ``dry_run``: the first ``cfg.dry_run_docs`` records only, in a temporary directory; nothing is written to
    ``out``. ``on_chunk_done(index)`` is called after each work unit of stage 1 (progress, tests). ``ray``: run
    the work units on Ray (:mod:`zero2all.corpus.on_ray`; None: when ``RAY_ADDRESS`` is set), same output."""
    cfg = (cfg or CleanConfig()).validate()
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    if not inputs:
        raise ConfigError("clean: no --input given")
    sources = []
    for s in inputs:
        name = SourceSpec.parse(str(s)).name
        if name not in sources:
            sources.append(name)
    if not dry_run:
        check_out_outside_inputs(inputs, out)
    read_kwargs = {"text_field": text_field, "txt_mode": txt_mode, "strict": strict}
    from zero2all.corpus.on_ray import connect, ray_requested, ray_workers

    use_ray = ray_requested(ray)
    workers = ray_workers(connect(), cfg.workers) if use_ray else cfg.workers or os.cpu_count() or 1
    lsh = lsh_parameters(cfg)
    if verbose:
        print(f"near dedup: threshold {lsh['threshold']}, {lsh['num_perm']} permutations -> {lsh['bands']} bands x "
              f"{lsh['rows']} rows; S-curve 1-(1-s^r)^b = {lsh['curve_at_threshold']:.4f} at s={lsh['threshold']}, "
              f"{lsh['curve_at_0.5']:.4f} at s=0.5; verify bar {lsh['verify_bar']}")
    # the evaluation sets are read before the output folder is touched: a bad --decontaminate changes nothing
    dindex = build_index(cfg.decontam.sets, cfg.decontam.ngram, log=print if verbose else None) \
        if cfg.decontam.sets else None
    tmp = None
    if dry_run:
        tmp = tempfile.TemporaryDirectory(prefix="z2all-clean-dry-")
        out_dir, max_docs = Path(tmp.name), cfg.dry_run_docs if max_docs is None else max_docs
    else:
        out_dir = Path(out)
        # new, empty or an earlier `clean` output (resumed or redone); never a folder of other files
        claim_output_dir(out_dir, "clean", inputs=inputs, legacy=_is_legacy_output)
    try:
        # one run per folder: a second `clean` on the same --out is refused at once (a dry run writes a temporary)
        with contextlib.nullcontext() if dry_run else locked_output_dir(out_dir):
            return _run(inputs, out_dir, cfg, sources, read_kwargs, workers, lsh, max_docs, on_chunk_done, verbose,
                        dry_run, dindex, use_ray)
    finally:
        if tmp is not None:
            tmp.cleanup()


_OUTPUT_NAME = re.compile(r"^(clean-\d{5}\.jsonl|report\.(json|md|png)|\.work)$")


def _is_legacy_output(path: Path) -> bool:
    """A `clean` output written before outputs carried a marker: nothing but the files `clean` writes."""
    names = [n for n in os.listdir(path) if not n.startswith(".z2all-") and temporary_target(n) is None]
    return bool(names) and all(_OUTPUT_NAME.match(n) for n in names)


def _run(inputs, out_dir: Path, cfg, sources, read_kwargs, workers, lsh, max_docs, on_chunk_done, verbose, dry_run,
         dindex=None, use_ray=False):
    t0 = time.time()
    work = out_dir / ".work"
    work.mkdir(parents=True, exist_ok=True)
    fp = _fingerprint(inputs, cfg, read_kwargs, max_docs, dindex.digest if dindex is not None else None)
    marker = work / "run.json"
    if marker.exists():
        old = json.loads(marker.read_text())
        if old.get("fingerprint") != fp:
            shutil.rmtree(work)  # another config or input: earlier units are not reusable
            work.mkdir(parents=True)
        elif verbose:
            done = len(list(work.glob("chunk-*.json")))
            print(f"resuming: {done} work unit{'s' if done != 1 else ''} already done in {work}")
    save_json({"fingerprint": fp, "inputs": list(map(str, inputs))}, marker)
    if dindex is not None:
        dindex.save(work / DECONTAM_INDEX)  # the workers load it from here, once each
    stats = ReadStats()
    n_chunks = _stage1(inputs, work, cfg, sources, read_kwargs, stats, workers, max_docs, on_chunk_done, use_ray)
    t1 = time.time()
    removed, dup_of, src_idx, nbytes, counts, dstats = _stage2(work, n_chunks, cfg, lsh, use_ray, workers)
    t2 = time.time()
    report = _assemble(work, n_chunks, removed, dup_of, src_idx, nbytes, counts, dstats, sources, cfg, lsh, stats,
                       dindex)
    shards = _write_shards(work, out_dir, n_chunks, removed, counts, cfg, report, write=not dry_run)
    if not dry_run:
        report["shards"] = shards
    report["seconds"] = {"stage1_filter_hash": round(t1 - t0, 2), "stage2_dedup": round(t2 - t1, 2),
                         "total": round(time.time() - t0, 2)}
    report["workers"] = workers
    if use_ray:
        report["engine"] = "ray"
    sizes = {name: s["bytes_out"] for name, s in report["sources"].items()}
    report["sampling"] = {str(t): {k: round(v, 4) for k, v in temperature_weights(sizes, t).items()}
                          for t in cfg.temperatures} if len(sizes) > 1 else {}
    report["inputs"] = list(map(str, inputs))
    from zero2all.corpus.clean.report import write_report

    if not dry_run:
        write_report(report, out_dir)
        if read_output_marker(out_dir) is None:
            write_output_marker(out_dir, "clean")
        shutil.rmtree(work)
    if verbose:
        from zero2all.corpus.clean.report import summary_line

        print(stats.report())
        print(summary_line(report))
    return report


def _assemble(work, n_chunks, removed, dup_of, src_idx, nbytes, counts, dstats, sources, cfg, lsh, stats,
              dindex=None) -> dict:
    per_src: dict = {}
    examples: dict = {}
    contaminated: dict = {}
    for i in range(n_chunks):
        c = json.loads((work / f"chunk-{i:06d}.json").read_text())
        for name, s in c["sources"].items():
            t = per_src.setdefault(name, {"docs_in": 0, "bytes_in": 0, "docs_out": 0, "bytes_out": 0, "removed": {},
                                          "flagged": {}, "pii": {}, "c4_lines_dropped": 0, "duplicate_clusters": 0,
                                          "langs": {}})
            t["docs_in"] += s["docs_in"]
            t["bytes_in"] += s["bytes_in"]
            t["c4_lines_dropped"] += s["c4_lines_dropped"]
            for key in ("removed", "flagged", "pii", "langs"):
                for k, v in s.get(key, {}).items():
                    t[key][k] = t[key].get(k, 0) + v
        for name, hit in c.get("contaminated", {}).items():
            tot = contaminated.setdefault(name, {"docs": 0, "examples": []})
            tot["docs"] += hit["docs"]
            tot["examples"] += hit["examples"][:max(cfg.examples - len(tot["examples"]), 0)]
        for rule, exs in c["examples"].items():
            room = cfg.examples - len(examples.setdefault(rule, []))
            examples[rule] += exs[:max(room, 0)]
    names = sources + ["?"]
    for code, rule in ((1, "exact_duplicate"), (2, "near_duplicate")):
        sel = removed == code
        for si in np.unique(src_idx[sel]):
            name = names[si]
            t = per_src[name]
            t["removed"][rule] = int((sel & (src_idx == si)).sum())
            t["duplicate_clusters"] += int(len(np.unique(dup_of[sel & (src_idx == si)])))
    kept = removed == 0
    for si in np.unique(src_idx):
        t = per_src[names[si]]
        t["docs_out"] = int((kept & (src_idx == si)).sum())
        t["bytes_out"] = int(nbytes[kept & (src_idx == si)].sum())
    totals = {k: sum(t[k] for t in per_src.values()) for k in ("docs_in", "docs_out", "bytes_in", "bytes_out")}
    removed_totals: dict = {}
    for t in per_src.values():
        for k, v in t["removed"].items():
            removed_totals[k] = removed_totals.get(k, 0) + v
    report = {"totals": totals, "removed": removed_totals, "sources": per_src, "examples": examples,
              "dedup": {**lsh, **dstats}, "read": stats.to_dict(), "config": cfg.to_dict(),
              "_dup_examples": _dup_example_indices(removed, dup_of, cfg.examples)}
    if dindex is not None:
        matched = sum(t["removed"].get("contaminated", 0) + t["flagged"].get("contaminated", 0)
                      for t in per_src.values())
        report["decontamination"] = decontamination_record(dindex, cfg.decontam.report_only, contaminated, matched)
    return report


def decontamination_record(dindex, report_only: bool, contaminated: dict, matched: int) -> dict:
    """The ``decontamination`` section of a report (and of ``z2all prepare``'s ``meta.json``): the n-gram length,
    the mode, and per evaluation set its files (path, sha256) or task, its n-gram count and the training documents
    that shared an n-gram with it (``docs``, with examples). ``z2all eval`` reads the sets' names and digests."""
    sets = []
    for rec in dindex.sets:
        hit = contaminated.get(rec["name"], {"docs": 0, "examples": []})
        sets.append({**rec, "docs": hit["docs"], "examples": hit["examples"]})
    return {"ngram": dindex.n, "mode": "report" if report_only else "remove", "documents": matched, "sets": sets}


def _dup_example_indices(removed, dup_of, k) -> dict:
    out = {}
    for code, rule in ((1, "exact_duplicate"), (2, "near_duplicate")):
        idx = np.flatnonzero(removed == code)[:k]
        out[rule] = [(int(i), int(dup_of[i])) for i in idx]
    return out


def _write_shards(work: Path, out_dir: Path, n_chunks: int, removed, counts, cfg, report, write: bool = True
                  ) -> list[str]:
    """Stream the units' records into the output shards (kept ones only) and fill the duplicate examples."""
    pairs = report.pop("_dup_examples")
    wanted = {g: None for rule in pairs.values() for pair in rule for g in pair}
    shards, at, f, ctx = [], 0, None, None
    for i in range(n_chunks):
        if write and i % cfg.shard_chunks == 0:
            if ctx is not None:
                ctx.__exit__(None, None, None)
            name = f"clean-{i // cfg.shard_chunks:05d}.jsonl"
            ctx = atomic_write(out_dir / name, "wb")
            f = ctx.__enter__()
            shards.append(name)
        if not write and not any(at <= g < at + counts[i] for g in wanted):
            at += counts[i]
            continue
        with open(work / f"chunk-{i:06d}.jsonl", "rb") as src:
            for j, line in enumerate(src):
                g = at + j
                if g in wanted:
                    rec = json.loads(line)
                    wanted[g] = {"id": rec["id"], "data_src": rec["data_src"], "text": rec["content"][:_SNIPPET]}
                if write and removed[g] == 0:
                    f.write(line)
        at += counts[i]
    if ctx is not None:
        ctx.__exit__(None, None, None)
    if write:
        for old in out_dir.glob("clean-*.jsonl"):
            if old.name not in shards:
                old.unlink()
    for rule, rule_pairs in pairs.items():
        report["examples"][rule] = [{**wanted[i], "kept_id": wanted[j]["id"]} for i, j in rule_pairs]
    return shards
