"""Training objectives: what differs between pretraining, SFT and DPO. The loop in ``trainer.py`` is shared.

The interface
-------------
An objective turns one micro-batch into a scalar loss::

    class MyObjective(Objective):
        name = "my-stage"

        def loss(self, model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            ...                      # forward through `model` (the possibly wrapped training model)
            return loss, {"accuracy": acc.detach()}

        def num_tokens(self, batch) -> int:          # optional: tokens pushed through the model (throughput, MFU)
            return batch["chosen_ids"].numel() * 2

- ``batch`` is the ``dict[str, Tensor]`` yielded by the data iterator (``it = dataset.iterator(batch_size,
  seed=...)``; ``next(it)``), already moved to the training device. The iterator must also provide
  ``state_dict()`` / ``load_state_dict(sd)`` so a resumed run continues with exactly the next batch. The pretraining
  batch is ``{"input_ids": (B, T) long, "labels": (B, T) long}`` (labels = input_ids shifted by one, -100 = ignore),
  optionally ``"doc_ids": (B, T)`` for intra-document attention.
- ``loss`` is the MEAN loss of the micro-batch as a 0-dim float tensor that requires grad. The trainer runs it
  under the autocast context, divides it by the number of accumulation steps, scales it (fp16) and calls backward.
- The metrics dict holds extra 0-dim tensors (detached) or floats to log, e.g. DPO's reward margin; the trainer
  averages each over the micro-batches of an update and logs it as ``train/<name>`` (no host sync per micro-batch).
- ``eval_loss(model, batch)`` defaults to ``loss``; the trainer calls it under ``torch.no_grad()`` with the model in
  eval mode on validation batches and records the mean loss and the mean of each metric. ``loss_is_token_nll``
  (True unless the objective says otherwise) means the loss is a mean per-token cross-entropy, so its ``exp`` is
  reported as the perplexity; ``eval_printed`` names the metrics shown on the eval line.
- Anything stage-specific the objective needs (a frozen reference model, a beta, a z-loss weight) is given to its
  constructor; objectives keep no state the trainer must checkpoint.
"""

from __future__ import annotations

import torch


class Objective:
    """Base class; see the module docstring for the contract."""

    name = "objective"
    loss_is_token_nll = True                 # the loss is a mean per-token cross-entropy: exp(loss) is a perplexity
    eval_printed: tuple[str, ...] = ()       # eval metrics shown on the eval line (all of them are recorded)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError(f"{type(self).__name__}.loss")

    def eval_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        return self.loss(model, batch)

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens the model processes for this batch (the throughput and MFU numerator)."""
        return batch["input_ids"].numel()


class PretrainObjective(Objective):
    """Next-token prediction: mean cross-entropy over every label that is not -100.

    loss = -1/|M| * sum_{(b,t) in M} log softmax(logits[b, t])[labels[b, t]],   M = {(b, t): labels[b, t] != -100}

    ``z_loss`` > 0 adds z_loss * mean(logsumexp(logits)^2) (PaLM), which keeps the softmax normaliser near 1.
    """

    name = "pretrain"

    def __init__(self, z_loss: float = 0.0):
        self.z_loss = z_loss

    def loss(self, model, batch):
        _, loss = model(batch["input_ids"], batch["labels"], doc_ids=batch.get("doc_ids"), z_loss=self.z_loss)
        return loss, {}


class SFTObjective(Objective):
    """Supervised fine-tuning on chat data: next-token cross-entropy on the assistant tokens only.

    loss = -1/|A| * sum_{(b,t) in A} log softmax(logits[b, t])[labels[b, t]],   A = {(b, t): labels[b, t] != -100}

    The labels (``zero2all/data/chat.py``) are -100 on system / user turns, template headers and padding, so A is
    the set of assistant tokens (with their ``<|im_end|>``). Packed rows carry ``doc_ids`` (attention stays inside
    a sample) and ``position_ids`` (RoPE positions restart at 0 per sample), so a packed row computes the same
    loss as its samples run one by one. Logged: ``label_tokens``, the supervised tokens per micro-batch.
    """

    name = "sft"

    def loss(self, model, batch):
        _, loss = model(batch["input_ids"], batch["labels"], doc_ids=batch.get("doc_ids"),
                        position_ids=batch.get("position_ids"))
        return loss, {"label_tokens": (batch["labels"] != -100).sum()}


class DPOObjective(Objective):
    """Direct Preference Optimisation (Rafailov et al., 2023); the formula is in ``zero2all/train/dpo.py``:

        loss = -log sigmoid(beta * [(log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))])

    The reference log-probs come from the batch (``ref_chosen_logps`` / ``ref_rejected_logps``, computed once
    before training: no second model in memory) or else from ``reference_model``, a frozen copy evaluated under
    ``torch.no_grad`` in eval mode. Chosen and rejected rows run as one forward of 2B rows. Logged: mean implicit
    rewards of chosen and rejected answers, their margin, the accuracy (share of pairs with a positive margin) and
    the policy's mean sequence log-probs.
    """

    name = "dpo"
    loss_is_token_nll = False  # -log sigmoid of a reward margin per pair: exp of it means nothing
    eval_printed = ("rewards/accuracy", "rewards/margin")

    def __init__(self, beta: float = 0.1, reference_model: torch.nn.Module | None = None):
        if beta <= 0:
            raise ValueError(f"dpo beta: must be positive, got {beta}")
        self.beta = beta
        self.reference_model = reference_model
        if reference_model is not None:
            reference_model.eval()
            reference_model.requires_grad_(False)

    def reference_logprobs(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        from zero2all.train.dpo import pair_logprobs

        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if self.reference_model is None:
            raise ValueError("DPOObjective: the batch has no precomputed reference log-probs and no reference model "
                             "was given")
        with torch.no_grad():
            return pair_logprobs(self.reference_model, batch)

    def loss(self, model, batch):
        from zero2all.train.dpo import dpo_loss, pair_logprobs

        chosen, rejected = pair_logprobs(model, batch)
        ref_chosen, ref_rejected = self.reference_logprobs(batch)
        loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, self.beta)
        metrics["logps/chosen"] = chosen.detach().mean()
        metrics["logps/rejected"] = rejected.detach().mean()
        return loss, metrics

    def num_tokens(self, batch) -> int:
        return batch["chosen_ids"].numel() + batch["rejected_ids"].numel()
