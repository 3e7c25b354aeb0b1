"""The trainer under torchrun (2 gloo processes on CPU): same loss sequence as one process with the same global
batch, sharded checkpoints that resume with a different number of processes (2 -> 1 and 1 -> 2), and a worker
killed mid-run that torchrun restarts and that resumes from the last complete checkpoint by itself. Float64
(``train.precision = "fp64"``): per step the loss and the gradient norm, and the final parameters, within
tests/equivalence.py's bound."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from equivalence import PARAM_RTOL, RTOL, rel

from zero2all import checkpoint as ckpt_io
from zero2all.config import load_config
from zero2all.train.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
MICRO = 2            # per process with 2 processes; the single process uses 2 * MICRO (same global batch)

BASE = ["model.vocab_size=128", "model.hidden_dim=64", "model.intermediate_size=128", "model.n_layers=2",
        "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32", "model.ops.rmsnorm='torch'",
        "model.ops.rope='torch'", "model.ops.swiglu='torch'", "model.ops.cross_entropy='torch'",
        "train.grad_accum_steps=2", "train.max_steps=8", "train.ckpt_every=4", "train.eval_every=0",
        "train.sample_every=0", "train.num_samples=0", "train.tensorboard=false", "train.warmup_steps=2",
        "train.lr=0.01", "train.device='cpu'", "train.keep_last=0", "train.precision='fp64'",
        "train.schedule='constant'"]  # the lr of a step does not depend on max_steps

# torchrun runs this: the trainer as `z2all pretrain` runs it, except that on the first attempt (torchrun's
# TORCHELASTIC_RESTART_COUNT=0) rank 1 dies abruptly right after update KILL_AT when KILL_AT > 0.
WORKER = textwrap.dedent("""
    import os, sys
    import torch
    torch.set_num_threads(1)
    from zero2all.config import load_config
    from zero2all.train import trainer as T

    kill_at = int(os.environ.get("KILL_AT", "0"))
    original = T.Trainer.train_step

    def train_step(self):
        rec = original(self)
        if kill_at and self.rank == 1 and self.step == kill_at and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os._exit(17)
        return rec

    T.Trainer.train_step = train_step
    cfg = load_config("tiny", sys.argv[1:])
    T.pretrain(cfg, show_progress=False)
    T.zd.finish_process(0)  # as `z2all` does at the end of a torchrun worker
""")


def losses(out: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, gradient norm before clipping)."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs if r.get("kind") == "train"}


def assert_close_losses(got: dict, want: dict, steps):
    for s in steps:
        for i, what in enumerate(("loss", "grad norm")):
            assert rel(got[s][i], want[s][i]) <= RTOL, f"step {s}: {what} {got[s][i]!r} vs {want[s][i]!r}"


def assert_same_final(got: Path, want: Path) -> None:
    """The final models of two runs (``out/final``): every parameter within PARAM_RTOL of its tensor's largest."""
    from safetensors.torch import load_file

    a, b = load_file(str(got / "final" / "model.safetensors")), load_file(str(want / "final" / "model.safetensors"))
    assert set(a) == set(b)
    for name, w in b.items():
        d = float((a[name] - w).abs().max()) / float(w.abs().max())
        assert d <= PARAM_RTOL, f"final {name}: {d:.2e} (relative)"


def single_process(out: Path, *extra: str) -> dict:
    torch.set_num_threads(1)
    cfg = load_config("tiny", BASE + [f"train.micro_batch_size={2 * MICRO}", f"train.out_dir='{out}'", *extra])
    Trainer(cfg, show_progress=False).fit()
    return losses(out)


def torchrun(tmp: Path, out: Path, *extra: str, kill_at: int = 0, restarts: int = 0) -> subprocess.CompletedProcess:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={restarts}", str(script), *BASE, f"train.micro_batch_size={MICRO}",
           f"train.out_dir='{out}'", *extra]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each restart gets a fresh store for init_process_group; with the
    # store shared with torchrun's rendezvous a restarted worker can read a peer address of the previous attempt
    # (pytorch/pytorch#135712) and fail to connect (seen here as gloo "connectFullMesh ... Connection refused")
    env = dict(os.environ, KILL_AT=str(kill_at), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_trainer_two_processes_match_one_and_survive_a_killed_worker(tmp_path):
    want = single_process(tmp_path / "single")
    assert want[8][0] < want[1][0] - 0.1  # training happens
    # 2 processes (DDP + no_sync), rank 1 killed after update 6: torchrun restarts both, --resume auto picks
    # ckpt-000004 (the last complete one) and the run finishes with the same losses as the uninterrupted one
    out = tmp_path / "ddp"
    proc = torchrun(tmp_path, out, "train.resume='auto'", kill_at=6, restarts=1)
    got = losses(out)
    assert sorted(got) == list(range(1, 9))
    assert_close_losses(got, want, range(1, 9))
    assert "resumed from" in proc.stdout and "ckpt-000004" in proc.stdout
    assert ckpt_io.verify(out / "ckpt-000008") == [] and ckpt_io.read_meta(out / "ckpt-000004")["world_size"] == 2
    assert_same_final(out, tmp_path / "single")
    # 2 -> 1: one process resumes the 2-process sharded checkpoint of step 4 and continues the same sequence
    one = tmp_path / "two-to-one"
    one.mkdir()
    cfg = load_config("tiny", BASE + [f"train.micro_batch_size={2 * MICRO}", f"train.out_dir='{one}'",
                                      f"train.resume='{out / 'ckpt-000004'}'"])
    Trainer(cfg, show_progress=False).fit()
    assert_close_losses(losses(one), want, range(5, 9))
    assert_same_final(one, tmp_path / "single")


@pytest.mark.slow
def test_trainer_one_process_checkpoint_resumes_on_two_with_zero1(tmp_path):
    out = tmp_path / "run"
    want = single_process(out, "train.max_steps=4")              # plain checkpoint ckpt-000004
    shutil.copytree(out / "final", tmp_path / "four" / "final")  # the 4-step model (out/final is rewritten)
    full = single_process(tmp_path / "full")
    torchrun(tmp_path, out, "train.resume='auto'", "parallel.mode='zero1'")
    got = losses(out)
    assert_close_losses(got, full, range(1, 9))
    assert want[4] == got[4]
    assert_same_final(out, tmp_path / "full")
    # FSDP2 (ZeRO-3-like) with full activation checkpointing inside the trainer; sampling and the final model
    # gather the shards
    fsdp = tmp_path / "fsdp"
    proc = torchrun(tmp_path, fsdp, "parallel.mode='fsdp'", "parallel.activation_checkpointing='full'",
                    "train.max_steps=4", "train.num_samples=1", "train.sample_new_tokens=4")
    assert_close_losses(losses(fsdp), full, range(1, 5))
    assert_same_final(fsdp, tmp_path / "four")
    assert "parallel: fsdp on 2 processes" in proc.stdout and "mem/rank r0:" in proc.stdout
    assert "sample (step 4)" in proc.stdout
    from zero2all.model.io import load_model

    assert load_model(fsdp / "final").num_params() == load_model(out / "final").num_params()
