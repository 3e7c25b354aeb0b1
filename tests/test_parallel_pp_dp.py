"""Pipeline x data parallelism on 4 gloo processes (CPU, fp32): pp2 x dp2, FSDP2 sharding each stage over its two
data-parallel ranks and every block under activation checkpointing, reproduces the single-process loss sequence
and gradient norms of the same global batch (2 replicas x micro-batch 2 x accumulation 2 = the single process's
micro-batch 4 x accumulation 2). Helpers and the bound (relative 1e-5 on the losses) are test_parallel_pp.py's."""

from __future__ import annotations

import pytest
import torch
from test_parallel_pp import assert_same, launch, train


@pytest.mark.slow
def test_pp2_x_dp2_matches_one_process(tmp_path):
    torch.set_num_threads(1)
    want = train(tmp_path / "single", "train.micro_batch_size=4")
    (got,) = launch(tmp_path / "mesh", 4, [["train.micro_batch_size=2", "parallel.pp=2",
                                             "parallel.pp_schedule='1f1b'", "parallel.mode='fsdp'",
                                             "parallel.activation_checkpointing='full'"]])
    assert_same(got, want, "pp2 x dp2 (FSDP2 on each stage, activation checkpointing)")
