"""A model whose output is written by hand: greedy decoding repeats a chosen text forever.

Its blocks add nothing to the residual stream (``o_proj`` and ``down_proj`` are zero), so the logits depend on the
current token only: ``lm_head @ norm(embed[token])``. Each token of the cycle gets a unit vector of its own as its
embedding, and the LM head row of its successor points along that vector, so the greedy successor of token ``a`` is
the next token of the cycle. The output then goes through the real tokenizer, sampler, server and stream: the
browser test uses it to make a model send ``<script>`` tags to the page.
"""

from __future__ import annotations

from pathlib import Path

import torch


def scripted_model(tok, tokenizer_dir, out: Path, text: str, start_text: str = "\n", hidden_dim: int = 64,
                   n_heads: int = 4, n_layers: int = 2, max_seq_len: int = 4096, plain: bool = True) -> Path:
    """Save to ``out`` a model that continues ``start_text`` (its last token) with ``text`` repeated forever."""
    from zero2all.config import ModelConfig, OpsConfig
    from zero2all.model.io import save_model
    from zero2all.model.z2all import build_model

    cycle = tok.encode(text)
    chain = [tok.encode(start_text)[-1]] + cycle + [cycle[0]]
    successor: dict[int, int] = {}
    for a, b in zip(chain, chain[1:]):
        if successor.setdefault(a, b) != b:
            raise ValueError(f"token {a} of {text!r} would need two successors: choose a text whose tokens differ")
    if len(successor) > hidden_dim:
        raise ValueError(f"{len(successor)} tokens in the cycle, more than hidden_dim {hidden_dim}")
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_dim=hidden_dim, intermediate_size=hidden_dim * 3 // 2,
                      n_layers=n_layers, n_heads=n_heads, n_kv_heads=max(1, n_heads // 2), max_seq_len=max_seq_len,
                      **({"ops": OpsConfig.plain()} if plain else {}))
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for dim, (a, b) in enumerate(successor.items()):
            model.embed_tokens.weight[a] = 0
            model.embed_tokens.weight[a, dim] = 1
            model.lm_head.weight[b, dim] = 10
    save_model(model, out, tokenizer_dir=tokenizer_dir)
    return out
