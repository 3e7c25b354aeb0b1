"""Data-parallel training on 2 gloo processes (CPU) against the single-process run of the same global batch.

Every parallel mode must reproduce the single-process loss sequence: the global batch of each step is
world * micro * accum sequences; rank r takes its own micro-batch rows of each micro-step, so the mean of the
ranks' mean losses is the single process's mean loss. Tolerance: fp32, 1e-5 relative on the losses (summation
order differs: all-reduce vs one large matmul); AdamW turns tiny gradient differences into small parameter
differences, so the bound is checked over a few steps only.
"""

from __future__ import annotations

import functools
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from zero2all.config import ModelConfig, OpsConfig, TrainConfig
from zero2all.model.z2all import build_model
from zero2all.train import distributed as zd

WORLD = 2
MICRO, ACCUM, SEQ, STEPS = 2, 2, 16, 4
LOSS_RTOL = 1e-5
LEAN_OPS = OpsConfig(rmsnorm="torch", rope="torch", swiglu="torch", cross_entropy="torch", attention="sdpa",
                     fused_linear="triton")


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=96, hidden_dim=48, intermediate_size=80, n_layers=3, n_heads=4, n_kv_heads=2,
                max_seq_len=SEQ, ops=OpsConfig.plain())
    base.update(kw)
    return ModelConfig(**base)


def global_batches(steps: int, world: int = WORLD, seed: int = 0) -> torch.Tensor:
    """(steps, world * MICRO * ACCUM, SEQ + 1) tokens: each step's global batch. Sequences follow
    t[i+1] = (5 t[i] + 3) mod 96 from a random start, so the loss falls within a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 96, (steps, world * MICRO * ACCUM, 1), generator=g)
    seq = [start]
    for _ in range(SEQ):
        seq.append((seq[-1] * 5 + 3) % 96)
    return torch.cat(seq, dim=-1)


def make_run(tc: TrainConfig, env: zd.DistEnv, model_kw: dict | None = None):
    model = build_model(tiny_cfg(**(model_kw or {})), seed=1234)
    model = zd.parallelize(model, tc, env)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    return model, zd.shard_optimizer(opt, tc, env)


def train_steps(model, opt, batches: torch.Tensor, env: zd.DistEnv, steps: range, world: int) -> list[float]:
    """The step loop under test: rank r's rows of micro-step a are [(a*world + r)*micro_rows, +micro_rows)."""
    micro_rows = MICRO * world // env.world_size
    losses = []
    for step in steps:
        batch = batches[step]
        total = 0.0
        for a in range(ACCUM):
            start = (a * env.world_size + env.rank) * micro_rows
            rows = batch[start:start + micro_rows]
            with zd.gradient_sync(model, enabled=a == ACCUM - 1):
                _, loss = model(rows[:, :-1], rows[:, 1:])
                (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        zd.clip_grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(zd.all_reduce_mean(total, env))
    return losses


@functools.lru_cache(maxsize=None)
def _reference(steps: int) -> tuple[float, ...]:
    env = zd.DistEnv()
    model, opt = make_run(TrainConfig(parallel="none"), env)
    return tuple(train_steps(model, opt, global_batches(steps), env, range(steps), WORLD))


def reference_losses(steps: int = STEPS) -> list[float]:
    """The single-process loss sequence of the same global batches (computed once per session)."""
    return list(_reference(steps))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, scenario: str, out: str, kwargs: dict):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    env = zd.init_distributed(device="cpu", timeout_s=kwargs.pop("timeout_s", 60.0))
    done = False
    try:
        result = SCENARIOS[scenario](env, Path(out), **kwargs)
        if env.rank == 0 and result is not None:
            (Path(out) / "result.json").write_text(json.dumps(result))
        torch.distributed.barrier()  # neither rank tears down gloo while the other still talks to it
        done = True
    finally:
        zd.destroy_distributed()
    if done:  # results written, both ranks past the barrier: leave without gloo's teardown (see finish_process)
        zd.finish_process(0)


def spawn(scenario: str, out: Path, **kwargs) -> dict:
    mp.spawn(_entry, args=(WORLD, free_port(), scenario, str(out), kwargs), nprocs=WORLD, join=True)
    return json.loads((out / "result.json").read_text())


# ------------------------------------------------------------------------------------------------------ scenarios


def scenario_modes(env, out, modes: list[dict]):
    """Train STEPS steps once per config in ``modes``; return each loss sequence."""
    results, reduce_scatters = [], []
    original = torch.distributed.reduce_scatter_single
    calls = [0]

    def counting(*args, **kwargs):  # FSDP2 reduce-scatters gradients through this function
        calls[0] += 1
        return original(*args, **kwargs)

    torch.distributed.reduce_scatter_single = counting
    for fields in modes:
        fields = dict(fields)
        model_kw = fields.pop("model", None)
        model, opt = make_run(TrainConfig(**fields), env, model_kw)
        calls[0] = 0
        results.append(train_steps(model, opt, global_batches(STEPS), env, range(STEPS), WORLD))
        reduce_scatters.append(calls[0])
        if fields.get("parallel") == "fsdp":  # parameters really are sharded across the two ranks
            w = zd.unwrap(model).layers[0].mlp.down_proj.weight
            assert type(w).__name__ == "DTensor" and w.to_local().shape[0] * env.world_size == w.shape[0]
    torch.distributed.reduce_scatter_single = original
    return {"losses": results, "reduce_scatters": reduce_scatters}


def scenario_save(env, out, jobs: list[dict]):
    """For each job: train to STEPS, saving a sharded checkpoint ``out/<name>/ckpt-<save_at>`` on the way."""
    results = {}
    for job in jobs:
        job = dict(job)
        name, save_at = job.pop("name"), job.pop("save_at")
        model, opt = make_run(TrainConfig(**job), env)
        batches = global_batches(STEPS)
        first = train_steps(model, opt, batches, env, range(save_at), WORLD)
        zd.save_sharded_checkpoint(out / name / f"ckpt-{save_at:06d}", model, opt, env, meta={"step": save_at},
                                   rank_state={"rank": env.rank})
        results[name] = first + train_steps(model, opt, batches, env, range(save_at, STEPS), WORLD)
    return results


def scenario_resume(env, out, jobs: list[dict]):
    """For each job: load ``ckpt`` into a fresh run of another config and train to STEPS."""
    results = {}
    for job in jobs:
        job = dict(job)
        name, ckpt = job.pop("name"), job.pop("ckpt")
        model, opt = make_run(TrainConfig(**job), env)
        meta, rank_state = zd.load_sharded_checkpoint(ckpt, model, opt, env)
        hook_restored = rank_state is not None and zd.comm_hook_state(model) is not None
        losses = train_steps(model, opt, global_batches(STEPS), env, range(meta["step"], STEPS), WORLD)
        results[name] = {"losses": losses, "rank_state": rank_state, "hook_restored": hook_restored}
    return results


def scenario_timeout(env, out):
    import time

    if env.rank == 1:
        time.sleep(6)  # never joins the all-reduce
        os._exit(0)
    try:
        with zd.collective_timeout(env, "the test all-reduce"):
            torch.distributed.all_reduce(torch.ones(1))
    except zd.DistributedTimeoutError as e:
        (out / "result.json").write_text(json.dumps({"error": str(e)}))
        os._exit(0)  # the group is broken; skip the destroy that would wait for rank 1
    return {"error": None}


SCENARIOS = {"modes": scenario_modes, "save": scenario_save, "resume": scenario_resume, "timeout": scenario_timeout}


# ---------------------------------------------------------------------------------------------------------- tests


def assert_same_losses(got, want, rtol=LOSS_RTOL, msg=""):
    assert len(got) == len(want), msg
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), f"{msg} step {step}: {g} vs single-process {w} ({got} vs {want})"


def test_loss_moves_in_reference():
    losses = reference_losses()
    assert losses[-1] < losses[0] - 0.05, losses  # the comparison below is meaningful only if training happens


def test_parallel_modes_match_single_process(tmp_path):
    want = reference_losses()
    modes = [dict(parallel="ddp"), dict(parallel="fsdp", reshard_after_forward=True),
             dict(parallel="fsdp", reshard_after_forward=False), dict(parallel="zero1"),
             dict(parallel="ddp", activation_checkpointing="full"),
             dict(parallel="fsdp", activation_checkpointing="selective", ac_selective="attention"),
             dict(parallel="fsdp", cpu_offload=True),
             dict(parallel="fsdp", fsdp_accum_no_sync=True),
             dict(parallel="fsdp", reshard_after_forward=False, fsdp_accum_no_sync=True),
             dict(parallel="ddp", comm_hook="fp16"),
             dict(parallel="ddp", comm_hook="powersgd", powersgd_start_iter=2, powersgd_rank=1),
             dict(parallel="fsdp", precision="bf16", fsdp_reduce_fp32=True),
             # the lean fused projections (Triton custom ops; the interpreter on CPU) under DDP and FSDP2
             dict(parallel="ddp", model=dict(ops=LEAN_OPS)),
             dict(parallel="fsdp", activation_checkpointing="selective", ac_selective="attention",
                  model=dict(ops=LEAN_OPS))]
    out = spawn("modes", tmp_path, modes=modes)
    got, reduce_scatters = out["losses"], out["reduce_scatters"]
    # FSDP reduce-scatters once per block group (3 blocks + root) per micro-step; with fsdp_accum_no_sync once
    # per update
    groups = 3 + 1
    assert reduce_scatters[1] == groups * ACCUM * STEPS and reduce_scatters[0] == 0  # fsdp / ddp
    assert reduce_scatters[7] == reduce_scatters[8] == groups * STEPS                  # fsdp_accum_no_sync
    for fields, losses in zip(modes[:9], got[:9]):
        assert_same_losses(losses, want, msg=str(fields))
    fp16, powersgd, bf16 = got[9], got[10], got[11]
    # FSDP's bf16 mixed-precision policy (bf16 compute, fp32 gradient reduction): within bf16 rounding
    assert_same_losses(bf16, want, rtol=1e-3)
    assert bf16 != want
    # fp16 gradients on the wire: the same within fp16 rounding (AdamW normalises it), but not bit-identical
    assert_same_losses(fp16, want, rtol=2e-3)
    assert fp16 != want
    # PowerSGD: exact for the first powersgd_start_iter steps (plain all-reduce), an approximation after
    assert_same_losses(powersgd[:2], want[:2])
    assert powersgd[2:] != want[2:] and abs(powersgd[-1] - want[-1]) < 0.05 * want[-1]
    # fused_linear computes the same float32 math as the plain ops, summed in another order
    for fields, losses in zip(modes[12:], got[12:]):
        assert_same_losses(losses, want, rtol=1e-4, msg=str(fields))


def test_sharded_checkpoint_2_to_1_and_export(tmp_path):
    want = reference_losses()
    saved = spawn("save", tmp_path, jobs=[dict(name="fsdp", parallel="fsdp", save_at=2)])["fsdp"]
    assert_same_losses(saved, want)
    ckpt = tmp_path / "fsdp" / "ckpt-000002"
    assert zd.latest_complete_checkpoint(tmp_path / "fsdp") == ckpt
    # one process, plain model: continues the 2-process sequence
    env = zd.DistEnv()
    model, opt = make_run(TrainConfig(parallel="none"), env)
    meta, rank_state = zd.load_sharded_checkpoint(ckpt, model, opt, env)
    assert meta["step"] == 2 and meta["world_size"] == 2 and rank_state is None  # world size changed
    resumed = train_steps(model, opt, global_batches(STEPS), env, range(2, STEPS), WORLD)
    assert_same_losses(resumed, saved[2:])
    # export the sharded step-2 weights to one HF directory: loads back to the same logits
    from zero2all.cli import main as cli_main
    from zero2all.model.io import load_model

    assert cli_main(["export-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    hf = tmp_path / "hf"
    assert (hf / "config.json").exists()
    step2, _ = make_run(TrainConfig(parallel="none"), env)
    zd.load_sharded_checkpoint(ckpt, step2, None, env)
    tokens = global_batches(1)[0, :2, :-1]
    with torch.no_grad():
        torch.testing.assert_close(load_model(hf)(tokens)[0], step2.eval()(tokens)[0], rtol=1e-5, atol=1e-5)


def test_sharded_checkpoint_1_to_2_into_zero1(tmp_path):
    want = reference_losses()
    env = zd.DistEnv()
    model, opt = make_run(TrainConfig(parallel="none"), env)
    first = train_steps(model, opt, global_batches(STEPS), env, range(2), WORLD)
    zd.save_sharded_checkpoint(tmp_path / "ckpt-000002", model, opt, env, meta={"step": 2})
    assert_same_losses(first, want[:2])
    got = spawn("resume", tmp_path, jobs=[dict(name="zero1", parallel="zero1", ckpt=str(tmp_path / "ckpt-000002"))])
    assert_same_losses(got["zero1"]["losses"], want[2:])


def test_zero1_into_fsdp_and_powersgd_state_survive_resume(tmp_path):
    """ZeRO-1 writes each rank's optimizer partition; FSDP reads them back as shards of other shapes. PowerSGD's
    per-rank error feedback and warm-start matrices are restored: the resumed run is bit-identical."""
    want = reference_losses()
    hook = dict(comm_hook="powersgd", powersgd_start_iter=2, powersgd_rank=1)
    saved = spawn("save", tmp_path, jobs=[dict(name="zero1", parallel="zero1", save_at=2),
                                          dict(name="powersgd", parallel="ddp", save_at=3, **hook)])
    got = spawn("resume", tmp_path, jobs=[
        dict(name="fsdp", parallel="fsdp", ckpt=str(tmp_path / "zero1" / "ckpt-000002")),
        dict(name="powersgd", parallel="ddp", ckpt=str(tmp_path / "powersgd" / "ckpt-000003"), **hook)])
    assert_same_losses(got["fsdp"]["losses"], want[2:])
    assert got["fsdp"]["rank_state"] == {"rank": 0}  # same world size: each rank gets its own state back
    assert got["powersgd"]["hook_restored"]
    assert got["powersgd"]["losses"] == saved["powersgd"][3:]


def test_collective_timeout_has_a_clear_message(tmp_path):
    got = spawn("timeout", tmp_path, timeout_s=2.0)
    assert got["error"] and "train.dist_timeout_s=2s" in got["error"] and "rank 0/2" in got["error"]


def test_config_errors_name_the_field():
    env = zd.DistEnv()
    with pytest.raises(ValueError, match="train.parallel"):
        zd.validate_parallel_config(TrainConfig(parallel="tp"), env)
    with pytest.raises(ValueError, match="torchrun"):
        zd.validate_parallel_config(TrainConfig(parallel="fsdp"), env)
    with pytest.raises(ValueError, match="train.comm_hook"):
        zd.validate_parallel_config(TrainConfig(comm_hook="fp8"), env)
    with pytest.raises(ValueError, match="train.cpu_offload"):
        zd.validate_parallel_config(TrainConfig(cpu_offload=True), env)
    with pytest.raises(ValueError, match="train.ac_every"):
        zd.validate_parallel_config(TrainConfig(activation_checkpointing="selective", ac_every=0), env)
    assert zd.validate_parallel_config(TrainConfig(), env) == "none"
    assert zd.resolve_parallel("auto", zd.DistEnv(world_size=2)) == "ddp"


def test_data_state_moves_between_world_sizes():
    synthetic = {"kind": "synthetic", "seed": 1, "next_sample": 12}
    assert zd.rescale_data_state(synthetic, {}, 2, 1)["next_sample"] == 24   # global position 24 kept
    assert zd.rescale_data_state(synthetic, {}, 2, 4)["next_sample"] == 6
    with pytest.raises(ValueError, match="cannot be split"):
        zd.rescale_data_state({"next_sample": 3}, {}, 1, 2)
    packed = {"epoch": 2, "position": 10, "world_size": 2, "num_windows": 50, "rank": 0}
    moved = zd.rescale_data_state(packed, {"world_size": 1, "num_windows": 100, "rank": 0}, 2, 1)
    assert moved == {"epoch": 2, "position": 20, "world_size": 1, "num_windows": 100, "rank": 0}
    assert zd.rescale_data_state(packed, {}, 2, 2) is packed
    with pytest.raises(ValueError, match="cannot move"):
        zd.rescale_data_state({"cursor": 1}, {}, 2, 1)


def test_resume_with_another_world_size_needs_the_same_global_batch():
    from zero2all.config import load_config
    from zero2all.train.checkpoint import CheckpointMismatch, check_compatible
    from zero2all.config import to_dict

    saved = to_dict(load_config("tiny", ["train.micro_batch_size=2", "train.grad_accum_steps=2"]))
    same_batch = load_config("tiny", ["train.micro_batch_size=4", "train.grad_accum_steps=2"])
    check_compatible("ckpt", saved, same_batch, 256, world_size=1, saved_world_size=2,
                     saved_tokenizer_hash=None, tokenizer_hash=None)  # 2 x 2 x 2 == 4 x 2 x 1
    other_batch = load_config("tiny", ["train.micro_batch_size=2", "train.grad_accum_steps=2"])
    with pytest.raises(CheckpointMismatch, match=r"global batch: 8 sequences per update .* 4 now"):
        check_compatible("ckpt", saved, other_batch, 256, world_size=1, saved_world_size=2,
                         saved_tokenizer_hash=None, tokenizer_hash=None)
