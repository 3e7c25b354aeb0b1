"""The data protocol (zero2all.data.protocol): every dataset and iterator kind follows it, states resume exactly on
the same number of processes and move to another one (synthetic: the exact global position; packed windows and
chat items: the same epoch at the same fraction of it, rounded down)."""

import json

import pytest
import torch
from data_helpers import make_packed_data, write_dpo_file, write_sft_file
from standin_tokenizer import ByteTokenizer

from zero2all.data.chat import DPODataset, ItemIterator, SFTDataset
from zero2all.data.datasets import PackedDataset
from zero2all.data.protocol import BatchDataset, BatchIterator
from zero2all.data.sft_shards import DPOShardDataset, SFTShardDataset, prepare_sft
from zero2all.data.synthetic import SyntheticDataset

TOK = ByteTokenizer()
SEED = 7


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Packed shards and their tokenizer; chat files; the chat files prepared as SFT and DPO shards with that
    tokenizer (it has the chat specials)."""
    root = tmp_path_factory.mktemp("protocol")
    data = make_packed_data(root)
    sft, dpo = write_sft_file(root / "sft.jsonl", 40), write_dpo_file(root / "dpo.jsonl", 12)
    quiet = dict(log=lambda *a: None)
    prepare_sft([sft], root / "tok", root / "sft-shards", **quiet)
    prepare_sft([dpo], root / "tok", root / "dpo-shards", kind="dpo", **quiet)
    return {"packed": data, "sft": sft, "dpo": dpo, "sft-shards": root / "sft-shards",
            "dpo-shards": root / "dpo-shards"}


# kind -> dataset of one rank: (files, rank, world_size) -> dataset. Sizes: every kind has items for 4 ranks.
BUILDERS = {
    "synthetic": lambda f, r, w: SyntheticDataset(64, 12, rank=r, world_size=w),
    "packed": lambda f, r, w: PackedDataset(f["packed"], 256, rank=r, world_size=w),   # 488 windows
    "sft": lambda f, r, w: SFTDataset.from_files(f["sft"], TOK, 48, "pad", rank=r, world_size=w),   # 40 rows
    "dpo": lambda f, r, w: DPODataset.from_files(f["dpo"], TOK, 40, rank=r, world_size=w),          # 12 pairs
    "sft-shards": lambda f, r, w: SFTShardDataset(f["sft-shards"], 48, 0, "pad", rank=r, world_size=w),
    "dpo-shards": lambda f, r, w: DPOShardDataset(f["dpo-shards"], 40, 0, rank=r, world_size=w),
}
EPOCHED = [k for k in BUILDERS if k != "synthetic"]


def layout(files, kind, world_size, batch_size):
    """Every rank's iterator of a ``world_size``-process run, as the trainer builds them (one dataset per rank)."""
    return [BUILDERS[kind](files, r, world_size).iterator(batch_size, seed=SEED) for r in range(world_size)]


def run(iterators, steps):
    for _ in range(steps):
        for it in iterators:
            next(it)
    return [json.loads(json.dumps(it.state_dict())) for it in iterators]  # as a JSON checkpoint stores them


def steps_into_the_second_epoch(iterators, batch_size):
    """Steps that end about half-way through the second epoch (not at its start)."""
    n = len(iterators[0].ds)
    steps = 3 * n // 2 // batch_size
    assert n < steps * batch_size < 2 * n, (n, batch_size)
    return steps


def rows_of(ds, indices):
    """The batch of items ``indices`` of ``ds``, built directly."""
    if hasattr(ds, "batch"):
        return ds.batch(indices)
    items = [ds[i] for i in indices]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def same_batch(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_every_kind_follows_the_protocol(files, kind):
    ds = BUILDERS[kind](files, 0, 1)
    it = ds.iterator(2, seed=SEED)
    assert isinstance(ds, BatchDataset) and isinstance(it, BatchIterator)
    assert iter(it) is it and len(ds) > 0
    assert ds.tokenizer_hash is None if kind in ("synthetic", "sft", "dpo") else isinstance(ds.tokenizer_hash, str)
    batch = next(it)
    assert isinstance(batch, dict) and all(isinstance(v, torch.Tensor) for v in batch.values())
    state = it.state_dict()
    assert json.loads(json.dumps(state)) == state                       # plain JSON values only
    assert {"kind", "seed", "batch_size", "rank", "world_size"} <= set(state)
    assert not isinstance(object(), BatchIterator) and not isinstance(object(), BatchDataset)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_same_world_size_resumes_exactly(files, kind):
    B = 3
    first = layout(files, kind, 2, B)
    states = run(first, steps_into_the_second_epoch(first, B) if kind in EPOCHED else 5)
    resumed = layout(files, kind, 2, B)
    for it in resumed:
        state = it.rescaled_state(states)
        assert state == states[it.state_dict()["rank"]]
        it.load_state_dict(state)
    for _ in range(3):
        for old, new in zip(first, resumed):
            assert same_batch(next(new), next(old))


def synthetic_global_batch(world_size, steps, global_batch):
    """The rows of the global batch after ``steps`` of an uninterrupted run on ``world_size`` processes, in global
    sample order (rank r's row j is global sample (next + j) * world_size + r)."""
    its = layout(None, "synthetic", world_size, global_batch // world_size)
    run(its, steps)
    rows = torch.stack([next(it)["input_ids"] for it in its], dim=1)   # (per rank, ranks, T)
    return rows.reshape(global_batch, -1)


@pytest.mark.parametrize("world_size", [1, 4])
def test_synthetic_keeps_the_exact_global_position(world_size):
    G, k = 4, 5                                                   # global batch, steps taken on 2 processes
    states = run(layout(None, "synthetic", 2, G // 2), k)
    moved = layout(None, "synthetic", world_size, G // world_size)
    for it in moved:
        state = it.rescaled_state(states)
        assert state["next_sample"] * world_size == k * G and state["world_size"] == world_size
        it.load_state_dict(state)
    rows = torch.stack([next(it)["input_ids"] for it in moved], dim=1).reshape(G, -1)
    assert torch.equal(rows, synthetic_global_batch(world_size, k, G))   # that layout, uninterrupted
    assert torch.equal(rows, synthetic_global_batch(1, k, G))            # one process, uninterrupted


def test_synthetic_position_that_does_not_split_raises():
    states = run(layout(None, "synthetic", 2, 3), 1)             # 6 samples consumed
    with pytest.raises(ValueError, match=r"6 samples consumed by 2 processes \(3 each\) cannot be split evenly "
                                         r"over 4"):
        layout(None, "synthetic", 4, 1)[0].rescaled_state(states)


@pytest.mark.parametrize("kind", EPOCHED)
@pytest.mark.parametrize("world_size", [1, 4])
def test_epoched_kinds_keep_the_epoch_and_the_fraction(files, kind, world_size):
    B = 3
    before = layout(files, kind, 2, B)
    states = run(before, steps_into_the_second_epoch(before, B))
    epoch, position, count = states[0]["epoch"], states[0]["position"], len(before[0].ds)
    assert epoch == 1 and position > 0
    for it in layout(files, kind, world_size, max(1, 2 * B // world_size)):
        state = it.rescaled_state(states)
        count_now = len(it.ds)
        assert state["epoch"] == epoch and state["position"] == position * count_now // count
        assert state["world_size"] == world_size and state["rank"] == it.state_dict()["rank"]
        assert count_now != count                                            # the layout did change
        it.load_state_dict(state)
        # the next batch starts at that position of this layout's order of the epoch
        start = state["position"]
        take = min(it.batch_size, count_now - start)
        want = rows_of(it.ds, it.order(epoch)[start:start + take].tolist())
        got = next(it)
        assert all(torch.equal(got[k][:take], want[k]) for k in want)


def test_states_of_another_kind_or_run_are_refused(files):
    synthetic = run(layout(None, "synthetic", 2, 2), 1)
    packed = layout(files, "packed", 1, 2)[0]
    with pytest.raises(ValueError, match="data state of kind 'synthetic'.*reads 'packed'"):
        packed.load_state_dict(synthetic[0])
    with pytest.raises(ValueError, match="data state of kind 'synthetic'"):
        packed.rescaled_state(synthetic)
    items = layout(files, "sft", 1, 2)[0]
    with pytest.raises(ValueError, match="data state of kind 'packed'"):
        items.load_state_dict(packed.state_dict())
    # a state of another layout is not loaded as it is: the key that differs is named
    with pytest.raises(ValueError, match="world_size is 2 in the data state but 1"):
        layout(None, "synthetic", 1, 2)[0].load_state_dict(synthetic[0])
    # the list must be every rank's state, in rank order, of one run on the same data
    one = layout(None, "synthetic", 1, 4)[0]
    with pytest.raises(ValueError, match="world_size 2 but 1 states"):
        one.rescaled_state(synthetic[:1])
    with pytest.raises(ValueError, match="says rank 1"):
        one.rescaled_state(synthetic[::-1])
    with pytest.raises(ValueError, match="rank 1 has next_sample 3 but rank 0 has 2"):
        one.rescaled_state([synthetic[0], dict(synthetic[1], next_sample=3)])
    with pytest.raises(ValueError, match="seed is 8 in the data state but 7"):
        one.rescaled_state([dict(s, seed=8) for s in synthetic])
    with pytest.raises(ValueError, match="non-empty list"):
        one.rescaled_state([])


def test_states_written_before_the_protocol_still_load(files):
    """Older states lack kind, rank, world_size (and more): they load, and move between world sizes."""
    syn = layout(None, "synthetic", 1, 2)[0]
    syn.load_state_dict({"kind": "synthetic", "seed": SEED, "next_sample": 12})
    assert syn.next_sample == 12
    assert syn.rescaled_state([{"kind": "synthetic", "seed": SEED, "next_sample": 3}] * 2)["next_sample"] == 6
    packed = layout(files, "packed", 1, 2)[0]
    old_packed = {"epoch": 1, "position": 5, "seed": SEED, "batch_size": 2, "shuffle": True,
                  "num_windows": len(packed.ds), "seq_len": 256, "split": "train", "rank": 0, "world_size": 1,
                  "tokenizer_hash": packed.ds.tokenizer_hash}
    packed.load_state_dict(old_packed)
    assert (packed.epoch, packed.position) == (1, 5)
    items = layout(files, "sft", 1, 2)[0]
    old_items = {"epoch": 2, "position": 3, "seed": SEED, "batch_size": 2, "shuffle": True, "num_items": 20}
    items.load_state_dict(dict(old_items, num_items=40))
    assert (items.epoch, items.position) == (2, 3)
    assert items.rescaled_state([old_items, old_items])["position"] == 6   # 3 of 20 -> 6 of 40


def test_wrapped_item_dataset_has_the_layout_of_its_base(files):
    """A dataset that batches another's items (DPO pairs with reference log-probs) iterates in that layout."""
    from zero2all.train.posttrain import ReferenceLogprobDataset

    base = BUILDERS["dpo"](files, 1, 2)
    it = ItemIterator(ReferenceLogprobDataset(base, torch.zeros(len(base), 2)), 2, seed=SEED)
    assert (it.state_dict()["rank"], it.state_dict()["world_size"]) == (1, 2)
