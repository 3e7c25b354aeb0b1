"""Hugging Face interop for MoE models: ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``, both directions.

Attention, norms, embeddings and dense MLPs map as for Llama (``hf.py``). The MoE parts::

    ours (layers.i.mlp.)            Mixtral (model.layers.i.)                 Qwen2-MoE (model.layers.i.mlp.)
    router.weight (E, H)            block_sparse_moe.gate.weight              gate.weight
    experts.gate_up_proj (E, 2I, H) block_sparse_moe.experts.j.w1 / w3        experts.j.gate_proj / up_proj
                                    (gate / up rows of expert j)
    experts.down_proj (E, H, I)     block_sparse_moe.experts.j.w2             experts.j.down_proj
    shared.gate_up_proj.weight      -                                         shared_expert.gate_proj / up_proj
    shared.down_proj.weight         -                                         shared_expert.down_proj
    shared_gate.weight (1, H)       -                                         shared_expert_gate.weight

Export writes the per-expert layout above, which every transformers version reads (transformers 5 fuses the
experts into ``experts.gate_up_proj`` / ``experts.down_proj`` when loading); import takes either layout (the fused
names are what ``save_pretrained`` of transformers 5 may write: ``mlp.experts.gate_up_proj`` (E, 2I, H) = [gate |
up] and ``mlp.experts.down_proj`` (E, H, I), the same as ours).

What each family can express: Mixtral has every layer MoE, no shared expert, the softmax router renormalised over
the top k. Qwen2-MoE adds one shared expert with a sigmoid gate, dense layers (``mlp_only_layers``,
``decoder_sparse_step``) and ``norm_topk_prob``; its q/k/v projections may carry biases but o_proj does not, so a
``qkv_bias`` checkpoint is refused (our ``attention_bias`` puts a bias on o_proj as well). The sigmoid router,
``routed_scaling`` != 1 and shared experts without the gate have no HF counterpart here and are refused on export.
"""

from __future__ import annotations

import torch

from zero2all.config import ConfigError, ModelConfig, MoEConfig

FAMILIES = ("mixtral", "qwen2_moe")


def family_of(cfg: ModelConfig) -> str:
    """The HF family that represents ``cfg`` exactly, or a ConfigError saying what does not fit."""
    m = cfg.moe
    if m.router != "softmax_topk" or m.routed_scaling != 1.0:
        raise ConfigError("model.moe: only the softmax_topk router with routed_scaling = 1 exports to HF "
                          "(Mixtral / Qwen2-MoE)")
    if m.n_shared_experts or m.first_dense_layers or m.moe_every != 1 or not m.renormalize:
        if m.n_shared_experts and not m.shared_expert_gate:
            raise ConfigError("model.moe: shared experts export to Qwen2-MoE only with shared_expert_gate = true")
        if cfg.attention_bias:
            raise ConfigError("model.attention_bias: Qwen2-MoE has no o_proj bias")
        return "qwen2_moe"
    return "mixtral"


def model_config_to_hf_moe(cfg: ModelConfig, base: dict) -> dict:
    """``base`` is the Llama config dict of the same model (``hf.model_config_to_hf``); MoE keys added."""
    m, family = cfg.moe, family_of(cfg)
    out = {k: v for k, v in base.items() if k not in ("mlp_bias", "attention_bias", "head_dim")}
    out.update(model_type=family, num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coef,
               output_router_logits=False)
    if family == "mixtral":
        out.update(architectures=["MixtralForCausalLM"], num_local_experts=m.n_experts,
                   intermediate_size=cfg.expert_intermediate_size, router_jitter_noise=0.0, sliding_window=None)
    else:
        out.update(architectures=["Qwen2MoeForCausalLM"], num_experts=m.n_experts,
                   moe_intermediate_size=cfg.expert_intermediate_size, intermediate_size=cfg.intermediate_size,
                   shared_expert_intermediate_size=m.n_shared_experts * cfg.expert_intermediate_size,
                   norm_topk_prob=m.renormalize, decoder_sparse_step=m.moe_every,
                   mlp_only_layers=list(range(m.first_dense_layers)), qkv_bias=False, use_sliding_window=False)
    return out


def moe_config_from_hf(hf: dict, source: str) -> tuple[MoEConfig, int, int]:
    """(MoEConfig, dense intermediate size, expert intermediate size) of a Mixtral / Qwen2-MoE config.json."""
    family = hf.get("model_type")
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"{source}: router_jitter_noise is not supported")
    if family == "mixtral":
        if hf.get("sliding_window"):
            raise ConfigError(f"{source}: sliding_window attention is not supported")
        inter = hf["intermediate_size"]
        return MoEConfig(n_experts=hf["num_local_experts"], top_k=hf.get("num_experts_per_tok", 2),
                         expert_intermediate_size=inter,
                         aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0))), inter, inter
    if hf.get("qkv_bias", True):
        raise ConfigError(f"{source}: qkv_bias=true (q/k/v biases without an o_proj bias) is not supported")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window is not supported")
    expert, shared = hf["moe_intermediate_size"], hf.get("shared_expert_intermediate_size", 0)
    if shared % expert:
        raise ConfigError(f"{source}: shared_expert_intermediate_size {shared} is not a multiple of "
                          f"moe_intermediate_size {expert}")
    step, dense = hf.get("decoder_sparse_step", 1), sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ConfigError(f"{source}: mlp_only_layers {dense} must be the first layers (0, 1, ...)")
    moe = MoEConfig(n_experts=hf["num_experts"], top_k=hf.get("num_experts_per_tok", 4),
                    n_shared_experts=shared // expert, shared_expert_gate=shared > 0,
                    expert_intermediate_size=expert, moe_every=step, first_dense_layers=len(dense),
                    renormalize=bool(hf.get("norm_topk_prob", False)),
                    aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))
    return moe, hf["intermediate_size"], expert


def _prefixes(cfg: ModelConfig, i: int) -> str:
    return f"model.layers.{i}.block_sparse_moe" if family_of(cfg) == "mixtral" else f"model.layers.{i}.mlp"


def split_moe_state(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, dict]:
    """Our state dict -> (HF tensors of the MoE layers, the remaining tensors for the Llama mapping)."""
    family = family_of(cfg)
    out, rest = {}, {}
    for name, t in sd.items():
        parts = name.split(".")
        if len(parts) < 4 or parts[2] != "mlp" or not cfg.moe.is_moe_layer(int(parts[1])):
            rest[name] = t
            continue
        p, kind = _prefixes(cfg, int(parts[1])), ".".join(parts[3:])
        if kind == "router.weight":
            out[f"{p}.gate.weight"] = t
        elif kind == "router.expert_bias":
            continue
        elif kind == "experts.gate_up_proj":
            for j, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                names = ("w1", "w3") if family == "mixtral" else ("gate_proj", "up_proj")
                out[f"{p}.experts.{j}.{names[0]}.weight"] = gate
                out[f"{p}.experts.{j}.{names[1]}.weight"] = up
        elif kind == "experts.down_proj":
            for j, down in enumerate(t):
                out[f"{p}.experts.{j}.{'w2' if family == 'mixtral' else 'down_proj'}.weight"] = down
        elif kind == "shared.gate_up_proj.weight":
            gate, up = t.chunk(2, dim=0)
            out[f"{p}.shared_expert.gate_proj.weight"], out[f"{p}.shared_expert.up_proj.weight"] = gate, up
        elif kind == "shared.down_proj.weight":
            out[f"{p}.shared_expert.down_proj.weight"] = t
        elif kind == "shared_gate.weight":
            out[f"{p}.shared_expert_gate.weight"] = t
        else:
            raise ConfigError(f"HF export: no HF name for {name}")
    return {k: v.contiguous() for k, v in out.items()}, rest


def take_moe_state(hf: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict:
    """Pop the MoE layers' tensors (per-expert or fused names, ``block_sparse_moe`` or ``mlp``) from ``hf``;
    return them under our names. Missing tensors raise, naming them."""
    m, out, missing = cfg.moe, {}, []

    def take(*keys):
        for k in keys:
            if k in hf:
                return hf.pop(k)
        missing.append(keys[0])
        return None

    names = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}
    for i in range(cfg.n_layers):
        if not m.is_moe_layer(i):
            continue
        ps = [f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"]
        ours = f"layers.{i}.mlp"
        out[f"{ours}.router.weight"] = take(*(f"{p}.gate.weight" for p in ps))
        fused = next((p for p in ps if f"{p}.experts.gate_up_proj" in hf), None)
        if fused is not None:
            out[f"{ours}.experts.gate_up_proj"] = hf.pop(f"{fused}.experts.gate_up_proj")
            out[f"{ours}.experts.down_proj"] = take(f"{fused}.experts.down_proj")
        else:
            gates, ups, downs = [], [], []
            for j in range(m.n_experts):
                for kind, dst in (("gate", gates), ("up", ups), ("down", downs)):
                    dst.append(take(*(f"{p}.experts.{j}.{n}.weight" for p in ps for n in names[kind])))
            if not missing:
                out[f"{ours}.experts.gate_up_proj"] = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)
                out[f"{ours}.experts.down_proj"] = torch.stack(downs)
        if m.n_shared_experts:
            p = f"model.layers.{i}.mlp"
            gate, up = take(f"{p}.shared_expert.gate_proj.weight"), take(f"{p}.shared_expert.up_proj.weight")
            if gate is not None and up is not None:
                out[f"{ours}.shared.gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
            out[f"{ours}.shared.down_proj.weight"] = take(f"{p}.shared_expert.down_proj.weight")
            out[f"{ours}.shared_gate.weight"] = take(f"{p}.shared_expert_gate.weight")
    if missing:
        raise ConfigError(f"{source or 'HF checkpoint'}: missing tensors: {', '.join(missing[:8])}"
                          + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return out
