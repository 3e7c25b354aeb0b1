"""A synthetic token source with the packed dataset's interface, for ``data.path = ""`` (tests, throughput runs).

Each sample is an arithmetic progression modulo the vocabulary: ``x_t = (a + d * t) mod V`` with a random start
``a`` and a random stride ``d`` in [1, 8]. It is learnable (after two tokens the rest is determined), so a working
trainer shows a falling loss on it, yet costs nothing to produce.

Sample ``i`` of rank ``r`` is global sample ``i * world_size + r`` and depends only on (seed, that index): batches
of 8 are exactly four batches of 2 concatenated, ranks never overlap, and the iterator's whole state is one
counter, so resuming is exact.
"""

from __future__ import annotations

import torch

MAX_STRIDE = 8


class SyntheticDataset:
    """``SyntheticDataset(vocab_size, seq_len, split, rank, world_size)``; ``.iterator(batch_size, seed)``."""

    def __init__(self, vocab_size: int, seq_len: int, split: str = "train", rank: int = 0, world_size: int = 1):
        if vocab_size < 2 or seq_len < 1:
            raise ValueError(f"synthetic data: need vocab_size >= 2 and seq_len >= 1, got {vocab_size}, {seq_len}")
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.split, self.rank, self.world_size = split, rank, world_size
        self.tokenizer_hash = None  # no tokenizer made these tokens

    def iterator(self, batch_size: int, seed: int = 0) -> "SyntheticIterator":
        return SyntheticIterator(self, batch_size, seed)

    def sample(self, index: int, seed: int) -> torch.Tensor:
        """Tokens of global sample ``index``: (seq_len + 1,) long."""
        split_offset = 0 if self.split == "train" else 1 << 40  # validation never repeats a training sample
        g = torch.Generator().manual_seed((seed * 1_000_003 + split_offset + index) & ((1 << 63) - 1))
        start = torch.randint(0, self.vocab_size, (1,), generator=g)
        stride = torch.randint(1, MAX_STRIDE + 1, (1,), generator=g)
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size


class SyntheticIterator:
    def __init__(self, dataset: SyntheticDataset, batch_size: int, seed: int):
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
        return {"kind": "synthetic", "seed": self.seed, "next_sample": self.next_sample}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "synthetic":
            raise ValueError(f"synthetic data: cannot resume from a data state of kind {sd.get('kind')!r}")
        self.seed = int(sd["seed"])
        self.next_sample = int(sd["next_sample"])
