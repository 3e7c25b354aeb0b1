"""Pipeline parallelism (zero2all/distributed/pp.py): stage balancing, the refusals, and the trainer on 2 and 4
gloo processes (CPU, fp32) against the single-process loss sequence of the same global batch.

One launch of 2 processes trains pp2 with every schedule (GPipe, 1F1B, interleaved 1F1B with 2 stages per rank,
interleaved zero bubble: torch's ScheduleInterleavedZeroBubble) for 20 steps; the 1F1B run also validates through
the forward-only schedule and writes a checkpoint at step 10 that one process resumes, continuing the same
sequence. pp2 x dp2 on 4 processes: test_parallel_pp_dp.py.

Bound: relative difference <= 1e-5 per step. The pipeline computes each micro-batch's loss as a sum over its
pipeline microbatches of (token-loss sum / the micro-batch's valid tokens), the single process as one mean:
the same numbers summed in another order (fp32 rounding, ~1e-7), which AdamW carries through 20 steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_distributed import free_port, gloo_worker

from zero2all.config import ConfigError, ModelConfig, ParallelConfig, check_mesh, load_config
from zero2all.distributed.pp import split_layers, stage_layout, stage_rank, unit_costs

STEPS, CKPT_AT = 20, 10
EVAL = ["train.eval_every=10", "train.eval_batches=2"]  # validation losses at steps 0, 10 and 20
LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4   # the norm is a square root of per-stage sums of squares: a little more rounding than the loss
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]

BASE = ["model.vocab_size=64", "model.hidden_dim=32", "model.intermediate_size=64", "model.n_layers=4",
        "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=16", "model.ops.rmsnorm='torch'",
        "model.ops.rope='torch'", "model.ops.swiglu='torch'", "model.ops.cross_entropy='torch'",
        "model.ops.fused_linear='torch'", "model.ops.attention='sdpa'", "train.grad_accum_steps=2",
        f"train.max_steps={STEPS}", "train.eval_every=0", "train.sample_every=0", "train.num_samples=0",
        "train.tensorboard=false", "train.warmup_steps=2", "train.lr=0.01", "train.device='cpu'",
        "train.keep_last=0", "train.schedule='constant'", "train.precision='fp32'", "train.eval_batches=0",
        "train.log_every=0", "train.grad_clip=0.5"]


def losses(out: Path) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) of every step: the norm catches a wrongly scaled gradient, which
    AdamW's updates (invariant to a constant gradient scale) would hide from the losses."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["loss"], r["grad_norm"]) for r in sorted((r for r in recs if r.get("kind") == "train"),
                                                         key=lambda r: r["step"])]


def eval_losses(out: Path) -> list[float]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in recs if r.get("kind") == "eval" and "loss" in r]


def assert_same(got: list[tuple], want: list[tuple], what: str, first_step: int = 1) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} steps vs {len(want)}"
    for i, ((g, gn), (w, wn)) in enumerate(zip(got, want)):
        assert abs(g - w) <= LOSS_RTOL * abs(w), f"{what}, step {first_step + i}: loss {g} vs {w}"
        assert abs(gn - wn) <= NORM_RTOL * abs(wn), f"{what}, step {first_step + i}: grad norm {gn} vs {wn}"


def train(out: Path, *overrides: str) -> list[tuple[float, float]]:
    from zero2all.train.trainer import Trainer

    cfg = load_config("tiny", BASE + [f"train.out_dir='{out}'", *overrides])
    Trainer(cfg, show_progress=False).fit()
    return losses(out)


# ------------------------------------------------------------------------------------------------ processes


def _entry(rank: int, world: int, port: int, out: str, runs: list[list[str]]):
    def work(env):
        for i, overrides in enumerate(runs):
            train(Path(out) / f"run{i}", *overrides)

    gloo_worker(rank, world, port, out, work, timeout_s=120.0)


def launch(out: Path, world: int, runs: list[list[str]]) -> list[list[tuple[float, float]]]:
    mp.spawn(_entry, args=(world, free_port(), str(out), runs), nprocs=world, join=True)
    return [losses(out / f"run{i}") for i in range(len(runs))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[tuple[float, float]], list[float]]:
    """One process, micro-batch 4 x accumulation 2: the loss sequence every mesh must reproduce."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("single")
    return train(out, "train.micro_batch_size=4", *EVAL), eval_losses(out)


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


def test_explicit_split_overrides_the_flop_balance_and_is_checked():
    cfg = load_config("tiny", BASE + ["parallel.pp=2", "parallel.pp_split=[3, 1]", "train.micro_batch_size=4"])
    assert cfg.parallel.pp_split == [3, 1]
    assert stage_layout(cfg.model, cfg.parallel, 16) == [[0, 1, 2], [3]]
    check_mesh(cfg.model, cfg.train, cfg.parallel, 2)
    interleaved = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, pp_split=[1, 1, 1, 1])
    assert stage_layout(cfg.model, interleaved, 16) == [[0], [1], [2], [3]]
    for split, what in (([2, 1], "summing to 3"), ([4, 0, 0], "got 3 summing to 4"), ([4, 0], "each >= 1")):
        with pytest.raises(ConfigError, match=rf"pp_split=\[{split[0]}.*{what}"):
            check_mesh(cfg.model, cfg.train, ParallelConfig(pp=2, pp_split=split), 2)
    with pytest.raises(ConfigError, match="needs parallel.pp > 1"):
        check_mesh(cfg.model, cfg.train, ParallelConfig(pp_split=[4]), 1)


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


def test_last_stage_loss_is_the_token_sum_even_without_valid_tokens():
    """The last stage returns sum over valid tokens of the cross-entropy, on the device-count path (every
    microbatch has valid tokens) and on the host-count path (one has none: an exact zero, zero gradients)."""
    import torch.nn.functional as F

    from zero2all.distributed.pp import token_loss_sum

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    h = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, :3] = -100
    want = F.cross_entropy(head(h).flatten(0, 1), labels.reshape(-1), ignore_index=-100, reduction="sum")
    (grad_want,) = torch.autograd.grad(want, h)
    for every_valid in (True, False):
        got = token_loss_sum(h, head, labels, 0.0, "torch", every_valid)
        assert got.shape == (1,) and torch.allclose(got[0], want, rtol=1e-6)
        (grad,) = torch.autograd.grad(got.sum(), h)
        assert torch.allclose(grad, grad_want, rtol=1e-5, atol=1e-7)
    empty = token_loss_sum(h, head, torch.full_like(labels, -100), 0.0, "torch", False)
    assert empty.item() == 0.0 and not torch.autograd.grad(empty.sum(), h)[0].any()


def test_impossible_pipelines_are_refused_naming_the_numbers():
    cfg = load_config("tiny", BASE + ["parallel.pp=2", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match="pp_microbatches=2 is fewer than the 4 pipeline stages"):
        check_mesh(cfg.model, cfg.train, ParallelConfig(pp=2, pp_schedule="interleaved_1f1b",
                                                        pp_stages_per_rank=2, pp_microbatches=2), 2)
    with pytest.raises(ConfigError, match="n_layers=4"):
        check_mesh(cfg.model, cfg.train, ParallelConfig(pp=4, pp_schedule="zero_bubble", pp_stages_per_rank=2), 4)
    with pytest.raises(ConfigError, match="pp_microbatches=3 does not divide"):
        check_mesh(cfg.model, cfg.train, ParallelConfig(pp=2, pp_microbatches=3), 2)
    with pytest.raises(ConfigError, match="pp_stages_per_rank=2 needs"):
        ParallelConfig(pp=2, pp_stages_per_rank=2, pp_schedule="1f1b").validate(2)
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


@pytest.mark.slow
def test_pp2_every_schedule_matches_one_process_and_resumes_on_one(reference, tmp_path):
    runs = [["train.micro_batch_size=4", "parallel.pp=2", f"parallel.pp_schedule='{name}'",
             f"parallel.pp_stages_per_rank={v}", *(["train.ckpt_every=10", *EVAL] if name == "1f1b" else []),
             *(["parallel.pp_split=[1,3]"] if name == "gpipe" else []),   # an explicit, unbalanced split
             *(["parallel.pp_balance='time'"] if name == "1f1b" else [])]  # stages balanced by timing them
            for name, v in SCHEDULES]
    got = launch(tmp_path, 2, runs)
    reference, reference_eval = reference
    assert reference[-1][0] < reference[0][0] - 0.5  # training happens
    # validation through the pipeline's forward-only schedule gives the single process's validation losses
    pp_eval = eval_losses(tmp_path / "run1")
    assert len(pp_eval) == len(reference_eval) == 3
    assert pp_eval == pytest.approx(reference_eval, rel=LOSS_RTOL)
    for (name, v), seq in zip(SCHEDULES, got):
        assert_same(seq, reference, f"pp2 {name} (stages per rank {v})")
    # the pp2 checkpoint has the plain model's names, resumes on one process and continues the sequence
    ckpt = tmp_path / "run1" / f"ckpt-{CKPT_AT:06d}"
    one = tmp_path / "resumed"
    resumed = train(one, "train.micro_batch_size=4", f"train.resume='{ckpt}'")
    assert_same(resumed, reference[CKPT_AT:], "pp2 checkpoint resumed on one process", CKPT_AT + 1)
    # the model loader (export-hf, generate, eval) reads a pp2 checkpoint whole, and the pp2 run's final model
    # holds every stage's weights: both equal the one-process continuation's weights at step 20
    from safetensors.torch import load_file

    from zero2all.model.io import load_model

    want = load_file(str(one / "final" / "model.safetensors"))
    loaded = load_model(tmp_path / "run1" / f"ckpt-{STEPS:06d}").state_dict()
    final = load_file(str(tmp_path / "run1" / "final" / "model.safetensors"))
    assert set(loaded) == set(final) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(loaded[name], w, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(final[name], w, rtol=1e-4, atol=1e-6, msg=name)
