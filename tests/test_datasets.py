import json
import shutil

import numpy as np
import pytest
import torch
from data_helpers import make_packed_data

from zero2all.data.datasets import PackedDataset
from zero2all.data.pretokenize import TokenizerMismatchError, read_meta


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_packed_data(tmp_path_factory.mktemp("packed"))


def _stream(d, split="train"):
    meta = read_meta(d)
    return np.concatenate([np.fromfile(d / s["bin"], dtype=meta["dtype"]) for s in meta["splits"][split]["shards"]])


def test_windows_are_shifted_slices_of_the_stream(data_dir):
    stream = _stream(data_dir).astype(np.int64)
    assert len(read_meta(data_dir)["splits"]["train"]["shards"]) >= 3  # windows cross shard boundaries
    for T in (7, 64, 100):
        ds = PackedDataset(data_dir, T)
        assert len(ds) == (len(stream) - 1) // T
        for i in (0, 1, len(ds) // 2, len(ds) - 1):
            item = ds[i]
            assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (T,)
            assert np.array_equal(item["input_ids"].numpy(), stream[i * T:i * T + T])
            assert np.array_equal(item["labels"].numpy(), stream[i * T + 1:i * T + T + 1])
        with pytest.raises(IndexError):
            ds[len(ds)]
    assert ds.tokenizer_hash == read_meta(data_dir)["tokenizer"]["hash"]
    valid = PackedDataset(data_dir, 16, split="valid")
    assert np.array_equal(valid[0]["input_ids"].numpy(), _stream(data_dir, "valid")[:16])


def test_reads_only_what_it_needs(data_dir):
    ds = PackedDataset(data_dir, 32)
    ds[0]
    assert list(ds._maps) == [(0, "bin")] and isinstance(ds._maps[(0, "bin")], np.memmap)


def test_ranks_get_disjoint_windows(data_dir):
    T, R = 33, 3
    ranks = [PackedDataset(data_dir, T, rank=r, world_size=R) for r in range(R)]
    full = PackedDataset(data_dir, T)
    assert len({len(d) for d in ranks}) == 1 and len(ranks[0]) == len(full) // R
    starts = [set(d.window_start(i) for i in range(len(d))) for d in ranks]
    assert not (starts[0] & starts[1]) and not (starts[1] & starts[2]) and not (starts[0] & starts[2])
    assert set.union(*starts) == {i * T for i in range(len(ranks[0]) * R)}
    assert torch.equal(ranks[1][0]["input_ids"], full[1]["input_ids"])
    with pytest.raises(ValueError, match="rank 3 is outside"):
        PackedDataset(data_dir, T, rank=3, world_size=3)


def test_doc_ids_follow_the_index(data_dir):
    ds = PackedDataset(data_dir, 48, return_doc_ids=True)
    changes = 0
    for i in range(len(ds)):
        item = ds[i]
        eos = (item["input_ids"] == ds.eos_id).long()
        expected = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(eos, 0)[:-1]])
        assert torch.equal(item["doc_ids"], expected), i
        changes += int(item["doc_ids"][-1])
    assert changes > 100


def test_iterator_epochs_cover_every_window_once(data_dir):
    ds = PackedDataset(data_dir, 64)
    n, B = len(ds), 5
    it = ds.iterator(B, seed=3)
    seen = [i for _ in range(-(-2 * n // B)) for i in it.next_indices()]
    assert sorted(seen[:n]) == list(range(n)) and sorted(seen[n:2 * n]) == list(range(n))
    assert seen[:n] != seen[n:2 * n]  # reshuffled each epoch
    assert ds.iterator(B, seed=3).next_indices() == seen[:B]
    assert ds.iterator(B, seed=4).next_indices() != seen[:B]
    assert ds.iterator(B, shuffle=False).next_indices() == list(range(B))
    batch = next(ds.iterator(B, seed=3))
    assert batch["input_ids"].shape == (B, 64) and batch["labels"].shape == (B, 64)
    assert torch.equal(batch["input_ids"][1], ds[seen[1]]["input_ids"])


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_continues_with_exactly_the_next_batch(data_dir, world_size):
    T, B = 40, 7
    ds = PackedDataset(data_dir, T, rank=world_size - 1, world_size=world_size, return_doc_ids=True)
    k = len(ds) // B + 3  # past an epoch boundary
    straight = ds.iterator(B, seed=11)
    expected = [next(straight) for _ in range(k + 4)]
    first = ds.iterator(B, seed=11)
    for _ in range(k):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    assert state["epoch"] == 1
    resumed = PackedDataset(data_dir, T, rank=world_size - 1, world_size=world_size,
                            return_doc_ids=True).iterator(B, seed=11)
    resumed.load_state_dict(state)
    for want in expected[k:]:
        got = next(resumed)
        for key in ("input_ids", "labels", "doc_ids"):
            assert torch.equal(got[key], want[key])
    wrong = ds.iterator(B + 1, seed=11)
    with pytest.raises(ValueError, match="batch_size is 7 in the data state but 8"):
        wrong.load_state_dict(state)


def test_errors_name_the_problem(data_dir, tmp_path):
    with pytest.raises(TokenizerMismatchError, match="tokenized with tokenizer"):
        PackedDataset(data_dir, 16, expected_tokenizer_hash="0" * 64)
    PackedDataset(data_dir, 16, expected_tokenizer_hash=read_meta(data_dir)["tokenizer"]["hash"])
    with pytest.raises(ValueError, match="fewer than world_size"):
        PackedDataset(data_dir, 10**7)
    with pytest.raises(ValueError, match="no split 'test'"):
        PackedDataset(data_dir, 16, split="test")
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        PackedDataset(tmp_path, 16)
    broken = tmp_path / "broken"
    shutil.copytree(data_dir, broken)
    shard = broken / read_meta(data_dir)["splits"]["train"]["shards"][1]["bin"]
    shard.write_bytes(shard.read_bytes()[:-6])
    with pytest.raises(ValueError, match="the shard is truncated or was replaced"):
        PackedDataset(broken, 16)
