"""Pipeline parallelism composed with the other mesh dimensions on 4 gloo processes (CPU, float64), in one launch:

- pp2 x dp2: FSDP2 shards each stage over its two data-parallel ranks, every block under activation
  checkpointing (2 replicas x micro-batch 2 x accumulation 2 = the single process's micro-batch 4 x accumulation 2);
- tp2 x pp2 with sequence parallelism (1F1B), and without it (interleaved 1F1B, 2 stages per rank): each stage's
  blocks are tensor-parallel (DTensor), the last stage's cross-entropy runs under loss parallel on vocab-sharded
  logits (one replica: micro-batch 4 x accumulation 2).

Each reproduces, per step, the single-process loss and gradient norm of the same global batch, and its final model
(gathered from every stage, tensor-parallel fused rows back in the plain layout) equals the single process's, all
within tests/equivalence.py's float64 bound.

What it catches (tests/mutations.py, ``-t pp_dp``): gradients x2 on one rank (rank 1 is a first-stage rank in
every layout here: its stage's gradient norm and parameters move), one block's gradients x0.5, the norm weights'
gradients x0.5. A bug that doubles the loss of rank 1 acts on no run here (the pipeline's loss lives on the last
stage, ranks 2 and 3): ``test_parallel_pp.py`` and the data-parallel tests catch that one."""

from __future__ import annotations

import pytest
import torch
from equivalence import assert_equivalent, launch, train

STEPS = 6
RUNS = {
    "pp2 x dp2 (FSDP2 on each stage, activation checkpointing)":
        ["train.micro_batch_size=2", "parallel.pp=2", "parallel.pp_schedule='1f1b'", "parallel.mode='fsdp'",
         "parallel.activation_checkpointing='full'"],
    "tp2 x pp2 (sequence parallel, loss parallel on the last stage)":
        ["train.micro_batch_size=4", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
         "parallel.pp_schedule='1f1b'", "parallel.pp_microbatches=2"],
    "tp2 x pp2 (interleaved 1F1B, 2 stages per rank, plain norm weights)":
        ["train.micro_batch_size=4", "parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule='interleaved_1f1b'",
         "parallel.pp_stages_per_rank=2"],
}


@pytest.mark.slow
def test_pp2_with_dp2_and_with_tp2_match_one_process(tmp_path):
    torch.set_num_threads(1)
    steps = f"train.max_steps={STEPS}"
    want = train(tmp_path / "single", "train.micro_batch_size=4", steps)
    assert want.losses[-1] < want.losses[0] - 0.1  # training happens
    got = launch(tmp_path / "mesh", 4, [[*run, steps] for run in RUNS.values()])
    for what, run in zip(RUNS, got):
        assert_equivalent(run, want, what)
