"""Direct Preference Optimisation (Rafailov et al., 2023): the loss and the sequence log-probabilities it needs.

For a prompt x with a preferred answer y_w and a rejected one y_l, the policy pi and a frozen reference pi_ref:

    r_w = beta * (log pi(y_w|x) - log pi_ref(y_w|x))        implicit reward of the chosen answer
    r_l = beta * (log pi(y_l|x) - log pi_ref(y_l|x))        implicit reward of the rejected answer
    loss = -log sigmoid(r_w - r_l)                          averaged over the batch

log pi(y|x) is the sum of the answer tokens' log-probabilities (prompt tokens are labelled -100). The reference
log-probs may be computed once ahead of training and stored with the data, which halves the memory (no second
model); the loss does not care where they come from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum over t of log softmax(logits[b, t])[labels[b, t]] for labels != ignore_index -> (B,), float32.

    ``labels`` are aligned with ``logits`` (already shifted: logits[:, t] predicts labels[:, t], like the model's
    ``targets``).
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"sequence_logprobs: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ")
    valid = labels != ignore_index
    safe = labels.masked_fill(~valid, 0)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return (logp * valid).sum(dim=-1)


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float = 0.1
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean DPO loss over the batch and metrics: mean rewards, margin and accuracy (share with r_w > r_l)."""
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps.detach())
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps.detach())
    margin = chosen_rewards - rejected_rewards
    loss = -F.logsigmoid(margin).mean()
    metrics = {
        "rewards/chosen": chosen_rewards.detach().mean().item(),
        "rewards/rejected": rejected_rewards.detach().mean().item(),
        "rewards/margin": margin.detach().mean().item(),
        "rewards/accuracy": (margin.detach() > 0).float().mean().item(),
    }
    return loss, metrics


def pair_logprobs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-probs of a ``zero2all.data.chat.dpo_collate`` batch: (chosen (B,), rejected (B,)), from one
    forward over the chosen and rejected rows stacked."""
    ids = torch.cat([batch["chosen_ids"], batch["rejected_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    logits, _ = model(ids)
    logps = sequence_logprobs(logits, labels)
    half = batch["chosen_ids"].size(0)
    return logps[:half], logps[half:]


@torch.no_grad()
def precompute_reference_logprobs(model, pairs, pad_id: int, batch_size: int = 8, device=None
                                  ) -> torch.Tensor:
    """(N, 2) log-probs [chosen, rejected] of every pair under a frozen reference model, computed once ahead of
    training so that DPO needs no second model in memory."""
    from zero2all.data.chat import dpo_collate

    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    out = []
    for i in range(0, len(pairs), batch_size):
        batch = {k: v.to(device) for k, v in dpo_collate(pairs[i:i + batch_size], pad_id).items()}
        chosen, rejected = pair_logprobs(model, batch)
        out.append(torch.stack([chosen, rejected], dim=1).cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 2)
