"""CUDA graphs of the tensor-parallel blocks (``parallel.tp_graphs``, zero2all/distributed/graphs.py).

CPU: the switch is refused, naming the reason, wherever graphs cannot run (no CUDA, FSDP2 / pp / cp meshes,
activation checkpointing, compiled blocks, tp = 1 or the DTensor implementation). The plumbing around the graphs
(static buffers, the order of copies and captures, which gradient goes where) is checked on CPU with the CUDA
graph calls replaced by a stand-in whose capture runs the code and whose replay does nothing: the capture call
then computes for real and must give the eager block's loss and gradients; later calls with the same tokens and
weights find the right values still in the buffers, which checks the replay path, and a second forward before
the first one's backward must run eagerly (a replay there would lose its gradient). A parameter whose storage
moved is refused. Changing values between replays needs a real replay: that is the GPU test.

GPU (``-k gpu``, two CUDA devices, NCCL): tp2 + SP on a small model in bf16, the same 6 training steps eagerly and
with the graphs (eager warm-up, capture, replays): the loss sequences agree (the graphs replay the eager kernels;
tolerance 2e-3 relative for bf16 and NCCL's reduction order), and a second forward before the first one's
backward (its graphs' buffers are in use) falls back to the eager block and gives the eager gradients.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.test_distributed import free_port
from zero2all.config import ConfigError, ModelConfig, ParallelConfig

STEPS, MICRO, ACCUM, SEQ = 6, 2, 2, 128


def test_tp_graphs_refused_where_they_cannot_run():
    from zero2all.distributed.graphs import check_graphs_supported

    pc = ParallelConfig(tp=2, sequence_parallel=True, tp_graphs=True)
    with pytest.raises(ConfigError, match="needs CUDA devices"):
        check_graphs_supported(torch.device("cpu"), pc, 2, compile_blocks=False)
    cuda = torch.device("cuda", 0)
    check_graphs_supported(cuda, pc, 2, compile_blocks=False)   # plain tp2 on 2 processes: accepted
    with pytest.raises(ConfigError, match="dp_shard=2 on 4 processes"):
        check_graphs_supported(cuda, pc, 4, compile_blocks=False)
    with pytest.raises(ConfigError, match="pp=2"):
        check_graphs_supported(cuda, ParallelConfig(tp=2, pp=2, tp_graphs=True), 4, compile_blocks=False)
    with pytest.raises(ConfigError, match="activation checkpointing"):
        check_graphs_supported(cuda, ParallelConfig(tp=2, tp_graphs=True, activation_checkpointing="full"), 2,
                               compile_blocks=False)
    with pytest.raises(ConfigError, match="train.compile"):
        check_graphs_supported(cuda, pc, 2, compile_blocks=True)
    from zero2all.distributed.plan import resolve, sections

    for fields in ({"tp": 1}, {"tp": 2, "tp_impl": "dtensor"}):
        with pytest.raises(ConfigError, match="parallel.tp_graphs"):
            resolve(sections(None, ParallelConfig(tp_graphs=True, **fields)), 2)


def test_graphs_are_on_by_default_wherever_they_can_run():
    """``tp_graphs`` / ``pp_cuda_graphs`` default to "auto": on where the checks above accept the run, off with
    the reason elsewhere; ``true`` still refuses a run where they cannot work, ``false`` turns them off."""
    from zero2all.distributed.graphs import tp_graphs_wanted
    from zero2all.distributed.pp import pipeline_graphs_wanted

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert ParallelConfig().tp_graphs == "auto" and ParallelConfig().pp_cuda_graphs == "auto"
    tp2 = ParallelConfig(tp=2, sequence_parallel=True)
    assert tp_graphs_wanted(cuda, tp2, 2, compile_blocks=False) == (True, "")
    on, why = tp_graphs_wanted(cpu, tp2, 2, compile_blocks=False)
    assert not on and "needs CUDA devices" in why
    on, why = tp_graphs_wanted(cuda, tp2, 4, compile_blocks=False)
    assert not on and "dp_shard=2" in why
    assert tp_graphs_wanted(cuda, ParallelConfig(tp=2, tp_graphs=False), 2, compile_blocks=False) == (False, "")
    assert tp_graphs_wanted(cuda, ParallelConfig(), 1, compile_blocks=False) == (False, "")
    with pytest.raises(ConfigError, match="train.compile"):
        tp_graphs_wanted(cuda, ParallelConfig(tp=2, tp_graphs=True), 2, compile_blocks=True)
    with pytest.raises(ConfigError, match="expected true, false or"):
        ParallelConfig(tp=2, tp_graphs="yes").validate(2)

    pp2 = ParallelConfig(pp=2)
    assert pipeline_graphs_wanted(pp2, {"pp": 2}, cuda) == (True, "")
    for pc, shape, device, kw, reason in (
            (pp2, {"pp": 2}, cpu, {}, "needs CUDA devices"),
            (pp2, {"pp": 2, "dp_shard": 2}, cuda, {}, "graphs plain pipeline stages only"),
            (pp2, {"pp": 2}, cuda, {"linear_precision": "fp8_tensorwise"}, "linear_precision"),
            (pp2, {"pp": 2}, cuda, {"moe": True}, "mixture-of-experts"),
            (ParallelConfig(pp=2, pp_schedule="zero_bubble", pp_stages_per_rank=2), {"pp": 2}, cuda, {},
             "zero_bubble")):
        on, why = pipeline_graphs_wanted(pc, shape, device, **kw)
        assert not on and reason in why, (pc, shape, why)
    with pytest.raises(ConfigError, match="needs CUDA devices"):
        pipeline_graphs_wanted(ParallelConfig(pp=2, pp_cuda_graphs=True), {"pp": 2}, cpu)


def _capture_call_on_cpu(env) -> dict:
    """tp2 + SP on 2 gloo processes: per call, the loss and the norms of three gradients (this rank's shards),
    eagerly and through graphs.py with the stand-in; call 3 is the capture call."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh

    from zero2all.config import OpsConfig
    from zero2all.distributed import graphs, tp
    from zero2all.model.z2all import build_model

    class Stand:  # CUDA's stream, graph and pool calls: capture = run the code, replay = nothing
        def wait_stream(self, other):
            pass

        def replay(self):
            pass

        def capture_begin(self, pool=None, capture_error_mode="global"):
            pass

        def capture_end(self):
            pass

        def reset(self):
            resets.append(1)

    torch.cuda.Stream = lambda device=None: Stand()
    torch.cuda.current_stream = lambda device=None: Stand()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.graph_pool_handle = lambda: None
    torch.cuda.CUDAGraph = Stand
    torch.cuda.synchronize = lambda device=None: None
    graphs.BlockGraphs.applies = lambda self, x, cos, doc_ids, mask: torch.is_grad_enabled()
    cfg = ModelConfig(vocab_size=96, hidden_dim=32, intermediate_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=16, ops=OpsConfig.plain())
    mesh = init_device_mesh("cpu", (env.world_size,))
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    resets = []

    def step(model, scales=(1.0,)):  # forwards with these loss weights, one backward: loss and 3 grad norms
        model.zero_grad(set_to_none=True)
        with tp.loss_parallel_context():
            losses = [model(tokens, tokens)[1] for _ in scales]
            sum(w * loss for w, loss in zip(scales, losses)).backward()
        grads = [model.layers[0].mlp.down_proj.weight.grad, model.layers[1].input_layernorm.weight.grad,
                 model.embed_tokens.weight.grad]
        return [float(losses[0].to_local())] + [float(g.to_local().norm()) for g in grads]

    for use in (False, True):
        model = build_model(cfg, seed=1)
        tp.apply_tp(model, mesh, True, "local", graphs=use)
        # warm-up calls, the capture call, two replays (same tokens and weights: the stand-in's buffers still hold
        # the right values), then two forwards before one backward (the second must run eagerly)
        rows = [step(model) for _ in range(graphs.WARMUP_CALLS + 3)] + [step(model, (1.0, 2.0))]
        out["graphs" if use else "eager"] = rows
        if use:
            out["captured"] = [len(v) for v in tp.regions_of(model.layers[0]).graphs.graphs.values()]
            o_proj = model.layers[0].self_attn.o_proj
            o_proj.weight = torch.nn.Parameter(o_proj.weight.detach().clone())   # new storage
            try:
                step(model)
            except RuntimeError as e:
                out["moved"] = str(e)
            # the end of a run: every graph freed before the process group goes (NCCL waits for them otherwise)
            out["freed"] = [tp.block_graphs(model).release(), len(resets),
                            len(tp.regions_of(model.layers[0]).graphs.graphs)]
    return out


def test_graph_plumbing_of_the_capture_call_on_cpu(tmp_path):
    from tests.test_distributed import gloo_worker

    mp.spawn(gloo_worker, args=(2, free_port(), str(tmp_path), _capture_call_on_cpu), nprocs=2, join=True)
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["captured"] == [1, 1]     # both blocks captured, one signature each
    assert "no longer has the storage" in res.get("moved", "")
    assert res["freed"] == [4, 4, 0]     # 2 blocks x (forward, backward) graphs reset, none left
    for call, (eager, graphed) in enumerate(zip(res["eager"], res["graphs"])):
        for a, b in zip(eager, graphed):
            assert abs(a - b) <= 1e-6 * max(abs(a), 1e-6), f"call {call}: {graphed} vs eager {eager}"


# ------------------------------------------------------------------------------------------------------- GPU


def _gpu_cfg() -> ModelConfig:
    return ModelConfig(vocab_size=512, hidden_dim=256, intermediate_size=512, n_layers=3, n_heads=4, n_kv_heads=2,
                       max_seq_len=SEQ)


def _train(env, graphs: bool) -> tuple[list[float], float]:
    from zero2all import distributed as zd
    from zero2all.model.z2all import build_model

    pc = ParallelConfig(tp=2, sequence_parallel=True, tp_graphs=graphs)
    run = zd.parallelize(build_model(_gpu_cfg(), device=env.device, seed=7), pc, env, precision="bf16")
    opt = torch.optim.AdamW(run.model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 512, (STEPS, ACCUM, MICRO, SEQ + 1), generator=g).to(env.device)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for a in range(ACCUM):
            batch = {"input_ids": data[step, a, :, :-1], "labels": data[step, a, :, 1:]}
            with run.train_context(batch), torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = run.model(batch["input_ids"], batch["labels"])
                (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        with run.optimizer_context():
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    # two forwards, then one backward: the second runs eagerly (the first holds the graphs' buffers)
    batch = {"input_ids": data[0, 0, :, :-1], "labels": data[0, 0, :, 1:]}
    with run.train_context(batch), torch.autocast("cuda", dtype=torch.bfloat16):
        first = run.model(batch["input_ids"], batch["labels"])[1]
        second = run.model(batch["input_ids"], batch["labels"])[1]
        (first + 2 * second).backward()
    grad = run.plain.layers[0].mlp.down_proj.weight.grad.to_local().float().norm().item()
    return losses, grad


def _gpu_worker(rank: int, port: int, out: str) -> None:
    import os

    from zero2all import distributed as zd

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env = zd.init_distributed(device="cuda", timeout_s=120.0)
    try:
        eager = _train(env, graphs=False)
        graphed = _train(env, graphs=True)
        if env.rank == 0:
            (Path(out) / "result.json").write_text(json.dumps({"eager": eager, "graphs": graphed}))
        torch.distributed.barrier()
    finally:
        zd.destroy_distributed()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_tp_graphs_match_the_eager_blocks(tmp_path):
    mp.spawn(_gpu_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    res = json.loads((tmp_path / "result.json").read_text())
    (eager, eager_grad), (graphed, graphed_grad) = res["eager"], res["graphs"]
    print("tp2 + SP losses eager ", [round(v, 5) for v in eager])
    print("tp2 + SP losses graphs", [round(v, 5) for v in graphed])
    print(f"two forwards, one backward: grad norm eager {eager_grad:.6g}, graphs {graphed_grad:.6g}")
    assert eager[-1] < eager[0]   # it learns
    for step, (a, b) in enumerate(zip(eager, graphed)):
        assert abs(a - b) <= 2e-3 * abs(a), f"step {step}: graphs {b} vs eager {a}"
    assert abs(eager_grad - graphed_grad) <= 2e-3 * eager_grad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_pretrain_with_tp_graphs_exits(tmp_path):
    """``z2all pretrain`` with tp_graphs under torchrun: trains, writes final/, and exits 0 (a graph that captured
    a collective, left alive, makes ``destroy_process_group`` wait forever)."""
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "zero2all.cli", "pretrain", "--config", "tiny", "--out", str(out), "train.max_steps=6",
           "train.eval_every=0", "train.ckpt_every=0", "train.micro_batch_size=4", "model.vocab_size=512",
           "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_graphs=true"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(f"exit {proc.returncode} after {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (out / "final").is_dir()
    assert "replayed as CUDA graphs" in proc.stdout + proc.stderr
