"""`z2all estimate` for mixture-of-experts models: total vs active parameters, active FLOPs per token, memory per
GPU under expert parallelism + FSDP, all-to-all volume per step.

With h = hidden, I_e = expert_intermediate_size, E experts of which k are routed per token, s shared experts:

    per MoE layer:   router E h  +  routed E * 3 h I_e  +  shared s * 3 h I_e (+ h for Qwen's shared gate)
    active / token:  router E h  +  (k + s) * 3 h I_e (+ h)          (the experts a token actually goes through)

FLOPs per token use the project's MFU formula with the *active* non-embedding parameters:
6 N_active + 6 l h T (causal attention counted as computed, half of T x T).

Memory under ``parallel.ep`` = ep (distributed/ep.py): every parameter is sharded over all N GPUs (the non-expert
ones by FSDP2 over N, the experts over ep and then FSDP2 over the N / ep dp ranks), so the fp32 weights, gradients
and AdamW moments take 16 P / N bytes; while a layer computes, its gathered bf16 weights (non-expert part whole, the
E / ep local experts) are added, twice for FSDP's prefetch. All-to-all: in each MoE layer every token sends k rows
of h values out and gets them back (dispatch + combine), again in the backward, and a row stays on its own GPU with
probability 1 / ep under balanced routing::

    bytes per GPU per step = 4 * n_moe_layers * tokens_per_gpu * k * h * bytes * (ep - 1) / ep
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zero2all.accounting import GB, mfu_flops_per_token, param_counts
from zero2all.config import ConfigError, ModelConfig


@dataclass
class MoEParams:
    total: int
    active: int                 # the model with only the experts one token goes through (embedding counted whole)
    active_non_embedding: int   # N_active of the MFU formula (the LM head counts)
    experts: int                # routed experts, all layers
    non_expert: int             # everything else
    moe_layers: int
    per_moe_layer_routed: int
    per_moe_layer_active: int


def _moe_layer_parts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(router, routed experts, shared experts + gate) parameters of one MoE layer."""
    m, h, ie = cfg.moe, cfg.hidden_dim, cfg.expert_intermediate_size
    return m.n_experts * h, m.n_experts * 3 * h * ie, m.n_shared_experts * 3 * h * ie + (
        h if m.shared_expert_gate else 0)


def mlp_params_all_layers(cfg: ModelConfig) -> int:
    """MLP parameters over all layers: dense SwiGLU (3 h I) or MoE (router + routed + shared)."""
    n_moe = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.n_layers))
    return (cfg.n_layers - n_moe) * 3 * cfg.hidden_dim * cfg.intermediate_size + n_moe * sum(_moe_layer_parts(cfg))


def moe_param_counts(cfg: ModelConfig) -> MoEParams:
    """Exact counts; the total equals ``build_model(cfg, device="meta").num_params()``."""
    m = cfg.moe
    counts = param_counts(cfg)
    n_moe = sum(m.is_moe_layer(i) for i in range(cfg.n_layers))
    router, routed, shared = _moe_layer_parts(cfg)
    active_layer = router + m.top_k * 3 * cfg.hidden_dim * cfg.expert_intermediate_size + shared
    active = counts.total - n_moe * (router + routed + shared) + n_moe * active_layer
    embedding = 0 if cfg.tie_word_embeddings else counts.embedding
    return MoEParams(total=counts.total, active=active, active_non_embedding=active - embedding,
                     experts=n_moe * routed, non_expert=counts.total - n_moe * routed, moe_layers=n_moe,
                     per_moe_layer_routed=routed, per_moe_layer_active=active_layer)


def moe_estimate(cfg: ModelConfig, gpus: int = 1, ep: int = 1, micro_batch_size: int = 1, seq_len: int = 2048,
                 grad_accum_steps: int = 1, peak_flops: float = 989e12, mfu: float = 0.4,
                 act_bytes: int = 2) -> dict:
    """The MoE part of ``z2all estimate`` (JSON-ready)."""
    if not cfg.moe.enabled:
        raise ConfigError("model.moe.n_experts = 0: not a mixture-of-experts model")
    if ep < 1 or gpus % ep:
        raise ConfigError(f"--ep {ep}: must divide --gpus {gpus}")
    if cfg.moe.n_experts % ep:
        raise ConfigError(f"--ep {ep} does not divide model.moe.n_experts={cfg.moe.n_experts}")
    m, h, L = cfg.moe, cfg.hidden_dim, cfg.n_layers
    p = moe_param_counts(cfg)
    flops_token = mfu_flops_per_token(cfg, seq_len)  # 6 N_active + 6 l h T
    tokens_gpu = micro_batch_size * seq_len * grad_accum_steps
    state = 16 * p.total / gpus                       # fp32 weights + grads + AdamW m, v
    gathered = 2 * 2 * (p.non_expert / max(L, 1) + p.per_moe_layer_routed / ep)  # bf16, x2 prefetch
    a2a = 4 * p.moe_layers * tokens_gpu * m.top_k * h * act_bytes * (ep - 1) / ep
    rows_per_layer = micro_batch_size * seq_len * m.top_k
    return {
        "params": asdict(p) | {"active_fraction": p.active / p.total},
        "flops": {"per_token_active (6N_active+6lhT)": flops_token,
                  "per_token_if_dense (6N_total+6lhT)": 6 * (p.total - param_counts(cfg).embedding)
                  + 6 * L * h * seq_len,
                  "per_step_per_gpu": flops_token * tokens_gpu},
        "memory_per_gpu": {"sharded_state (16 P / N)": state, "gathered_layer_bf16": gathered,
                           "experts_per_gpu": m.n_experts // ep,
                           "expert_rows_per_micro_batch_per_layer": rows_per_layer,
                           "permuted_copies_per_micro_batch (x_sorted, y_sorted, gate_up, h)":
                               p.moe_layers * rows_per_layer * (2 * h + 3 * cfg.expert_intermediate_size)
                               * act_bytes},
        "communication": {"all_to_all_bytes_per_step_per_gpu": a2a, "ep": ep, "dp": gpus // ep},
        "time": {"step_seconds": flops_token * tokens_gpu / (peak_flops * mfu)},
    }


def active_dense_config(cfg: ModelConfig) -> ModelConfig:
    """The dense model a token's computation looks like: each MoE layer's MLP of width (k + s) * I_e. The dense
    estimate of it has the right FLOPs and activations (not the parameter and memory lines: those are above)."""
    import copy

    dense = copy.deepcopy(cfg)
    m = cfg.moe
    dense.intermediate_size = (m.top_k + m.n_shared_experts) * cfg.expert_intermediate_size
    dense.moe.n_experts = 0
    return dense


def format_moe_estimate(est: dict) -> str:
    p, f, mem, c = est["params"], est["flops"], est["memory_per_gpu"], est["communication"]
    rows = [("-- mixture of experts", ""),
            ("parameters total / active", f"{p['total']:,} / {p['active']:,} ({p['active_fraction'] * 100:.1f} %)"),
            ("  routed experts / the rest", f"{p['experts']:,} / {p['non_expert']:,} ({p['moe_layers']} MoE layers)"),
            ("N_active (non-embedding)", f"{p['active_non_embedding']:,}"),
            ("FLOPs / token (active)", f"{f['per_token_active (6N_active+6lhT)']:.3g} "
                                       f"(a dense model of all parameters: "
                                       f"{f['per_token_if_dense (6N_total+6lhT)']:.3g})"),
            (f"memory / GPU (ep {c['ep']} x dp {c['dp']}, FSDP)",
             f"{mem['sharded_state (16 P / N)'] / GB:,.2f} GB sharded state + "
             f"{mem['gathered_layer_bf16'] / GB:,.2f} GB gathered layer + "
             f"{mem['permuted_copies_per_micro_batch (x_sorted, y_sorted, gate_up, h)'] / GB:,.2f} GB expert "
             f"activations; {mem['experts_per_gpu']} experts / GPU"),
            ("all-to-all / GPU / step", f"{c['all_to_all_bytes_per_step_per_gpu'] / GB:,.3f} GB")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(k if k.startswith("--") else f"{k:<{width}}  {v}" for k, v in rows)
