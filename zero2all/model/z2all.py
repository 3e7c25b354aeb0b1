"""The Z2all model: a Llama-2 decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention, KV cache) in one file.

Read top to bottom: KVCache, Attention, MLP, Block, Z2all. Every hot op goes through ``ops`` (the switchboard),
so a fused Triton kernel and the plain PyTorch reference are interchangeable per ``ModelConfig.ops``.

Layout choices (and why):
- q, k, v come from ONE projection ``qkv`` (hidden -> (n_heads + 2 * n_kv_heads) * head_dim) and gate/up from ONE
  projection ``gate_up`` (hidden -> 2 * intermediate): one large GEMM instead of three / two smaller ones. The HF
  mapping in ``hf.py`` splits and joins them; the math is identical to HF's LlamaForCausalLM.
- Pre-norm with the residual add fused into the norm: each block receives ``(x, residual)`` where x is the last
  sub-layer's output, so "residual += x; normed = rmsnorm(residual)" is one kernel. With ``residual_in_fp32`` the
  residual stream stays float32 under bf16 autocast.
- Initialisation: N(0, initializer_range) for every linear and the embedding; the two projections that write into
  the residual stream (``o_proj``, ``down_proj``) use std / sqrt(2 * n_layers) when ``scaled_init`` (GPT-2 /
  Megatron: keeps the residual's variance independent of depth); norm weights are 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero2all.config import ModelConfig
from zero2all.kernels.numerics import Numerics
from zero2all.model import ops
from zero2all.model.moe import MoE, init_moe_, moe_aux_loss


class KVCache:
    """Preallocated keys and values for incremental decoding: per layer (batch, n_kv_heads, max_len, head_dim)."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int | None = None, device=None,
                 dtype=torch.float32):
        self.max_len = max_len or cfg.max_seq_len
        shape = (batch_size, cfg.n_kv_heads, self.max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (batch, n_kv_heads, T, head_dim) at [start_pos, start_pos + T); return all keys so far."""
        end = start_pos + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache: position {end} exceeds its length {self.max_len}")
        self.k[layer][:, :, start_pos:end] = k.to(self.k[layer].dtype)
        self.v[layer][:, :, start_pos:end] = v.to(self.v[layer].dtype)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # used only where no residual is fused in
        return ops.rmsnorm_torch(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_size = cfg.n_heads * cfg.head_dim
        self.kv_size = cfg.n_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_dim, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_dim, bias=cfg.attention_bias)
        self.seq_first = False   # activations (T, B, ...) instead of (B, T, ...): Z2all.set_seq_first

    def forward(self, x, cos, sin, kv_cache: KVCache | None = None, start_pos: int = 0, doc_ids=None,
                attn_mask=None):
        # x: (B, T, hidden)
        return self.o_proj(self.attend(self.qkv_proj(x), cos, sin, kv_cache, start_pos, doc_ids, attn_mask))

    def attend(self, qkv, cos, sin, kv_cache: KVCache | None = None, start_pos: int = 0, doc_ids=None,
               attn_mask=None):
        """The attention core between the two projections: qkv (B, T, q_size + 2 kv_size) -> (B, T, q_size);
        (T, B, ...) -> (T, B, q_size) with ``seq_first``."""
        if self.seq_first:
            return self._attend_seq_first(qkv, cos, sin, kv_cache, doc_ids, attn_mask)
        B, T, _ = qkv.shape
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim)                        # (B, T, H, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)                     # (B, T, Hkv, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q, k = ops.apply_rope(q, k, cos, sin, impl=self.cfg.ops.rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, heads, T, D)
        if kv_cache is not None and hasattr(kv_cache, "attend"):  # a paged cache attends over its block tables
            return kv_cache.attend(self.layer_idx, q, k, v).transpose(1, 2).reshape(B, T, self.q_size)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, start_pos, k, v)         # (B, Hkv, start_pos + T, D)
            k, v = k.to(q.dtype), v.to(q.dtype)
        y = ops.attention(q, k, v, impl=self.cfg.ops.attention, dropout_p=self.cfg.attention_dropout,
                          training=self.training, doc_ids=doc_ids, mask=attn_mask)  # (B, H, T, D)
        return y.transpose(1, 2).reshape(B, T, self.q_size)

    def _attend_seq_first(self, qkv, cos, sin, kv_cache, doc_ids, attn_mask):
        """qkv (T, B, ...) -> (T, B, q_size): RoPE and attention read (B, T, heads, D) views of the (T, B) layout
        (strided, no copy), and the output is permuted back once."""
        if kv_cache is not None or doc_ids is not None or attn_mask is not None:
            raise ValueError("Attention.seq_first: training forwards of whole sequences only (no KV cache, document "
                             "ids or mask)")
        T, B, _ = qkv.shape
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.n_heads, self.head_dim)).transpose(0, 1)       # (B, T, H, D) views
        k = k.unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(0, 1)
        v = v.unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(0, 1)
        q, k = ops.apply_rope(q, k, cos, sin, impl=self.cfg.ops.rope)
        y = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), impl=self.cfg.ops.attention,
                          dropout_p=self.cfg.attention_dropout, training=self.training)  # (B, H, T, D)
        return y.permute(2, 0, 1, 3).reshape(T, B, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate_up_proj = nn.Linear(cfg.hidden_dim, 2 * cfg.intermediate_size, bias=False)  # [gate | up]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(ops.swiglu(self.gate_up_proj(x), impl=self.cfg.ops.swiglu))


class Installed:
    """A function installed on a module from outside (:meth:`Block.set_forward`, :meth:`Z2all.set_parallel_loss`).
    It belongs to the module it was installed on: a deep copy of the module (a frozen reference model) gets none
    and runs the model's own code."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __deepcopy__(self, memo):
        return None


class Block(nn.Module):
    """residual += x; h = attn(norm(residual)); residual += h; out = mlp(norm(residual)). Returns (out, residual).

    With ``ops.fused_linear`` the same math runs through the lean fused projections (``kernels/fused_linear.py``:
    norm + qkv, o, norm + gate|up, SwiGLU + down), which keep far less for backward; parameters are unchanged."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, numerics: Numerics | None = None):
        super().__init__()
        self.cfg = cfg
        self.numerics = numerics if numerics is not None else Numerics.from_ops(cfg.ops)  # the model's, shared
        self.input_layernorm = RMSNorm(cfg.hidden_dim, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_dim, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.moe.is_moe_layer(layer_idx) else MLP(cfg)
        self.installed_forward: Installed | None = None

    def set_forward(self, impl=None) -> None:
        """Replace this block's forward by ``impl(block, x, residual, cos, sin, kv_cache, start_pos, doc_ids,
        attn_mask) -> (out, residual)`` (the same math on another layout: tensor parallelism on local shards
        installs its own); ``None`` restores the model's own. Callers keep calling the block as before."""
        self.installed_forward = None if impl is None else Installed(impl)

    def uses_fused_linear(self, x) -> bool:
        """The lean fused projections (``ops.fused_linear``) apply when selected and the projections are plain
        ``nn.Linear`` (a LoRA-wrapped projection keeps the plain path)."""
        attn, mlp = self.self_attn, self.mlp
        if isinstance(mlp, MoE):
            if self.cfg.ops.linear_precision != "bf16":
                raise ValueError(f"model.ops.linear_precision = {self.cfg.ops.linear_precision!r}: FP8 linears are "
                                 "not implemented for MoE blocks; use 'bf16'")
            return False
        plain = all(isinstance(m, nn.Linear) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
        sharded = ops.is_dtensor(attn.qkv_proj.weight)  # tensor parallel: the modules' sharded path
        if self.cfg.ops.linear_precision != "bf16":  # FP8 GEMMs live in these functions (kernels or reference)
            if not plain or sharded:
                raise ValueError(f"model.ops.linear_precision = {self.cfg.ops.linear_precision!r} needs plain, "
                                 "unsharded nn.Linear projections (not LoRA-wrapped or tensor-parallel ones); "
                                 "use 'bf16'")
            return True
        return ops.use_triton(self.cfg.ops.fused_linear, x) and plain and not sharded

    def forward(self, x, residual, cos, sin, kv_cache=None, start_pos=0, doc_ids=None, attn_mask=None):
        c = self.cfg
        if self.installed_forward is not None:  # e.g. tensor parallel on local shards: the same math
            return self.installed_forward.fn(self, x, residual, cos, sin, kv_cache, start_pos, doc_ids, attn_mask)
        if self.uses_fused_linear(x):
            # the same math; norm + qkv, o, norm + gate|up and SwiGLU + down as lean fused functions
            attn, mlp, impl, prec = self.self_attn, self.mlp, c.ops.fused_linear, c.ops.linear_precision
            nx = self.numerics
            qkv, residual = ops.norm_linear(x, residual, self.input_layernorm.weight, c.rms_norm_eps,
                                            c.residual_in_fp32, attn.qkv_proj.weight, attn.qkv_proj.bias, impl,
                                            prec, "qkv", nx)
            y = attn.attend(qkv, cos, sin, kv_cache, start_pos, doc_ids, attn_mask)
            h = ops.lean_linear(y, attn.o_proj.weight, attn.o_proj.bias, impl, prec, "o", nx)
            h = F.dropout(h, c.dropout1, self.training) if c.dropout1 else h
            gate_up, residual = ops.norm_linear(h, residual, self.post_attention_layernorm.weight, c.rms_norm_eps,
                                                c.residual_in_fp32, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                                                impl, prec, "gate_up", nx)
            h = ops.swiglu_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, impl, prec, "down", nx)
            h = F.dropout(h, c.dropout2, self.training) if c.dropout2 else h
            return h, residual
        h, residual = ops.add_rmsnorm(x, residual, self.input_layernorm.weight, c.rms_norm_eps,
                                      c.residual_in_fp32, impl=c.ops.rmsnorm)
        h = self.self_attn(h, cos, sin, kv_cache, start_pos, doc_ids, attn_mask)
        h = F.dropout(h, c.dropout1, self.training) if c.dropout1 else h
        h, residual = ops.add_rmsnorm(h, residual, self.post_attention_layernorm.weight, c.rms_norm_eps,
                                      c.residual_in_fp32, impl=c.ops.rmsnorm)
        h = self.mlp(h)
        h = F.dropout(h, c.dropout2, self.training) if c.dropout2 else h
        return h, residual


class Z2all(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        # this model's FP8 options, weight casts, amax histories and step-fusion marks (kernels/numerics.py)
        self.numerics = Numerics.from_ops(cfg.ops)
        V = cfg.padded_vocab_size
        self.embed_tokens = nn.Embedding(V, cfg.hidden_dim)
        self.layers = nn.ModuleList(Block(cfg, i, self.numerics) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_dim, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_dim, V, bias=False)
        self.parallel_loss: Installed | None = None
        self.tie_weights()
        if self.embed_tokens.weight.device.type != "meta":
            self.reset_parameters()

    def set_parallel_loss(self, fn=None) -> None:
        """Install ``fn(model, h, targets) -> loss or None``: the LM head + cross-entropy of a sharded LM head
        (tensor parallelism's vocab-parallel loss); None (or ``fn`` returning None) leaves the head to the logits
        path. ``None`` uninstalls."""
        self.parallel_loss = None if fn is None else Installed(fn)

    def set_seq_first(self, seq_first: bool = True) -> None:
        """Keep the activations (seq, batch, hidden) instead of (batch, seq, hidden) through the blocks: ``embed``
        then takes tokens (T, B), ``head_loss`` targets (T, B), and attention reads (batch, seq) views of its
        inputs. The GEMMs see the same (T * B, hidden) rows; what differs is how attention's inputs and outputs
        are strided (the layout rows of ``z2all bench train`` time the two). Training forwards of dense models
        only: a MoE block's sequence-wise loss groups tokens by batch row."""
        if seq_first and self.cfg.moe.enabled:
            raise ValueError("Z2all.set_seq_first: dense models only (a MoE block groups its sequence-wise loss by "
                             "batch row)")
        for layer in self.layers:
            layer.self_attn.seq_first = seq_first

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings`` the LM head uses the embedding matrix itself (one parameter, two uses).
        The one place that ties: call it again after anything that replaces parameters (``to_empty``, loading
        with ``assign=True``, a state dict that carries only the embedding)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # -- initialisation ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None):
        std = self.cfg.initializer_range
        out_std = std / math.sqrt(2 * self.cfg.n_layers) if self.cfg.scaled_init else std
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                s = out_std if name.endswith(("o_proj", "down_proj")) else std
                module.weight.normal_(0.0, s, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std, generator=generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, MoE):
                init_moe_(module, std, out_std, generator)
        self.tie_weights()  # the shared matrix keeps the embedding's init

    # -- rotary tables ----------------------------------------------------------------------------------------
    def rope_tables(self, start_pos: int, T: int, device, position_ids: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (T, head_dim // 2) for positions start_pos .. start_pos + T - 1, or of shape
        (B, T, head_dim // 2) for explicit per-row ``position_ids`` (B, T) (packed samples restarting at 0,
        left-padded generation batches)."""
        c = self.cfg
        scaling = c.rope_scaling
        dynamic = bool(scaling) and scaling.get("type", scaling.get("rope_type")) == "dynamic"
        if dynamic:
            scaling = dict(scaling)
            scaling.setdefault("original_max_position_embeddings", c.max_seq_len)
        if position_ids is None:
            positions = torch.arange(start_pos, start_pos + T, device=device)
            return ops.rope_frequencies(c.head_dim, c.rope_theta, positions, scaling, seq_len=start_pos + T)
        # dynamic NTK needs the sequence length on the host (a sync); other kinds stay on the device
        seq_len = int(position_ids.max()) + 1 if dynamic else None
        cos, sin = ops.rope_frequencies(c.head_dim, c.rope_theta, position_ids.reshape(-1), scaling, seq_len=seq_len)
        return cos.view(*position_ids.shape, -1), sin.view(*position_ids.shape, -1)

    # -- forward ----------------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                start_pos: int = 0, doc_ids: torch.Tensor | None = None, z_loss: float = 0.0,
                position_ids: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                logits_to_keep: int = 0):
        """tokens (B, T) int64 -> (logits (B, T, padded_vocab), loss or None).

        ``position_ids`` (B, T): RoPE positions per row (default start_pos + arange(T)); packed SFT samples restart
        at 0, left-padded generation rows start after their padding. ``attn_mask``: boolean, broadcastable to
        (B, 1, T, Tk), True = may attend; it replaces the causal / document mask (the caller includes causality),
        e.g. a static KV cache whose unwritten or padded slots must be hidden.

        With ``targets`` (B, T) the mean cross-entropy over targets != -100 is returned as well. When the fused
        linear+cross-entropy op is selected (``ops.cross_entropy`` = fused, or auto on a GPU) the logits are never
        materialised and ``None`` is returned in their place.

        ``logits_to_keep`` n > 0 (without ``targets``): logits of the last n positions only, (B, n, padded_vocab)
        (a prefill needs just the last one; the LM head is then a product of n rows, not T).
        """
        B, T = tokens.shape
        cos, sin = self.rope_tables(start_pos, T, tokens.device, position_ids)
        x, residual = self.blocks(self.embed(tokens), None, cos, sin, kv_cache, start_pos, doc_ids, attn_mask)
        h = self.final_norm(x, residual)
        if targets is None:
            return self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h), None
        return self.head_loss(h, targets, z_loss)

    # -- the pieces of the forward (what pipeline stages, hidden-state readers and value heads call) -----------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> the first block's input (B, T, hidden)."""
        return self.embed_tokens(tokens)

    def blocks(self, x, residual, cos, sin, kv_cache=None, start_pos=0, doc_ids=None, attn_mask=None,
               layers=None):
        """``(x, residual)`` through ``layers`` (default every block, in order; residual None before the first
        block of the model) -> ``(x, residual)``. Each block runs its own forward or the one installed on it."""
        for layer in self.layers if layers is None else layers:
            x, residual = layer(x, residual, cos, sin, kv_cache, start_pos, doc_ids, attn_mask)
        return x, residual

    def final_norm(self, x, residual) -> torch.Tensor:
        """The last block's ``(x, residual)`` -> h, the LM head's input (residual += x; RMSNorm)."""
        c = self.cfg
        h, _ = ops.add_rmsnorm(x, residual, self.norm.weight, c.rms_norm_eps, c.residual_in_fp32, impl=c.ops.rmsnorm)
        return h

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0, reduction: str = "mean",
                  counted: bool = False):
        """(logits or None, the training loss): the LM head's cross-entropy (+ z-loss) over targets != -100 plus
        every MoE term of the last forward (load-balancing, sequence-wise and router z-losses with their
        ``model.moe`` weights). Logits are None where the fused linear + cross-entropy never forms them.

        ``reduction="mean"``: the mean over the valid targets plus the MoE terms. ``"sum"``: n x that, n the
        number of valid targets: the token losses summed, the MoE terms weighted by n. A pipeline's last stage
        returns this per microbatch: the sums of a micro-batch's microbatches divided by its valid-token count
        give its mean cross-entropy, each microbatch's MoE terms weighted by its share of the valid tokens. No
        valid target: an exact 0 that joins the autograd graph. ``counted``: see :meth:`token_loss`.

        A pipeline stage runs this on its own modules (``self`` is then any module with ``cfg``, ``lm_head``,
        ``numerics``, ``parallel_loss`` and the stage's MoE blocks), hence the explicit class in the calls."""
        logits, loss = Z2all.token_loss(self, h, targets, z_loss, reduction, counted)
        aux = moe_aux_loss(self) if self.cfg.moe.enabled else None
        if aux is not None:
            loss = loss + (aux * (targets != -100).sum() if reduction == "sum" else aux)
        return logits, loss

    def token_loss(self, h: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0, reduction: str = "mean",
                   counted: bool = False):
        """(logits or None, the LM head's cross-entropy (+ z-loss) over targets != -100): their mean or, with
        ``reduction="sum"``, their sum; no MoE term (:meth:`head_loss` adds them). The fused kernel gives the
        mean, so its sum is mean x count: ``counted`` (the caller knows that ``targets`` hold a valid token) keeps
        the count on the device, otherwise it is read on the host. A vocab-sharded head (tensor parallelism) sums
        its sharded logits' cross-entropy under loss parallel (the caller's context)."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"token_loss / head_loss: reduction must be 'mean' or 'sum', not {reduction!r}")
        sharded = ops.is_dtensor(self.lm_head.weight)
        if ops.uses_fused_cross_entropy(self.cfg.ops.cross_entropy, h) and not (sharded and reduction == "sum"):
            if sharded:  # tensor parallel: vocab-parallel, or None (loss parallel)
                loss = self.parallel_loss.fn(self, h, targets) if self.parallel_loss is not None else None
            elif reduction == "sum":
                return None, fused_token_sum(h, self.lm_head.weight, targets, z_loss, counted, self.numerics)
            else:
                loss = ops.linear_cross_entropy(h, self.lm_head.weight, targets, z_loss=z_loss, impl="fused",
                                                numerics=self.numerics)
            if loss is not None:
                return None, loss
        logits = self.lm_head(h)
        if z_loss:
            return logits, ops.linear_cross_entropy_torch(h, self.lm_head.weight, targets, z_loss=z_loss,
                                                          reduction=reduction)
        return logits, F.cross_entropy(ops.upcast(logits).view(-1, logits.size(-1)), targets.reshape(-1),
                                       ignore_index=-100, reduction=reduction)

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (shared tensors once). ``non_embedding`` leaves out the input embedding only: the LM
        head does matmul work and counts (as in the MFU formula of docs/accounting.md)."""
        seen, n = set(), 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        if non_embedding and not self.cfg.tie_word_embeddings:
            n -= self.embed_tokens.weight.numel()
        return n

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, dtype=None) -> KVCache:
        w = self.embed_tokens.weight
        return KVCache(self.cfg, batch_size, max_len, device=w.device, dtype=dtype or w.dtype)


def fused_token_sum(h, weight, targets, z_loss: float, counted: bool, numerics) -> torch.Tensor:
    """The fused linear + cross-entropy's mean x the valid-target count. The kernel divides by the count, so
    without ``counted`` (the caller's word that a target is valid) the count is read on the host and none valid
    gives an exact 0 joined to ``h``'s graph instead of 0 / 0."""
    count = (targets != -100).sum()
    if not counted:
        count = int(count)
        if count == 0:
            return ops.upcast(h).sum() * 0.0
    mean = ops.linear_cross_entropy(h, weight, targets, z_loss=z_loss, impl="fused", numerics=numerics)
    return ops.upcast(mean) * count


def build_model(cfg: ModelConfig, device="cpu", dtype=None, seed: int | None = None) -> Z2all:
    """Build a model on ``device`` (``"meta"`` allocates nothing: parameter counts and sharded init)."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = Z2all(cfg)
    if dtype is not None:
        model = model.to(dtype)
    return model
