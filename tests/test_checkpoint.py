"""Checkpoints: bit-exact resume after a real kill -9, crash-safe writes, pruning, mismatch errors."""

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

from zero2all.config import ConfigError
from zero2all.model.io import load_model
from zero2all.train import checkpoint as ckpt_io
from zero2all.train.checkpoint import CheckpointMismatch, latest_checkpoint, list_checkpoints
from zero2all.train.trainer import Trainer

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
    sa = torch.load(straight / "ckpt-000008" / "trainer_state.pt", weights_only=True)
    sb = torch.load(resumed / "ckpt-000008" / "trainer_state.pt", weights_only=True)
    for i, st in sa["optimizer"]["state"].items():
        assert torch.equal(st["exp_avg_sq"], sb["optimizer"]["state"][i]["exp_avg_sq"])
    assert [s for s, _ in list_checkpoints(resumed)] == [4, 8]  # keep_last=2


def test_kill_during_checkpoint_write_leaves_previous_loadable(tmp_path):
    """SIGKILL in the middle of writing the second checkpoint's weights."""
    out = tmp_path / "run"
    script = tmp_path / "killer.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import safetensors.torch
        from test_trainer import tiny_cfg
        from zero2all.train.trainer import Trainer

        calls = []
        original = safetensors.torch.save_file

        def save_file(tensors, filename, metadata=None):
            calls.append(filename)
            if len(calls) == 2:          # second checkpoint: write half a file, then die
                original(tensors, filename, metadata=metadata)
                with open(filename, "r+b") as f:
                    f.truncate(os.path.getsize(filename) // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            return original(tensors, filename, metadata=metadata)

        safetensors.torch.save_file = save_file
        Trainer(tiny_cfg({str(out)!r}, "train.max_steps=4", "train.ckpt_every=2"), show_progress=False).fit()
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    leftovers = list(out.glob(".tmp-ckpt-000004-*"))
    assert leftovers and (leftovers[0] / "model.safetensors").exists()  # the half-written one
    assert latest_checkpoint(out) == out / "ckpt-000002"
    model = load_model(out / "ckpt-000002")
    assert model(torch.randint(0, 96, (1, 5)))[0].isfinite().all()
    trainer = Trainer(tiny_cfg(out, "train.max_steps=4", "train.ckpt_every=2", "train.resume='auto'"),
                      show_progress=False)
    trainer.fit()
    assert trainer.resumed_from == out / "ckpt-000002"
    assert [s for s, _ in list_checkpoints(out)] == [2, 4] and not list(out.glob(".tmp-ckpt-*"))


def test_exception_during_save_keeps_previous(tmp_path, monkeypatch):
    trainer = Trainer(tiny_cfg(tmp_path, "train.max_steps=3"), show_progress=False)
    trainer.train_step()
    first = trainer.save_checkpoint()
    trainer.train_step()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_io.torch, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint()
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first and [s for s, _ in list_checkpoints(tmp_path)] == [1]
    ckpt_io.load_checkpoint(first, Trainer(tiny_cfg(tmp_path / "other")).raw_model)


def test_keep_last_prunes_oldest(tmp_path):
    Trainer(tiny_cfg(tmp_path, "train.max_steps=5", "train.ckpt_every=1", "train.keep_last=2"),
            show_progress=False).fit()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert not list(tmp_path.glob(".trash-*")) and not list(tmp_path.glob(".tmp-*"))


def test_incomplete_directory_is_not_a_checkpoint(tmp_path):
    Trainer(tiny_cfg(tmp_path, "train.max_steps=2", "train.ckpt_every=1"), show_progress=False).fit()
    (tmp_path / "ckpt-000002" / "trainer_state.pt").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000001"
    with pytest.raises(FileNotFoundError, match="missing trainer_state.pt"):
        ckpt_io.load_checkpoint(tmp_path / "ckpt-000002", Trainer(tiny_cfg(tmp_path / "x")).raw_model)


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
    for name in ("tokenizer.json", "z2all_tokenizer.json", "config.json", "data_state.json"):
        assert (ck / name).exists(), name
    assert (tmp_path / "run" / "final" / "tokenizer.json").exists()
    model = load_model(ck)
    x = torch.randint(0, 96, (2, 7))
    trainer.raw_model.eval()
    torch.testing.assert_close(model(x)[0], trainer.raw_model(x)[0], rtol=0, atol=0)
    state = torch.load(ck / "trainer_state.pt", weights_only=True)
    assert state["step"] == 2 and set(state["rng"]) >= {"python", "numpy", "torch"}
    assert json.loads((ck / "data_state.json").read_text())["next_sample"] == 2 * 2


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
