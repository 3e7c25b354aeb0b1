"""Activation checkpointing applied from outside the model: same loss and gradients (float64, the model of
``train.precision = "fp64"``), and the recomputation is exactly what each mode promises (counted by the ATen ops
the backward pass re-runs)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zero2all.config import ModelConfig, OpsConfig
from zero2all.distributed import apply_activation_checkpointing
from zero2all.model.z2all import build_model

N_LAYERS = 4


def tiny(attention: str) -> ModelConfig:
    ops = OpsConfig.plain()
    ops.attention = attention
    return ModelConfig(vocab_size=61, hidden_dim=40, intermediate_size=72, n_layers=N_LAYERS, n_heads=4,
                       n_kv_heads=2, max_seq_len=24, ops=ops)


class OpCounter(TorchDispatchMode):
    """Counts ATen ops by name (the overload packet, e.g. ``mm``)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def run(attention: str, mode: str, selective: str = "blocks", every: int = 2):
    torch.manual_seed(0)
    model = build_model(tiny(attention), seed=7, dtype=torch.float64)
    wrapped = apply_activation_checkpointing(model, mode, selective, every)
    tokens = torch.randint(0, 61, (3, 23))
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    counter = OpCounter()
    with counter:
        loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, counter.counts, wrapped


ATTENTION_FWD = {"naive": "_softmax", "sdpa": "_scaled_dot_product_flash_attention_for_cpu"}


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_checkpointing_modes_keep_loss_and_grads_and_recompute_what_they_say(attention):
    ref_loss, ref_grads, ref_counts, _ = run(attention, "none")
    fwd_op = ATTENTION_FWD[attention]
    assert ref_counts[fwd_op] == 0  # without checkpointing the backward never re-runs a forward op
    cases = {"full": ("full", "blocks"), "every2": ("selective", "blocks"), "attention": ("selective", "attention")}
    counts = {}
    for name, (mode, selective) in cases.items():
        loss, grads, counts[name], wrapped = run(attention, mode, selective)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for key, g in ref_grads.items():
            # recomputation repeats the same float64 operations: measured bit-identical
            torch.testing.assert_close(grads[key], g, rtol=0, atol=0, msg=f"{name}: {key}")
        assert wrapped == (list(range(N_LAYERS)) if name != "every2" else [0, 2])
    # the attention core's forward is re-run once per checkpointed block
    assert counts["full"][fwd_op] == N_LAYERS
    assert counts["every2"][fwd_op] == N_LAYERS // 2
    assert counts["attention"][fwd_op] == N_LAYERS
    # full recomputation re-runs each block's projections up to gate_up (torch stops the replay once every saved
    # tensor is back: down_proj's output is saved by nothing inside the block); the attention-core policy none
    extra_mm = {name: c["mm"] - ref_counts["mm"] for name, c in counts.items()}
    assert extra_mm["full"] == 3 * N_LAYERS and extra_mm["every2"] == 3 * N_LAYERS // 2
    assert extra_mm["attention"] == 0


def test_bad_mode_is_rejected():
    model = build_model(tiny("sdpa"), seed=7)
    with pytest.raises(ValueError, match="activation checkpointing"):
        apply_activation_checkpointing(model, "some")
    with pytest.raises(ValueError, match="selective"):
        apply_activation_checkpointing(model, "selective", "mlp")

