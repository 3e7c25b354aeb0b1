"""Aux-loss-free balancing of the sigmoid router: the bias update rules, and that they drive a skewed router
(its weights frozen, as when the router learns slower than the bias moves) to a balanced load."""

import pytest
import torch

from zero2all.config import ConfigError, ModelConfig, MoEConfig, OpsConfig
from zero2all.model.moe import MoE, expert_counts


def make_moe(**moe) -> MoE:
    m = MoEConfig(n_experts=8, top_k=2, expert_intermediate_size=16, router="sigmoid", **moe)
    cfg = ModelConfig(vocab_size=64, hidden_dim=32, intermediate_size=48, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=32, ops=OpsConfig.plain(), moe=m)
    return MoE(cfg)


def skewed(moe: MoE, n_tokens=4096, seed=0) -> torch.Tensor:
    """Tokens sharing one direction that experts 0 and 1 align with: without a bias they take nearly all."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(32, generator=g)
    x = torch.randn(n_tokens, 32, generator=g) * 0.5 + common
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(8, 32, generator=g) * 0.05)
        moe.router.weight[:2] += 0.1 * common / common.norm()
    return x


def load_ratio(moe: MoE, x: torch.Tensor) -> float:
    load = expert_counts(moe.router(x).experts, 8).float()
    return float(load.max() / load.mean())


def balance(moe: MoE, x: torch.Tensor, steps: int) -> list[float]:
    """max / mean load per step, each step's load feeding the bias update."""
    history = []
    for _ in range(steps):
        load = expert_counts(moe.router(x).experts, 8).float()
        history.append(float(load.max() / load.mean()))
        moe.update_bias(load)
    return history


def test_error_rule_is_the_clipped_relative_load_error():
    moe = make_moe(bias_update="error", bias_update_rate=0.05)
    load = torch.tensor([0.0, 10, 20, 30, 40, 50, 60, 110])  # mean 40
    moe.update_bias(load)
    want = 0.05 * ((40 - load) / 40).clamp(-1, 1)
    torch.testing.assert_close(moe.router.expert_bias, want)
    assert moe.router.expert_bias[7].item() == pytest.approx(-0.05)  # -1.75 clipped to -1


@pytest.mark.parametrize("rule,rate,bound", [("error", 0.02, 1.05), ("sign", 3e-3, 1.15)])
def test_bias_update_balances_a_skewed_router(rule, rate, bound):
    moe = make_moe(bias_update=rule, bias_update_rate=rate)
    x = skewed(moe)
    assert load_ratio(moe, x) > 3.0  # the two favoured experts take most of the 2 x 4096 assignments
    history = balance(moe, x, 150)
    assert max(history[100:]) < bound


def test_error_rule_settles_where_the_sign_rule_oscillates():
    """The same largest step (1e-2): the sign rule keeps moving every bias by the full step and swings around the
    balance; the error rule's steps shrink with the error and it settles."""
    worst = {}
    for rule in ("sign", "error"):
        moe = make_moe(bias_update=rule, bias_update_rate=1e-2)
        x = skewed(moe)
        worst[rule] = max(balance(moe, x, 120)[60:])
    assert worst["error"] < 1.05 < 1.3 < worst["sign"]


def test_unknown_rule_is_refused():
    with pytest.raises(ConfigError, match="model.moe.bias_update: 'pid' is not one of sign, error"):
        MoEConfig(n_experts=4, bias_update="pid").validate()
