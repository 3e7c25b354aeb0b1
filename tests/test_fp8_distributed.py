"""FP8 linears under FSDP2 and DDP (2 gloo processes on CPU) against the single-process run of the same global batch.

The blocks' projections run their FP8 GEMMs on the gathered weights through the PyTorch reference path (the same
rule as the kernels, checked bit for bit in test_kernels_fp8.py; the interpreter would make this test minutes
long); the Triton custom ops under FSDP2 are the bf16 lean ops' plumbing, covered by test_distributed.py.

Forward casts are per row (token) or per weight row, so the first loss (before any update) is the single
process's to 1e-5. The weight-gradient GEMM scales each column of the output gradient over the tokens of the
micro-batch at hand (a rank's half of it, not the whole): the gradients then differ at FP8's rounding level, and
the later losses within 1e-2.
"""

from __future__ import annotations

import torch
from test_distributed import (
    ACCUM,
    MICRO,
    STEPS,
    WORLD,
    assert_same_losses,
    global_batches,
    make_run,
    spawn,
    train_steps,
)

from zero2all import distributed as zd
from zero2all.config import OpsConfig

FP8_OPS = OpsConfig(rmsnorm="torch", rope="torch", swiglu="torch", cross_entropy="torch", attention="sdpa",
                    fused_linear="torch", linear_precision="fp8_rowwise")


def single_process_losses() -> list[float]:
    env = zd.DistEnv()
    run, opt = make_run({}, env, dict(ops=FP8_OPS))
    return train_steps(run, opt, global_batches(STEPS), env, range(STEPS), WORLD)


def test_fp8_fsdp_and_ddp_match_single_process(tmp_path):
    assert MICRO * ACCUM >= 2
    want = single_process_losses()
    assert want[-1] < want[0] - 0.05, want                                 # training happens
    modes = [dict(parallel="fsdp", model=dict(ops=FP8_OPS)), dict(parallel="ddp", model=dict(ops=FP8_OPS))]
    got = spawn("modes", tmp_path, modes=modes)["losses"]
    for name, losses in zip(("fsdp", "ddp"), got):
        assert all(torch.isfinite(torch.tensor(losses))), (name, losses)
        assert_same_losses(losses[:1], want[:1], rtol=1e-5, msg=f"fp8 {name}, first step")
        assert_same_losses(losses, want, rtol=1e-2, msg=f"fp8 {name}")
