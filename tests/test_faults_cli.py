"""Faults, interrupts and misuse at the command line: a command that produced nothing useful, a failed or
interrupted `prepare` rerun with corrected inputs, read-only outputs and full disks, tokenizer / model mismatches.
Each command must end with one clear line and a non-zero exit code, and leave what existed before intact."""

import builtins
import ctypes
import errno
import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from zero2all import checkpoint as ckpt_io
from zero2all.cli import main
from zero2all.data.pretokenize import prepare, read_meta
from zero2all.model.io import save_model
from zero2all.model.z2all import build_model
from zero2all.tokenizer import load_tokenizer, train_tokenizer

STDLIB = sysconfig.get_paths()["stdlib"]
TINY_MODEL = ["model.hidden_dim=32", "model.intermediate_size=72", "model.n_layers=1", "model.n_heads=4",
              "model.n_kv_heads=2", "model.ops.rmsnorm='torch'", "model.ops.rope='torch'",
              "model.ops.swiglu='torch'", "model.ops.cross_entropy='torch'"]
QUIET_RUN = ["train.device='cpu'", "train.precision='fp32'", "train.tensorboard=false", "train.warmup_steps=1",
             "train.micro_batch_size=2", "train.eval_every=0", "train.num_samples=0", "train.log_every=0"]


def _quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    docs = [{"content": f"def f{i}(x):\n    return x * {i} + len('document {i}')\n" * (1 + i % 4)}
            for i in range(120)]
    (d / "good.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    (d / "other.jsonl").write_text("".join(json.dumps({"content": f"class C{i}: pass  # other {i}\n" * 5}) + "\n"
                                           for i in range(60)))
    return d


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tok"
    train_tokenizer([os.path.join(STDLIB, "json", "*.py"), str(corpus / "good.jsonl")], 512, out, log=_quiet)
    return out


@pytest.fixture(scope="module")
def tok2_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok2") / "tok"
    train_tokenizer([os.path.join(STDLIB, "email", "*.py")], 512, out, log=_quiet)
    return out


def _entries(d):
    return sorted(p.name for p in d.iterdir()) if d.exists() else None


def _one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"z2all {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def read_only(monkeypatch, root, code=errno.EROFS):
    """Make every write under ``root`` fail as on a read-only file system (root may be exempt from chmod)."""
    root = os.path.realpath(root)

    def inside(path) -> bool:
        if isinstance(path, int):
            return False
        p = os.path.realpath(os.fsdecode(os.fspath(path)))
        return p == root or p.startswith(root + os.sep)

    def deny(path):
        raise OSError(code, os.strerror(code), os.fsdecode(os.fspath(path)))

    real_os_open, real_open = os.open, builtins.open

    def os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND) and inside(path):
            deny(path)
        return real_os_open(path, flags, *args, **kwargs)

    def py_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and set(mode) & set("wax+") and inside(file):
            deny(file)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", py_open)
    monkeypatch.setattr(io, "open", py_open)
    for name in ("mkdir", "rmdir", "unlink", "remove", "rename", "replace"):
        real = getattr(os, name)

        def guarded(*args, _real=real, **kwargs):
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and inside(a):
                    deny(a)
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, guarded)


# ---------------------------------------------------------------------------------------------------- prepare


def test_prepare_with_every_record_skipped_fails_and_leaves_nothing(corpus, tok_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": \n' * 11)
    (tmp_path / "empty.jsonl").write_text("")
    out = tmp_path / "runs" / "data"
    args = ["prepare", "--input", str(bad), str(tmp_path / "empty.jsonl"), "--tokenizer", str(tok_dir),
            "--out", str(out), "--workers", "1", "--no-progress"]
    assert main(args) == 2
    line = _one_error_line(capsys.readouterr().err, "prepare")
    assert "no documents survived: 12 skipped (empty_file=1, malformed_json=11)" in line
    assert not out.exists() and not out.parent.exists()  # nothing left, not even the directories it created
    # an existing empty --out is left empty, and the corrected command into it works
    out.mkdir(parents=True)
    assert main(args) == 2
    assert _entries(out) == []
    fixed = ["prepare", "--input", str(corpus / "good.jsonl"), "--tokenizer", str(tok_dir), "--out", str(out),
             "--workers", "1", "--no-progress"]
    assert main(fixed) == 0
    assert read_meta(out)["splits"]["train"]["docs"] > 0


def test_prepare_with_only_empty_or_held_out_documents_fails(tok_dir, tmp_path, capsys):
    empty_texts = tmp_path / "blank.jsonl"
    empty_texts.write_text('{"content": ""}\n' * 5)
    out = tmp_path / "d"
    assert main(["prepare", "--input", str(empty_texts), "--tokenizer", str(tok_dir), "--out", str(out),
                 "--workers", "1", "--no-progress"]) == 2
    assert "the 5 documents read hold no text" in _one_error_line(capsys.readouterr().err, "prepare")
    assert not out.exists()
    one = tmp_path / "one.jsonl"
    one.write_text('{"content": "a single document"}\n')
    assert main(["prepare", "--input", f"one={one}", "--tokenizer", str(tok_dir), "--out", str(out),
                 "--workers", "1", "--no-progress", "--source", "one=0"]) == 2
    assert "the train split is empty" in _one_error_line(capsys.readouterr().err, "prepare")
    assert not out.exists()


def test_pretrain_on_too_little_data_is_one_line(tok_dir, tmp_path, capsys):
    one = tmp_path / "one.jsonl"
    one.write_text('{"content": "ab"}\n')
    prepare([str(one)], tok_dir, tmp_path / "data", workers=1, valid_fraction=0.0, log=_quiet)
    assert main(["pretrain", "--config", "tiny", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"),
                 "--no-progress", *TINY_MODEL, "model.vocab_size=512", "model.max_seq_len=16", *QUIET_RUN,
                 "train.max_steps=1"]) == 2
    line = _one_error_line(capsys.readouterr().err, "pretrain")
    assert "split 'train' has 3 tokens: fewer than world_size * seq_len + 1 = 17" in line


SMALL_GROUPS = dict(workers=1, valid_fraction=0.05, chunk_bytes=2_000, shard_chunks=1, log=_quiet)


def _train_bytes(out):
    meta = read_meta(out)
    return b"".join((out / s["bin"]).read_bytes() for s in meta["splits"]["train"]["shards"])


@pytest.mark.parametrize("change", ["inputs", "tokenizer", "file content"])
def test_rerun_with_corrected_inputs_replaces_an_unfinished_run(corpus, tok_dir, tok2_dir, tmp_path, capsys,
                                                               change):
    src = tmp_path / "src.jsonl"
    src.write_bytes((corpus / "good.jsonl").read_bytes())
    out = tmp_path / "data"
    with pytest.raises(KeyboardInterrupt):
        prepare([str(src)], tok_dir, out, _stop_after_groups=3, **SMALL_GROUPS)
    assert (out / "_state.json").exists() and len(list(out.glob("shard_*.json"))) == 3
    inputs, tok = [str(src)], tok_dir
    if change == "inputs":
        inputs = [str(corpus / "other.jsonl")]
    elif change == "tokenizer":
        tok = tok2_dir
    else:  # the same path, edited (e.g. a bad line fixed)
        src.write_text(src.read_text()[: 1000].rsplit("\n", 1)[0] + "\n")
    logged = []
    meta = prepare(inputs, tok, out, **SMALL_GROUPS | {"log": logged.append})
    assert any("unfinished" in line and "replac" in line for line in logged), logged
    fresh = prepare(inputs, tok, tmp_path / "fresh", **SMALL_GROUPS)
    assert meta["splits"] == fresh["splits"] and _train_bytes(out) == _train_bytes(tmp_path / "fresh")
    assert _entries(out) == _entries(tmp_path / "fresh")  # no shard of the earlier run is left
    assert meta["throughput"]["tokenized_chunks"] == fresh["throughput"]["tokenized_chunks"]  # nothing reused


def test_rerun_of_the_same_command_still_resumes(corpus, tok_dir, tmp_path):
    out = tmp_path / "data"
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus / "good.jsonl")], tok_dir, out, _stop_after_groups=2, **SMALL_GROUPS)
    meta = prepare([str(corpus / "good.jsonl")], tok_dir, out, **SMALL_GROUPS)
    fresh = prepare([str(corpus / "good.jsonl")], tok_dir, tmp_path / "fresh", **SMALL_GROUPS)
    assert meta["throughput"]["tokenized_chunks"] == fresh["throughput"]["tokenized_chunks"] - 2
    assert _train_bytes(out) == _train_bytes(tmp_path / "fresh")


def test_finished_output_with_other_inputs_needs_overwrite(corpus, tok_dir, tmp_path, capsys):
    out = tmp_path / "data"
    base = ["prepare", "--tokenizer", str(tok_dir), "--out", str(out), "--workers", "1", "--no-progress"]
    assert main(base + ["--input", str(corpus / "good.jsonl")]) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    assert main(base + ["--input", str(corpus / "other.jsonl")]) == 2
    line = _one_error_line(capsys.readouterr().err, "prepare")
    assert "finished" in line and "sources differ" in line and "--overwrite" in line
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before
    assert main(base + ["--input", str(corpus / "other.jsonl"), "--overwrite"]) == 0
    assert list(read_meta(out)["sources"]) == ["other"]


def test_strict_failure_leaves_the_output_as_it_was(corpus, tok_dir, tmp_path, capsys):
    src = tmp_path / "web.jsonl"
    src.write_text((corpus / "good.jsonl").read_text() + '{"content": \n')
    args = ["prepare", "--input", str(src), "--tokenizer", str(tok_dir), "--workers", "1", "--no-progress",
            "--strict", "--chunk-mb", "0.002", "--shard-chunks", "1"]
    out = tmp_path / "new" / "data"
    assert main(args + ["--out", str(out)]) == 2
    assert "web.jsonl:121: malformed_json" in _one_error_line(capsys.readouterr().err, "prepare")
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    assert main(args + ["--out", str(existing)]) == 2
    assert _entries(existing) == []
    # --overwrite deletes the earlier output first; what the failed run wrote under the same names goes too
    assert main(["prepare", "--input", str(corpus / "good.jsonl"), "--tokenizer", str(tok_dir), "--workers", "1",
                 "--no-progress", "--chunk-mb", "0.002", "--shard-chunks", "1", "--out", str(existing)]) == 0
    assert len(list(existing.glob("train_*.bin"))) > 2
    assert main(args + ["--out", str(existing), "--overwrite"]) == 2
    assert _entries(existing) == []


# ---------------------------------------------------------------------------------------------------- demo


def test_demo_sft_steps_zero_skips_sft(corpus, tok_dir, tmp_path, monkeypatch, capsys):
    import zero2all.data.pretokenize as pretokenize
    import zero2all.demo as demo

    real_prepare = pretokenize.prepare

    def small_prepare(inputs, tokenizer_dir, out_dir, **kw):  # the demo's steps, on a small corpus
        return real_prepare([str(corpus / "good.jsonl")], tokenizer_dir, out_dir, workers=1, **kw)

    monkeypatch.setattr(pretokenize, "prepare", small_prepare)
    out = tmp_path / "demo"
    (out / "tokenizer").parent.mkdir(parents=True)
    load_tokenizer(tok_dir).save(out / "tokenizer")
    calls = []
    real_sft = demo.run_sft_stage
    monkeypatch.setattr(demo, "run_sft_stage", lambda *a, **k: calls.append((a, k)) or real_sft(*a, **k))
    overrides = TINY_MODEL + ["model.max_seq_len=32", "train.micro_batch_size=2", "train.tensorboard=false",
                              "train.num_samples=0", "train.eval_batches=1"]
    assert main(["demo", "--out", str(out), "--steps", "2", "--sft-steps", "0", *overrides]) == 0
    assert calls == [] and not (out / "sft").exists() and (out / "final").is_dir()
    assert "sft/" not in capsys.readouterr().out.splitlines()[-1]
    with pytest.raises(ValueError, match="--sft-steps"):
        demo.run_demo(out, steps=2, sft_steps=-1, overrides=overrides)


# ---------------------------------------------------------------------------------------------------- OS errors


def _tiny_checkpoint(path, vocab_size=128, tokenizer_dir=None, tokenizer_hash=None):
    from zero2all.config import ModelConfig, OpsConfig

    cfg = ModelConfig(vocab_size=vocab_size, hidden_dim=32, intermediate_size=64, n_layers=1, n_heads=4,
                      n_kv_heads=2, max_seq_len=32, ops=OpsConfig.plain())
    extra = {"tokenizer_hash": tokenizer_hash} if tokenizer_hash else None
    return save_model(build_model(cfg, seed=0), path, extra=extra, tokenizer_dir=tokenizer_dir)


def test_pretrain_into_a_read_only_out_is_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    (out / "notes.txt").write_text("before")
    (out / ".z2all-output.json").write_text('{"kind": "pretrain"}')  # a run folder the user put notes into
    read_only(monkeypatch, out)
    assert main(["pretrain", "--config", "tiny", "--out", str(out), "--no-progress", *TINY_MODEL,
                 "model.vocab_size=64", "model.max_seq_len=16", "train.max_steps=2", *QUIET_RUN]) == 1
    line = _one_error_line(capsys.readouterr().err, "pretrain")
    assert f"cannot write {out}" in line and "Read-only file system (errno 30)" in line
    assert line.endswith("choose a writable --out") and ".tmp" not in line
    monkeypatch.undo()
    assert _entries(out) == [".z2all-output.json", "notes.txt"] and (out / "notes.txt").read_text() == "before"


def _drop_permission_override():
    """In a child process about to exec: take CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (1, 2) out of its
    capability bounding set (prctl PR_CAPBSET_DROP = 24), so that root's program obeys file modes like anyone's."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _unprivileged_options(env) -> dict | None:
    """subprocess options under which chmod 0o555 stops writes: none for an ordinary user; for root, root without
    its capability to override file modes, else the user nobody; None when neither can run Python here."""
    if os.geteuid() != 0:
        return {}
    candidates = [dict(preexec_fn=_drop_permission_override)]
    try:
        nobody = pwd.getpwnam("nobody")
        candidates.append(dict(user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[]))
    except KeyError:
        pass
    for options in candidates:
        try:
            probe = subprocess.run([sys.executable, "-c", "import zero2all"], env=env, capture_output=True,
                                   timeout=120, **options)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return options
    return None


def test_pretrain_read_only_for_real():
    """A real read-only --out (chmod 0o555), the command run as an unprivileged process (as root: without the
    capability to override file modes, or as nobody)."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    options = _unprivileged_options(env)
    if options is None:
        pytest.skip("running as root, and neither root without CAP_DAC_OVERRIDE nor the user nobody can run Python "
                    "here (the injected test covers the message)")
    base = Path(tempfile.mkdtemp(prefix="z2all-ro-"))
    try:
        base.chmod(0o755)                                   # reachable by nobody; out itself is read-only
        out = base / "ro"
        out.mkdir()
        out.chmod(0o555)
        proc = subprocess.run([sys.executable, "-m", "zero2all.cli", "pretrain", "--config", "tiny", "--out",
                               str(out), "--no-progress", *TINY_MODEL, "model.vocab_size=64", "model.max_seq_len=16",
                               "train.max_steps=2", *QUIET_RUN], env=env, cwd=base, capture_output=True, text=True,
                              timeout=300, **options)
        assert proc.returncode == 1, proc.stderr
        assert "Permission denied" in _one_error_line(proc.stderr, "pretrain")
        assert _entries(out) == []   # an empty folder (one holding the user's files is refused before any write)
    finally:
        if (base / "ro").exists():
            (base / "ro").chmod(0o755)
        shutil.rmtree(base)


def test_export_hf_into_a_read_only_directory_is_one_line(tmp_path, monkeypatch, capsys):
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    parent = tmp_path / "exports"
    assert main(["export-hf", "--ckpt", str(ckpt), "--out", str(parent / "hf")]) == 0
    before = {f.name: f.read_bytes() for f in (parent / "hf").iterdir()}
    capsys.readouterr()
    read_only(monkeypatch, parent)
    assert main(["export-hf", "--ckpt", str(ckpt), "--out", str(parent / "hf"), "--dtype", "bfloat16"]) == 1
    line = _one_error_line(capsys.readouterr().err, "export-hf")
    assert f"cannot write {parent / 'hf'}" in line and line.endswith("choose a writable --out")
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in (parent / "hf").iterdir()} == before and _entries(parent) == ["hf"]


def _pretrain_args(out, *extra):
    return ["pretrain", "--config", "tiny", "--out", str(out), "--no-progress", *TINY_MODEL, "model.vocab_size=64",
            "model.max_seq_len=16", *QUIET_RUN, "train.ckpt_every=2", *extra]


def test_full_disk_at_the_first_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    import torch.distributed.checkpoint as dcp

    def full(state, checkpoint_id=None, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(checkpoint_id))

    out = tmp_path / "run"
    monkeypatch.setattr(dcp, "save", full)
    assert main(_pretrain_args(out, "train.max_steps=2")) == 1
    line = _one_error_line(capsys.readouterr().err, "pretrain")
    assert "disk full while writing" in line and line.endswith("nothing was replaced; free space or choose another "
                                                                 "--out")
    assert str(out) in line and ".tmp" not in line
    assert ckpt_io.newest_verified(out)[0] is None
    # with a checkpoint already there: it stays intact and resumable
    monkeypatch.undo()
    assert main(_pretrain_args(out, "train.max_steps=2", "--resume", "auto")) == 0
    first = out / "ckpt-000002"
    files = {f.name: f.read_bytes() for f in first.iterdir()}
    monkeypatch.setattr(dcp, "save", full)
    capsys.readouterr()
    assert main(_pretrain_args(out, "train.max_steps=4", "--resume", "auto")) == 1
    _one_error_line(capsys.readouterr().err, "pretrain")
    monkeypatch.undo()
    assert ckpt_io.newest_verified(out)[0] == first and ckpt_io.verify(first) == []
    assert {f.name: f.read_bytes() for f in first.iterdir()} == files


def test_full_disk_inside_the_checkpoint_writer_is_one_line(tmp_path, monkeypatch, capsys):
    """A real write failure inside torch.distributed.checkpoint reaches the command wrapped in its
    CheckpointException; the command still prints one line."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream

    def create_stream(self, path, mode):
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(self, path, mode)

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    out = tmp_path / "run"
    assert main(_pretrain_args(out, "train.max_steps=2")) == 1
    line = _one_error_line(capsys.readouterr().err, "pretrain")
    assert "disk full while writing" in line and str(out) in line


def test_train_tokenizer_checks_out_is_writable_before_training(corpus, tmp_path, monkeypatch, capsys):
    import zero2all.tokenizer.train as train_mod

    def never(*a, **k):
        raise AssertionError("trained before checking --out")

    monkeypatch.setattr(train_mod, "_train_bytelevel_bpe", never)
    monkeypatch.setattr(train_mod, "_SampledTexts", never)
    parent = tmp_path / "ro"
    parent.mkdir()
    read_only(monkeypatch, parent)
    assert main(["train-tokenizer", "--input", str(corpus / "good.jsonl"), "--vocab-size", "512",
                 "--out", str(parent / "tok")]) == 1
    line = _one_error_line(capsys.readouterr().err, "train-tokenizer")
    assert f"cannot write {parent / 'tok'}: Read-only file system (errno 30); choose a writable --out" in line
    monkeypatch.undo()
    assert _entries(parent) == []
    # a writable --out passes the check (its parent directories are created, and taken back if training fails)
    monkeypatch.setattr(train_mod, "_SampledTexts", never)
    with pytest.raises(AssertionError, match="trained before"):
        main(["train-tokenizer", "--input", str(corpus / "good.jsonl"), "--vocab-size", "512",
              "--out", str(tmp_path / "a" / "b" / "tok")])
    assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------------------------------------------- vocab size


def test_vocab_size_is_given_or_the_difference_is_said(corpus, tmp_path, capsys):
    code = os.path.join(STDLIB, "json", "*.py")
    assert main(["train-tokenizer", "--input", code, "--vocab-size", "448", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert load_tokenizer(tmp_path / "a").vocab_size == 448 and "rounded" not in out and "warning" not in out
    assert main(["train-tokenizer", "--input", code, "--vocab-size", "400", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert load_tokenizer(tmp_path / "b").vocab_size == 448
    assert "vocab_size 400 rounded up to 448 (a multiple of 64" in out
    # a corpus too small for the merges asked for: the smaller vocabulary, and a warning that says why
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": f"hello world number {i} the quick brown fox"}) + "\n"
                             for i in range(50)))
    for backend in ("hf", "spm"):
        assert main(["train-tokenizer", "--input", str(small), "--vocab-size", "1000", "--out",
                     str(tmp_path / backend), "--backend", backend]) == 0
        out = capsys.readouterr().out
        got = load_tokenizer(tmp_path / backend).vocab_size
        assert got < 1024
        warning = next(line for line in out.splitlines() if line.startswith("warning:"))
        assert f"vocabulary of {got}, not the 1024 asked for" in warning and "corpus" in warning
    assert main(["train-tokenizer", "--input", code, "--vocab-size", "300", "--out", str(tmp_path / "c")]) == 2
    line = _one_error_line(capsys.readouterr().err, "train-tokenizer")
    assert "vocab_size=300: must be at least 336" in line
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------------------------- tokenizer fit


def test_training_with_a_smaller_tokenizer_warns(corpus, tok_dir, tmp_path, capsys):
    data = tmp_path / "data"
    prepare([str(corpus / "good.jsonl")], tok_dir, data, workers=1, log=_quiet)
    args = ["pretrain", "--config", "tiny", "--data", str(data), "--no-progress", *TINY_MODEL,
            "model.max_seq_len=16", *QUIET_RUN, "train.max_steps=1", "train.ckpt_every=0"]
    assert main(args + ["--out", str(tmp_path / "a"), "model.vocab_size=1024"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "512 ids" in warnings[0] and "1024" in warnings[0]
    assert "never trained" in warnings[0]
    assert main(args + ["--out", str(tmp_path / "b"), "model.vocab_size=512"]) == 0
    assert "warning:" not in capsys.readouterr().out
    assert main(args + ["--out", str(tmp_path / "c"), "model.vocab_size=256"]) == 2  # more ids than rows
    assert "smaller than the tokenizer's vocabulary" in _one_error_line(capsys.readouterr().err, "pretrain")


def test_inference_with_another_tokenizer(tok_dir, tok2_dir, tmp_path, monkeypatch, capsys):
    import zero2all.infer.server as server

    tok, tok2 = load_tokenizer(tok_dir), load_tokenizer(tok2_dir)
    ckpt = _tiny_checkpoint(tmp_path / "ckpt", vocab_size=512, tokenizer_dir=tok_dir, tokenizer_hash=tok.hash)
    gen = ["generate", "--ckpt", str(ckpt), "--prompt", "def", "--max-new-tokens", "2", "--seed", "0"]
    assert main(gen) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(gen + ["--tokenizer", str(tok_dir)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(gen + ["--tokenizer", str(tok2_dir)]) == 0
    err = capsys.readouterr().err
    warning = next(line for line in err.splitlines() if line.startswith("warning:"))
    assert tok.hash[:16] in warning and tok2.hash[:16] in warning and str(tok2_dir) in warning
    # more ids than the model has rows: refused before loading
    small = _tiny_checkpoint(tmp_path / "small", vocab_size=256, tokenizer_dir=tok_dir)
    assert main(["generate", "--ckpt", str(small), "--prompt", "x", "--tokenizer", str(tok2_dir)]) == 2
    line = _one_error_line(capsys.readouterr().err, "generate")
    assert "512 ids" in line and "256" in line and str(tok2_dir) in line
    # a checkpoint without a stored hash: compared with its own tokenizer files
    calls = []
    monkeypatch.setattr(server, "serve", lambda *a, **k: calls.append(k))
    plain = _tiny_checkpoint(tmp_path / "plain", vocab_size=512, tokenizer_dir=tok_dir)
    assert main(["serve", "--ckpt", str(plain), "--tokenizer", str(tok2_dir)]) == 0
    assert calls and tok.hash[:16] in capsys.readouterr().err
    assert main(["serve", "--ckpt", str(small), "--tokenizer", str(tok2_dir)]) == 2
    assert len(calls) == 1
    assert "256" in _one_error_line(capsys.readouterr().err, "serve")


def _small_demo(corpus, tok_dir, out, monkeypatch):
    """The demo's steps on the small corpus (prepare patched to read it), with the tokenizer already in place."""
    import zero2all.data.pretokenize as pretokenize

    real_prepare = pretokenize.prepare

    def small_prepare(inputs, tokenizer_dir, out_dir, **kw):
        return real_prepare([str(corpus / "good.jsonl")], tokenizer_dir, out_dir, workers=1, **kw)

    monkeypatch.setattr(pretokenize, "prepare", small_prepare)
    load_tokenizer(tok_dir).save(out / "tokenizer", kind="train-tokenizer")  # as the demo writes it
    return TINY_MODEL + ["model.max_seq_len=32", "train.micro_batch_size=2", "train.tensorboard=false",
                         "train.num_samples=0", "train.eval_batches=1"]


def test_demo_trains_on_a_wall_clock_budget(corpus, tok_dir, tmp_path, monkeypatch, capsys):
    """--minutes is a wall-clock budget (train.time_budget_s), not a step count from timing two updates: the
    length is fixed from the measured rate, pretraining and SFT alike. The clock is faked: 0.25 s per reading."""
    import zero2all.train.trainer as trainer_module

    now = [0.0]

    def clock():
        now[0] += 0.25
        return now[0]

    monkeypatch.setattr(trainer_module, "wall_clock", clock)
    import zero2all.data.instructions as instructions

    real_build = instructions.build_docstring_instructions
    monkeypatch.setattr(instructions, "build_docstring_instructions",  # a few stdlib files, not all of it
                        lambda **kw: real_build(paths=sorted(instructions.stdlib_source_files())[:40], **kw))
    out = tmp_path / "demo"
    overrides = _small_demo(corpus, tok_dir, out, monkeypatch) + ["model.max_seq_len=256"]
    assert main(["demo", "--out", str(out), "--minutes", "0.5", "--sft-minutes", "0.25", *overrides]) == 0
    text = capsys.readouterr().out
    assert "pretraining the tiny preset for 0.5 minutes on cpu" in text
    assert "train.max_steps=3000 train.time_budget_s=30" in text
    # the length is fixed at the end of the demo's 20 warmup updates, from the (fake) clock's rate
    assert "time budget 30 s: 263 ms per update measured over updates 2-20" in text
    pretrain = ckpt_io.read_run_config(out / ckpt_io.newest_verified(out)[0])["train"]["max_steps"]
    assert 100 < pretrain < 120  # ~30 s / 0.25 s, less the readings of evaluations and checkpoints
    assert "time budget 15 s: 275 ms per update" in text and (out / "sft" / "final").is_dir()
    capsys.readouterr()
    assert main(["demo", "--out", str(out), "--minutes", "0"]) == 2
    assert "--minutes 0.0: must be > 0" in capsys.readouterr().err


def test_demo_overwrite_starts_over(corpus, tok_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "demo"
    overrides = _small_demo(corpus, tok_dir, out, monkeypatch)
    assert main(["demo", "--out", str(out), "--steps", "3", "--sft-steps", "0", *overrides]) == 0
    assert ckpt_io.list_checkpoints(out)[-1][1].name == "ckpt-000003"
    capsys.readouterr()
    # without --overwrite the finished run is reused; with it the run starts over, the old checkpoints kept aside
    assert main(["demo", "--out", str(out), "--steps", "2", "--sft-steps", "0", "--overwrite", *overrides]) == 0
    text = capsys.readouterr().out
    assert f"--overwrite: moved 1 earlier checkpoint(s) of {out} aside" in text
    assert "training a 8192-token byte-level BPE" in text or "training a" in text
    assert [p.name for _, p in ckpt_io.list_checkpoints(out)] == ["ckpt-000002"]
