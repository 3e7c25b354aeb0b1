"""The decode step of a Z2all model as four fused kernels per layer (``zero2all/kernels/decode.py``).

``FusedDecodeStep(model, cache, batch, max_len)(tokens, slot, pad_len)`` computes the same next-token logits as
``model(tokens, kv_cache=cache, position_ids=slot - pad_len, attn_mask=visible)`` (the generic step in
``generate.DecodeSession``) for one token per row, and writes that token's keys and values into the static cache::

    x = embed(tokens)                           (batch 1: read inside the first product instead)
    per layer:  qkv  = norm_gemv(x, r)          (r <- r + x, normed by input_layernorm, @ qkv_proj^T; r = none
                                                 before the first layer)
                attn = decode_attention(qkv)    (q, k rotated; k, v written at the cache slot; softmax over the
                                                 row's visible slots)
                o    = gemv(attn)               (@ o_proj^T)
                gu   = norm_gemv(o, r)          (r <- r + o, normed by post_attention_layernorm, @ gate_up^T)
                x    = swiglu_gemv(gu)          (silu(gate) * up @ down_proj^T)
    logits = norm_gemv(x, r)                    (final norm, @ lm_head^T)

All buffers are allocated once, so the step can be captured as one CUDA graph that serves every cache slot (the
kernels read the slot and the rows' padding from device tensors). The residual stream alternates between two
buffers so that no kernel overwrites the residual it is reading.

Used by ``Generator`` on CUDA when ``supported(model, batch)`` is None; otherwise the generic step runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_ROWS = 16


def supported(model, batch_size: int) -> str | None:
    """None when the fused step can run this model at this batch size, else the reason it cannot."""
    from zero2all.model.ops import triton_available

    cfg = model.cfg
    w = model.embed_tokens.weight
    if w.device.type != "cuda" and not _interpreting():
        return "not on CUDA"
    if not triton_available():
        return "Triton is not importable"
    if batch_size > MAX_ROWS:
        return f"batch {batch_size} > {MAX_ROWS}"
    d = cfg.head_dim
    if d < 32 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 32"
    scaling = cfg.rope_scaling
    if scaling and scaling.get("type", scaling.get("rope_type")) == "dynamic":
        return "dynamic NTK RoPE"
    if cfg.moe.enabled:
        return "MoE layers (the fused step has no router or experts)"
    for layer in model.layers:
        mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if any(type(m) is not nn.Linear for m in mods):
            return "a projection is not a plain nn.Linear (a LoRA adapter: merge it first)"
    if type(model.lm_head) is not nn.Linear:
        return "the LM head is not a plain nn.Linear"
    return None


def graph_replay_ms(graph: torch.cuda.CUDAGraph, replays: int, rounds: int = 3) -> float:
    """Milliseconds per replay of a captured graph replayed back to back: the median of ``rounds`` rounds of
    ``replays`` replays, after one warm-up replay."""
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return sorted(times)[rounds // 2]


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


class FusedDecodeStep:
    def __init__(self, model, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], batch_size: int,
                 max_len: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        from zero2all.kernels import decode as K

        reason = supported(model, batch_size)
        if reason:
            raise ValueError(f"fused decode step: {reason}")
        self.K = K
        cfg = model.cfg
        self.cfg = cfg
        w = model.embed_tokens.weight
        device, dtype = w.device, w.dtype
        self.embed = w
        self.layers = []
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((layer.input_layernorm.weight, a.qkv_proj.weight.contiguous(), a.qkv_proj.bias,
                                a.o_proj.weight.contiguous(), a.o_proj.bias, layer.post_attention_layernorm.weight,
                                m.gate_up_proj.weight.contiguous(), m.down_proj.weight.contiguous()))
        self.final_norm = model.norm.weight
        self.lm_head = model.lm_head.weight.contiguous()
        self.eps = cfg.rms_norm_eps
        self.k_cache, self.v_cache = k_cache, v_cache
        # the RoPE tables of max_len positions; ``rope``: another step's, shared (a session's one-row steps)
        self.cos, self.sin = rope or tuple(t.contiguous() for t in model.rope_tables(0, max_len, device))
        B, H, D, Hkv = batch_size, cfg.n_heads, cfg.head_dim, cfg.n_kv_heads
        res_dtype = torch.float32 if cfg.residual_in_fp32 else dtype
        empty = lambda *shape, dt=dtype: torch.empty(shape, device=device, dtype=dt)  # noqa: E731
        self.residual = (empty(B, cfg.hidden_dim, dt=res_dtype), empty(B, cfg.hidden_dim, dt=res_dtype))
        self.qkv = empty(B, (H + 2 * Hkv) * D)
        self.attn = empty(B, H * D)
        self.o = empty(B, cfg.hidden_dim)
        self.gate_up = empty(B, 2 * cfg.intermediate_size)
        self.down = empty(B, cfg.hidden_dim)
        self.logits = empty(B, model.lm_head.weight.size(0), dt=torch.float32)  # sampling reads float32 anyway
        self.scratch = K.AttentionScratch(B, H, Hkv, D, max_len, device)
        self.shape = (B, H, D)

    def product_shapes(self) -> list[tuple[torch.Tensor, int]]:
        """(weight, prologue) of each distinct one-row product of the step, largest first."""
        K, (_, w_qkv, _, w_o, _, _, w_gu, w_down) = self.K, self.layers[0]
        shapes = [(self.lm_head, K.PROLOGUE_NORM), (w_gu, K.PROLOGUE_NORM), (w_down, K.PROLOGUE_SWIGLU),
                  (w_qkv, K.PROLOGUE_NORM), (w_o, K.PROLOGUE_NONE)]
        return sorted(shapes, key=lambda s: -s[0].numel())

    @torch.inference_mode()
    def tune(self, tokens: torch.Tensor, slot: torch.Tensor, pad_len: torch.Tensor, replays: int = 8) -> dict:
        """Choose the one-row kernel's tiles for each product shape by timing the whole step as a CUDA graph.

        The products overlap their neighbours (programmatic launch), so a product timed alone ranks tiles
        differently from the step (on an H200 the tiles picked alone were up to 13 % slower in the step). One
        pass of coordinate descent, largest matrix first, over ``decode.row_tile_candidates()``; the choice is
        kept per (device, shape) in ``decode.ROW_TILES`` for every later step. Writes the step's key and value at
        ``slot`` (callers pass a slot that the prefill overwrites). Batch 1 on CUDA only (more rows use the
        tensor-core kernel); returns {shape: tiles}.
        """
        K = self.K
        if tokens.size(0) != 1 or not self.embed.is_cuda or not K.tuning_enabled():  # Z2ALL_DECODE_AUTOTUNE=0
            return {}
        keys = [K.row_tiles_key(w, p) for w, p in self.product_shapes()]
        if all(k in K.ROW_TILES for k in keys):
            return {k: K.ROW_TILES[k] for k in keys}

        def step_time(key, tiles) -> float:
            K.ROW_TILES[key] = tiles
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self(tokens, slot, pad_len)  # compiles a new tile's kernel outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self(tokens, slot, pad_len)
            return graph_replay_ms(graph, replays)

        for key in keys:
            K.ROW_TILES.setdefault(key, K.default_row_tiles())
        for key in keys:
            timed, kept = {}, K.ROW_TILES[key]
            try:
                for tiles in K.row_tile_candidates():
                    timed[tiles] = step_time(key, tiles)
            finally:  # a failure leaves the tiles as they were, not the candidate that failed
                K.ROW_TILES[key] = min(timed, key=timed.get) if timed else kept
        return {k: K.ROW_TILES[k] for k in keys}

    def __call__(self, tokens: torch.Tensor, slot: torch.Tensor, pad_len: torch.Tensor) -> torch.Tensor:
        """tokens (B, 1) at cache slot ``slot`` (1-element long tensor) -> logits (B, V), float32."""
        K = self.K
        if tokens.size(0) == 1:  # the first product reads the embedding row itself
            x, token = self.embed, tokens.view(1)
        else:
            x, token = F.embedding(tokens[:, 0], self.embed), None                      # (B, hidden)
        residual = None
        for i, (ln1, w_qkv, b_qkv, w_o, b_o, ln2, w_gu, w_down) in enumerate(self.layers):
            r1 = self.residual[0]
            K.fused_gemv(x, w_qkv, self.qkv, bias=b_qkv, prologue=K.PROLOGUE_NORM, residual=residual,
                         norm_weight=ln1, residual_out=r1, eps=self.eps, token=token if i == 0 else None)
            K.decode_attention(self.qkv, self.cos, self.sin, self.k_cache[i], self.v_cache[i], pad_len, slot,
                               self.attn.view(self.shape), self.scratch)
            K.fused_gemv(self.attn, w_o, self.o, bias=b_o)
            r2 = self.residual[1]
            K.fused_gemv(self.o, w_gu, self.gate_up, prologue=K.PROLOGUE_NORM, residual=r1, norm_weight=ln2,
                         residual_out=r2, eps=self.eps)
            K.fused_gemv(self.gate_up, w_down, self.down, prologue=K.PROLOGUE_SWIGLU)
            x, residual = self.down, r2
        K.fused_gemv(x, self.lm_head, self.logits, prologue=K.PROLOGUE_NORM, residual=residual,
                     norm_weight=self.final_norm, residual_out=self.residual[0], eps=self.eps)
        return self.logits
