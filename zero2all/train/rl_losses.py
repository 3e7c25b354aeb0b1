"""The formulas of online RL for language models, as plain tensor functions (no models, no generation).

Notation: a response y = (y_1 .. y_n) to a prompt x is sampled from the policy pi_old (the weights at rollout
time); pi is the policy being updated, pi_ref the frozen reference. Per response token t:

    log-ratio   l_t   = log pi(y_t | x, y_<t) - log pi_old(y_t | x, y_<t)
    ratio       rho_t = exp(l_t)
    clipped surrogate (PPO, Schulman et al. 2017), to minimise:
                L_t   = -min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)
    clip fraction     = share of tokens where the clipped term is the smaller one (|rho_t - 1| > eps, A_t != 0)

KL to the reference, per token, from samples of pi (Schulman, "Approximating KL divergence", 2020), with
d_t = log pi_ref(y_t) - log pi(y_t):

    k1 = -d_t                        unbiased, can be negative
    k3 = exp(d_t) - d_t - 1          unbiased, always >= 0, low variance (GRPO's KL term)

GRPO (Shao et al. 2024, DeepSeekMath): G responses per prompt, scalar rewards r_1..r_G; every token of response i
gets the group-normalised advantage A_i = (r_i - mean(r)) / (std(r) + eps). No value model.

PPO for RLHF (Ouyang et al. 2022): per-token rewards r_t = -beta * k1_t, plus the sequence score on the last
token; a value head V_t; generalised advantage estimation (Schulman et al. 2016):

    delta_t = r_t + gamma V_{t+1} - V_t,     A_t = sum_k (gamma lambda)^k delta_{t+k},     R_t = A_t + V_t

and a clipped value loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2).

Every mean below is over response tokens only (``mask`` = 1 on them): ``masked_mean(x, mask)``.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k3")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target) (B, T), entropy of the distribution (B, T)), in float32. ``vocab`` cuts padded rows of the
    vocabulary (they are never sampled)."""
    logits = logits.float()
    if vocab is not None:
        logits = logits[..., :vocab]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi: ``k1`` or ``k3`` (module docstring)."""
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"kl estimator {kind!r} is not one of {', '.join(KL_ESTIMATORS)}")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4
                     ) -> torch.Tensor:
    """GRPO: rewards (B * G,), G consecutive responses per prompt -> (r - group mean) / (group std + eps)."""
    if rewards.numel() % group_size:
        raise ValueError(f"group_advantages: {rewards.numel()} rewards are not groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        std = r.std(dim=1, keepdim=True, unbiased=group_size > 1) if group_size > 1 else torch.zeros_like(r)
        adv = adv / (std + eps)
    return adv.reshape(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens of each row (``mask`` marks them; they are
    contiguous). rewards, values, mask: (B, T). Returns (advantages, returns), zero outside the mask."""
    B, T = rewards.shape
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, device=rewards.device)
    next_value = torch.zeros(B, device=rewards.device)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last * m
        # outside the response nothing carries over (a row's response is the last stretch of its tokens)
        last = last * m
        next_value = values[:, t] * m
    return adv, (adv + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries (PPO's advantage normalisation)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        clip_eps: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean clipped surrogate loss, clip fraction) over the masked tokens (module docstring)."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    loss = masked_mean(-torch.minimum(unclipped, clipped), mask)
    clip_frac = masked_mean((clipped < unclipped).float(), mask)
    return loss, clip_frac.detach()


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip_eps: float = 0.2) -> torch.Tensor:
    """0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-eps) - R)^2), mean over the masked tokens."""
    v_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2), mask)
