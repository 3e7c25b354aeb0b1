"""Activation checkpointing: what autograd keeps between the forward and the backward of each block.

``full`` wraps every block with torch's ``checkpoint_wrapper`` (keeps only each block's input; one extra forward,
~+33 % compute); ``selective`` with ``ac_selective = blocks`` wraps every ``ac_every``-th block, or with
``attention`` every block under torch's selective checkpoint policy that recomputes only the attention core
(SDPA / QK^T-softmax-V) and keeps every other op's output, as in Megatron's selective recomputation (Korthikanti
et al. 2022): the attention core's activations grow as T^2 with the naive kernel and it has few FLOPs to redo.
The wrapper only changes what autograd keeps: the loss and the gradients are the same as without it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from zero2all.config import AC_MODES, AC_SELECTIVE


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks: ``model.layers`` (ours) or ``model.model.layers`` (HF Llama)."""
    for candidate in (model, getattr(model, "model", None)):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise TypeError(f"{type(model).__name__}: no .layers ModuleList of transformer blocks to wrap")


def _attention_core_ops() -> set:
    """ATen ops of the attention core: the SDPA kernels and the naive path's batched matmuls / softmax."""
    aten = torch.ops.aten
    names = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable", "bmm", "_softmax", "baddbmm"]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


# view-like ops cost nothing to redo and their outputs alias saved tensors anyway
_FREE_OPS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "split", "split_with_sizes",
             "select", "slice", "unsqueeze", "squeeze", "detach", "alias", "as_strided"}


def attention_core_policy():
    """A selective-checkpoint policy: recompute the attention core (and free view ops), save everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    core = _attention_core_ops()

    def policy(ctx, op, *args, **kwargs):
        if op in core or op.__name__.split(".")[0] in _FREE_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", selective: str = "blocks",
                                   every: int = 2) -> list[int]:
    """Wrap transformer blocks of ``model`` in place with torch's ``checkpoint_wrapper`` (non-reentrant).

    Returns the indices of the wrapped blocks. The wrapper only changes what autograd keeps: the loss and the
    gradients are the same as without it (recomputation replays the same ops, dropout RNG included).
    """
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode == "none":
        return []
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {', '.join(AC_MODES)}")
    blocks = transformer_blocks(model)
    kwargs: dict[str, Any] = {"preserve_rng_state": True}
    if mode == "full":
        chosen = list(range(len(blocks)))
    elif selective == "blocks":
        chosen = [i for i in range(len(blocks)) if i % every == 0]
    elif selective == "attention":
        chosen = list(range(len(blocks)))
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, attention_core_policy())
    else:
        raise ValueError(f"selective checkpointing {selective!r} is not one of {', '.join(AC_SELECTIVE)}")
    for i in chosen:
        blocks[i] = checkpoint_wrapper(blocks[i], **kwargs)
    return chosen
