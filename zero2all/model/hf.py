"""Hugging Face interop: Z2all <-> ``LlamaForCausalLM`` (config.json + safetensors), both directions.

The math is identical; only names and two fusions differ:

    ours                                     HF Llama
    embed_tokens.weight                      model.embed_tokens.weight
    layers.i.self_attn.qkv_proj.weight       model.layers.i.self_attn.{q,k,v}_proj.weight  (rows [q | k | v])
    layers.i.self_attn.o_proj.weight         model.layers.i.self_attn.o_proj.weight
    layers.i.mlp.gate_up_proj.weight         model.layers.i.mlp.{gate,up}_proj.weight      (rows [gate | up])
    layers.i.mlp.down_proj.weight            model.layers.i.mlp.down_proj.weight
    layers.i.{input,post_attention}_layernorm.weight   same names under model.
    norm.weight                              model.norm.weight
    lm_head.weight                           lm_head.weight  (absent when tied)

Both use the "rotate half" RoPE layout, so q/k rows need no permutation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zero2all.config import ConfigError, ModelConfig, OpsConfig

HF_CONFIG = "config.json"


def model_config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.padded_vocab_size,
        "hidden_size": cfg.hidden_dim,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": "silu",
        "mlp_bias": False,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if cfg.rope_scaling:
        kind = cfg.rope_scaling.get("type", cfg.rope_scaling.get("rope_type"))
        scaling = {"rope_type": kind, "type": kind, "factor": float(cfg.rope_scaling["factor"])}
        if kind == "dynamic" and cfg.rope_scaling.get("original_max_position_embeddings"):
            # HF takes the original context from max_position_embeddings
            out["max_position_embeddings"] = int(cfg.rope_scaling["original_max_position_embeddings"])
        out["rope_scaling"] = scaling
    if cfg.moe.enabled:
        from zero2all.model.hf_moe import model_config_to_hf_moe

        return model_config_to_hf_moe(cfg, out)
    return out


def model_config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig from an HF Llama config.json dict; rejects what our model cannot represent."""
    arch = hf.get("model_type")
    if arch not in ("llama", None, "mixtral", "qwen2_moe"):
        raise ConfigError(f"{source}: model_type {arch!r} is not a Llama, Mixtral or Qwen2-MoE architecture")
    moe = None
    if arch in ("mixtral", "qwen2_moe"):
        from zero2all.model.hf_moe import moe_config_from_hf

        moe, _, _ = moe_config_from_hf(hf, source)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (SwiGLU needs silu)")
    if hf.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ConfigError(f"{source}: head_dim {head_dim} * num_attention_heads {heads} != hidden_size {hidden}")
    # rope: transformers >= 5 may write rope_parameters instead of rope_theta / rope_scaling
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    rope_scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default"):
            if kind not in ("linear", "dynamic"):
                raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported (linear, dynamic)")
            rope_scaling = {"type": kind, "factor": float(scaling["factor"])}
            if kind == "dynamic":
                rope_scaling["original_max_position_embeddings"] = int(
                    scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048))
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_dim=hidden,
        intermediate_size=hf["intermediate_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        initializer_range=hf.get("initializer_range", 0.02),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        pad_token_id=hf.get("pad_token_id"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        ops=OpsConfig(),
    )
    if moe is not None:
        cfg.moe = moe
    cfg.validate()
    return cfg


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {}
    if cfg.moe.enabled:  # the MoE layers' tensors (model/hf_moe.py); the rest maps as for Llama
        from zero2all.model.hf_moe import split_moe_state

        out, sd = split_moe_state(sd, cfg)
    for name, t in sd.items():
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[name] = t
        elif ".self_attn.qkv_proj." in name:
            base = "model." + name.replace("qkv_proj.", "")
            suffix = name.rsplit(".", 1)[1]
            wq, wk, wv = t.split([q, kv, kv], dim=0)
            prefix = base.rsplit(".", 1)[0]
            out[f"{prefix}.q_proj.{suffix}"] = wq
            out[f"{prefix}.k_proj.{suffix}"] = wk
            out[f"{prefix}.v_proj.{suffix}"] = wv
        elif ".mlp.gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            out["model." + name.replace("gate_up_proj", "gate_proj")] = gate
            out["model." + name.replace("gate_up_proj", "up_proj")] = up
        else:
            out["model." + name] = t
    return {k: v.contiguous() for k, v in out.items()}


def state_dict_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig, source: str = "") -> dict[str, torch.Tensor]:
    out = {}
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    missing = []

    def take(key):
        if key not in hf:
            missing.append(key)
            return None
        return hf.pop(key)

    out["embed_tokens.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = _cat(take(f"{a}.q_proj.weight"), take(f"{a}.k_proj.weight"),
                                                             take(f"{a}.v_proj.weight"))
        if cfg.attention_bias:
            out[f"layers.{i}.self_attn.qkv_proj.bias"] = _cat(take(f"{a}.q_proj.bias"), take(f"{a}.k_proj.bias"),
                                                               take(f"{a}.v_proj.bias"))
            out[f"layers.{i}.self_attn.o_proj.bias"] = take(f"{a}.o_proj.bias")
        out[f"layers.{i}.self_attn.o_proj.weight"] = take(f"{a}.o_proj.weight")
        if not cfg.moe.is_moe_layer(i):
            out[f"layers.{i}.mlp.gate_up_proj.weight"] = _cat(take(f"{p}.mlp.gate_proj.weight"),
                                                              take(f"{p}.mlp.up_proj.weight"))
            out[f"layers.{i}.mlp.down_proj.weight"] = take(f"{p}.mlp.down_proj.weight")
        out[f"layers.{i}.input_layernorm.weight"] = take(f"{p}.input_layernorm.weight")
        out[f"layers.{i}.post_attention_layernorm.weight"] = take(f"{p}.post_attention_layernorm.weight")
    if cfg.moe.enabled and not missing:
        from zero2all.model.hf_moe import take_moe_state

        out.update(take_moe_state(hf, cfg, source))
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["embed_tokens.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    if missing:
        raise ConfigError(f"{source or 'HF checkpoint'}: missing tensors: {', '.join(missing[:8])}"
                          + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    if hf:
        extra = sorted(hf)
        raise ConfigError(f"{source or 'HF checkpoint'}: unexpected tensors: {', '.join(extra[:8])}")
    return out


def _cat(*ts):
    if any(t is None for t in ts):
        return None
    return torch.cat(ts, dim=0)


def read_hf_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory: model.safetensors, sharded safetensors (with an index), or
    pytorch_model*.bin read with ``weights_only=True`` (no code is unpickled)."""
    from safetensors.torch import load_file

    d = Path(hf_dir)
    files = sorted(d.glob("*.safetensors"))
    files = [f for f in files if not f.name.startswith("adapter_")]
    if files:
        out = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(d.glob("pytorch_model*.bin"))
    if bins:
        out = {}
        for f in bins:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        return out
    raise FileNotFoundError(f"{d}: no *.safetensors or pytorch_model*.bin weights found")


def read_hf_config(hf_dir: str | Path) -> ModelConfig:
    path = Path(hf_dir) / HF_CONFIG
    if not path.exists():
        raise FileNotFoundError(f"{hf_dir}: no config.json (not an HF model directory)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        reason = getattr(e, "msg", "not UTF-8 text")
        raise ConfigError(f"{path}: not valid JSON ({reason}); the file is damaged") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    try:
        return model_config_from_hf(data, str(path))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        what = f"no {e.args[0]!r} key" if isinstance(e, KeyError) else str(e)
        raise ConfigError(f"{path}: not a Llama-architecture config.json this library can read ({what})") from None
