"""Pipeline parallelism (zero2all/distributed/pp.py): stage balancing, the refusals, and the trainer on 2 gloo
processes (CPU, float64) against the single-process run of the same global batch (tests/equivalence.py).

One launch of 2 processes trains pp2 with every schedule (GPipe, 1F1B, interleaved 1F1B with 2 stages per rank,
interleaved zero bubble: torch's ScheduleInterleavedZeroBubble); the 1F1B run also
validates through the forward-only schedule and writes a checkpoint half-way that one process resumes, continuing
the same sequence. Each matches one process per step (loss and gradient norm) and in its final parameters within
the float64 bound. pp2 x dp2 and tp2 x pp2 on 4 processes: test_parallel_pp_dp.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from equivalence import RTOL, TINY, Run, assert_equivalent, launch, log_measured, rel, train

from zero2all.config import ConfigError, ModelConfig, ParallelConfig, load_config
from zero2all.distributed.pp import split_layers, stage_layout, stage_rank, unit_costs

STEPS, CKPT_AT = 6, 3
EVAL = ["train.eval_every=3", "train.eval_batches=2"]  # validation losses at steps 0, 3 and 6
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]
BASE = [*TINY, f"train.max_steps={STEPS}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """One process, micro-batch 4 x accumulation 2 (with validation): the run every pipeline must reproduce."""
    torch.set_num_threads(1)
    return train(tmp_path_factory.mktemp("single"), "train.micro_batch_size=4", *EVAL, base=BASE)


# ------------------------------------------------------------------------------------------------ tests


def test_split_balances_the_most_expensive_stage():
    rng = random.Random(0)
    for _ in range(30):
        n, k = rng.randint(2, 9), 0
        k = rng.randint(1, n)
        costs = [rng.uniform(1, 10) for _ in range(n)]
        first, last = rng.uniform(0, 20), rng.uniform(0, 20)
        stages = split_layers(costs, k, first, last)
        assert [i for s in stages for i in s] == list(range(n)) and all(stages)

        def worst(cuts):
            bounds = [0, *cuts, n]
            return max(sum(costs[bounds[j]:bounds[j + 1]]) + (first if j == 0 else 0) + (last if j == k - 1 else 0)
                       for j in range(k))

        import itertools

        brute = min(worst(c) for c in itertools.combinations(range(1, n), k - 1))
        assert worst([s[0] for s in stages[1:]]) == pytest.approx(brute)


def test_layout_weighs_the_lm_head_and_places_stages_round_robin():
    cfg = ModelConfig(vocab_size=128000, hidden_dim=2048, intermediate_size=5632, n_layers=22, n_heads=32,
                      n_kv_heads=4, max_seq_len=2048)
    embed, blocks, head = unit_costs(cfg, 2048)
    assert head == 6 * cfg.padded_vocab_size * 2048 and embed < head
    layout = stage_layout(cfg, ParallelConfig(pp=2), 2048)
    assert len(layout[0]) > len(layout[1])   # a large LM head (~5 blocks of work) on the last stage: fewer blocks
    assert len(layout[0]) + len(layout[1]) == 22
    assert [stage_rank(s, 2) for s in range(4)] == [0, 1, 0, 1]


def check_mesh(cfg, pc, world):
    """The plan's refusals for ``cfg`` with another parallel section."""
    from dataclasses import replace

    from zero2all.distributed.plan import resolve

    return resolve(replace(cfg, parallel=pc), world)


def test_explicit_split_overrides_the_flop_balance_and_is_checked():
    cfg = load_config("tiny", BASE + ["parallel.pp=2", "parallel.pp_split=[3, 1]", "train.micro_batch_size=4"])
    assert cfg.parallel.pp_split == [3, 1]
    assert stage_layout(cfg.model, cfg.parallel, 16) == [[0, 1, 2], [3]]
    check_mesh(cfg, cfg.parallel, 2)
    interleaved = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, pp_split=[1, 1, 1, 1])
    assert stage_layout(cfg.model, interleaved, 16) == [[0], [1], [2], [3]]
    for split, what in (([2, 1], "summing to 3"), ([4, 0, 0], "got 3 summing to 4"), ([4, 0], "each >= 1")):
        with pytest.raises(ConfigError, match=rf"pp_split=\[{split[0]}.*{what}"):
            check_mesh(cfg, ParallelConfig(pp=2, pp_split=split), 2)
    with pytest.raises(ConfigError, match="needs parallel.pp > 1"):
        check_mesh(cfg, ParallelConfig(pp_split=[4]), 1)


def test_measured_costs_time_every_piece_and_leave_no_gradients():
    from zero2all.distributed.pp_balance import measured_unit_costs
    from zero2all.model.z2all import build_model

    cfg = load_config("tiny", BASE)
    model = build_model(cfg.model, device="cpu", seed=0)
    embed, blocks, head = measured_unit_costs(model, 16, torch.device("cpu"), torch.float32, repeats=1)
    assert len(blocks) == cfg.model.n_layers and len(set(blocks)) == 1   # one timing per kind of block
    assert embed > 0 and blocks[0] > 0 and head > 0
    assert all(p.grad is None for p in model.parameters())
    layout = stage_layout(cfg.model, ParallelConfig(pp=2, pp_balance="time"), 16, (embed, blocks, head))
    assert [i for ids in layout for i in ids] == list(range(cfg.model.n_layers)) and all(layout)
    from zero2all.distributed.pp import check_pipeline_mesh

    with pytest.raises(ConfigError, match="pp_balance='time' with tp=2"):
        check_pipeline_mesh(ParallelConfig(pp=2, tp=2, pp_balance="time"),
                            {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2})
    with pytest.raises(ConfigError, match="pp_balance: 'fast' is not one of flops, time"):
        ParallelConfig(pp=2, pp_balance="fast").validate(2)


def _moe_head_input(cross_entropy: str, dtype: torch.dtype):
    """A tiny MoE model (every auxiliary term weighted) after a training forward, its LM head's input and labels
    with 3 ignored targets."""
    from zero2all.config import MoEConfig, OpsConfig
    from zero2all.model.z2all import build_model

    ops = OpsConfig.plain()
    ops.cross_entropy = cross_entropy
    cfg = ModelConfig(vocab_size=40, hidden_dim=16, intermediate_size=32, n_layers=2, n_heads=2, n_kv_heads=1,
                      max_seq_len=8, ops=ops, moe=MoEConfig(n_experts=4, top_k=2, expert_intermediate_size=8,
                                                             aux_loss_coef=0.5, seq_aux_loss_coef=0.1,
                                                             z_loss_coef=0.5))
    model = build_model(cfg, seed=0, dtype=dtype).train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 40, (2, 5), generator=g)
    labels = torch.randint(0, 40, (2, 5), generator=g)
    labels[0, :3] = -100
    cos, sin = model.rope_tables(0, 5, "cpu")
    h = model.final_norm(*model.blocks(model.embed(tokens), None, cos, sin))
    return model, h, labels


@pytest.mark.parametrize("cross_entropy,dtype,rtol", [("torch", torch.float64, 4e-14), ("fused", torch.float32, 5e-6)])
def test_head_loss_sum_is_the_valid_count_times_the_mean_with_every_moe_term(cross_entropy, dtype, rtol):
    """What the last pipeline stage returns per microbatch: the model's head_loss(reduction="sum") = n x its mean
    (n valid targets): the token losses (z-loss included) summed, every MoE term weighted by n; the same with the
    count kept on the device (``counted``); no valid target: an exact 0 with zero gradients. Measured: 4.7e-16
    (float64 reference) and 6.6e-8 (the fused kernel, float32) relative."""
    model, h, labels = _moe_head_input(cross_entropy, dtype)
    n = int((labels != -100).sum())
    _, mean = model.head_loss(h, labels, z_loss=0.1)
    _, tokens_only = model.token_loss(h, labels, z_loss=0.1, reduction="sum")
    for counted in (False, True):
        _, total = model.head_loss(h, labels, z_loss=0.1, reduction="sum", counted=counted)
        torch.testing.assert_close(total, n * mean, rtol=rtol, atol=0)
        (grad_sum,) = torch.autograd.grad(total, h, retain_graph=True)
        (grad_mean,) = torch.autograd.grad(mean, h, retain_graph=True)
        torch.testing.assert_close(grad_sum, n * grad_mean, rtol=rtol, atol=rtol * float(grad_sum.abs().max()))
    aux = float((total - tokens_only).detach()) / n   # the MoE terms, weighted by the count
    assert aux > 1e-2 and abs(aux - float(sum(m.aux_loss for m in model.modules() if hasattr(m, "router")))) < 1e-5
    _, empty = model.head_loss(h, torch.full_like(labels, -100), reduction="sum")
    assert empty.item() == 0.0 and not torch.autograd.grad(empty, h, retain_graph=True)[0].any()


def test_impossible_pipelines_are_refused_naming_the_numbers():
    cfg = load_config("tiny", BASE + ["parallel.pp=2", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match="pp_microbatches=2 is fewer than the 4 pipeline stages"):
        check_mesh(cfg, ParallelConfig(pp=2, pp_schedule="interleaved_1f1b",
                                    pp_stages_per_rank=2, pp_microbatches=2), 2)
    with pytest.raises(ConfigError, match="n_layers=4"):
        check_mesh(cfg, ParallelConfig(pp=4, pp_schedule="zero_bubble", pp_stages_per_rank=2), 4)
    with pytest.raises(ConfigError, match="pp_microbatches=3 does not divide"):
        check_mesh(cfg, ParallelConfig(pp=2, pp_microbatches=3), 2)
    with pytest.raises(ConfigError, match="pp_stages_per_rank=2 needs"):
        check_mesh(cfg, ParallelConfig(pp=2, pp_stages_per_rank=2, pp_schedule="1f1b"), 2)
    from zero2all.distributed.pp import check_pipeline_mesh

    with pytest.raises(ConfigError, match="zero_bubble.*dp_shard=2"):
        check_pipeline_mesh(ParallelConfig(pp=2, pp_schedule="zero_bubble"),
                            {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1})
    check_pipeline_mesh(ParallelConfig(pp=2, pp_schedule="zero_bubble"),   # with tp only: allowed
                        {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2})
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        from zero2all.distributed.pp import check_pipeline_model

        check_pipeline_model(ModelConfig(vocab_size=64, hidden_dim=32, intermediate_size=64, n_layers=2,
                                         n_heads=4, n_kv_heads=2, tie_word_embeddings=True))


# a MoE model with every auxiliary term of the loss: 8 experts top-2 with the softmax router, the load-balancing,
# sequence-wise and router z-losses weighted (0.5, 0.1, 0.5), one dense block first (a stage without MoE blocks)
MOE_AUX = ["model.moe.n_experts=8", "model.moe.top_k=2", "model.moe.expert_intermediate_size=16",
           "model.moe.first_dense_layers=1", "model.moe.router='softmax_topk'", "model.moe.aux_loss_coef=0.5",
           "model.moe.seq_aux_loss_coef=0.1", "model.moe.z_loss_coef=0.5", "train.max_steps=4"]


def test_moe_stages_are_not_graphed():
    from zero2all.distributed.pp import pipeline_graphs_wanted

    shape = {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    assert pipeline_graphs_wanted(ParallelConfig(pp=2), shape, torch.device("cpu"), moe=True)[0] is False
    with pytest.raises(ConfigError, match="pp_cuda_graphs = true with a MoE model"):
        pipeline_graphs_wanted(ParallelConfig(pp=2, pp_cuda_graphs=True), shape, torch.device("cpu"), moe=True)


@pytest.mark.slow
def test_moe_pp2_every_schedule_matches_one_process_with_its_auxiliary_losses(tmp_path):
    """The training loss of a MoE model under pp includes every MoE term (load-balancing, sequence-wise, router
    z-loss) of every stage's blocks, not only the last stage's cross-entropy: loss, gradient norm per step and the
    final parameters equal one process. A pipeline microbatch is a forward of its own (its auxiliary losses are
    computed over its tokens, as under gradient accumulation), so the single process runs one pipeline microbatch
    (one sequence) per micro-batch over the same global batch: 1 x 8 against pp's 4 sequences x 2, split in 4."""
    base = [*BASE, *MOE_AUX]
    torch.set_num_threads(1)
    want = train(tmp_path / "single", "train.micro_batch_size=1", "train.grad_accum_steps=8", base=base)
    runs = [["train.micro_batch_size=4", "parallel.pp=2", f"parallel.pp_schedule='{name}'",
             f"parallel.pp_stages_per_rank={v}",
             *(["parallel.pp_balance='time'"] if name == "1f1b" else [])]  # timed MoE forwards must not count
            for name, v in SCHEDULES]
    got = launch(tmp_path, 2, runs, base=base)
    for (name, v), run in zip(SCHEDULES, got):
        assert_equivalent(run, want, f"MoE pp2 {name} (stages per rank {v})")
    # every MoE layer's statistics are logged (each stage's own layers, gathered), equal to one process's
    import json

    def moe_metrics(out):
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return [{k: v for k, v in r.items() if k.startswith("moe/")} for r in recs if r.get("kind") == "train"]

    single = moe_metrics(tmp_path / "single")
    assert {k.split("/")[1] for k in single[0]} == {"layer1", "layer2", "layer3"}
    for i in range(len(SCHEDULES)):
        for got_step, want_step in zip(moe_metrics(tmp_path / f"run{i}"), single):
            assert set(got_step) == set(want_step)
            assert all(rel(got_step[k], want_step[k]) <= RTOL for k in want_step), (got_step, want_step)
    # the auxiliary losses weigh: without them the same run logs another loss
    plain = train(tmp_path / "no_aux", "train.micro_batch_size=1", "train.grad_accum_steps=8",
                  "model.moe.aux_loss_coef=0.0", "model.moe.seq_aux_loss_coef=0.0", "model.moe.z_loss_coef=0.0",
                  base=base)
    assert rel(plain.losses[0], want.losses[0]) > 1e-3


@pytest.mark.slow
def test_pp2_every_schedule_matches_one_process_and_resumes_on_one(reference, tmp_path):
    runs = [["train.micro_batch_size=4", "parallel.pp=2", f"parallel.pp_schedule='{name}'",
             f"parallel.pp_stages_per_rank={v}", *([f"train.ckpt_every={CKPT_AT}", *EVAL] if name == "1f1b" else []),
             *(["parallel.pp_split=[1,3]"] if name == "gpipe" else []),   # an explicit, unbalanced split
             *(["parallel.pp_balance='time'"] if name == "1f1b" else [])]  # stages balanced by timing them
            for name, v in SCHEDULES]
    got = launch(tmp_path, 2, runs, base=BASE)
    dense = reference
    assert dense.losses[-1] < dense.losses[0] - 0.2  # training happens
    # validation through the pipeline's forward-only schedule gives the single process's validation losses
    assert len(got[1].eval_losses) == len(dense.eval_losses) == 3
    d = log_measured("pp2 1f1b validation losses", {"loss": max(map(rel, got[1].eval_losses, dense.eval_losses))})
    assert d["loss"] <= RTOL, (got[1].eval_losses, dense.eval_losses)
    for (name, v), run in zip(SCHEDULES, got):
        assert_equivalent(run, dense, f"pp2 {name} (stages per rank {v})")
    # the pp2 checkpoint has the plain model's names, resumes on one process and continues the sequence: the same
    # losses, gradient norms and final parameters as the straight single-process run
    ckpt = tmp_path / "run1" / f"ckpt-{CKPT_AT:06d}"
    resumed = train(tmp_path / "resumed", "train.micro_batch_size=4", f"train.resume='{ckpt}'", base=BASE)
    assert_equivalent(resumed, Run(dense.losses[CKPT_AT:], dense.grad_norms[CKPT_AT:], dense.params),
                      "pp2 checkpoint resumed on one process")
    # the model loader (export-hf, generate, eval) reads a pp2 checkpoint whole: the final model's weights (read
    # into the loader's float32 model)
    from zero2all.model.io import load_model

    loaded = load_model(tmp_path / "run1" / f"ckpt-{STEPS:06d}").state_dict()
    assert set(loaded) == set(got[1].params)
    for name, w in got[1].params.items():
        torch.testing.assert_close(loaded[name], w.float(), rtol=0, atol=0, msg=name)


def test_every_stage_weighs_its_moe_terms_by_the_microbatchs_share_of_the_valid_tokens():
    """Two stages of a MoE model on one process, microbatches with different numbers of valid tokens: the first
    stage's attached MoE terms and the last stage's (inside head_loss's sum) weigh alike, by the microbatch's valid
    tokens over the micro-batch's. The gradients equal the whole model's sum over microbatches of head_loss(sum) /
    N_valid. Measured (float64): equal bit for bit (the bound allows a few units of rounding); the first stage
    weighing its terms by 1 / microbatches instead differs by 0.1."""
    from zero2all.distributed.pp import StageModule

    model, _, _ = _moe_head_input("torch", torch.float64)
    assert all(hasattr(block.mlp, "router") for block in model.layers)   # a MoE block on each stage
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 40, (2, 6), generator=g)
    labels = torch.randint(0, 40, (2, 6), generator=g)
    labels[0, :4] = -100                        # microbatch 0 holds 2 valid tokens, microbatch 1 holds 6
    n = int((labels != -100).sum())
    weight = torch.full((2,), 1.0 / n, dtype=torch.float64)
    first, last = (StageModule(model, [0], True, False, compute_dtype=torch.float64),
                   StageModule(model, [1], False, True, compute_dtype=torch.float64))
    for stage in (first, last):
        stage.in_chunk, stage.multiplier = True, 1.0
    params = list(model.parameters())
    got = 0.0
    for i in range(2):
        kw = dict(labels=labels[i:i + 1], loss_weight=weight[i:i + 1])
        got = got + last(*first(tokens[i:i + 1], **kw), **kw).sum() * weight[i]
    got_grads = torch.autograd.grad(got, params, allow_unused=True)
    want = 0.0
    cos, sin = model.rope_tables(0, 6, "cpu")
    for i in range(2):
        h = model.final_norm(*model.blocks(model.embed(tokens[i:i + 1]), None, cos, sin))
        want = want + model.head_loss(h, labels[i:i + 1], reduction="sum")[1] / n
    want_grads = torch.autograd.grad(want, params, allow_unused=True)
    # the value: the last stage's output plus the first stage's terms, reported beside it (attached terms act in
    # the backward pass only)
    torch.testing.assert_close(got.detach() + sum(first.aux_reported), want.detach(), rtol=1e-15, atol=0)
    for a, b in zip(got_grads, want_grads):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-15 * float(b.abs().max()))
