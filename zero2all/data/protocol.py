"""The contract every training data source follows: a dataset hands out endless, resumable batch iterators.

``BatchDataset``
    ``len(ds)``: the items (windows, rows, pairs, samples) this rank visits per epoch.
    ``ds.iterator(batch_size, seed=0) -> BatchIterator``: an endless stream of batches for this rank; the same
    ``(batch_size, seed)`` on the same data and layout gives the same stream.
    ``ds.tokenizer_hash: str | None``: the hash of the tokenizer that made the tokens (None: no tokenizer did,
    e.g. synthetic data); the trainer refuses to resume on data of another tokenizer.
    The dataset object is built for one rank of ``world_size`` processes (its *layout*); ranks see disjoint items.

``BatchIterator``
    ``iter(it)`` is ``it``; ``next(it) -> dict[str, torch.Tensor]`` never raises StopIteration (an epoch that ends
    mid-batch continues with the next epoch's first items).

    ``it.state_dict() -> dict``: plain JSON values only (str, int, float, bool, None), so a checkpoint can store it
    as JSON. It holds the position (``epoch`` / ``position`` or ``next_sample``) plus the layout it was taken in:
    ``kind`` (which iterator wrote it), ``rank``, ``world_size``, ``batch_size``, ``seed`` and what fixes the
    items (``num_windows`` / ``num_items``, ``seq_len``, ``split``, ``tokenizer_hash``, ...).

    ``it.load_state_dict(state) -> None``: continue exactly where ``state`` was taken. Only for a state of the same
    layout: every key of ``state`` other than the position must equal this iterator's own, else ValueError naming
    the key and both values (a state of another kind names the kind). A key missing from ``state`` is accepted,
    so states written before that key existed still load.

    ``it.rescaled_state(states: list[dict]) -> dict``: ``states`` is EVERY rank's ``state_dict()`` of one run
    with ``len(states)`` processes, in rank order. Returns a state in this iterator's current layout (its own
    rank, world size, batch size) that continues that run's sequence of global batches, for
    ``it.load_state_dict``:

    - exactly where the data allows: synthetic sample ``i`` of rank ``r`` is global sample ``i * world + r``, so
      the global position (samples consumed by all ranks together) is kept exactly; a position that the new
      number of processes cannot split evenly raises ValueError with the numbers;
    - else as close as the layout allows: packed windows and chat items are split between ranks and each rank
      shuffles its own share, so another number of processes has other per-rank permutations and no position in
      them continues the old sequence. The epoch is kept and the position is the same fraction of the epoch,
      rounded down: ``floor(position * len_now / len_then)`` with ``len`` the per-rank item count. Rounding down
      repeats at most one item per rank of the current epoch rather than skipping data never seen.

    With ``len(states)`` equal to this iterator's world size it returns ``states[rank]`` after checking that the
    state fits (the same layout), so an unchanged run resumes exactly. It is a pure function of ``states`` and
    the iterator's configuration: it neither reads nor changes the iterator's position. It raises ValueError
    when the states disagree with each other (kind, epoch, position, seed, ... differ between ranks), name
    another rank or world size than their place in the list, or were taken on other data (another seed, split,
    sequence length or tokenizer, where the state records them).

The helpers below hold the checks the iterators share.
"""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch


@runtime_checkable
class BatchIterator(Protocol):
    """An endless, resumable batch stream of one rank (see the module docstring)."""

    def __iter__(self) -> "BatchIterator": ...

    def __next__(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def rescaled_state(self, states: list[dict]) -> dict: ...


@runtime_checkable
class BatchDataset(Protocol):
    """One rank's share of a data source; ``iterator`` gives its batches (see the module docstring)."""

    tokenizer_hash: str | None

    def __len__(self) -> int: ...

    def iterator(self, batch_size: int, seed: int = 0) -> BatchIterator: ...


def state_kind(state: dict) -> str | None:
    """The ``kind`` of an iterator state; states written before kinds were recorded are recognised by the key
    only their iterator writes."""
    if "kind" in state:
        return state["kind"]
    for key, kind in (("next_sample", "synthetic"), ("num_windows", "packed"), ("num_items", "items")):
        if key in state:
            return kind
    return None


def check_kind(state, kind: str, what: str) -> None:
    """Raise ValueError unless ``state`` is a dict written by an iterator of ``kind``."""
    if not isinstance(state, dict):
        raise ValueError(f"{what}: a data state must be a dict, got {type(state).__name__}")
    found = state_kind(state)
    if found != kind:
        raise ValueError(f"{what}: cannot use a data state of kind {found!r} (keys {', '.join(sorted(state))}); "
                         f"this iterator reads {kind!r} states")


def check_same_layout(state: dict, mine: dict, position_keys: Iterable[str], what: str) -> None:
    """Raise ValueError naming the first key (other than the position) whose value in ``state`` differs from this
    iterator's ``mine``; keys absent from ``state`` (older states) pass."""
    skip = set(position_keys)
    for key, value in mine.items():
        if key in skip or key not in state:
            continue
        if state[key] != value:
            raise ValueError(f"{what}: {key} is {state[key]!r} in the data state but {value!r} for this iterator; "
                             f"loading it would not continue the same batch sequence")


def check_run_states(states, kind: str, what: str) -> dict:
    """Check that ``states`` are every rank's state of one run of ``kind``, in rank order: each names its place
    (``rank``) and the run's size (``world_size``) where it records them, and all agree on everything but the rank
    (every rank of a run has as many items and runs the same steps, so all are at the same position). Returns rank
    0's state."""
    if not isinstance(states, (list, tuple)) or not states:
        raise ValueError(f"{what}: rescaled_state needs every rank's state as a non-empty list, got {states!r}")
    world = len(states)
    for r, state in enumerate(states):
        check_kind(state, kind, f"{what} (state {r} of {world})")
        if state.get("rank", r) != r:
            raise ValueError(f"{what}: state {r} of {world} says rank {state['rank']!r}; pass the states in rank "
                             f"order")
        if state.get("world_size", world) != world:
            raise ValueError(f"{what}: state {r} says world_size {state['world_size']!r} but {world} states were "
                             f"given; pass every rank's state")
    first = states[0]
    for r, state in enumerate(states[1:], 1):
        for key in sorted((set(first) | set(state)) - {"rank"}):
            if first.get(key) != state.get(key):
                raise ValueError(f"{what}: rank {r} has {key} {state.get(key)!r} but rank 0 has {first.get(key)!r}; "
                                 f"the states are not of one run")
    return first


def check_same_data(first: dict, mine: dict, keys: Iterable[str], what: str) -> None:
    """Before rescaling: the keys that fix which items exist and their order (seed, split, ...) must be equal in
    the old run's state and in this iterator; only the number of processes (and the batch size) may change."""
    for key in keys:
        if key in first and key in mine and first[key] != mine[key]:
            raise ValueError(f"{what}: {key} is {first[key]!r} in the data state but {mine[key]!r} for this "
                             f"iterator; another {key} is another batch sequence, not the same one on another "
                             f"number of processes")


def rescaled_epoch_position(first: dict, count_key: str, count_now: int, what: str) -> tuple[int, int]:
    """(epoch, position) of a shuffled per-rank epoch moved to a layout with ``count_now`` items per rank: the
    epoch kept and the same fraction of it, rounded down (see the module docstring)."""
    for key in ("epoch", "position", count_key):
        if key not in first:
            raise ValueError(f"{what}: the data state has no {key!r}; cannot move it to another number of processes")
    epoch, position, count_then = int(first["epoch"]), int(first["position"]), int(first[count_key])
    if not 0 <= position < count_then:
        raise ValueError(f"{what}: position {position} is outside [0, {count_then}) ({count_key} {count_then})")
    return epoch, position * count_now // count_then


def check_epoch_position(state: dict, mine: dict, kind: str, position_keys: Iterable[str], length: int,
                         what: str) -> tuple[int, int]:
    """``state``'s (epoch, position) after checking that it was taken in the layout ``mine`` describes, of an
    iterator over ``length`` items (the shared check of the epoch/position iterators)."""
    check_kind(state, kind, what)
    check_same_layout(state, mine, position_keys, what)
    for key in position_keys:
        if key not in state:
            raise ValueError(f"{what}: the data state has no {key!r}")
    epoch, position = int(state["epoch"]), int(state["position"])
    if epoch < 0 or not 0 <= position < length:
        raise ValueError(f"{what}: epoch {epoch}, position {position}: the position is outside [0, {length}) or the "
                         f"epoch is negative")
    return epoch, position

