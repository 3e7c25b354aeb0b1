"""Small data sets the data tests share: packed token shards (with the tokenizer that made them) and chat files."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

STDLIB = sysconfig.get_paths()["stdlib"]


def make_packed_data(root: Path) -> Path:
    """Train a 512-token tokenizer into ``root / "tok"`` and prepare token shards (several, with a valid split) of
    a few stdlib packages plus many short documents into ``root / "data"``; returns the data directory."""
    from zero2all.data.pretokenize import prepare
    from zero2all.tokenizer import train_tokenizer

    docs = [{"content": "短文" * (1 + i % 5) + f" doc {i}"} for i in range(200)]  # many short documents
    (root / "short.jsonl").write_text("\n".join(json.dumps(d, ensure_ascii=False) for d in docs), encoding="utf-8")
    inputs = [os.path.join(STDLIB, "json", "*.py"), os.path.join(STDLIB, "email", "*.py"), str(root / "short.jsonl")]
    train_tokenizer(inputs, 512, root / "tok", log=lambda *a: None)
    prepare(inputs, root / "tok", root / "data", workers=1, valid_fraction=0.1, chunk_bytes=15_000,
            shard_chunks=3, log=lambda *a: None)
    return root / "data"


def write_sft_file(path: Path, n: int = 40, trailing: str = "") -> Path:
    """``n`` instruction records of varied lengths as JSON lines, then ``trailing`` (e.g. a malformed line)."""
    path.write_text("".join(json.dumps({"instruction": "q" * (i % 7 + 1), "output": "a" * (i % 5 + 1)}) + "\n"
                            for i in range(n)) + trailing)
    return path


def write_dpo_file(path: Path, n: int = 5) -> Path:
    """``n`` preference records with prompts of growing length."""
    path.write_text("".join(json.dumps({"prompt": "p" * (i + 1), "chosen": "yes", "rejected": "no!"}) + "\n"
                            for i in range(n)))
    return path
