"""Bad and unusual inputs at the command line: damaged token shards, damaged tokenizer files, directory inputs that
hold the tool's own outputs, shards whose tokenizer moved or changed, full disks, bad server addresses. Each case
must end with one line on stderr naming the file (or value) and what to do, exit code 2 for bad input and 1 for an
operating-system failure, and leave what the user owns as it was."""

import errno
import json
import os
import shutil
import socket

import numpy as np
import pytest

from zero2all.cli import main
from zero2all.data.pretokenize import ShardError, prepare, read_meta
from zero2all.model.io import save_model
from zero2all.model.z2all import build_model
from zero2all.tokenizer import load_tokenizer, train_tokenizer

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


# ---------------------------------------------------------------------------------------------------- token shards


def _shard_case(data_dir, tmp_path, case):
    d = _copy(data_dir, tmp_path / "data")
    meta = read_meta(d)
    shard = meta["splits"]["train"]["shards"][0]
    if case == "truncated":
        with open(d / shard["bin"], "r+b") as f:
            f.truncate(100)
        return d, f"{d / shard['bin']}: 100 bytes, but meta.json lists {shard['tokens']:,} tokens of uint16"
    if case == "garbled-index":
        (d / shard["idx"]).write_bytes(b"\x80\x04\x95garbled pickle, not an index")
        return d, f"{d / shard['idx']}: not a document index written by `z2all prepare`"
    if case == "short-index":
        np.save(d / shard["idx"], np.arange(3, dtype=np.int64))
        return d, f"{d / shard['idx']}: damaged document index (2 documents, meta.json lists {shard['docs']})"
    if case == "id-too-large":  # an older meta.json without the recorded largest id: found by the scan
        for s in meta["splits"]["train"]["shards"]:
            s.pop("max_id", None)
        (d / "meta.json").write_text(json.dumps(meta))
        tokens = np.memmap(d / shard["bin"], dtype=np.uint16, mode="r+")
        tokens[shard["tokens"] - 5] = 5000
        tokens.flush()
        return d, f"{d / shard['bin']}: holds token id 5000, but the model has 448 token rows"
    if case == "changed-after-prepare":  # below the vocabulary, but above what prepare wrote
        tokens = np.memmap(d / shard["bin"], dtype=np.uint16, mode="r+")
        tokens[7] = shard["max_id"] + 1
        tokens.flush()
        return d, f"{d / shard['bin']}: holds token id {shard['max_id'] + 1}, but `z2all prepare` wrote none above"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["truncated", "garbled-index", "short-index", "id-too-large",
                                  "changed-after-prepare"])
def test_a_damaged_shard_is_one_line_before_training(case, data_dir, tmp_path, capsys):
    d, expected = _shard_case(data_dir, tmp_path, case)
    before = _files(d)
    out = tmp_path / "run"
    assert main(_pretrain(d, out, "train.max_steps=1")) == 2
    line = _one_error_line(capsys.readouterr().err, "pretrain")
    assert expected in line and f"re-run `z2all prepare` with --overwrite to rebuild {d}" in line
    assert _files(d) == before and not out.exists()


def test_prepare_records_the_largest_id_and_a_small_model_is_refused_at_once(data_dir, monkeypatch):
    from zero2all.data import datasets

    shards = read_meta(data_dir)["splits"]["train"]["shards"]
    largest = max(int(np.fromfile(data_dir / s["bin"], dtype=np.uint16).max()) for s in shards)
    assert max(s["max_id"] for s in shards) == largest
    scanned = []
    monkeypatch.setattr(datasets, "max_token_id", lambda tokens: scanned.append(len(tokens)) or 0)
    with pytest.raises(ShardError, match=f"holds token id {largest}, but the model has {largest} token rows"):
        datasets.PackedDataset(data_dir, 16, model_vocab_size=largest)
    assert scanned == []  # refused from meta.json, without reading the shards


def test_large_shards_are_scanned_once_each_before_their_first_batch(data_dir, tmp_path, monkeypatch):
    from zero2all.data import datasets

    d, _ = _shard_case(data_dir, tmp_path, "id-too-large")
    monkeypatch.setattr(datasets.PackedDataset, "EAGER_SCAN_BYTES", 0)  # as if the shards were large
    scanned = []
    real = datasets.max_token_id
    monkeypatch.setattr(datasets, "max_token_id", lambda tokens: scanned.append(len(tokens)) or real(tokens))
    ds = datasets.PackedDataset(d, 16, model_vocab_size=448)
    assert scanned == []
    with pytest.raises(ShardError, match="5000"):
        ds.read_tokens(0, 4)
    good = datasets.PackedDataset(data_dir, 16, model_vocab_size=448)
    for i in range(len(good)):
        good[i]
    assert scanned == [ds.shards[0]["tokens"]] + [s["tokens"] for s in good.shards]  # each shard once


@pytest.mark.parametrize("case", ["garbled-index", "truncated-tokens"])
def test_a_damaged_sft_directory_is_one_line(case, tok_dir, ckpt, tmp_path, capsys):
    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f"ok {i} " * 3}) + "\n"
                               for i in range(20)))
    d = tmp_path / "sft-data"
    assert main(["prepare-sft", "--input", str(records), "--tokenizer", str(tok_dir), "--out", str(d)]) == 0
    if case == "garbled-index":
        (d / "train.index.npy").write_bytes(b"junk")
        expected = f"{d / 'train.index.npy'}: damaged (not a plain .npy array"
    else:
        with open(d / "train.tokens.bin", "r+b") as f:
            f.truncate(10)
        expected = f"{d / 'train.tokens.bin'}: 10 bytes, but its index lists"
    before = _files(d)
    capsys.readouterr()
    assert main(["sft", "--init", str(ckpt), "--data", str(d), "--out", str(tmp_path / "run"), "--no-progress",
                 "train.max_steps=1", "train.device='cpu'"]) == 2
    line = _one_error_line(capsys.readouterr().err, "sft")
    assert expected in line and f"re-run `z2all prepare-sft` with --overwrite to rebuild {d}" in line
    assert _files(d) == before


# ---------------------------------------------------------------------------------------------------- shard tokenizer


def _hash_in_checkpoint(run):
    return load_tokenizer(run / "final").hash


def test_shards_keep_their_tokenizer_when_moved_or_retrained(corpus, tmp_path, capsys):
    tok = tmp_path / "tok"
    train_tokenizer([str(corpus / "good.jsonl")], 448, tok, log=_quiet)
    original = load_tokenizer(tok).hash
    data = tmp_path / "data"
    prepare([str(corpus / "good.jsonl")], tok, data, workers=1, log=_quiet)
    meta = read_meta(data)
    assert meta["tokenizer"]["copy"] == "tokenizer" and load_tokenizer(data / "tokenizer").hash == original
    # the shards move, and another tokenizer is trained into the old folder
    moved = tmp_path / "elsewhere" / "data"
    moved.parent.mkdir()
    data.rename(moved)
    train_tokenizer([os.path.join(os.path.dirname(os.__file__), "json", "*.py")], 448, tok, log=_quiet)
    assert load_tokenizer(tok).hash != original
    tok_files = _files(tok)
    assert main(_pretrain(moved, tmp_path / "run", "train.max_steps=1")) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if line.startswith("note:"))
    assert f"{tok} no longer holds the tokenizer that made {moved}" in note and original[:16] in note
    assert _hash_in_checkpoint(tmp_path / "run") == original
    assert _files(tok) == tok_files


def test_shards_of_earlier_versions_name_their_tokenizer_folder(corpus, tok_dir, data_dir, tmp_path, capsys):
    """meta.json without a kept copy: the recorded folder is used while its hash matches; a changed one is one
    line (exit 2), a folder that is gone a warning."""
    tok = _copy(tok_dir, tmp_path / "tok")
    d = _copy(data_dir, tmp_path / "data")
    meta = read_meta(d)
    del meta["tokenizer"]["copy"]
    meta["tokenizer"]["dir"] = str(tok)
    (d / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(d / "tokenizer")
    assert main(_pretrain(d, tmp_path / "a", "train.max_steps=1")) == 0
    assert _hash_in_checkpoint(tmp_path / "a") == meta["tokenizer"]["hash"]
    capsys.readouterr()
    train_tokenizer([os.path.join(os.path.dirname(os.__file__), "json", "*.py")], 448, tok, log=_quiet)
    before = _files(d)
    assert main(_pretrain(d, tmp_path / "b", "train.max_steps=1")) == 2
    line = _one_error_line(capsys.readouterr().err, "pretrain")
    assert f"{tok}: holds tokenizer {load_tokenizer(tok).hash[:16]}, but {d} was made with" in line
    assert "put that tokenizer back" in line and not (tmp_path / "b").exists() and _files(d) == before
    shutil.rmtree(tok)
    assert main(_pretrain(d, tmp_path / "c", "train.max_steps=1")) == 0
    warning = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"{tok}, the tokenizer that made {d}, is gone" in warning[0]


def test_overwrite_replaces_the_kept_tokenizer(corpus, tok_dir, tmp_path):
    d = tmp_path / "data"
    prepare([str(corpus / "good.jsonl")], tok_dir, d, workers=1, log=_quiet)
    other = tmp_path / "tok2"
    train_tokenizer([os.path.join(os.path.dirname(os.__file__), "json", "*.py")], 448, other, log=_quiet)
    prepare([str(corpus / "good.jsonl")], other, d, workers=1, log=_quiet, overwrite=True)
    assert load_tokenizer(d / "tokenizer").hash == load_tokenizer(other).hash == read_meta(d)["tokenizer"]["hash"]


# ---------------------------------------------------------------------------------------------------- inference inputs


def _damaged_tokenizer_ckpt(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "ckpt")
    text = (d / "tokenizer.json").read_text()
    (d / "tokenizer.json").write_text(text[:200])  # a copy cut short
    return d


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "export-gguf"])
def test_a_truncated_tokenizer_json_is_one_line(command, ckpt, tmp_path, monkeypatch, capsys):
    import zero2all.infer.server as server

    d = _damaged_tokenizer_ckpt(ckpt, tmp_path)
    before = _files(d)
    monkeypatch.setattr(server, "run_server", lambda *a, **k: pytest.fail("served with a damaged tokenizer"))
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("/exit\n"))
    args = {"generate": ["--prompt", "x"], "chat": [], "serve": ["--port", "0"],
            "export-gguf": ["--out", str(tmp_path / "m.gguf")]}[command]
    assert main([command, "--ckpt", str(d), *args]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert f"{d / 'tokenizer.json'}:1: not valid JSON" in line and "the file is damaged" in line
    assert _files(d) == before and not (tmp_path / "m.gguf").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA GPU is present")
@pytest.mark.parametrize("command", ["generate", "serve", "eval"])
def test_device_cuda_without_a_gpu_is_one_line(command, ckpt, corpus, capsys):
    args = {"generate": ["--prompt", "x"], "serve": ["--port", "0"], "eval": ["--data", str(corpus / "good.jsonl")]}
    assert main([command, "--ckpt", str(ckpt), "--device", "cuda", *args[command]]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert "--device: 'cuda' was asked for but no CUDA GPU is available; use cpu (or auto)" in line


@pytest.fixture(scope="module")
def chatless_ckpt(corpus, tmp_path_factory):
    """A checkpoint whose tokenizer (a plain byte-level BPE, as many foreign ones) has no chat tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from zero2all.config import ModelConfig, OpsConfig

    root = tmp_path_factory.mktemp("chatless")
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train([str(corpus / "good.jsonl")], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "tok").mkdir()
    hf.save(str(root / "tok" / "tokenizer.json"))
    tok = load_tokenizer(root / "tok")
    assert tok.im_start_id is None
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_dim=32, intermediate_size=64, n_layers=1, n_heads=4,
                      n_kv_heads=2, max_seq_len=64, ops=OpsConfig.plain())
    return save_model(build_model(cfg, seed=0), root / "ckpt", tokenizer_dir=root / "tok")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_chat_with_a_tokenizer_without_chat_tokens_is_one_line(command, chatless_ckpt, capsys):
    extra = ["--prompt", "hi", "--chat"] if command == "generate" else []
    assert main([command, "--ckpt", str(chatless_ckpt), *extra]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert f"the tokenizer of {chatless_ckpt} has no <|im_start|>/<|im_end|> chat tokens" in line
    assert main(["generate", "--ckpt", str(chatless_ckpt), "--prompt", "hi", "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize("flag, value, expected", [
    ("--port", "99999", "--port 99999: must be 0-65535 (0 picks a free port)"),
    ("--port", "-1", "--port -1: must be 0-65535"),
    ("--max-tokens-limit", "0", "--max-tokens-limit 0: must be at least 1"),
    ("--max-batch", "0", "--max-batch 0: must be at least 1"),
    ("--max-queue", "-1", "--max-queue -1: must be at least 0"),
    ("--drain-timeout", "nan", "--drain-timeout nan: must be a number of seconds >= 0"),
])
def test_serve_values_that_can_never_work_are_refused_before_loading(flag, value, expected, ckpt, monkeypatch,
                                                                     capsys):
    import zero2all.infer.generate as generate

    monkeypatch.setattr(generate, "load_for_inference", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["serve", "--ckpt", str(ckpt), flag, value]) == 2
    assert expected in _one_error_line(capsys.readouterr().err, "serve")


def test_serve_on_a_busy_port_or_a_bad_host_names_both(ckpt, monkeypatch, capsys):
    import zero2all.infer.generate as generate

    monkeypatch.setattr(generate, "load_for_inference", lambda *a, **k: pytest.fail("loaded the model"))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--ckpt", str(ckpt), "--port", str(port)]) == 1
        line = _one_error_line(capsys.readouterr().err, "serve")
        assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in line and "another --port" in line
    for host in ("no-such-host.invalid", "192.0.2.1"):  # unresolvable; a documentation address of no machine
        assert main(["serve", "--ckpt", str(ckpt), "--host", host, "--port", "8123"]) == 2
        line = _one_error_line(capsys.readouterr().err, "serve")
        assert f"--host {host}: cannot listen on {host}:8123" in line and "use 127.0.0.1, 0.0.0.0" in line


def test_export_into_the_working_directory_is_one_line(ckpt, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out in (".", str(work), str(tmp_path)):
        assert main(["export-hf", "--ckpt", str(ckpt), "--out", out]) == 2
        line = _one_error_line(capsys.readouterr().err, "export-hf")
        assert f"--out {out}: is " in line and "which this command would replace whole" in line
    assert _files(work) == {"notes.txt": b"mine"} and sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_a_reward_function_returning_a_string_is_one_line(tmp_path, monkeypatch, capsys):
    from zero2all.config import ModelConfig, OpsConfig
    from zero2all.train.rl_tasks import make_problems, sft_records

    problems = make_problems(8, seed=0, max_value=5)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in problems))
    text = "\n".join(f"{r['instruction']} {r['output']}" for r in sft_records(problems))
    (tmp_path / "corpus.txt").write_text(text * 3)
    tok = train_tokenizer([str(tmp_path / "corpus.txt")], 384, tmp_path / "tok", log=_quiet)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_dim=32, intermediate_size=64, n_layers=1, n_heads=4,
                      n_kv_heads=2, max_seq_len=96, ops=OpsConfig.plain())
    init = save_model(build_model(cfg, seed=0), tmp_path / "init", tokenizer_dir=tmp_path / "tok")
    (tmp_path / "wordy_reward.py").write_text("def score(text, record):\n    return 'good'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "rl"
    assert main(["rl", "--init", str(init), "--data", str(prompts), "--out", str(out), "--reward-fn",
                 "wordy_reward:score", "--group-size", "2", "--max-new-tokens", "2", "--device", "cpu",
                 "--no-progress", "train.max_steps=1", "train.micro_batch_size=2", "train.tensorboard=false",
                 "train.ckpt_every=0", "train.eval_every=0"]) == 2
    line = _one_error_line(capsys.readouterr().err, "rl")
    assert "rl.reward_fn wordy_reward:score: returned 'good' (str)" in line and "must return a number" in line
    assert not (out / "final").exists()


# ---------------------------------------------------------------------------------------------------- full disks


def _full(message="No space left on device"):
    def raise_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, message)
    return raise_full


def _disk_full_line(err, command, path):
    line = _one_error_line(err, command)
    assert line.startswith(f"z2all {command}: error: disk full while writing {path}"), line
    assert " bytes free); nothing was replaced; free space or choose another --out" in line and ".tmp" not in line
    return line


@pytest.mark.parametrize("how", ["oserror", "safetensors"])
def test_export_hf_on_a_full_disk_keeps_the_previous_export(how, ckpt, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    out = tmp_path / "hf"
    assert main(["export-hf", "--ckpt", str(ckpt), "--out", str(out)]) == 0
    before = _files(out)
    capsys.readouterr()
    if how == "oserror":
        monkeypatch.setattr(safetensors.torch, "save_file", _full())
    else:  # what safetensors raises on a full disk: its own error type, errno only in the text
        def save_file(*args, **kwargs):
            raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                              'message: "No space left on device" })')
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    assert main(["export-hf", "--ckpt", str(ckpt), "--out", str(out), "--dtype", "bfloat16"]) == 1
    _disk_full_line(capsys.readouterr().err, "export-hf", out)
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("how", ["oserror", "short-write"])
def test_export_gguf_on_a_full_disk_keeps_the_previous_file(how, ckpt, tmp_path, monkeypatch, capsys):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", "--ckpt", str(ckpt), "--out", str(out)]) == 0
    before = out.read_bytes()
    capsys.readouterr()

    def short_write(self, *args, **kwargs):  # numpy's tofile on a full disk: an OSError without errno
        raise OSError("2097152 requested and 1244392 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", _full() if how == "oserror" else short_write)
    assert main(["export-gguf", "--ckpt", str(ckpt), "--out", str(out), "--dtype", "f16", "--overwrite"]) == 1
    _disk_full_line(capsys.readouterr().err, "export-gguf", out)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


@pytest.mark.parametrize("how", ["oserror", "torch-writer"])
def test_a_full_disk_at_a_checkpoint_leaves_no_temporary(how, tmp_path, monkeypatch, capsys):
    import torch.distributed.checkpoint as dcp

    import zero2all.fileio as fileio

    out = tmp_path / "run"
    args = ["pretrain", "--config", "tiny", "--out", str(out), "--no-progress", *TINY_MODEL, "model.vocab_size=64",
            "model.max_seq_len=16", *QUIET_RUN, "train.ckpt_every=2", "train.keep_last=0"]
    assert main(args + ["train.max_steps=2"]) == 0
    first = _files(out / "ckpt-000002")
    capsys.readouterr()
    real_save = dcp.save

    def save(state, checkpoint_id=None, **kwargs):  # part of the files written, then the disk is full
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)
        if how == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(checkpoint_id, "__0_0.distcp"))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(dcp, "save", save)
    monkeypatch.setattr(fileio, "free_bytes", lambda path: 4096)  # torch's wording needs a nearly full disk
    assert main(args + ["train.max_steps=4", "--resume", "auto"]) == 1
    line = _one_error_line(capsys.readouterr().err, "pretrain")
    assert "disk full while writing" in line and "(4,096 bytes free); nothing was replaced" in line
    assert str(out) in line and ".tmp" not in line
    assert not list(out.glob(".tmp-ckpt-*")) and _files(out / "ckpt-000002") == first
    assert not (out / "ckpt-000004").exists()


def test_disk_full_wordings_of_other_libraries_are_recognised(tmp_path, monkeypatch):
    from zero2all import fileio

    assert fileio.as_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")).errno == errno.EDQUOT
    e = fileio.as_disk_full(OSError("2097152 requested and 1244392 written"), tmp_path / "x.gguf")
    assert e.errno == errno.ENOSPC and e.filename == str(tmp_path / "x.gguf")
    assert fileio.as_disk_full(RuntimeError("IoError(Os { code: 28, kind: StorageFull })")).errno == errno.ENOSPC
    writer = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert fileio.as_disk_full(writer, tmp_path) is None  # plenty of space here: not called a full disk
    monkeypatch.setattr(fileio, "free_bytes", lambda path: 100)
    assert fileio.as_disk_full(writer, tmp_path).errno == errno.ENOSPC
    for other in (OSError(errno.EIO, "Input/output error"), ValueError("bad value"), OSError("10 requested")):
        assert fileio.as_disk_full(other, tmp_path) is None
    line = fileio.os_error_message(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "hf")
    assert line == f"disk full while writing {tmp_path / 'hf'} (100 bytes free); nothing was replaced; free space " \
                   f"or choose another --out"


# ---------------------------------------------------------------------------------------------------- other probes


@pytest.mark.parametrize("case", ["truncated-weights", "garbled-z2all-json"])
def test_a_damaged_checkpoint_is_one_line(case, ckpt, tmp_path, capsys):
    d = _copy(ckpt, tmp_path / "ckpt")
    if case == "truncated-weights":
        with open(d / "model.safetensors", "r+b") as f:
            f.truncate(1000)
        expected = f"{d / 'model.safetensors'}: damaged weights"
    else:
        (d / "z2all.json").write_text('{"model": ')
        expected = f"{d / 'z2all.json'}: damaged (Expecting value)"
    before = _files(d)
    assert main(["generate", "--ckpt", str(d), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    line = _one_error_line(capsys.readouterr().err, "generate")
    assert expected in line and "copy the checkpoint again" in line and _files(d) == before


@pytest.mark.parametrize("flag, value, expected", [("--top-p", "2", "--top-p: must be in (0, 1], got 2.0"),
                                                   ("--max-new-tokens", "-1", "--max-new-tokens: must be a positive"),
                                                   ("--stop", "", "--stop: must be non-empty strings")])
def test_bad_sampling_values_are_refused_before_loading(flag, value, expected, ckpt, monkeypatch, capsys):
    import zero2all.infer.generate as generate

    monkeypatch.setattr(generate, "load_for_inference", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "x", flag, value]) == 2
    captured = capsys.readouterr()
    assert expected in _one_error_line(captured.err, "generate") and captured.out == ""


def test_an_hf_config_without_llama_keys_is_one_line(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    assert main(["import-hf", "--hf", str(hf), "--out", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys.readouterr().err, "import-hf")
    assert f"{hf / 'config.json'}: not a Llama-architecture config.json this library can read (no '" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value", [("--context", "0"), ("--stride", "0"), ("--batch-size", "0")])
def test_eval_values_that_would_silently_become_defaults_are_refused(flag, value, ckpt, corpus, capsys):
    assert main(["eval", "--ckpt", str(ckpt), "--data", str(corpus / "good.jsonl"), flag, value]) == 2
    assert f"{flag}: {value} must be at least" in _one_error_line(capsys.readouterr().err, "eval")
