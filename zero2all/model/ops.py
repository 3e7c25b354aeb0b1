"""The op switchboard: every hot op of the model goes through one function here, which picks an implementation.

Each op has a plain PyTorch reference (``*_torch``), which defines the semantics and is what the fused Triton
kernels in ``zero2all/kernels`` are tested against. ``impl`` comes from ``ModelConfig.ops``:

    "torch"  -> the reference below
    "triton" -> the fused kernel (raises if Triton is missing)
    "auto"   -> the fused kernel for CUDA tensors when Triton imports, else the reference

Shapes used throughout: ``x`` (batch, seq, hidden); ``q`` (batch, seq, n_heads, head_dim);
``k``/``v`` (batch, seq, n_kv_heads, head_dim); ``cos``/``sin`` (seq, head_dim // 2), float32.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32: the dtype in which norms, rotations, softmax and the loss are computed. A float64
    tensor stays float64 (``train.precision = "fp64"``), anything narrower becomes float32."""
    return x if x.dtype == torch.float64 else x.float()


def use_triton(impl: str, x: torch.Tensor) -> bool:
    """Whether the fused kernel runs. Float64 tensors always take the plain reference: the Triton kernels compute
    in float32 at best, and ``train.precision = "fp64"`` exists to compare runs at float64 rounding."""
    if x.dtype == torch.float64:
        return False
    if impl == "triton":
        if not triton_available():
            raise RuntimeError("ops: 'triton' was asked for but Triton is not importable; use 'torch' or 'auto'")
        return True
    if impl == "auto":
        return x.is_cuda and triton_available()
    return False


# --------------------------------------------------------------------------------------------------------------
# RMSNorm (fused with the residual add)


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32, returned in x's dtype (Llama / HF semantics:
    the normalised value is cast to the input dtype before the weight multiply)."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rmsnorm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      residual_in_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm block entry: ``residual = residual + x`` then ``rmsnorm(residual)``.

    Returns ``(normed, residual)``; the residual stream is float32 when ``residual_in_fp32`` (so the sum of many
    bf16 block outputs does not lose precision), else x's dtype. ``residual=None`` starts the stream at ``x``.
    """
    if residual is None:
        residual = upcast(x) if residual_in_fp32 else x
    else:
        residual = residual + (upcast(x) if residual_in_fp32 else x)
    return rmsnorm_torch(residual, weight, eps).to(x.dtype), residual


def is_dtensor(t) -> bool:
    """True for a tensor-parallel parameter (``torch.distributed.tensor.DTensor``)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_weight(weight: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a norm weight. Under sequence parallelism the weight is a DTensor replicated over the
    tp ranks while each rank normalises only its own tokens: its gradient here is a partial sum over tokens,
    declared ``Partial`` so that DTensor (or FSDP2) sums it over the ranks. A plain tensor is returned as is."""
    if not is_dtensor(weight):
        return weight
    from torch.distributed.tensor import Partial

    return weight.to_local(grad_placements=[Partial()])


def add_rmsnorm(x, residual, weight, eps, residual_in_fp32=True, impl="auto"):
    weight = local_weight(weight)
    if use_triton(impl, x):
        from zero2all.kernels.rmsnorm import triton_add_rmsnorm

        return triton_add_rmsnorm(x, residual, weight, eps, residual_in_fp32)
    return add_rmsnorm_torch(x, residual, weight, eps, residual_in_fp32)


# --------------------------------------------------------------------------------------------------------------
# Rotary position embedding


def rope_frequencies(head_dim: int, theta: float, positions: torch.Tensor, scaling: dict | None = None,
                     seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (len(positions), head_dim // 2), float32.

    inv_freq_i = theta^(-2i/d). ``scaling``: {"type": "linear", "factor": f} divides positions by f (position
    interpolation); {"type": "dynamic", "factor": f} is dynamic NTK: when the sequence (``seq_len``) exceeds the
    original context L, the base becomes theta * (f * seq_len / L - (f - 1))^(d / (d - 2)).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))
    pos = positions.float()
    if scaling:
        kind = scaling.get("type", scaling.get("rope_type"))
        factor = float(scaling["factor"])
        if kind == "linear":
            pos = pos / factor
        elif kind == "dynamic":
            original = int(scaling.get("original_max_position_embeddings") or 0)
            if seq_len is not None and original and seq_len > original:
                base = theta * ((factor * seq_len / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
                inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                        device=positions.device).float() / head_dim))
        else:
            raise ValueError(f"rope_scaling type {kind!r} is not one of linear, dynamic")
    angles = torch.outer(pos, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate pairs (i, i + d/2) of each head by the position's angle (the "rotate half" layout of Llama in HF).

    out[..., :d/2] = x1 * cos - x2 * sin ;  out[..., d/2:] = x2 * cos + x1 * sin   (computed in float32)

    cos/sin are (T, d/2), shared by every row, or (B, T, d/2) for per-row positions.
    """
    c = cos[:, :, None, :] if cos.dim() == 3 else cos[None, :, None, :]
    s = sin[:, :, None, :] if sin.dim() == 3 else sin[None, :, None, :]

    def rotate(x):
        x1, x2 = upcast(x).chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def eager_functions() -> bool:
    """Whether our fused kernels may run through the plain autograd Functions of ``kernels/eager.py`` (less host
    time per call) instead of their registered custom ops: not while torch.compile traces (it needs the custom
    ops) and not under any Python dispatch mode, such as the selective activation-checkpoint policy, which must see
    each fused op as ONE op to save or recompute (inside a plain Function it would see the kernels' output
    buffers being written after it cached them)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None


def apply_rope(q, k, cos, sin, impl="auto"):
    if use_triton(impl, q):
        if not eager_functions():
            from zero2all.kernels.rope import triton_apply_rope
        else:  # the same kernel through a plain autograd Function (kernels/eager.py: less host time per call)
            from zero2all.kernels.eager import apply_rope as triton_apply_rope
        if cos.dim() == 3:
            # per-row tables (B, T, d/2): fold the rows into the token axis, (1, B*T, heads, d), so that each
            # token gets its own angles (a view of the fused qkv output, no copy)
            B, T = q.shape[:2]
            cos = cos.expand(B, T, -1).reshape(B * T, -1)
            sin = sin.expand(B, T, -1).reshape(B * T, -1)
            q2, k2 = triton_apply_rope(q.reshape(1, B * T, *q.shape[2:]), k.reshape(1, B * T, *k.shape[2:]),
                                       cos, sin)
            return q2.view(q.shape), k2.view(k.shape)
        return triton_apply_rope(q, k, cos, sin)
    return apply_rope_torch(q, k, cos, sin)


# --------------------------------------------------------------------------------------------------------------
# SwiGLU


def swiglu_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where the last dimension of ``gate_up`` is [gate | up] (one fused projection)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(gate_up, impl="auto"):
    if use_triton(impl, gate_up):
        from zero2all.kernels.swiglu import triton_swiglu

        return triton_swiglu(gate_up)
    return swiglu_torch(gate_up)


# --------------------------------------------------------------------------------------------------------------
# Lean projections (norm + linear, SwiGLU + linear, linear): zero2all/kernels/fused_linear.py
#
# The references are the block's plain path: add_rmsnorm then F.linear, swiglu then F.linear, F.linear (under
# autocast the linears cast their weights and keep the copies). The fused versions compute the same values and
# keep far less for backward; see the kernel module's docstring. In eager mode they run through plain autograd
# Functions (kernels/eager.py: less host time per call); torch.compile traces the custom ops.


def weight_cast_cache(store: dict | None = None):
    """A context within which the fused projections cast each weight to the compute dtype once and reuse the
    copy (``kernels/eager.py``): for spans in which no weight changes, such as a pipeline schedule step over all
    the microbatches of an update (``store``: copies kept across spans, see ``cached_weight_casts``). A no-op
    context without Triton."""
    if not triton_available():
        import contextlib

        return contextlib.nullcontext()
    from zero2all.kernels.eager import cached_weight_casts

    return cached_weight_casts(store)


def fp8_casts_use_triton(x: torch.Tensor) -> bool:
    """Where the plain path's FP8 casts run: our Triton kernels (``kernels/fp8.py``) on a GPU, next to the
    ``torch._scaled_mm`` GEMMs; the PyTorch reference of the same rule on CPU, where the GEMM is a float32
    emulation. The two quantise bit for bit alike, so the choice changes the speed only."""
    return x.is_cuda and triton_available()


def linear_torch(x, weight, bias=None, precision="bf16", kind="", numerics=None):
    """``F.linear``; with an FP8 ``precision`` (fp8_rowwise / fp8_tensorwise) the same linear with its three GEMMs
    on FP8 operands (``torch._scaled_mm`` and the Triton casts on a GPU, the PyTorch reference of the rule and a
    float32 emulation of the GEMM on CPU: ``fp8_casts_use_triton``). Under autocast the output is in autocast's
    dtype, as F.linear's. ``numerics``: the model's numerics context (``kernels/numerics.py``: FP8 weight casts,
    delayed scaling; None: none)."""
    if precision == "bf16":
        return F.linear(x, weight, bias)
    from zero2all.kernels.fp8_ref import fp8_linear

    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        return fp8_linear(x, weight, bias, precision, out_dtype=out_dtype, use_triton=fp8_casts_use_triton(x),
                          kind=kind or None, numerics=numerics)


def norm_linear_torch(x, residual, norm_weight, eps, residual_in_fp32, weight, bias=None, precision="bf16",
                      kind="", numerics=None):
    normed, residual = add_rmsnorm_torch(x, residual, norm_weight, eps, residual_in_fp32)
    return linear_torch(normed, weight, bias, precision, kind, numerics), residual


def norm_linear(x, residual, norm_weight, eps, residual_in_fp32, weight, bias=None, impl="auto", precision="bf16",
                kind="", numerics=None):
    """``(F.linear(normed, weight, bias), new_residual)`` with ``normed, new_residual = add_rmsnorm(...)``.

    ``precision``: bf16 (the compute dtype) or an FP8 recipe for the GEMMs; ``kind`` (qkv, gate_up) names the
    projection in the FP8 statistics; ``numerics``: the model's numerics context (``kernels/numerics.py``), which
    owns every cache and history the op keeps (None: none)."""
    if use_triton(impl, x):
        if eager_functions():
            from zero2all.kernels import eager

            return eager.norm_linear(x, residual, norm_weight, eps, residual_in_fp32, weight, bias, precision,
                                     kind, numerics)
        from zero2all.kernels.fused_linear import triton_norm_linear

        return triton_norm_linear(x, residual, norm_weight, eps, residual_in_fp32, weight, bias, precision, kind,
                                  numerics)
    return norm_linear_torch(x, residual, norm_weight, eps, residual_in_fp32, weight, bias, precision, kind,
                             numerics)


def swiglu_linear_torch(gate_up, weight, bias=None, precision="bf16", kind="", numerics=None):
    return linear_torch(swiglu_torch(gate_up), weight, bias, precision, kind, numerics)


def swiglu_linear(gate_up, weight, bias=None, impl="auto", precision="bf16", kind="", numerics=None):
    """``F.linear(silu(gate) * up, weight, bias)``."""
    if use_triton(impl, gate_up):
        if eager_functions():
            from zero2all.kernels import eager

            return eager.swiglu_linear(gate_up, weight, bias, precision, kind, numerics)
        from zero2all.kernels.fused_linear import triton_swiglu_linear

        return triton_swiglu_linear(gate_up, weight, bias, precision, kind, numerics)
    return swiglu_linear_torch(gate_up, weight, bias, precision, kind, numerics)


def lean_linear(x, weight, bias=None, impl="auto", precision="bf16", kind="", numerics=None):
    """``F.linear(x, weight, bias)``; the fused version casts the weight again in backward instead of keeping
    autocast's copy."""
    if use_triton(impl, x):
        if eager_functions():
            from zero2all.kernels import eager

            return eager.lean_linear(x, weight, bias, precision, kind, numerics)
        from zero2all.kernels.fused_linear import lean_linear as triton_lean_linear

        return triton_lean_linear(x, weight, bias, precision, kind, numerics)
    return linear_torch(x, weight, bias, precision, kind, numerics)


# --------------------------------------------------------------------------------------------------------------
# LM head + cross-entropy


def linear_cross_entropy_torch(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               ignore_index: int = -100, z_loss: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Mean (``reduction="sum"``: sum) cross-entropy of ``hidden @ weight.T`` over targets != ignore_index (logits
    in float32).

    ``z_loss`` adds z_loss * mean(logsumexp(logits)^2) over the same tokens (PaLM's auxiliary loss; summed with
    ``"sum"``)."""
    logits = upcast(F.linear(hidden, weight))
    logits = logits.view(-1, logits.size(-1))
    targets = targets.reshape(-1)
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)
    if z_loss:
        valid = targets != ignore_index
        lse2 = torch.logsumexp(logits[valid], dim=-1).pow(2)
        loss = loss + z_loss * (lse2.sum() if reduction == "sum" else lse2.mean())
    return loss


def linear_cross_entropy(hidden, weight, targets, ignore_index=-100, z_loss=0.0, impl="auto", numerics=None):
    """``numerics``: the model's numerics context (the fused loss reads its step-fusion marks; None: none)."""
    if uses_fused_cross_entropy(impl, hidden):
        from zero2all.kernels.cross_entropy import fused_linear_cross_entropy

        return fused_linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index, z_loss=z_loss,
                                          numerics=numerics)
    return linear_cross_entropy_torch(hidden, weight, targets, ignore_index, z_loss)


def uses_fused_cross_entropy(impl: str, hidden: torch.Tensor) -> bool:
    if hidden.dtype == torch.float64:  # the fused kernel accumulates in float32: the reference in float64
        return False
    return impl == "fused" or (impl == "auto" and hidden.is_cuda and triton_available())


# --------------------------------------------------------------------------------------------------------------
# Attention


def attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """The reference: softmax(q k^T / sqrt(d) + mask) v with K/V heads repeated for grouped-query attention.

    q (B, H, Tq, D), k/v (B, Hkv, Tk, D); ``mask`` is boolean (Tq, Tk) or (B, 1, Tq, Tk), True = may attend.
    """
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = (upcast(q) @ upcast(k).transpose(-2, -1)) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    if dropout_p and training:
        probs = F.dropout(probs, dropout_p)
    return (probs @ upcast(v)).to(q.dtype)


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Boolean (q_len, kv_len) mask for queries that are the last q_len of kv_len positions."""
    offset = kv_len - q_len
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= i + offset


def attention(q, k, v, impl="sdpa", dropout_p=0.0, training=False, doc_ids=None, mask=None):
    """Causal attention. q (B, H, Tq, D); k, v (B, Hkv, Tk, D) with Tk >= Tq (a KV cache holds the earlier keys).

    ``doc_ids`` (B, T) of document indices restricts attention to the same document (needs Tq == Tk).
    ``mask``: an explicit boolean mask broadcastable to (B, 1, Tq, Tk), True = may attend, used as given (the
    caller includes causality; e.g. a static KV cache with padded or not yet written slots). Every query must
    see at least one key. With ``flex`` an explicit mask takes the SDPA path.
    """
    tq, tk = q.size(2), k.size(2)
    if mask is not None:
        if impl == "naive":
            return attention_naive(q, k, v, mask, dropout_p, training)
        return _sdpa(q, k, v, mask, dropout_p if training else 0.0, is_causal=False)
    if impl == "flex":
        from zero2all.kernels.attention import flex_causal_attention

        return flex_causal_attention(q, k, v, doc_ids=doc_ids)
    mask = None
    if doc_ids is not None:
        if tq != tk:
            raise ValueError("attention: document masks need the full sequence (no KV cache)")
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        mask = (same & causal_mask(tq, tk, q.device))[:, None]
    elif tq != tk and tq > 1:
        mask = causal_mask(tq, tk, q.device)
    if impl == "naive":
        if mask is None and tq > 1:
            mask = causal_mask(tq, tk, q.device)
        return attention_naive(q, k, v, mask, dropout_p, training)
    if impl != "sdpa":
        raise ValueError(f"attention impl {impl!r} is not one of naive, sdpa, flex")
    return _sdpa(q, k, v, mask, dropout_p if training else 0.0, is_causal=mask is None and tq > 1)


def _sdpa(q, k, v, mask, dropout_p, is_causal):
    groups = q.size(1) // k.size(1)
    kwargs = {}
    if groups > 1 and mask is not None:
        return _sdpa_grouped_masked(q, k, v, mask, dropout_p)
    if groups > 1:
        if _SDPA_HAS_GQA:  # a constant, so torch.compile does not trace inspect.signature
            kwargs["enable_gqa"] = True
        else:  # torch < 2.5
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          **kwargs)


def _sdpa_grouped_masked(q, k, v, mask, dropout_p):
    """Grouped-query attention with an explicit mask, as plain multi-head attention over the KV heads.

    SDPA's fused kernels take either GQA (``enable_gqa``: flash only, which takes no mask) or a mask (the
    memory-efficient kernel, equal head counts only); both together fall back to the unfused math kernel. The
    G = H / Hkv query heads that share a KV head see the same keys under the same mask, so they are folded into
    the query axis: q (B, H, T, D) -> (B, Hkv, G*T, D) against k, v (B, Hkv, Tk, D), the mask repeated per head
    of the group. Exact: each query row still meets exactly its own keys and mask row.
    """
    B, H, T, D = q.shape
    Hkv, Tk = k.size(1), k.size(2)
    G = H // Hkv
    qf = q.reshape(B, Hkv, G * T, D)                                # head h = kv * G + g
    if T == 1:
        m = mask                                                    # (.., 1, Tk) broadcasts over the G rows
    else:
        m = mask if mask.dim() == 4 else mask[None, None]           # (mB, 1, T, Tk)
        m = m[:, :, None].expand(m.size(0), m.size(1), G, T, Tk).reshape(m.size(0), m.size(1), G * T, Tk)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=m, dropout_p=dropout_p)
    return out.reshape(B, H, T, D)


@functools.lru_cache(maxsize=None)
def _sdpa_has_gqa() -> bool:
    import inspect

    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature (torch 2.5+): its docstring lists the argument
        return "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


_SDPA_HAS_GQA = _sdpa_has_gqa()
