"""Outputs never destroy what they did not write: every command that writes a directory writes only into a new or
empty folder or a previous output of its own kind (``fileio.claim_output_dir``), refusing anything else with one
line and exit code 2. Also: one run per output folder (``fileio.OutputLock``), runs that stop training because
their updates are skipped, the permissions of what is written, and the tokenizer check of ``export-hf``."""

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero2all.cli import main
from zero2all.model.io import save_model
from zero2all.model.z2all import build_model

OUTPUT_MARKER = ".z2all-output.json"  # zero2all.fileio.OUTPUT_MARKER
TINY_MODEL = ["model.hidden_dim=32", "model.intermediate_size=72", "model.n_layers=1", "model.n_heads=4",
              "model.n_kv_heads=2", "model.ops.rmsnorm='torch'", "model.ops.rope='torch'",
              "model.ops.swiglu='torch'", "model.ops.cross_entropy='torch'", "model.vocab_size=64",
              "model.max_seq_len=16"]
QUIET_RUN = ["train.device='cpu'", "train.precision='fp32'", "train.tensorboard=false", "train.warmup_steps=1",
             "train.micro_batch_size=2", "train.eval_every=0", "train.num_samples=0", "train.log_every=0",
             "train.ckpt_every=0"]


def _tree(root: Path) -> dict:
    """{relative path: bytes (files) or None (directories)} of everything under ``root``."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"z2all {command}: error: "), err
    return lines[0]


def _victim(root: Path) -> Path:
    """A folder of the user's own: a file and a subfolder with a file."""
    victim = root / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "precious.txt").write_text("years of work")
    (victim / "sub" / "notes.md").write_text("more")
    return victim


def _tiny_checkpoint(path: Path, tokenizer_dir=None) -> Path:
    from zero2all.config import ModelConfig, OpsConfig

    cfg = ModelConfig(vocab_size=384, hidden_dim=32, intermediate_size=64, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_seq_len=32, ops=OpsConfig.plain())
    return save_model(build_model(cfg, seed=0), path, tokenizer_dir=tokenizer_dir)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    c = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    c.write_text("".join(json.dumps({"content": f"def f{i}(x):\n    return x * {i}  # number {i}\n"}) + "\n"
                         for i in range(60)))
    return c


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tok"
    assert main(["train-tokenizer", "--input", str(corpus), "--vocab-size", "384", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def ckpt(tok_dir, tmp_path_factory) -> Path:
    return _tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt", tokenizer_dir=tok_dir)


@pytest.fixture
def sft_file(tmp_path) -> Path:
    f = tmp_path / "chats.jsonl"
    f.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(8)))
    return f


# ---------------------------------------------------------------------------------------------------- data loss


def test_train_tokenizer_leaves_a_folder_of_the_users_files_alone(corpus, tmp_path, capsys):
    """`z2all train-tokenizer --input c.jsonl --vocab-size 336 --out victim` removed precious.txt and sub/."""
    victim = _victim(tmp_path)
    before = _tree(victim)
    assert main(["train-tokenizer", "--input", str(corpus), "--vocab-size", "336", "--out", str(victim)]) == 2
    line = _one_error_line(capsys.readouterr().err, "train-tokenizer")
    assert f"--out {victim} already holds files that are not an output of `z2all train-tokenizer`" in line
    assert "precious.txt" in line and "sub/" in line
    assert _tree(victim) == before and sorted(os.listdir(tmp_path)) == ["victim"]


def test_export_hf_never_replaces_the_folder_holding_its_checkpoint(tok_dir, tmp_path, capsys):
    """`z2all export-hf --ckpt keep/ckpt --out keep` deleted the source checkpoint."""
    keep = tmp_path / "keep"
    _tiny_checkpoint(keep / "ckpt", tokenizer_dir=tok_dir)
    before = _tree(keep)
    assert main(["export-hf", "--ckpt", str(keep / "ckpt"), "--out", str(keep)]) == 2
    line = _one_error_line(capsys.readouterr().err, "export-hf")
    assert f"--out {keep} holds the input {keep / 'ckpt'}" in line
    assert _tree(keep) == before
    # the same checkpoint after an export into its folder was marked as an export: still refused (the input)
    (keep / OUTPUT_MARKER).write_text(json.dumps({"kind": "export-hf"}))
    assert main(["export-hf", "--ckpt", str(keep / "ckpt"), "--out", str(keep)]) == 2
    assert (keep / "ckpt" / "model.safetensors").read_bytes() == before["ckpt/model.safetensors"]


@pytest.mark.parametrize("out", [".", "$PWD", ".."])
def test_the_working_directory_and_its_parents_are_refused(ckpt, tmp_path, monkeypatch, capsys, out):
    """`--out "$PWD"` wiped the working directory."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "precious.txt").write_text("keep me")
    monkeypatch.chdir(work)
    out = str(work) if out == "$PWD" else out
    before = _tree(tmp_path)
    assert main(["export-hf", "--ckpt", str(ckpt), "--out", out]) == 2
    line = _one_error_line(capsys.readouterr().err, "export-hf")
    assert any(s in line for s in ("is the working directory", "is a parent of the working directory",
                                   "is a folder above the working directory"))
    assert _tree(tmp_path) == before


def test_an_empty_cwd_is_refused_too(tmp_path, monkeypatch, capsys, corpus):
    monkeypatch.chdir(tmp_path)
    assert main(["train-tokenizer", "--input", str(corpus), "--vocab-size", "336", "--out", "."]) == 2
    assert "is the working directory" in _one_error_line(capsys.readouterr().err, "train-tokenizer")
    assert os.listdir(tmp_path) == []


def _commands(name: str, victim: Path, ckpt: Path, tok_dir: Path, corpus: Path, sft_file: Path) -> list[str]:
    return {
        "train-tokenizer": ["--input", str(corpus), "--vocab-size", "336"],
        "extend-tokenizer": ["--base", str(tok_dir), "--input", str(corpus), "--add", "8"],
        "export-hf": ["--ckpt", str(ckpt)],
        "export-reward-hf": ["--ckpt", str(ckpt)],
        "import-hf": ["--hf", str(ckpt)],
        "resize-vocab": ["--ckpt", str(ckpt), "--tokenizer", str(tok_dir)],
        "prepare": ["--input", str(corpus), "--tokenizer", str(tok_dir), "--workers", "1", "--no-progress"],
        "prepare-sft": ["--input", str(sft_file), "--tokenizer", str(tok_dir), "--overwrite"],
        "prepare-dpo": ["--input", str(sft_file), "--tokenizer", str(tok_dir), "--overwrite"],
        "clean": ["--input", str(corpus), "--workers", "1"],
        "pretrain": ["--config", "tiny", "--no-progress", *TINY_MODEL, *QUIET_RUN, "train.max_steps=1"],
        "sft": ["--init", str(ckpt), "--data", str(sft_file), "--no-progress", *QUIET_RUN, "train.max_steps=1"],
        "demo": ["--steps", "1", "--sft-steps", "0"],
    }[name] + ["--out", str(victim)]


@pytest.mark.parametrize("command", ["train-tokenizer", "extend-tokenizer", "export-hf", "export-reward-hf",
                                     "import-hf", "resize-vocab", "prepare", "prepare-sft", "prepare-dpo", "clean",
                                     "pretrain", "sft", "demo"])
def test_every_command_refuses_a_folder_of_other_files(command, ckpt, tok_dir, corpus, sft_file, tmp_path, capsys):
    victim = _victim(tmp_path)
    before = _tree(victim)
    assert main([command, *_commands(command, victim, ckpt, tok_dir, corpus, sft_file)]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert f"--out {victim}" in line and "precious.txt" in line, line
    assert _tree(victim) == before


def test_an_output_of_another_command_is_refused(ckpt, tok_dir, tmp_path, capsys):
    """An export is not a tokenizer: `train-tokenizer --out EXPORT` would replace the exported model."""
    hf = tmp_path / "hf"
    assert main(["export-hf", "--ckpt", str(ckpt), "--out", str(hf)]) == 0
    before = _tree(hf)
    capsys.readouterr()
    assert main(["import-hf", "--hf", str(ckpt), "--out", str(hf)]) == 2
    line = _one_error_line(capsys.readouterr().err, "import-hf")
    assert "holds an output of `z2all export-hf`, not of `z2all import-hf`" in line
    assert _tree(hf) == before


def test_rerunning_into_a_previous_output_replaces_it(ckpt, corpus, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["export-hf", "--ckpt", str(ckpt), "--out", str(hf)]) == 0
    first = (hf / "model.safetensors").stat().st_size
    assert main(["export-hf", "--ckpt", str(ckpt), "--out", str(hf), "--dtype", "bfloat16"]) == 0
    assert (hf / "model.safetensors").stat().st_size < first  # the bfloat16 export replaced the float32 one
    assert json.loads((hf / OUTPUT_MARKER).read_text())["kind"] == "export-hf"
    tok = tmp_path / "tok"
    for _ in range(2):
        assert main(["train-tokenizer", "--input", str(corpus), "--vocab-size", "336", "--out", str(tok)]) == 0
    # a file the user added to a previous output is theirs: the output is no longer replaced
    (hf / "README.md").write_text("my notes")
    capsys.readouterr()
    assert main(["export-hf", "--ckpt", str(ckpt), "--out", str(hf)]) == 2
    line = _one_error_line(capsys.readouterr().err, "export-hf")
    assert "previous output of `z2all export-hf` with files added to it (README.md)" in line
    assert (hf / "README.md").read_text() == "my notes"


def test_prepare_sft_replaces_its_previous_output_only_with_overwrite(tok_dir, sft_file, tmp_path, capsys):
    out = tmp_path / "sft-data"
    args = ["prepare-sft", "--input", str(sft_file), "--tokenizer", str(tok_dir), "--out", str(out)]
    assert main(args) == 0
    before = _tree(out)
    capsys.readouterr()
    assert main(args) == 2
    assert "holds a previous output of `z2all prepare-sft`: pass --overwrite" in _one_error_line(
        capsys.readouterr().err, "prepare-sft")
    assert _tree(out) == before
    assert main(args + ["--overwrite"]) == 0


def test_claim_output_dir_rules(tmp_path, monkeypatch):
    from zero2all.fileio import OutputDirError, claim_output_dir

    monkeypatch.chdir(tmp_path)
    assert claim_output_dir(tmp_path / "new", "k") == "absent"
    (tmp_path / "empty").mkdir()
    assert claim_output_dir(tmp_path / "empty", "k") == "empty"
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputDirError, match="is a file"):
        claim_output_dir(tmp_path / "file", "k")
    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / OUTPUT_MARKER).write_text(json.dumps({"kind": "k", "entries": ["a"]}))
    (prev / "a").write_text("x")
    assert claim_output_dir(prev, "k") == "previous"
    with pytest.raises(OutputDirError, match="pass --overwrite"):
        claim_output_dir(prev, "k", overwrite=False)
    # a named source (NAME=PATH) inside the output is an input too
    with pytest.raises(OutputDirError, match="holds the input"):
        claim_output_dir(prev, "k", inputs=[f"src={prev / 'a'}"])


# ------------------------------------------------------------------------------------------------- one run per folder


def _lock_holder(directory: Path) -> subprocess.Popen:
    """Another process that holds the lock of ``directory`` until killed."""
    code = ("import sys, time; from zero2all.fileio import OutputLock; OutputLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); time.sleep(120)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory)], stdout=subprocess.PIPE, text=True,
                              env=env)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_run_on_the_same_out_is_refused_at_once(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["pretrain", "--config", "tiny", "--out", str(out), "--no-progress", *TINY_MODEL, *QUIET_RUN,
            "train.max_steps=2", "--resume", "auto"]
    out.mkdir()
    holder = _lock_holder(out)
    try:
        t0 = time.perf_counter()
        assert main(args) == 2
        assert time.perf_counter() - t0 < 30
        line = _one_error_line(capsys.readouterr().err, "pretrain")
        assert f"{out} is in use by process {holder.pid} on " in line and "choose another --out" in line
        assert not (out / "final").exists() and not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died without letting go: its lock is stale, and the next run takes it over, saying so
    assert main(args) == 0
    captured = capsys.readouterr()
    assert f"taking over the lock left by process {holder.pid}" in captured.out + captured.err
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("command", ["prepare", "clean"])
def test_prepare_and_clean_refuse_a_folder_another_run_holds(command, corpus, tok_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = {"prepare": ["prepare", "--input", str(corpus), "--tokenizer", str(tok_dir), "--out", str(out),
                        "--workers", "1", "--no-progress"],
            "clean": ["clean", "--input", str(corpus), "--out", str(out), "--workers", "1"]}[command]
    out.mkdir()
    holder = _lock_holder(out)
    try:
        t0 = time.perf_counter()
        assert main(args) == 2
        assert time.perf_counter() - t0 < 30
        line = _one_error_line(capsys.readouterr().err, command)
        assert f"{out} is in use by process {holder.pid} on " in line and "choose another --out" in line
        assert sorted(os.listdir(out)) == [".z2all-lock"]  # nothing written beside the other run's lock
    finally:
        holder.kill()
        holder.wait()
    assert main(args) == 0  # the lock died with its holder
    assert (out / ("meta.json" if command == "prepare" else "report.json")).is_file()
    new_out = tmp_path / "new" / "out"  # a lock file the command made goes when it is done: the output alone
    assert main([a if a != str(out) else str(new_out) for a in args]) == 0
    assert ".z2all-lock" not in os.listdir(new_out) and (new_out / ".z2all-output.json").is_file()


def test_output_lock_is_shared_within_a_process_and_released_with_the_last_holder(tmp_path):
    from zero2all.fileio import OutputLock, OutputLockedError

    code = ("import sys; from zero2all.fileio import OutputLock, OutputLockedError\n"
            "try:\n    OutputLock(sys.argv[1]).acquire(); print('free')\n"
            "except OutputLockedError:\n    print('locked')")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def other_process_sees() -> str:
        return subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              env=env, check=True).stdout.strip()

    first = OutputLock(tmp_path).acquire()
    second = OutputLock(tmp_path).acquire()  # the same process: shared, not refused
    first.release()
    assert other_process_sees() == "locked"  # still held by the second holder
    second.release()
    assert other_process_sees() == "free"
    assert OutputLockedError.__mro__[1] is ValueError  # one line, exit code 2 at the command line


# ---------------------------------------------------------------------------------------------------- skipped updates


def test_a_run_whose_updates_are_all_skipped_stops_without_final(tmp_path, capsys):
    """`train.lr=1e4`: every update after the first has non-finite gradients."""
    out = tmp_path / "run"
    assert main(["pretrain", "--config", "tiny", "--out", str(out), "--no-progress", *TINY_MODEL, *QUIET_RUN,
                 "train.max_steps=50", "train.lr=1e4", "train.min_lr=0", "train.max_skipped_updates=4"]) == 3
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("z2all pretrain: error:")]
    assert len(line) == 1 and "training diverged: the last 4 updates" in line[0], err
    assert "Traceback" not in err
    assert not (out / "final").exists()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"]
    assert steps[-1]["step"] < 50 and all(r["skipped"] for r in steps[-4:])


def test_a_run_that_skipped_most_updates_writes_no_final(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["pretrain", "--config", "tiny", "--out", str(out), "--no-progress", *TINY_MODEL, *QUIET_RUN,
                 "train.max_steps=8", "train.lr=1e4", "train.min_lr=0", "train.max_skipped_updates=0"]) == 3
    err = capsys.readouterr().err
    assert "5 of 8 updates were skipped for non-finite gradients, so no final/ was written" in err
    assert not (out / "final").exists()


# ---------------------------------------------------------------------------------------------------- smaller


def test_outputs_follow_the_umask(ckpt, tmp_path):
    """Weights were written 0600 (safetensors) while every other file was 0644."""
    old = os.umask(0o022)
    try:
        assert main(["export-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
        assert main(["import-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
        assert main(["pretrain", "--config", "tiny", "--out", str(tmp_path / "run"), "--no-progress", *TINY_MODEL,
                     *QUIET_RUN, "train.max_steps=1", "train.ckpt_every=1"]) == 0
    finally:
        os.umask(old)
    files = [p for d in ("hf", "ours", "run") for p in (tmp_path / d).rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files) and any(p.suffix == ".distcp" for p in files)
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {"0o644"}, modes


def test_export_hf_checks_the_tokenizer_loads_first(tok_dir, tmp_path, capsys):
    src = _tiny_checkpoint(tmp_path / "ckpt", tokenizer_dir=tok_dir)
    text = (src / "tokenizer.json").read_text()
    (src / "tokenizer.json").write_text(text[: len(text) // 2])
    assert main(["export-hf", "--ckpt", str(src), "--out", str(tmp_path / "hf")]) == 2
    line = _one_error_line(capsys.readouterr().err, "export-hf")
    assert f"--ckpt {src}: its tokenizer does not load" in line and "tokenizer.json" in line
    assert not (tmp_path / "hf").exists()


def test_the_old_parallel_key_with_out(tmp_path):
    """`train.parallel=ddp` (now parallel.mode) together with --out was "train.out_dir: set twice"."""
    from zero2all.config import build_config_dict

    notes = []
    data = build_config_dict("tiny", ["train.parallel='ddp'"], {"train.out_dir": str(tmp_path)},
                             sources={"train.out_dir": "--out"}, warn=notes.append)
    assert data["parallel"]["mode"] == "ddp" and data["train"]["out_dir"] == str(tmp_path)
    assert notes == ["note: train.parallel is now parallel.mode (read as parallel.mode='ddp')"]


# ---------------------------------------------------------------------------------------------- single-file outputs

TINY_BENCH = ["--config", "tiny", "--seq", "16", "--micro-batch", "2", "--accum", "1", "--iters", "1", "--warmup",
              "0", "--rows", "naive", "model.vocab_size=64", "model.hidden_dim=32", "model.intermediate_size=64",
              "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2"]


def _file_command(name: str, out: Path, ckpt: Path, corpus: Path) -> list[str]:
    return {"export-gguf": ["export-gguf", "--ckpt", str(ckpt), "--out", str(out), "--dtype", "f16"],
            "eval": ["eval", "--ckpt", str(ckpt), "--data", str(corpus), "--json", str(out), "--no-progress",
                     "--device", "cpu", "--max-docs", "4"],
            "bench": ["bench", "train", "--device", "cpu", "--out", str(out), *TINY_BENCH]}[name]


@pytest.mark.parametrize("command", ["export-gguf", "eval", "bench"])
def test_a_single_file_output_is_replaced_only_with_overwrite(command, ckpt, corpus, tmp_path, capsys):
    if command == "export-gguf":
        pytest.importorskip("gguf")
    out = tmp_path / "result.out"
    out.write_text("the user's own file")
    args = _file_command(command, out, ckpt, corpus)
    t0 = time.perf_counter()
    assert main(args) == 2
    assert time.perf_counter() - t0 < 10  # refused before the model is loaded or a row runs
    option = "--json" if command == "eval" else "--out"
    line = _one_error_line(capsys.readouterr().err, command)
    assert f"{option} {out} already exists: pass --overwrite to replace it" in line
    assert out.read_text() == "the user's own file" and sorted(os.listdir(tmp_path)) == ["result.out"]
    assert main([*args, "--overwrite"]) == 0
    written = out.read_bytes()
    assert written.startswith(b"GGUF") if command == "export-gguf" else "results" in json.loads(written) or \
        "overall" in json.loads(written)
    assert sorted(os.listdir(tmp_path)) == ["result.out"]  # written beside it and renamed: no temporary left
    # a folder is never the file, and the command's own input is never replaced, --overwrite or not
    assert main([a if a != str(out) else str(tmp_path) for a in args] + ["--overwrite"]) == 2
    assert "is a folder: name a file" in capsys.readouterr().err
    if command == "export-gguf":
        weights = ckpt / "model.safetensors"
        before = weights.read_bytes()
        assert main([a if a != str(out) else str(weights) for a in args] + ["--overwrite"]) == 2
        assert "writing there would replace it" in capsys.readouterr().err and weights.read_bytes() == before
