"""Bits per byte on text files during training (train.eval_data): logged per source as eval/<source>/bits_per_byte,
equal to `z2all eval` on the final checkpoint."""

import json
import os
import sys

import pytest

from zero2all.config import ConfigError
from zero2all.train.trainer import Trainer

sys.path.insert(0, os.path.dirname(__file__))
from test_trainer import tiny_cfg  # noqa: E402

json_pkg = os.path.dirname(json.__file__)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from pathlib import Path

    from zero2all.data.pretokenize import prepare
    from zero2all.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("data")
    corpus = root / "corpus"
    corpus.mkdir()
    for f in sorted(Path(json_pkg).glob("*.py")):
        (corpus / (f.stem + ".txt")).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    train_tokenizer([str(corpus)], 384, out_dir=root / "tok", log=lambda *a: None)
    prepare([str(corpus)], root / "tok", root / "data", valid_fraction=0.2, workers=1, seq_len=24, progress=False,
            log=lambda *a: None)
    (root / "code.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in
                                             (Path(json_pkg) / "decoder.py").read_text().split("\n\n")[:6]))
    (root / "prose.txt").write_text("The model reads text and predicts the next token of every document.\n")
    return root


def test_eval_data_bits_per_byte_logged_per_source(tmp_path, prepared):
    from zero2all.eval.perplexity import evaluate_files

    files = [f"code={prepared / 'code.jsonl'}", str(prepared / "prose.txt")]
    trainer = Trainer(tiny_cfg(tmp_path / "run", f"data.path='{prepared / 'data'}'", "model.vocab_size=384",
                               "train.max_steps=4", "train.eval_every=2", "train.eval_batches=1",
                               f"train.eval_data={files!r}", "train.eval_data_max_docs=10"), show_progress=False)
    summary = trainer.fit()
    assert "last_eval_loss" in summary  # the validation-loss records are still the ones summarised
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    bpb = [r for r in records if r["kind"] == "eval" and "code/bits_per_byte" in r]
    assert [r["step"] for r in bpb] == [0, 2, 4]
    assert all(set(r) >= {"prose/bits_per_byte", "overall/bits_per_byte", "code/loss", "code/ppl"} for r in bpb)
    assert bpb[-1]["code/bits_per_byte"] < bpb[0]["code/bits_per_byte"]  # it learned something
    ref = evaluate_files(tmp_path / "run" / "final", files, max_docs=10, device="cpu", context=24)
    for src in ("code", "prose"):
        assert abs(ref.sources[src].to_dict()["bits_per_byte"] - bpb[-1][f"{src}/bits_per_byte"]) < 1e-4, src


def test_eval_data_config_errors(tmp_path, prepared):
    with pytest.raises(ConfigError, match="train.eval_data: expected a list"):
        tiny_cfg(tmp_path, "train.eval_data=3").validate()
    with pytest.raises(ConfigError, match="train.eval_data_max_docs: must be at least 1"):
        tiny_cfg(tmp_path, "train.eval_data_max_docs=0").validate()
    trainer = Trainer(tiny_cfg(tmp_path / "r", f"data.path='{prepared / 'data'}'", "model.vocab_size=384",
                               "train.max_steps=1", "train.eval_every=1", "train.eval_batches=1",
                               f"train.eval_data=['{tmp_path / 'missing.jsonl'}']"), show_progress=False)
    with pytest.raises(ConfigError, match="train.eval_data: .*missing.jsonl"):
        trainer.fit()
