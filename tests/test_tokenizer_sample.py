"""`z2all train-tokenizer --sample-bytes`: a bounded sample (zero2all.tokenizer.train.ByteReservoir) that is the same
for a seed whatever order or sharding the corpus is read in."""

from __future__ import annotations

import json
import random

from zero2all.cli import main
from zero2all.tokenizer.train import ByteReservoir, _priority, train_tokenizer


def _docs(n=400, seed=0):
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 120))) for _ in range(n)]


def _prefix(docs, budget, seed):
    """The reference: sort by priority, take documents while they fit."""
    out, total = [], 0
    for d in sorted(docs, key=lambda d: (_priority(seed, d), d)):
        n = len(d.encode())
        if total + n > budget:
            break
        out.append(d)
        total += n
    return out


def test_reservoir_is_bounded_and_independent_of_order_and_sharding():
    docs = _docs()
    budget = sum(len(d) for d in docs) // 5
    whole = ByteReservoir(budget, seed=7)
    for d in docs:
        whole.add(d)
    assert whole.bytes <= budget and whole.bytes > budget * 0.9
    assert whole.texts() == _prefix(docs, budget, 7)
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    parts = [ByteReservoir(budget, seed=7) for _ in range(3)]
    for i, d in enumerate(shuffled):
        parts[i % 3].add(d)
        assert parts[i % 3].bytes <= budget  # never more than the budget held
    merged = ByteReservoir(budget, seed=7)
    for p in parts:
        merged.merge(p)
    assert merged.texts() == whole.texts() and merged.seen_docs == len(docs)
    other = ByteReservoir(budget, seed=8)
    for d in docs:
        other.add(d)
    assert set(other.texts()) != set(whole.texts())


def test_train_tokenizer_sample_is_deterministic_across_file_order(tmp_path, capsys):
    docs = _docs(600, seed=3)
    for name, part in (("a", docs[:300]), ("b", docs[300:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    total = sum(len(d) for d in docs)
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    t1 = train_tokenizer([a, b], 384, None, sample_bytes=total // 4, log=lambda *x: None)
    t2 = train_tokenizer([b, a], 384, None, sample_bytes=total // 4, log=lambda *x: None)
    assert t1.hash == t2.hash
    tr = t1.meta["training"]
    assert tr["fed_bytes"] <= total // 4 and tr["corpus_bytes"] == total and tr["sample_bytes"] == total // 4
    assert main(["train-tokenizer", "--input", a, b, "--vocab-size", "384", "--out", str(tmp_path / "tok"),
                 "--sample-bytes", f"{total / 4e3:.3f}K"]) == 0
    assert main(["train-tokenizer", "--input", a, "--vocab-size", "384", "--out", str(tmp_path / "t2"),
                 "--sample-bytes", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sample-bytes lots" in err[0] and not (tmp_path / "t2").exists()
