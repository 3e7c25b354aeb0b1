"""Pretokenized SFT and DPO data (``z2all prepare-sft``, ``z2all prepare-dpo``): chat records rendered once into
token files + an index, then read by memory map, so large instruction or preference sets neither sit in memory as
Python lists nor get re-rendered per run.

Output directory (written into a hidden temporary directory, fsynced, then renamed into place: a killed run
leaves either the old directory or the complete new one)::

    meta.json             format, tokenizer hash / directory / vocabulary, counts per split, load report, command
    train.tokens.bin      every sample's token ids back to back (uint16 if the vocabulary fits, else uint32)
    train.labels.bin      uint8 per token: 1 where the token is learned (an assistant token), 0 where not
    train.index.npy       int64 sample start offsets plus the end (len = samples + 1)
    train.first_label.npy int32 position (within its sample) of each sample's first learned token
    valid.*               the same for the held-out split (possibly empty)

A DPO directory (``meta.json`` kind "dpo") stores each preference pair as two consecutive samples, chosen then
rejected, rendered exactly by ``zero2all.data.chat.render_dpo_record`` (labels on the answer only); an SFT
directory (kind "sft") renders with ``render_sft_record`` (chat template, assistant-only labels). The split is
by record content: ``u = blake2b(canonical JSON of the record)`` in [0, 1), held out when ``u < valid_fraction``;
identical records fall on the same side and the split does not depend on order or worker count.

:class:`SFTShardDataset` turns a split into the same rows as the in-memory :class:`~zero2all.data.chat.SFTDataset`
(same truncation to ``seq_len + 1`` tokens, same dropping of samples left without assistant tokens, the same
greedy in-order packing or one-sample-per-row padding, the same rank split), but builds each row only when a batch
asks for it. :class:`DPOShardDataset` gives the pairs of :class:`~zero2all.data.chat.DPODataset` (the same
truncation and dropping per side, the same rank split) from the memory map. Training refuses shards made with
another tokenizer (hash check) or of the other kind.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from zero2all.data.chat import (
    IGNORE_INDEX,
    ChatDataError,
    DPODataset,
    DPOSample,
    ItemIterator,
    LoadStats,
    SFTSample,
    iter_jsonl,
    render_dpo_record,
    render_sft_record,
)
from zero2all.fileio import atomic_dir, claim_output_dir, save_json

FORMAT = "zero2all-sft-shards"
FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "valid")
KINDS = ("sft", "dpo")


class SFTShardError(ValueError):
    """A pretokenized SFT directory is missing, incomplete, or was made with another tokenizer."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.uint32)


def record_unit(record) -> float:
    """A uniform in [0, 1) from the record's content (the train/valid split)."""
    text = json.dumps(record, sort_keys=True, ensure_ascii=False)
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2 ** 64


# --------------------------------------------------------------------------------------------------------------
# writing


_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, kind: str = "sft") -> None:
    from zero2all.tokenizer import load_tokenizer

    _WORKER["tok"] = load_tokenizer(tokenizer_dir)
    _WORKER["kind"] = kind


def _render_chunk(items: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """(where, record or error) -> (where, ([(ids, mask) per sample], unit) or error message); runs in a worker
    process. An SFT record is one sample, a preference record two (chosen, rejected)."""
    tok, kind = _WORKER["tok"], _WORKER.get("kind", "sft")
    out = []
    for where, record in items:
        try:
            if isinstance(record, ChatDataError):
                raise record
            if kind == "dpo":
                pair = render_dpo_record(tok, record, where)
                samples = [pair.chosen, pair.rejected]
            else:
                samples = [render_sft_record(tok, record, where)]
            encoded = [(s.input_ids, [int(y != IGNORE_INDEX) for y in s.labels]) for s in samples]
            out.append((where, (encoded, record_unit(record))))
        except ChatDataError as e:
            out.append((where, str(e)))
    return out


class _RayRenderer:
    """A Ray actor: one worker's tokenizer, loaded once, then ``_render_chunk`` per chunk."""

    def __init__(self, tokenizer_dir: str, kind: str):
        _init_worker(tokenizer_dir, kind)

    def render(self, items):
        return _render_chunk(items)


def _render_on_ray(workers: int, tokenizer_dir: str, kind: str, chunks):
    """The rendered chunks in order, from ``workers`` Ray actors (default: the cluster's CPUs), two per actor in
    flight."""
    from collections import deque

    from zero2all.corpus.on_ray import RETRIES, connect, ray_workers

    ray = connect()
    n = ray_workers(ray, workers if workers > 1 else None)
    actor = ray.remote(_RayRenderer).options(max_restarts=RETRIES, max_task_retries=RETRIES)
    actors = [actor.remote(tokenizer_dir, kind) for _ in range(n)]
    pending: deque = deque()
    try:
        for i, items in enumerate(chunks):
            pending.append(actors[i % n].render.remote(items))
            if len(pending) >= 2 * n:
                yield ray.get(pending.popleft())
        while pending:
            yield ray.get(pending.popleft())
    finally:
        for a in actors:
            ray.kill(a)


def _chunks(paths, size: int):
    buf = []
    for path in paths:
        for where, record in iter_jsonl(path):
            buf.append((where, record))
            if len(buf) == size:
                yield buf
                buf = []
    if buf:
        yield buf


class _SplitWriter:
    def __init__(self, root: Path, split: str, dtype: np.dtype):
        self.split, self.dtype = split, dtype
        self.tokens = open(root / f"{split}.tokens.bin", "wb")
        self.labels = open(root / f"{split}.labels.bin", "wb")
        self.offsets = [0]
        self.first_label: list[int] = []
        self.label_tokens = 0

    def add(self, ids: list[int], mask: list[int]) -> None:
        self.tokens.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self.labels.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self.offsets.append(self.offsets[-1] + len(ids))
        self.first_label.append(mask.index(1) if 1 in mask else len(mask))
        self.label_tokens += sum(mask)

    def close(self, root: Path) -> dict:
        for f in (self.tokens, self.labels):
            f.close()  # fsynced with the whole directory by atomic_dir
        np.save(root / f"{self.split}.index.npy", np.asarray(self.offsets, dtype=np.int64))
        np.save(root / f"{self.split}.first_label.npy", np.asarray(self.first_label, dtype=np.int32))
        return {"samples": len(self.first_label), "tokens": self.offsets[-1], "label_tokens": self.label_tokens}


def prepare_sft(inputs: Sequence[str | Path], tokenizer_dir: str | Path, out_dir: str | Path, *,
                valid_fraction: float = 0.0, on_error: str = "raise", workers: int = 1, overwrite: bool = False,
                chunk_records: int = 256, command: str = "", log=print, kind: str = "sft",
                ray: bool | None = None) -> dict:
    """Render every record of ``inputs`` (jsonl / jsonl.gz / json files) and write the directory described in the
    module docstring; returns its meta. ``workers`` > 1 renders chunks of records in parallel (same output).
    ``kind``: "sft" (instruction / conversation records) or "dpo" (preference pairs, two samples each).
    ``ray``: render the chunks on Ray actors (:mod:`zero2all.corpus.on_ray`; None: when ``RAY_ADDRESS`` is set),
    the same output; a killed run starts over (the output folder is replaced as a whole, never half-written)."""
    from zero2all.corpus.on_ray import connect, ray_requested
    from zero2all.tokenizer import load_tokenizer

    use_ray = ray_requested(ray)
    if use_ray:
        connect()  # a missing extra or an unreachable cluster is said first

    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error: {on_error!r} is not one of raise, skip")
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction: must be in [0, 1), got {valid_fraction}")
    out = Path(out_dir)
    paths = [Path(p) for p in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    # a previous output of this command is replaced with --overwrite only; anything else is never replaced
    claim_output_dir(out, f"prepare-{kind}", inputs=[*paths, tokenizer_dir], overwrite=overwrite,
                     legacy=lambda d: _is_legacy_output(d, kind))
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such file")
    tok = load_tokenizer(tokenizer_dir)
    if getattr(tok, "im_end_id", None) is None:
        raise ValueError(f"{tokenizer_dir}: the tokenizer has no <|im_end|> token (no chat template)")
    dtype = token_dtype(tok.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    stats = LoadStats()
    # a failure or a kill leaves the previous directory (if any) as it was
    with atomic_dir(out, kind=f"prepare-{kind}") as tmp:
        writers = {s: _SplitWriter(tmp, s, dtype) for s in SPLITS}
        if use_ray:
            pool, results = None, _render_on_ray(workers, str(tokenizer_dir), kind, _chunks(paths, chunk_records))
        elif workers > 1:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_dir), kind))
            results = pool.imap(_render_chunk, _chunks(paths, chunk_records))
        else:
            _WORKER["tok"], _WORKER["kind"] = tok, kind
            pool, results = None, map(_render_chunk, _chunks(paths, chunk_records))
        try:
            for chunk in results:
                for where, result in chunk:
                    stats.records += 1
                    if isinstance(result, str):
                        if on_error == "raise":
                            raise ChatDataError(result)
                        stats.skipped += 1
                        if len(stats.errors) < 10:
                            stats.errors.append(result)
                        continue
                    encoded, u = result
                    for ids, mask in encoded:
                        writers["valid" if u < valid_fraction else "train"].add(ids, mask)
        finally:
            if pool is not None:
                pool.terminate()
        splits = {s: w.close(tmp) for s, w in writers.items()}
        if splits["train"]["samples"] == 0:
            raise ValueError(f"no usable {kind.upper()} records in {', '.join(map(str, paths))}: {stats.summary()}")
        if kind == "dpo":
            for split in splits.values():
                split["pairs"] = split["samples"] // 2
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "kind": kind, "dtype": dtype.name,
            "tokenizer": {"hash": tok.hash, "dir": str(Path(tokenizer_dir).resolve()), "vocab_size": tok.vocab_size},
            "inputs": [str(p) for p in paths], "valid_fraction": valid_fraction, "splits": splits,
            "read": {"records": stats.records, "skipped": stats.skipped, "errors": stats.errors},
            "seconds": round(time.time() - t0, 3), "command": command or " ".join(sys.argv),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        save_json(meta, tmp / META_FILE)
    tr, va = splits["train"], splits["valid"]
    unit = "pairs" if kind == "dpo" else "samples"
    log(f"wrote {out}: {tr[unit]:,} train {unit} ({tr['tokens']:,} tokens, {tr['label_tokens']:,} learned), "
        f"{va[unit]:,} valid {unit}; {stats.skipped} malformed records skipped; {meta['seconds']:.1f} s")
    return meta


def read_sft_meta(data_dir: str | Path, kind: str | None = None) -> dict:
    """The meta of a prepared directory; with ``kind``, refuses one of the other kind ("sft" / "dpo")."""
    f = Path(data_dir) / META_FILE
    if not f.exists():
        raise SFTShardError(f"{f}: no meta.json; not a finished `z2all prepare-sft` / `prepare-dpo` output")
    meta = json.loads(f.read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise SFTShardError(f"{f}: format {meta.get('format')!r} is not {FORMAT!r}")
    found = meta.get("kind", "sft")
    if kind is not None and found != kind:
        raise SFTShardError(f"{f}: prepared {found.upper()} data, but this run needs {kind.upper()} data "
                            f"(`z2all prepare-{kind}`)")
    return meta


def is_sft_shard_dir(path: str | Path, kind: str | None = None) -> bool:
    """Whether ``path`` is a prepared directory (of ``kind``, when given)."""
    f = Path(path) / META_FILE
    if not f.is_file():
        return False
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False
    return meta.get("format") == FORMAT and (kind is None or meta.get("kind", "sft") == kind)


def _is_legacy_output(path: Path, kind: str) -> bool:
    """An output of this command written before outputs carried a marker: its meta.json and nothing but the
    files it writes."""
    names = {META_FILE} | {f"{s}.{part}" for s in SPLITS for part in ("tokens.bin", "labels.bin", "index.npy",
                                                                      "first_label.npy")}
    return is_sft_shard_dir(path, kind) and all(n in names for n in os.listdir(path))


# --------------------------------------------------------------------------------------------------------------
# reading


def _open_split(data_dir: Path, split: str, kind: str, tokenizer):
    """(meta, tokens memmap, labels memmap, offsets, first_label) of one split, after the kind and tokenizer
    checks."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
    meta = read_sft_meta(data_dir, kind)
    found = meta["tokenizer"]["hash"]
    if tokenizer is not None and tokenizer.hash != found:
        raise SFTShardError(f"{data_dir}: the shards were made with tokenizer {found[:16]}, but this run uses "
                            f"{tokenizer.hash[:16]}; re-run `z2all prepare-{kind}` with it")
    rebuild = f"re-run `z2all prepare-{kind}` with --overwrite to rebuild {data_dir}"
    arrays = []
    for name in (f"{split}.index.npy", f"{split}.first_label.npy"):
        try:  # never unpickle: an index is a plain array
            arrays.append(np.load(data_dir / name, allow_pickle=False))
        except (ValueError, EOFError) as e:
            raise SFTShardError(f"{data_dir / name}: damaged (not a plain .npy array: {type(e).__name__}); "
                                f"{rebuild}") from None
    offsets, first_label = arrays
    if offsets.ndim != 1 or len(offsets) == 0 or offsets.dtype.kind not in "iu":
        raise SFTShardError(f"{data_dir / f'{split}.index.npy'}: damaged (not a 1-d integer index); {rebuild}")
    n_tokens = int(offsets[-1])
    dtype = np.dtype(meta["dtype"])
    if n_tokens:
        for name, itemsize in ((f"{split}.tokens.bin", dtype.itemsize), (f"{split}.labels.bin", 1)):
            size = (data_dir / name).stat().st_size
            if size != n_tokens * itemsize:
                raise SFTShardError(f"{data_dir / name}: {size:,} bytes, but its index lists {n_tokens:,} tokens "
                                    f"({n_tokens * itemsize:,} bytes): truncated or replaced; {rebuild}")
        tokens = np.memmap(data_dir / f"{split}.tokens.bin", dtype=dtype, mode="r", shape=(n_tokens,))
        labels = np.memmap(data_dir / f"{split}.labels.bin", dtype=np.uint8, mode="r", shape=(n_tokens,))
    else:
        tokens = labels = np.zeros(0, dtype=dtype)
    return meta, tokens, labels, offsets, first_label


def greedy_pack(lengths: np.ndarray, seq_len: int) -> list[tuple[int, int]]:
    """Rows as [start, end) ranges of consecutive samples: a row takes samples in order while their (shifted)
    lengths fit ``seq_len`` - the plan of ``zero2all.data.chat.pack_samples``."""
    rows, start, used = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > seq_len and i > start:
            rows.append((start, i))
            start, used = i, 0
        used += n
    if len(lengths) > start:
        rows.append((start, len(lengths)))
    return rows


class SFTShardDataset:
    """One split of a ``prepare-sft`` directory as fixed-length rows (``input_ids``, ``labels``, ``position_ids``,
    and ``doc_ids`` when packed); the trainer's data contract (``iterator(batch_size, seed)``)."""

    def __init__(self, data_dir: str | Path, seq_len: int, pad_id: int, mode: str = "pack", split: str = "train",
                 rank: int = 0, world_size: int = 1, tokenizer=None):
        if mode not in ("pack", "pad"):
            raise ValueError(f"mode: {mode!r} is not one of pack, pad")
        if split not in SPLITS:
            raise ValueError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
        self.dir = Path(data_dir)
        self.meta, self.tokens, self.labels, offsets, first_label = _open_split(self.dir, split, "sft", tokenizer)
        self.tokenizer_hash = self.meta["tokenizer"]["hash"]
        self.seq_len, self.mode, self.pad_id, self.split = seq_len, mode, pad_id, split
        self.rank, self.world_size = rank, world_size
        lengths = np.diff(offsets)
        kept_len = np.minimum(lengths, seq_len + 1)           # truncation, as chat.load_sft_samples does
        keep = (kept_len >= 2) & (first_label < kept_len)     # a sample needs an assistant token left
        self.stats = LoadStats(records=len(lengths), truncated=int((lengths > seq_len + 1).sum()),
                               dropped_no_labels=int((~keep).sum()))
        self.sample_start = offsets[:-1][keep]
        self.sample_len = kept_len[keep]
        shifted = self.sample_len - 1
        if mode == "pack":
            rows = greedy_pack(shifted, seq_len)
        else:
            rows = [(i, i + 1) for i in range(len(shifted))]
        per_rank = len(rows) // world_size
        self.rows = rows[rank::world_size][:per_rank]

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, i: int) -> tuple[list[int], list[int]]:
        """(inputs, targets) of kept sample ``i``: ids[:-1] and labels[1:] (-100 where nothing is learned)."""
        s, n = int(self.sample_start[i]), int(self.sample_len[i])
        ids = torch.from_numpy(self.tokens[s:s + n].astype(np.int64))
        mask = torch.from_numpy(self.labels[s:s + n].astype(np.bool_))
        labels = ids.masked_fill(~mask, IGNORE_INDEX)
        return ids[:-1], labels[1:]

    def __getitem__(self, r: int) -> dict[str, torch.Tensor]:
        start, end = self.rows[r]
        parts = [self.sample(i) for i in range(start, end)]
        T = self.seq_len
        used = sum(len(t) for t, _ in parts)
        n = T - used
        ids = torch.cat([t for t, _ in parts] + [torch.full((n,), self.pad_id, dtype=torch.long)])
        labels = torch.cat([y for _, y in parts] + [torch.full((n,), IGNORE_INDEX, dtype=torch.long)])
        if self.mode == "pad":
            return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(T)}
        docs = torch.cat([torch.full((len(t),), d, dtype=torch.long) for d, (t, _) in enumerate(parts)]
                         + [torch.full((n,), len(parts), dtype=torch.long)])
        pos = torch.cat([torch.arange(len(t)) for t, _ in parts] + [torch.arange(n)])
        return {"input_ids": ids, "labels": labels, "doc_ids": docs, "position_ids": pos}

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        rows = [self[i] for i in indices]
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def iterator(self, batch_size: int, seed: int = 0, shuffle: bool = True) -> ItemIterator:
        return ItemIterator(self, batch_size, seed, shuffle)


class _ShardPairs(SequenceABC):
    """The kept pairs of a DPO split as :class:`DPOSample` objects, built from the memory map on access (a
    sequence: ``len``, indexing and slicing, as the in-memory list of pairs)."""

    def __init__(self, tokens, labels, starts: np.ndarray, lengths: np.ndarray):
        self.tokens, self.labels = tokens, labels
        self.starts, self.lengths = starts, lengths      # (pairs, 2): chosen, rejected (after truncation)

    def __len__(self) -> int:
        return len(self.starts)

    def _sample(self, s: int, n: int) -> SFTSample:
        ids = self.tokens[s:s + n].astype(np.int64)
        labels = np.where(self.labels[s:s + n].astype(np.bool_), ids, IGNORE_INDEX)
        return SFTSample(ids.tolist(), labels.tolist())

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"pair {i} of {len(self)}")
        (sc, sr), (nc, nr) = self.starts[i], self.lengths[i]
        return DPOSample(self._sample(int(sc), int(nc)), self._sample(int(sr), int(nr)))


class DPOShardDataset(DPODataset):
    """One split of a ``prepare-dpo`` directory as preference pairs: the batches of
    :class:`~zero2all.data.chat.DPODataset` (pairs whose chosen or rejected side keeps no answer token after
    truncation to ``seq_len + 1`` are dropped, as ``load_dpo_samples`` does; the same rank split)."""

    def __init__(self, data_dir: str | Path, seq_len: int, pad_id: int, split: str = "train", rank: int = 0,
                 world_size: int = 1, tokenizer=None):
        self.dir = Path(data_dir)
        self.meta, tokens, labels, offsets, first_label = _open_split(self.dir, split, "dpo", tokenizer)
        self.tokenizer_hash = self.meta["tokenizer"]["hash"]
        self.seq_len, self.pad_id, self.split = seq_len, pad_id, split
        self.rank, self.world_size = rank, world_size
        lengths = np.diff(offsets)
        if len(lengths) % 2:
            raise SFTShardError(f"{self.dir}: {split} holds {len(lengths)} samples, not chosen/rejected pairs")
        kept_len = np.minimum(lengths, seq_len + 1)
        keep = (kept_len >= 2) & (first_label < kept_len)
        pair_keep = keep[0::2] & keep[1::2]
        starts = np.stack([offsets[:-1][0::2], offsets[:-1][1::2]], axis=1)[pair_keep]
        kept = np.stack([kept_len[0::2], kept_len[1::2]], axis=1)[pair_keep]
        self.stats = LoadStats(records=len(lengths) // 2, truncated=int((lengths > seq_len + 1).sum()),
                               dropped_no_labels=int((~keep).sum()))
        per_rank = len(starts) // world_size
        self.pairs = _ShardPairs(tokens, labels, starts[rank::world_size][:per_rank],
                                 kept[rank::world_size][:per_rank])
