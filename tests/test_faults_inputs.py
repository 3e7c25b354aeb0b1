"""Bad and unusual inputs at the command line: damaged token shards, damaged tokenizer files, directory inputs that
hold the tool's own outputs, shards whose tokenizer moved or changed, full disks, bad server addresses. Each case
must end with one line on stderr naming the file (or value) and what to do, exit code 2 for bad input and 1 for an
operating-system failure, and leave what the user owns as it was."""

import json
import os
import shutil

import pytest

from zero2all.cli import main
from zero2all.data.pretokenize import prepare
from zero2all.model.io import save_model
from zero2all.model.z2all import build_model
from zero2all.tokenizer import train_tokenizer

TINY_MODEL = ["model.hidden_dim=32", "model.intermediate_size=72", "model.n_layers=1", "model.n_heads=4",
              "model.n_kv_heads=2", "model.ops.rmsnorm='torch'", "model.ops.rope='torch'",
              "model.ops.swiglu='torch'", "model.ops.cross_entropy='torch'"]
QUIET_RUN = ["train.device='cpu'", "train.precision='fp32'", "train.tensorboard=false", "train.warmup_steps=1",
             "train.micro_batch_size=2", "train.eval_every=0", "train.num_samples=0", "train.log_every=0"]

NO_FILTERS = ["gopher.enabled=false", "repetition.enabled=false", "c4.enabled=false", "code.enabled=false",
              "dedup.exact=false", "dedup.near=false"]


def _quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    docs = [{"content": f"def f{i}(x):\n    return x * {i} + len('document {i}')\n" * (1 + i % 4)}
            for i in range(120)]
    (d / "good.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    return d


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tok"
    train_tokenizer([str(corpus / "good.jsonl")], 448, out, log=_quiet)
    return out


@pytest.fixture(scope="module")
def data_dir(corpus, tok_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "data"
    prepare([str(corpus / "good.jsonl")], tok_dir, out, workers=1, log=_quiet)
    return out


@pytest.fixture(scope="module")
def ckpt(tok_dir, tmp_path_factory):
    from zero2all.config import ModelConfig, OpsConfig

    cfg = ModelConfig(vocab_size=448, hidden_dim=32, intermediate_size=64, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_seq_len=64, ops=OpsConfig.plain())
    return save_model(build_model(cfg, seed=0), tmp_path_factory.mktemp("ckpt") / "ckpt", tokenizer_dir=tok_dir)


def _one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"z2all {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _files(d) -> dict:
    """Every file under ``d`` (hidden ones too) with its bytes: what a failed command must leave as it was."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _pretrain(data, out, *extra):
    return ["pretrain", "--config", "tiny", "--data", str(data), "--out", str(out), "--no-progress", *TINY_MODEL,
            "model.vocab_size=448", "model.max_seq_len=16", *QUIET_RUN, "train.ckpt_every=0", *extra]


# ---------------------------------------------------------------------------------------------------- directory inputs


def test_a_clean_output_given_as_input_is_read_without_its_report(corpus, tmp_path, capsys):
    from zero2all.corpus.readers import expand_paths

    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(corpus / "good.jsonl", src / "good.jsonl")
    out = tmp_path / "clean"
    assert main(["clean", "--input", str(src), "--out", str(out), "--workers", "1", *NO_FILTERS]) == 0
    assert (out / "report.json").exists()
    assert [os.path.basename(f) for f in expand_paths(str(out))] == ["clean-00000.jsonl"]
    # a folder of the user's that only happens to hold a file named report.json: it is data like any other
    user = tmp_path / "user"
    user.mkdir()
    (user / "report.json").write_text('[{"text": "a record"}]')
    assert [os.path.basename(f) for f in expand_paths(str(user))] == ["report.json"]
    # hidden folders (a run's .work/, temporaries) are never read
    (src / ".work").mkdir()
    (src / ".work" / "chunk-000000.jsonl").write_text('{"content": "work file"}\n')
    assert [os.path.basename(f) for f in expand_paths(str(src))] == ["good.jsonl"]
    # the clean output read by the next command: no malformed record (report.json was the one)
    capsys.readouterr()
    assert main(["clean", "--input", str(out), "--out", str(tmp_path / "again"), "--workers", "1",
                 *NO_FILTERS]) == 0
    report = json.loads((tmp_path / "again" / "report.json").read_text())
    assert report["read"]["bad"] == {} and "malformed_json" not in capsys.readouterr().out


@pytest.mark.parametrize("command", ["clean", "prepare", "train-tokenizer"])
def test_an_out_inside_an_input_directory_is_refused(command, corpus, tok_dir, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(corpus / "good.jsonl", src / "good.jsonl")
    before = _files(src)
    extra = {"clean": ["--workers", "1"], "prepare": ["--tokenizer", str(tok_dir), "--workers", "1"],
             "train-tokenizer": ["--vocab-size", "448"]}[command]
    assert main([command, "--input", f"code={src}", "--out", str(src / "out"), *extra]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert f"--out {src / 'out'}: inside the input directory {src}" in line and "outside" in line
    assert _files(src) == before and sorted(p.name for p in src.iterdir()) == ["good.jsonl"]
