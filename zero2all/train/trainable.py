"""``train.trainable``: which parameters a (continued) pretraining run updates.

* ``all``: every parameter.
* ``embeddings+norms``: the embedding, the LM head and the RMSNorm gains; everything else is frozen
  (``requires_grad = False``, so the optimizer never sees it).
* ``new_embeddings``: only the embedding and LM-head rows at ids ``>= old_vocab`` (the rows ``z2all resize-vocab``
  added; ``old_vocab`` comes from the ``train.init`` checkpoint's ``z2all.json``). Every other tensor is frozen; a
  gradient hook zeroes the gradient of rows ``< old_vocab``, and the two tensors get no weight decay (the optimizer
  reads the setting: ``no_decay_modules``), so AdamW's update of those rows is exactly zero and they stay bit for
  bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zero2all.config import ConfigError

HEAD_MODULES = ("embed_tokens", "lm_head")


def no_decay_modules(mode: str) -> tuple[str, ...]:
    """The modules (by their own name) whose parameters get no weight decay under ``train.trainable = mode``:
    the embedding and the LM head for ``new_embeddings`` (decay would move the frozen rows), else none."""
    return HEAD_MODULES if mode == "new_embeddings" else ()


def resized_old_vocab(init: str | Path) -> int:
    """``resize.old_vocab`` of a ``z2all resize-vocab`` output (ConfigError naming the file otherwise)."""
    meta_file = Path(init) / "z2all.json"
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        return int(meta["resize"]["old_vocab"])
    except (OSError, KeyError, TypeError, ValueError):
        raise ConfigError(f"train.trainable: new_embeddings needs train.init to be a `z2all resize-vocab` output; "
                          f"{meta_file} has no resize.old_vocab") from None


def apply_trainable(model: torch.nn.Module, mode: str, init: str = "") -> str:
    """Freeze ``model``'s parameters per ``mode``; returns a line saying what is trained."""
    if mode == "all":
        return "trainable: all parameters"
    heads = {id(model.embed_tokens.weight), id(model.lm_head.weight)}
    norms = {id(p) for name, p in model.named_parameters() if name.endswith("norm.weight")}
    keep = heads | (norms if mode == "embeddings+norms" else set())
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    if mode == "embeddings+norms":
        n = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
        return f"trainable: embeddings, LM head and norms ({n:,} parameters)"
    old = resized_old_vocab(init)
    rows = model.embed_tokens.weight.shape[0]
    if not 0 < old <= rows:
        raise ConfigError(f"train.init: resize.old_vocab {old} is not within the model's {rows} rows")

    def mask(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[:old] = 0
        return grad

    for p in {id(p): p for p in (model.embed_tokens.weight, model.lm_head.weight)}.values():
        p.register_hook(mask)
    return f"trainable: embedding and LM-head rows {old}..{rows - 1} only ({rows - old} new rows)"
