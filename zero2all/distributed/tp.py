"""Tensor parallel (Megatron 1-D) and sequence parallel with DTensor ``parallelize_module``.

Per block, on the ``tp`` ranks of the mesh (t of them)::

    attention:  qkv_proj  ColwiseParallel   each rank: its n_heads/t query heads and n_kv_heads/t KV heads
                o_proj    RowwiseParallel   partial sums over heads -> all-reduce (or reduce-scatter with SP)
    MLP:        gate_up   ColwiseParallel   each rank: intermediate/t gate rows and the matching up rows
                down      RowwiseParallel   partial sums -> all-reduce (or reduce-scatter with SP)
    embedding   RowwiseParallel (vocab rows split; lookups outside a rank's rows give 0, summed over ranks)
    lm_head     ColwiseParallel (vocab split), logits stay sharded: the loss runs under ``loss_parallel``

The f / g conjugate operators of Megatron are the layouts' transitions: the Colwise input is Replicate (forward:
identity; backward: all-reduce of the input gradient = f) and the Rowwise output is Partial -> Replicate
(forward: all-reduce = g; backward: identity). Per layer: 2 all-reduces of b*s*h elements forward, 2 backward.

Sequence parallel (Korthikanti et al. 2022): between the TP regions the residual stream and the norms are split
along the sequence (Shard(1)); the Colwise input all-gathers the sequence and the Rowwise output reduce-scatters
it. Same communication volume (all-reduce = reduce-scatter + all-gather), activations of norms / residual / dropout
divided by t. The norm weights then see only this rank's tokens: they are Replicate DTensors whose gradient is a
Partial sum (``ops.local_weight``), reduced by DTensor (or by FSDP2, which redistributes non-dp dimensions).

Fused projections: ``qkv_proj`` holds [q | k | v] and ``gate_up_proj`` [gate | up]. A plain Shard(0) would give
rank 0 all of q and rank 1 k and v. Before sharding, the rows are reordered *rank-major*,
[q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (q_r = rank r's query heads, k_r / v_r its KV heads: whole GQA groups), so that
each rank's Shard(0) block is one fused GEMM for its own heads / columns. :class:`FusedRows` knows the permutation;
checkpoints and the HF export convert back to the canonical layout (``to_canonical``), so the checkpoint format is
the plain model's whatever the mesh.

Our Triton kernels (RMSNorm, RoPE, SwiGLU, attention through SDPA) run on plain local tensors: every TP style here
returns local outputs (``use_local_output``). The lean fused projections (``ops.fused_linear``) take whole weight
matrices and are not used under TP (the block sees DTensor weights and takes the module path); the fused
linear+cross-entropy is replaced by loss parallel: its per-token logsumexp needs the max and the sum over the
whole vocabulary, i.e. a reduction across ranks inside the kernel, which DTensor's loss parallel already does with
torch's collectives. :func:`describe_tp_ops` says which implementation each op uses (logged once).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn as nn

from zero2all.model import ops


@dataclass(frozen=True)
class FusedRows:
    """A parameter whose rows are ``pieces`` concatenated (canonical layout), each split evenly over ``tp`` ranks.
    Rank-major layout: for each rank r, the r-th slice of every piece."""

    pieces: tuple[int, ...]
    tp: int

    @cached_property
    def perm(self) -> torch.Tensor:
        """rank_major = canonical[perm]."""
        offsets = [sum(self.pieces[:i]) for i in range(len(self.pieces))]
        idx = []
        for r in range(self.tp):
            for off, n in zip(offsets, self.pieces):
                step = n // self.tp
                idx.extend(range(off + r * step, off + (r + 1) * step))
        return torch.tensor(idx, dtype=torch.long)

    @cached_property
    def inverse(self) -> torch.Tensor:
        return torch.argsort(self.perm)

    def to_rank_major(self, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, self.perm.to(t.device))

    def to_canonical(self, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, self.inverse.to(t.device))


def fused_layouts(model: nn.Module, tp: int) -> dict[str, FusedRows]:
    """The fused parameters of ``model`` (plain names, as in the checkpoint) and their row pieces."""
    cfg = model.cfg
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {}
    for i, block in enumerate(model.layers):
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = FusedRows((q, kv, kv), tp)
        if block.self_attn.qkv_proj.bias is not None:
            out[f"layers.{i}.self_attn.qkv_proj.bias"] = FusedRows((q, kv, kv), tp)
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = FusedRows((cfg.intermediate_size,) * 2, tp)
    return out


def describe_tp_ops(cfg, device: torch.device, sequence_parallel: bool) -> str:
    """One line: the implementation of each op under tensor parallelism on ``device``."""
    probe = torch.empty(0, device=device)

    def pick(impl: str) -> str:
        return "triton" if ops.use_triton(impl, probe) else "torch"

    o = cfg.ops
    return (f"tensor parallel ops: projections = torch linear on DTensor shards (Colwise/Rowwise); "
            f"rmsnorm = {pick(o.rmsnorm)} on local {'sequence shards' if sequence_parallel else 'tensors'}; "
            f"rope = {pick(o.rope)}, swiglu = {pick(o.swiglu)}, attention = {o.attention} on local heads; "
            f"fused_linear projections: off (whole-matrix kernels); loss: torch cross-entropy under loss_parallel "
            f"on vocab-sharded logits (fused linear+CE off)")


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool) -> dict[str, FusedRows]:
    """Shard ``model`` (the plain Z2all, weights already initialised identically on every rank) over ``tp_mesh``
    in place. Returns the fused parameters' layouts (for checkpoints and the HF export)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    t = tp_mesh.size()
    layouts = fused_layouts(model, t)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in layouts:
                param.copy_(layouts[name].to_rank_major(param))
    between = Shard(1) if sequence_parallel else Replicate()   # layout of the residual stream between regions
    block_plan = {
        "self_attn.qkv_proj": ColwiseParallel(input_layouts=between),
        "self_attn.o_proj": RowwiseParallel(output_layouts=between),
        "mlp.gate_up_proj": ColwiseParallel(input_layouts=between),
        "mlp.down_proj": RowwiseParallel(output_layouts=between),
    }
    for block in model.layers:
        attn = block.self_attn
        attn.n_heads, attn.n_kv_heads = attn.n_heads // t, attn.n_kv_heads // t
        attn.q_size, attn.kv_size = attn.q_size // t, attn.kv_size // t
        parallelize_module(block, tp_mesh, block_plan)
    parallelize_module(model, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    })
    if sequence_parallel:
        norms = [m for m in model.modules() if type(m).__name__ == "RMSNorm"]
        for norm in norms:
            norm.weight = nn.Parameter(distribute_tensor(norm.weight.data, tp_mesh, [Replicate()]))
    model.tie_weights()  # the LM head and the embedding are both Shard(0) over the vocabulary
    return layouts


def loss_parallel_context():
    """Cross-entropy on vocab-sharded logits (DTensor's loss parallel), for forward and backward."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def to_canonical_dtensor(value, rows: FusedRows):
    """A rank-major fused DTensor (a parameter or its optimizer state) as a DTensor of the canonical layout, for
    the checkpoint: gathered one tensor at a time, reordered, and sharded again by rows over the first mesh
    dimension (replicated over the others; DCP writes each piece once)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = value.device_mesh
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    canonical = rows.to_canonical(value.full_tensor())
    local = DTensor.from_local(canonical, mesh, [Replicate()] * mesh.ndim, run_check=False) \
        .redistribute(mesh, placements).to_local().clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=value.shape, stride=value.stride())


def to_rank_major_dtensor(canonical, rows: FusedRows, like):
    """The inverse of :func:`to_canonical_dtensor`, with ``like``'s mesh and placements (a loaded checkpoint
    value back into the parameter's own layout)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    full = rows.to_rank_major(canonical.full_tensor())
    return DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False) \
        .redistribute(mesh, like.placements)
