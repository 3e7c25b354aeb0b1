"""Prompt tuning and prefix tuning: PEFT methods that train a few virtual tokens and leave every weight frozen.

- **Prompt tuning** (Lester et al., 2021): n trainable embeddings P (n, hidden) are put before the input's
  embeddings; the model runs on [P; E(x)] with positions 0 .. n + T - 1. Only P trains.
- **Prefix tuning, P-Tuning v2 style** (Li & Liang, 2021; Liu et al., 2022): every layer gets n trainable keys
  and values (n per KV head) in front of its own; the queries of the T real tokens attend to them as to earlier
  tokens. The prefix keys enter attention as they are (no rotary embedding), and the real tokens take positions
  n .. n + T - 1, as if the prefix were a cached past. Implemented with the model's KV cache: the prefix fills
  slots [0, n), the tokens run with ``start_pos = n``.

Files follow PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors`` with one tensor
``prompt_embeddings``), so ``peft.PeftModel.from_pretrained(hf_model, dir)`` loads them onto our HF export and
gives our logits. PEFT's prefix tensor is (n, L * 2 * Hkv * D): viewed as (n, 2L, Hkv, D), entry 2l is layer
l's keys and 2l + 1 its values.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero2all.fileio import save_json, write_bytes
from zero2all.model.hidden import hidden_states
from zero2all.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

METHODS = {"prompt": "PROMPT_TUNING", "prefix": "PREFIX_TUNING"}


class PromptTuned(nn.Module):
    """``model`` (frozen) with ``num_virtual_tokens`` trainable virtual tokens of ``method`` prompt or prefix.

    ``forward(tokens, targets=None)`` -> (logits of the real tokens (B, T, V), mean cross-entropy or None), the
    contract of ``Z2all.forward`` (so the SFT objective trains it unchanged, on padded rows)."""

    def __init__(self, model: nn.Module, num_virtual_tokens: int, method: str = "prompt",
                 generator: torch.Generator | None = None):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"prompt tuning: method {method!r} is not one of {', '.join(METHODS)}")
        if num_virtual_tokens < 1:
            raise ValueError(f"prompt tuning: num_virtual_tokens must be >= 1, got {num_virtual_tokens}")
        self.model, self.cfg, self.method, self.n = model, model.cfg, method, num_virtual_tokens
        c, w = model.cfg, model.embed_tokens.weight
        width = c.hidden_dim if method == "prompt" else c.n_layers * 2 * c.n_kv_heads * c.head_dim
        self.prompt_embeddings = nn.Parameter(torch.empty(num_virtual_tokens, width, device=w.device, dtype=w.dtype))
        with torch.no_grad():
            if method == "prompt":  # start from embeddings of random vocabulary tokens (a familiar scale)
                rows = torch.randint(0, c.vocab_size, (num_virtual_tokens,), generator=generator).to(w.device)
                self.prompt_embeddings.copy_(w[rows])
            else:
                self.prompt_embeddings.normal_(0.0, c.initializer_range, generator=generator)
        model.requires_grad_(False)

    def prefix_cache(self, batch_size: int, total_len: int):
        """A KV cache of ``total_len`` slots whose first n hold the prefix keys and values of every layer."""
        c = self.cfg
        kv = self.prompt_embeddings.view(self.n, 2 * c.n_layers, c.n_kv_heads, c.head_dim).permute(1, 2, 0, 3)
        cache = self.model.new_kv_cache(batch_size, total_len, dtype=self.prompt_embeddings.dtype)
        for layer in range(c.n_layers):
            cache.k[layer][:, :, :self.n] = kv[2 * layer]      # (Hkv, n, D), broadcast over the batch
            cache.v[layer][:, :, :self.n] = kv[2 * layer + 1]
        return cache

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, doc_ids=None, position_ids=None,
                **_):
        B, T = tokens.shape
        plain = position_ids is None or bool((position_ids == torch.arange(T, device=tokens.device)).all())
        if doc_ids is not None or not plain:
            raise ValueError("prompt / prefix tuning trains on padded rows (post.packing=pad), not packed ones")
        if self.n + T > self.cfg.max_seq_len:
            raise ValueError(f"prompt tuning: {self.n} virtual + {T} tokens exceed max_seq_len "
                             f"{self.cfg.max_seq_len}")
        if self.method == "prompt":
            embeds = torch.cat([self.prompt_embeddings.unsqueeze(0).expand(B, -1, -1).to(
                self.model.embed_tokens.weight.dtype), self.model.embed_tokens(tokens)], dim=1)
            h = hidden_states(self.model, embeds=embeds)[:, self.n:]
        else:
            h = hidden_states(self.model, tokens, kv_cache=self.prefix_cache(B, self.n + T), start_pos=self.n)
        logits = self.model.lm_head(h)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                       ignore_index=-100)

    def num_params(self, non_embedding: bool = False) -> int:
        return self.model.num_params(non_embedding) + self.prompt_embeddings.numel()


def peft_config(module: PromptTuned, base_model_name_or_path: str = "") -> dict:
    c = module.cfg
    config = {"peft_type": METHODS[module.method], "task_type": "CAUSAL_LM", "num_virtual_tokens": module.n,
              "num_transformer_submodules": 1, "num_layers": c.n_layers, "inference_mode": True,
              "base_model_name_or_path": base_model_name_or_path, "revision": None}
    if module.method == "prompt":
        config.update({"token_dim": c.hidden_dim, "num_attention_heads": c.n_heads, "prompt_tuning_init": "RANDOM",
                       "prompt_tuning_init_text": None, "tokenizer_name_or_path": None})
    else:  # PEFT's grouped-query layout: token_dim = Hkv * D, "heads" = Hkv
        kv = c.n_kv_heads * c.head_dim
        config.update({"token_dim": kv, "num_attention_heads": c.n_kv_heads, "encoder_hidden_size": kv,
                       "prefix_projection": False})
    return config


def save_prompt_adapter(module: PromptTuned, out_dir: str | Path, base_model_name_or_path: str = "") -> Path:
    """``adapter_config.json`` + ``adapter_model.safetensors`` (tensor ``prompt_embeddings``), PEFT's layout."""
    from safetensors.torch import save

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensor = module.prompt_embeddings.detach().cpu().float().contiguous()
    write_bytes(out_dir / ADAPTER_WEIGHTS, save({"prompt_embeddings": tensor}, metadata={"format": "pt"}))
    save_json(peft_config(module, base_model_name_or_path), out_dir / ADAPTER_CONFIG)
    return out_dir


def load_prompt_adapter(model: nn.Module, adapter_dir: str | Path) -> PromptTuned:
    """A PEFT prompt- or prefix-tuning adapter (ours or trained with ``peft``, without a prefix projection) on
    ``model``."""
    from safetensors.torch import load_file

    path = Path(adapter_dir) / ADAPTER_CONFIG
    raw = json.loads(path.read_text(encoding="utf-8"))
    kinds = {v: k for k, v in METHODS.items()}
    if raw.get("peft_type") not in kinds:
        raise ValueError(f"{path}: peft_type {raw.get('peft_type')!r} is not PROMPT_TUNING or PREFIX_TUNING")
    if raw.get("prefix_projection"):
        raise ValueError(f"{path}: prefix_projection=true (an MLP re-parametrisation) is not supported")
    if raw.get("num_transformer_submodules", 1) != 1:
        raise ValueError(f"{path}: num_transformer_submodules must be 1 for a decoder-only model")
    module = PromptTuned(model, int(raw["num_virtual_tokens"]), kinds[raw["peft_type"]])
    tensors = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    t = tensors.get("prompt_embeddings")
    if t is None or t.shape != module.prompt_embeddings.shape:
        raise ValueError(f"{adapter_dir}: prompt_embeddings of shape {None if t is None else tuple(t.shape)}, "
                         f"expected {tuple(module.prompt_embeddings.shape)} for this model")
    with torch.no_grad():
        module.prompt_embeddings.copy_(t)
    return module
