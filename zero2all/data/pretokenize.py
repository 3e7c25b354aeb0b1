"""Pretokenization: records in, memory-mappable token shards out (``z2all prepare``).

Output directory::

    meta.json                 tokenizer hash, dtype, splits (shard list, token/doc counts), per-source counts,
                              mixture weights, the command; written last, so its presence means "complete"
    train_00000.bin           tokens, uint16 if the vocabulary has <= 65536 entries else uint32, native order
    train_00000.idx.npy       int64 document start offsets into that shard, plus the end (len = docs + 1)
    valid_00000.bin / .idx.npy
    shard_00000.json          marks shard group 0 complete (what resume skips)

Each document's tokens are followed by ``<|endoftext|>``, so documents are separated in the concatenated stream.

**Determinism.** The main process reads records in a fixed order (sources in the given order, files sorted) and
cuts them into chunks of ~``chunk_bytes`` of text; workers tokenize chunks and the main process writes results in
chunk order. Every per-document decision is a function of the document alone, so the bytes written are the same
for any number of workers. A shard group is ``shard_chunks`` consecutive chunks: one train and one valid shard.

**Train/valid split** by document: ``u = blake2b(source name, text)`` mapped to [0, 1); the document is held out
when ``u < valid_fraction``. Identical documents fall on the same side, and the split does not depend on order.
A record whose ``split`` field is ``"train"`` or ``"valid"`` (the site-packages corpus, split by package) is pinned
to that side instead: ``valid_fraction`` then applies only to records without one.

**Mixture weights** (``--source NAME=WEIGHT``): the weight is the expected number of copies of each of the
source's documents in the train split, realised by sampling: ``floor(w)`` copies plus one more with probability
``w - floor(w)`` (a second hash of the document), so ``zh=0.4`` keeps a 40 % sample of ``zh`` and ``code=2`` shows
code twice. For a target token share ``f_s`` per source with ``T_s`` tokens, use ``w_s = f_s * T / T_s``;
meta.json reports the realised token share of each source. Held-out documents are kept at most once (weight
``< 1`` still subsamples them, so the valid split follows the mixture). ``seed`` (``--seed``, default 0 = the
content hash alone) is mixed into the sampling draw: another seed, another sample; the split does not change.

**Source sampling** (``--temperature T``, ``--target-mb M``, ``--max-epochs E``): the weights are computed from
the source sizes ``n_i``, the UTF-8 bytes of their documents' text, counted by a first pass over the records (file
sizes would misjudge compressed and JSON-wrapped inputs). The pass is bounded: past ``size_sample_mb`` of text in a
source it stops at the next file boundary and extrapolates the rest of that source from the text bytes per on-disk
byte of the files read (a bound in bytes, not seconds, so the weights are the same on every machine and on a
resume, which reuses the sizes kept in ``_state.json``). Target shares ``p_i ~ n_i^(1/T)``
(:func:`zero2all.corpus.mixture.temperature_weights`) become weights ``w_i = p_i * B / n_i`` with the budget ``B``
the corpus size (or ``M`` MB of text). An explicit ``--source NAME=W`` wins for that source: its ``W * n`` is taken
from the budget first and the rest is shared by temperature. ``E`` caps the copies per document: a temperature
weight above it is clipped and its excess budget goes to the other sources (a printed line says so); an explicit
weight above it is refused. meta.json's ``mixture`` and ``sources`` report sizes, weights, effective epochs and the
shares before and after.

**Resume.** A group is complete when its ``shard_XXXXX.json`` exists (written after its shards are renamed into
place). Re-running the same command skips the chunks of complete groups (they are read but not tokenized). A resume
requires the same settings (sources, tokenizer, split, chunking) and the same input files (size and modification
time); the groups carry that key, so no shard of another run is ever reused. What ``--out`` holds decides:

- an unfinished run (``_state.json``) of other settings or inputs (a corrected rerun: another input list, another
  tokenizer, a fixed file) is replaced: its shards are deleted and this run starts over;
- a finished output (``meta.json``) of the same settings is left as is ("nothing to do"); of other settings it is
  refused unless ``overwrite`` (``--overwrite``) deletes it first.

A run that fails on its input (a ``--strict`` error, no text left for the train split, too few tokens for
``seq_len``) deletes what it wrote and the directories it created, so ``--out`` is as it was; an interruption or an
OS error (a full disk) keeps the finished groups for a resume. Every file is written under a temporary name and
renamed (``zero2all.fileio``); the temporaries a killed run leaves are deleted on resume.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zero2all.config import ConfigError
from zero2all.corpus.mixture import temperature_weights
from zero2all.corpus.pieces import MAX_PIECE_CHARS, text_pieces
from zero2all.corpus.readers import ReadStats, SourceSpec, check_out_outside_inputs, expand_paths, iter_records
from zero2all.fileio import (
    LOCK_FILE,
    OUTPUT_MARKER,
    AtomicFile,
    atomic_write,
    claim_output_dir,
    locked_output_dir,
    read_output_marker,
    temporary_target,
    write_output_marker,
)

META_FILE = "meta.json"
STATE_FILE = "_state.json"
TOKENIZER_COPY = "tokenizer"  # the tokenizer that made the shards, kept with them (meta.json names it by hash)
FORMAT = "zero2all-shards"
FORMAT_VERSION = 1


class TokenizerMismatchError(ValueError):
    """Shards were made with another tokenizer than the one in use."""


class ShardError(ConfigError):
    """A token shard or its index does not match meta.json (truncated, replaced, damaged), or holds token ids the
    model has no rows for. A ConfigError: the command prints its one line and exits with code 2."""


_SHARD_DTYPES = ("uint16", "uint32")
_SCAN_TOKENS = 1 << 24  # tokens per numpy pass of the id scan: 32 MB of uint16, a bounded amount of memory


def rebuild_hint(data_dir) -> str:
    return f"re-run `z2all prepare` with --overwrite to rebuild {data_dir}"


def shard_dtype_of(meta: dict, data_dir) -> np.dtype:
    """meta.json's token dtype, which must be one `prepare` writes."""
    name = meta.get("dtype")
    if name not in _SHARD_DTYPES:
        raise ShardError(f"{Path(data_dir) / META_FILE}: dtype {name!r} is not one of {', '.join(_SHARD_DTYPES)}; "
                         f"{rebuild_hint(data_dir)}")
    return np.dtype(name)


def check_shard_size(path: Path, tokens: int, dtype: np.dtype, data_dir) -> None:
    """The shard file holds exactly ``tokens`` tokens of ``dtype``, as meta.json says."""
    if not path.exists():
        raise ShardError(f"{path}: listed in meta.json but missing; {rebuild_hint(data_dir)}")
    size = path.stat().st_size
    if size != tokens * dtype.itemsize:
        what = "truncated" if size < tokens * dtype.itemsize else "longer than listed"
        raise ShardError(f"{path}: {size:,} bytes, but meta.json lists {tokens:,} tokens of {dtype.name} "
                         f"({tokens * dtype.itemsize:,} bytes): the shard is {what} or was replaced; "
                         f"{rebuild_hint(data_dir)}")


def load_offsets(path: Path, docs: int | None, tokens: int, data_dir, mmap: bool = True) -> np.ndarray:
    """A document index (``.idx.npy``: int64 offsets, ``docs + 1`` of them, from 0 to ``tokens``, non-decreasing),
    loaded without unpickling anything; anything else is a :class:`ShardError` naming the file."""
    if not path.exists():
        raise ShardError(f"{path}: listed in meta.json but missing; {rebuild_hint(data_dir)}")
    try:
        offsets = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise  # an operating-system failure (permissions, I/O), reported as such
        raise ShardError(f"{path}: not a document index written by `z2all prepare` (not a plain .npy array); "
                         f"{rebuild_hint(data_dir)}") from None
    problem = None
    if not isinstance(offsets, np.ndarray) or offsets.dtype != np.int64 or offsets.ndim != 1:
        problem = f"expected a 1-d int64 array, found {getattr(offsets, 'dtype', type(offsets).__name__)}"
    elif docs is not None and len(offsets) != docs + 1:
        problem = f"{len(offsets) - 1} documents, meta.json lists {docs}"
    elif len(offsets) == 0 or int(offsets[0]) != 0 or int(offsets[-1]) != tokens:
        problem = f"its offsets do not span the shard's {tokens:,} tokens"
    elif len(offsets) > 1 and bool((np.diff(offsets) < 0).any()):
        problem = "its offsets decrease"
    if problem:
        raise ShardError(f"{path}: damaged document index ({problem}); {rebuild_hint(data_dir)}")
    return offsets


def max_token_id(tokens: np.ndarray) -> int:
    """The largest id in ``tokens`` (a memmap is read in passes of ``_SCAN_TOKENS``), -1 when empty."""
    best = -1
    for i in range(0, len(tokens), _SCAN_TOKENS):
        best = max(best, int(tokens[i:i + _SCAN_TOKENS].max()))
    return best


def check_token_ids(path: Path, max_id: int, vocab_size: int, data_dir, recorded: int | None = None) -> None:
    """Every id of the shard ``path`` (largest: ``max_id``) is a row of a model of ``vocab_size``; and not above
    what `prepare` recorded for it, when it did (``recorded``)."""
    if recorded is not None and max_id > recorded:
        raise ShardError(f"{path}: holds token id {max_id}, but `z2all prepare` wrote none above {recorded}: the "
                         f"shard was changed after it was written; {rebuild_hint(data_dir)}")
    if max_id >= vocab_size:
        raise ShardError(f"{path}: holds token id {max_id}, but the model has {vocab_size} token rows "
                         f"(model.vocab_size, padded): set model.vocab_size to at least {max_id + 1} if the shards "
                         f"were made with a larger tokenizer, else {rebuild_hint(data_dir)}")


class NoDocumentsError(ValueError):
    """The inputs left no text for the train split (every record skipped or empty, or all held out)."""


def shard_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _unit_hashes(source: str, text: str, seed: int = 0) -> tuple[float, float]:
    """Two independent uniforms in [0, 1) from the document's content: (split, sampling). A non-zero ``seed``
    changes the sampling draw only."""
    key = source.encode() + b"\0" + text.encode("utf-8", "surrogatepass")
    h = hashlib.blake2b(key, digest_size=16).digest()
    u_sample = int.from_bytes(h[8:], "little") / 2**64
    if seed:
        h2 = hashlib.blake2b(key, digest_size=8, salt=seed.to_bytes(16, "little", signed=True)).digest()
        u_sample = int.from_bytes(h2, "little") / 2**64
    return int.from_bytes(h[:8], "little") / 2**64, u_sample


def copies_of(weight: float, u: float) -> int:
    """floor(w) copies plus one with probability frac(w): expectation exactly ``weight``."""
    base = math.floor(weight)
    return base + (1 if u < weight - base else 0)


# --------------------------------------------------------------------------------------------------------------
# worker side


_WORKER: dict = {}
_NSTATS = 7  # per-source counters, see ChunkResult.per_source


def _init_worker(tokenizer_dir: str, names: list[str], weights: list[float], valid_fraction: float, seed: int = 0,
                 tok=None, piece_chars: int = MAX_PIECE_CHARS, decontam=None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no nested thread pools
    if tok is None:
        from zero2all.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer_dir)
    _WORKER.update(tok=tok, names=names, weights=weights, valid_fraction=valid_fraction, seed=seed,
                   dtype=shard_dtype(tok.vocab_size), eos=tok.eos_id, piece_chars=piece_chars, decontam=decontam)


def _encode_document(tok, text: str, dtype: np.dtype, piece_chars: int) -> np.ndarray:
    """A document's tokens followed by eos. A document longer than ``piece_chars`` characters is encoded piece by
    piece (``zero2all.corpus.pieces``): the tokenizer's working memory stays that of one piece, and only the compact
    token array grows with the document."""
    parts = [np.asarray(tok.encode(piece), dtype=dtype) for piece in text_pieces(text, piece_chars)]
    return np.concatenate(parts + [np.asarray([tok.eos_id], dtype=dtype)])


@dataclass
class ChunkResult:
    index: int
    train: np.ndarray          # tokens, each document followed by eos
    train_lens: np.ndarray     # int64 length (incl. eos) of each train document copy
    valid: np.ndarray
    valid_lens: np.ndarray
    per_source: dict           # name -> [docs, docs_train, docs_valid, tokens_train, tokens_valid, bytes,
    #                                     docs not held out (train candidates)]
    text_bytes: int
    contaminated: dict = dataclasses.field(default_factory=dict)  # set -> {"docs", "examples"} (decontamination)


def tokenize_chunk(index: int, texts: list[str], sources: list[int], pins: list | None = None) -> ChunkResult:
    """Tokenize one chunk: split / sample each document, encode the kept ones, lay out the token arrays.
    ``pins[i]``: True / False puts document i in valid / train whatever its hash; None lets the hash decide."""
    w = _WORKER
    tok, names, weights, vf, dtype, eos = w["tok"], w["names"], w["weights"], w["valid_fraction"], w["dtype"], w["eos"]
    plan = []  # (text position, copies, is_valid)
    per_source = collections.defaultdict(lambda: [0] * _NSTATS)
    text_bytes = 0
    dindex, contaminated = w.get("decontam"), {}
    for i, (text, s) in enumerate(zip(texts, sources)):
        if dindex is not None and _contaminated(dindex, text, names[s], contaminated):
            continue
        u_split, u_sample = _unit_hashes(names[s], text, w.get("seed", 0))
        pin = pins[i] if pins is not None else None
        is_valid = u_split < vf if pin is None else pin
        n = copies_of(weights[s], u_sample)
        if is_valid:
            n = min(n, 1)
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        text_bytes += nbytes
        stats = per_source[names[s]]
        stats[0] += 1
        stats[5] += nbytes
        stats[6] += not is_valid
        if n:
            plan.append((i, n, is_valid))
    limit = w.get("piece_chars", MAX_PIECE_CHARS)
    short = [i for i, _, _ in plan if len(texts[i]) <= limit]  # whole, in one batch (as ever)
    encoded = dict(zip(short, tok.encode_batch([texts[i] for i in short]))) if short else {}
    parts: dict = {False: ([], []), True: ([], [])}
    for i, n, is_valid in plan:
        arrs, lens = parts[is_valid]
        if i in encoded:
            ids = encoded.pop(i)
            doc = np.empty(len(ids) + 1, dtype=dtype)
            doc[:-1] = ids
            doc[-1] = eos
        else:
            doc = _encode_document(tok, texts[i], dtype, limit)
        stats = per_source[names[sources[i]]]
        for _ in range(n):
            arrs.append(doc)
            lens.append(len(doc))
        stats[2 if is_valid else 1] += n
        stats[4 if is_valid else 3] += n * len(doc)

    def cat(arrs):
        return np.concatenate(arrs) if arrs else np.empty(0, dtype=dtype)

    return ChunkResult(index, cat(parts[False][0]), np.asarray(parts[False][1], dtype=np.int64),
                       cat(parts[True][0]), np.asarray(parts[True][1], dtype=np.int64), dict(per_source), text_bytes,
                       contaminated)


_DECONTAM_EXAMPLES = 3


def _contaminated(dindex, text: str, source: str, acc: dict) -> bool:
    """Count ``text`` against each evaluation set it shares an n-gram with; True if it is to be dropped (the
    index's ``report_only`` attribute keeps it)."""
    hits = dindex.match(text)
    for name, ngram in hits.items():
        c = acc.setdefault(name, {"docs": 0, "examples": []})
        c["docs"] += 1
        if len(c["examples"]) < _DECONTAM_EXAMPLES:
            c["examples"].append({"data_src": source, "text": text[:160], "ngram": ngram})
    return bool(hits) and not dindex.report_only


def merge_contaminated(acc: dict, part: dict) -> dict:
    for name, c in part.items():
        t = acc.setdefault(name, {"docs": 0, "examples": []})
        t["docs"] += c["docs"]
        t["examples"] += c["examples"][:max(_DECONTAM_EXAMPLES - len(t["examples"]), 0)]
    return acc


def _tokenize_chunk_args(args):
    return tokenize_chunk(*args)


# --------------------------------------------------------------------------------------------------------------
# main side


def _parse_sources(inputs, weights: dict | None, text_field: str | None) -> list[SourceSpec]:
    if isinstance(inputs, (str, os.PathLike, SourceSpec)):
        inputs = [inputs]
    specs = [x if isinstance(x, SourceSpec) else SourceSpec.parse(str(x), text_field=text_field) for x in inputs]
    seen = {}
    for s in specs:
        if s.name in seen:
            raise ValueError(f"two inputs are both named {s.name!r} ({seen[s.name]} and {s.paths}); name them "
                             f"with NAME=PATH")
        seen[s.name] = s.paths
    for name, w in (weights or {}).items():
        if name not in seen:
            raise ValueError(f"--source {name}={w}: no input named {name!r} (inputs: {', '.join(seen)})")
        if not (isinstance(w, (int, float)) and w >= 0 and math.isfinite(w)):
            raise ValueError(f"--source {name}={w}: the weight must be a finite number >= 0")
        next(s for s in specs if s.name == name).weight = float(w)
    return specs


def measure_sources(specs: list[SourceSpec], txt_mode: str = "file", sample_bytes: int | None = None) -> dict:
    """{source: {"bytes", "docs", "estimated"}}: the UTF-8 text bytes and documents of each source, counted over its
    records. Past ``sample_bytes`` of text the count stops at the next file boundary and the remaining files are
    extrapolated from the text (and documents) per on-disk byte of the files read (``estimated`` is then True)."""
    sizes = {}
    for spec in specs:
        stats = ReadStats()
        files = [f for p in spec.paths for f in expand_paths(str(p))]
        nbytes = docs = 0
        read_files, stopped, last_file = len(files), False, 0
        for rec in iter_records(spec, txt_mode=txt_mode, stats=stats):
            if sample_bytes is not None and nbytes >= sample_bytes and stats.files > last_file:
                read_files, stopped = stats.files - 1, True  # this record opens a new file: stop before it
                break
            nbytes += len(rec["content"].encode("utf-8", "surrogatepass"))
            docs += 1
            last_file = stats.files
        entry = {"bytes": nbytes, "docs": docs, "estimated": False}
        if stopped and read_files < len(files):
            disk_read = sum(os.path.getsize(f) for f in files[:read_files])
            disk_rest = sum(os.path.getsize(f) for f in files[read_files:])
            if disk_read > 0:
                entry = {"bytes": round(nbytes + nbytes / disk_read * disk_rest),
                         "docs": round(docs + docs / disk_read * disk_rest), "estimated": True}
        sizes[spec.name] = entry
    return sizes


def plan_mixture(sizes: dict[str, float], explicit: dict[str, float], temperature: float | None = None,
                 target_bytes: float | None = None, max_epochs: float | None = None) -> tuple[dict, list[str]]:
    """({source: weight}, notes): temperature weights for the sources without an explicit weight, scaled so that
    the expected output (sum of weight * size) is ``target_bytes`` (default: the corpus size), explicit weights
    taken as given, copies per document capped at ``max_epochs`` (the clipped budget goes to the other sources)."""
    if temperature is not None and not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"--temperature {temperature}: must be a finite number > 0")
    if max_epochs is not None and not (max_epochs >= 1 and math.isfinite(max_epochs)):
        raise ValueError(f"--max-epochs {max_epochs}: must be a finite number >= 1")
    if target_bytes is not None and not (target_bytes > 0 and math.isfinite(target_bytes)):
        raise ValueError(f"--target-mb {target_bytes / 1e6:g}: must be a finite number > 0")
    notes: list[str] = []
    for name, w in explicit.items():
        if max_epochs is not None and w > max_epochs:
            raise ValueError(f"--source {name}={w:g}: above --max-epochs {max_epochs:g} (copies per document); lower "
                             f"one of them")
    weights = {name: float(w) for name, w in explicit.items()}
    free = [k for k in sizes if k not in explicit]
    if not free:
        return weights, notes
    if temperature is None and target_bytes is None:
        return {**{k: 1.0 for k in free}, **weights}, notes
    budget = float(target_bytes) if target_bytes is not None else float(sum(sizes.values()))
    remaining = budget - sum(weights[k] * sizes[k] for k in weights)
    if remaining < 0:
        raise ValueError(f"--target-mb {budget / 1e6:g}: the explicit --source weights alone give "
                         f"{(budget - remaining) / 1e6:g} MB; raise --target-mb or lower them")
    sized = [k for k in free if sizes[k] > 0]
    temp_w = temperature_weights({k: sizes[k] for k in sized}, temperature or 1.0)
    total_free = sum(sizes[k] for k in sized)
    share = {k: temp_w[k] * sizes[k] / total_free for k in sized}  # target share of the free budget
    capped: dict[str, float] = {}
    active = list(sized)
    first: dict[str, float] = {}
    while active:
        rest = remaining - sum(max_epochs * sizes[k] for k in capped)
        norm = sum(share[k] for k in active)
        for k in active:
            weights[k] = rest * share[k] / norm / sizes[k] if norm > 0 else 0.0
            first.setdefault(k, weights[k])
        over = [k for k in active if max_epochs is not None and weights[k] > max_epochs]
        if not over:
            break
        for k in over:
            capped[k] = weights[k] = float(max_epochs)
            active.remove(k)
    for k in capped:
        notes.append(f"--max-epochs {max_epochs:g}: {k} capped at {max_epochs:g} copies per document (the temperature "
                     f"asked for {first[k]:.3g}); its excess goes to the other sources")
    planned = sum(weights[k] * sizes[k] for k in weights if k in sizes)
    if capped and not active and planned < budget * (1 - 1e-9):
        notes.append(f"--max-epochs {max_epochs:g}: every source is capped; the output is {planned / 1e6:.3g} MB of "
                     f"text, not the {budget / 1e6:.3g} MB budget")
    for k in free:
        weights.setdefault(k, 1.0)  # an empty source: nothing to sample
    return weights, notes


def _chunks(specs: list[SourceSpec], chunk_bytes: int, stats: ReadStats, txt_mode: str, strict: bool):
    """(chunk index, texts, source indices, split pins or None), cut every ~chunk_bytes of text: the same cut for
    any worker count. A pin is True / False for a record whose ``split`` field says valid / train."""
    texts, srcs, pins, size, index = [], [], [], 0, 0
    for s_index, spec in enumerate(specs):
        for rec in iter_records(spec, txt_mode=txt_mode, strict=strict, stats=stats):
            text = rec["content"]
            texts.append(text)
            srcs.append(s_index)
            split = rec["others"].get("split") if isinstance(rec.get("others"), dict) else None
            pins.append({"valid": True, "train": False}.get(split) if isinstance(split, str) else None)
            size += len(text)
            if size >= chunk_bytes:
                yield index, texts, srcs, (pins if any(p is not None for p in pins) else None)
                texts, srcs, pins, size, index = [], [], [], 0, index + 1
    if texts:
        yield index, texts, srcs, (pins if any(p is not None for p in pins) else None)


def _fingerprint(specs, tokenizer_hash, valid_fraction, chunk_bytes, shard_chunks, txt_mode, dtype) -> dict:
    return {"sources": [{"name": s.name, "paths": [str(p) for p in s.paths], "text_field": s.text_field,
                         "weight": s.weight} for s in specs],
            "tokenizer_hash": tokenizer_hash, "valid_fraction": valid_fraction, "chunk_bytes": chunk_bytes,
            "shard_chunks": shard_chunks, "txt_mode": txt_mode, "dtype": str(dtype)}


def _input_stamp(specs: list[SourceSpec]) -> dict:
    """{file: [size, mtime_ns]} of every input file: an unfinished run resumes only over the same files."""
    stamp = {}
    for s in specs:
        for p in s.paths:
            for f in expand_paths(str(p)):
                st = os.stat(f)
                stamp[f] = [st.st_size, st.st_mtime_ns]
    return stamp


def _run_key(fingerprint: dict, stamp: dict) -> str:
    """What a resume must match: the settings (sources, tokenizer, split, chunking) and the input files as they
    are now. Finished shard groups carry it; only groups with this run's key are reused."""
    return _hash_obj({"fingerprint": fingerprint, "inputs": stamp})


def _difference(old_fp: dict, fingerprint: dict, old_stamp: dict | None, stamp: dict) -> str:
    diff = [k for k in fingerprint if old_fp.get(k) != fingerprint[k]]
    if diff:
        return f"settings ({', '.join(diff)} differ)"
    changed = sorted(set(stamp) ^ set(old_stamp or {}) | {f for f in stamp if (old_stamp or {}).get(f) != stamp[f]})
    if old_stamp is None or not changed:
        return "inputs"
    return f"input files ({changed[0]}{f' and {len(changed) - 1} more' if len(changed) > 1 else ''} changed)"


def _check_existing(out: Path, fingerprint: dict, stamp: dict, overwrite: bool, log) -> dict | None:
    """What ``out`` holds decides: a FINISHED output (meta.json) of other settings is refused (``--overwrite``
    replaces it) and one of the same settings is returned as is; an UNFINISHED run (``_state.json``) of other
    settings or input files is replaced (its shards are deleted, never mixed with this run's)."""
    if overwrite:
        _remove_outputs(out)
        return None
    meta_file = out / META_FILE
    if meta_file.exists():
        old = json.loads(meta_file.read_text(encoding="utf-8"))
        old_fp = old.get("fingerprint", {})
        if old_fp.get("tokenizer_hash") != fingerprint["tokenizer_hash"]:
            raise TokenizerMismatchError(
                f"{out} holds a finished `z2all prepare` output made with tokenizer "
                f"{str(old_fp.get('tokenizer_hash'))[:16]}, not {fingerprint['tokenizer_hash'][:16]}; use another "
                f"--out, or --overwrite to replace it")
        if old_fp != fingerprint:
            raise ValueError(f"{out} holds a finished `z2all prepare` output made with other "
                             f"{_difference(old_fp, fingerprint, None, stamp)}; use another --out, or --overwrite "
                             f"to replace it")
        return old
    state_file = out / STATE_FILE
    if state_file.exists():
        try:
            old = json.loads(state_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = {}
        if old.get("run_key") != _run_key(fingerprint, stamp):
            groups = len(list(out.glob("shard_*.json")))
            reason = _difference(old.get("fingerprint", {}), fingerprint, old.get("inputs"), stamp)
            log(f"{out}: an unfinished run with other {reason} was here; replacing it ({groups} finished shard "
                f"group{'s' if groups != 1 else ''} deleted)")
            _remove_outputs(out)
    return None


_OUTPUT_NAME = re.compile(r"^((train|valid)_\d{5}\.(bin|idx\.npy)|shard_\d{5}\.json)$")
# the temporaries of earlier versions: .train_00000.bin.tmp, and .NAME.<8 characters>.tmp from tempfile.mkstemp
_OLD_TEMPORARY = re.compile(r"^\.((train|valid)_\d{5}\.bin|((train|valid)_\d{5}\.idx\.npy|shard_\d{5}\.json|"
                            r"meta\.json|_state\.json)\.[a-z0-9_]{8})\.tmp$")


def _is_output(name: str) -> bool:
    return name in (META_FILE, STATE_FILE, OUTPUT_MARKER) or bool(_OUTPUT_NAME.match(name))


def _is_temporary(name: str) -> bool:
    """A temporary of one of our outputs (``fileio`` names them ``.NAME.<random>.tmp``)."""
    target = temporary_target(name)
    return (target is not None and _is_output(target)) or bool(_OLD_TEMPORARY.match(name))


def _remove_outputs(out: Path, keep: set[str] = frozenset(), only: set[str] | None = None) -> None:
    """Delete what `prepare` writes (and only that: other files in the directory stay), except the names in
    ``keep``; with ``only``, just the names in it."""
    for f in out.iterdir():
        if f.name in keep or (only is not None and f.name not in only):
            continue
        if f.is_file() and (_is_output(f.name) or _is_temporary(f.name)):
            f.unlink()
        elif f.name == TOKENIZER_COPY and f.is_dir() and _is_tokenizer_copy(f):
            shutil.rmtree(f)


def _is_tokenizer_copy(d: Path) -> bool:
    """A folder of nothing but tokenizer files (what `Tokenizer.save` writes): the copy `prepare` keeps."""
    names = {p.name for p in d.iterdir()}
    return "tokenizer.json" in names and names <= {"tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                                                   "special_tokens_map.json", "z2all_tokenizer.json"}


def shard_tokenizer(data_dir, meta: dict | None = None, log=print):
    """(the tokenizer directory of a `prepare` output, its Tokenizer), or (None, None) when it has none.

    The copy kept with the shards (``tokenizer/``, by hash in meta.json) when there is one: it made the shards, so
    the folder it was copied from may since hold another tokenizer, and the shards may have moved (a note says so
    when the recorded folder changed). Outputs of earlier versions name only that folder: it is used when its
    hash is still the shards' (else :class:`TokenizerMismatchError`, one line); a folder that is gone gives a
    warning line and (None, None)."""
    from zero2all.tokenizer import load_tokenizer

    data_dir = Path(data_dir)
    meta = meta if meta is not None else read_meta(data_dir)
    info = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else {}
    expected, recorded = info.get("hash"), info.get("dir")
    recorded_dir = Path(recorded) if isinstance(recorded, str) and recorded else None
    if recorded_dir is not None and not recorded_dir.is_absolute():
        recorded_dir = data_dir / recorded_dir
    copy = data_dir / info["copy"] if isinstance(info.get("copy"), str) else None
    if copy is not None and (copy / "tokenizer.json").is_file():
        tok = load_tokenizer(copy)
        if expected and tok.hash != expected:
            raise TokenizerMismatchError(f"{copy}: tokenizer {tok.hash[:16]}, but the shards were made with "
                                         f"{expected[:16]} (meta.json): the copy was changed; "
                                         f"{rebuild_hint(data_dir)}")
        if recorded_dir is not None and (recorded_dir / "tokenizer.json").is_file():
            try:
                now = load_tokenizer(recorded_dir).hash
            except ValueError:
                now = None
            if now != tok.hash:
                log(f"note: {recorded_dir} no longer holds the tokenizer that made {data_dir}; using the copy kept "
                    f"with the shards ({copy}, {tok.hash[:16]})")
        return copy, tok
    if recorded_dir is None:
        return None, None
    if not (recorded_dir / "tokenizer.json").is_file():
        log(f"warning: {recorded_dir}, the tokenizer that made {data_dir}, is gone (shards written before "
            f"`prepare` kept a copy of their tokenizer); checkpoints will carry no tokenizer: re-run `z2all prepare` "
            f"with --overwrite to keep one with the shards")
        return None, None
    tok = load_tokenizer(recorded_dir)
    if expected and tok.hash != expected:
        raise TokenizerMismatchError(
            f"{recorded_dir}: holds tokenizer {tok.hash[:16]}, but {data_dir} was made with {expected[:16]} (the "
            f"folder changed since `prepare`, which did not yet keep a copy with the shards); put that tokenizer "
            f"back, or {rebuild_hint(data_dir)} (the new output keeps its own copy)")
    return recorded_dir, tok


def _group_name(split: str, g: int) -> str:
    return f"{split}_{g:05d}"


class _GroupWriter:
    """Accumulates one shard group (a train and a valid shard) in temporary files; ``finish`` renames them into
    place and writes the group's completion marker last."""

    def __init__(self, out: Path, g: int, dtype: np.dtype):
        self.out, self.g, self.dtype = out, g, dtype
        self.shards: dict[str, AtomicFile] = {}
        try:
            for s in ("train", "valid"):
                self.shards[s] = AtomicFile(out / f"{_group_name(s, g)}.bin", "wb")
        except BaseException:
            self.abort()
            raise
        self.lens = {"train": [], "valid": []}
        self.max_id = {"train": -1, "valid": -1}  # recorded per shard: checked against a model's vocabulary
        self.per_source: dict = collections.defaultdict(lambda: [0] * _NSTATS)
        self.contaminated: dict = {}
        self.chunks = 0

    def add(self, r: ChunkResult) -> None:
        for split, arr, lens in (("train", r.train, r.train_lens), ("valid", r.valid, r.valid_lens)):
            self.shards[split].file.write(arr.tobytes())
            self.lens[split].append(lens)
            if len(arr):
                self.max_id[split] = max(self.max_id[split], int(arr.max()))
        for name, v in r.per_source.items():
            acc = self.per_source[name]
            for i, x in enumerate(v):
                acc[i] += x
        merge_contaminated(self.contaminated, r.contaminated)
        self.chunks += 1

    def finish(self, run_key: str) -> dict:
        info = {"group": self.g, "chunks": self.chunks, "per_source": dict(self.per_source)}
        if self.contaminated:
            info["contaminated"] = self.contaminated
        for split in ("train", "valid"):
            lens = np.concatenate(self.lens[split]) if self.lens[split] else np.empty(0, np.int64)
            offsets = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(lens, out=offsets[1:])
            base = _group_name(split, self.g)
            with atomic_write(self.out / f"{base}.idx.npy", "wb") as fi:
                np.save(fi, offsets)
            self.shards[split].commit()
            info[split] = {"bin": f"{base}.bin", "idx": f"{base}.idx.npy", "tokens": int(offsets[-1]),
                           "docs": int(len(lens)), "max_id": self.max_id[split]}
        info["run_key"] = run_key
        with atomic_write(self.out / f"shard_{self.g:05d}.json") as f:
            json.dump(info, f, indent=1)
        return info

    def abort(self) -> None:
        for shard in self.shards.values():
            if not shard.closed:
                shard.discard()


def _hash_obj(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _completed_groups(out: Path, run_key: str) -> dict[int, dict]:
    done = {}
    for f in sorted(out.glob("shard_*.json")):
        info = json.loads(f.read_text(encoding="utf-8"))
        files_ok = all((out / info[s]["bin"]).exists() and (out / info[s]["idx"]).exists() for s in ("train", "valid"))
        if info.get("run_key") == run_key and files_ok:
            done[info["group"]] = info
    return done


class _Progress:
    """tqdm bar in MB of text with tokens/s in the postfix (silent when disabled)."""

    def __init__(self, enabled: bool):
        self.t0 = time.time()
        self.bytes = 0
        self.tokens = 0
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(unit="B", unit_scale=True, unit_divisor=1000, desc="prepare", mininterval=0.5,
                            file=sys.stderr, dynamic_ncols=True)

    def update(self, nbytes: int, ntokens: int) -> None:
        self.bytes += nbytes
        self.tokens += ntokens
        if self.bar is not None:
            self.bar.update(nbytes)
            dt = max(time.time() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.tokens / dt / 1e6:.2f}M tok/s, {self.tokens / 1e6:.1f}M tok",
                                     refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def prepare(inputs, tokenizer_dir, out_dir, *, valid_fraction: float = 0.01, workers: int | None = None,
            weights: dict | None = None, text_field: str | None = None, txt_mode: str = "file",
            strict: bool = False, chunk_bytes: int = 1 << 20, shard_chunks: int = 256, seq_len: int | None = None,
            overwrite: bool = False, progress: bool | None = None, command: str | None = None, log=print,
            temperature: float | None = None, target_mb: float | None = None, max_epochs: float | None = None,
            seed: int = 0, size_sample_mb: float = 256.0, piece_chars: int = MAX_PIECE_CHARS,
            decontaminate: list[str] | None = None, decontam_ngram: int = 13, decontam_report_only: bool = False,
            ray: bool | None = None, _stop_after_groups: int | None = None) -> dict:
    """Tokenize ``inputs`` with the tokenizer in ``tokenizer_dir`` into shards in ``out_dir`` (see the module
    docstring). ``workers``: processes (default: all cores; 1 = in this process). ``weights``: {source name:
    mixture weight}; ``temperature`` / ``target_mb`` / ``max_epochs`` / ``seed``: source sampling (see the module
    docstring; ``size_sample_mb`` bounds the size pass per source). ``seq_len`` (optional) checks each split has
    at least one window. ``piece_chars``: documents longer than this are tokenized in pieces (bounded memory; see
    ``zero2all.corpus.pieces``). ``decontaminate``: evaluation sets (:mod:`zero2all.corpus.decontam`); documents
    sharing a ``decontam_ngram``-word n-gram with one are dropped (counted only with ``decontam_report_only``).
    ``ray``: tokenize on Ray actors (:mod:`zero2all.corpus.on_ray`; None: when ``RAY_ADDRESS`` is set), the same
    shards byte for byte. Returns meta.json's dict.
    ``_stop_after_groups`` simulates an interruption (tests)."""
    from zero2all.tokenizer import load_tokenizer

    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction: must be in [0, 1), got {valid_fraction}")
    from zero2all.corpus.on_ray import connect, ray_requested, ray_workers

    use_ray = ray_requested(ray)
    if use_ray:
        connect()  # a missing extra or an unreachable cluster is said before anything else
    t0 = time.time()
    tok = load_tokenizer(tokenizer_dir)
    if tok.eos_id is None:
        raise ValueError(f"{tokenizer_dir}: the tokenizer has no <|endoftext|> / eos token to separate documents")
    dtype = shard_dtype(tok.vocab_size)
    specs = _parse_sources(inputs, weights, text_field)
    explicit = {k: float(v) for k, v in (weights or {}).items()}
    plan_mixture({}, explicit, temperature, None if target_mb is None else target_mb * 1e6, max_epochs)  # checks
    if not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise ValueError(f"--seed {seed}: must be an integer in [0, 2^63)")
    if not size_sample_mb > 0:
        raise ValueError(f"size_sample_mb: must be > 0, got {size_sample_mb}")
    mix = {"temperature": temperature, "target_mb": target_mb, "max_epochs": max_epochs, "seed": seed,
           "explicit": sorted(explicit), "size_sample_mb": size_sample_mb}
    workers = ray_workers(connect(), workers) if use_ray else max(1, workers or os.cpu_count() or 1)
    fingerprint = _fingerprint(specs, tok.hash, valid_fraction, chunk_bytes, shard_chunks, txt_mode, dtype)
    if temperature is not None or target_mb is not None or max_epochs is not None or seed:
        fingerprint["mixture"] = mix  # absent otherwise: outputs made before these options stay valid
    if piece_chars != MAX_PIECE_CHARS:
        fingerprint["piece_chars"] = piece_chars
    stamp = _input_stamp(specs)  # a missing input fails here, before anything is written
    dindex = None
    if decontaminate:
        from zero2all.corpus.decontam import build_index

        dindex = build_index(decontaminate, decontam_ngram, log=log)  # before anything is written
        dindex.report_only = decontam_report_only
        fingerprint["decontam"] = {"index": dindex.digest, "report_only": decontam_report_only}
    check_out_outside_inputs(specs, out_dir)
    out = Path(out_dir)
    # new, empty or a `prepare` output (to resume, or replace with --overwrite); a folder of other files: refused
    claim_output_dir(out, "prepare", inputs=[tokenizer_dir, *([inputs] if isinstance(inputs, (str, os.PathLike))
                                                              else inputs)], legacy=_is_legacy_output)
    run = _PrepareRun(out=out, tok=tok, tokenizer_dir=tokenizer_dir, specs=specs, fingerprint=fingerprint,
                      stamp=stamp, dtype=dtype, workers=workers, valid_fraction=valid_fraction, txt_mode=txt_mode,
                      strict=strict, chunk_bytes=chunk_bytes, shard_chunks=shard_chunks, seq_len=seq_len,
                      overwrite=overwrite, progress=progress, command=command, log=log, t0=t0, mix=mix,
                      explicit=explicit, piece_chars=piece_chars, dindex=dindex, use_ray=use_ray,
                      stop_after_groups=_stop_after_groups)
    with locked_output_dir(out, on_takeover=log):  # one run per folder: a second one is refused
        return _prepare_locked(run)


@dataclass
class _PrepareRun:
    """One ``prepare`` run as :func:`prepare` checked and resolved it: what the steps below share."""

    out: Path
    tok: object                  # the loaded tokenizer
    tokenizer_dir: object
    specs: list                  # SourceSpec per source, weights set by _plan_sources
    fingerprint: dict            # the settings that decide the output (meta.json, _state.json)
    stamp: dict                  # the inputs' sizes and times
    dtype: np.dtype              # the shards' token dtype
    workers: int
    valid_fraction: float
    txt_mode: str
    strict: bool
    chunk_bytes: int
    shard_chunks: int            # chunks per shard group
    seq_len: int | None
    overwrite: bool
    progress: bool | None
    command: str | None
    log: object
    t0: float
    mix: dict                    # the source-sampling settings
    explicit: dict               # the weights given per source
    piece_chars: int = MAX_PIECE_CHARS
    dindex: object = None        # the decontamination index (None: off)
    use_ray: bool = False
    stop_after_groups: int | None = None   # tests: an interruption after this many new groups


def _prepare_locked(run: _PrepareRun) -> dict:
    out = run.out
    before = _snapshot(out)
    try:
        return _prepare_into(run)
    except Exception as e:
        # Bad or insufficient input (a --strict error, no documents, too few tokens for --seq-len): take back
        # what this run wrote, so --out is as it was. An OS error (a full disk) or an interruption keeps the
        # finished shard groups for a resume.
        if not isinstance(e, OSError) or isinstance(e, FileNotFoundError):
            now = _snapshot(out)
            written = {name for name in now if before.get(name) != now[name]}  # new, or replaced (atomic writes)
            _remove_outputs(out, keep={STATE_FILE} if STATE_FILE in before else set(), only=written)
        raise  # locked_output_dir removes a folder this run created once only its lock file is left


def _snapshot(out: Path) -> dict[str, tuple[int, int, int]]:
    """{name: (inode, size, mtime_ns)} of the files in ``out``: what a failed run compares to find what it wrote."""
    snap = {}
    for entry in os.scandir(out):
        if entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            snap[entry.name] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return snap


def _prepare_into(run: _PrepareRun) -> dict:
    """Resume or start the run in ``run.out``, tokenize the shard groups still missing, write meta.json."""
    out = run.out
    complete = _check_existing(out, run.fingerprint, run.stamp, run.overwrite, run.log)
    if complete is not None:
        run.log(f"{out}: already complete ({complete['splits']['train']['tokens']:,} train tokens); nothing to do")
        return complete
    run_key = _run_key(run.fingerprint, run.stamp)
    mixture = _plan_sources(out, run.specs, run_key, run.mix, run.explicit, run.txt_mode, run.log)
    done = _start_or_resume(run, run_key, mixture)
    stats = ReadStats()
    groups, tokenized_chunks, bar = _tokenize_groups(run, run_key, done, stats)
    return _finish(run, groups, stats, tokenized_chunks, bar, mixture)


def _start_or_resume(run: _PrepareRun, run_key: str, mixture: dict) -> dict[int, dict]:
    """The shard groups this run finished before (kept); everything else of ``run.out`` that is not this run's
    goes, and ``_state.json`` records the run. Returns {group: its shard_*.json}."""
    out = run.out
    done = _completed_groups(out, run_key)
    # what is not a finished group of this run goes: the temporaries a killed run left, shards of other runs
    _remove_outputs(out, keep={STATE_FILE} | {f"shard_{g:05d}.json" for g in done}
                    | {info[s][k] for info in done.values() for s in ("train", "valid") for k in ("bin", "idx")})
    with atomic_write(out / STATE_FILE) as f:
        json.dump({"fingerprint": run.fingerprint, "run_key": run_key, "inputs": run.stamp,
                   "sizes": mixture["sizes"], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)
    if done:
        run.log(f"{out}: resuming; {len(done)} shard groups already complete")
    return done


def _tokenize_groups(run: _PrepareRun, run_key: str, done: dict, stats: ReadStats):
    """Tokenize the chunks of the groups not ``done`` (in this process, a process pool or Ray actors), each group
    written as it completes. Returns ({group: info}, chunks tokenized, the progress bar)."""
    specs = run.specs
    init_args = (str(run.tokenizer_dir), [s.name for s in specs], [s.weight for s in specs], run.valid_fraction,
                 run.mix["seed"], None, run.piece_chars, run.dindex)
    bar = _Progress(run.progress if run.progress is not None else sys.stderr.isatty())
    groups: dict[int, dict] = dict(done)
    writer: _GroupWriter | None = None
    tokenized_chunks = 0

    def todo():
        for index, texts, srcs, pins in _chunks(specs, run.chunk_bytes, stats, run.txt_mode, run.strict):
            if index // run.shard_chunks not in done:
                yield index, texts, srcs, pins

    def consume(r: ChunkResult):
        nonlocal writer, tokenized_chunks
        g = r.index // run.shard_chunks
        if writer is not None and writer.g != g:
            groups[writer.g] = writer.finish(run_key)
            writer = None
            if run.stop_after_groups is not None and len(groups) - len(done) >= run.stop_after_groups:
                raise KeyboardInterrupt(f"stopped after {run.stop_after_groups} groups (test hook)")
        if writer is None:
            writer = _GroupWriter(run.out, g, run.dtype)
        writer.add(r)
        tokenized_chunks += 1
        bar.update(r.text_bytes, len(r.train) + len(r.valid))

    try:
        if run.use_ray:
            _run_ray(run.workers, init_args, todo(), consume)
        elif run.workers == 1:
            _init_worker(*init_args[:-3], tok=run.tok, piece_chars=run.piece_chars, decontam=run.dindex)
            for args in todo():
                consume(tokenize_chunk(*args))
        else:
            _run_pool(run.workers, init_args, todo(), consume)
        if writer is not None:
            groups[writer.g] = writer.finish(run_key)
            writer = None
    except BaseException:
        if writer is not None:
            writer.abort()
        bar.close()
        raise
    bar.close()
    return groups, tokenized_chunks, bar


def _finish(run: _PrepareRun, groups: dict, stats: ReadStats, tokenized_chunks: int, bar: _Progress,
            mixture: dict) -> dict:
    """Refuse a run with nothing to train on; otherwise write meta.json, drop ``_state.json`` and report."""
    out, log, specs = run.out, run.log, run.specs
    nothing = _nothing_useful(groups, specs, stats, run.valid_fraction)
    if nothing:
        if stats.bad:
            log(stats.report())
        raise NoDocumentsError(f"{nothing}; nothing written to {out}")
    seconds = time.time() - run.t0
    meta = _write_meta(out, groups, specs, run.fingerprint, run.tok, run.tokenizer_dir, run.dtype,
                       run.valid_fraction, stats, seconds, run.command, run.seq_len, tokenized_chunks, bar, mixture,
                       _decontamination(groups, specs, run.dindex))
    (out / STATE_FILE).unlink(missing_ok=True)
    if stats.bad:
        log(stats.report())
    tr, va = meta["splits"]["train"], meta["splits"]["valid"]
    shards = f"{len(tr['shards'])} shard{'s' if len(tr['shards']) != 1 else ''}"
    log(f"wrote {out}: train {tr['tokens']:,} tokens / {tr['docs']:,} docs in {shards}, valid "
        f"{va['tokens']:,} tokens / {va['docs']:,} docs ({run.dtype.name}); {meta['throughput']['mb_per_s']:.1f} "
        f"MB/s, {meta['throughput']['tokens_per_s'] / 1e6:.2f}M tokens/s with {run.workers} workers")
    for line in _source_lines(meta):
        log(line)
    return meta


def _source_lines(meta: dict) -> list[str]:
    lines = ["per source: documents and MB of text in, weight (expected copies per document), effective epochs "
             "(train copies per train document), share of the input bytes -> share of the train tokens"]
    for name, v in meta["sources"].items():
        lines.append(f"  {name}: {v['docs_read']:,} docs, {v['bytes'] / 1e6:,.2f} MB; weight {v['weight']:.4g} "
                     f"({v['weight_from']}); {v['effective_epochs']:.3g} epochs; share {v['share_in']:.1%} -> "
                     f"{v['train_share']:.1%}")
    return lines


def _plan_sources(out: Path, specs: list[SourceSpec], run_key: str, mix: dict, explicit: dict, txt_mode: str,
                  log) -> dict:
    """Set each spec's weight from the source sampling settings; returns what meta.json reports of it. The sizes
    are measured once: a resume reuses those its unfinished run kept in ``_state.json``."""
    sizes, notes = None, []
    if mix["temperature"] is not None or mix["target_mb"] is not None:
        try:
            state = json.loads((out / STATE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            state = {}
        if state.get("run_key") == run_key and state.get("sizes"):
            sizes = state["sizes"]
        else:
            log(f"measuring {len(specs)} source{'s' if len(specs) != 1 else ''} for --temperature/--target-mb "
                f"(a pass over the records, bounded to ~{mix['size_sample_mb']:g} MB of text per source)")
            sizes = measure_sources(specs, txt_mode, int(mix["size_sample_mb"] * 1e6))
    weights, notes = plan_mixture({k: v["bytes"] for k, v in (sizes or {}).items()}, explicit, mix["temperature"],
                                  None if mix["target_mb"] is None else mix["target_mb"] * 1e6, mix["max_epochs"])
    for s in specs:
        s.weight = weights.get(s.name, s.weight)
    for line in notes:
        log(line)
    origin = {s.name: "explicit" if s.name in explicit else
              "temperature" if sizes is not None else "default" for s in specs}
    return {**{k: v for k, v in mix.items() if k != "explicit"}, "sizes": sizes, "notes": notes, "origin": origin}


def _nothing_useful(groups: dict, specs: list[SourceSpec], stats: ReadStats, valid_fraction: float) -> str | None:
    """Why the train split holds no text to train on (None when it does)."""
    train_tokens = sum(g["train"]["tokens"] for g in groups.values())
    train_docs = sum(g["train"]["docs"] for g in groups.values())
    if train_tokens > train_docs:  # more than the separator after each document
        return None
    if stats.records == 0:
        why = f"no documents survived: {stats.skipped:,} skipped"
        if stats.bad:
            why += f" ({', '.join(f'{k}={v}' for k, v in sorted(stats.bad.items()))})"
        why += f", 0 read from {stats.files:,} file{'s' if stats.files != 1 else ''}"
        if stats.examples:
            why += f"; the first: {stats.examples[0]}"
        return why + "; fix the inputs (or --text-field) and run again"
    if stats.bytes == 0:
        return f"the {stats.records:,} documents read hold no text (every one is empty)"
    if train_docs == 0:
        valid_docs = sum(g["valid"]["docs"] for g in groups.values())
        weights = [f"{s.name}={s.weight:g}" for s in specs if s.weight < 1]
        return (f"the train split is empty: of {stats.records:,} documents read, {valid_docs:,} went to the valid "
                f"split (--valid-fraction {valid_fraction:g}) and the rest were sampled away by the --source weights"
                f" ({', '.join(weights) or 'none below 1'})")
    return f"the train split holds no text: its {train_docs:,} documents are empty"


class _RayTokenizer:
    """A Ray actor: one worker's tokenizer, loaded once, then ``tokenize_chunk`` per work unit."""

    def __init__(self, init_args: tuple):
        _init_worker(*init_args)

    def tokenize(self, args):
        return tokenize_chunk(*args)


def _run_ray(workers: int, init_args: tuple, tasks, consume) -> None:
    """As :func:`_run_pool`, on Ray actors (restarted, and their calls retried, if a worker dies)."""
    from zero2all.corpus.on_ray import RETRIES, connect, ordered_map

    ray = connect()
    actor = ray.remote(_RayTokenizer).options(max_restarts=RETRIES, max_task_retries=RETRIES)
    ref = ray.put(init_args)  # the tokenizer folder and the decontamination index: stored once
    actors = [actor.remote(ref) for _ in range(workers)]
    try:
        ordered_map(lambda args, n: actors[n % workers].tokenize.remote(args), tasks, 2 * workers,
                    lambda _args, result: consume(result), ray.get)
    finally:
        for a in actors:
            ray.kill(a)


def _run_pool(workers: int, init_args: tuple, tasks, consume) -> None:
    """Tokenize chunks on ``workers`` processes, at most 2 per worker in flight (bounded memory), results consumed
    in chunk order."""
    # fork (local_pool_context says when not): the workers never use the Rust thread pool
    # (TOKENIZERS_PARALLELISM=false), which is what makes forking a process that used `tokenizers` safe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from zero2all.corpus.on_ray import local_pool_context

    with local_pool_context().Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        pending = collections.deque()
        for args in tasks:
            pending.append(pool.apply_async(_tokenize_chunk_args, (args,)))
            while len(pending) >= 2 * workers:
                consume(pending.popleft().get())
        while pending:
            consume(pending.popleft().get())


def _decontamination(groups: dict, specs: list[SourceSpec], dindex) -> dict:
    """meta.json's decontamination entries: ``decontamination`` (this run's sets with the documents matched, when
    ``--decontaminate`` was given) and ``decontaminated_against``, the list ``z2all eval`` reads: every evaluation
    set (name, files with sha256, or task) the train data was checked against, here or by the ``z2all clean``
    whose output is an input (its ``report.json``), each with its ``mode`` (``remove`` or ``report``)."""
    out: dict = {}
    against = []
    if dindex is not None:
        contaminated: dict = {}
        for g in sorted(groups):
            merge_contaminated(contaminated, groups[g].get("contaminated", {}))
        mode = "report" if dindex.report_only else "remove"
        sets = [{**rec, **contaminated.get(rec["name"], {"docs": 0, "examples": []})} for rec in dindex.sets]
        out["decontamination"] = {"ngram": dindex.n, "mode": mode,
                                  "documents_matched": sum(c["docs"] for c in contaminated.values()), "sets": sets}
        against += [{k: v for k, v in rec.items() if k in ("name", "files", "task")} | {"ngram": dindex.n,
                    "mode": mode, "by": "prepare"} for rec in dindex.sets]
    seen = set()
    for spec in specs:
        for p in spec.paths:
            if str(p) == "stdlib":
                continue
            folder = Path(p) if os.path.isdir(p) else Path(p).parent
            report = folder / "report.json"
            if report in seen or not report.is_file():
                continue
            seen.add(report)
            try:
                dc = json.loads(report.read_text(encoding="utf-8")).get("decontamination")
            except (OSError, ValueError, AttributeError):
                continue
            for rec in (dc or {}).get("sets", []):
                against.append({k: v for k, v in rec.items() if k in ("name", "files", "task")}
                               | {"ngram": dc.get("ngram"), "mode": dc.get("mode"), "by": str(report.resolve())})
    out["decontaminated_against"] = against
    return out


def _write_meta(out, groups, specs, fingerprint, tok, tokenizer_dir, dtype, valid_fraction, stats, seconds, command,
                seq_len, tokenized_chunks, bar, mixture, decontamination=None) -> dict:
    splits = {}
    for split in ("train", "valid"):
        shards = [groups[g][split] for g in sorted(groups)]
        splits[split] = {"shards": shards, "tokens": sum(s["tokens"] for s in shards),
                         "docs": sum(s["docs"] for s in shards)}
        if seq_len and split == "train" and splits[split]["tokens"] < seq_len + 1:
            raise ValueError(f"the {split} split has {splits[split]['tokens']} tokens, fewer than seq_len+1="
                             f"{seq_len + 1}: add data or lower --seq-len")
    per_source = collections.defaultdict(lambda: [0] * _NSTATS)
    for g in groups.values():
        for name, v in g["per_source"].items():
            for i, x in enumerate(v):
                per_source[name][i] += x
    total_train = max(splits["train"]["tokens"], 1)
    sources = {}
    for s in specs:
        docs, d_tr, d_va, t_tr, t_va, nbytes, cand = per_source[s.name]
        sources[s.name] = {"paths": [str(p) for p in s.paths], "text_field": s.text_field, "weight": s.weight,
                           "weight_from": mixture["origin"][s.name], "docs_read": docs, "bytes": nbytes,
                           "docs_train": d_tr, "docs_valid": d_va, "tokens_train": t_tr, "tokens_valid": t_va,
                           "effective_epochs": round(d_tr / cand, 6) if cand else 0.0,
                           "train_share": round(t_tr / total_train, 6)}
    total_bytes = sum(v["bytes"] for v in sources.values())
    planned = sum(v["weight"] * v["bytes"] for v in sources.values())
    for v in sources.values():
        v["share_in"] = round(v["bytes"] / max(total_bytes, 1), 6)
        v["share_planned"] = round(v["weight"] * v["bytes"] / planned, 6) if planned > 0 else 0.0
    total_tokens = splits["train"]["tokens"] + splits["valid"]["tokens"]
    tok.save(out / TOKENIZER_COPY)  # moving the shards or retraining the tokenizer in its folder breaks nothing
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "tokenizer": {"hash": tok.hash, "dir": str(Path(tokenizer_dir).resolve()), "copy": TOKENIZER_COPY,
                      "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "backend": tok.backend},
        "dtype": dtype.name, "separator": "eos after every document",
        "valid_fraction": valid_fraction, "splits": splits, "sources": sources,
        "mixture": {k: v for k, v in mixture.items() if k != "origin"},
        "bytes_per_token": round(total_bytes / max(total_tokens, 1), 4),
        "read": stats.to_dict(),
        "fingerprint": fingerprint,
        "command": command or " ".join(sys.argv),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "throughput": {"seconds": round(seconds, 3), "tokenized_chunks": tokenized_chunks,
                       "mb_per_s": round(bar.bytes / 1e6 / max(seconds, 1e-9), 2),
                       "tokens_per_s": round(bar.tokens / max(seconds, 1e-9), 1)},
        **(decontamination or {}),
    }
    with atomic_write(out / META_FILE) as f:
        json.dump(meta, f, indent=2, ensure_ascii=False)
        f.write("\n")
    if read_output_marker(out) is None:
        write_output_marker(out, "prepare")
    return meta


def _is_legacy_output(path: Path) -> bool:
    """A `prepare` output written before outputs carried a marker: nothing but the files `prepare` writes."""
    names = [n for n in os.listdir(path) if n != LOCK_FILE]
    return bool(names) and all(_is_output(n) or _is_temporary(n) for n in names)


def read_meta(data_dir) -> dict:
    f = Path(data_dir) / META_FILE
    if not f.exists():
        state = Path(data_dir) / STATE_FILE
        hint = " (an interrupted `z2all prepare`: run the same command again to finish it)" if state.exists() else ""
        raise FileNotFoundError(f"{f}: no meta.json; not a finished `z2all prepare` output{hint}")
    meta = json.loads(f.read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{f}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def check_tokenizer(data_dir, tokenizer) -> None:
    """Raise :class:`TokenizerMismatchError` unless ``data_dir``'s shards were made with ``tokenizer`` (a Tokenizer,
    a tokenizer directory or a hash)."""
    if isinstance(tokenizer, str) and len(tokenizer) == 64 and not os.path.exists(tokenizer):
        expected = tokenizer
    elif hasattr(tokenizer, "hash"):
        expected = tokenizer.hash
    else:
        from zero2all.tokenizer import load_tokenizer

        expected = load_tokenizer(tokenizer).hash
    got = read_meta(data_dir)["tokenizer"]["hash"]
    if got != expected:
        raise TokenizerMismatchError(
            f"{data_dir}: the shards were tokenized with tokenizer {got[:16]}, but this run uses {expected[:16]}; "
            f"re-run `z2all prepare` with this tokenizer (or use the matching tokenizer)")
