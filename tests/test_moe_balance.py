"""Aux-loss-free balancing of the sigmoid router: the bias update rules, and that they drive a skewed router
(its weights frozen, as when the router learns slower than the bias moves) to a balanced load."""

import pytest
import torch

from zero2all.config import ConfigError, ModelConfig, MoEConfig, OpsConfig
from zero2all.model.moe import MoE, expert_counts, load_balancing_loss


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


def topic_batch(centres: torch.Tensor, topics: torch.Tensor, seq: int, g: torch.Generator) -> torch.Tensor:
    """Sequences of ``seq`` tokens, each token its sequence's topic centre plus unit noise: (B * seq, H)."""
    x = centres[topics].unsqueeze(1) + torch.randn(len(topics), seq, centres.shape[1], generator=g)
    return x.reshape(-1, centres.shape[1])


def train_router(groups: str, steps=150, batch=16, seq=64) -> tuple[float, float]:
    """A router whose expert e starts aligned with topic e (experts specialised on content), trained with Adam on
    the balance loss alone (``groups``: "batch" or "sequence"), over batches of sequences of random topics; the
    bias moves after every step as in training. Returns the max / mean load, after training, of a batch mixing
    all topics and of a batch whose sequences are all of topic 0."""
    moe = make_moe(bias_update="error", bias_update_rate=0.02)
    g = torch.Generator().manual_seed(0)
    centres = 0.5 * torch.randn(8, 32, generator=g)
    with torch.no_grad():
        moe.router.weight.copy_(0.02 * torch.randn(8, 32, generator=g) + centres / centres.norm(dim=1, keepdim=True))
    one_topic = topic_batch(centres, torch.zeros(16, dtype=torch.long), 128, g)
    mixed = topic_batch(centres, torch.arange(16) % 8, 128, g)
    assert load_ratio(moe, one_topic) > 3.5  # before: a batch of topic 0 goes to expert 0 (and one other)
    opt = torch.optim.Adam(moe.router.parameters(), lr=3e-3)
    for _ in range(steps):
        routing = moe.router(topic_batch(centres, torch.randint(0, 8, (batch,), generator=g), seq, g))
        load_balancing_loss(routing, 8, batch if groups == "sequence" else 1).backward()
        opt.step()
        opt.zero_grad()
        moe.update_bias(expert_counts(routing.experts, 8).float())
    with torch.no_grad():
        return load_ratio(moe, mixed), load_ratio(moe, one_topic)


def test_sequence_wise_loss_is_the_batch_loss_of_each_sequence_averaged():
    moe = make_moe()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(8, 32, generator=g))
    x = torch.randn(3 * 10, 32, generator=g)
    per_seq = [load_balancing_loss(moe.router(x[i * 10:(i + 1) * 10]), 8) for i in range(3)]
    torch.testing.assert_close(load_balancing_loss(moe.router(x), 8, 3), torch.stack(per_seq).mean())


def test_sequence_wise_loss_balances_a_batch_of_one_topic():
    """Experts specialised on topics: the bias and the batch-wise loss balance the mixed batches they see, but a
    batch drawn from one topic still sends most of its tokens to that topic's expert. The sequence-wise loss asks
    every sequence to spread its tokens, so a batch of any mix of topics is balanced."""
    mixed_b, one_b = train_router("batch")
    mixed_s, one_s = train_router("sequence")
    assert mixed_b < 1.25 and mixed_s < 1.25
    assert one_b > 3.0        # batch-wise: the one-topic batch stays as skewed as before
    assert one_s < 1.3        # sequence-wise: balanced within each sequence, so within any batch
