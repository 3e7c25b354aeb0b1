"""CUDA graphs of pipeline stages (zero2all/distributed/pp_graphs.py, parallel.pp_cuda_graphs).

CPU: the switch's refusals (no CUDA device, other mesh dimensions, activation checkpointing, zero bubble) and the
number of graph slots each schedule needs. GPU (``-k gpu``, skipped without CUDA): a stage's blocks graphed with
two slots and driven in 1F1B order (F0 F1 B0 F2 B1 B2, two microbatches in flight) give the outputs, input
gradients and accumulated weight gradients of the eager blocks, over two updates with the weights changed in
between (the graphs must read the refreshed weight copies, not stale ones).
"""

from __future__ import annotations

import pytest
import torch

from zero2all.config import ConfigError, ModelConfig, ParallelConfig
from zero2all.distributed.pp import check_pipeline_graphs, graph_slots

CUDA = torch.cuda.is_available()


def test_graph_switch_is_refused_where_it_cannot_run():
    pc = ParallelConfig(pp=2, pp_cuda_graphs=True)
    pc.validate()
    with pytest.raises(ConfigError, match="needs CUDA devices"):
        check_pipeline_graphs(pc, {"pp": 2}, torch.device("cpu"))
    with pytest.raises(ConfigError, match="plain pipeline stages only.*dp_shard"):
        check_pipeline_graphs(pc, {"pp": 2, "dp_shard": 2}, torch.device("cuda"))
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        check_pipeline_graphs(ParallelConfig(pp=2, pp_cuda_graphs=True, activation_checkpointing="full"),
                              {"pp": 2}, torch.device("cuda"))
    for bad in (ParallelConfig(pp=1, pp_cuda_graphs=True),
                ParallelConfig(pp=2, pp_cuda_graphs=True, pp_schedule="zero_bubble", pp_stages_per_rank=2)):
        with pytest.raises(ConfigError, match="pp_cuda_graphs needs"):
            bad.validate()


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
