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


ENGLISH_WORDS = ("the model reads text and predicts the next token of every document it sees while the tokenizer "
                 "splits words into pieces that are learned from a corpus of plain english sentences").split()


def english(rng, n_words: int) -> str:
    """A sentence of ``n_words`` words drawn by ``rng`` (a ``random.Random``) from :data:`ENGLISH_WORDS`."""
    return " ".join(rng.choice(ENGLISH_WORDS) for _ in range(n_words)) + "."


def exported_tiny_model(d: Path, rng) -> Path:
    """A 384-token tokenizer trained on 40 English sentences drawn by ``rng``, a 2-layer model saved with it in
    ``d / "ours"`` (our format) and exported to ``d / "hf"`` (transformers); returns ``d``."""
    from zero2all.config import ModelConfig, OpsConfig
    from zero2all.model.io import export_hf, save_model
    from zero2all.model.z2all import build_model
    from zero2all.tokenizer import train_tokenizer

    corpus = d / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": english(rng, 60)}) + "\n" for _ in range(40)))
    tok = train_tokenizer([str(corpus)], 384, d / "tok", log=lambda *a: None)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_dim=64, intermediate_size=96, n_layers=2, n_heads=4,
                      n_kv_heads=2, max_seq_len=32, initializer_range=0.2, ops=OpsConfig.plain())
    save_model(build_model(cfg, seed=3).eval(), d / "ours", tokenizer_dir=d / "tok")
    export_hf(d / "ours", d / "hf")
    return d
