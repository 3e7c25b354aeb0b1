"""Datasets that turn token shards (``z2all prepare``) into training batches.

PackedDataset: pretraining on packed windows
--------------------------------------------
The shards of a split, concatenated in order, are one token stream ``s`` of ``N`` tokens (documents separated by
``<|endoftext|>``). Window ``w`` is ``s[w*T : w*T + T + 1]`` for ``T = seq_len``: ``input_ids = window[:-1]``,
``labels = window[1:]``; consecutive windows overlap by one token so every token is predicted exactly once. There
are ``W = (N - 1) // T`` windows; rank ``r`` of ``R`` owns windows ``r, r + R, r + 2R, ...`` (disjoint between
ranks), ``W // R`` of them so every rank runs the same number of steps. Windows are read from ``np.memmap``s
opened lazily per process: memory holds one batch, not the shards.

``ds.iterator(batch_size, seed)`` is an endless stream of batches: epoch ``e`` visits this rank's windows in the
order ``rng([seed, e]).permutation(len(ds))``; a batch that reaches the end of an epoch continues with the next
epoch's first windows. Its whole state is ``(epoch, position)``: ``state_dict()`` / ``load_state_dict()`` make a
resumed run draw exactly the batch the interrupted one would have drawn next. On another number of processes
(``rescaled_state``) each rank owns other windows in another order, so the run keeps its epoch and the same
fraction of it (rounded down); see :mod:`zero2all.data.protocol`, whose ``BatchDataset`` / ``BatchIterator``
contract these classes follow.

With ``return_doc_ids`` each window also has ``doc_ids`` (T,): the index of the document each input token belongs
to, counted from 0 at the window's first token (a document ends with its ``<|endoftext|>``), for
intra-document attention masks. Boundaries come from the shards' ``.idx.npy`` document offsets.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from zero2all.data.pretokenize import (
    TokenizerMismatchError,
    check_shard_size,
    check_token_ids,
    load_offsets,
    max_token_id,
    read_meta,
    shard_dtype_of,
)
from zero2all.data.protocol import (
    check_epoch_position,
    check_run_states,
    check_same_data,
    rescaled_epoch_position,
)

KIND = "packed"


class PackedDataset:
    """Windows of ``seq_len + 1`` tokens from the shards of ``split`` for ``rank`` of ``world_size``."""

    # shards are checked once, when opened: sizes against meta.json, document indexes, and every token id below
    # the vocabulary. Up to this many bytes of shards the ids are scanned at once; past it each shard is scanned
    # the first time this process reads it (still before any of its tokens reaches the model).
    EAGER_SCAN_BYTES = 1 << 30

    def __init__(self, data_dir, seq_len: int, split: str = "train", rank: int = 0, world_size: int = 1,
                 return_doc_ids: bool = False, expected_tokenizer_hash: str | None = None,
                 model_vocab_size: int | None = None):
        self.data_dir = Path(data_dir)
        self.meta = read_meta(self.data_dir)
        if split not in self.meta["splits"]:
            raise ValueError(f"{self.data_dir}: no split {split!r} (splits: {', '.join(self.meta['splits'])})")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.tokenizer_hash: str = self.meta["tokenizer"]["hash"]
        if expected_tokenizer_hash is not None and expected_tokenizer_hash != self.tokenizer_hash:
            raise TokenizerMismatchError(
                f"{self.data_dir}: the shards were tokenized with tokenizer {self.tokenizer_hash[:16]}, but "
                f"{expected_tokenizer_hash[:16]} was expected; re-run `z2all prepare` with the model's tokenizer")
        self.seq_len, self.split, self.rank, self.world_size = seq_len, split, rank, world_size
        self.return_doc_ids = return_doc_ids
        self.dtype = shard_dtype_of(self.meta, self.data_dir)
        self.vocab_size: int = self.meta["tokenizer"]["vocab_size"]
        self.eos_id: int = self.meta["tokenizer"]["eos_id"]
        self.shards = [s for s in self.meta["splits"][split]["shards"] if s["tokens"] > 0]
        # ids must have rows in the model (or, without one, be ids of the tokenizer that made the shards)
        self.id_limit = model_vocab_size if model_vocab_size is not None else self.vocab_size
        for s in self.shards:
            check_shard_size(self.data_dir / s["bin"], s["tokens"], self.dtype, self.data_dir)
            load_offsets(self.data_dir / s["idx"], s.get("docs"), s["tokens"], self.data_dir)
            if s.get("max_id") is not None:  # recorded by `prepare`: a model too small is refused at once
                check_token_ids(self.data_dir / s["bin"], s["max_id"], self.id_limit, self.data_dir)
        self._ids_checked: set[int] = set()
        if sum(s["tokens"] for s in self.shards) * self.dtype.itemsize <= self.EAGER_SCAN_BYTES:
            for k in range(len(self.shards)):
                self._check_ids(k)
        sizes = [s["tokens"] for s in self.shards]
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # global start of each shard
        docs = [s["docs"] for s in self.shards]
        self.shard_doc_starts = np.concatenate([[0], np.cumsum(docs)]).astype(np.int64)
        self.num_tokens = int(self.shard_starts[-1])
        self.num_windows_total = max(self.num_tokens - 1, 0) // seq_len
        self.num_windows = self.num_windows_total // world_size
        if self.num_windows == 0:  # a ConfigError: the command says it in one line (exit code 2)
            from zero2all.config import ConfigError

            raise ConfigError(f"{self.data_dir}: split {split!r} has {self.num_tokens:,} tokens: fewer than "
                              f"world_size * seq_len + 1 = {world_size * seq_len + 1}; lower seq_len or add data")
        self._maps: dict = {}
        self._pid = None

    def __len__(self) -> int:
        return self.num_windows

    def __repr__(self) -> str:
        return (f"PackedDataset({str(self.data_dir)!r}, split={self.split}, seq_len={self.seq_len}, "
                f"windows={self.num_windows} for rank {self.rank}/{self.world_size}, tokens={self.num_tokens:,})")

    # ------------------------------------------------------------------------------------------------- reading

    def _check_ids(self, k: int) -> None:
        """Scan shard ``k`` once for an id the model has no row for (and for ids above what `prepare` recorded)."""
        if k in self._ids_checked:
            return
        s = self.shards[k]
        path = self.data_dir / s["bin"]
        check_token_ids(path, max_token_id(np.memmap(path, dtype=self.dtype, mode="r")), self.id_limit,
                        self.data_dir, recorded=s.get("max_id"))
        self._ids_checked.add(k)

    def _shard(self, k: int, kind: str = "bin"):
        if self._pid != os.getpid():  # memmaps are per process (DataLoader workers, forks)
            self._maps, self._pid = {}, os.getpid()
        key = (k, kind)
        if key not in self._maps:
            s = self.shards[k]
            if kind == "bin":
                self._check_ids(k)
                self._maps[key] = np.memmap(self.data_dir / s["bin"], dtype=self.dtype, mode="r")
            else:
                self._maps[key] = load_offsets(self.data_dir / s["idx"], s.get("docs"), s["tokens"], self.data_dir)
        return self._maps[key]

    def _pieces(self, start: int, length: int):
        """Split ``[start, start + length)`` of the split's stream at shard boundaries: yields
        (shard k, offset in the shard, offset in the output, count)."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.num_tokens})")
        k = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        done = 0
        while done < length:
            local = start + done - int(self.shard_starts[k])
            take = min(length - done, int(self.shard_starts[k + 1]) - (start + done))
            yield k, local, done, take
            done += take
            k += 1

    def read_tokens(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the split's stream, across shard boundaries."""
        out = np.empty(length, dtype=np.int64)
        for k, local, done, take in self._pieces(start, length):
            out[done:done + take] = self._shard(k)[local:local + take]
        return out

    def doc_ids_of(self, start: int, length: int) -> np.ndarray:
        """Per position of ``[start, start + length)``: its document's index, relative to the first position."""
        out = np.empty(length, dtype=np.int64)
        for k, local, done, take in self._pieces(start, length):
            offsets = self._shard(k, "idx")  # doc starts within the shard, plus the end
            pos = np.arange(local, local + take)
            out[done:done + take] = np.searchsorted(offsets, pos, side="right") - 1 + self.shard_doc_starts[k]
        return out - out[0]

    def window_start(self, i: int) -> int:
        """Token offset of this rank's ``i``-th window."""
        return (i * self.world_size + self.rank) * self.seq_len

    def __getitem__(self, i: int) -> dict:
        if i < 0:
            i += self.num_windows
        if not 0 <= i < self.num_windows:
            raise IndexError(f"window {i} outside [0, {self.num_windows})")
        start = self.window_start(i)
        window = torch.from_numpy(self.read_tokens(start, self.seq_len + 1))
        item = {"input_ids": window[:-1], "labels": window[1:]}
        if self.return_doc_ids:
            item["doc_ids"] = torch.from_numpy(self.doc_ids_of(start, self.seq_len))
        return item

    def iterator(self, batch_size: int, seed: int = 0, shuffle: bool = True) -> "PackedIterator":
        return PackedIterator(self, batch_size, seed=seed, shuffle=shuffle)


class PackedIterator:
    """Endless, resumable batches of a PackedDataset (see the module docstring)."""

    def __init__(self, dataset: PackedDataset, batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.ds, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = None, None

    def order(self, epoch: int) -> np.ndarray:
        """The window order of ``epoch`` (a function of seed and epoch only)."""
        if self._order_epoch != epoch:
            n = len(self.ds)
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                           else np.arange(n))
            self._order_epoch = epoch
        return self._order

    def next_indices(self) -> list[int]:
        idx: list[int] = []
        n = len(self.ds)
        while len(idx) < self.batch_size:
            order = self.order(self.epoch)
            take = min(self.batch_size - len(idx), n - self.position)
            idx += order[self.position:self.position + take].tolist()
            self.position += take
            if self.position == n:
                self.epoch, self.position = self.epoch + 1, 0
        return idx

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        items = [self.ds[i] for i in self.next_indices()]
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}

    # which windows exist and their order within an epoch; the world size and batch size may change on rescaling
    DATA_KEYS = ("seed", "shuffle", "seq_len", "split", "tokenizer_hash")
    POSITION_KEYS = ("epoch", "position")

    def state_dict(self) -> dict:
        return {"kind": KIND, "epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "num_windows": len(self.ds),
                "seq_len": self.ds.seq_len, "split": self.ds.split, "rank": self.ds.rank,
                "world_size": self.ds.world_size, "tokenizer_hash": self.ds.tokenizer_hash}

    def _check_fits(self, state: dict) -> tuple[int, int]:
        """``state``'s (epoch, position) after checking that it was taken in this iterator's layout."""
        return check_epoch_position(state, self.state_dict(), KIND, self.POSITION_KEYS, len(self.ds),
                                    "packed data")

    def load_state_dict(self, sd: dict) -> None:
        """Continue where ``sd`` was taken. The data layout must be the same (else the batches would differ)."""
        self.epoch, self.position = self._check_fits(sd)

    def rescaled_state(self, states: list[dict]) -> dict:
        """Every rank's state of a run on ``len(states)`` processes -> this rank's state: the same state when the
        world size is unchanged, else the same epoch at the same fraction of it (rounded down)."""
        first = check_run_states(states, KIND, "packed data")
        if len(states) == self.ds.world_size:
            self._check_fits(states[self.ds.rank])
            return states[self.ds.rank]
        mine = self.state_dict()
        check_same_data(first, mine, self.DATA_KEYS, "packed data")
        epoch, position = rescaled_epoch_position(first, "num_windows", len(self.ds), "packed data")
        return dict(mine, epoch=epoch, position=position)
