"""Expert parallelism: the routed experts of every MoE layer divided over the ``ep`` ranks of a (dp, ep) mesh.

Different experts hold different weights and see different tokens. Every rank runs attention and the router on
its own micro-batch (all world ranks are data-parallel for the non-expert parameters); in a MoE layer the rows
routed to expert e travel to the rank that holds e and back::

    x sorted by expert (local)  --all_to_all (split sizes exchanged first)-->  rows from every source rank
    regroup by local expert -> grouped SwiGLU GEMM -> ungroup  --all_to_all back-->  combine with router weights

Both exchanges are ``all_to_all_single_autograd`` (torch's functional collectives): the backward is the reverse
exchange of the gradients. Rank r of an ep group holds experts [r E/ep, (r+1) E/ep).

Gradients. Each rank's loss is a mean over its own tokens and the run's loss is the mean over the world ranks.
A non-expert weight's gradient is averaged over all ranks (FSDP2 over the flat world mesh). An expert's gradient
arrives summed over the ep source ranks that sent it tokens, then FSDP2 averages it over the dp replicas that
hold the same expert; the missing 1/ep is applied in the forward (``Experts.grad_scale``), so both kinds end up
as the gradient of the world-mean loss: what one process computes on the whole batch.

Sharding and checkpoints. Expert weights are DTensors sharded on dim 0 (the expert axis) over the ``ep`` mesh
dimension, and FSDP2 shards them further over ``dp`` (2D: dp x ep); the other parameters are FSDP2-sharded over
all ranks. With dp = 1 (ep = the world size) the experts stay out of FSDP2: each is held by one rank, so there
is nothing to gather or reduce; their forward casts them to the compute dtype (bf16), their gradients and
optimizer state stay float32. The blocks keep their gathered non-expert weights from the forward to the backward
(``parallel.ep_reshard_after_forward = false``, the default: next to the experts they are small), which saves the
backward's re-gather per block and micro-batch. The checkpoint (``zero2all/checkpoint``, DCP) stores global
tensors under the plain names (``layers.1.mlp.experts.gate_up_proj``), so a run resumes on any ep size, one
process included.

Composition with the other mesh dimensions (tp/pp/cp): this module needs only the ("dp", "ep") sub-mesh; a full
mesh that also has tp/pp/cp dimensions passes ``mesh["dp", "ep"]`` to :func:`apply_expert_parallel`. The
non-expert FSDP2 here spans all ranks, right while dp and ep are the only dimensions; with tp/pp/cp it must span
the flattened ("dp", "ep") ranks instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from zero2all.config import ConfigError, ParallelConfig
from zero2all.distributed.env import DistEnv


def ep_mesh(env: DistEnv, ep: int):
    """The 2D (dp, ep) device mesh over all ranks: ranks r * ep .. r * ep + ep - 1 form one ep group."""
    from torch.distributed.device_mesh import init_device_mesh

    if env.world_size % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the {env.world_size} processes")
    return init_device_mesh(env.device.type, (env.world_size // ep, ep), mesh_dim_names=("dp", "ep"))


class SplitPlan:
    """One MoE layer's split sizes under exchange: ``counts`` (2, ep, L) on the device = [rows I send to (rank
    d, its local expert l), rows rank s sends me for my local expert l], and their copy on its way to the host
    (``ready`` marks its arrival on CUDA). :meth:`host` waits for it: the one host sync of the layer."""

    def __init__(self, counts: torch.Tensor, host: torch.Tensor, ready):
        self.counts, self._host, self.ready = counts, host, ready

    def host(self) -> tuple[list[int], list[int]]:
        """(rows I send to each rank, rows I receive from each rank)."""
        if self.ready is not None:
            self.ready.synchronize()
        send, recv = self._host.tolist()
        return [sum(row) for row in send], [sum(row) for row in recv]


class AllToAllDispatch:
    """Send each expert's rows to the rank holding it, run the local experts, send the results back.

    Host syncs: ``all_to_all_single`` needs the split sizes on the host (dropless routing: they change every
    step), so each layer's forward reads them once: the send and receive counts in one small copy, started in
    :meth:`plan` right after the router and awaited in :meth:`__call__` after the layer's other launches
    (sort, gather, auxiliary losses, shared experts), so the GPU stays busy while the host waits. Nothing else in the
    layer syncs (the regrouping is sized from the host counts); the backward needs no sync at all: the
    exchanges' gradients reuse the forward's splits, reversed."""

    def __init__(self, group, ep: int, n_experts: int):
        self.group, self.ep, self.local = group, ep, n_experts // ep

    # under torch.compile (train.compile: per block) the exchanges run eagerly: their split sizes are read on the
    # host and the expert weights are DTensors, neither of which traces; the rest of the block is compiled
    @torch.compiler.disable
    def plan(self, counts: torch.Tensor) -> SplitPlan:
        send = counts.to(torch.int64).view(self.ep, self.local)   # rows for destination d, its local expert l
        recv = torch.empty_like(send)                              # rows from source s for my local expert l
        dist.all_to_all_single(recv.view(-1), send.reshape(-1), group=self.group)
        both = torch.stack([send, recv])
        if both.device.type != "cuda":
            return SplitPlan(both, both, None)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return SplitPlan(both, host, ready)

    @torch.compiler.disable
    def __call__(self, moe, x_sorted: torch.Tensor, plan: SplitPlan) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        from zero2all.model.moe import gather_rows

        send_rows, recv_rows = plan.host()
        x_recv = all_to_all_single_autograd(x_sorted, recv_rows, send_rows, self.group)
        # received rows are grouped by source, then by local expert: regroup them by local expert
        recv = plan.counts[1]
        local_ids = torch.arange(self.local, device=recv.device).repeat(self.ep)
        local_ids = torch.repeat_interleave(local_ids, recv.reshape(-1), output_size=sum(recv_rows))
        order = torch.argsort(local_ids, stable=True)
        y = moe.experts(gather_rows(x_recv, order), recv.sum(0))
        y_recv = y.new_zeros(y.shape).index_copy(0, order, y)
        return all_to_all_single_autograd(y_recv, send_rows, recv_rows, self.group)


def apply_expert_parallel(model: nn.Module, pc: ParallelConfig, env: DistEnv, param_dtype: torch.dtype,
                          mesh=None) -> nn.Module:
    """Shard ``model`` in place: experts over ep (then FSDP2 over dp), everything else FSDP2 over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from zero2all.distributed.ac import transformer_blocks
    from zero2all.model.moe import moe_layers

    ep = pc.ep
    mesh = mesh if mesh is not None else ep_mesh(env, ep)
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(f"parallel.ep={ep}: the model has no MoE layers (model.moe.n_experts = 0)")
    n_experts = layers[0][1].cfg.moe.n_experts
    if n_experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide model.moe.n_experts={n_experts}")
    if param_dtype in (torch.float32, torch.float64):
        mp = MixedPrecisionPolicy()
    else:
        mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=torch.float32 if pc.fsdp_reduce_fp32 else param_dtype)
    group = mesh.get_group("ep")
    # with one ep group (dp = 1) every expert lives on one rank: nothing to shard further or to reduce, so the
    # experts stay out of FSDP2 (no gather / reduce-scatter hooks per layer) and are cast to the compute dtype
    # in the forward instead
    alone = mesh["dp"].size() == 1
    reshard = pc.ep_reshard_after_forward
    ignored: set[nn.Parameter] = set()
    for _, moe in layers:
        experts = moe.experts
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(full.data, mesh["ep"], [Shard(0)])))
        experts.grad_scale = 1.0 / ep
        moe.dispatch = AllToAllDispatch(group, ep, n_experts)
        if alone:
            ignored.update(experts.parameters())
            experts.compute_dtype = None if param_dtype in (torch.float32, torch.float64) else param_dtype
        else:
            fully_shard(experts, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    world = init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("world",))
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=world, mp_policy=mp, ignored_params=ignored or None,
                    reshard_after_forward=reshard and i < len(blocks) - 1)
    fully_shard(model, mesh=world, mp_policy=mp, ignored_params=ignored or None, reshard_after_forward=reshard)
    # each MoE layer's forward waits once on the host for its split sizes, which stops the host from running
    # ahead to issue the next block's all-gather early: ask for it at this block's start instead
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])
    return model


def refusals(req) -> list[str]:
    """Expert parallelism's declared rules (``plan.resolve``): ep divides the processes and the experts, the
    non-expert parameters are FSDP2-sharded over all ranks (mode fsdp), on a plain data-parallel layout."""
    pc, e, out = req.parallel, req.parallel.ep, []
    if e == 1:
        return out
    if req.world_size is not None and req.world_size % e:
        out.append(f"parallel.ep={e} does not divide the {req.world_size} processes")
    if pc.uses_mesh():
        out.append(f"parallel.ep={e} with tp={pc.tp}, pp={pc.pp}, cp={pc.cp}, dp_replicate={pc.dp_replicate}: "
                   f"expert parallelism composes with FSDP2 data parallelism only (set tp, pp, cp and dp_replicate "
                   f"to 1)")
    elif pc.resolved_mode(req.world_size or e) != "fsdp":
        out.append(f"parallel.ep={e} needs parallel.mode = fsdp (or auto): the non-expert parameters are FSDP2-"
                   f"sharded over all ranks, the experts over the dp ranks")
    model = req.model
    if model is not None and not model.moe.enabled:
        out.append(f"parallel.ep={e}: the model has no MoE layers (model.moe.n_experts = 0); set parallel.ep = 1")
    elif model is not None and model.moe.n_experts % e:
        out.append(f"parallel.ep={e} does not divide model.moe.n_experts={model.moe.n_experts} (every ep rank holds "
                   f"the same number of experts)")
    return out
