"""Expert parallelism on gloo (CPU): ep2 (2 processes) and ep2 x dp2 (4 processes) reproduce the single-process
run of the same global batches (dropless, float64: per step the loss and the gradient norm, at the end every
parameter, within tests/equivalence.py's bound), and a checkpoint written under ep2 resumes on one process and
continues the same run.

The model is a tiny MoE (4 experts, top-2, a shared expert, a dense first layer; the plain per-expert loop as the
expert implementation). Load-balancing and z-losses are on: they are means over each rank's tokens, like the
cross-entropy, except the balancing loss, which is a product of two means (f_e P_e) and so differs between one
batch and its halves; it is kept off here and checked apart (tests/test_moe.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from equivalence import Run, assert_equivalent
from test_distributed import free_port, gloo_worker

from zero2all import checkpoint as ckpt
from zero2all import distributed as zd
from zero2all.config import ModelConfig, MoEConfig, OpsConfig, ParallelConfig, to_dict
from zero2all.distributed.ac import transformer_blocks
from zero2all.model.moe import gather_rows
from zero2all.model.z2all import build_model

STEPS, SEQ, ROWS = 6, 12, 8  # ROWS sequences per global batch


def moe_cfg() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_dim=32, intermediate_size=48, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=SEQ, ops=OpsConfig.plain(),
                       moe=MoEConfig(n_experts=4, top_k=2, n_shared_experts=1, expert_intermediate_size=24,
                                     first_dense_layers=1, z_loss_coef=1e-3))


def batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 64, (STEPS, ROWS, 1), generator=g)
    seq = [start]
    for _ in range(SEQ):
        seq.append((seq[-1] * 7 + 5) % 64)
    return torch.cat(seq, -1)


def make(env, ep: int, reshard: bool = False, compile_blocks: bool = False):
    model = build_model(moe_cfg(), seed=7, dtype=torch.float64)
    if compile_blocks:  # as train.compile does (per block, before wrapping); the eager backend: tracing only
        for block in transformer_blocks(model):
            block.compile(backend="eager")
    pc = ParallelConfig(mode="auto" if ep > 1 else "none", ep=ep, ep_reshard_after_forward=reshard)
    run = zd.parallelize(model, pc, env, precision="fp64")
    opt = torch.optim.AdamW(run.model.parameters(), lr=3e-3, weight_decay=0.1)
    return run, opt


def train(run, opt, env, steps) -> dict:
    """Each step's loss and gradient norm (before clipping)."""
    data, losses, norms = batches(), [], []
    rows = ROWS // env.world_size
    for step in steps:
        part = data[step, env.rank * rows:(env.rank + 1) * rows]
        _, loss = run.model(part[:, :-1], part[:, 1:])
        loss.backward()
        norms.append(float(zd.clip_grad_norm(run.model, 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(zd.all_reduce_mean(loss.item(), env))
    return {"losses": losses, "norms": norms}


def parts(run, opt, step):
    return {"model": ckpt.ModelState(run.plain), "optim": ckpt.OptimizerState(run.plain, opt),
            "trainer": ckpt.JsonState(lambda: {"step": step[0]}, lambda s: step.__setitem__(0, s["step"]))}


def scenario(env, out: Path, ep: int, save_at: int = 0, reshard: bool = False, compile_blocks: bool = False):
    """Train STEPS steps under ep (all ranks data-parallel); with ``save_at``, checkpoint after that step;
    ``reshard``: FSDP2 frees the gathered weights after each block's forward (parallel.ep_reshard_after_forward);
    ``compile_blocks``: each block under torch.compile (the exchanges stay eager)."""
    run, opt = make(env, ep, reshard, compile_blocks)
    w = run.plain.layers[1].mlp.experts.gate_up_proj
    assert w.to_local().shape[0] * env.world_size == w.shape[0]  # dp x ep: each rank holds its share
    # one ep group (dp = 1): the experts stay out of FSDP2 (FSDP2 renames the class of what it wraps)
    assert (type(run.plain.layers[1].mlp.experts).__name__ == "Experts") == (env.world_size == ep)
    first = train(run, opt, env, range(save_at))
    if save_at:
        ckpt.save(out / "ckpt", parts(run, opt, [save_at]), env, {"step": save_at, "model": to_dict(moe_cfg())})
    rest = train(run, opt, env, range(save_at, STEPS))
    full = run.full_state_dict()  # gathered for the final model directory: global expert tensors on rank 0
    if full is not None:
        torch.save({k: v.detach().cpu().clone() for k, v in full.items()}, out / "params.pt")
    return {k: first[k] + rest[k] for k in first}


def _entry(rank, world, port, out, kwargs):
    gloo_worker(rank, world, port, out, lambda env: scenario(env, Path(out), **kwargs), timeout_s=120.0)


def spawn(out: Path, world: int, **kwargs) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_entry, args=(world, free_port(), str(out), kwargs), nprocs=world, join=True)
    got = json.loads((out / "result.json").read_text())
    return Run(got["losses"], got["norms"], torch.load(out / "params.pt"))


def params(run) -> dict:
    return {k: v.detach().clone() for k, v in run.plain.state_dict().items()}


def reference() -> Run:
    run, opt = make(zd.DistEnv(), 1)
    got = train(run, opt, zd.DistEnv(), range(STEPS))
    return Run(got["losses"], got["norms"], params(run))


def test_ep2_and_ep2_dp2_match_single_process_and_resume(tmp_path):
    want = reference()
    assert want.losses[-1] < want.losses[0] - 0.3, want.losses  # training happens: the comparison means something
    half = STEPS // 2
    # ep2 runs its blocks under torch.compile and saves a checkpoint at step 10 on the way; ep2 x dp2 reshards
    # after the forward (the default keeps the gathered weights), so both FSDP2 settings are checked
    for name, world, kw in (("save", 2, {"save_at": half, "compile_blocks": True}), ("ep2dp2", 4, {"reshard": True})):
        assert_equivalent(spawn(tmp_path / name, world, ep=2, **kw), want, f"ep2 on {world} processes")
    # one process resumes from the ep2 checkpoint and continues the same sequence
    env = zd.DistEnv()
    run, opt = make(env, 1)
    step = [0]
    ckpt.load(tmp_path / "save" / "ckpt", parts(run, opt, step), env)
    assert step[0] == half
    resumed = train(run, opt, env, range(half, STEPS))
    assert_equivalent(Run(resumed["losses"], resumed["norms"], params(run)),
                      Run(want.losses[half:], want.grad_norms[half:], want.params), "ep2 -> resumed on one process")


@pytest.mark.parametrize("n,k,h,keep", [(13, 2, 7, 1.0), (9, 3, 5, 0.6), (17, 1, 4, 1.0), (1, 2, 3, 0.5)])
def test_gather_rows_matches_indexing_forward_and_backward(n, k, h, keep):
    """The dispatch gather (rows x[order // k], sort-free backward) equals plain indexing in float64, with
    all assignments kept (a permutation) and with some dropped (capacity)."""
    g = torch.Generator().manual_seed(n * 31 + k)
    x = torch.randn(n, h, dtype=torch.float64, generator=g, requires_grad=True)
    order = torch.randperm(n * k, generator=g)[:max(1, int(keep * n * k))]
    dy = torch.randn(order.numel(), h, dtype=torch.float64, generator=g)
    got = gather_rows(x, order, k)
    (gx,) = torch.autograd.grad(got, x, dy)
    want = x[order // k]
    (wx,) = torch.autograd.grad(want, x, dy)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(gx, wx, rtol=1e-12, atol=1e-12)


MOE_KEYS = ["model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_intermediate_size=32",
            "model.moe.first_dense_layers=1", "model.moe.router='sigmoid'", "model.moe.z_loss_coef=0.001",
            "model.ops.grouped_gemm='loop'", "train.log_every=2"]


@pytest.mark.slow
def test_trainer_with_expert_parallelism_matches_one_process(tmp_path):
    """`z2all pretrain` under torchrun with parallel.ep=2 (2 micro-steps per update): the loss sequence of one
    process (the sigmoid router's bias update sums the load over the ranks), expert-load metrics logged, the final
    model gathered (defaults: fsdp_accum_no_sync = auto, on under ep); the same sequence with one reduce-scatter
    per micro-step (fsdp_accum_no_sync = false)."""
    from test_distributed_trainer import assert_close_losses, assert_same_final, single_process, torchrun


    want = single_process(tmp_path / "single", *MOE_KEYS, "train.max_steps=6")
    proc = torchrun(tmp_path, tmp_path / "ep", *MOE_KEYS, "train.max_steps=6", "parallel.ep=2")
    recs = [json.loads(line) for line in (tmp_path / "ep" / "metrics.jsonl").read_text().splitlines()]
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in recs if r["kind"] == "train"}
    assert_close_losses(got, want, range(1, 7))
    assert "parallel: fsdp on 2 processes" in proc.stdout
    assert [r["step"] for r in recs if "moe/layer1/load_max" in r] == [2, 4, 6]
    # one reduce-scatter per micro-step instead of per update: the same sequence
    torchrun(tmp_path, tmp_path / "nosync", *MOE_KEYS, "train.max_steps=6", "parallel.ep=2",
             "parallel.fsdp_accum_no_sync=false")
    nosync = [json.loads(line) for line in (tmp_path / "nosync" / "metrics.jsonl").read_text().splitlines()]
    assert_close_losses({r["step"]: (r["loss"], r["grad_norm"]) for r in nosync if r["kind"] == "train"}, want,
                        range(1, 7))
    assert_same_final(tmp_path / "ep", tmp_path / "single")
    assert_same_final(tmp_path / "nosync", tmp_path / "single")
