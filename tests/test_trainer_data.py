"""The trainer on real token shards: tokenizer -> prepare -> pretrain, self-contained checkpoints, tokenizer checks."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from zero2all.checkpoint.compat import CheckpointMismatch
from zero2all.config import ConfigError
from zero2all.train.trainer import Trainer

sys.path.insert(0, os.path.dirname(__file__))
from test_trainer import tiny_cfg  # noqa: E402

json_pkg = os.path.dirname(json.__file__)  # a few stdlib files: a small real corpus


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from zero2all.data.pretokenize import prepare
    from zero2all.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("data")
    corpus = root / "corpus"  # the json package's sources as .txt documents
    corpus.mkdir()
    for f in sorted(Path(json_pkg).glob("*.py")):
        (corpus / (f.stem + ".txt")).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    out = {}
    for name, vocab in (("a", 384), ("b", 448)):
        tok_dir = root / f"tok_{name}"
        train_tokenizer([str(corpus)], vocab, out_dir=tok_dir, log=lambda *a: None)
        prepare([str(corpus)], tok_dir, root / f"data_{name}", valid_fraction=0.2, workers=1, seq_len=24,
                progress=False, log=lambda *a: None)
        out[name] = (tok_dir, root / f"data_{name}")
    return out


def data_cfg(out_dir, data_dir, *extra):
    return tiny_cfg(out_dir, f"data.path='{data_dir}'", "model.vocab_size=512", *extra)


def test_pretrain_on_shards_checkpoint_carries_tokenizer(tmp_path, prepared):
    from zero2all.model.io import load_model
    from zero2all.tokenizer import load_tokenizer

    tok_dir, data_dir = prepared["a"]
    trainer = Trainer(data_cfg(tmp_path / "run", data_dir, "train.max_steps=4", "train.eval_every=2",
                               "train.eval_batches=2", "train.num_samples=1", "train.sample_new_tokens=4",
                               "train.sample_prompts=['def ']"), show_progress=False)
    assert trainer.tokenizer is not None and trainer.eval_data is not None
    assert trainer.tokenizer_hash == load_tokenizer(tok_dir).hash
    assert trainer.cfg.model.eos_token_id == trainer.tokenizer.eos_id
    summary = trainer.fit()
    assert summary["steps"] == 4 and "last_eval_loss" in summary
    ckpt = tmp_path / "run" / "ckpt-000004"
    tok = load_tokenizer(ckpt)
    assert tok.hash == trainer.tokenizer_hash
    assert tok.decode(tok.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    assert load_tokenizer(tmp_path / "run" / "final").hash == tok.hash
    assert json.loads((ckpt / "z2all.json").read_text())["tokenizer_hash"] == tok.hash
    assert load_model(ckpt).cfg.eos_token_id == tok.eos_id
    samples = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in samples if s["kind"] == "sample"] == ["def "]  # sample_every=0: at the end only


def test_resume_with_data_of_another_tokenizer_fails(tmp_path, prepared):
    Trainer(data_cfg(tmp_path, prepared["a"][1], "train.max_steps=2"), show_progress=False).fit()
    trainer = Trainer(data_cfg(tmp_path, prepared["b"][1], "train.max_steps=3", "train.resume='auto'"),
                      show_progress=False)
    with pytest.raises(CheckpointMismatch, match="tokenizer: hash"):
        trainer.fit()


def test_resume_on_shards_continues_the_batch_sequence(tmp_path, prepared):
    data_dir = prepared["a"][1]
    straight = Trainer(data_cfg(tmp_path / "s", data_dir, "train.max_steps=4"), show_progress=False)
    straight_batches = [next(straight.train_iter)["input_ids"] for _ in range(8)]
    first = Trainer(data_cfg(tmp_path / "r", data_dir, "train.max_steps=2"), show_progress=False)
    first.fit()
    resumed = Trainer(data_cfg(tmp_path / "r", data_dir, "train.max_steps=4", "train.resume='auto'"),
                      show_progress=False)
    resumed._maybe_resume()
    assert resumed.step == 2
    assert torch.equal(next(resumed.train_iter)["input_ids"], straight_batches[2])  # 2 steps x 1 micro-batch


def test_model_vocab_smaller_than_tokenizer_is_refused(tmp_path, prepared):
    with pytest.raises(ConfigError, match="model.vocab_size: 256 is smaller than the tokenizer's vocabulary"):
        Trainer(tiny_cfg(tmp_path, f"data.path='{prepared['a'][1]}'", "model.vocab_size=256"))


def test_missing_data_dir_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Trainer(tiny_cfg(tmp_path, f"data.path='{tmp_path / 'nowhere'}'"))


@pytest.mark.slow
def test_demo_pipeline_end_to_end(tmp_path, capsys):
    """`z2all demo` on the real stdlib corpus, with a 1-layer model and 3 steps to stay quick."""
    from zero2all.cli import main

    args = ["demo", "--out", str(tmp_path / "demo"), "--steps", "3", "--sft-steps", "3", "--threads", "2",
            "model.n_layers=1",
            "model.hidden_dim=32", "model.intermediate_size=64", "model.n_heads=2", "model.n_kv_heads=1",
            "data.seq_len=64", "train.eval_batches=1", "train.sample_new_tokens=4", "train.tensorboard=false"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for step in ("1/7 corpus", "2/7 tokenizer", "3/7 shards", "4/7 pretraining", "5/7 samples", "6/7 SFT",
                 "7/7 chat"):
        assert step in out
    assert "--- prompt 'def '" in out and "validation loss" in out and "--- assistant:" in out
    demo = tmp_path / "demo"
    for name in ("report.md", "loss.png", "metrics.jsonl", "final/model.safetensors", "final/tokenizer.json",
                 "ckpt-000003/manifest.json", "tokenizer/tokenizer.json", "data/meta.json",
                 "sft/final/model.safetensors", "sft-data/train.jsonl"):
        assert (demo / name).exists(), name
    assert main(args) == 0  # a second run reuses everything and resumes at the end
    assert "reusing" in capsys.readouterr().out
