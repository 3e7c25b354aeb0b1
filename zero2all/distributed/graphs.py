"""CUDA graphs of the tensor-parallel blocks (``parallel.tp_graphs``): a block's forward and its backward each
become one graph replay instead of hundreds of kernel launches and Python dispatches.

Why: under tensor parallelism every rank launches the kernels of the whole model on 1/t of the work each. At
z2all-1.1b / tp2 the GPU then finishes a kernel faster than the host issues the next one, and every collective
waits for the slower rank's host (BENCHMARKS.md, "Tensor parallel on local shards"). A CUDA graph replays the
recorded kernels, the NCCL collectives of the region edges included, with one host call.

How (the recipe of ``torch.cuda.make_graphed_callables``, applied per block and per input signature):

1. The first ``WARMUP_CALLS`` forwards of a block with a given signature (shapes, dtypes, autocast) run eagerly:
   Triton compiles and autotunes, cuBLAS / cuDNN pick their plans, NCCL's communicators exist.
2. On the next forward the block's math (``tp.block_math``) is run once more on a side stream on static input
   buffers (forward + backward), then captured as the forward graph; its backward (``torch.autograd.grad`` of
   the static outputs) is captured when autograd first reaches the block, i.e. in the reverse order of the
   forwards. The graphs of one signature share one memory pool and are captured in the order they replay
   (forward of blocks 0..n-1, backward of n-1..0), the rule for graphs sharing a pool.
3. Every later call copies its inputs into the static buffers and replays; the backward copies the incoming
   gradients and replays. The graph reads the parameters' own storage (their local shards, updated in place by
   the optimizer); a parameter whose storage moved is refused (checked on every replay).

Returned gradients: the input gradients are the graph's buffers (consumed at once by the previous block); the
weight gradients are cloned, since autograd may keep the first one as ``.grad`` and the next replay would
overwrite it. Outside its conditions the block runs eagerly (same math): no autograd (evaluation), per-row
positions or masks, a second forward before the backward of the first (the static buffers are in use).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

WARMUP_CALLS = 2   # eager forwards of a block per signature before its capture
MAX_SIGNATURES = 4  # input signatures captured per model; calls with further ones run eagerly


def check_graphs_supported(device: torch.device, pc, world_size: int, compile_blocks: bool) -> None:
    """Refuse ``parallel.tp_graphs`` where it cannot run, naming why (called before any sharding)."""
    from zero2all.config import ConfigError

    reasons = []
    if device.type != "cuda":
        reasons.append(f"it needs CUDA devices (this process runs on {device.type}: CUDA graphs do not exist there)")
    if pc.tp < 2 or pc.tp_impl != "local":
        reasons.append(f"it needs parallel.tp > 1 with tp_impl = 'local' (got tp={pc.tp}, "
                       f"tp_impl={pc.tp_impl!r})")
    shape = pc.mesh_shape(world_size)
    if shape["pp"] > 1 or shape["cp"] > 1 or shape["dp_replicate"] > 1 or shape["dp_shard"] > 1:
        reasons.append(f"it composes with plain tensor parallelism only (got pp={shape['pp']}, cp={shape['cp']}, "
                       f"dp_replicate={shape['dp_replicate']}, dp_shard={shape['dp_shard']} on {world_size} "
                       f"processes: FSDP2 and pipeline stages move "
                       f"or free the parameters' storage that a graph reads)")
    if pc.activation_checkpointing != "none":
        reasons.append(f"activation checkpointing ({pc.activation_checkpointing!r}) re-runs the forward inside "
                       f"backward; set parallel.activation_checkpointing = 'none'")
    if compile_blocks:
        reasons.append("train.compile compiles the blocks instead; use one of the two")
    if reasons:
        raise ConfigError("parallel.tp_graphs: " + "; ".join(reasons))


def tp_graphs_wanted(device: torch.device, pc, world_size: int, compile_blocks: bool) -> tuple[bool, str]:
    """Whether the tensor-parallel blocks run as CUDA graphs, and why not when they don't.

    ``parallel.tp_graphs = true`` insists (a run where they cannot work is refused); ``false`` turns them off;
    ``"auto"`` (the default) turns them on wherever :func:`check_graphs_supported` accepts the run."""
    from zero2all.config import ConfigError

    if pc.tp_graphs is False or pc.tp < 2:
        return False, ""
    try:
        check_graphs_supported(device, pc, world_size, compile_blocks)
    except ConfigError as e:
        if pc.tp_graphs is True:
            raise
        return False, str(e).replace("parallel.tp_graphs: ", "", 1)
    return True, ""


@dataclass
class _Graphs:
    """One block's captured graphs for one input signature, with their static buffers."""

    stream: torch.cuda.Stream
    pool: tuple
    x: torch.Tensor
    residual: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    weights: tuple                      # detached aliases of the block's local parameters (None kept)
    grad_mask: tuple[bool, ...]         # which of (x, residual, *weights) need a gradient
    forward: torch.cuda.CUDAGraph
    outputs: tuple                      # (out, residual) with their autograd graph, until the backward capture
    results: tuple                      # the same buffers as plain tensors, what each replay returns
    backward: torch.cuda.CUDAGraph | None = None
    grad_outputs: tuple = ()
    grads: tuple = ()                   # the backward graph's gradient buffers, one per True in grad_mask
    pending: object = None              # weakref to the autograd node of a forward whose backward has not run
    fresh: bool = True                  # captured from this call's inputs, whose backward is yet to capture

    def pointers_match(self, weights) -> bool:
        return all((a is None) == (b is None) and (a is None or a.data_ptr() == b.data_ptr())
                   for a, b in zip(self.weights, weights))

    def busy(self) -> bool:
        return self.pending is not None and self.pending() is not None

    def capture_backward(self) -> None:
        """Capture ``autograd.grad`` of the static outputs (when autograd first reaches this block)."""
        inputs = [t for t, need in zip((self.x, self.residual, *self.weights), self.grad_mask) if need]
        graph = torch.cuda.CUDAGraph()
        with _capturing(graph, self.pool, self.stream):
            grads = torch.autograd.grad(self.outputs, inputs, self.grad_outputs, allow_unused=True)
            for grad in grads:
                if grad is not None:
                    _wait_inside(grad)
        self.grads = tuple(grads)
        self.backward = graph
        self.outputs = self.results   # drop the captured autograd graph


@dataclass
class BlockGraphs:
    """The graphs of every block of one model (``TPRegions.graphs``): per block and signature, eager warm-up
    calls, then capture and replays. One memory pool per signature, shared by its blocks."""

    calls: dict = field(default_factory=dict)
    graphs: "weakref.WeakKeyDictionary[nn.Module, dict]" = field(default_factory=weakref.WeakKeyDictionary)
    pools: dict = field(default_factory=dict)
    stream: torch.cuda.Stream | None = None

    def applies(self, x, cos, doc_ids, attn_mask) -> bool:
        """Blocks with autograd on, one RoPE table for all rows and no masks run through the graphs."""
        return (torch.is_grad_enabled() and x.is_cuda and cos.dim() == 2 and doc_ids is None and attn_mask is None)

    @staticmethod
    def signature(x, residual, cos, weights) -> tuple:
        kind = x.device.type
        autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        need = (x.requires_grad, residual is not None and residual.requires_grad,
                *(w is not None and w.requires_grad for w in weights))
        return (tuple(x.shape), x.dtype, None if residual is None else (tuple(residual.shape), residual.dtype),
                tuple(cos.shape), cos.dtype, autocast, need)

    def run(self, regions, block: nn.Module, x, residual, cos, sin):
        from zero2all.distributed.tp import block_math, block_weights

        weights = tuple(block_weights(regions, block))
        key = self.signature(x, residual, cos, weights)
        per_block = self.graphs.setdefault(block, {})
        g = per_block.get(key)
        if g is None and key not in self.pools and len(self.pools) >= MAX_SIGNATURES:
            # shapes that change from call to call (e.g. padded batches of varying length): each new signature
            # would cost its own captures and memory pool; past a few, new ones run eagerly
            return block_math(regions, block, x, residual, cos, sin, _weights_tuple(weights))
        if g is None:
            n = self.calls.get((id(block), key), 0)
            if n < WARMUP_CALLS:
                self.calls[(id(block), key)] = n + 1
                return block_math(regions, block, x, residual, cos, sin, _weights_tuple(weights))
            g = per_block[key] = self._capture_forward(regions, block, x, residual, cos, sin, weights, key)
        elif g.busy():  # a second forward before the first one's backward: the static buffers are taken
            return block_math(regions, block, x, residual, cos, sin, _weights_tuple(weights))
        if not g.pointers_match(weights):
            raise RuntimeError("parallel.tp_graphs: a parameter of a captured block no longer has the storage its "
                               "CUDA graph reads (was .data replaced, or the model moved?); update parameters in "
                               "place or turn tp_graphs off")
        out, res = _GraphedBlock.apply(g, x, residual, cos, sin, *weights)
        return out, res

    def release(self) -> int:
        """Free every captured graph (call before the process group is destroyed); returns how many were freed.

        A graph that captured an NCCL collective holds a reference on that communicator, and NCCL's communicator
        teardown waits until every such graph is destroyed: ``destroy_process_group`` with a graph still alive
        never returns. After this call the blocks run eagerly again until they are captured anew."""
        if self.stream is not None:
            torch.cuda.synchronize()
        freed = 0
        for per_block in list(self.graphs.values()):
            for g in per_block.values():
                for graph in (g.forward, g.backward):
                    if graph is not None:
                        graph.reset()
                        freed += 1
            per_block.clear()
        self.graphs = weakref.WeakKeyDictionary()
        self.calls.clear()
        self.pools.clear()
        return freed

    def _capture_forward(self, regions, block, x, residual, cos, sin, weights, key) -> _Graphs:
        from zero2all.distributed.tp import block_math

        if self.stream is None:
            self.stream = torch.cuda.Stream(device=x.device)
        pool = self.pools.setdefault(key, torch.cuda.graph_pool_handle())
        need = key[-1]

        def static(t, grad):
            if t is None:
                return None
            return t.detach().clone().requires_grad_(grad)

        sx, sres = static(x, need[0]), static(residual, need[1])
        scos, ssin = cos.detach().clone(), sin.detach().clone()
        sw = tuple(None if w is None else w.detach().requires_grad_(g) for w, g in zip(weights, need[2:]))
        inputs = [t for t, g in zip((sx, sres, *sw), need) if g]
        kind = x.device.type
        autocast = dict(device_type=kind, dtype=torch.get_autocast_dtype(kind),
                        enabled=torch.is_autocast_enabled(kind), cache_enabled=False)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.autocast(**autocast):  # once more on the capture stream
            outs = block_math(regions, block, sx, sres, scos, ssin, _weights_tuple(sw))
            if inputs:
                torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs], allow_unused=True)
            del outs
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        torch.clear_autocast_cache()
        with _capturing(graph, pool, stream), torch.autocast(**autocast):
            outs = block_math(regions, block, sx, sres, scos, ssin, _weights_tuple(sw))
            for o in outs:
                _wait_inside(o)
        results = tuple(_plain(o).detach() for o in outs)
        return _Graphs(stream, pool, sx, sres, scos, ssin, sw, need, graph, tuple(outs), results)


@contextlib.contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream):
    """Capture the work issued inside into ``graph`` on ``stream`` (``torch.cuda.graph`` without its
    ``gc.collect()`` and ``empty_cache()``, which would cost seconds over a model's 2 x n_layers captures). Only
    the capturing thread is checked for unsafe calls (``thread_local``): NCCL's watchdog keeps polling its own
    events meanwhile."""
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the capture is void; report the first error
                graph.capture_end()
            raise
        graph.capture_end()


def _wait_inside(t: torch.Tensor) -> None:
    """A region edge's output may be a functional collective's lazy result (``AsyncCollectiveTensor``), waited
    on by its first use. The wait (the join of NCCL's stream) must be part of the capture: issue it now."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(t, AsyncCollectiveTensor):
        t.trigger_wait()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a functional collective's lazy result (already waited on by the capture)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def _weights_tuple(weights):
    from zero2all.distributed.tp import BlockWeights

    return BlockWeights(*weights)


class _GraphedBlock(torch.autograd.Function):
    """Forward: copy the inputs into the static buffers, replay the forward graph. Backward: copy the output
    gradients, replay (capturing on first use) the backward graph."""

    @staticmethod
    def forward(ctx, g: _Graphs, x, residual, cos, sin, *weights):
        if g.fresh:  # the buffers hold these inputs already; a copy would bump the version of tensors that the
            g.fresh = False  # captured autograd graph saved, and its backward is captured later
        else:
            g.x.copy_(x)
            if residual is not None:
                g.residual.copy_(residual)
            g.cos.copy_(cos)
            g.sin.copy_(sin)
        g.forward.replay()
        ctx.g = g
        g.pending = weakref.ref(ctx)  # alive as long as that forward's autograd graph is
        out, res = (r.detach() for r in g.results)
        return out, res

    @staticmethod
    def backward(ctx, grad_out, grad_res):
        g: _Graphs = ctx.g
        if not g.grad_outputs:
            g.grad_outputs = tuple(torch.empty_like(r) for r in g.results)
        for buf, grad in zip(g.grad_outputs, (grad_out, grad_res)):
            if grad is None:
                buf.zero_()
            else:
                buf.copy_(grad)
        if g.backward is None:
            g.capture_backward()
        g.backward.replay()
        g.pending = None
        it = iter(g.grads)
        out = []
        for i, need in enumerate(g.grad_mask):
            grad = next(it) if need else None
            out.append(grad.clone() if grad is not None and i >= 2 else grad)  # weights: see the module docstring
        return (None, out[0], out[1], None, None, *out[2:])


def refusals(req) -> list[str]:
    """``parallel.tp_graphs = true``'s declared rules (``plan.resolve``): tensor parallel blocks of tp_impl =
    'local'; with the world size, device and compile setting known, :func:`check_graphs_supported`'s too."""
    from zero2all.config import ConfigError

    pc = req.parallel
    if pc.tp_graphs is not True:
        return []
    if pc.tp == 1 or pc.tp_impl != "local":
        return [f"parallel.tp_graphs captures the blocks of tp_impl = 'local': it needs parallel.tp > 1 and tp_impl "
                f"= 'local' (got tp={pc.tp}, tp_impl={pc.tp_impl!r})"]
    if req.device is None or req.world_size is None:
        return []
    try:
        check_graphs_supported(req.device, pc, req.world_size, bool(req.compile_blocks))
    except ConfigError as e:
        return [str(e)]
    return []
