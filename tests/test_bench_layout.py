"""The layout rows of ``z2all bench train`` (``bench.layout_forward``): the model's own seams with activations kept
(batch, seq, hidden) or (seq, batch, hidden) compute the model's loss and gradients; only the strides differ."""

from __future__ import annotations

import pytest
import torch

from zero2all.bench import layout_forward
from zero2all.config import ModelConfig, MoEConfig, OpsConfig
from zero2all.model.z2all import build_model


def tiny(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=48, hidden_dim=32, intermediate_size=48, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=16, ops=OpsConfig.plain(), **kw)


def test_both_layouts_give_the_models_loss_and_gradients():
    """Measured (float64): the losses equal, the gradients within 4.3e-16 of each tensor's largest element in both
    layouts; (seq, batch) activations through attention that reads them as (batch, seq) (the switch not set) give a
    loss 8e-4 away."""
    model = build_model(tiny(), seed=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 48, (3, 7), generator=g)
    targets = torch.randint(0, 48, (3, 7), generator=g)
    want = model(tokens, targets)[1]
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    for layout in ("bsh", "sbh", "bsh"):   # the switch is set by each call, and undone
        loss = layout_forward(model, tokens, targets, layout)
        torch.testing.assert_close(loss, want, rtol=1e-14, atol=0)
        for got, w in zip(torch.autograd.grad(loss, list(model.parameters())), want_grads):
            torch.testing.assert_close(got, w, rtol=0, atol=4e-14 * float(w.abs().max()))
    assert all(not block.self_attn.seq_first for block in model.layers)
    model.set_seq_first(False)
    x, residual = model.blocks(model.embed(tokens.t()), None, *model.rope_tables(0, 3, "cpu"))  # read as (B=7, T=3)
    wrong = model.head_loss(model.final_norm(x, residual), targets.t())[1]
    assert abs(float((wrong - want).detach())) > 1e-4


def test_seq_first_refuses_moe_models_and_decoding():
    moe = build_model(tiny(moe=MoEConfig(n_experts=4, top_k=2, expert_intermediate_size=8)), seed=0)
    with pytest.raises(ValueError, match="dense models only"):
        moe.set_seq_first()
    model = build_model(tiny(), seed=0)
    model.set_seq_first()
    with pytest.raises(ValueError, match="no KV cache"):
        model(torch.zeros(1, 4, dtype=torch.long), kv_cache=model.new_kv_cache(1))
