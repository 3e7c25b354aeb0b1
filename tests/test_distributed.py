"""Data-parallel training on 2 (and 4) gloo processes (CPU) against the single-process run of the same global batch,
and the one checkpoint format across world sizes and parallelism kinds.

Every parallel mode must reproduce the single-process run: the global batch of each step is world * micro * accum
sequences; rank r takes its own micro-batch rows of each micro-step, so the mean of the ranks' mean losses is the
single process's mean loss. The runs are float64 (``precision = "fp64"``: the model's parameters, activations and
optimizer state) and compared per step on the loss and the gradient norm, and at the end on every parameter,
within tests/equivalence.py's bound. Runs whose path is precision-specific (a bf16 FSDP policy, fp16 / PowerSGD
gradient compression, the Triton fused projections) keep their own dtype and bounds measured for them.
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
from equivalence import RTOL, Run, assert_equivalent

from zero2all import checkpoint as ckpt
from zero2all import distributed as zd
from zero2all.config import ModelConfig, OpsConfig, ParallelConfig
from zero2all.model.z2all import build_model

WORLD = 2
MICRO, ACCUM, SEQ, STEPS = 2, 2, 16, 4
LOSS_RTOL = RTOL
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


def make_run(fields: dict, env: zd.DistEnv, model_kw: dict | None = None):
    """(Parallelized, optimizer) for ``fields``: ParallelConfig fields, ``parallel`` naming the mode, and
    ``precision`` (fp64 by default: the model in float64, as the trainer makes it)."""
    fields = dict(fields)
    precision = fields.pop("precision", "fp64")
    pc = ParallelConfig(mode=fields.pop("parallel", "none"), **fields)
    model = build_model(tiny_cfg(**(model_kw or {})), seed=1234, dtype=torch.float64 if precision == "fp64" else None)
    run = zd.parallelize(model, pc, env, precision=precision, seed=1337)
    opt = run.shard_optimizer(torch.optim.AdamW(run.model.parameters(), lr=3e-3, weight_decay=0.1,
                                                betas=(0.9, 0.95)))
    model.numerics.attach(opt)          # as the trainer does: the model's kept casts dropped after each step
    return run, opt


def checkpoint_parts(run, opt, env, step: list, saved_world: int | None = None, rank_box: list | None = None,
                     hook: bool = False) -> dict:
    """The trainer's checkpoint parts for the bare loop: model, optimizer, the step, each rank's own state, and
    PowerSGD's state when ``hook``."""
    saved_world = saved_world or env.world_size
    box = rank_box if rank_box is not None else []
    parts = {"model": ckpt.ModelState(run.plain), "optim": ckpt.OptimizerState(run.plain, zd.local_optimizer(opt)),
             "trainer": ckpt.JsonState(lambda: {"step": step[0]}, lambda s: step.__setitem__(0, s["step"])),
             "own": ckpt.RankStates(env.rank, lambda: {"rank": env.rank},
                                    box.append, saved_world)}
    if hook:
        h = run.comm_hook
        parts["comm_hook"] = ckpt.RankStates(env.rank, h.state_dict, lambda states: box.append(
            h.load_state_dict(states[env.rank])), saved_world, binary=True)
    return parts


def save(run, opt, env, path: Path, step: int, hook: bool = False) -> None:
    from zero2all.config import to_dict

    ckpt.save(path, checkpoint_parts(run, opt, env, [step], hook=hook), env,
              {"step": step, "model": to_dict(run.plain.cfg)})


def load(run, opt, env, path: Path, hook: bool = False) -> tuple[int, list]:
    """Load ``path`` into (run, opt); returns (step, what the RankStates parts received)."""
    meta = ckpt.read_meta(path)
    step, box = [0], []
    ckpt.load(path, checkpoint_parts(run, opt, env, step, meta["world_size"], box, hook), env)
    return step[0], box


def train_steps(run, opt, batches: torch.Tensor, env: zd.DistEnv, steps: range, world: int) -> dict:
    """The step loop under test: rank r's rows of micro-step a are [(a*world + r)*micro_rows, +micro_rows).
    Returns {"losses": [...], "norms": [...]} (the gradient norm before clipping) of each step."""
    micro_rows = MICRO * world // env.world_size
    losses, norms = [], []
    for step in steps:
        batch = batches[step]
        total = 0.0
        for a in range(ACCUM):
            start = (a * env.world_size + env.rank) * micro_rows
            rows = batch[start:start + micro_rows]
            with run.gradient_sync(a == ACCUM - 1):
                _, loss = run.model(rows[:, :-1], rows[:, 1:])
                (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        norms.append(float(zd.clip_grad_norm(run.model, 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(zd.all_reduce_mean(total, env))
    return {"losses": losses, "norms": norms}


def joined(*parts: dict) -> dict:
    return {k: [v for p in parts for v in p[k]] for k in ("losses", "norms")}


def final_params(run) -> dict | None:
    """The whole model's weights on rank 0 (gathered under FSDP / ZeRO-1 / DDP alike), None elsewhere."""
    sd = run.full_state_dict()
    return None if sd is None else {k: v.detach().cpu().clone() for k, v in sd.items()}


def save_params(run, path: Path) -> None:
    params = final_params(run)
    if params is not None:
        torch.save(params, path)


def as_run(result: dict, params_path: Path | None = None, first: int = 0) -> Run:
    """A :class:`equivalence.Run` from a step loop's result (from step ``first`` on) and saved parameters."""
    params = torch.load(params_path) if params_path is not None else {}
    return Run(result["losses"][first:], result["norms"][first:], params)


@functools.lru_cache(maxsize=None)
def _reference(steps: int, precision: str = "fp64") -> Run:
    env = zd.DistEnv()
    run, opt = make_run({"precision": precision}, env)
    got = train_steps(run, opt, global_batches(steps), env, range(steps), WORLD)
    return Run(got["losses"], got["norms"], final_params(run))


def reference(steps: int = STEPS, precision: str = "fp64", first: int = 0) -> Run:
    """The single-process run of the same global batches (computed once per session), from step ``first`` on."""
    r = _reference(steps, precision)
    return Run(r.losses[first:], r.grad_norms[first:], r.params)


def reference_losses(steps: int = STEPS) -> list[float]:
    return reference(steps).losses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_worker(rank: int, world: int, port: int, out: str, work, timeout_s: float = 60.0) -> None:
    """The body of one process spawned by a test: torchrun's environment, a gloo group, ``work(env)`` (what it
    returns on rank 0, unless None, goes to ``out/result.json``), then a clean exit."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    env = zd.init_distributed(device="cpu", timeout_s=timeout_s)
    done = False
    try:
        result = work(env)
        if env.rank == 0 and result is not None:
            (Path(out) / "result.json").write_text(json.dumps(result))
        torch.distributed.barrier()  # neither rank tears down gloo while the other still talks to it
        done = True
    finally:
        zd.destroy_distributed()
    if done:  # results written, both ranks past the barrier: leave without gloo's teardown (see finish_process)
        zd.finish_process(0)


def _entry(rank: int, world: int, port: int, scenario: str, out: str, kwargs: dict):
    timeout_s = kwargs.pop("timeout_s", 60.0)
    gloo_worker(rank, world, port, out, lambda env: SCENARIOS[scenario](env, Path(out), **kwargs), timeout_s)


def spawn(scenario: str, out: Path, world: int = WORLD, **kwargs) -> dict:
    mp.spawn(_entry, args=(world, free_port(), scenario, str(out), kwargs), nprocs=world, join=True)
    return json.loads((out / "result.json").read_text())


# ------------------------------------------------------------------------------------------------------ scenarios


def scenario_modes(env, out, modes: list[dict]):
    """Train STEPS steps once per config in ``modes``; return each one's losses and gradient norms (the final
    parameters go to out/params<i>.pt)."""
    results, reduce_scatters = [], []
    original = torch.distributed.reduce_scatter_single
    calls = [0]

    def counting(*args, **kwargs):  # FSDP2 reduce-scatters gradients through this function
        calls[0] += 1
        return original(*args, **kwargs)

    torch.distributed.reduce_scatter_single = counting
    for i, fields in enumerate(modes):
        fields = dict(fields)
        model_kw = fields.pop("model", None)
        run, opt = make_run(fields, env, model_kw)
        calls[0] = 0
        results.append(train_steps(run, opt, global_batches(STEPS), env, range(STEPS), WORLD))
        reduce_scatters.append(calls[0])
        save_params(run, out / f"params{i}.pt")
        if fields.get("parallel") == "fsdp":  # parameters really are sharded across the two ranks
            w = run.plain.layers[0].mlp.down_proj.weight
            assert type(w).__name__ == "DTensor" and w.to_local().shape[0] * env.world_size == w.shape[0]
    torch.distributed.reduce_scatter_single = original
    return {"losses": results, "reduce_scatters": reduce_scatters}


def scenario_save(env, out, jobs: list[dict]):
    """For each job: train to STEPS, saving ``out/<name>/ckpt-<save_at>`` on the way."""
    results = {}
    for job in jobs:
        job = dict(job)
        name, save_at = job.pop("name"), job.pop("save_at")
        hook = job.get("comm_hook") == "powersgd"
        run, opt = make_run(job, env)
        batches = global_batches(STEPS)
        first = train_steps(run, opt, batches, env, range(save_at), WORLD)
        save(run, opt, env, out / name / ckpt.checkpoint_name(save_at), save_at, hook=hook)
        results[name] = joined(first, train_steps(run, opt, batches, env, range(save_at, STEPS), WORLD))
        save_params(run, out / name / "params.pt")
    return results


def scenario_resume(env, out, jobs: list[dict]):
    """For each job: load ``ckpt`` into a fresh run of another config (maybe another world size) and train to
    STEPS."""
    results = {}
    for job in jobs:
        job = dict(job)
        name, path = job.pop("name"), Path(job.pop("ckpt"))
        hook = job.get("comm_hook") == "powersgd"
        run, opt = make_run(job, env)
        step, received = load(run, opt, env, path, hook=hook)
        results[name] = {**train_steps(run, opt, global_batches(STEPS), env, range(step, STEPS), WORLD),
                         "received": received}
        save_params(run, out / f"{name}_params.pt")
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
    from equivalence import differences, rel
    from equivalence import log_measured as measured

    want = reference()
    exact = [dict(parallel="ddp"), dict(parallel="fsdp", reshard_after_forward=True),
             dict(parallel="fsdp", reshard_after_forward=False), dict(parallel="zero1"),
             dict(parallel="ddp", activation_checkpointing="full"),
             dict(parallel="fsdp", activation_checkpointing="selective", ac_selective="attention"),
             dict(parallel="fsdp", cpu_offload=True),
             dict(parallel="fsdp", fsdp_accum_no_sync=True),
             dict(parallel="fsdp", reshard_after_forward=False, fsdp_accum_no_sync=True)]
    specific = [dict(parallel="ddp", comm_hook="fp16"),
                dict(parallel="ddp", comm_hook="powersgd", powersgd_start_iter=2, powersgd_rank=1),
                dict(parallel="fsdp", precision="bf16", fsdp_reduce_fp32=True),
                # the lean fused projections (Triton custom ops; the interpreter on CPU) under DDP and FSDP2, in
                # float32 (float64 takes the plain reference instead of the kernels)
                dict(parallel="ddp", precision="fp32", model=dict(ops=LEAN_OPS)),
                dict(parallel="fsdp", precision="fp32", activation_checkpointing="selective",
                     ac_selective="attention", model=dict(ops=LEAN_OPS))]
    modes = exact + specific
    out = spawn("modes", tmp_path, modes=modes)
    got = [as_run(r, tmp_path / f"params{i}.pt") for i, r in enumerate(out["losses"])]
    reduce_scatters = out["reduce_scatters"]
    # FSDP reduce-scatters once per block group (3 blocks + root) per micro-step; with fsdp_accum_no_sync once
    # per update
    groups = 3 + 1
    assert reduce_scatters[1] == groups * ACCUM * STEPS and reduce_scatters[0] == 0  # fsdp / ddp
    assert reduce_scatters[7] == reduce_scatters[8] == groups * STEPS                  # fsdp_accum_no_sync
    for fields, run in zip(exact, got):
        assert_equivalent(run, want, str(fields))
    ddp = got[0]
    fp16, powersgd, bf16 = got[len(exact):len(exact) + 3]
    # fp16 gradients on the wire: the plain DDP run within fp16 rounding (measured: losses 6e-6, gradient norms
    # 7.9e-5), and visibly not it (the hook acted: a plain all-reduce differs by ~1e-16)
    d = measured("ddp fp16 hook vs ddp", differences(fp16, ddp))
    assert 1e-7 < d["grad_norm"] <= 1e-3 and d["loss"] <= 5e-4, d
    # PowerSGD: the plain all-reduce for the first powersgd_start_iter steps, a rank-1 approximation after
    assert_equivalent(Run(powersgd.losses[:2], powersgd.grad_norms[:2]), Run(ddp.losses[:2], ddp.grad_norms[:2]),
                      "ddp powersgd, first 2 steps", params=False)
    later = measured("ddp powersgd vs ddp, steps 3-4", {"loss": max(map(rel, powersgd.losses[2:], ddp.losses[2:])),
                                                        "grad_norm": max(map(rel, powersgd.grad_norms[2:],
                                                                             ddp.grad_norms[2:]))})
    # measured: losses 1.4e-2, gradient norms 0.66 from the plain all-reduce's
    assert later["grad_norm"] > 1e-2 and abs(powersgd.losses[-1] - ddp.losses[-1]) < 0.05 * ddp.losses[-1], later
    # FSDP's bf16 mixed-precision policy (bf16 compute, fp32 gradient reduction) against the float64 run: measured
    # losses 1.4e-4, gradient norms 2.5e-3 (the parameters, 0.18 of a tensor's largest element after AdamW's
    # normalised updates of bf16-rounded near-zero gradients, say nothing at this precision)
    d = measured("fsdp bf16 policy vs one process fp64", differences(bf16, want))
    assert 1e-5 < d["loss"] <= 1e-2 and d["grad_norm"] <= 0.1, d
    # fused_linear computes the same float32 math as the plain ops, summed in another order: measured losses
    # 5.2e-8, gradient norms 9.8e-8, parameters 4.7e-5 (AdamW's normalised updates of near-zero gradients)
    want32 = reference(precision="fp32")
    for fields, run in zip(specific[3:], got[len(exact) + 3:]):
        d = measured(f"{fields} vs one process fp32", differences(run, want32))
        assert d["loss"] <= 5e-6 and d["grad_norm"] <= 5e-6 and d["params"] <= 1e-3, (fields, d)


SAVED_ON_TWO = [dict(name="ddp", parallel="ddp", save_at=2),
                dict(name="fsdp", parallel="fsdp", reshard_after_forward=True, save_at=2),
                dict(name="fsdp_zero2", parallel="fsdp", reshard_after_forward=False, save_at=2),
                dict(name="zero1", parallel="zero1", save_at=2)]


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    """Every data-parallel kind trained on 2 processes, each saving a checkpoint at step 2 (one spawn)."""
    out = tmp_path_factory.mktemp("saved_on_two")
    return out, spawn("save", out, jobs=SAVED_ON_TWO)


def test_every_kind_saved_on_two_resumes_on_one_process(saved_on_two, tmp_path):
    """N=2 -> M=1, and DDP / FSDP2 (both reshard modes) / ZeRO-1 -> no wrapping at all: the resumed run is the
    single-process run (losses, gradient norms, final parameters)."""
    want = reference()
    out, saved = saved_on_two
    env = zd.DistEnv()
    for job in SAVED_ON_TWO:
        name = job["name"]
        assert_equivalent(as_run(saved[name], out / name / "params.pt"), want, name)
        path = out / name / "ckpt-000002"
        assert ckpt.verify(path) == [] and ckpt.read_meta(path)["world_size"] == 2
        run, opt = make_run({}, env)
        step, received = load(run, opt, env, path)
        assert step == 2 and received == [[{"rank": 0}, {"rank": 1}]]  # every old rank's own state is handed over
        resumed = train_steps(run, opt, global_batches(STEPS), env, range(2, STEPS), WORLD)
        assert_equivalent(Run(resumed["losses"], resumed["norms"], final_params(run)), reference(first=2),
                          f"{name}(2) -> one process")
    # the FSDP-sharded step-2 weights exported to one HF directory load back to the same logits
    from zero2all.cli import main as cli_main
    from zero2all.model.io import load_model

    path = out / "fsdp" / "ckpt-000002"
    assert cli_main(["export-hf", "--ckpt", str(path), "--out", str(tmp_path / "hf")]) == 0
    step2, _ = make_run({}, env)
    load(step2, torch.optim.AdamW(step2.model.parameters()), env, path)
    tokens = global_batches(1)[0, :2, :-1]
    with torch.no_grad():
        want_logits = step2.plain.eval()(tokens)[0]
        # float32 files (HF export; the one loader's float32 model) of the float64 weights: float32 rounding
        torch.testing.assert_close(load_model(tmp_path / "hf")(tokens)[0].double(), want_logits, rtol=1e-5,
                                   atol=1e-5)
        loaded = load_model(path).state_dict()   # the one loader reads the sharded checkpoint whole
        for name, w in step2.plain.state_dict().items():
            torch.testing.assert_close(loaded[name], w.float(), rtol=0, atol=0, msg=name)


def test_saved_on_two_resumes_on_four_with_another_kind(saved_on_two):
    """N=2 -> M=4: DDP's checkpoint into FSDP2, ZeRO-1's into DDP."""
    out, saved = saved_on_two
    got = spawn("resume", out, world=4, jobs=[
        dict(name="ddp_to_fsdp", parallel="fsdp", ckpt=str(out / "ddp" / "ckpt-000002")),
        dict(name="zero1_to_ddp", parallel="ddp", ckpt=str(out / "zero1" / "ckpt-000002"))])
    want = reference(first=2)
    assert_equivalent(as_run(got["ddp_to_fsdp"], out / "ddp_to_fsdp_params.pt"), want, "ddp(2) -> fsdp(4)")
    assert_equivalent(as_run(got["zero1_to_ddp"], out / "zero1_to_ddp_params.pt"), want, "zero1(2) -> ddp(4)")


def test_one_process_checkpoint_resumes_on_two_with_zero1_and_fsdp(tmp_path):
    env = zd.DistEnv()
    run, opt = make_run({}, env)
    first = train_steps(run, opt, global_batches(STEPS), env, range(2), WORLD)
    save(run, opt, env, tmp_path / "ckpt-000002", 2)
    assert_equivalent(Run(first["losses"], first["norms"]), Run(*[x[:2] for x in (reference().losses,
                                                                                 reference().grad_norms)]),
                      "one process, first 2 steps", params=False)
    got = spawn("resume", tmp_path, jobs=[
        dict(name="zero1", parallel="zero1", ckpt=str(tmp_path / "ckpt-000002")),
        dict(name="fsdp_zero2", parallel="fsdp", reshard_after_forward=False, ckpt=str(tmp_path / "ckpt-000002"))])
    for name in ("zero1", "fsdp_zero2"):
        assert_equivalent(as_run(got[name], tmp_path / f"{name}_params.pt"), reference(first=2),
                          f"one process -> {name}(2)")


def test_zero1_into_fsdp_and_powersgd_state_survive_resume(tmp_path):
    """ZeRO-1 writes each rank's optimizer partition; FSDP reads them back as shards of other shapes. PowerSGD's
    per-rank error feedback and warm-start matrices are restored: the resumed run's losses, gradient norms and final
    parameters are bit-identical to the uninterrupted run's."""
    hook = dict(comm_hook="powersgd", powersgd_start_iter=2, powersgd_rank=1)
    saved = spawn("save", tmp_path, jobs=[dict(name="zero1", parallel="zero1", save_at=2),
                                          dict(name="powersgd", parallel="ddp", save_at=3, **hook)])
    got = spawn("resume", tmp_path, jobs=[
        dict(name="fsdp", parallel="fsdp", ckpt=str(tmp_path / "zero1" / "ckpt-000002")),
        dict(name="powersgd", parallel="ddp", ckpt=str(tmp_path / "powersgd" / "ckpt-000003"), **hook)])
    assert_equivalent(as_run(got["fsdp"], tmp_path / "fsdp_params.pt"), reference(first=2), "zero1(2) -> fsdp(2)")
    assert got["fsdp"]["received"] == [[{"rank": 0}, {"rank": 1}]]
    assert True in got["powersgd"]["received"]  # the hook state was restored
    assert got["powersgd"]["losses"] == saved["powersgd"]["losses"][3:]
    # the error feedback and warm-start matrices are kept per parameter (the resumed DDP lays its buckets out anew):
    # the first compressed gradient after the resume is the uninterrupted run's, and so is every later one
    assert got["powersgd"]["norms"] == saved["powersgd"]["norms"][3:]
    resumed = torch.load(tmp_path / "powersgd_params.pt")
    straight = torch.load(tmp_path / "powersgd" / "params.pt")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_collective_timeout_has_a_clear_message(tmp_path):
    got = spawn("timeout", tmp_path, timeout_s=2.0)
    assert got["error"] and "parallel.timeout_s=2s" in got["error"] and "rank 0/2" in got["error"]


def test_config_errors_name_the_field():
    from zero2all.config import load_config
    from zero2all.distributed.plan import resolve, sections

    env = zd.DistEnv()
    with pytest.raises(ValueError, match="parallel.mode"):
        ParallelConfig(mode="tp").validate()
    with pytest.raises(ValueError, match="torchrun"):
        zd.parallelize(build_model(tiny_cfg()), ParallelConfig(mode="fsdp"), env)
    with pytest.raises(ValueError, match="parallel.comm_hook"):
        ParallelConfig(comm_hook="fp8").validate()
    with pytest.raises(ValueError, match="parallel.cpu_offload"):
        resolve(sections(None, ParallelConfig(cpu_offload=True)), 1)
    with pytest.raises(ValueError, match="parallel.ac_every"):
        ParallelConfig(activation_checkpointing="selective", ac_every=0).validate()
    assert ParallelConfig().resolved_mode(1) == "none" and ParallelConfig().resolved_mode(2) == "ddp"
    # the names of earlier versions are read as the new ones
    assert load_config("tiny", ["train.parallel='zero1'", "train.dist_timeout_s=5"]).parallel.mode == "zero1"


def test_resume_with_another_world_size_needs_the_same_global_batch():
    from zero2all.checkpoint.compat import CheckpointMismatch, check_compatible
    from zero2all.config import load_config, to_dict

    saved = to_dict(load_config("tiny", ["train.micro_batch_size=2", "train.grad_accum_steps=2"]))
    same_batch = load_config("tiny", ["train.micro_batch_size=4", "train.grad_accum_steps=2"])
    check_compatible("ckpt", saved, same_batch, 256, world_size=1, saved_world_size=2,
                     saved_tokenizer_hash=None, tokenizer_hash=None)  # 2 x 2 x 2 == 4 x 2 x 1
    other_batch = load_config("tiny", ["train.micro_batch_size=2", "train.grad_accum_steps=2"])
    with pytest.raises(CheckpointMismatch, match=r"global batch: 8 sequences per update .* 4 now"):
        check_compatible("ckpt", saved, other_batch, 256, world_size=1, saved_world_size=2,
                         saved_tokenizer_hash=None, tokenizer_hash=None)
