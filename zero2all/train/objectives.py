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
  eval mode on validation batches and reports the mean and ``exp`` of it (perplexity).
- Anything stage-specific the objective needs (a frozen reference model, a beta, a z-loss weight) is given to its
  constructor; objectives keep no state the trainer must checkpoint.
"""

from __future__ import annotations

import torch


class Objective:
    """Base class; see the module docstring for the contract."""

    name = "objective"

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
