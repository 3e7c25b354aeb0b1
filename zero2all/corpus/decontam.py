"""Benchmark decontamination: find training documents that share a long word n-gram with an evaluation set.

Normalisation (the same on both sides): Unicode NFKC (the cleaner's strongest form: it also folds full-width
letters and ligatures), case folded, then *words* are maximal runs of letters and digits (``str.isalnum``) and each
CJK ideograph is a word of its own; whitespace, line breaks and punctuation only separate words. So an evaluation
question copied with other capitals, spacing, line wrapping or quotes still matches, while a change of any word does
not. Chinese gets per-character words because it has no spaces: 13 characters are about a short clause.

N-grams: ``n`` consecutive words (13 by default, the length GPT-3 used, Brown et al. 2020, App. C: long enough that
common phrases do not collide, short enough that a copied question is caught). Each word gets a 64-bit hash from
prefix sums of a polynomial over its code points (vectorised, as in :mod:`zero2all.corpus.clean.minhash`), an
n-gram the mix of ``n`` position-weighted word hashes: 64 bits, so with ``K`` indexed n-grams a training n-gram
collides by chance with probability ``K / 2^64`` (1e-12 for ten million). An evaluation text with fewer than ``n``
words has no n-gram and is counted as ``too_short`` (matching it whole would flag every document containing a
short answer such as "the answer is yes").

Evaluation sets (``--decontaminate``): ``NAME=PATH`` or ``PATH`` (named after the file or folder stem), where PATH
is a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.txt`` file (optionally ``.gz`` / ``.zst``), a folder of them (one
set) or a glob; or ``lm-eval:TASK`` (``lm-eval:TASK@DIR`` for a task YAML in DIR) for an lm-evaluation-harness task
whose documents the harness can load: offline only if its data set is in the local cache or the task reads local
files (the harness's own tasks download from the Hugging Face hub otherwise). A json record's text is all its string
values joined with newlines (question, choices and answer alike), so n-grams spanning fields count too.

The index (:class:`DecontamIndex`) is one sorted array of unique n-gram hashes with a 64-bit mask per hash of the
sets holding it (at most 64 sets): 16 bytes per n-gram, saved as ``.npz`` so that worker processes load it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from zero2all.config import ConfigError
from zero2all.corpus.hashing import mix64

__all__ = ["DecontamIndex", "EvalSet", "build_index", "contamination_warning", "eval_set_record", "ngram_hashes",
           "normalize_for_ngrams", "parse_eval_sets", "read_eval_texts", "training_data_of"]

_U64 = np.uint64
_B = 0x9E3779B97F4A7C15
_B_INV = pow(_B, -1, 1 << 64)
_SEGMENT = 1 << 20
MAX_SETS = 64
LM_EVAL_PREFIX = "lm-eval:"
_FORMATS = (".jsonl", ".json", ".parquet", ".txt")
_TABLES: dict = {}
_PLANES = 0x30000


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """(word character, CJK ideograph) lookup tables over every code point, built once per process (~0.1 s)."""
    if not _TABLES:
        word = np.fromiter((chr(c).isalnum() for c in range(_PLANES)), dtype=bool, count=_PLANES)
        word[-1] = False  # everything above the first three planes (no letters in use) maps here: a separator
        cjk = np.zeros(_PLANES, dtype=bool)
        for lo, hi in ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2FFFE)):
            cjk[lo:hi + 1] = True
        _TABLES["t"] = (word | cjk, cjk)
    return _TABLES["t"]


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(over="ignore"):
        pw = np.concatenate([[_U64(1)], np.cumprod(np.full(n - 1, _B, dtype=_U64))]) if n > 1 else np.ones(1, _U64)
        inv = np.concatenate([[_U64(1)], np.cumprod(np.full(n - 1, _B_INV, dtype=_U64))]) if n > 1 else \
            np.ones(1, _U64)
    return pw, inv


_POW: dict = {}


def _pow_table(n: int):
    if "pw" not in _POW or len(_POW["pw"]) < n:
        _POW["pw"], _POW["inv"] = _powers(max(n, 4096, 2 * len(_POW.get("pw", ()))))
    return _POW["pw"][:n], _POW["inv"][:n]


def normalize_for_ngrams(text: str) -> str:
    """NFKC and case folding: the text whose words the n-grams are made of."""
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
    return text.casefold()


def _words(norm: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(word hashes uint64, start, end code-point offsets) of a normalised text."""
    cp = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    if len(cp) == 0:
        z = np.zeros(0, dtype=np.int64)
        return np.zeros(0, dtype=_U64), z, z
    word_t, cjk_t = _tables()
    cp = np.minimum(cp, _PLANES - 1)
    word, cjk = word_t[cp], cjk_t[cp]
    prev_w = np.concatenate([[False], word[:-1]])
    next_w = np.concatenate([word[1:], [False]])
    prev_c = np.concatenate([[False], cjk[:-1]])
    next_c = np.concatenate([cjk[1:], [False]])
    starts = np.flatnonzero(word & (~prev_w | cjk | prev_c))
    ends = np.flatnonzero(word & (~next_w | cjk | next_c)) + 1
    hashes = np.empty(len(starts), dtype=_U64)
    # segments of at most _SEGMENT code points cut between words, so the power tables stay bounded
    at_word = 0
    while at_word < len(starts):
        base = int(starts[at_word])
        stop = int(np.searchsorted(ends, base + _SEGMENT, side="right"))
        stop = max(stop, at_word + 1)
        seg_end = int(ends[stop - 1])
        seg = cp[base:seg_end]
        pw, inv = _pow_table(len(seg) + 1)
        s, e = starts[at_word:stop] - base, ends[at_word:stop] - base
        with np.errstate(over="ignore"):
            prefix = np.concatenate([[_U64(0)], np.cumsum(seg.astype(_U64) * pw[:len(seg)], dtype=_U64)])
            hashes[at_word:stop] = mix64((prefix[e] - prefix[s]) * inv[s] + (e - s).astype(_U64))
        at_word = stop
    return hashes, starts, ends


def _ngram_mul(n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix64(np.arange(1, n + 1, dtype=_U64) * _U64(0xD6E8FEB86659FD93)) | _U64(1)


def ngram_hashes(text: str, n: int = 13, normalized: bool = False, spans: bool = False):
    """The 64-bit hashes of the text's word ``n``-grams, in order (empty with fewer than ``n`` words).

    ``spans=True`` also returns the normalised text and the (start, end) offsets of each word, to show an n-gram."""
    norm = text if normalized else normalize_for_ngrams(text)
    units, starts, ends = _words(norm)
    k = len(units) - n + 1
    if k <= 0:
        out = np.zeros(0, dtype=_U64)
    else:
        mul = _ngram_mul(n)
        with np.errstate(over="ignore"):
            acc = units[:k] * mul[0]
            for j in range(1, n):
                acc = acc + units[j:j + k] * mul[j]
            out = mix64(acc)
    return (out, norm, starts, ends) if spans else out


# --------------------------------------------------------------------------------------------------------------
# evaluation sets


@dataclass
class EvalSet:
    """One evaluation set: a name and its files (or one lm-evaluation-harness task)."""

    name: str
    files: list[str] = field(default_factory=list)
    task: str | None = None
    include: str | None = None      # a folder of task YAML files (local tasks)


def _set_name(path: str) -> str:
    name = Path(path.rstrip("/")).name
    for suffix in (".gz", ".zst") + _FORMATS:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or "eval"


def _data_files(path: str) -> list[str]:
    from zero2all.corpus.readers import expand_paths

    try:
        files = expand_paths(path)
    except FileNotFoundError as e:
        raise ConfigError(f"--decontaminate {e}") from None
    return files


def parse_eval_sets(specs: Iterable[str]) -> list[EvalSet]:
    """``--decontaminate`` values -> :class:`EvalSet` list (files resolved; names unique)."""
    sets: list[EvalSet] = []
    for spec in specs:
        spec = str(spec)
        if spec.startswith(LM_EVAL_PREFIX):
            task, _, include = spec[len(LM_EVAL_PREFIX):].partition("@")
            if not task:
                raise ConfigError(f"--decontaminate {spec}: expected lm-eval:TASK or lm-eval:TASK@DIR")
            if include and not os.path.isdir(include):
                raise ConfigError(f"--decontaminate {spec}: {include} is not a folder of task YAML files")
            sets.append(EvalSet(task, task=task, include=include or None))
            continue
        name, sep, path = spec.partition("=")
        if not (sep and name and "/" not in name and not os.path.exists(spec)):
            name, path = _set_name(spec), spec
        sets.append(EvalSet(name, files=_data_files(path)))
    names = [s.name for s in sets]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"--decontaminate: two evaluation sets are named {dup!r}; name them NAME=PATH")
    if len(sets) > MAX_SETS:
        raise ConfigError(f"--decontaminate: {len(sets)} evaluation sets, at most {MAX_SETS}; put files of one "
                          "benchmark in one folder (a folder is one set)")
    return sets


def _strings(obj) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def _record_text(obj) -> str:
    return "\n".join(_strings(obj))


def _read_file(path: str) -> Iterator[str]:
    from zero2all.corpus.readers import open_binary

    name = path.lower()
    for c in (".gz", ".zst"):
        if name.endswith(c):
            name = name[: -len(c)]
    try:
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    yield _record_text(row)
            return
        with open_binary(path) as f:
            raw = f.read()
        text = raw.decode("utf-8", "replace")
        if name.endswith(".jsonl"):
            for i, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        yield _record_text(json.loads(line))
                    except json.JSONDecodeError:
                        raise ConfigError(f"--decontaminate {path}:{i}: not a JSON line") from None
        elif name.endswith(".json"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--decontaminate {path}: not JSON ({e.msg} at line {e.lineno})") from None
            for item in obj if isinstance(obj, list) else [obj]:
                yield _record_text(item)
        else:
            yield text
    except OSError as e:
        raise ConfigError(f"--decontaminate {path}: cannot read ({e.strerror or e})") from None


def _task_texts(task: str, include: str | None = None) -> Iterator[str]:
    """The documents of an lm-evaluation-harness task (its test split, else its validation split): each document's
    raw string fields, rendered prompt, choices and target (``doc_to_text`` / ``doc_to_choice`` /
    ``doc_to_target``). ``include``: a folder of local task YAML files."""
    try:
        from lm_eval.tasks import TaskManager, get_task_dict
    except ImportError:
        raise ConfigError(f"--decontaminate lm-eval:{task}: lm-evaluation-harness is not installed "
                          "(pip install 'zero2all[eval]'), or give the task's files instead") from None
    try:
        manager = TaskManager(include_path=[include], include_defaults=False) if include else None
        if manager is None or task not in manager.all_tasks:
            manager = TaskManager(include_path=[include] if include else None)
        # lm-eval >= 0.4.10: TaskManager.load (flat dict of leaf tasks); earlier ones: get_task_dict (nested)
        tasks = manager.load([task])["tasks"] if hasattr(manager, "load") else get_task_dict([task], manager)
    except Exception as e:  # the harness raises many kinds (unknown task, no network, missing data set)
        raise ConfigError(f"--decontaminate lm-eval:{task}: the harness could not load it offline "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    for obj in _leaf_tasks(tasks):
        docs = obj.test_docs() if obj.has_test_docs() else obj.validation_docs() if obj.has_validation_docs() else []
        for doc in docs or []:
            parts = [_record_text(dict(doc))]
            for fn in ("doc_to_text", "doc_to_choice", "doc_to_target"):
                try:
                    v = getattr(obj, fn)(doc)
                except Exception:
                    continue
                parts += list(_strings(v))
            yield "\n".join(p for p in parts if p)


def _leaf_tasks(d) -> Iterator:
    for v in d.values():
        if isinstance(v, dict):
            yield from _leaf_tasks(v)
        elif v is not None:
            yield v


def read_eval_texts(s: EvalSet) -> Iterator[str]:
    if s.task is not None:
        yield from _task_texts(s.task, s.include)
        return
    for f in s.files:
        yield from _read_file(f)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def eval_set_record(s: EvalSet) -> dict:
    """What outputs record about a set (the record ``z2all eval`` reads): name, files with sha256, or the task."""
    if s.task is not None:
        return {"name": s.name, "task": s.task}
    return {"name": s.name, "files": [{"path": os.path.abspath(f), "sha256": _sha256(f)} for f in s.files]}


# --------------------------------------------------------------------------------------------------------------
# the index


class DecontamIndex:
    """Sorted unique n-gram hashes of the evaluation sets, each with a bit mask of the sets holding it."""

    def __init__(self, keys: np.ndarray, owners: np.ndarray, names: list[str], n: int, sets: list[dict],
                 report_only: bool = False):
        self.keys, self.owners, self.names, self.n, self.sets = keys, owners, list(names), int(n), sets
        self.report_only = report_only  # what the user of the index does with a match (kept with it for workers)

    def match(self, text: str, normalized: bool = False) -> dict[str, str]:
        """{set name: the first shared n-gram as normalised text} for every set the text shares an n-gram with."""
        h, norm, starts, ends = ngram_hashes(text, self.n, normalized, spans=True)
        if not len(h) or not len(self.keys):
            return {}
        pos = np.searchsorted(self.keys, h)
        pos[pos == len(self.keys)] = 0
        hit = self.keys[pos] == h
        if not hit.any():
            return {}
        where = np.flatnonzero(hit)
        masks = self.owners[pos[where]]
        out: dict[str, str] = {}
        for bit, name in enumerate(self.names):
            on = np.flatnonzero(masks & _U64(1 << bit))
            if len(on):
                i = int(where[on[0]])
                out[name] = norm[int(starts[i]):int(ends[i + self.n - 1])]
        return out

    @property
    def digest(self) -> str:
        h = hashlib.sha256(json.dumps({"n": self.n, "sets": self.sets}, sort_keys=True).encode())
        h.update(self.keys.tobytes())
        h.update(self.owners.tobytes())
        return h.hexdigest()[:16]

    def save(self, path: str | os.PathLike) -> None:
        from zero2all.fileio import atomic_write

        with atomic_write(path, "wb") as f:
            np.savez(f, keys=self.keys, owners=self.owners, n=np.int64(self.n),
                     meta=np.frombuffer(json.dumps({"names": self.names, "sets": self.sets}).encode(), np.uint8))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DecontamIndex":
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            return cls(z["keys"], z["owners"], meta["names"], int(z["n"]), meta["sets"])


_LOADED: dict = {}


def load_index_cached(path: str | os.PathLike) -> DecontamIndex:
    """One load per process and file (worker processes call this for every work unit)."""
    p = str(path)
    stamp = os.stat(p).st_mtime_ns
    if _LOADED.get("key") != (p, stamp):
        _LOADED.clear()
        _LOADED["key"], _LOADED["index"] = (p, stamp), DecontamIndex.load(p)
    return _LOADED["index"]


def build_index(specs: Iterable[str], n: int = 13, log=None) -> DecontamIndex:
    """Read the evaluation sets and index their word ``n``-grams; ``log(line)`` gets one summary line per set."""
    if n < 1:
        raise ConfigError(f"decontam.ngram: must be >= 1, got {n}")
    sets = parse_eval_sets(specs)
    all_keys, all_bits, records = [], [], []
    for bit, s in enumerate(sets):
        texts = too_short = 0
        parts = []
        for text in read_eval_texts(s):
            texts += 1
            h = ngram_hashes(text, n)
            if not len(h):
                too_short += 1
            parts.append(h)
        keys = np.unique(np.concatenate(parts)) if parts else np.zeros(0, _U64)
        rec = eval_set_record(s)
        rec.update({"texts": texts, "too_short": too_short, "ngrams": int(len(keys))})
        records.append(rec)
        all_keys.append(keys)
        all_bits.append(np.full(len(keys), _U64(1 << bit), dtype=_U64))
        if log:
            log(f"decontamination set {s.name}: {texts:,} texts, {len(keys):,} distinct {n}-grams"
                + (f", {too_short:,} shorter than {n} words (not indexed)" if too_short else ""))
        if texts == 0:
            raise ConfigError(f"--decontaminate {s.name}: no text found")
    keys = np.concatenate(all_keys) if all_keys else np.zeros(0, _U64)
    bits = np.concatenate(all_bits) if all_bits else np.zeros(0, _U64)
    order = np.argsort(keys, kind="stable")
    keys, bits = keys[order], bits[order]
    first = np.concatenate([[True], keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, bool)
    group = np.cumsum(first) - 1
    owners = np.zeros(int(first.sum()), dtype=_U64)
    np.bitwise_or.at(owners, group, bits)
    return DecontamIndex(keys[first], owners, [s.name for s in sets], n, records)


# --------------------------------------------------------------------------------------------------------------
# what `z2all eval` checks


def training_data_of(ckpt: str | os.PathLike) -> Path | None:
    """The ``z2all prepare`` folder a checkpoint was trained on, from the run config (``config.json``: the
    checkpoint's own, else its run folder's) ``data.path``; None when unknown (an HF model, synthetic data)."""
    for folder in (Path(ckpt), Path(ckpt).parent):
        try:
            cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        data = cfg.get("data") if isinstance(cfg, dict) else None
        if isinstance(data, dict) and isinstance(data.get("path"), str) and data["path"]:
            return Path(data["path"])
    return None


def contamination_warning(ckpt: str | os.PathLike, data: Iterable[str] = (), tasks: Iterable[str] = ()) -> str | None:
    """One line naming the evaluated sets that the checkpoint's known training data was not decontaminated
    against, or None. A file set counts as decontaminated when each of its files' sha256 is among the files of a
    set recorded with mode ``remove`` in the data's ``meta.json`` (``decontaminated_against``); a harness task
    when its name is."""
    data_dir = training_data_of(ckpt)
    if data_dir is None:
        return None
    try:
        meta = json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    against = [r for r in meta.get("decontaminated_against", []) if r.get("mode") == "remove"]
    digests = {f.get("sha256") for r in against for f in r.get("files", [])}
    task_names = {r.get("task") for r in against if r.get("task")}
    missing = [t for t in tasks if t not in task_names]
    for spec in data:
        name, sep, path = str(spec).partition("=")
        if not (sep and name and "/" not in name and not os.path.exists(str(spec))):
            path = str(spec)
        try:
            from zero2all.corpus.readers import expand_paths

            files = expand_paths(path)
        except FileNotFoundError:
            continue  # the evaluation itself reports it
        if any(_sha256(f) not in digests for f in files):
            missing.append(str(spec))
    if not missing:
        return None
    known = ", ".join(sorted({r["name"] for r in against})) or "none"
    return (f"warning: {', '.join(missing)} not decontaminated against the training data {data_dir} (sets removed "
            f"from it: {known}); z2all clean / prepare --decontaminate removes overlapping documents")
