"""Checkpoints (one DCP format for every world size): bit-exact resume after a real kill -9 at any point of a
save or of training, a corrupt file in any part, a full disk, SIGINT / SIGTERM; lines, pruning, mismatch errors."""

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from zero2all import checkpoint as ckpt_io
from zero2all.checkpoint.compat import CheckpointMismatch
from zero2all.config import ConfigError
from zero2all.model.io import load_model
from zero2all.train.trainer import Trainer


def list_checkpoints(out):
    return [(s, p) for s, p in ckpt_io.list_checkpoints(out) if ckpt_io.is_checkpoint(p)]


def latest_checkpoint(out):
    return ckpt_io.newest_verified(out)[0]


def optimizer_state(ckpt):
    """The optimizer part of a checkpoint as {parameter name: {state key: tensor}}, read in one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = ckpt.parent / (ckpt.name + ".pt")
    dcp_to_torch_save(ckpt, target)
    return torch.load(target, weights_only=False)["optim"]["state"]

sys.path.insert(0, os.path.dirname(__file__))
from test_trainer import tiny_cfg  # noqa: E402

# dropout on, so the resumed run must also restore the RNG states to reproduce the same masks
RESUME_OVERRIDES = ["train.max_steps=8", "train.ckpt_every=4", "train.grad_accum_steps=2",
                    "train.micro_batch_size=3", "train.eval_every=2", "train.eval_batches=1", "train.num_samples=1",
                    "train.sample_every=3", "train.sample_new_tokens=3", "train.keep_last=2",
                    "model.dropout1=0.1", "model.dropout2=0.1"]

# A training process that SIGKILLs itself when it is about to run update `KILL_AT` (1-based), i.e. after
# update KILL_AT - 1 finished and was logged but before any later checkpoint.
DRIVER = textwrap.dedent("""
    import os, signal, sys
    import torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads({threads})
    from test_trainer import tiny_cfg
    from zero2all.train.trainer import Trainer

    kill_at = int(sys.argv[2])
    original = Trainer.train_step

    def train_step(self):
        if self.step + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    Trainer.train_step = train_step
    cfg = tiny_cfg(sys.argv[1], "train.resume='auto'", *{overrides!r})
    Trainer(cfg, show_progress=False).fit()
""")


def run_driver(tmp_path, out_dir, kill_at, overrides):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=os.path.dirname(__file__), threads=torch.get_num_threads(),
                                    overrides=list(overrides)))
    return subprocess.run([sys.executable, str(script), str(out_dir), str(kill_at)], capture_output=True, text=True)


def train_losses(out_dir):
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in recs if r["kind"] == "train"]


def test_resume_after_kill_is_bit_exact(tmp_path):
    straight = tmp_path / "straight"
    Trainer(tiny_cfg(straight, *RESUME_OVERRIDES), show_progress=False).fit()

    resumed = tmp_path / "resumed"
    proc = run_driver(tmp_path, resumed, kill_at=7, overrides=RESUME_OVERRIDES)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [s for s, _ in list_checkpoints(resumed)] == [4]
    assert [s for s, _, _ in train_losses(resumed)] == [1, 2, 3, 4, 5, 6]  # steps 5, 6 ran after the checkpoint
    Trainer(tiny_cfg(resumed, "train.resume='auto'", *RESUME_OVERRIDES), show_progress=False).fit()

    a, b = train_losses(straight), train_losses(resumed)
    assert [s for s, _, _ in b] == list(range(1, 9))  # records of the lost steps 5, 6 were replaced
    assert a == b  # exact equality of every loss and grad norm
    wa, wb = load_file(str(straight / "final" / "model.safetensors")), load_file(str(resumed / "final" /
                                                                                         "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = optimizer_state(straight / "ckpt-000008"), optimizer_state(resumed / "ckpt-000008")
    assert sa.keys() == sb.keys() and len(sa) > 0
    for name, st in sa.items():
        assert torch.equal(st["exp_avg_sq"], sb[name]["exp_avg_sq"]) and torch.equal(st["exp_avg"], sb[name]["exp_avg"])
    assert [s for s, _ in list_checkpoints(resumed)] == [4, 8]  # keep_last=2


KILLER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_trainer import tiny_cfg
    from zero2all import checkpoint as ckpt_io
    from zero2all import fileio
    import zero2all.checkpoint.files as files
    from zero2all.train.trainer import Trainer

    point, calls = {point!r}, []

    def die_on(module, name, when=2):
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            calls.append(name)
            if calls.count(name) == when:   # the second checkpoint
                if point.endswith("-after"):
                    original(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(module, name, wrapped)

    if point.startswith("dcp"):             # inside the tensor files' write
        import torch.distributed.checkpoint as dcp
        die_on(dcp, "save")
    elif point.startswith("manifest"):      # the manifest, the last file
        die_on(ckpt_io, "write_manifest")
    elif point.startswith("replace"):       # the swap into place
        die_on(fileio, "replace_dir")
    elif point.startswith("prune"):
        die_on(ckpt_io, "prune")
    Trainer(tiny_cfg({out!r}, "train.max_steps=4", "train.ckpt_every=2", "train.keep_last=1"),
            show_progress=False).fit()
""")


@pytest.mark.parametrize("point", ["dcp", "manifest", "manifest-after", "replace", "replace-after", "prune"])
def test_kill_during_checkpoint_write_leaves_previous_loadable(tmp_path, point):
    """SIGKILL at each point of writing the second checkpoint: the first stays loadable, --resume auto picks the
    newest intact state and the run ends exactly as an uninterrupted one."""
    straight = tmp_path / "straight"
    Trainer(tiny_cfg(straight, "train.max_steps=4", "train.ckpt_every=2", "train.keep_last=1"),
            show_progress=False).fit()
    out = tmp_path / "run"
    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(tests=os.path.dirname(__file__), point=point, out=str(out)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    newest = latest_checkpoint(out)
    assert newest in (out / "ckpt-000002", out / "ckpt-000004")
    if point in ("dcp", "manifest", "replace"):
        assert newest == out / "ckpt-000002"
    assert load_model(newest)(torch.randint(0, 96, (1, 5)))[0].isfinite().all()
    trainer = Trainer(tiny_cfg(out, "train.max_steps=4", "train.ckpt_every=2", "train.keep_last=1",
                               "train.resume='auto'"), show_progress=False)
    trainer.fit()
    assert trainer.resumed_from == newest
    assert [s for s, _ in list_checkpoints(out)][-1] == 4 and not list(out.glob(".tmp-*"))
    assert train_losses(out)[-2:] == train_losses(straight)[-2:]


def test_full_disk_during_save_keeps_previous(tmp_path, monkeypatch):
    trainer = Trainer(tiny_cfg(tmp_path, "train.max_steps=3"), show_progress=False)
    trainer.train_step()
    first = trainer.save_checkpoint()
    trainer.train_step()
    import torch.distributed.checkpoint as dcp

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(OSError, match="No space left"):
        trainer.save_checkpoint()
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first and [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert ckpt_io.verify(first) == []


@pytest.mark.parametrize("victim", ["distcp", ".metadata", "z2all.json", "config.json", "manifest.json"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys, victim):
    """A truncated or altered file in any part of the newest checkpoint: --resume auto names it, skips it, resumes
    from the previous one, moves the bad one aside and continues the uninterrupted loss sequence exactly."""
    args = ["train.max_steps=4", "train.ckpt_every=2", "train.keep_last=0"]
    straight = tmp_path / "straight"
    Trainer(tiny_cfg(straight, *args), show_progress=False).fit()
    out = tmp_path / "run"
    Trainer(tiny_cfg(out, *args), show_progress=False).fit()
    ck = out / "ckpt-000004"
    f = next(ck.glob("*.distcp")) if victim == "distcp" else ck / victim
    data = f.read_bytes()
    if victim == "manifest.json":
        f.unlink()
    else:
        f.write_bytes(data[: len(data) // 2] + bytes(len(data) - len(data) // 2))  # same size, other bytes
    assert ckpt_io.verify(ck)
    capsys.readouterr()
    trainer = Trainer(tiny_cfg(out, *args, "train.resume='auto'"), show_progress=False)
    trainer.fit()
    printed = capsys.readouterr().out
    assert trainer.resumed_from == out / "ckpt-000002"
    assert f"skipping {ck}" in printed and "moved 1 later checkpoint(s)" in printed
    assert len(list(out.glob("abandoned-*/ckpt-000004"))) == 1
    assert train_losses(out)[-2:] == train_losses(straight)[-2:]
    assert ckpt_io.verify(out / "ckpt-000004") == []


def test_resuming_an_older_checkpoint_starts_a_new_line(tmp_path, capsys):
    """Resuming from ckpt-18 of a run that reached 24 with other settings: the old 24 is moved aside, the new
    line's 24 is really written (not skipped), and pruning keeps the new line's newest."""
    base = ["train.ckpt_every=6", "train.keep_last=2"]
    Trainer(tiny_cfg(tmp_path, "train.max_steps=24", *base), show_progress=False).fit()
    old_24 = (tmp_path / "ckpt-000024" / "manifest.json").read_text()
    capsys.readouterr()
    Trainer(tiny_cfg(tmp_path, "train.max_steps=26", "train.lr=1e-5", "train.min_lr=1e-6", *base,
                     f"train.resume={json.dumps(str(tmp_path / 'ckpt-000018'))}"), show_progress=False).fit()
    printed = capsys.readouterr().out
    assert "starts a new line" in printed and "ckpt-000024" in printed
    aside = list(tmp_path.glob("abandoned-*"))
    assert len(aside) == 1 and (aside[0] / "ckpt-000024" / "manifest.json").read_text() == old_24
    assert [s for s, _ in list_checkpoints(tmp_path)] == [24, 26]
    assert (tmp_path / "ckpt-000024" / "manifest.json").read_text() != old_24
    assert json.loads((tmp_path / "ckpt-000024" / "config.json").read_text())["train"]["lr"] == 1e-5


SIGNAL_DRIVER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from test_trainer import tiny_overrides
    from zero2all import checkpoint as ckpt_io
    from zero2all.cli import main
    from zero2all.train.trainer import Trainer

    where, signum = {where!r}, {signum}

    def hit(name, original, when):
        def wrapped(self, *args, **kwargs):
            if when(self):
                os.kill(os.getpid(), signum)   # arrives while this runs
            return original(self, *args, **kwargs)
        setattr(Trainer, name, wrapped)

    if where == "update":
        hit("train_step", Trainer.train_step, lambda t: t.step == 3)           # during update 4
    elif where == "eval":
        hit("evaluate", Trainer.evaluate, lambda t: t.step == 2)               # during the step-2 evaluation
    elif where == "save":
        hit("save_checkpoint", Trainer.save_checkpoint, lambda t: t.step == 2)  # during the step-2 checkpoint
    sys.exit(main(["pretrain", "--config", {empty!r}, "--no-progress", *tiny_overrides({out!r}, *{args!r})]))
""")


@pytest.mark.parametrize("where, signum, code, stopped_at", [("update", 2, 130, 4), ("update", 15, 143, 4),
                                                             ("eval", 2, 130, 2), ("save", 15, 143, 2)])
def test_signal_saves_a_checkpoint_and_resume_continues_exactly(tmp_path, where, signum, code, stopped_at):
    """SIGINT / SIGTERM during an update, an evaluation or a checkpoint save: the work in flight finishes, one
    checkpoint is saved, the exit is 130 / 143 with one line, and --resume auto continues the uninterrupted loss
    sequence exactly."""
    args = ["train.max_steps=6", "train.ckpt_every=2" if where == "save" else "train.ckpt_every=0",
            "train.eval_every=2" if where == "eval" else "train.eval_every=0", "train.eval_batches=1"]
    straight = tmp_path / "straight"
    Trainer(tiny_cfg(straight, *args), show_progress=False).fit()
    out = tmp_path / "run"
    (tmp_path / "empty.toml").write_text("")
    script = tmp_path / "interrupt_driver.py"
    script.write_text(SIGNAL_DRIVER.format(tests=os.path.dirname(__file__), where=where, signum=signum,
                                           empty=str(tmp_path / "empty.toml"), out=str(out), args=args))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "interrupted by" in proc.stderr and f"ckpt-{stopped_at:06d}" in proc.stderr
    assert [s for s, _ in list_checkpoints(out)][-1] == stopped_at
    Trainer(tiny_cfg(out, *args, "train.resume='auto'"), show_progress=False).fit()
    assert train_losses(out) == train_losses(straight)


def test_second_ctrl_c_aborts_at_once():
    from zero2all.train.trainer import _StopSignals

    with _StopSignals() as stop:
        os.kill(os.getpid(), 2)
        assert stop.received == 2
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), 2)


def test_keep_last_prunes_oldest(tmp_path):
    Trainer(tiny_cfg(tmp_path, "train.max_steps=5", "train.ckpt_every=1", "train.keep_last=2"),
            show_progress=False).fit()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert not list(tmp_path.glob(".trash-*")) and not list(tmp_path.glob(".tmp-*"))


def test_incomplete_directory_is_not_a_checkpoint(tmp_path):
    Trainer(tiny_cfg(tmp_path, "train.max_steps=2", "train.ckpt_every=1"), show_progress=False).fit()
    (tmp_path / "ckpt-000002" / "manifest.json").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000001"
    with pytest.raises(ckpt_io.CheckpointError, match="manifest.json is missing"):
        Trainer(tiny_cfg(tmp_path, "train.max_steps=3", f"train.resume={json.dumps(str(tmp_path / 'ckpt-000002'))}"),
                show_progress=False).fit()


def test_checkpoint_of_the_earlier_format_is_refused_with_the_way_out(tmp_path):
    old = tmp_path / "ckpt-000003"
    old.mkdir()
    for name in ("trainer_state.pt", "data_state.json", "model.safetensors", "z2all.json"):
        (old / name).write_text("{}")
    with pytest.raises(ckpt_io.CheckpointError, match="earlier zero2all version.*z2all convert-checkpoint"):
        Trainer(tiny_cfg(tmp_path, "train.max_steps=4", "train.resume='auto'"), show_progress=False).fit()


@pytest.mark.parametrize("override, expected", [
    ("model.n_layers=3", "model.n_layers: 2 in the checkpoint, 3 now"),
    ("model.hidden_dim=48", "model.hidden_dim: 32 in the checkpoint, 48 now"),
    ("train.micro_batch_size=4", "train.micro_batch_size: 2 in the checkpoint, 4 now"),
    ("data.seq_len=16", "data.seq_len: 24 in the checkpoint, 16 now"),
])
def test_mismatched_config_is_refused(tmp_path, override, expected):
    Trainer(tiny_cfg(tmp_path, "train.max_steps=1"), show_progress=False).fit()
    trainer = Trainer(tiny_cfg(tmp_path, "train.max_steps=2", "train.resume='auto'", override), show_progress=False)
    with pytest.raises(CheckpointMismatch) as err:
        trainer.fit()
    assert expected in str(err.value) and "ckpt-000001" in str(err.value)


def test_mismatched_tokenizer_is_refused_and_changes_are_reported(tmp_path, capsys):
    first = Trainer(tiny_cfg(tmp_path, "train.max_steps=1"), show_progress=False)
    first.train_data.tokenizer_hash = "aaaa1111"
    first.tokenizer_hash = "aaaa1111"
    first.fit()
    trainer = Trainer(tiny_cfg(tmp_path, "train.max_steps=2", "train.resume='auto'"), show_progress=False)
    trainer.tokenizer_hash = "bbbb2222"
    with pytest.raises(CheckpointMismatch, match="tokenizer: hash 'aaaa1111' in the checkpoint, 'bbbb2222'"):
        trainer.fit()
    ok = Trainer(tiny_cfg(tmp_path, "train.max_steps=2", "train.resume='auto'", "train.lr=1e-3",
                          "train.weight_decay=0.05"), show_progress=False)
    ok.tokenizer_hash = "aaaa1111"
    ok.fit()
    assert [g["weight_decay"] for g in ok.optimizer.param_groups] == [0.05, 0.0]  # the new value is used
    out = capsys.readouterr().out
    assert "resumed from" in out and "train.lr: 0.003 -> 0.001" in out and "train.max_steps: 1 -> 2" in out


def test_fresh_run_refuses_an_out_dir_with_checkpoints(tmp_path):
    Trainer(tiny_cfg(tmp_path, "train.max_steps=1"), show_progress=False).fit()
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        Trainer(tiny_cfg(tmp_path, "train.max_steps=2"), show_progress=False).fit()


def test_checkpoint_is_self_contained(tmp_path):
    """Weights load with load_model; tokenizer files are copied in; the state loads with weights_only."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"fake": true}')
    (tok / "z2all_tokenizer.json").write_text('{"hash": "abc"}')
    trainer = Trainer(tiny_cfg(tmp_path / "run", "train.max_steps=2"), tokenizer_dir=tok, show_progress=False)
    trainer.fit()
    ck = tmp_path / "run" / "ckpt-000002"
    for name in ("tokenizer.json", "z2all_tokenizer.json", "config.json", "manifest.json", ".metadata"):
        assert (ck / name).exists(), name
    assert (tmp_path / "run" / "final" / "tokenizer.json").exists()
    model = load_model(ck)
    x = torch.randint(0, 96, (2, 7))
    trainer.raw_model.eval()
    torch.testing.assert_close(model(x)[0], trainer.raw_model(x)[0], rtol=0, atol=0)
    assert ckpt_io.read_meta(ck)["step"] == 2 and ckpt_io.verify(ck) == []
    manifest = json.loads((ck / "manifest.json").read_text())["files"]
    assert {"tokenizer.json", "config.json", "z2all.json", ".metadata"} <= set(manifest)


def test_rng_state_round_trip():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = ckpt_io.capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    ckpt_io.restore_rng_state(state)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_resuming_a_finished_run_changes_nothing(tmp_path):
    cfg = ["train.max_steps=3", "train.eval_every=3", "train.eval_batches=1", "train.num_samples=1",
           "train.sample_new_tokens=2"]
    Trainer(tiny_cfg(tmp_path, *cfg), show_progress=False).fit()
    before = (tmp_path / "metrics.jsonl").read_text().splitlines()
    again = Trainer(tiny_cfg(tmp_path, "train.resume='auto'", *cfg), show_progress=False)
    again.fit()
    after = (tmp_path / "metrics.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["kind"] for line in after[len(before):]]
    assert again.step == 3 and kinds == ["info"]  # no second eval or sample of the same step
    assert "Prompt:" in (tmp_path / "report.md").read_text()


def test_checkpoint_of_the_earlier_single_process_format_converts_and_resumes_exactly(tmp_path, capsys):
    """A checkpoint in the earlier single-process layout (safetensors weights, trainer_state.pt with index-keyed
    optimizer state and tuple RNG states, data_state.json): resuming is refused naming the command; after
    `z2all convert-checkpoint` the run continues the uninterrupted loss sequence exactly."""
    from zero2all.cli import main
    from zero2all.model.io import save_model

    args = ["train.max_steps=4", "train.ckpt_every=2", "model.dropout1=0.1"]
    straight = tmp_path / "straight"
    Trainer(tiny_cfg(straight, *args), show_progress=False).fit()
    # the earlier layout, made from the state of the run at step 2
    t = Trainer(tiny_cfg(tmp_path / "scratch", *args, f"train.resume={json.dumps(str(straight / 'ckpt-000002'))}"),
                show_progress=False)
    t.resume(straight / "ckpt-000002")
    old = tmp_path / "old" / "ckpt-000002"
    save_model(t.raw_model, old, extra={"step": 2, "tokenizer_hash": None}, atomic=False)
    np_state = np.random.get_state()
    torch.save({"step": t.step, "tokens_seen": t.tokens_seen, "skipped_total": t.skipped_total,
                "elapsed_s": t.elapsed_s, "world_size": 1, "objective": "pretrain", "scaler": t.scaler.state_dict(),
                "schedule": t.schedule.state_dict(), "tokenizer_hash": None, "optimizer": t.optimizer.state_dict(),
                "rng": {"python": random.getstate(),
                        "numpy": {"kind": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                                  "cached_gaussian": float(np_state[4])},
                        "torch": torch.get_rng_state()}}, old / "trainer_state.pt")
    (old / "config.json").write_text((straight / "ckpt-000002" / "config.json").read_text())
    (old / "data_state.json").write_text(json.dumps({"kind": "synthetic", "seed": 1337, "next_sample": 4}))
    with pytest.raises(ckpt_io.CheckpointError, match="z2all convert-checkpoint"):
        Trainer(tiny_cfg(old.parent, *args, "train.resume='auto'"), show_progress=False).fit()
    new = tmp_path / "new" / "ckpt-000002"
    assert main(["convert-checkpoint", str(old), "--out", str(new)]) == 0
    assert ckpt_io.verify(new) == [] and ckpt_io.read_meta(new)["step"] == 2
    Trainer(tiny_cfg(new.parent, *args, "train.resume='auto'"), show_progress=False).fit()
    assert train_losses(new.parent) == train_losses(straight)[2:]
