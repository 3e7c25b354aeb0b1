"""A synthetic token source with the packed dataset's interface, for ``data.path = ""`` (tests, throughput runs).

Each sample is an arithmetic progression modulo the vocabulary: ``x_t = (a + d * t) mod V`` with a random start
``a`` and a random stride ``d`` in [1, 8]. It is learnable (after two tokens the rest is determined), so a working
trainer shows a falling loss on it, yet costs nothing to produce.

Sample ``i`` of rank ``r`` is global sample ``i * world_size + r`` and depends only on (seed, that index): batches
of 8 are exactly four batches of 2 concatenated, ranks never overlap, and the iterator's whole state is one
counter, so resuming is exact. The same counter moves the stream to another number of processes exactly
(``rescaled_state``): the global position ``next_sample * world_size`` is kept.

It follows :mod:`zero2all.data.protocol` (``BatchDataset`` / ``BatchIterator``).
"""

from __future__ import annotations

import torch

from zero2all.data.protocol import check_kind, check_run_states, check_same_data, check_same_layout

MAX_STRIDE = 8
SPLIT_SAMPLES = 1 << 40  # global sample indices of one split: validation samples start at this offset
KIND = "synthetic"


class SyntheticDataset:
    """``SyntheticDataset(vocab_size, seq_len, split, rank, world_size)``; ``.iterator(batch_size, seed)``."""

    def __init__(self, vocab_size: int, seq_len: int, split: str = "train", rank: int = 0, world_size: int = 1):
        if vocab_size < 2 or seq_len < 1:
            raise ValueError(f"synthetic data: need vocab_size >= 2 and seq_len >= 1, got {vocab_size}, {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"synthetic data: rank {rank} is outside world_size {world_size}")
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.split, self.rank, self.world_size = split, rank, world_size
        self.tokenizer_hash = None  # no tokenizer made these tokens

    def __len__(self) -> int:
        """Samples this rank can draw before its global indices would reach the next split's samples."""
        return SPLIT_SAMPLES // self.world_size

    def iterator(self, batch_size: int, seed: int = 0) -> "SyntheticIterator":
        return SyntheticIterator(self, batch_size, seed)

    def sample(self, index: int, seed: int) -> torch.Tensor:
        """Tokens of global sample ``index``: (seq_len + 1,) long."""
        split_offset = 0 if self.split == "train" else SPLIT_SAMPLES  # validation never repeats a training sample
        g = torch.Generator().manual_seed((seed * 1_000_003 + split_offset + index) & ((1 << 63) - 1))
        start = torch.randint(0, self.vocab_size, (1,), generator=g)
        stride = torch.randint(1, MAX_STRIDE + 1, (1,), generator=g)
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size


class SyntheticIterator:
    """Endless batches of a SyntheticDataset; the state is the per-rank sample counter ``next_sample``."""

    # the samples depend on these and the global index only: another value is another stream
    DATA_KEYS = ("seed", "split", "vocab_size", "seq_len")

    def __init__(self, dataset: SyntheticDataset, batch_size: int, seed: int):
        if batch_size <= 0:
            raise ValueError(f"synthetic data: batch_size must be positive, got {batch_size}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.next_sample = 0  # index (per rank) of the next sample to yield

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        ds = self.dataset
        rows = [ds.sample((self.next_sample + i) * ds.world_size + ds.rank, self.seed)
                for i in range(self.batch_size)]
        self.next_sample += self.batch_size
        tokens = torch.stack(rows)                                   # (B, T + 1)
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    def state_dict(self) -> dict:
        ds = self.dataset
        return {"kind": KIND, "seed": self.seed, "next_sample": self.next_sample, "batch_size": self.batch_size,
                "rank": ds.rank, "world_size": ds.world_size, "split": ds.split, "vocab_size": ds.vocab_size,
                "seq_len": ds.seq_len}

    def _check_fits(self, state: dict) -> int:
        """``state``'s ``next_sample`` after checking that it was taken in this iterator's layout."""
        check_kind(state, KIND, "synthetic data")
        check_same_layout(state, self.state_dict(), ("next_sample",), "synthetic data")
        if "next_sample" not in state:
            raise ValueError("synthetic data: the data state has no 'next_sample'")
        next_sample = int(state["next_sample"])
        if next_sample < 0:
            raise ValueError(f"synthetic data: next_sample {next_sample} is negative")
        return next_sample

    def load_state_dict(self, state: dict) -> None:
        self.next_sample = self._check_fits(state)

    def rescaled_state(self, states: list[dict]) -> dict:
        """Every rank's state of a run on ``len(states)`` processes -> this rank's state that continues at the same
        global sample (exact; ValueError when the consumed samples do not split evenly over this world size)."""
        first = check_run_states(states, KIND, "synthetic data")
        ds, then = self.dataset, len(states)
        if then == ds.world_size:
            self._check_fits(states[ds.rank])
            return states[ds.rank]
        check_same_data(first, self.state_dict(), self.DATA_KEYS, "synthetic data")
        if "next_sample" not in first:
            raise ValueError("synthetic data: the data state has no 'next_sample'")
        per_rank = int(first["next_sample"])
        consumed = per_rank * then  # every rank drew samples [0, next_sample): global samples [0, consumed)
        if consumed % ds.world_size:
            raise ValueError(f"synthetic data: {consumed} samples consumed by {then} processes ({per_rank} each) "
                             f"cannot be split evenly over {ds.world_size} processes")
        return dict(self.state_dict(), next_sample=consumed // ds.world_size)
