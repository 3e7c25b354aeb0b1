"""Tensor parallel (Megatron 1-D) and sequence parallel on the ``tp`` ranks of the device mesh (t of them).

The parameters are DTensor shards whatever the implementation (checkpoints, the optimizer and FSDP2 see the
same layout)::

    attention:  qkv_proj  Shard(0)   each rank: its n_heads/t query heads and n_kv_heads/t KV heads
                o_proj    Shard(1)   partial sums over heads -> all-reduce (or reduce-scatter with SP)
    MLP:        gate_up   Shard(0)   each rank: intermediate/t gate rows and the matching up rows
                down      Shard(1)   partial sums -> all-reduce (or reduce-scatter with SP)
    embedding   Shard(0)  (vocab rows split; lookups outside a rank's rows give 0, summed over ranks)
    lm_head     Shard(0)  (vocab split), logits stay sharded: the loss runs under ``loss_parallel``

The f / g conjugate operators of Megatron are layout transitions: a region's input is Replicate (forward:
identity; backward: all-reduce of the input gradient = f) and its output Partial -> Replicate (forward:
all-reduce = g; backward: identity). Per layer: 2 all-reduces of b*s*h elements forward, 2 backward.

Sequence parallel (Korthikanti et al. 2022): between the TP regions the residual stream and the norms are split
over the tokens; a region's input all-gathers the tokens and its output reduce-scatters them. Same communication
volume (all-reduce = reduce-scatter + all-gather), activations of norms / residual divided by t. The norm
weights then see only this rank's tokens: they are Replicate DTensors whose gradient is a Partial sum
(``ops.local_weight``), reduced by DTensor (or by FSDP2, which redistributes non-dp dimensions).

Two implementations (``parallel.tp_impl``):

- ``local`` (default): the block runs on plain local tensors with our kernels (RMSNorm, lean projections
  ``ops.lean_linear`` / ``ops.swiglu_linear``, RoPE, SDPA) on ``weight.to_local()``; the only DTensor work is
  ONE redistribution at each region edge (:class:`TPRegions`: ``enter`` before qkv and gate|up, ``exit`` after
  o and down). Under SP the residual stream is the local block of the *flattened* tokens, (b*s/t, h): rank r
  holds tokens [r*b*s/t, (r+1)*b*s/t) of the row-major (b, s) order, so the all-gather and the reduce-scatter
  are contiguous along dim 0 (no chunk / cat copies), and any token split is valid since norms and the
  residual add are per token; attention and RoPE run after the gather on whole sequences, (b, s, h) again. The
  embedding reduce-scatters its vocab-partial output into that layout, the LM head all-gathers it and returns
  logits (1, b*s, V) (flattened tokens, sharded over the vocabulary).
  With ``parallel.tp_graphs`` (CUDA) each block's forward and backward are captured once and replayed as CUDA
  graphs, the region edges' NCCL collectives included (``graphs.py``): the host issues a few calls per block
  instead of every kernel.
- ``dtensor``: DTensor ``parallelize_module`` with Colwise/RowwiseParallel on every linear and SP as Shard(1)
  of (b, s, h): per-op DTensor dispatch (CPU time) and gathers along dim 1 (copies); kept for comparison.

Fused projections: ``qkv_proj`` holds [q | k | v] and ``gate_up_proj`` [gate | up]. A plain Shard(0) would give
rank 0 all of q and rank 1 k and v. Before sharding, the rows are reordered *rank-major*,
[q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (q_r = rank r's query heads, k_r / v_r its KV heads: whole GQA groups), so that
each rank's Shard(0) block is one fused GEMM for its own heads / columns (and its gate|up block is
[gate_r | up_r], what the SwiGLU kernels expect). :class:`FusedRows` knows the permutation; checkpoints and the
HF export convert back to the canonical layout (``to_canonical``), so the checkpoint format is the plain model's
whatever the mesh.

The fused norm + qkv projection is not used under TP (under SP a gather sits between the norm and the GEMM);
the fused linear+cross-entropy is replaced by loss parallel: its per-token logsumexp needs the max and the sum
over the whole vocabulary, i.e. a reduction across ranks, which DTensor's loss parallel does with torch's
collectives. :func:`describe_tp_ops` says which implementation each op uses (logged once).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

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

    # the layout's side of a checkpoint (``checkpoint/state.py`` calls these on any layout object it is given, so
    # the checkpoint code knows nothing of tensor parallelism)
    def save_value(self, value):
        """A sharded value (parameter or optimizer state) as the checkpoint stores it: the canonical layout."""
        return to_canonical_dtensor(value, self) if hasattr(value, "device_mesh") else value

    def load_value(self, value, like):
        """A loaded checkpoint value back into this parameter's layout (``like``: the current value)."""
        return to_rank_major_dtensor(value, self, like) if hasattr(value, "device_mesh") else value


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


def describe_tp_ops(cfg, device: torch.device, sequence_parallel: bool, impl: str = "local", chunks: int = 1,
                    graphs: bool = False) -> str:
    """One line: the implementation of each op under tensor parallelism on ``device``."""
    probe = torch.empty(0, device=device)

    def pick(kind: str) -> str:
        return "triton" if ops.use_triton(kind, probe) else "torch"

    o = cfg.ops
    tokens = "sequence shards" if sequence_parallel else "tensors"
    loss = "torch cross-entropy under loss_parallel on vocab-sharded logits"
    if impl == "local":
        layout = "flattened-token shards, contiguous all-gather / reduce-scatter" if sequence_parallel else \
            "replicated, all-reduce"
        groups = f", {chunks} groups of sequences per block" if sequence_parallel and chunks > 1 else ""
        projections = (f"projections = {pick(o.fused_linear)} lean linear / swiglu+linear on local weight shards "
                       f"(one redistribution per region edge: {layout}{groups})")
        if ops.uses_fused_cross_entropy(o.cross_entropy, probe):
            loss = "fused vocab-parallel linear+cross-entropy on the local vocabulary rows (tp_loss.py)"
    else:
        projections = "projections = torch linear on DTensor shards (Colwise/Rowwise per linear)"
    blocks = "; blocks replayed as CUDA graphs (forward and backward, graphs.py)" if graphs else ""
    return (f"tensor parallel ops ({impl}): {projections}; rmsnorm = {pick(o.rmsnorm)} on local {tokens}; "
            f"rope = {pick(o.rope)}, swiglu = {pick(o.swiglu)}, attention = {o.attention} on local heads; "
            f"fused norm+qkv: off; loss: {loss}{blocks}")


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool, impl: str = "local",
             chunks: int = 1, graphs: bool = False) -> dict[str, FusedRows]:
    """Shard ``model`` (the plain Z2all, weights already initialised identically on every rank) over ``tp_mesh``
    in place, with the ``impl`` implementation (``local`` or ``dtensor``, see the module docstring; ``chunks``:
    groups of sequences per block under ``local`` + SP, see :func:`block_forward`; ``graphs``: the blocks as
    CUDA graphs, ``graphs.py``). Returns the fused parameters' layouts (for checkpoints and the HF export)."""
    t = tp_mesh.size()
    layouts = fused_layouts(model, t)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in layouts:
                param.copy_(layouts[name].to_rank_major(param))
    for block in model.layers:
        attn = block.self_attn
        attn.n_heads, attn.n_kv_heads = attn.n_heads // t, attn.n_kv_heads // t
        attn.q_size, attn.kv_size = attn.q_size // t, attn.kv_size // t
    if impl == "local":
        from zero2all.distributed.graphs import BlockGraphs

        _apply_local(model, TPRegions(tp_mesh, sequence_parallel, chunks, BlockGraphs() if graphs else None))
    else:
        _apply_dtensor(model, tp_mesh, sequence_parallel)
    model.tie_weights()  # the LM head and the embedding are both Shard(0) over the vocabulary
    return layouts


def _apply_dtensor(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    between = Shard(1) if sequence_parallel else Replicate()   # layout of the residual stream between regions
    block_plan = {
        "self_attn.qkv_proj": ColwiseParallel(input_layouts=between),
        "self_attn.o_proj": RowwiseParallel(output_layouts=between),
        "mlp.gate_up_proj": ColwiseParallel(input_layouts=between),
        "mlp.down_proj": RowwiseParallel(output_layouts=between),
    }
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan)
    parallelize_module(model, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    })
    if sequence_parallel:
        for norm in (m for m in model.modules() if type(m).__name__ == "RMSNorm"):
            norm.weight = nn.Parameter(distribute_tensor(norm.weight.data, tp_mesh, [Replicate()]))


# ------------------------------------------------------------------------------------------ tp_impl = "local"

_REGIONS: "weakref.WeakKeyDictionary[nn.Module, TPRegions]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TPRegions:
    """The tensor-parallel region edges of one model, as two layout changes of plain local tensors.

    ``enter`` (before qkv and gate|up): the residual-stream layout -> the whole input on every rank. SP: an
    all-gather of the flattened-token shards (backward: reduce-scatter); otherwise Megatron's f (identity,
    backward all-reduce). ``exit`` (after o and down): partial sums over this rank's heads / columns -> the
    residual-stream layout. SP: a reduce-scatter over the flattened tokens (backward: all-gather); otherwise g
    (all-reduce, backward identity). Each is one DTensor ``redistribute`` (torch's collectives and their
    autograd), so the ops in between run on plain tensors."""

    mesh: object
    sequence_parallel: bool
    chunks: int = 1
    graphs: object = None   # graphs.BlockGraphs with parallel.tp_graphs, else None

    def groups(self, x: torch.Tensor, seq_len: int, per_row: bool) -> int:
        """How many groups of whole sequences the block runs as (``block_forward``): ``chunks`` when SP is on,
        the local tokens are that many groups of whole sequences and nothing comes per batch row (per-row RoPE
        positions, document ids, masks), else 1."""
        k = self.chunks
        if k <= 1 or not self.sequence_parallel or per_row or x.size(0) % (k * seq_len):
            return 1
        return k

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        if not self.sequence_parallel:
            d = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
            return d.to_local(grad_placements=[Partial()])
        d = DTensor.from_local(x.reshape(-1, x.size(-1)), self.mesh, [Shard(0)], run_check=False)
        return d.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    def exit(self, y: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        if not self.sequence_parallel:
            return DTensor.from_local(y, self.mesh, [Partial()], run_check=False) \
                .redistribute(self.mesh, [Replicate()]).to_local()
        flat = y.reshape(-1, y.size(-1))
        t = self.mesh.size()
        if flat.size(0) % t:
            raise ValueError(f"sequence parallel: {flat.size(0)} tokens per forward are not divisible by tp={t}")
        return DTensor.from_local(flat, self.mesh, [Partial()], run_check=False) \
            .redistribute(self.mesh, [Shard(0)]).to_local()

    def replicated(self, param: torch.Tensor) -> torch.Tensor:
        """A Replicate parameter (a norm weight, o's bias) as a local tensor: under SP each rank sees only its
        tokens, so its gradient is a Partial sum; otherwise every rank computes the whole gradient."""
        if not ops.is_dtensor(param):
            return param
        return ops.local_weight(param) if self.sequence_parallel else param.to_local()


def regions_of(block: nn.Module) -> TPRegions | None:
    """The regions of a block sharded by ``tp_impl = local`` (None for the dtensor implementation)."""
    return _REGIONS.get(block)


class BlockWeights(NamedTuple):
    """A sharded block's parameters as the local tensors its math reads (None where the model has none): the
    norm weights and o's bias through :meth:`TPRegions.replicated`, the projections' local shards."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def block_weights(regions: TPRegions, block: nn.Module) -> BlockWeights:
    """The local tensors of ``block``'s parameters (autograd carries their gradients back to the DTensors)."""
    attn, mlp = block.self_attn, block.mlp
    o_bias = attn.o_proj.bias
    return BlockWeights(regions.replicated(block.input_layernorm.weight), attn.qkv_proj.weight.to_local(),
                        _local(attn.qkv_proj.bias), attn.o_proj.weight.to_local(),
                        None if o_bias is None else regions.replicated(o_bias),
                        regions.replicated(block.post_attention_layernorm.weight),
                        mlp.gate_up_proj.weight.to_local(), mlp.down_proj.weight.to_local())


def _installed_block_forward(regions: TPRegions, block: nn.Module, x, residual, cos, sin, kv_cache=None,
                             start_pos=0, doc_ids=None, attn_mask=None):
    """The forward ``apply_tp`` installs on each block (``Block.set_forward``)."""
    if kv_cache is not None:
        raise ValueError("tensor parallel blocks do not decode with a KV cache; gather the model first")
    return block_forward(regions, block, x, residual, cos, sin, doc_ids, attn_mask)


def block_forward(regions: TPRegions, block: nn.Module, x, residual, cos, sin, doc_ids=None, attn_mask=None):
    """``Block.forward`` on local shards: residual += x; h = attn(norm(residual)); residual += h;
    out = mlp(norm(residual)), with ``enter`` / ``exit`` around each region. x and residual are in the
    residual-stream layout ((b*s/t, h) flattened-token shards under SP, (b, s, h) otherwise). With
    ``parallel.tp_graphs`` the block runs as replays of its captured CUDA graphs where it can (graphs.py)."""
    c = block.cfg
    if c.ops.linear_precision != "bf16":
        raise ValueError(f"model.ops.linear_precision = {c.ops.linear_precision!r} is not available with tensor "
                         f"parallelism; use 'bf16'")
    if regions.graphs is not None and regions.graphs.applies(x, cos, doc_ids, attn_mask):
        return regions.graphs.run(regions, block, x, residual, cos, sin)
    return block_math(regions, block, x, residual, cos, sin, block_weights(regions, block), doc_ids, attn_mask)


def block_math(regions: TPRegions, block: nn.Module, x, residual, cos, sin, w: BlockWeights, doc_ids=None,
               attn_mask=None):
    """The block's math on the local tensors ``w`` (see :func:`block_forward`).

    With ``regions.chunks`` = k > 1 (SP, whole sequences per rank) the local tokens are cut into k groups of whole
    sequences and each stage runs over all groups before the next stage starts: group j+1's all-gather and group
    j's reduce-scatter run on NCCL's stream while the GEMMs of another group run. Every op in the block is per
    sequence, and the gather of group j of every rank is a set of whole sequences, so the groups never mix."""
    c, attn = block.cfg, block.self_attn
    T, H, impl, eps, fp32 = cos.size(-2), c.hidden_dim, c.ops.fused_linear, c.rms_norm_eps, c.residual_in_fp32
    k = regions.groups(x, T, per_row=cos.dim() == 3 or doc_ids is not None or attn_mask is not None)
    xs = x.chunk(k) if k > 1 else [x]
    rs = residual.chunk(k) if k > 1 and residual is not None else [residual] * k

    def norm(hs, weight):
        out = [ops.add_rmsnorm(h, r, weight, eps, fp32, impl=c.ops.rmsnorm) for h, r in zip(hs, rs)]
        return [o[0] for o in out], [o[1] for o in out]

    hs, rs = norm(xs, w.input_norm)
    fulls = [regions.enter(h).view(-1, T, H) for h in hs]        # every group's all-gather before the GEMMs
    outs = []
    for full in fulls:
        y = attn.attend(ops.lean_linear(full, w.qkv, w.qkv_bias, impl), cos, sin, None, 0, doc_ids, attn_mask)
        outs.append(regions.exit(ops.lean_linear(y, w.o, None, impl)))
    if w.o_bias is not None:
        outs = [o + w.o_bias for o in outs]
    hs, rs = norm(outs, w.post_norm)
    fulls = [regions.enter(h).view(-1, T, H) for h in hs]
    outs = [regions.exit(ops.swiglu_linear(ops.lean_linear(full, w.gate_up, None, impl), w.down, None, impl))
            for full in fulls]
    if k == 1:
        return outs[0], rs[0]
    return torch.cat(outs), torch.cat(rs)


def _local(p):
    return None if p is None else p.to_local()


def block_graphs(model: nn.Module):
    """The ``graphs.BlockGraphs`` of a model sharded with ``parallel.tp_graphs`` (None otherwise)."""
    regions = _REGIONS.get(model)
    return None if regions is None else regions.graphs


def vocab_parallel_loss(model: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """The fused vocab-parallel LM head + cross-entropy (``tp_loss.py``) of a model sharded by ``tp_impl =
    local``: ``h`` (the final norm's output, residual-stream layout) enters the head's region (all-gather under
    SP), the loss is computed from the local vocabulary rows. None for the dtensor implementation."""
    regions = _REGIONS.get(model)
    if regions is None:
        return None
    from zero2all.distributed.tp_loss import vocab_parallel_cross_entropy

    weight = model.lm_head.weight.to_local()
    full = regions.enter(h).reshape(-1, h.size(-1))
    start = regions.mesh.get_local_rank() * weight.size(0)
    return vocab_parallel_cross_entropy(full, weight, targets, regions.mesh.get_group(), start)


def _apply_local(model: nn.Module, regions: TPRegions) -> None:
    """Shard the parameters (DTensors, the layouts of the table above) and route the blocks, the embedding and
    the LM head through :class:`TPRegions`."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh, sp = regions.mesh, regions.sequence_parallel

    def shard(module: nn.Module, name: str, placement) -> None:
        p = getattr(module, name)
        if p is not None:
            setattr(module, name, nn.Parameter(distribute_tensor(p.data, mesh, [placement])))

    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        if not hasattr(mlp, "gate_up_proj"):
            raise ValueError("tensor parallel: mixture-of-experts blocks are not split over tp ranks (use "
                             "parallel.ep for the experts)")
        shard(attn.qkv_proj, "weight", Shard(0))
        shard(attn.qkv_proj, "bias", Shard(0))
        shard(attn.o_proj, "weight", Shard(1))
        shard(attn.o_proj, "bias", Replicate())
        shard(mlp.gate_up_proj, "weight", Shard(0))
        shard(mlp.down_proj, "weight", Shard(1))
        if sp:
            shard(block.input_layernorm, "weight", Replicate())
            shard(block.post_attention_layernorm, "weight", Replicate())
        _REGIONS[block] = regions
        block.set_forward(functools.partial(_installed_block_forward, regions))
    if sp:
        shard(model.norm, "weight", Replicate())
    shard(model.embed_tokens, "weight", Shard(0))
    if not model.cfg.tie_word_embeddings:
        shard(model.lm_head, "weight", Shard(0))

    def embed_input(module, args):
        (tokens,) = args  # vocab-sharded lookup: DTensor's embedding gives a (masked) partial sum
        return (DTensor.from_local(tokens.reshape(-1) if sp else tokens, mesh, [Replicate()], run_check=False),)

    def embed_output(module, args, out):
        return out.redistribute(mesh, [Shard(0) if sp else Replicate()]).to_local()

    def head_input(module, args):
        (h,) = args
        if sp:  # the flattened-token shards, gathered: (b*s, h); the gradient is reduce-scattered back
            return (DTensor.from_local(h.reshape(-1, h.size(-1)), mesh, [Shard(0)], run_check=False)
                    .redistribute(mesh, [Replicate()]),)
        return (DTensor.from_local(h, mesh, [Replicate()], run_check=False),)

    def head_output(module, args, logits):  # (b*s, V) -> (1, b*s, V) under SP: a batch of flattened tokens
        return logits.unsqueeze(0) if logits.dim() == 2 else logits

    _REGIONS[model] = regions
    model.set_parallel_loss(vocab_parallel_loss)
    model.embed_tokens.register_forward_pre_hook(embed_input)
    model.embed_tokens.register_forward_hook(embed_output)
    model.lm_head.register_forward_pre_hook(head_input)
    model.lm_head.register_forward_hook(head_output)


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


def refusals(req) -> list[str]:
    """Tensor parallelism's declared rules (``plan.resolve``): attention split by whole KV groups, the MLP by
    columns and the vocabulary by rows (each divisible by tp), dense blocks only (MoE experts go over ep), no
    dropout (the replicated activations would drop different values on each rank), the vocab-parallel loss is the
    cross-entropy alone, FP8 linears are not sharded; sequence parallel and async tp need tp."""
    pc, model, t, out = req.parallel, req.model, req.parallel.tp, []
    if pc.sequence_parallel and t == 1:
        out.append("parallel.sequence_parallel shards the sequence over the tp ranks: it needs parallel.tp > 1")
    if pc.async_tp and (t == 1 or pc.tp_impl != "dtensor" or not pc.sequence_parallel):
        out.append(f"parallel.async_tp overlaps the sequence-parallel collectives of DTensor linears: it needs "
                   f"parallel.tp > 1, tp_impl = 'dtensor' and sequence_parallel = true (got tp={t}, tp_impl="
                   f"{pc.tp_impl!r}, sequence_parallel={pc.sequence_parallel}); it also needs train.compile = true")
    elif pc.async_tp and req.compile_blocks is False:
        out.append("parallel.async_tp rewrites compiled graphs: set train.compile = true")
    elif pc.async_tp and req.device is not None and req.device.type != "cuda":
        out.append("parallel.async_tp needs CUDA devices (symmetric memory over NVLink); set it to false")
    if t == 1 or model is None:
        return out
    for name, value in (("n_heads", model.n_heads), ("n_kv_heads", model.n_kv_heads),
                        ("intermediate_size", model.intermediate_size)):
        if value % t:
            out.append(f"parallel.tp={t}: model.{name}={value} is not divisible by it (each tensor-parallel rank "
                       f"holds an equal share); pick a tp that divides it")
    if model.padded_vocab_size % t:
        out.append(f"parallel.tp={t}: the vocabulary ({model.padded_vocab_size} rows) is not divisible by it "
                   f"(embedding and LM head are split by rows); set model.pad_vocab_to_multiple_of")
    if model.moe.enabled:
        out.append(f"parallel.tp={t} with a mixture-of-experts model: MoE blocks are not split over tp ranks; use "
                   f"parallel.ep for the experts (with tp = 1)")
    if model.ops.linear_precision != "bf16":
        out.append(f"parallel.tp={t} with model.ops.linear_precision = {model.ops.linear_precision!r}: FP8 linears "
                   f"need plain, unsharded projections; use 'bf16'")
    for name in ("attention_dropout", "dropout1", "dropout2"):
        if getattr(model, name):
            out.append(f"parallel.tp={t}: model.{name}={getattr(model, name)} would drop different values of the "
                       f"replicated activations on each tp rank; set it to 0")
    if req.train is not None and req.train.z_loss:
        out.append(f"parallel.tp={t}: train.z_loss is not available with tensor parallelism (the vocab-parallel "
                   f"loss computes the cross-entropy only); set it to 0")
    seq_len, c = req.seq_len, req.size("cp")
    if pc.sequence_parallel and seq_len and (seq_len // c) % t:
        out.append(f"parallel.sequence_parallel: {seq_len // c} tokens per sequence and rank (seq_len={seq_len} / "
                   f"cp={c}) are not divisible by tp={t}")
    return out
