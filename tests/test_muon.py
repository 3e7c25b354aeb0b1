"""Muon (zero2all/train/muon.py): the Newton-Schulz iteration against float64 SVD references, the parameter split,
the update rule against a plain re-derivation, training and resume through the trainer, and the distributed runs
(DDP, FSDP2, tp2) against one process in float64."""

from __future__ import annotations

import math

import pytest
import torch

from zero2all.train.muon import Muon, muon_param_groups, newton_schulz, ns_singular_value, orthogonalize, update_scale


def _matrix(m, n, cond=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, n, generator=g, dtype=torch.float64)
    if cond is None:
        return a
    u, _, vh = torch.linalg.svd(a, full_matrices=False)
    s = torch.logspace(0, -math.log10(cond), min(m, n), dtype=torch.float64)
    return u @ torch.diag(s) @ vh


@pytest.mark.parametrize("shape,cond", [((37, 23), None), ((23, 37), None), ((31, 31), 1e6), ((5, 41), 1e3)])
def test_newton_schulz_is_the_scalar_polynomial_on_the_svd(shape, cond):
    """X = U f(S / ||G||_F) V^T exactly (the iteration is an odd polynomial: it keeps the singular vectors), and
    singular values above 3e-3 of the norm land in [0.68, 1.21] (near the polar factor U V^T)."""
    g = _matrix(*shape, cond=cond)
    x = newton_schulz(g, steps=5, eps=0.0)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    fs = ns_singular_value(s / torch.linalg.matrix_norm(g), 5)
    want = u @ torch.diag(fs) @ vh
    err = float((x - want).abs().max())
    assert err < 1e-12, err
    big = s / s.norm() >= 3e-3
    assert bool(((fs[big] > 0.68) & (fs[big] < 1.21)).all()), fs
    # the polar factor's singular vectors: U^T X V is diagonal
    core = u.mT @ x @ vh.mT
    assert float((core - torch.diag(torch.diagonal(core))).abs().max()) < 1e-12


def test_newton_schulz_batches_stacked_experts_and_pieces():
    g = torch.randn(3, 10, 6, dtype=torch.float64)
    got = newton_schulz(g)
    for e in range(3):
        torch.testing.assert_close(got[e], newton_schulz(g[e]), rtol=0, atol=1e-14)
    o = orthogonalize(g[0], (4, 6), 5, "spectral")
    torch.testing.assert_close(o[:4], newton_schulz(g[0, :4]) * 1.0, rtol=0, atol=1e-14)
    torch.testing.assert_close(o[4:], newton_schulz(g[0, 4:]) * 1.0, rtol=0, atol=1e-14)
    assert update_scale(4, 6, "spectral") == 1.0 and update_scale(12, 3, "spectral") == 2.0
    assert update_scale(64, 16, "rms") == pytest.approx(0.2 * 8)


def test_param_split_puts_the_blocks_matrices_under_muon():
    from zero2all.config import load_config
    from zero2all.model.z2all import Z2all

    cfg = load_config("tiny-moe", ["train.optimizer='muon'"])
    model = Z2all(cfg.model)
    groups = muon_param_groups(model, cfg.train)
    muon = groups[0]
    assert muon["kind"] == "muon"
    assert all(".layers." in f".{n}" and "router" not in n for n in muon["names"])
    others = [n for g in groups[1:] for n in g["names"]]
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight"} <= set(others)
    assert any("router" in n for n in others)
    pieces = dict(zip(muon["names"], muon["pieces"]))
    m = cfg.model
    hd = m.hidden_dim // m.n_heads
    assert pieces["layers.0.self_attn.qkv_proj.weight"] == (m.n_heads * hd, m.n_kv_heads * hd, m.n_kv_heads * hd)
    assert pieces["layers.1.mlp.experts.gate_up_proj"] == (176, 176)
    assert pieces["layers.0.self_attn.o_proj.weight"] is None


def test_one_step_follows_the_written_rule():
    """Two Muon steps on one matrix against the rule written out by hand (Nesterov momentum, decoupled decay)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 7, dtype=torch.float64))
    w0 = w.detach().clone()
    opt = Muon([{"params": [w], "kind": "muon", "pieces": [None], "weight_decay": 0.1, "lr_ratio": 2.0}], lr=0.01,
               momentum=0.9, scale="rms")
    grads = [torch.randn(12, 7, dtype=torch.float64) for _ in range(2)]
    m = torch.zeros_like(w0)
    want = w0.clone()
    for g in grads:
        w.grad = g.clone()
        opt.step()
        m = 0.9 * m + g
        u = g + 0.9 * m
        want = want * (1 - 0.02 * 0.1) - 0.02 * 0.2 * math.sqrt(12) * newton_schulz(u)
    torch.testing.assert_close(w.detach(), want, rtol=0, atol=1e-14)


def test_adamw_part_matches_torch_adamw():
    torch.manual_seed(1)
    a = torch.nn.Parameter(torch.randn(9, 5, dtype=torch.float64))
    b = torch.nn.Parameter(a.detach().clone())
    ours = Muon([{"params": [a], "kind": "adamw", "weight_decay": 0.1, "lr_ratio": 1.0}], lr=0.01)
    ref = torch.optim.AdamW([b], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(9, 5, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-15)


def test_muon_is_refused_with_zero1():
    from zero2all.config import ConfigError, load_config
    from zero2all.distributed.plan import resolve

    with pytest.raises(ConfigError, match="muon.*zero1"):
        resolve(load_config("tiny", ["train.optimizer='muon'", "parallel.mode='zero1'"]), 2)
    with pytest.raises(ConfigError, match="train.optimizer"):
        load_config("tiny", ["train.optimizer='sgd'"]).validate()


MUON = ["train.optimizer='muon'", "train.muon_lr=0.02", "train.muon_scale='spectral'", "train.max_steps=6"]


def test_trainer_with_muon_learns_and_resumes_exactly(tmp_path):
    """One process, float64: Muon trains (the loss falls faster than nothing), and a run stopped at step 3 and
    resumed (momentum buffers and AdamW moments from the checkpoint) ends on the same parameters as the run
    without a stop."""
    from equivalence import train

    want = train(tmp_path / "straight", *MUON, "train.micro_batch_size=4")
    assert want.losses[-1] < want.losses[0] - 0.1, want.losses
    train(tmp_path / "stopped", *MUON, "train.micro_batch_size=4", "train.max_steps=3", "train.ckpt_every=3")
    ckpt = sorted((tmp_path / "stopped").glob("ckpt-*"))[-1]
    got = train(tmp_path / "resumed", *MUON, "train.micro_batch_size=4", f"train.resume='{ckpt}'")
    for name, w in want.params.items():
        assert torch.equal(got.params[name], w), name


@pytest.mark.slow
def test_muon_under_ddp_fsdp2_tp2_and_pp2_matches_one_process(tmp_path):
    """2 gloo processes, float64, the same global batch: DDP, FSDP2 (each rank gathers the whole update of a
    matrix), tp2 + SP (fused q/k/v and gate/up rows rank-major: put back in order before the split) and pp2."""
    from equivalence import assert_equivalent, launch, train

    torch.set_num_threads(1)
    want = train(tmp_path / "single", *MUON, "train.micro_batch_size=4")
    runs = {"muon, ddp": ["train.micro_batch_size=2", "parallel.mode='ddp'"],
            "muon, fsdp2": ["train.micro_batch_size=2", "parallel.mode='fsdp'"],
            "muon, tp2 + SP": ["train.micro_batch_size=4", "parallel.tp=2", "parallel.sequence_parallel=true"],
            "muon, pp2": ["train.micro_batch_size=4", "parallel.pp=2", "parallel.pp_schedule='1f1b'",
                          "parallel.pp_microbatches=2"]}
    got = launch(tmp_path / "mesh", 2, [[*MUON, *r] for r in runs.values()])
    for what, run in zip(runs, got):
        assert_equivalent(run, want, what)


def test_muon_with_fp8_linears_on_the_cpu_reference_path(tmp_path):
    """Muon over FP8 linears (tensorwise, the CPU reference path; float32 master weights): it learns as it does in
    float32, the quantisation really ran (the losses differ from the float32 run's), and a stop + resume ends on
    the same parameters bit for bit (Muon's momentum and the FP8 state both come back from the checkpoint)."""
    from equivalence import train

    fp8 = ["train.precision='fp32'", "model.ops.linear_precision='fp8_tensorwise'", "train.micro_batch_size=4"]
    plain = train(tmp_path / "fp32", *MUON, "train.precision='fp32'", "train.micro_batch_size=4")
    want = train(tmp_path / "straight", *MUON, *fp8)
    assert want.losses[-1] < want.losses[0] - 0.1, want.losses
    diffs = [abs(a - b) for a, b in zip(want.losses, plain.losses)]
    assert 0 < max(diffs) < 0.05 * plain.losses[0], (want.losses, plain.losses)
    train(tmp_path / "stopped", *MUON, *fp8, "train.max_steps=3", "train.ckpt_every=3")
    ckpt = sorted((tmp_path / "stopped").glob("ckpt-*"))[-1]
    got = train(tmp_path / "resumed", *MUON, *fp8, f"train.resume='{ckpt}'")
    for name, w in want.params.items():
        assert w.dtype == torch.float32 and torch.equal(got.params[name], w), name
