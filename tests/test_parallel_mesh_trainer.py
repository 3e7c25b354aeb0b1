"""The trainer on a device mesh under torchrun (2 gloo processes, CPU): tensor + sequence parallel reproduces the
one-process run of the same global batch in float64 (per step the loss and the gradient norm, the final
parameters; one data-parallel replica: the same micro-batch size), its
sharded checkpoint (rank-major fused rows, vocab-sharded embedding) resumes on one process, and the final model
is exported in the plain layout."""

from __future__ import annotations

import pytest

from tests.test_distributed_trainer import (
    BASE,
    MICRO,
    assert_close_losses,
    assert_same_final,
    losses,
    single_process,
    torchrun,
)
from zero2all.config import load_config
from zero2all.train.trainer import Trainer


@pytest.mark.slow
def test_trainer_tp2_sp_matches_one_process_and_resumes_on_one(tmp_path):
    want = single_process(tmp_path / "single")
    out = tmp_path / "tp2"
    proc = torchrun(tmp_path, out, f"train.micro_batch_size={2 * MICRO}", "parallel.tp=2",
                    "parallel.sequence_parallel=true", "train.eval_every=4", "train.eval_batches=2")
    assert "parallel: mesh (tp=2) on 2 processes" in proc.stdout
    assert "tensor parallel ops (local): projections = torch lean linear" in proc.stdout
    assert_close_losses(losses(out), want, range(1, 9))
    one = tmp_path / "tp2-to-one"
    one.mkdir()
    cfg = load_config("tiny", BASE + [f"train.micro_batch_size={2 * MICRO}", f"train.out_dir='{one}'",
                                      f"train.resume='{out / 'ckpt-000004'}'"])
    Trainer(cfg, show_progress=False).fit()
    assert_close_losses(losses(one), want, range(5, 9))
    assert_same_final(out, tmp_path / "single")   # exported in the plain layout
    assert_same_final(one, tmp_path / "single")
