"""Chat data for post-training: records -> chat-template token ids with assistant-only labels, packing, DPO pairs.

Record formats (JSON lines; one record per line)::

    instruction   {"instruction": "...", "input": "...", "output": "...", "system": "..."}   (input, system optional)
    conversation  {"conversations": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...],
                   "tools": [...]}   (tools optional: OpenAI's function list, offered in the system message; an
                   assistant message may have OpenAI's "tool_calls", a "tool" message is a call's result; the
                   written form is in ``data/tools.py``, and a tool-calling turn is assistant output like any)
    preference    {"prompt": "..." or "conversations": [...], "chosen": ..., "rejected": ...}
                  (chosen / rejected: a string, an assistant message, or a list of messages to append)

Rendering uses the tokenizer's chat template (``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message) through
``tokenizer.apply_chat_template`` only, so training sees exactly the ids inference will build. Each message's ids
are the difference between the template of the conversation up to it and up to the one before it, and an
assistant message's header (``<|im_start|>assistant\\n``) is the generation prompt: so the labels cover precisely
what the model must produce after the generation prompt, i.e. the assistant's content and its ``<|im_end|>``.
Everything else (system, user, headers, the newline after ``<|im_end|>``) gets label -100 (ignored by the loss).

``SFTSample.labels`` are aligned with ``input_ids`` (labels[j] is input_ids[j] or -100); batching shifts them per
sample (inputs = ids[:-1], targets = labels[1:]) before packing, so no target ever crosses from one sample into the
next. Batches use the trainer's layout: ``input_ids`` and ``labels`` (the shifted targets).

Packing puts several samples in one row of ``seq_len`` tokens with per-sample document ids (attention stays inside
a sample: the model's ``doc_ids``) and positions restarting at 0 for each sample (the model's ``position_ids``);
the packed loss then equals the loss of the samples run one by one (the mean over all assistant tokens). (RoPE
scores depend only on position differences, so restarting positions changes little in exact arithmetic; it keeps
the rounding, and dynamic NTK scaling, exactly as for a sample alone.)
Padding puts one sample per row instead. Bad records raise :class:`ChatDataError` naming ``file:line`` or are
counted and skipped (``on_error="skip"``).

:class:`SFTDataset` and :class:`DPODataset` hold the rendered rows in memory (fine for instruction sets up to a few
hundred thousand samples) and give the trainer's data contract: ``ds.iterator(batch_size, seed)`` is an endless,
resumable batch stream (``state_dict`` / ``load_state_dict`` / ``rescaled_state`` of
:class:`ItemIterator`, the :mod:`zero2all.data.protocol` contract), rows split disjointly between ranks.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from zero2all.data.protocol import (
    check_epoch_position,
    check_run_states,
    check_same_data,
    rescaled_epoch_position,
)
from zero2all.data.tools import call_arguments, template_messages

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")


class ChatDataError(ValueError):
    """A record is malformed; the message starts with ``file:line``."""


@dataclass
class SFTSample:
    input_ids: list[int]
    labels: list[int]          # aligned with input_ids; IGNORE_INDEX where no loss is taken

    @property
    def num_label_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


@dataclass
class DPOSample:
    chosen: SFTSample          # prompt + chosen answer, labels on the answer only
    rejected: SFTSample


@dataclass
class LoadStats:
    records: int = 0
    skipped: int = 0           # malformed records skipped with on_error="skip"
    truncated: int = 0         # samples cut to the maximum length
    dropped_no_labels: int = 0  # samples with no assistant token left (e.g. truncated away)
    errors: list[str] = field(default_factory=list)  # the first few skip messages

    def summary(self) -> str:
        return (f"{self.records} records, {self.skipped} malformed skipped, {self.truncated} truncated, "
                f"{self.dropped_no_labels} without assistant tokens dropped")


# --------------------------------------------------------------------------------------------------------------
# records -> messages


def _check_messages(messages, where: str, field_name: str = "conversations") -> list[dict]:
    """Validated messages; an assistant message may carry ``tool_calls`` (its ``content`` then may be empty or
    null) and a ``tool`` message is a tool's result (``data/tools.py``)."""
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(f"{where}: '{field_name}' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatDataError(f"{where}: {field_name}[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatDataError(f"{where}: {field_name}[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None:
            if not isinstance(calls, list):
                raise ChatDataError(f"{where}: {field_name}[{i}].tool_calls must be a list")
            for j, call in enumerate(calls):
                try:
                    call_arguments(call)
                except ValueError as e:
                    raise ChatDataError(f"{where}: {field_name}[{i}].tool_calls[{j}]: {e}") from None
            content = "" if content is None else content
        if not isinstance(content, str):
            raise ChatDataError(f"{where}: {field_name}[{i}].content must be a string")
        out.append({"role": role, "content": content, **({"tool_calls": calls} if calls else {})})
    return out


def _tools(record: dict, where: str) -> list[dict] | None:
    """A conversation record's ``tools`` (OpenAI's function list), checked."""
    tools = record.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ChatDataError(f"{where}: 'tools' must be a list of tool objects "
                            "({\"type\": \"function\", \"function\": {...}})")
    return tools


def instruction_to_messages(record: dict, where: str = "record") -> list[dict]:
    """{"instruction", "input"?, "output", "system"?} -> [system?, user, assistant]."""
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            raise ChatDataError(f"{where}: instruction record needs a string '{key}'")
    extra = record.get("input") or ""
    if not isinstance(extra, str):
        raise ChatDataError(f"{where}: 'input' must be a string")
    user = record["instruction"] + ("\n\n" + extra if extra else "")
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
    if record.get("system"):
        messages.insert(0, {"role": "system", "content": str(record["system"])})
    return messages


def record_to_messages(record, where: str = "record") -> list[dict]:
    """An SFT record of either format -> a validated message list that contains an assistant turn."""
    if not isinstance(record, dict):
        raise ChatDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        messages = template_messages(_check_messages(record["conversations"], where), _tools(record, where))
    elif "instruction" in record:
        messages = instruction_to_messages(record, where)
    else:
        raise ChatDataError(f"{where}: expected 'conversations' or 'instruction'/'output' keys, "
                            f"got {sorted(record)[:6]}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatDataError(f"{where}: no assistant message (nothing to learn from)")
    return messages


# --------------------------------------------------------------------------------------------------------------
# messages -> ids and labels


def render_messages(tokenizer, messages: Sequence[dict], train_on: str = "assistant",
                    where: str = "record") -> SFTSample:
    """Token ids of the conversation and labels on assistant tokens (all of them, or only the ``last`` turn)."""
    if train_on not in ("assistant", "last"):
        raise ValueError(f"train_on: {train_on!r} is not one of assistant, last")
    im_end = tokenizer.im_end_id
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids: list[int] = []
    labels: list[int] = []
    for i, m in enumerate(messages):
        full = list(tokenizer.apply_chat_template(list(messages[:i + 1])))
        if full[:len(ids)] != ids:
            raise ChatDataError(f"{where}: the chat template is not prefix-stable at message {i}")
        learn = m["role"] == "assistant" and (train_on == "assistant" or i == last_assistant)
        if not learn:
            labels += [IGNORE_INDEX] * (len(full) - len(ids))
            ids = full
            continue
        header = list(tokenizer.apply_chat_template(list(messages[:i]), add_generation_prompt=True))
        if full[:len(header)] != header:
            raise ChatDataError(f"{where}: the generation prompt is not a prefix of assistant message {i}")
        body = full[len(header):]
        # the answer runs up to and including its last <|im_end|>; what follows (a newline) is template glue
        end = len(body) - body[::-1].index(im_end) if im_end in body else len(body)
        labels += [IGNORE_INDEX] * (len(header) - len(ids)) + body[:end] + [IGNORE_INDEX] * (len(body) - end)
        ids = full
    return SFTSample(ids, labels)


def render_sft_record(tokenizer, record, where: str = "record") -> SFTSample:
    return render_messages(tokenizer, record_to_messages(record, where), "assistant", where)


def _answer_messages(value, where: str, key: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        return template_messages(_check_messages([value], where, key))
    if isinstance(value, list):
        return template_messages(_check_messages(value, where, key))
    raise ChatDataError(f"{where}: '{key}' must be a string, a message or a list of messages")


def render_dpo_record(tokenizer, record, where: str = "record") -> DPOSample:
    """{"prompt" | "conversations", "chosen", "rejected"} -> the two full sequences, labels on the answers."""
    if not isinstance(record, dict):
        raise ChatDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("chosen", "rejected"):
        if key not in record:
            raise ChatDataError(f"{where}: preference record needs '{key}'")
    if "conversations" in record:
        prompt = template_messages(_check_messages(record["conversations"], where), _tools(record, where))
    elif isinstance(record.get("prompt"), str):
        prompt = [{"role": "user", "content": record["prompt"]}]
        if record.get("system"):
            prompt.insert(0, {"role": "system", "content": str(record["system"])})
    else:
        raise ChatDataError(f"{where}: preference record needs a string 'prompt' or a 'conversations' list")
    pair = []
    for key in ("chosen", "rejected"):
        answer = _answer_messages(record[key], where, key)
        if answer[-1]["role"] != "assistant":
            raise ChatDataError(f"{where}: '{key}' must end with an assistant message")
        pair.append(render_messages(tokenizer, prompt + answer, "last", where))
    return DPOSample(*pair)


# --------------------------------------------------------------------------------------------------------------
# files


def iter_jsonl(path: str | Path) -> Iterator[tuple[str, object]]:
    """Yield (``file:line``, parsed record) for each non-empty line of a .jsonl / .jsonl.gz file; a .json file
    holding one list of records is read whole. A line that is not JSON raises :class:`ChatDataError`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ChatDataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        if not isinstance(data, list):
            raise ChatDataError(f"{path}: a .json file must hold a list of records")
        for i, rec in enumerate(data):
            yield f"{path}[{i}]", rec
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, ChatDataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})")


def _load(paths, render, on_error: str, stats: LoadStats):
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error: {on_error!r} is not one of raise, skip")
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        for where, record in iter_jsonl(path):
            stats.records += 1
            try:
                if isinstance(record, ChatDataError):
                    raise record
                yield render(record, where)
            except ChatDataError as e:
                if on_error == "raise":
                    raise
                stats.skipped += 1
                if len(stats.errors) < 10:
                    stats.errors.append(str(e))


def _fit(sample: SFTSample, max_len: int | None, stats: LoadStats) -> SFTSample | None:
    if max_len is not None and len(sample.input_ids) > max_len:
        sample = SFTSample(sample.input_ids[:max_len], sample.labels[:max_len])
        stats.truncated += 1
    if sample.num_label_tokens == 0 or len(sample.input_ids) < 2:
        stats.dropped_no_labels += 1
        return None
    return sample


def load_sft_samples(paths, tokenizer, max_len: int | None = None, on_error: str = "raise"
                     ) -> tuple[list[SFTSample], LoadStats]:
    """Render every record of the files; samples longer than ``max_len`` tokens are truncated (and counted)."""
    stats = LoadStats()
    out = []
    for s in _load(paths, lambda r, w: render_sft_record(tokenizer, r, w), on_error, stats):
        s = _fit(s, max_len, stats)
        if s is not None:
            out.append(s)
    return out, stats


def load_dpo_samples(paths, tokenizer, max_len: int | None = None, on_error: str = "raise"
                     ) -> tuple[list[DPOSample], LoadStats]:
    stats = LoadStats()
    out = []
    for pair in _load(paths, lambda r, w: render_dpo_record(tokenizer, r, w), on_error, stats):
        chosen, rejected = _fit(pair.chosen, max_len, stats), _fit(pair.rejected, max_len, stats)
        if chosen is not None and rejected is not None:
            out.append(DPOSample(chosen, rejected))
    return out, stats


# --------------------------------------------------------------------------------------------------------------
# batches


def shift(sample: SFTSample) -> tuple[list[int], list[int]]:
    """(inputs, targets) for next-token prediction: inputs = ids[:-1], targets = labels[1:]."""
    return sample.input_ids[:-1], sample.labels[1:]


def pack_samples(samples: Iterable[SFTSample], seq_len: int, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """Greedy in-order packing into rows of ``seq_len`` tokens.

    Each row, in the trainer's batch layout: ``input_ids``, ``labels`` (the shifted targets, -100 where no loss),
    ``doc_ids`` (sample index within the row; the tail padding is a document of its own) and ``position_ids``
    (restarting at 0 for each sample). A sample longer than seq_len + 1 tokens is an error here (truncate when
    loading).
    """
    rows: list[dict[str, torch.Tensor]] = []
    cur: list[tuple[list[int], list[int]]] = []
    used = 0

    def flush():
        nonlocal cur, used
        if not cur:
            return
        tokens, targets, docs, pos = [], [], [], []
        for d, (t, y) in enumerate(cur):
            tokens += t
            targets += y
            docs += [d] * len(t)
            pos += list(range(len(t)))
        n = seq_len - len(tokens)
        tokens += [pad_id] * n
        targets += [IGNORE_INDEX] * n
        docs += [len(cur)] * n
        pos += list(range(n))
        rows.append({"input_ids": torch.tensor(tokens), "labels": torch.tensor(targets),
                     "doc_ids": torch.tensor(docs), "position_ids": torch.tensor(pos)})
        cur, used = [], 0

    for i, s in enumerate(samples):
        t, y = shift(s)
        if len(t) > seq_len:
            raise ValueError(f"sample {i}: {len(t) + 1} tokens do not fit seq_len {seq_len} + 1; truncate first")
        if used + len(t) > seq_len:
            flush()
        cur.append((t, y))
        used += len(t)
    flush()
    return rows


def pad_samples(samples: Iterable[SFTSample], seq_len: int | None, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """One sample per row, right-padded to ``seq_len`` (None: to the longest sample of ``samples``)."""
    pairs = [shift(s) for s in samples]
    length = seq_len or max(len(t) for t, _ in pairs)
    rows = []
    for i, (t, y) in enumerate(pairs):
        if len(t) > length:
            raise ValueError(f"sample {i}: {len(t) + 1} tokens do not fit seq_len {length} + 1; truncate first")
        n = length - len(t)
        rows.append({"input_ids": torch.tensor(t + [pad_id] * n), "labels": torch.tensor(y + [IGNORE_INDEX] * n),
                     "position_ids": torch.arange(length)})
    return rows


def collate(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack rows of equal length into a batch (B, T) per key."""
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def dpo_collate(pairs: Sequence[DPOSample], pad_id: int, seq_len: int | None = None) -> dict[str, torch.Tensor]:
    """A preference batch, every sequence right-padded to one length T (so chosen and rejected can run as one
    forward): ``chosen_ids``, ``chosen_labels``, ``rejected_ids``, ``rejected_labels``, each (B, T)."""
    length = seq_len or max(max(len(p.chosen.input_ids), len(p.rejected.input_ids)) for p in pairs) - 1
    chosen = collate(pad_samples([p.chosen for p in pairs], length, pad_id))
    rejected = collate(pad_samples([p.rejected for p in pairs], length, pad_id))
    return {"chosen_ids": chosen["input_ids"], "chosen_labels": chosen["labels"],
            "rejected_ids": rejected["input_ids"], "rejected_labels": rejected["labels"]}


# --------------------------------------------------------------------------------------------------------------
# datasets with the trainer's iterator contract (endless, resumable; see zero2all/data/datasets.py)


def _layout(dataset) -> tuple[int, int]:
    """(rank, world_size) the dataset's items were split for. A wrapper that batches another dataset's items
    (found as ``.base``, e.g. DPO pairs with reference log-probs attached) has that dataset's layout; a dataset
    that records none is a single process's."""
    while not hasattr(dataset, "world_size") and hasattr(dataset, "base"):
        dataset = dataset.base
    return int(getattr(dataset, "rank", 0)), int(getattr(dataset, "world_size", 1))


class ItemIterator:
    """Endless batches over ``dataset.batch(indices)``: epoch e visits the items in the order
    ``rng([seed, e]).permutation(len)``; the state is (epoch, position), so a resumed run continues exactly. On
    another number of processes (``rescaled_state``) the epoch is kept at the same fraction, rounded down
    (:mod:`zero2all.data.protocol`)."""

    KIND = "items"
    # which items exist and their order within an epoch; the world size and batch size may change on rescaling
    DATA_KEYS = ("seed", "shuffle", "tokenizer_hash")
    POSITION_KEYS = ("epoch", "position")

    def __init__(self, dataset, batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty (nothing survived loading, or fewer rows than ranks)")
        self.ds, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.rank, self.world_size = _layout(dataset)
        self.epoch, self.position = 0, 0

    def order(self, epoch: int):
        """The item order of ``epoch`` (a function of seed and epoch only)."""
        import numpy as np

        n = len(self.ds)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        idx: list[int] = []
        n = len(self.ds)
        while len(idx) < self.batch_size:
            take = min(self.batch_size - len(idx), n - self.position)
            idx += self.order(self.epoch)[self.position:self.position + take].tolist()
            self.position += take
            if self.position == n:
                self.epoch, self.position = self.epoch + 1, 0
        return self.ds.batch(idx)

    def state_dict(self) -> dict:
        return {"kind": self.KIND, "epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "num_items": len(self.ds),
                "rank": self.rank, "world_size": self.world_size,
                "tokenizer_hash": getattr(self.ds, "tokenizer_hash", None)}

    def _check_fits(self, state: dict) -> tuple[int, int]:
        """``state``'s (epoch, position) after checking that it was taken in this iterator's layout."""
        return check_epoch_position(state, self.state_dict(), self.KIND, self.POSITION_KEYS, len(self.ds),
                                    "chat data")

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.position = self._check_fits(sd)

    def rescaled_state(self, states: list[dict]) -> dict:
        """Every rank's state of a run on ``len(states)`` processes -> this rank's state: the same state when the
        world size is unchanged, else the same epoch at the same fraction of it (rounded down)."""
        first = check_run_states(states, self.KIND, "chat data")
        if len(states) == self.world_size:
            self._check_fits(states[self.rank])
            return states[self.rank]
        mine = self.state_dict()
        check_same_data(first, mine, self.DATA_KEYS, "chat data")
        epoch, position = rescaled_epoch_position(first, "num_items", len(self.ds), "chat data")
        return dict(mine, epoch=epoch, position=position)




def _shard(items: list, rank: int, world_size: int) -> list:
    """Items r, r + R, ... for rank r of R, the same count on every rank (so all ranks run the same steps)."""
    per_rank = len(items) // world_size
    return items[rank::world_size][:per_rank]


class SFTDataset:
    """Chat samples as fixed-length rows (``input_ids``, ``labels``, ``position_ids``, and ``doc_ids`` when packed)
    of ``seq_len`` tokens, built in memory; ``iterator(batch_size, seed)`` follows the trainer's contract."""

    def __init__(self, samples: Sequence[SFTSample], seq_len: int, pad_id: int, mode: str = "pack", rank: int = 0,
                 world_size: int = 1):
        if mode not in ("pack", "pad"):
            raise ValueError(f"mode: {mode!r} is not one of pack, pad")
        rows = pack_samples(samples, seq_len, pad_id) if mode == "pack" else pad_samples(samples, seq_len, pad_id)
        self.rows = _shard(rows, rank, world_size)
        self.seq_len, self.mode, self.rank, self.world_size = seq_len, mode, rank, world_size
        self.stats: LoadStats | None = None
        self.tokenizer_hash: str | None = None  # from_files sets the tokenizer's

    @classmethod
    def from_files(cls, paths, tokenizer, seq_len: int, mode: str = "pack", on_error: str = "raise",
                   rank: int = 0, world_size: int = 1) -> "SFTDataset":
        samples, stats = load_sft_samples(paths, tokenizer, max_len=seq_len + 1, on_error=on_error)
        ds = cls(samples, seq_len, tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id, mode,
                 rank, world_size)
        ds.stats, ds.tokenizer_hash = stats, getattr(tokenizer, "hash", None)
        return ds

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        return collate([self.rows[i] for i in indices])

    def iterator(self, batch_size: int, seed: int = 0, shuffle: bool = True) -> ItemIterator:
        return ItemIterator(self, batch_size, seed, shuffle)


class DPODataset:
    """Preference pairs; a batch is :func:`dpo_collate` padded to ``seq_len`` (fixed shapes)."""

    def __init__(self, pairs: Sequence[DPOSample], seq_len: int, pad_id: int, rank: int = 0, world_size: int = 1):
        self.pairs = _shard(list(pairs), rank, world_size)
        self.seq_len, self.pad_id, self.rank, self.world_size = seq_len, pad_id, rank, world_size
        self.stats: LoadStats | None = None
        self.tokenizer_hash: str | None = None  # from_files sets the tokenizer's

    @classmethod
    def from_files(cls, paths, tokenizer, seq_len: int, on_error: str = "raise", rank: int = 0,
                   world_size: int = 1) -> "DPODataset":
        pairs, stats = load_dpo_samples(paths, tokenizer, max_len=seq_len + 1, on_error=on_error)
        ds = cls(pairs, seq_len, tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id, rank,
                 world_size)
        ds.stats, ds.tokenizer_hash = stats, getattr(tokenizer, "hash", None)
        return ds

    def __len__(self) -> int:
        return len(self.pairs)

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        return dpo_collate([self.pairs[i] for i in indices], self.pad_id, self.seq_len)

    def iterator(self, batch_size: int, seed: int = 0, shuffle: bool = True) -> ItemIterator:
        return ItemIterator(self, batch_size, seed, shuffle)
