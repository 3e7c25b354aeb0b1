"""The model's final hidden states, for heads other than the LM head and for inputs other than token ids.

``Z2all.forward`` maps token ids to logits. Reward models and value heads read the last normalised hidden state
``h`` (the input of ``lm_head``) instead, and prompt tuning feeds embeddings that are not rows of the embedding
table. :func:`hidden_states` runs the same blocks in the same order as ``Z2all.forward`` (so ``lm_head(h)`` equals
its logits exactly) and accepts either ``tokens`` or ``embeds``.
"""

from __future__ import annotations

import torch


def hidden_states(model, tokens: torch.Tensor | None = None, embeds: torch.Tensor | None = None, kv_cache=None,
                  start_pos: int = 0, position_ids: torch.Tensor | None = None,
                  attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, hidden): the final RMSNorm's output for ``tokens`` (B, T) or ``embeds`` (B, T, hidden)."""
    if (tokens is None) == (embeds is None):
        raise ValueError("hidden_states: give exactly one of tokens and embeds")
    x = model.embed(tokens) if embeds is None else embeds
    B, T = x.shape[:2]
    cos, sin = model.rope_tables(start_pos, T, x.device, position_ids)
    x, residual = model.blocks(x, None, cos, sin, kv_cache, start_pos, None, attn_mask)
    return model.final_norm(x, residual)


def last_token_index(lengths: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token in right-padded rows of the given lengths (>= 1)."""
    if bool((lengths < 1).any()):
        raise ValueError("last_token_index: every row needs at least one token")
    return lengths.long() - 1
