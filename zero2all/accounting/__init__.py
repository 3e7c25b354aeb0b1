"""Training-cost accounting: parameters, FLOPs, memory, communication, MFU and time, as plain functions.

Every number ``z2all estimate`` prints comes from one function below, and each function's docstring gives its
formula. Symbols used throughout (a Llama-2 decoder, see ``zero2all/model/z2all.py``):

    l  layers               h  hidden size            V  (padded) vocabulary      I  MLP intermediate size
    a  attention heads      a_kv  key/value heads     d  head dim = h / a         q_dim = a*d, kv_dim = a_kv*d
    b  micro-batch size     s  sequence length        t  tensor-parallel size     N  GPUs

Conventions (and why):
- FLOPs count multiply-adds as 2 and only matrix products (the elementwise work of norms, RoPE, SwiGLU and softmax
  is < 1 % for these shapes). :func:`forward_flops_per_token` counts attention over the full s x s score matrix by
  default, as in Megatron-LM (Narayanan et al. 2021) and torch's FLOP counter; a causal kernel computes only the
  lower triangle, half of it, and ``attention_causal=True`` halves the term. Backward = 2 x forward (one product
  for the input gradient, one for the weight gradient).
- The MFU formula is the project's one: MFU = tokens/s * (6*N + 6*l*h*s) / peak, with N the non-embedding
  parameters (the LM head counts) and the causal attention counted as the kernel computes it (half of s^2) --
  see :func:`mfu`. Use it everywhere a throughput is printed.
- Memory sizes are bytes; the GPU table lists vendor memory in GB (1e9 bytes) and dense (non-sparse) bf16 tensor
  FLOP/s from the vendors' spec sheets.
- Nothing here imports torch except the two measurement helpers at the end, which check these formulas against
  what autograd really saves (``saved_activation_bytes``) and what torch's FLOP counter counts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from zero2all.config import ConfigError, ModelConfig

GB = 1e9
SECONDS_PER_DAY = 86400.0

# --------------------------------------------------------------------------------------------------------------
# hardware


@dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16_flops: float   # dense tensor-core bf16 FLOP/s (fp32 accumulate), no sparsity
    memory_bytes: float      # vendor's number, GB = 1e9 bytes
    note: str = ""


GPUS: dict[str, GPU] = {
    "h100": GPU("NVIDIA H100 SXM 80GB", 989e12, 80 * GB),
    "h100-pcie": GPU("NVIDIA H100 PCIe 80GB", 756e12, 80 * GB),
    "h200": GPU("NVIDIA H200 SXM 141GB", 989e12, 141 * GB),
    "b200": GPU("NVIDIA B200 180GB", 2250e12, 180 * GB),
    "a100": GPU("NVIDIA A100 SXM 80GB", 312e12, 80 * GB),
    "a100-40gb": GPU("NVIDIA A100 40GB", 312e12, 40 * GB),
    "l40s": GPU("NVIDIA L40S 48GB", 362e12, 48 * GB),
    "a10": GPU("NVIDIA A10 24GB", 125e12, 24 * GB),
    "l4": GPU("NVIDIA L4 24GB", 121e12, 24 * GB),
    "4090": GPU("NVIDIA GeForce RTX 4090 24GB", 165.2e12, 24 * GB, "bf16 with fp32 accumulate"),
    "3090": GPU("NVIDIA GeForce RTX 3090 24GB", 71e12, 24 * GB, "bf16 with fp32 accumulate"),
    "mi300x": GPU("AMD Instinct MI300X 192GB", 1307e12, 192 * GB),
}

# substrings of torch.cuda.get_device_name() -> key of GPUS, most specific first
_DEVICE_NAME_KEYS = [("h100 pcie", "h100-pcie"), ("h100", "h100"), ("h200", "h200"), ("gh200", "h200"),
                     ("b200", "b200"), ("a100", "a100"), ("l40s", "l40s"), ("a10g", "a10"), ("a10", "a10"),
                     ("l4", "l4"), ("4090", "4090"), ("3090", "3090"), ("mi300x", "mi300x")]


def get_gpu(key: str) -> GPU:
    """The table entry for ``h100``, ``a100``, ...; a clear error lists the known keys."""
    try:
        return GPUS[key.lower()]
    except KeyError:
        raise ConfigError(f"--gpu {key!r}: unknown GPU (known: {', '.join(GPUS)})") from None


def peak_flops_for_device_name(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a ``torch.cuda.get_device_name()`` string, or None when it is not in the table."""
    low = device_name.lower()
    if "a100" in low and "40gb" in low:
        return GPUS["a100-40gb"].peak_bf16_flops
    for needle, key in _DEVICE_NAME_KEYS:
        if needle in low:
            return GPUS[key].peak_bf16_flops
    return None


# --------------------------------------------------------------------------------------------------------------
# parameters


@dataclass
class ParamCounts:
    """Exact parameter counts by part. ``attention_*`` and ``mlp``/``norms`` are totals over all layers."""

    embedding: int
    attention_q: int
    attention_k: int
    attention_v: int
    attention_o: int
    mlp: int
    norms: int            # 2 per layer + the final norm
    lm_head: int          # 0 when tied to the embedding
    per_layer: int
    layers: int           # l * per_layer
    total: int
    non_embedding: int    # total minus the input embedding (the LM head counts); = total when tied
    matmul: int           # parameters used in matrix products (everything but the embedding lookup and norms)
    rule_of_thumb: int    # 12 * l * h^2

    def as_dict(self) -> dict:
        return asdict(self)


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Parameters of ``Z2all(cfg)`` by part, equal to ``build_model(cfg, device="meta").num_params()``.

    per layer: q = h*q_dim, k = v = h*kv_dim (grouped-query attention: a_kv < a shrinks k and v), o = q_dim*h,
               (+ q_dim + 2*kv_dim and h biases with attention_bias), MLP = 3*h*I (SwiGLU: gate, up, down),
               2 RMSNorm weights of h.
    model:     embedding V*h + l*per_layer + final norm h + LM head V*h (0 when tied).

    The rule of thumb 12*l*h^2 assumes multi-head attention (4h^2) and a 4h GeLU MLP (8h^2); for Llama-2-7B
    (I = 11008 ~ 8h/3 * 3 matrices ~ 8h^2) it is within 1 % of the layer parameters, for GQA models it
    overestimates.
    """
    h, l, V, I = cfg.hidden_dim, cfg.n_layers, cfg.padded_vocab_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    bias = cfg.attention_bias
    q = h * q_dim + (q_dim if bias else 0)
    k = h * kv_dim + (kv_dim if bias else 0)
    v = h * kv_dim + (kv_dim if bias else 0)
    o = q_dim * h + (h if bias else 0)
    mlp = 3 * h * I
    norms_layer = 2 * h
    mlp_all = l * mlp
    if cfg.moe.enabled:  # MoE layers: router + routed and shared experts (zero2all/accounting/moe.py)
        from zero2all.accounting.moe import mlp_params_all_layers

        mlp_all = mlp_params_all_layers(cfg)
    layers = l * (q + k + v + o + norms_layer) + mlp_all
    per_layer = layers // l
    embedding = V * h
    lm_head = 0 if cfg.tie_word_embeddings else V * h
    total = embedding + layers + h + lm_head
    non_embedding = total - embedding if not cfg.tie_word_embeddings else total
    matmul = l * (q + k + v + o) + mlp_all + V * h
    return ParamCounts(embedding=embedding, attention_q=l * q, attention_k=l * k, attention_v=l * v,
                       attention_o=l * o, mlp=mlp_all, norms=l * norms_layer + h, lm_head=lm_head,
                       per_layer=per_layer, layers=layers, total=total, non_embedding=non_embedding,
                       matmul=matmul, rule_of_thumb=12 * l * h * h)


# --------------------------------------------------------------------------------------------------------------
# FLOPs


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, attention_causal: bool = False) -> dict:
    """Forward matmul FLOPs per token, by part (GQA- and SwiGLU-aware):

        qkv       2 * h * (q_dim + 2*kv_dim)        per layer
        o         2 * q_dim * h                     per layer
        attention 4 * s * q_dim                     per layer (q k^T and p v over the full s x s; /2 if causal)
        mlp       2 * 3 * h * I                     per layer
        lm_head   2 * h * V

    For multi-head attention and a 4h two-matrix MLP this is Megatron's l*(24*h^2 + 4*s*h) + 2*h*V per token
    (see :func:`megatron_flops_per_step`).
    """
    h, l, V, I = cfg.hidden_dim, cfg.n_layers, cfg.padded_vocab_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attention = 4 * seq_len * q_dim * (0.5 if attention_causal else 1.0)
    parts = {
        "qkv": l * 2 * h * (q_dim + 2 * kv_dim),
        "o": l * 2 * q_dim * h,
        "attention": l * attention,
        "mlp": l * 2 * 3 * h * I,
        "lm_head": 2 * h * V,
    }
    parts["total"] = sum(parts.values())
    return parts


def training_flops_per_token(cfg: ModelConfig, seq_len: int, attention_causal: bool = False) -> float:
    """Forward + backward FLOPs per token = 3 x :func:`forward_flops_per_token` (backward does two products per
    forward product: the input gradient and the weight gradient)."""
    return 3 * forward_flops_per_token(cfg, seq_len, attention_causal)["total"]


def training_flops_per_step(cfg: ModelConfig, batch_size: int, seq_len: int, attention_causal: bool = False) -> float:
    """FLOPs of one optimizer step over ``batch_size`` sequences of ``seq_len`` (all micro-batches, all GPUs)."""
    return batch_size * seq_len * training_flops_per_token(cfg, seq_len, attention_causal)


def flops_6nd(n_params: float, n_tokens: float) -> float:
    """Kaplan et al.'s training-compute approximation C = 6 * N * D (2 forward + 4 backward per parameter/token)."""
    return 6.0 * n_params * n_tokens


def megatron_flops_per_step(batch_size: int, seq_len: int, hidden: int, n_layers: int, vocab: int) -> float:
    """Narayanan et al. (2021)'s forward FLOPs of a GPT step, l*(24*b*s*h^2 + 4*b*s^2*h) + 2*b*s*h*V, times 3
    for forward + backward (multi-head attention, 4h GeLU MLP; no activation recomputation)."""
    b, s, h, l, V = batch_size, seq_len, hidden, n_layers, vocab
    return 3.0 * (l * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * V)


def mfu_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The project's model FLOPs per trained token: 6*N + 6*l*h*s, N = non-embedding parameters (LM head counts).

    MoE models: N counts the parameters one token goes through (``accounting.moe``: router, top_k routed and the
    shared experts). 6*N is the matmul work of forward+backward; 6*l*h*s is the attention score/value products of
    a causal model as the kernel computes them: 3 (forward + backward) x 4*s*q_dim (q k^T and p v, q_dim = h) x 1/2,
    because under the causal mask a token attends to the positions before it, so only the lower half of the s x s
    score matrix is computed (flash attention skips the masked blocks). Counting the full s x s (12*l*h*s, the
    Megatron-LM / PaLM convention) credits work the kernel never does: at seq 65,536 the attention is most of the
    counted FLOPs and the full count nearly doubles the MFU. It equals 3 x :func:`forward_flops_per_token` with
    ``attention_causal=True`` up to the norm weights (6 FLOPs per norm weight).
    """
    if cfg.moe.enabled:  # a MoE token goes through top_k of the routed experts: N = active parameters
        from zero2all.accounting.moe import moe_param_counts

        n = moe_param_counts(cfg).active_non_embedding
    else:
        n = param_counts(cfg).non_embedding
    return 6.0 * n + 6.0 * cfg.n_layers * cfg.hidden_dim * seq_len


def mfu(tokens_per_s: float, cfg, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: tokens/s * (6*N + 6*l*h*s) / peak, as a fraction (0.42 = 42 %), causal attention
    counted as computed (half of s^2, see :func:`mfu_flops_per_token`).

    ``cfg`` is a ModelConfig (or a Config, whose ``.model`` is used); ``peak_flops`` is the peak of ALL devices
    the tokens/s were measured on (n_gpus * 989e12 for H100s in bf16). Printed the same way everywhere.
    """
    cfg = getattr(cfg, "model", cfg)
    if peak_flops <= 0:
        raise ValueError(f"mfu: peak_flops must be positive, got {peak_flops}")
    return tokens_per_s * mfu_flops_per_token(cfg, seq_len) / peak_flops


# --------------------------------------------------------------------------------------------------------------
# memory: model states


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for weights, gradients and optimizer state (AdamW), and per activation element."""

    name: str
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    autocast_weight_copies: bool   # autocast keeps a bf16 copy of each matmul weight from forward to backward
    description: str

    @property
    def state_bytes_per_param(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


PRECISIONS: dict[str, Precision] = {
    "bf16-amp": Precision("bf16-amp", 4, 4, 8, 2, True,
                          "fp32 weights/grads, AdamW m+v fp32, bf16 autocast (this project's trainer): 16 B/param"),
    "bf16-mixed": Precision("bf16-mixed", 2, 2, 12, 2, False,
                            "bf16 weights/grads, fp32 master + m + v in the optimizer (ZeRO paper): 16 B/param"),
    "fp32": Precision("fp32", 4, 4, 8, 4, False, "everything fp32: 16 B/param, 4-byte activations"),
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ConfigError(f"precision {name!r}: unknown (known: {', '.join(PRECISIONS)})") from None


def model_state_bytes(n_params: float, precision: str = "bf16-amp", zero: int = 0, dp: int = 1) -> dict:
    """Weights, gradients and AdamW states per GPU for ``n_params`` parameters replicated over ``dp`` GPUs.

    ZeRO (Rajbhandari et al. 2020) shards over the data-parallel group: stage 1 the optimizer states, stage 2 also
    the gradients, stage 3 also the weights:
        weights    = P * w / (dp if zero >= 3 else 1)
        gradients  = P * g / (dp if zero >= 2 else 1)
        optimizer  = P * o / (dp if zero >= 1 else 1)
    with (w, g, o) = (4, 4, 8) for fp32 and bf16-amp, (2, 2, 12) for bf16-mixed: 16 bytes per parameter either way.
    """
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero {zero}: must be 0, 1, 2 or 3")
    if dp < 1:
        raise ConfigError(f"data-parallel size must be >= 1, got {dp}")
    p = get_precision(precision)
    weights = n_params * p.weight_bytes / (dp if zero >= 3 else 1)
    grads = n_params * p.grad_bytes / (dp if zero >= 2 else 1)
    optimizer = n_params * p.optimizer_bytes / (dp if zero >= 1 else 1)
    return {"weights": weights, "gradients": grads, "optimizer": optimizer, "total": weights + grads + optimizer}


def largest_trainable_params(gpu_memory_bytes: float, n_gpus: int, zero: int, precision: str = "bf16-amp") -> float:
    """Largest parameter count whose weights + gradients + AdamW states fit (activations and buffers ignored):
    memory / (w/s3 + g/s2 + o/s1), s_k = n_gpus when the ZeRO stage shards that part, else 1."""
    per_param = model_state_bytes(1.0, precision, zero, n_gpus)["total"]
    return gpu_memory_bytes / per_param


# --------------------------------------------------------------------------------------------------------------
# memory: activations


def korthikanti_activation_bytes_per_layer(seq_len: int, micro_batch_size: int, hidden: int, n_heads: int, tp: int = 1,
                                           sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes of ONE GPT layer as published by Korthikanti et al. (2022), Table 2 (16-bit activations,
    1-byte dropout masks, multi-head attention, 4h GeLU MLP, attention scores materialised):

        no parallelism                  s*b*h * (34 + 5*a*s/h)
        tensor parallel t               s*b*h * (10 + 24/t + 5*a*s/(h*t))
        tensor + sequence parallel      s*b*h/t * (34 + 5*a*s/h)
        selective recompute (+TP)       s*b*h * (10 + 24/t)        (with SP: 34*s*b*h/t)
        full recompute                  2*s*b*h                    (with SP: 2*s*b*h/t; only the layer input)
    """
    s, b, h, a, t = seq_len, micro_batch_size, hidden, n_heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        return 34 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    if recompute != "none":
        raise ConfigError(f"recompute {recompute!r}: not one of none, selective, full")
    if sequence_parallel:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def activation_bytes_per_token_per_layer(cfg: ModelConfig, precision: str = "bf16-amp", tp: int = 1,
                                         sequence_parallel: bool = False, recompute: str = "none",
                                         fused_kernels: bool = True, kv_repeated: bool = False,
                                         fused_linear: bool = False) -> dict:
    """Bytes autograd keeps per token for one Z2all block, by tensor (the Korthikanti et al. method applied to
    this model: RMSNorm, RoPE, SwiGLU, GQA, a flash-type attention kernel that stores no s x s matrix).

    e = activation bytes (2 in bf16), r = residual-stream bytes (4 with ``residual_in_fp32``, else e):

        attention norm   r*h + 4        residual input + 1/rms        (torch path also keeps the fp32 normalised
        mlp norm         r*h + 4        same                           value: + 4*h each)
        qkv input        e*h            the normed activation the projection needs for its weight gradient
        q, k, v          e*(q_dim + kv_dim) + e*(q_dim + 2*kv_dim)
                                        the attention kernel saves the rotated q and k (new tensors) and v, a
                                        view that keeps the whole fused qkv output alive; when K/V heads are
                                        repeated for GQA (``kv_repeated``: CPU SDPA, torch < 2.5) it saves the
                                        repeated copies instead: e*3*q_dim
        attn out + lse   e*q_dim + 4*a  kernel output (also the o projection's input) + log-sum-exp per head
        gate_up input    e*h
        gate|up          2*e*I          SwiGLU's input (the fused kernel recomputes silu in backward)
        down input       e*I            silu(gate)*up             (torch path also keeps silu(gate): + e*I)
        dropout masks    h per dropout  (1 byte, only when dropout1/dropout2 > 0)

    With ``fused_linear`` (the lean norm_linear / swiglu_linear / lean_linear of ``kernels/fused_linear.py``) each
    norm keeps only its normalised value in the compute dtype and 1/rms, which also stand in for the projection
    input; the down projection's input is recomputed from gate|up in backward:

        norms            e*h + 4 each   (instead of r*h + 4 + the projection input e*h)
        projection inputs, down input   0

    Tensor parallelism shards everything between the two projections of each sub-block (q, k, v, attention out,
    gate|up, down input) by t; sequence parallelism shards the rest (norm inputs, projection inputs) by t as
    well. Recompute: ``selective`` re-runs the attention core in backward (its out/lse are not kept; the s x s
    terms Korthikanti removes do not exist with a flash kernel), ``full`` keeps only the block's inputs
    (x: e*h and the residual: r*h).
    """
    p = get_precision(precision)
    e = p.activation_bytes
    r = 4 if (cfg.residual_in_fp32 or e == 4) else e
    h, a, I = cfg.hidden_dim, cfg.n_heads, cfg.intermediate_size
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    if kv_repeated and kv_dim < q_dim:
        qkv_saved = e * 3 * q_dim
    else:
        qkv_saved = e * (q_dim + kv_dim) + e * (q_dim + 2 * kv_dim)
    t = tp
    sp = t if sequence_parallel else 1
    if recompute not in ("none", "selective", "full"):
        raise ConfigError(f"recompute {recompute!r}: not one of none, selective, full")
    if recompute == "full":
        parts = {"block inputs": (e * h + r * h) / sp}
        parts["total"] = sum(parts.values())
        return parts
    norm_extra = 0 if fused_kernels else 4 * h
    parts = {
        "norms": 2 * (r * h + 4 + norm_extra) / sp,
        "projection inputs": 2 * e * h / sp,                      # qkv input, gate_up input
        "q, k, v": qkv_saved / t,
        "attention out + lse": (e * q_dim + (0 if recompute == "selective" else 4 * a)) / t,
        "gate|up": 2 * e * I / t,
        "down input": (e * I + (0 if fused_kernels else e * I)) / t,
    }
    if fused_linear:  # round_c(y) + 1/rms per norm; the down input is rebuilt from gate|up in backward
        parts.update({"norms": 2 * (e * h + 4) / sp, "projection inputs": 0, "down input": 0})
    masks = (h if cfg.dropout1 else 0) + (h if cfg.dropout2 else 0)
    if masks:
        parts["dropout masks"] = masks / sp
    parts["total"] = sum(parts.values())
    return parts


def head_activation_bytes_per_token(cfg: ModelConfig, precision: str = "bf16-amp", fused_cross_entropy: bool = True,
                                    fused_kernels: bool = True) -> dict:
    """Activations outside the blocks, per token: token ids (8, for the embedding gradient), final norm
    (r*h + 4, + 4*h on the torch path), LM-head input (e*h), and without the fused linear-cross-entropy the
    fp32 log-softmax of the logits (4*V) that cross-entropy keeps for backward. (The bf16 logits themselves, e*V,
    are the forward's output and live as long as the caller holds them; see :func:`peak_memory_bytes`.)"""
    p = get_precision(precision)
    e = p.activation_bytes
    r = 4 if (cfg.residual_in_fp32 or e == 4) else e
    h, V = cfg.hidden_dim, cfg.padded_vocab_size
    parts = {"token ids": 8, "final norm": r * h + 4 + (0 if fused_kernels else 4 * h), "lm_head input": e * h}
    if not fused_cross_entropy:
        parts["log-softmax (fp32)"] = 4 * V
    parts["total"] = sum(parts.values())
    return parts


def autocast_weight_copy_bytes(cfg: ModelConfig, precision: str = "bf16-amp", tp: int = 1, pp: int = 1,
                               zero: int = 0, fused_cross_entropy: bool = False, fused_linear: bool = False) -> float:
    """bf16 copies of the matmul weights that autocast makes in forward and autograd keeps until backward:
    2 bytes per matmul parameter of this GPU's shard (under ZeRO-3 only the ~2 layers being gathered). The fused
    linear-cross-entropy takes the LM head's weight as it is, so its copy is left out then; the lean fused
    linears (``fused_linear``) cast the block weights again in backward, so theirs are left out as well."""
    if not get_precision(precision).autocast_weight_copies:
        return 0.0
    pc = param_counts(cfg)
    layer_matmul = (pc.attention_q + pc.attention_k + pc.attention_v + pc.attention_o + pc.mlp) / cfg.n_layers
    if fused_linear:
        layer_matmul = 0
    if zero >= 3:
        return 2.0 * 2 * layer_matmul / tp
    layers = math.ceil(cfg.n_layers / pp)
    head = 0 if fused_cross_entropy else cfg.padded_vocab_size * cfg.hidden_dim
    return 2.0 * (layers * layer_matmul + head) / tp


# --------------------------------------------------------------------------------------------------------------
# parallel layout, peak memory, largest micro-batch


def params_per_gpu(cfg: ModelConfig, tp: int = 1, pp: int = 1) -> float:
    """Parameters one GPU holds before ZeRO sharding: the worst pipeline stage (ceil(l/pp) layers plus the
    embedding on the first stage or the LM head + final norm on the last), matmul weights and embedding split by
    tp (vocab-parallel), norm weights replicated."""
    pc = param_counts(cfg)
    h, l = cfg.hidden_dim, cfg.n_layers
    layer_matmul = pc.per_layer - 2 * h
    layers = math.ceil(l / pp)
    body = layers * (layer_matmul / tp + 2 * h)
    first = pc.embedding / tp
    last = pc.lm_head / tp + h
    if pp == 1:
        return body + first + last
    return body + max(first, last)


def peak_memory_bytes(cfg: ModelConfig, micro_batch_size: int, seq_len: int, n_gpus: int = 1,
                      precision: str = "bf16-amp", zero: int = 0, tp: int = 1, pp: int = 1,
                      grad_accum_steps: int = 1, recompute: str = "none",
                      sequence_parallel: bool | None = None, fused_kernels: bool = True,
                      fused_cross_entropy: bool = True, fused_linear: bool = False, pp_microbatches: int = 0) -> dict:
    """Predicted peak memory of one GPU during a training step, by part:

        model states      :func:`model_state_bytes` of :func:`params_per_gpu` over dp = n_gpus / (tp*pp)
        weight copies     :func:`autocast_weight_copy_bytes`
        activations       b*s * (layers_on_gpu * per-layer + head) * in-flight micro-batches (1F1B keeps
                          min(pp, grad_accum) micro-batches on the first stage); with ``pp_microbatches`` = m > 0
                          each micro-batch runs as m pipeline microbatches of b/m sequences, of which
                          min(pp, grad_accum * m) are in flight; with full recompute one block's full activations
                          are rebuilt during its backward and are added once
        logits            without the fused loss: the bf16 logits the forward returns (e*V per token) and, at the
                          start of backward, two fp32 gradients of the log-softmax (8*V per token)

    The peak is at the start of backward: every activation alive, and the gradients only if they survive between
    backward passes (gradient accumulation, ``grad_accum_steps > 1``); with one micro-batch per step they are
    created while activations are freed, so the peak is max(that, weights + gradients + optimizer).
    """
    if n_gpus % (tp * pp):
        raise ConfigError(f"--gpus {n_gpus} is not divisible by tp*pp = {tp * pp}")
    if sequence_parallel is None:
        sequence_parallel = tp > 1
    dp = n_gpus // (tp * pp)
    p = get_precision(precision)
    states = model_state_bytes(params_per_gpu(cfg, tp, pp), precision, zero, dp)
    copies = autocast_weight_copy_bytes(cfg, precision, tp, pp, zero, fused_cross_entropy, fused_linear)
    tokens = micro_batch_size * seq_len
    split = pp_microbatches if pp > 1 and pp_microbatches > 0 else 1   # pipeline microbatches per micro-batch
    layers = math.ceil(cfg.n_layers / pp)
    per_layer = activation_bytes_per_token_per_layer(cfg, precision, tp, sequence_parallel, recompute,
                                                     fused_kernels, fused_linear=fused_linear)["total"]
    head = head_activation_bytes_per_token(cfg, precision, fused_cross_entropy, fused_kernels)["total"]
    in_flight = min(pp, grad_accum_steps * split) / split if pp > 1 else 1   # in micro-batches' worth
    activations = in_flight * tokens * (layers * per_layer + head / (tp if sequence_parallel else 1))
    if recompute == "full":
        activations += tokens * activation_bytes_per_token_per_layer(cfg, precision, tp, sequence_parallel, "none",
                                                                     fused_kernels,
                                                                     fused_linear=fused_linear)["total"]
    logits = 0.0 if fused_cross_entropy else tokens * cfg.padded_vocab_size * (p.activation_bytes + 8) / tp
    grads_at_peak = states["gradients"] if grad_accum_steps > 1 else 0.0
    at_backward_start = states["weights"] + states["optimizer"] + grads_at_peak + copies + activations + logits
    total = max(at_backward_start, states["total"])
    return {"weights": states["weights"], "gradients": states["gradients"], "optimizer": states["optimizer"],
            "model_states": states["total"], "weight_copies": copies, "activations": activations,
            "logits": logits, "at_backward_start": at_backward_start, "at_optimizer_step": states["total"],
            "total": total}


def max_micro_batch_size(cfg: ModelConfig, seq_len: int, gpu_memory_bytes: float, reserve_bytes: float = 2 * GB,
                    **layout) -> int:
    """Largest micro-batch whose :func:`peak_memory_bytes` fits in ``gpu_memory_bytes - reserve_bytes`` (the
    reserve covers the CUDA context, allocator fragmentation and workspaces); 0 if not even one sequence fits.
    ``layout`` takes the keyword arguments of :func:`peak_memory_bytes` (n_gpus, precision, zero, tp, ...)."""
    budget = gpu_memory_bytes - reserve_bytes

    def fits(b: int) -> bool:
        return peak_memory_bytes(cfg, b, seq_len, **layout)["total"] <= budget

    if not fits(1):
        return 0
    hi = 2
    while fits(hi):  # peak memory grows with the micro-batch: double, then bisect
        hi *= 2
        if hi > 1 << 24:
            return hi
    lo = hi // 2  # fits(lo) and not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --------------------------------------------------------------------------------------------------------------
# communication


def ring_all_reduce_factor(n: int) -> float:
    """Bytes a GPU sends per byte of buffer in a ring all-reduce: 2(n-1)/n (reduce-scatter + all-gather)."""
    return 2.0 * (n - 1) / n if n > 1 else 0.0


def ring_gather_factor(n: int) -> float:
    """Bytes sent per buffer byte in a ring reduce-scatter or all-gather: (n-1)/n."""
    return (n - 1) / n if n > 1 else 0.0


def data_parallel_comm_bytes(n_params: float, dp: int, zero: int = 0, precision: str = "bf16-amp",
                             grad_accum_steps: int = 1) -> dict:
    """Bytes each GPU sends per optimizer step for data parallelism over ``dp`` GPUs, P params, M micro-batches,
    gradients of g bytes and weights of w bytes (ring collectives):

        DDP (zero 0)  all-reduce grads once per step (no_sync during accumulation)   2(dp-1)/dp * P*g
        ZeRO-1        reduce-scatter grads once + all-gather updated weights          (dp-1)/dp * P*(g + w)
        ZeRO-2        reduce-scatter grads every micro-batch + all-gather weights     (dp-1)/dp * P*(M*g + w)
        ZeRO-3        per micro-batch all-gather weights for forward and for backward
                      and reduce-scatter grads                                        (dp-1)/dp * M*P*(2w' + g)

    (w' the bytes of the gathered copy.) With g = w and M = 1 this is the ZeRO paper's 2P (stages 0-2) and 3P
    (stage 3). Under bf16-amp, FSDP2 gathers the weights for compute in bf16 (its ``param_dtype``), so ZeRO-3's
    gathers move 2 bytes per parameter while the gradients are reduced in fp32 (``parallel.fsdp_reduce_fp32``);
    measured on z2all-1.7b, dp 4, M 8: all-gather 39.0 GB and reduce-scatter 39.7 GB per GPU per step, as this
    formula gives.
    """
    p = get_precision(precision)
    g, w, M = p.grad_bytes, p.weight_bytes, grad_accum_steps
    w_gather = p.activation_bytes if p.autocast_weight_copies else w   # the dtype FSDP2 gathers for compute
    f = ring_gather_factor(dp)
    if zero == 0:
        sent = ring_all_reduce_factor(dp) * n_params * g
    elif zero == 1:
        sent = f * n_params * (g + w)
    elif zero == 2:
        sent = f * n_params * (M * g + w)
    elif zero == 3:
        sent = f * M * n_params * (2 * w_gather + g)
    else:
        raise ConfigError(f"--zero {zero}: must be 0, 1, 2 or 3")
    collective = ["all-reduce", "reduce-scatter + all-gather", "reduce-scatter + all-gather",
                  "all-gather x2 + reduce-scatter"][zero]
    return {"bytes_per_step": sent, "collective": collective}


def tensor_parallel_comm_bytes(cfg: ModelConfig, micro_batch_size: int, seq_len: int, tp: int,
                               grad_accum_steps: int = 1, precision: str = "bf16-amp", recompute: str = "none",
                               pp: int = 1) -> float:
    """Bytes each GPU sends per optimizer step for Megatron tensor parallelism: per block and micro-batch two
    all-reduces of the b*s*h activation in forward and two in backward (with sequence parallelism each becomes an
    all-gather + reduce-scatter of the same total volume), each 2(t-1)/t * b*s*h*e; full recompute re-runs the
    forward's two: 4 -> 6."""
    e = get_precision(precision).activation_bytes
    n_collectives = 6 if recompute == "full" else 4
    layers = math.ceil(cfg.n_layers / pp)
    return (grad_accum_steps * layers * n_collectives * ring_all_reduce_factor(tp)
            * micro_batch_size * seq_len * cfg.hidden_dim * e)


def context_parallel_comm_bytes(cfg: ModelConfig, micro_batch_size: int, seq_len: int, cp: int,
                                grad_accum_steps: int = 1, precision: str = "bf16-amp", tp: int = 1,
                                pp: int = 1) -> float:
    """Bytes each GPU sends per step for ring attention over ``cp`` ranks: in every attention layer's forward a
    rank passes on cp-1 K/V blocks of b*(s/cp) tokens x 2*n_kv_heads*head_dim/t values; the backward passes the
    K/V blocks again and the dK/dV blocks once: 3 * (cp-1)/cp * b*s*2*kv*e per layer and micro-batch."""
    if cp <= 1:
        return 0.0
    e = get_precision(precision).activation_bytes
    kv = 2 * cfg.n_kv_heads * cfg.head_dim / tp
    layers = math.ceil(cfg.n_layers / pp)
    return grad_accum_steps * layers * 3 * (cp - 1) / cp * micro_batch_size * seq_len * kv * e


def pipeline_bubble_fraction(stages: int, micro_batches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a GPipe / 1F1B schedule with K stages and M micro-batches: (K-1)/(K+M-1).
    (Equivalently the bubble is (K-1)/M of the ideal compute time.) With V virtual stages per rank (interleaved
    1F1B) each fill/drain slot is 1/V as long: (K-1)/(V*M+K-1)."""
    if stages < 1 or micro_batches < 1 or stages_per_rank < 1:
        raise ConfigError("pipeline: stages, micro-batches and stages per rank must be >= 1")
    return (stages - 1) / (stages_per_rank * micro_batches + stages - 1)


# --------------------------------------------------------------------------------------------------------------
# time


def training_seconds(total_flops: float, n_gpus: int, peak_flops_per_gpu: float, mfu_fraction: float) -> float:
    """Wall time = FLOPs / (n_gpus * peak * MFU)."""
    if not 0 < mfu_fraction <= 1:
        raise ConfigError(f"--mfu {mfu_fraction}: must be in (0, 1]")
    return total_flops / (n_gpus * peak_flops_per_gpu * mfu_fraction)


def training_days(n_tokens: float, flops_per_token: float, n_gpus: int, peak_flops_per_gpu: float,
                  mfu_fraction: float) -> float:
    """Days to train on D tokens: D * flops_per_token / (n_gpus * peak * MFU) / 86400. With flops_per_token = 6N
    this is the 6ND estimate; :func:`mfu_flops_per_token` adds the attention term."""
    return training_seconds(n_tokens * flops_per_token, n_gpus, peak_flops_per_gpu, mfu_fraction) / SECONDS_PER_DAY


def step_seconds(cfg: ModelConfig, tokens_per_step: float, seq_len: int, n_gpus: int, peak_flops_per_gpu: float,
                 mfu_fraction: float) -> float:
    """Predicted time of one optimizer step at a given MFU: tokens_per_step * (6N + 6lhs) / (n * peak * MFU)."""
    return training_seconds(tokens_per_step * mfu_flops_per_token(cfg, seq_len), n_gpus, peak_flops_per_gpu,
                            mfu_fraction)


# --------------------------------------------------------------------------------------------------------------
# the whole estimate (what `z2all estimate` prints)


@dataclass
class Layout:
    gpus: int = 1
    gpu: str = "h100"
    tokens: float | None = None        # None = 20 tokens per parameter (Chinchilla-optimal)
    mfu: float = 0.4
    zero: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch_size: int = 1
    seq_len: int = 2048
    grad_accum_steps: int = 1
    recompute: str = "none"
    precision: str = "bf16-amp"
    sequence_parallel: bool | None = None
    fused_kernels: bool = True
    fused_cross_entropy: bool = True
    fused_linear: bool = False
    pp_microbatches: int = 0           # pipeline microbatches per micro-batch (0 = one sequence each)
    pp_stages_per_rank: int = 1        # interleaved schedules: virtual stages per pipeline rank
    residual_in_fp32: bool = True      # the residual stream crosses stage boundaries in fp32

    def validate(self) -> None:
        for name in ("gpus", "tp", "pp", "cp", "micro_batch_size", "seq_len", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if self.gpus % (self.tp * self.pp * self.cp):
            raise ConfigError(f"--gpus {self.gpus} is not divisible by --tp {self.tp} x --pp {self.pp} x --cp "
                              f"{self.cp}")
        if self.seq_len % (2 * self.cp) and self.cp > 1:
            raise ConfigError(f"--seq {self.seq_len} is not divisible by 2 x --cp {self.cp} (load-balanced chunks)")
        if self.tokens is not None and self.tokens <= 0:
            raise ConfigError(f"--tokens: must be positive, got {self.tokens}")
        get_gpu(self.gpu)
        get_precision(self.precision)
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero {self.zero}: must be 0, 1, 2 or 3")
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigError(f"--recompute {self.recompute!r}: not one of none, selective, full")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"--mfu {self.mfu}: must be in (0, 1]")


def _memory_kwargs(L: Layout) -> dict:
    """The keyword arguments of :func:`peak_memory_bytes` for a layout (its micro-batch and sequence aside)."""
    sp = (L.tp > 1) if L.sequence_parallel is None else L.sequence_parallel
    # under tp the loss runs as loss parallel on vocab-sharded logits (distributed/tp.py), not the fused kernel
    fused_ce = L.fused_cross_entropy and L.tp == 1
    # ZeRO / FSDP shards over dp x cp (the cp ranks hold the same weights): n_gpus / (tp * pp) ranks
    return dict(n_gpus=L.gpus, precision=L.precision, zero=L.zero, tp=L.tp, pp=L.pp,
                grad_accum_steps=L.grad_accum_steps, recompute=L.recompute, sequence_parallel=sp,
                fused_kernels=L.fused_kernels, fused_cross_entropy=fused_ce,
                fused_linear=L.fused_linear and L.tp == 1, pp_microbatches=L.pp_microbatches)


def layout_fits(cfg: ModelConfig, L: Layout, reserve_bytes: float = 2 * GB) -> bool:
    """Whether :func:`peak_memory_bytes` of ``L`` stays within the GPU's memory less ``reserve_bytes``."""
    peak = peak_memory_bytes(cfg, L.micro_batch_size, L.seq_len // L.cp, **_memory_kwargs(L))["total"]
    return peak <= get_gpu(L.gpu).memory_bytes - reserve_bytes


def fitting_layout(cfg: ModelConfig, layout: Layout, max_gpus: int = 1 << 16) -> Layout | None:
    """The first layout that fits, for a ``layout`` that does not: the same GPUs first, then 2x, 4x, ... as
    many of the same kind. Per GPU count, candidates are tried from the least to the most disruptive change,
    ranked by a cost: a smaller micro-batch (grad accumulation raised to keep the tokens per step) 1, selective
    recomputation 1 and full 2, ZeRO-1 1 and ZeRO-3 (FSDP) 2, tensor parallel 2 + log2(tp) (at most 8, within a
    node, dividing the heads), pipeline parallel 3 + log2(pp) (at most one stage per layer). None if nothing up
    to ``max_gpus`` fits."""
    L = layout
    tokens_per_rank = L.micro_batch_size * L.grad_accum_steps
    gpus = L.gpus
    while gpus <= max_gpus:
        candidates = []
        for tp in (t for t in (1, 2, 4, 8) if t == L.tp or (gpus % (t * L.cp) == 0 and cfg.n_heads % t == 0
                                                             and cfg.n_kv_heads % t == 0)):
            for pp in (p for p in (1, 2, 4, 8, 16, 32, 64) if p == L.pp or p <= cfg.n_layers):
                if gpus % (tp * pp * L.cp):
                    continue
                for zero in sorted({L.zero, 1, 3}):
                    for recompute in ("none", "selective", "full"):
                        cost = (2 + math.log2(tp) if tp != L.tp else 0) + (3 + math.log2(pp) if pp != L.pp else 0) \
                            + ({0: 0, 1: 1, 2: 1, 3: 2}[zero] if zero > L.zero else 0) \
                            + ({"none": 0, "selective": 1, "full": 2}[recompute] if recompute != L.recompute else 0)
                        if zero < L.zero or (recompute != L.recompute and recompute == "none"):
                            continue
                        candidates.append((cost, tp, pp, zero, recompute))
        for cost, tp, pp, zero, recompute in sorted(candidates):
            trial = replace(L, gpus=gpus, tp=tp, pp=pp, zero=zero, recompute=recompute)
            if layout_fits(cfg, trial):
                return trial
            smallest = replace(trial, micro_batch_size=1, grad_accum_steps=tokens_per_rank)
            if L.micro_batch_size > 1 and layout_fits(cfg, smallest):  # the largest micro-batch that fits
                lo, hi = 1, L.micro_batch_size
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if layout_fits(cfg, replace(trial, micro_batch_size=mid)) else (lo, mid)
                return replace(trial, micro_batch_size=lo, grad_accum_steps=math.ceil(tokens_per_rank / lo))
        gpus *= 2
    return None


def layout_flags(L: Layout) -> str:
    """The ``z2all estimate`` flags that select layout ``L``."""
    return (f"--gpus {L.gpus} --tp {L.tp} --pp {L.pp} --cp {L.cp} --zero {L.zero} --recompute {L.recompute} "
            f"--micro-batch-size {L.micro_batch_size} --grad-accum-steps {L.grad_accum_steps}")


def estimate(cfg: ModelConfig, layout: Layout) -> dict:
    """Everything at once for one model and one cluster layout, as a JSON-ready dict."""
    layout.validate()
    gpu = get_gpu(layout.gpu)
    L = layout
    sp = (L.tp > 1) if L.sequence_parallel is None else L.sequence_parallel
    dp = L.gpus // (L.tp * L.pp * L.cp)
    local_seq = L.seq_len // L.cp         # tokens of each sequence on one cp rank (activations, tp and pp traffic)
    pc = param_counts(cfg)
    tokens = L.tokens if L.tokens is not None else 20.0 * pc.total
    fwd = forward_flops_per_token(cfg, L.seq_len, attention_causal=True)  # as the causal kernel computes it
    per_token_mfu = mfu_flops_per_token(cfg, L.seq_len)
    tokens_per_step = L.micro_batch_size * L.seq_len * L.grad_accum_steps * dp
    mem_kw = _memory_kwargs(L)
    memory = peak_memory_bytes(cfg, L.micro_batch_size, local_seq, **mem_kw)
    per_layer = activation_bytes_per_token_per_layer(cfg, L.precision, L.tp, sp, L.recompute, L.fused_kernels,
                                                     fused_linear=L.fused_linear)
    shard = params_per_gpu(cfg, L.tp, L.pp)
    comm = {
        "data_parallel": data_parallel_comm_bytes(shard, dp * L.cp, L.zero, L.precision, L.grad_accum_steps),
        "tensor_parallel_bytes_per_step": tensor_parallel_comm_bytes(cfg, L.micro_batch_size, local_seq, L.tp,
                                                                     L.grad_accum_steps, L.precision, L.recompute,
                                                                     L.pp),
        "pipeline_bytes_per_step": pipeline_p2p_bytes(
            cfg.hidden_dim, local_seq, L.micro_batch_size, L.grad_accum_steps, L.pp, L.pp_stages_per_rank,
            get_precision(L.precision).activation_bytes,
            4 if L.residual_in_fp32 else get_precision(L.precision).activation_bytes, L.tp, sp),
        "context_parallel_bytes_per_step": context_parallel_comm_bytes(cfg, L.micro_batch_size, L.seq_len, L.cp,
                                                                       L.grad_accum_steps, L.precision, L.tp, L.pp),
    }
    # an update runs as one pipeline schedule of accum x pp_microbatches microbatches (zero2all/distributed/pp.py)
    bubble = pipeline_bubble_fraction(L.pp, (L.pp_microbatches or L.micro_batch_size) * L.grad_accum_steps,
                                      L.pp_stages_per_rank)
    step_s = step_seconds(cfg, tokens_per_step, L.seq_len, L.gpus, gpu.peak_bf16_flops, L.mfu)
    fits = memory["total"] <= gpu.memory_bytes - 2 * GB
    fitting = None if fits else fitting_layout(cfg, L)
    return {
        "layout": asdict(L) | {"dp": dp, "sequence_parallel": sp,
                                                                           "tokens": tokens},
        "gpu": asdict(gpu),
        "params": pc.as_dict(),
        "flops": {
            "forward_per_token": fwd,
            "training_per_token": 3 * fwd["total"],
            "mfu_per_token (6N+6lhs)": per_token_mfu,
            "6N_per_token": 6.0 * pc.non_embedding,
            "per_step": tokens_per_step * per_token_mfu,
            "total_6ND (N=all params)": flops_6nd(pc.total, tokens),
            "total": tokens * per_token_mfu,
        },
        "memory_per_gpu": memory | {
            "gpu_memory": gpu.memory_bytes,
            "fits": fits,
            # the first layout that fits (fitting_layout) when this one does not; None when none does
            "fitting_layout": None if fitting is None else asdict(fitting) | {"flags": layout_flags(fitting)},
            "params_on_gpu_before_zero": shard,
            "activation_per_token_per_layer": per_layer,
            "korthikanti_per_layer (GPT formula)": korthikanti_activation_bytes_per_layer(
                local_seq, L.micro_batch_size, cfg.hidden_dim, cfg.n_heads, L.tp, sp, L.recompute),
            "max_micro_batch_size": max_micro_batch_size(cfg, local_seq, gpu.memory_bytes, **mem_kw),
        },
        "communication": comm,
        "pipeline_bubble": bubble,
        "time": {
            "tokens_per_step": tokens_per_step,
            "step_seconds": step_s,
            "tokens_per_second": tokens_per_step / step_s,
            "steps": tokens / tokens_per_step,
            "days": training_days(tokens, per_token_mfu, L.gpus, gpu.peak_bf16_flops, L.mfu),
            "days_6ND": training_days(tokens, 6.0 * pc.total, L.gpus, gpu.peak_bf16_flops, L.mfu),
            "seconds": training_seconds(tokens * per_token_mfu, L.gpus, gpu.peak_bf16_flops, L.mfu),
            "seconds_6ND": training_seconds(tokens * 6.0 * pc.total, L.gpus, gpu.peak_bf16_flops, L.mfu),
            "gpu_hours": training_seconds(tokens * per_token_mfu, L.gpus, gpu.peak_bf16_flops, L.mfu)
            * L.gpus / 3600,
        },
    }


def format_duration(seconds: float) -> str:
    """A wall time in the unit that keeps it readable: ms under a second, s under two minutes, min under two
    hours, h under two days, else days."""
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * SECONDS_PER_DAY:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / SECONDS_PER_DAY:,.1f} days"


def format_gpu_time(gpu_hours: float) -> str:
    """GPU time in GPU-seconds below one GPU-hour, else GPU-hours."""
    if gpu_hours < 1:
        return f"{gpu_hours * 3600:,.3g} GPU-seconds"
    return f"{gpu_hours:,.0f} GPU-hours"


def _si(x: float, unit: str = "") -> str:
    for div, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {suffix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def format_estimate(est: dict, name: str = "") -> str:
    """The readable table ``z2all estimate`` prints."""
    L, p, f, m, c, t = est["layout"], est["params"], est["flops"], est["memory_per_gpu"], est["communication"], \
        est["time"]
    rows: list[tuple[str, str]] = []

    def section(title):
        rows.append((f"-- {title}", ""))

    section(f"model {name}".strip())
    rows += [("parameters", f"{p['total']:,} ({_si(p['total'])})"),
             ("  embedding", f"{p['embedding']:,}"),
             ("  attention q / k / v / o", f"{p['attention_q']:,} / {p['attention_k']:,} / {p['attention_v']:,} / "
                                           f"{p['attention_o']:,}"),
             ("  mlp (gate, up, down)", f"{p['mlp']:,}"),
             ("  norms", f"{p['norms']:,}"),
             ("  lm head", f"{p['lm_head']:,}" + (" (tied)" if p["lm_head"] == 0 else "")),
             ("non-embedding (N)", f"{p['non_embedding']:,}"),
             ("rule of thumb 12*l*h^2", f"{p['rule_of_thumb']:,} (exact, all layers: {p['layers']:,})")]
    section(f"FLOPs (seq {L['seq_len']})")
    fw = f["forward_per_token"]
    rows += [("forward / token", f"{_si(fw['total'], 'FLOP')} (qkv {_si(fw['qkv'])}, o {_si(fw['o'])}, "
                                 f"attn (causal) {_si(fw['attention'])}, mlp {_si(fw['mlp'])}, "
                                 f"head {_si(fw['lm_head'])})"),
             ("train / token (3x fwd)", _si(f["training_per_token"], "FLOP")),
             ("MFU FLOPs / token 6N+6lhs", f"{_si(f['mfu_per_token (6N+6lhs)'], 'FLOP')} "
                                            f"(6N alone {_si(f['6N_per_token'], 'FLOP')})"),
             ("per step", f"{f['per_step']:.3g} FLOP"),
             (f"total for {L['tokens']:.3g} tokens", f"{f['total']:.3g} FLOP "
                                                     f"(6ND with all parameters: {f['total_6ND (N=all params)']:.3g})")]
    zero = L["zero"]
    section(f"memory per GPU ({L['precision']}, ZeRO-{zero}, dp {L['dp']} x cp {L['cp']} x tp {L['tp']} x pp "
            f"{L['pp']}, "
            f"micro-batch {L['micro_batch_size']}, recompute {L['recompute']})")
    per_layer = m["activation_per_token_per_layer"]["total"] * L["micro_batch_size"] * L["seq_len"]
    rows += [("weights", _gb(m["weights"])), ("gradients", _gb(m["gradients"])),
             ("optimizer (AdamW)", _gb(m["optimizer"])),
             ("bf16 weight copies", _gb(m["weight_copies"])),
             ("activations", f"{_gb(m['activations'])} "
                             f"({m['activation_per_token_per_layer']['total']:,.0f} B/token/layer = "
                             f"{_gb(per_layer)}"
                             f"/layer; Korthikanti's GPT formula, s x s scores kept: "
                             f"{_gb(m['korthikanti_per_layer (GPT formula)'])}/layer)"),
             ("logits", _gb(m["logits"])),
             ("at backward start (sum)", f"{_gb(m['at_backward_start'])} (weights + optimizer + weight copies + "
                                         f"activations + logits"
                                         + (" + gradients, kept between micro-batches)" if L["grad_accum_steps"] > 1
                                            else "; the gradients come as activations are freed)")),
             ("at optimizer step (sum)", f"{_gb(m['at_optimizer_step'])} (weights + gradients + optimizer)"),
             ("peak (the larger)", f"{_gb(m['total'])} of {_gb(m['gpu_memory'])} (2 GB kept for the CUDA context and "
                                   f"workspaces) -> {'fits' if m['fits'] else 'DOES NOT FIT'}"),
             ("largest micro-batch that fits", str(m["max_micro_batch_size"]))]
    if not m["fits"]:
        fit = m.get("fitting_layout")
        rows.append(("a layout that fits", f"{fit['flags']} (the first found: the same GPUs, then 2x, 4x, ... "
                                           f"of them)" if fit else "none up to 65,536 GPUs of this kind"))
    section("communication per GPU per step")
    rows += [(f"data parallel ({c['data_parallel']['collective']})", _gb(c["data_parallel"]["bytes_per_step"])),
             ("tensor parallel", _gb(c["tensor_parallel_bytes_per_step"])),
             ("pipeline p2p", _gb(c["pipeline_bytes_per_step"])),
             ("context parallel ring K/V", _gb(c["context_parallel_bytes_per_step"])),
             ("pipeline bubble (K-1)/(K+M-1)", f"{est['pipeline_bubble'] * 100:.1f} %")]
    section(f"time ({L['gpus']} x {L['gpu']}, MFU {L['mfu'] * 100:.0f} %"
            + (", if it fit: see 'a layout that fits')" if not m["fits"] else ")"))
    rows += [("tokens / step", f"{t['tokens_per_step']:,}"),
             ("step time", format_duration(t["step_seconds"])),
             ("throughput", f"{t['tokens_per_second']:,.0f} tokens/s"),
             ("steps", f"{t['steps']:,.0f}"),
             ("training time", f"{format_duration(t['seconds'])} (6ND: {format_duration(t['seconds_6ND'])}), "
                               f"{format_gpu_time(t['gpu_hours'])}")]
    width = max(len(k) for k, _ in rows if not k.startswith("--"))
    return "\n".join(k if k.startswith("--") else f"{k:<{width}}  {v}" for k, v in rows)


# --------------------------------------------------------------------------------------------------------------
# measurement helpers (used by tests and benchmarks/accounting_check.py to check the formulas above)


def _is_parameter_copy(t) -> bool:
    """True when ``t`` is a cast / transpose / view of a parameter (autocast's bf16 weight copy): its autograd
    history is a chain of such nodes ending at a parameter's gradient accumulator."""
    fn = t.grad_fn
    for _ in range(6):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return True
        if name not in _COPY_NODES:
            return False
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
    return False


_COPY_NODES = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
               "UnsafeViewBackward0", "AliasBackward0", "ExpandBackward0"}


def saved_activation_bytes(model, tokens, targets, autocast_dtype=None) -> dict:
    """Run one forward of ``model`` and measure what autograd keeps for backward, with saved_tensors_hooks.

    Each saved tensor's storage is counted once (views share storage). Storages of parameters are left out;
    tensors that are casts of parameters (autocast's bf16 weight copies) are counted apart.
    Returns {"activations", "weight_copies", "tensors"} (bytes, bytes, number of storages).
    """
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in param_ptrs and key not in seen:
            seen[key] = (storage.nbytes(), _is_parameter_copy(t))
        return t

    device_type = tokens.device.type
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            _, loss = model(tokens, targets)
    del loss
    acts = sum(n for n, c in seen.values() if not c)
    copies = sum(n for n, c in seen.values() if c)
    return {"activations": acts, "weight_copies": copies, "tensors": len(seen)}


def measured_flops(model, tokens, targets, backward: bool) -> int:
    """Total FLOPs torch's FlopCounterMode counts for one forward (and backward) of ``model``."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        _, loss = model(tokens, targets)
        if backward:
            loss.backward()
    return counter.get_total_flops()


# --------------------------------------------------------------------------------------------------------------
# pipeline parallelism (zero2all/distributed/pp.py)


def pipeline_p2p_bytes(hidden: int, seq_len: int, micro_batch_size: int, grad_accum_steps: int, stages: int,
                       stages_per_rank: int = 1, act_bytes: int = 2, residual_bytes: int = 4, tp: int = 1,
                       sequence_parallel: bool = False) -> float:
    """Point-to-point bytes one GPU sends per step, on average over the K pipeline ranks. Every boundary between
    consecutive stages (K * V - 1 of them) carries, for every sequence of every micro-batch, the activations x and
    the residual stream (B * T * H elements each) forward and their gradients backward:

        2 * (K V - 1) * accum * B * T * H * (act_bytes + residual_bytes) / K       per GPU

    ``residual_bytes`` is 4 when the residual stream stays fp32 under bf16 autocast (``residual_in_fp32``). Each
    tensor-parallel rank sends its own copy, or with sequence parallelism its 1/tp slice of the sequence."""
    if stages <= 1:
        return 0.0
    boundaries = stages * stages_per_rank - 1
    per_replica = 2.0 * boundaries * grad_accum_steps * micro_batch_size * seq_len * hidden * (act_bytes
                                                                                                + residual_bytes)
    return per_replica / stages / (tp if sequence_parallel else 1)
