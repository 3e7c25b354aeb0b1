"""The shared training loop: schedules, weight-decay groups, accumulation, fp16 loss scaling, logging outputs."""

import json
import math
from pathlib import Path

import pytest
import torch

from zero2all.cli import main
from zero2all.config import ConfigError, load_config
from zero2all.data.synthetic import SyntheticDataset
from zero2all.model.io import load_model
from zero2all.train.objectives import Objective, PretrainObjective
from zero2all.train.optim import DynamicLossScaler, LRSchedule, param_groups
from zero2all.train.trainer import Trainer, sample_continuation

TINY_MODEL = ["model.vocab_size=96", "model.hidden_dim=32", "model.intermediate_size=72", "model.n_layers=2",
              "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=24", "model.ops.rmsnorm='torch'",
              "model.ops.rope='torch'", "model.ops.swiglu='torch'", "model.ops.cross_entropy='torch'"]


def tiny_overrides(out_dir, *overrides) -> list[str]:
    """The key=value overrides of the tests' tiny run (on top of the defaults, no preset)."""
    return TINY_MODEL + [f"train.out_dir='{out_dir}'", "train.device='cpu'", "train.precision='fp32'",
                         "train.tensorboard=false", "train.max_steps=6", "train.warmup_steps=2", "train.lr=3e-3",
                         "train.min_lr=3e-4", "train.eval_every=0", "train.ckpt_every=0", "train.num_samples=0",
                         "train.log_every=0"] + list(overrides)


def tiny_cfg(out_dir, *overrides):
    return load_config(None, tiny_overrides(out_dir, *overrides))


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ schedules


def test_cosine_schedule_values():
    s = LRSchedule("cosine", lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert s.lr_at(0) == pytest.approx(0.1)          # (0 + 1) / 10
    assert s.lr_at(4) == pytest.approx(0.5)
    assert s.lr_at(9) == pytest.approx(1.0)          # last warmup step reaches the peak
    assert s.lr_at(59) == pytest.approx(0.55)        # p = 0.5: halfway between peak and floor
    assert s.lr_at(34) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.25)))
    assert s.lr_at(109) == pytest.approx(0.1)        # last step reaches min_lr
    values = [s.lr_at(i) for i in range(10, 110)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_and_constant_schedule_values():
    s = LRSchedule("wsd", lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100, decay_fraction=0.2)
    assert s.lr_at(0) == pytest.approx(0.1)
    assert s.lr_at(10) == s.lr_at(50) == s.lr_at(79) == 1.0   # stable phase
    assert s.lr_at(80) == pytest.approx(1.0 - 0.9 / 20)       # first decay step
    assert s.lr_at(89) == pytest.approx(0.55)
    assert s.lr_at(99) == pytest.approx(0.1)
    c = LRSchedule("constant", lr=2.0, min_lr=0.0, warmup_steps=4, max_steps=10)
    assert [c.lr_at(i) for i in (0, 3, 4, 9)] == [0.5, 2.0, 2.0, 2.0]


def test_schedule_rejects_bad_values():
    with pytest.raises(ConfigError, match="train.schedule"):
        LRSchedule("linear", 1.0, 0.1, 0, 10)
    with pytest.raises(ConfigError, match="train.warmup_steps"):
        LRSchedule("cosine", 1.0, 0.1, -1, 10)
    assert LRSchedule("cosine", 1.0, 0.1, 20, 10).lr_at(9) == pytest.approx(0.5)  # warmup longer than the run
    with pytest.raises(ConfigError, match="train.min_lr"):
        LRSchedule("cosine", 1.0, 2.0, 0, 10)


def test_warmup_longer_than_the_run_is_warned(tmp_path, capsys):
    """The LR never reaches train.lr when warmup_steps > max_steps: the run says so at its start."""
    s = LRSchedule("cosine", 1.0, 0.1, 20, 10)
    assert "train.warmup_steps=20" in s.warning() and "50%" in s.warning()  # peak lr_at(9) = 10/20 of lr
    assert LRSchedule("cosine", 1.0, 0.1, 10, 10).warning() is None            # the last step reaches the peak
    assert LRSchedule("cosine", 1.0, 0.1, 0, 10).warning() is None
    Trainer(tiny_cfg(tmp_path, "train.max_steps=2", "train.warmup_steps=8"), show_progress=False).fit()
    out = capsys.readouterr().out
    assert ("warning: train.warmup_steps=8 is longer than the run (train.max_steps=2): the learning rate peaks "
            "at 25% of train.lr=0.003\n") in out
    Trainer(tiny_cfg(tmp_path / "b", "train.max_steps=2", "train.warmup_steps=2"), show_progress=False).fit()
    assert "warning: train.warmup_steps" not in capsys.readouterr().out


class _FakeClock:
    """The clock ``train.time_budget_s`` reads, advanced by ``per_update`` seconds at each training update."""

    def __init__(self, trainer_module, monkeypatch, per_update: float):
        self.now, self.per_update = 128.0, per_update
        monkeypatch.setattr(trainer_module, "wall_clock", lambda: self.now)

    def wrap(self, trainer):
        step = trainer.train_step

        def timed_step():
            self.now += self.per_update(trainer.step) if callable(self.per_update) else self.per_update
            return step()

        trainer.train_step = timed_step
        return trainer


def test_time_budget_fixes_the_schedule_from_the_measured_rate(tmp_path, monkeypatch, capsys):
    """0.125 s per update and a 3.5 s budget: after warmup and 10 timed updates (1.375 s used) the run fixes its
    length at 11 + 2.125 / 0.125 = 28 updates, the cosine schedule ends there (min_lr at the last update) and the
    checkpoints record that length, so a resume continues the same schedule."""
    import zero2all.train.trainer as trainer_module

    clock = _FakeClock(trainer_module, monkeypatch, 0.125)
    cfg = tiny_cfg(tmp_path, "train.max_steps=1000", "train.warmup_steps=4", "train.time_budget_s=3.5",
                   "train.ckpt_every=20")
    trainer = clock.wrap(Trainer(cfg, show_progress=False))
    trainer.fit()
    out = capsys.readouterr().out
    assert "time budget 3.5 s: 125 ms per update measured over updates 2-11 -> 28 updates in all" in out
    assert trainer.step == trainer.budget_steps == trainer.schedule.max_steps == 28
    lrs = [r["lr"] for r in (json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines())
           if r.get("kind") == "train"]
    assert len(lrs) == 28 and lrs[-1] == pytest.approx(3e-4) and lrs[3] == pytest.approx(3e-3)
    saved = json.loads((tmp_path / "ckpt-000020" / "config.json").read_text())
    assert saved["train"]["max_steps"] == 28
    # a resume of the budgeted run keeps the fixed length (from the counters), not train.max_steps
    resumed = Trainer(tiny_cfg(tmp_path, "train.max_steps=1000", "train.warmup_steps=4", "train.time_budget_s=3.5",
                               f"train.resume='{tmp_path / 'ckpt-000020'}'"),
                      show_progress=False)
    resumed._maybe_resume()
    assert resumed.step == 20 and resumed.tcfg.max_steps == 28 and resumed.schedule.max_steps == 28


def test_time_budget_stops_when_the_time_is_up(tmp_path, monkeypatch, capsys):
    """Updates that slow down after the length was fixed (0.125 s, then 0.375 s): the run stops when the budget is
    spent, before the planned length, and still writes its final model."""
    import zero2all.train.trainer as trainer_module

    clock = _FakeClock(trainer_module, monkeypatch, lambda step: 0.125 if step < 12 else 0.375)
    cfg = tiny_cfg(tmp_path, "train.max_steps=1000", "train.warmup_steps=0", "train.time_budget_s=3.5")
    trainer = clock.wrap(Trainer(cfg, show_progress=False))
    summary = trainer.fit()
    out = capsys.readouterr().out
    assert "-> 28 updates in all" in out
    # 1.5 s after 12 updates, then 0.375 s each: the 3.5 s are spent at update 18
    assert "time budget of 3.5 s used up after update 18 (of 28)" in out and trainer.step == 18
    assert Path(summary["final"]).is_dir()


@pytest.mark.parametrize("counts", ["all", "training"])
def test_time_budget_counts_training_only_when_asked(tmp_path, monkeypatch, capsys, counts):
    """Evaluations of 1 s every 5 updates (and one at the start), 0.125 s per update, a 3.5 s budget: counting
    training only, the run is the 28 updates of the budget without evaluations (they are left off its clock);
    counting all, the evaluations spend the budget and the run is shorter."""
    import zero2all.train.trainer as trainer_module

    clock = _FakeClock(trainer_module, monkeypatch, 0.125)
    cfg = tiny_cfg(tmp_path, "train.max_steps=1000", "train.warmup_steps=4", "train.time_budget_s=3.5",
                   "train.eval_every=5", f"train.time_budget_counts='{counts}'")
    trainer = clock.wrap(Trainer(cfg, show_progress=False))
    evaluate = trainer.evaluate

    def slow_evaluate(*a, **k):
        clock.now += 1.0
        return evaluate(*a, **k)
    trainer.evaluate = slow_evaluate
    trainer.fit()
    out = capsys.readouterr().out
    if counts == "training":
        assert "-> 28 updates in all" in out and trainer.step == 28
        assert trainer.wall_s == pytest.approx(3.5)
    else:
        assert trainer.step == 10 and trainer.wall_s == pytest.approx(4.25)  # 1 + 10 x 0.125 + 2 evaluations


# ------------------------------------------------------------------------------------------------ optimiser


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_weight_decay_groups(decay_embeddings):
    from zero2all.model.z2all import build_model

    cfg = load_config(None, TINY_MODEL + ["model.attention_bias=true"]).model
    model = build_model(cfg, seed=0)
    groups = param_groups(model, 0.1, decay_embeddings)
    decay, no_decay = (set(g["names"]) for g in groups)
    assert ("embed_tokens.weight" in decay) == decay_embeddings
    assert "lm_head.weight" in decay and "layers.0.self_attn.qkv_proj.weight" in decay
    assert "layers.1.mlp.down_proj.weight" in decay
    assert "norm.weight" in no_decay and "layers.0.input_layernorm.weight" in no_decay
    assert "layers.0.self_attn.qkv_proj.bias" in no_decay
    assert sum(p.numel() for g in groups for p in g["params"]) == model.num_params()
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0


def test_tied_embeddings_are_grouped_once():
    from zero2all.model.z2all import build_model

    model = build_model(load_config(None, TINY_MODEL + ["model.tie_word_embeddings=true"]).model, seed=0)
    groups = param_groups(model, 0.1, decay_embeddings=False)
    names = [n for g in groups for n in g["names"]]
    assert "embed_tokens.weight" in groups[1]["names"] and "lm_head.weight" not in names
    assert sum(p.numel() for g in groups for p in g["params"]) == model.num_params()


# ------------------------------------------------------------------------------------------------ the loop


def test_start_of_run_prints(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path, "train.micro_batch_size=2", "train.grad_accum_steps=16", "train.max_steps=1")
    trainer = Trainer(cfg, show_progress=False)
    trainer.fit()
    out = capsys.readouterr().out
    assert "tokens per iteration will be: 768\n" in out
    assert "breaks down as: 16 grad accum steps * 1 data-parallel ranks * 2 micro-batch size * 24 max seq len" in out
    # 2 layers x (qkv 32x64, o 32x32, gate_up 32x144, down 72x32) + lm_head 96x32; embedding 96x32 + 5 norms of 32
    assert "\ndecayed parameter tensors: 9, with 23,040 parameters\n" in out
    assert "\nnon-decayed parameter tensors: 6, with 3,232 parameters\n" in out


def test_grad_accumulation_equivalence(tmp_path):
    """4 micro-batches of 2 with accumulation == one batch of 8 (fp32): same losses and weights."""
    runs = {}
    for accum, bs in ((4, 2), (1, 8)):
        cfg = tiny_cfg(tmp_path / f"a{accum}", f"train.grad_accum_steps={accum}", f"train.micro_batch_size={bs}",
                       "train.max_steps=4")
        trainer = Trainer(cfg, show_progress=False)
        losses = [trainer.train_step()["loss"] for _ in range(4)]
        runs[accum] = (losses, weights(trainer.raw_model), trainer.tokens_seen)
    (l4, w4, n4), (l1, w1, n1) = runs[4], runs[1]
    assert n4 == n1 == 4 * 8 * 24
    assert l4 == pytest.approx(l1, rel=1e-5, abs=1e-6)
    for k in w1:
        torch.testing.assert_close(w4[k], w1[k], rtol=1e-4, atol=1e-5, msg=k)
    assert not torch.equal(w1["lm_head.weight"], Trainer(tiny_cfg(tmp_path / "fresh")).raw_model.lm_head.weight)


def test_loss_falls_and_outputs_are_written(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "train.max_steps=40", "train.micro_batch_size=8", "train.eval_every=20",
                   "train.eval_batches=2", "train.num_samples=2", "train.sample_new_tokens=5",
                   "train.tensorboard=true", "train.ckpt_every=20", "train.log_every=10")
    summary = Trainer(cfg, show_progress=False).fit()
    out = tmp_path / "run"
    assert summary["last_loss_mean"] < summary["first_loss_mean"] - 0.5  # learnable synthetic sequences
    assert summary["last_eval_loss"] < summary["first_eval_loss"]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 41))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "peak_mem_bytes"):
        assert key in train[0]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 20, 40] and evals[-1]["ppl"] == pytest.approx(math.exp(evals[-1]["loss"]))
    assert sum(r["kind"] == "sample" for r in recs) == 2
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "train loss, last" in report and "loss.png" in report
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    # the final model and each checkpoint load as plain model directories
    model = load_model(out / "final")
    ckpt_model = load_model(out / "ckpt-000040")
    tokens = torch.randint(0, 96, (1, 10))
    torch.testing.assert_close(model(tokens)[0], ckpt_model(tokens)[0], rtol=0, atol=0)


class InjectInfObjective(Objective):
    """Pretraining loss, but the gradient of update ``bad_update`` (0-based call group) overflows."""

    name = "pretrain-with-overflow"

    def __init__(self, bad_update: int, accum: int):
        self.inner, self.calls, self.bad_update, self.accum = PretrainObjective(), 0, bad_update, accum

    def loss(self, model, batch):
        loss, metrics = self.inner.loss(model, batch)
        update = self.calls // self.accum
        self.calls += 1
        if update == self.bad_update:
            loss = loss * float("inf")
        return loss, metrics


def test_dynamic_loss_scaler_logic():
    s = DynamicLossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    assert s.update(found_inf=True) is False and s.scale == 512.0 and s.skipped_steps == 1
    assert [s.update(found_inf=False) for _ in range(3)] == [True] * 3 and s.scale == 1024.0
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2048.0)
    s.unscale_([p])
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    off = DynamicLossScaler(enabled=False)
    assert off.scale == 1.0 and off.update(found_inf=True) is False and off.update(found_inf=False) is True


def test_fp16_skips_overflowing_step_and_recovers(tmp_path):
    cfg = tiny_cfg(tmp_path, "train.precision='fp16'", "train.grad_accum_steps=2", "train.max_steps=5")
    trainer = Trainer(cfg, objective=InjectInfObjective(bad_update=1, accum=2), show_progress=False)
    assert trainer.scaler.enabled and trainer.scaler.scale == 2.0 ** 16
    r1 = trainer.train_step()
    w1, opt_steps = weights(trainer.raw_model), trainer.optimizer.state_dict()["state"][0]["step"].item()
    r2 = trainer.train_step()                         # gradients are inf/nan: no update, scale halved
    assert r2["skipped"] and r2["skipped_total"] == 1 and not math.isfinite(r2["grad_norm"])
    assert r2["loss_scale"] == 2.0 ** 15
    w2 = weights(trainer.raw_model)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert trainer.optimizer.state_dict()["state"][0]["step"].item() == opt_steps
    assert all(p.grad is None for p in trainer.raw_model.parameters())
    r3 = trainer.train_step()                         # recovers: finite, applied
    assert not r3["skipped"] and math.isfinite(r3["grad_norm"]) and math.isfinite(r3["loss"])
    assert r3["loss_scale"] == 2.0 ** 15 and r3["skipped_total"] == 1
    assert not torch.equal(w2["lm_head.weight"], trainer.raw_model.lm_head.weight)
    assert not r1["skipped"] and r1["loss_scale"] == 2.0 ** 16


def test_skipped_step_is_logged(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path, "train.precision='fp16'", "train.max_steps=3")
    Trainer(cfg, objective=InjectInfObjective(bad_update=1, accum=1), show_progress=False).fit()
    assert "SKIPPED (non-finite gradients; 1 so far)" in capsys.readouterr().out
    assert "| skipped steps (non-finite gradients) | 1 |" in (tmp_path / "report.md").read_text()


def test_synthetic_batches_concatenate_and_ranks_are_disjoint():
    ds = SyntheticDataset(50, 7)
    big = next(ds.iterator(8, seed=3))
    it = ds.iterator(2, seed=3)
    small = [next(it) for _ in range(4)]
    assert torch.equal(torch.cat([b["input_ids"] for b in small]), big["input_ids"])
    assert torch.equal(big["labels"][:, :-1], big["input_ids"][:, 1:])
    r0 = next(SyntheticDataset(50, 7, rank=0, world_size=2).iterator(4, seed=3))["input_ids"]
    r1 = next(SyntheticDataset(50, 7, rank=1, world_size=2).iterator(4, seed=3))["input_ids"]
    assert torch.equal(r0[0], big["input_ids"][0]) and torch.equal(r1[0], big["input_ids"][1])
    it2 = ds.iterator(2, seed=3)
    it2.load_state_dict(it.state_dict())
    assert torch.equal(next(it2)["input_ids"], next(it)["input_ids"])


def test_sampler_with_cache_matches_full_forward():
    from zero2all.model.z2all import build_model

    model = build_model(load_config(None, TINY_MODEL).model, seed=1).eval()
    prompt = [5, 17, 3]
    new = sample_continuation(model, prompt, 6, temperature=0.0)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):  # greedy without a cache: re-run the whole sequence each time
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    assert new == ids[3:]
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert sample_continuation(model, prompt, 6, 1.0, 10, g1) == sample_continuation(model, prompt, 6, 1.0, 10, g2)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="train.grad_accum_steps"):
        Trainer(tiny_cfg(tmp_path, "train.grad_accum_steps=0"))
    with pytest.raises(ConfigError, match="train.precision"):
        Trainer(tiny_cfg(tmp_path, "train.precision='fp8'"))
    with pytest.raises(ConfigError, match="data.seq_len"):
        Trainer(tiny_cfg(tmp_path, "data.seq_len=100"))


def test_pretrain_command(tmp_path, capsys):
    args = ["pretrain", "--config", "tiny", "--out", str(tmp_path / "cli"), "--device", "cpu"] + TINY_MODEL + [
        "train.max_steps=3", "train.micro_batch_size=2", "train.warmup_steps=1", "train.tensorboard=false",
        "train.sample_new_tokens=3", "train.num_samples=1", "train.eval_batches=1"]
    assert main(args) == 0
    assert (tmp_path / "cli" / "ckpt-000003").is_dir() and (tmp_path / "cli" / "report.md").exists()
    assert main(args) == 2  # the out dir holds checkpoints and --resume was not given
    assert "--resume auto" in capsys.readouterr().err
    assert main(args[:1] + ["--resume", "auto"] + args[1:] + ["train.max_steps=5"]) == 0
    assert (tmp_path / "cli" / "ckpt-000005").is_dir()


def test_logged_mfu_matches_the_formula(tmp_path):
    """With a configured peak (here on the CPU), MFU = tokens/s * (6N + 6 L H T) / peak, N non-embedding."""
    cfg = tiny_cfg(tmp_path, "train.gpu_peak_flops=1e12", "train.micro_batch_size=3", "train.max_steps=2")
    trainer = Trainer(cfg, show_progress=False)
    rec = trainer.train_step()
    n = sum(p.numel() for name, p in trainer.raw_model.named_parameters() if name != "embed_tokens.weight")
    flops_per_token = 6 * n + 6 * 2 * 32 * 24
    assert rec["tokens_per_s"] == pytest.approx(3 * 24 / rec["step_time_s"])
    assert rec["mfu"] == pytest.approx(rec["tokens_per_s"] * flops_per_token / 1e12, rel=1e-9)
    assert Trainer(tiny_cfg(tmp_path / "b"), show_progress=False).train_step()["mfu"] is None  # CPU: no peak


# ------------------------------------------------------------------------------------------------ float64


def test_fp64_is_refused_on_a_gpu_and_with_fp8_with_the_reason(tmp_path):
    from zero2all.train.trainer import resolve_precision

    with pytest.raises(ConfigError, match=r"train.precision = 'fp64' runs on the CPU only .* set train.device = "
                                          r"'cpu' \(it is 'cuda'\)"):
        tiny_cfg(tmp_path, "train.precision='fp64'", "train.device='cuda'").validate(1)
    with pytest.raises(ConfigError, match="runs on the CPU only"):   # device auto that resolved to a GPU
        resolve_precision("fp64", torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="fp64' with model.ops.linear_precision = 'fp8_rowwise'"):
        tiny_cfg(tmp_path, "train.precision='fp64'", "model.ops.linear_precision='fp8_rowwise'").validate(1)
    assert resolve_precision("fp64", torch.device("cpu")) == "fp64"


def test_fp64_trains_parameters_activations_and_optimizer_state_in_float64(tmp_path):
    """With fp64 everything is float64, and the ops asked to run Triton kernels (which compute in float32 at best)
    take their plain references: the same loss as the all-plain model, to float64 rounding."""
    from zero2all.model.z2all import build_model

    fused = ["model.ops.rmsnorm='triton'", "model.ops.rope='triton'", "model.ops.swiglu='triton'",
             "model.ops.fused_linear='triton'", "model.ops.cross_entropy='fused'"]
    cfg = tiny_cfg(tmp_path / "run", "train.precision='fp64'", "train.max_steps=1", *fused)
    trainer = Trainer(cfg, show_progress=False)
    seen = []
    trainer.raw_model.layers[0].register_forward_hook(lambda m, i, o: seen.append(o[0].dtype))
    trainer.fit()
    assert seen and set(seen) == {torch.float64}
    assert {p.dtype for p in trainer.raw_model.parameters()} == {torch.float64}
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if t.is_floating_point() and t.dim()]
    assert state and {t.dtype for t in state} == {torch.float64}
    # the fused ops fall back to the plain references in float64: the plain model's loss
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    plain_cfg = tiny_cfg(tmp_path / "plain", "train.precision='fp64'").model
    losses = []
    for model_cfg in (cfg.model, plain_cfg):
        model = build_model(model_cfg, seed=3, dtype=torch.float64)
        losses.append(model(tokens[:, :-1], tokens[:, 1:])[1].detach())
    assert losses[0].dtype == torch.float64
    assert abs(float(losses[0]) - float(losses[1])) <= 1e-14 * float(losses[1])
