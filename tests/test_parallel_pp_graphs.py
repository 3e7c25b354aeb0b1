"""CUDA graphs of pipeline stages (zero2all/distributed/pp_graphs.py, parallel.pp_cuda_graphs).

CPU: the switch's refusals (no CUDA device, other mesh dimensions, activation checkpointing, zero bubble, FP8), the
number of graph slots each schedule needs, and the slot bookkeeping under torch's real schedules on 2 gloo
processes (slots replaced by an eager stand-in with the same contract) against the single-process loss
sequence. GPU (``-k gpu``, skipped without CUDA): a stage's blocks graphed with
two slots and driven in 1F1B order (F0 F1 B0 F2 B1 B2, two microbatches in flight) give the outputs, input
gradients and accumulated weight gradients of the eager blocks, over two updates with the weights changed in
between (the graphs must read the refreshed weight copies, not stale ones).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zero2all.config import ConfigError, ModelConfig, ParallelConfig
from zero2all.distributed.pp import check_pipeline_graphs, graph_slots

CUDA = torch.cuda.is_available()


def test_graph_switch_is_refused_where_it_cannot_run():
    from zero2all.distributed.plan import resolve, sections

    pc = ParallelConfig(pp=2, pp_cuda_graphs=True)
    pc.validate()
    with pytest.raises(ConfigError, match="needs CUDA devices"):
        check_pipeline_graphs(pc, {"pp": 2}, torch.device("cpu"))
    with pytest.raises(ConfigError, match="plain pipeline stages only.*dp_shard"):
        check_pipeline_graphs(pc, {"pp": 2, "dp_shard": 2}, torch.device("cuda"))
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        check_pipeline_graphs(ParallelConfig(pp=2, pp_cuda_graphs=True, activation_checkpointing="full"),
                              {"pp": 2}, torch.device("cuda"))
    with pytest.raises(ConfigError, match="linear_precision = 'fp8_rowwise'"):
        check_pipeline_graphs(pc, {"pp": 2}, torch.device("cuda"), "fp8_rowwise")
    for bad in (ParallelConfig(pp=1, pp_cuda_graphs=True),
                ParallelConfig(pp=2, pp_cuda_graphs=True, pp_schedule="zero_bubble", pp_stages_per_rank=2)):
        with pytest.raises(ConfigError, match="pp_cuda_graphs needs"):
            resolve(sections(None, bad), None)


def test_graph_slots_follow_the_microbatches_in_flight():
    assert [graph_slots("1f1b", 4, k, 8) for k in range(4)] == [4, 3, 2, 1]
    assert graph_slots("1f1b", 4, 0, 2) == 2          # never more than the microbatches
    assert graph_slots("gpipe", 2, 0, 8) == 8
    assert graph_slots("interleaved_1f1b", 2, 3, 16) == 4


def _tiny_stage(first: bool):
    from zero2all.distributed.pp import StageModule
    from zero2all.model.z2all import Z2all

    cfg = ModelConfig(vocab_size=96, hidden_dim=64, intermediate_size=160, n_layers=3, n_heads=4, n_kv_heads=2,
                      max_seq_len=48, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Z2all(cfg).cuda()
    return StageModule(model, [0, 1, 2], first=first, last=False, compute_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("first", [True, False])
def test_gpu_graphed_stage_matches_eager_in_1f1b_order(first):
    from zero2all.distributed.pp_graphs import GraphedBlocks
    from zero2all.model import ops

    stage = _tiny_stage(first)
    params = list(stage.layers.parameters())
    graphed = GraphedBlocks(stage.run_blocks, params, max_slots=2)
    store: dict = {}
    order = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    g = torch.Generator(device="cuda").manual_seed(1)

    def inputs():
        x = torch.randn(2, 48, 64, device="cuda", generator=g)
        return (x,) if first else (x, torch.randn(2, 48, 64, device="cuda", generator=g))

    def run(fn, data, upstream):
        outs, grads_in = {}, {}
        leaves = {}
        for kind, m in order:
            if kind == "F":
                leaves[m] = tuple(t.clone().requires_grad_() for t in data[m])
                outs[m] = fn(*leaves[m])
            else:
                torch.autograd.backward(outs[m], upstream[m])
                grads_in[m] = [t.grad for t in leaves[m]]
        return outs, grads_in

    for update in range(2):
        data = [inputs() for _ in range(3)]
        upstream = [tuple(torch.randn(2, 48, 64, device="cuda", generator=g) for _ in range(2)) for _ in range(3)]
        from zero2all.kernels.eager import refresh_weight_casts

        refresh_weight_casts(store)
        with torch.autocast("cuda", dtype=torch.bfloat16), ops.weight_cast_cache({}):
            for p in params:
                p.grad = None
            want_out, want_gin = run(stage.run_blocks, data, upstream)
            want_w = [p.grad.clone() for p in params]
        # the eager graph must be gone before a capture, as it is between the pipeline's updates: while it lives,
        # the parameters' gradient accumulators made on the default stream live on, and a captured backward that
        # hands them gradients would make the default stream wait on the capture (which CUDA refuses)
        want_out = {m: tuple(o.detach() for o in outs) for m, outs in want_out.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16), ops.weight_cast_cache(store):
            for p in params:
                p.grad = None
            graphed.begin_step()
            got_out, got_gin = run(graphed, data, upstream)
            graphed.finish_step()
        assert len(graphed.slots) == 2 and graphed.eager_calls == 0
        for m in range(3):
            for a, b in zip(got_out[m], want_out[m]):
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
            for a, b in zip(got_gin[m], want_gin[m]):
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        for p, w in zip(params, want_w):
            torch.testing.assert_close(p.grad, w, rtol=2e-2, atol=2e-3)
        with torch.no_grad():          # an optimizer step: the next update's graphs must see these weights
            for p in params:
                p.add_(torch.randn_like(p) * 0.05)


# ------------------------------------------------------------------------------------------------ CPU, gloo


class SlotStandIn:
    """A captured slot's contract run eagerly on CPU: ONE saved forward per slot (a second forward before the
    backward replaces it, as a graph replay overwrites the activations it saved), weight gradients added to the
    accumulators, input gradients returned. Lets the slot bookkeeping, the gradient hand-off and the slot counts
    of each schedule run under torch's real pipeline runtime on gloo."""

    def __init__(self, fn, sample, params, accumulators, warmup):
        self.fn, self.params, self.accumulators = fn, params, accumulators
        self.saved = None

    def forward(self, inputs):
        with torch.enable_grad():
            leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in inputs)
            outs = tuple(self.fn(*leaves))
        self.saved = (leaves, outs)
        return tuple(o.detach().clone() for o in outs)

    def backward(self, grads):
        (leaves, outs), self.saved = self.saved, None   # a slot reused before its backward fails here
        wants = [t for t in leaves if t.requires_grad]
        grads = [torch.zeros_like(o) if g is None else g for o, g in zip(outs, grads)]
        got = torch.autograd.grad(outs, wants + self.params, grad_outputs=grads, allow_unused=True)
        for acc, g in zip(self.accumulators, got[len(wants):]):
            if g is not None:
                acc.add_(g)
        rest = iter(got[:len(wants)])
        return tuple(next(rest) if t.requires_grad else None for t in leaves)


def _graph_entry(rank: int, world: int, port: int, out: str, runs: list[list[str]]):
    from test_distributed import gloo_worker
    from test_parallel_pp import BASE

    import zero2all.distributed.pp as pp
    from zero2all.config import load_config
    from zero2all.distributed.pp_graphs import GraphedBlocks
    from zero2all.train.trainer import Trainer

    GraphedBlocks.slot_type = SlotStandIn
    device_check = pp.check_pipeline_graphs
    pp.check_pipeline_graphs = lambda pc, shape, device, precision: device_check(pc, shape, torch.device("cuda"),
                                                                                 precision)

    def work(env):
        stats = []
        for i, overrides in enumerate(runs):
            run_out = Path(out) / f"run{i}"
            trainer = Trainer(load_config("tiny", BASE + [f"train.out_dir='{run_out}'", *overrides]),
                              show_progress=False)
            trainer.fit()
            stats.append([(g.most_in_flight, len(g.slots), g.eager_calls) for g in trainer.pipeline.graphed_blocks()])
        (Path(out) / f"stats{env.rank}.json").write_text(json.dumps(stats))

    gloo_worker(rank, world, port, out, work, timeout_s=120.0)


def test_graph_bookkeeping_under_the_real_schedules_matches_one_process(tmp_path):
    """pp2 with pp_cuda_graphs (slots run by the CPU stand-in) reproduces the single-process run (10 steps,
    float64: losses, gradient norms, final parameters) under GPipe, 1F1B and interleaved 1F1B, and no forward
    ever finds its slots full (the slot counts of
    ``graph_slots`` cover what torch's schedules keep in flight: 1F1B exactly K - k)."""
    import torch.multiprocessing as mp
    from equivalence import assert_equivalent, read_run, train
    from test_distributed import free_port
    from test_parallel_pp import BASE

    torch.set_num_threads(1)
    reference = train(tmp_path / "single", "train.micro_batch_size=4", "train.max_steps=10", base=BASE)
    schedules = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]
    runs = [["train.micro_batch_size=4", "parallel.pp=2", f"parallel.pp_schedule='{name}'",
             f"parallel.pp_stages_per_rank={v}", "parallel.pp_cuda_graphs=true", "train.max_steps=10"]
            for name, v in schedules]
    mp.spawn(_graph_entry, args=(2, free_port(), str(tmp_path), runs), nprocs=2, join=True)
    stats = [json.loads((tmp_path / f"stats{r}.json").read_text()) for r in range(2)]
    for i, (name, v) in enumerate(schedules):
        assert_equivalent(read_run(tmp_path / f"run{i}"), reference, f"pp2 {name} with the graph bookkeeping")
        for rank in range(2):
            for most, slots, eager in stats[rank][i]:
                assert eager == 0 and most == slots, (name, rank, stats[rank][i])
    assert [s[0] for s in stats[0][1]] == [2] and [s[0] for s in stats[1][1]] == [1]   # 1F1B: K - k in flight
    assert [s[0] for s in stats[0][0]] == [8]                                          # GPipe: all M = 8
