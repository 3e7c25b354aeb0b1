"""Tensor, sequence and context parallelism on a device mesh (gloo, CPU, float64) against the single-process run
of the same global batches, and checkpoints moving between meshes.

A step's global batch is DP * MICRO * ACCUM sequences whatever tp / cp are: data-parallel rank d reads rows
[(a * DP + d) * MICRO, + MICRO) of micro-step a; its tp and cp ranks read the same rows. The single process runs
MICRO * DP rows per micro-step. Every run is float64 and is compared per step on the loss and the gradient norm,
and at the end on every parameter (gathered as the HF export gathers them: the canonical fused layout), within
tests/equivalence.py's bound.

Launches: one 2-process launch (tp2, tp2 + SP, tp2 + SP in two groups of sequences (``tp_chunks``) with the
fused vocab-parallel cross-entropy, tp2 + SP with ``tp_impl = dtensor``, cp2, and a resume of a one-process
checkpoint on tp2) and one 4-process launch (tp2 x dp_replicate2 (HSDP), dp_shard2 x tp2 + SP (FSDP2, fused
vocab-parallel cross-entropy), cp2 x tp2 + SP, saving a checkpoint that one process then resumes). Without
``tp_impl`` the default (``local``) runs.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from equivalence import Run, assert_equivalent

from tests import cpu_ring_attention
from tests.test_distributed import free_port, gloo_worker
from zero2all import checkpoint as ckpt
from zero2all import distributed as zd
from zero2all.config import ConfigError, ModelConfig, OpsConfig, ParallelConfig, TrainConfig, to_dict
from zero2all.distributed.tp import regions_of
from zero2all.model.z2all import build_model
from zero2all.train.optim import grad_norm_and_clip

DP = 2                      # data-parallel replicas of the global batch (the single process runs all of them)
MICRO, ACCUM, SEQ, STEPS, SAVE_AT = 2, 2, 16, 6, 3


def tiny_cfg() -> ModelConfig:
    """The smallest model with every path: GQA (4 heads, 2 KV heads), two blocks, vocab and MLP divisible by 2."""
    return ModelConfig(vocab_size=96, hidden_dim=32, intermediate_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=SEQ, ops=OpsConfig.plain())


def global_batches(steps: int = STEPS, seed: int = 0) -> torch.Tensor:
    """(steps, DP * MICRO * ACCUM, SEQ + 1): sequences t[i+1] = (5 t[i] + 3) mod 96, learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    seq = [torch.randint(0, 96, (steps, DP * MICRO * ACCUM, 1), generator=g)]
    for _ in range(SEQ):
        seq.append((seq[-1] * 5 + 3) % 96)
    return torch.cat(seq, dim=-1)


def make_run(fields: dict, env: zd.DistEnv):
    fields = dict(fields)
    cfg = tiny_cfg()
    cfg.ops.cross_entropy = fields.pop("cross_entropy", cfg.ops.cross_entropy)  # fused: vocab-parallel under tp
    pc = ParallelConfig(**fields)
    run = zd.parallelize(build_model(cfg, seed=1234, dtype=torch.float64), pc, env, precision="fp64")
    # foreach: the multi-tensor kernels that GPUs run (mixing DTensor shards and plain tensors)
    opt = torch.optim.AdamW(run.model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    return run, opt


def train_steps(run, opt, env, steps: range) -> dict:
    """The step loop under test: this data-parallel rank's rows of each micro-step, forward + backward inside the
    run's train context (loss parallel, ring attention), the loss averaged over dp x cp. Returns each step's loss
    and gradient norm (before clipping)."""
    batches = global_batches()
    dp_rank, dp_size = run.dims.dp_rank, run.dims.dp_size
    rows_per_rank = MICRO * DP // dp_size
    losses, norms = [], []
    for step in steps:
        total = 0.0
        for a in range(ACCUM):
            start = (a * dp_size + dp_rank) * rows_per_rank
            rows = batches[step, start:start + rows_per_rank]
            batch = {"input_ids": rows[:, :-1].clone(), "labels": rows[:, 1:].clone()}
            with run.gradient_sync(a == ACCUM - 1), run.train_context(batch):
                _, loss = run.model(batch["input_ids"], batch["labels"])
                (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        norms.append(float(grad_norm_and_clip(list(run.model.parameters()), 1.0)))
        with run.optimizer_context():
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(run.dims.reduce_mean(total))
    return {"losses": losses, "norms": norms}


def parts(run, opt, step: list) -> dict:
    return {"model": ckpt.ModelState(run.plain, run.fused_rows),
            "optim": ckpt.OptimizerState(run.plain, opt, run.fused_rows),
            "trainer": ckpt.JsonState(lambda: {"step": step[0]}, lambda s: step.__setitem__(0, s["step"]))}


def save(run, opt, env, path: Path, step: int) -> None:
    ckpt.save(path, parts(run, opt, [step]), env, {"step": step, "model": to_dict(run.plain.cfg)})


def resume(run, opt, env, path: Path) -> int:
    step = [0]
    ckpt.load(path, parts(run, opt, step), env)
    return step[0]


def final_params(run) -> dict | None:
    """Every parameter gathered on rank 0 in the canonical layout (the HF-export path), None elsewhere."""
    sd = run.full_state_dict()
    return None if sd is None else {k: v.detach().cpu().clone() for k, v in sd.items()}


@functools.lru_cache(maxsize=None)
def _reference() -> Run:
    """The single-process run of STEPS steps."""
    env = zd.DistEnv()
    run, opt = make_run({}, env)
    got = train_steps(run, opt, env, range(STEPS))
    return Run(got["losses"], got["norms"], final_params(run))


def reference(first: int = 0) -> Run:
    r = _reference()
    return Run(r.losses[first:], r.grad_norms[first:], r.params)


# ------------------------------------------------------------------------------------------------ the workers


def worker_cases(env, out: Path, cases: list[dict]) -> dict:
    """Each case: fields of ParallelConfig, plus ``save`` (write ckpt at SAVE_AT) or ``resume`` (a checkpoint).
    Returns each case's losses and gradient norms; its final parameters go to out/<name>.pt."""
    results = {}
    for case in cases:
        case = dict(case)
        name, save_dir, resume_from = case.pop("name"), case.pop("save", None), case.pop("resume", None)
        run, opt = make_run(case, env)
        start = resume(run, opt, env, Path(resume_from)) if resume_from else 0
        if save_dir:
            first = train_steps(run, opt, env, range(SAVE_AT))
            save(run, opt, env, Path(save_dir), SAVE_AT)
            rest = train_steps(run, opt, env, range(SAVE_AT, STEPS))
            results[name] = {k: first[k] + rest[k] for k in first}
        else:
            results[name] = train_steps(run, opt, env, range(start, STEPS))
        params = final_params(run)  # the HF-export path (a collective): canonical fused layout again
        if params is not None:
            torch.save(params, out / f"{name}.pt")
        if name.startswith("tp2"):  # the implementation asked for runs (local: our blocks on local shards)
            regions = regions_of(run.plain.layers[0])
            assert (regions is None) == (case.get("tp_impl") == "dtensor"), name
            if case.get("tp_chunks"):  # 4 rows per micro-step, 2 per rank: two groups of one sequence
                assert regions.groups(torch.empty(2 * SEQ, 1), SEQ, per_row=False) == 2
        if name == "tp2":  # really sharded: half the heads and half the vocabulary per rank
            attn = run.plain.layers[0].self_attn
            assert attn.qkv_proj.weight.to_local().shape[0] * 2 == attn.qkv_proj.weight.shape[0]
            assert run.plain.lm_head.weight.to_local().shape[0] == 48
    return results


def _entry(rank: int, world: int, port: int, out: str, cases: list[dict]):
    cpu_ring_attention.register()
    gloo_worker(rank, world, port, out, lambda env: worker_cases(env, Path(out), cases), timeout_s=120.0)


def launch(world: int, out: Path, cases: list[dict]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_entry, args=(world, free_port(), str(out), cases), nprocs=world, join=True)
    return json.loads((out / "result.json").read_text())


def result(got: dict, out: Path, name: str) -> Run:
    return Run(got[name]["losses"], got[name]["norms"], torch.load(out / f"{name}.pt"))


# ---------------------------------------------------------------------------------------------------- the tests


def test_mesh_runs_match_single_process_and_resume_across_meshes(tmp_path):
    want = reference()
    assert want.losses[-1] < want.losses[0] - 0.3, want.losses  # training happens: the comparison means something

    # one process saves at SAVE_AT; tp2 resumes it below
    env = zd.DistEnv()
    run, opt = make_run({}, env)
    train_steps(run, opt, env, range(SAVE_AT))
    save(run, opt, env, tmp_path / "single", SAVE_AT)

    w2 = tmp_path / "w2"
    two = launch(2, w2, [
        {"name": "tp2", "tp": 2},
        {"name": "tp2_sp", "tp": 2, "sequence_parallel": True},
        {"name": "tp2_sp_chunks2_fused_ce", "tp": 2, "sequence_parallel": True, "tp_chunks": 2,
         "cross_entropy": "fused"},
        {"name": "tp2_sp_dtensor", "tp": 2, "sequence_parallel": True, "tp_impl": "dtensor"},
        {"name": "cp2", "cp": 2},
        {"name": "tp2_from_single", "tp": 2, "resume": str(tmp_path / "single")},
    ])
    for name in ("tp2", "tp2_sp", "tp2_sp_chunks2_fused_ce", "tp2_sp_dtensor", "cp2"):
        assert_equivalent(result(two, w2, name), want, name)
    assert_equivalent(result(two, w2, "tp2_from_single"), reference(SAVE_AT), "one process -> tp2")

    w4 = tmp_path / "w4"
    four = launch(4, w4, [
        {"name": "tp2_dp2", "tp": 2, "dp_replicate": 2},
        {"name": "fsdp2_tp2_sp", "tp": 2, "dp_shard": 2, "sequence_parallel": True, "cross_entropy": "fused",
         "activation_checkpointing": "full", "save": str(tmp_path / "mesh4")},
        {"name": "cp2_tp2_sp", "cp": 2, "tp": 2, "sequence_parallel": True},
    ])
    for name in ("tp2_dp2", "fsdp2_tp2_sp", "cp2_tp2_sp"):
        assert_equivalent(result(four, w4, name), want, name)

    # fsdp2 x tp2 (rank-major fused rows, 2-D shards) -> one process: the canonical layout came back
    run, opt = make_run({}, env)
    step = resume(run, opt, env, tmp_path / "mesh4")
    assert step == SAVE_AT
    resumed = train_steps(run, opt, env, range(SAVE_AT, STEPS))
    assert_equivalent(Run(resumed["losses"], resumed["norms"], final_params(run)), reference(SAVE_AT),
                      "fsdp2 x tp2 -> one process")


def test_impossible_meshes_are_refused_with_the_numbers():
    m, t = tiny_cfg(), TrainConfig(micro_batch_size=4)
    cases = [(dict(tp=4), 4, "n_kv_heads=2"), (dict(tp=2), 3, "does not divide the 3 processes"),
             (dict(cp=3), 3, "2 \\* cp = 6"), (dict(pp=4), 4, "model.n_layers=2"),
             (dict(pp=2, pp_microbatches=3), 2, "does not divide train.micro_batch_size=4"),
             (dict(pp=2, pp_microbatches=1), 2, "fewer than the 2 pipeline stages"),
             (dict(tp=2, dp_shard=3), 4, "= 6, but 4 processes run")]
    from zero2all.distributed.plan import PlanRefusal, resolve, sections

    def plan(pc, world):
        parts = sections(m, pc)
        parts.train = t
        return resolve(parts, world)

    for fields, world, msg in cases:
        with pytest.raises(PlanRefusal, match=msg):
            plan(ParallelConfig(**fields), world)
    with pytest.raises(PlanRefusal, match="plain data parallelism"):
        plan(ParallelConfig(mode="ddp", tp=2), 2)
    with pytest.raises(PlanRefusal, match="sequence_parallel"):
        plan(ParallelConfig(sequence_parallel=True), 1)
    assert plan(ParallelConfig(tp=2, cp=2), 8).shape["dp_shard"] == 2
    from zero2all.config import load_config

    with pytest.raises(PlanRefusal, match="document_mask"):
        resolve(load_config("tiny", ["parallel.cp=2", "data.document_mask=true"]), 2)
    with pytest.raises(PlanRefusal, match="ops.attention='flex'"):
        resolve(sections(ModelConfig(**{**tiny_cfg().__dict__, "ops": OpsConfig(attention="flex")}),
                         ParallelConfig(cp=2)), 2)
    assert plan(ParallelConfig(tp=2, cp=2), 8).dp_coords(5) == (1, 2)  # row-major: rank 5 = dp 1, cp 0, tp 1
    assert plan(ParallelConfig(), 8).dp_coords(5) == (5, 8)
    assert zd.data_parallel_rank(ParallelConfig(tp=2, cp=2), 5, 8) == (1, 2)


def test_estimate_splits_the_mesh_dimensions():
    from zero2all.accounting import Layout, context_parallel_comm_bytes, estimate
    from zero2all.config import load_model_config

    cfg = load_model_config("z2all-1.1b")
    # ring attention: 3 passes (K/V forward, K/V + dK/dV backward) of (cp-1)/cp of b*s*2*kv*e per layer
    kv = 2 * cfg.n_kv_heads * cfg.head_dim
    assert context_parallel_comm_bytes(cfg, 1, 65536, 2) == cfg.n_layers * 3 * 0.5 * 65536 * kv * 2
    assert context_parallel_comm_bytes(cfg, 1, 65536, 1) == 0.0
    one = estimate(cfg, Layout(gpus=2, seq_len=8192, zero=3))
    cp2 = estimate(cfg, Layout(gpus=2, seq_len=8192, zero=3, cp=2))
    assert cp2["layout"]["dp"] == 1 and one["layout"]["dp"] == 2
    # half the tokens of each sequence per GPU: half the activations; FSDP still shards over both GPUs
    assert abs(cp2["memory_per_gpu"]["activations"] * 2 - one["memory_per_gpu"]["activations"]) < 1.0
    assert cp2["memory_per_gpu"]["weights"] == one["memory_per_gpu"]["weights"]
    assert cp2["communication"]["context_parallel_bytes_per_step"] > 0
    with pytest.raises(ConfigError, match="--cp"):
        estimate(cfg, Layout(gpus=3, cp=2))


def test_fused_rows_rank_major_layout():
    from zero2all.distributed.tp import FusedRows

    rows = FusedRows((8, 4, 4), 2)                     # q of 8 rows, k and v of 4, over 2 ranks
    canonical = torch.arange(16)
    rank_major = rows.to_rank_major(canonical)
    # rank 0's Shard(0) block: its q half, its k half, its v half; rank 1's the other halves
    assert rank_major.tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]
    assert torch.equal(rows.to_canonical(rank_major), canonical)
    w = torch.randn(12, 3)
    assert torch.equal(FusedRows((6, 6), 3).to_canonical(FusedRows((6, 6), 3).to_rank_major(w)), w)
