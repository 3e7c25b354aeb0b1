"""Causal attention with optional document masks, through FlexAttention.

Dense causal attention is best served by ``scaled_dot_product_attention`` (flash / cuDNN backends; see
``ops.attention``). When sequences are packed from several documents, a token should attend only to earlier tokens
of its own document::

    allowed(b, i, j) = j <= i + (Tk - Tq)  and  doc_ids[b, i] == doc_ids[b, j]

Passing that as a dense (B, 1, T, T) boolean mask to SDPA forces its slow masked path and O(T^2) memory.
FlexAttention compiles the mask predicate into a fused Triton attention kernel and skips the tiles that are fully
masked (a block mask built once per batch), so document masking costs less than dense causal attention. Grouped
query attention runs without repeating K/V (``enable_gqa``).

On a GPU the attention function is compiled once (FlexAttention is only fast compiled); on the CPU it runs the
eager reference path, which is what the tests use.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


def _block_mask(doc_ids: torch.Tensor | None, B: int, q_len: int, kv_len: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = kv_len - q_len
    if doc_ids is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        return create_block_mask(mask_mod, None, None, q_len, kv_len, device=device)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(doc_mask_mod, B, None, q_len, kv_len, device=device)


@functools.lru_cache(maxsize=16)
def _causal_block_mask(q_len: int, kv_len: int, device: torch.device):
    return _block_mask(None, 1, q_len, kv_len, device)


def flex_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, Tq, D); k, v (B, Hkv, Tk, D), Tk >= Tq (queries are the last Tq positions); doc_ids (B, Tk) ints
    or None. Returns (B, H, Tq, D) in q's dtype."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"flex attention: {H} query heads are not a multiple of {Hkv} key/value heads")
    if doc_ids is not None:
        if Tq != Tk:
            raise ValueError("flex attention: document masks need the full sequence (no KV cache)")
        if doc_ids.shape != (B, Tk):
            raise ValueError(f"flex attention: doc_ids shape {tuple(doc_ids.shape)} != ({B}, {Tk})")
        block_mask = _block_mask(doc_ids.to(q.device), B, Tq, Tk, q.device)
    else:
        block_mask = _causal_block_mask(Tq, Tk, q.device)
    kwargs = {"enable_gqa": True} if H != Hkv else {}
    return _flex_fn(q.device.type)(q, k, v, block_mask=block_mask, **kwargs)
