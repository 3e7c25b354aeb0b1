"""CUDA graphs of a pipeline stage's blocks: one captured forward and backward per in-flight microbatch.

Why: with one or two sequences per pipeline microbatch every kernel of a 1.1B block is small (tens of
microseconds), and the host spends more time launching a stage's ~100 kernels per block than the GPU spends
running them (BENCHMARKS.md, "Pipeline parallel: host time and stage balance"). A CUDA graph launches the whole
captured stream of kernels with one call: the block stack of a stage, forward and backward, becomes two replays
per microbatch.

What a replay may and may not do. A graph replays fixed kernels on fixed addresses: its inputs are copied into
static buffers, its outputs and everything it saves for backward live at fixed places in the graph's private
memory pool. A schedule keeps several microbatches in flight on a stage (1F1B: up to K - k on stage k of K; GPipe:
all M): the activations saved by the forward of microbatch m must survive until its backward, so a second forward
through the SAME graph before that backward would overwrite them. Hence *slots*: each slot is its own capture
(own pool, own static buffers) of the forward and backward; a forward takes a free slot, its backward frees it.
The number of slots is the largest number of microbatches in flight on the stage; if a schedule ever has more,
the extra forward runs eagerly (same values, counted in ``eager_calls``). The outputs and input gradients handed
back to the schedule are copies, so a later replay of the slot never changes a tensor the schedule still sends or
holds.

Parameter gradients: a replayed backward cannot write into ``param.grad`` (the trainer frees it after every
update, so its address changes). Each stage keeps one float32 accumulator per parameter; every backward replay
adds its weight gradients into them inside the graph, and :meth:`GraphedBlocks.finish_step` hands them to
``param.grad`` after the schedule step (:meth:`GraphedBlocks.begin_step` zeroes them before the next). The sum is
the one the eager path accumulates, microbatch by microbatch, in the same order.

Weight casts: the fused projections read bf16 copies of the float32 master weights (``kernels/eager.py``). A graph
must read copies at fixed addresses that hold the CURRENT weights: the stage keeps one persistent cast store whose
copies are refreshed in place (``copy_``) at the start of every schedule step, before any replay.

Capture runs under autocast without its cast cache (a cached cast from before the capture would be a stale
constant inside the graph) and in thread-local capture mode (the NCCL watchdog thread keeps querying its events).
Capture needs warm-up calls first (Triton compiles and autotunes outside the graph); the pipeline turns the graphs
on (``enabled``) from the second schedule step of a microbatch count, after torch's runtime has inferred its
shapes with a forward that has no backward (it would hold a slot). No autograd graph of an eager forward may be
alive at a capture: it keeps the parameters' gradient accumulators made on the default stream, and a captured
backward handing them gradients would make the default stream wait on the capture, which CUDA refuses (between
the pipeline's updates every graph is freed). Only plain pipeline stages are
graphed: no FSDP, tensor or context parallelism, activation checkpointing, document masks or per-row positions;
the zero-bubble schedule (which splits a backward into two parts) is refused (``pp.check_pipeline_graphs``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn


def _autocast_without_cache(device: torch.device):
    """The caller's autocast state (if any) with the cast cache disabled, for warm-up and capture."""
    if not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type), cache_enabled=False)


class _Slot:
    """One capture of ``fn`` (forward graph and backward graph in one private pool) with its static buffers."""

    def __init__(self, fn: Callable, sample: tuple[torch.Tensor, ...], params: list[nn.Parameter],
                 accumulators: list[torch.Tensor], warmup: int):
        device = sample[0].device
        # the static inputs are made, warmed up and captured on ONE side stream: autograd makes the stream a leaf
        # was created on wait for the gradients it receives from several uses (the first block's input is both
        # the norm's input and the residual stream); were that the default (legacy) stream, the backward capture
        # would fail ("operation would make the legacy stream depend on a capturing blocking stream")
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in sample)
        wants = [t for t in self.inputs if t.requires_grad]
        with torch.cuda.stream(side):
            for _ in range(warmup):     # compile / autotune outside the graph, settle the caching allocator
                # under the same autocast state as each capture below (the forward under autocast, the backward
                # not): a backward that ran differently here would meet kernels for the first time inside the
                # capture, and loading a kernel's module there is an implicit synchronisation the capture refuses
                with _autocast_without_cache(device):
                    out = fn(*self.inputs)
                grads = torch.autograd.grad(out, wants + params, grad_outputs=[torch.ones_like(o) for o in out],
                                            allow_unused=True)
                # the accumulation the backward graph ends with, into scratch: the capture then launches no
                # kernel for the first time
                pairs = [(a, g) for a, g in zip(accumulators, grads[len(wants):]) if g is not None]
                if pairs:
                    torch._foreach_add_([torch.zeros_like(a) for a, _ in pairs], [g.to(a.dtype) for a, g in pairs])
        torch.cuda.synchronize(device)
        pool = torch.cuda.graph_pool_handle()
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd, pool=pool, stream=side, capture_error_mode="thread_local"), \
                _autocast_without_cache(device):
            self.outputs = tuple(fn(*self.inputs))
        with torch.cuda.stream(side):
            self.grad_outputs = tuple(torch.zeros_like(o) for o in self.outputs)
        with torch.cuda.graph(self.bwd, pool=pool, stream=side, capture_error_mode="thread_local"):
            grads = torch.autograd.grad(self.outputs, wants + params, grad_outputs=self.grad_outputs,
                                        allow_unused=True)
            pairs = [(a, g) for a, g in zip(accumulators, grads[len(wants):]) if g is not None]
            if pairs:
                torch._foreach_add_([a for a, _ in pairs], [g.to(a.dtype) for a, g in pairs])
        grads_in = iter(grads[:len(wants)])
        self.grad_inputs = tuple(next(grads_in) if t.requires_grad else None for t in self.inputs)
        self.outputs = tuple(o.detach() for o in self.outputs)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for static, t in zip(self.inputs, inputs):
            static.detach().copy_(t)
        self.fwd.replay()
        return tuple(o.clone() for o in self.outputs)

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        for static, g in zip(self.grad_outputs, grads):
            if g is None:
                static.zero_()
            else:
                static.copy_(g)
        self.bwd.replay()
        return tuple(None if g is None else g.clone() for g in self.grad_inputs)


class _Replay(torch.autograd.Function):
    """Autograd node of one graphed call: forward replays the slot's forward graph, backward its backward graph
    (which also accumulates the weight gradients) and frees the slot."""

    @staticmethod
    def forward(ctx, owner: GraphedBlocks, slot: _Slot, *inputs):
        ctx.owner, ctx.slot = owner, slot
        return slot.forward(inputs)

    @staticmethod
    def backward(ctx, *grads):
        grad_inputs = ctx.slot.backward(grads)
        ctx.owner.release(ctx.slot)
        return (None, None, *grad_inputs)


class GraphedBlocks:
    """``fn(*inputs) -> tuple of tensors`` (a stage's block stack) run through CUDA graphs, up to ``max_slots``
    microbatches in flight. ``params`` are the parameters ``fn`` reads whose gradients the graphs accumulate.

    Call :meth:`begin_step` before a schedule step (zeroes the accumulators) and :meth:`finish_step` after it
    (adds them to ``param.grad``). A call whose input shapes differ from the first captured ones, or that finds no
    free slot, runs ``fn`` eagerly (normal autograd)."""

    slot_type = _Slot   # what one in-flight microbatch runs on (the tests' CPU stand-in has the same interface)

    def __init__(self, fn: Callable, params: list[nn.Parameter], max_slots: int, warmup: int = 2):
        if max_slots < 1:
            raise ValueError(f"CUDA graph slots must be >= 1, got {max_slots}")
        self.fn, self.max_slots, self.warmup = fn, max_slots, warmup
        self.params = [p for p in params if p.requires_grad]
        self.accumulators = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
                             for p in self.params]  # float32, or float64 for float64 parameters
        self.slots: list[_Slot] = []
        self.free: list[_Slot] = []
        self.signature: tuple | None = None
        self.eager_calls = 0     # calls that found no free slot or other shapes
        self.replays = 0
        self.most_in_flight = 0  # the most slots taken at once (what the schedule needed)
        self.enabled = False     # set by the pipeline from its second schedule step of a shape on

    def _signature(self, inputs) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in inputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sig = self._signature(inputs)
        if self.signature is None:
            self.signature = sig
        slot = None
        if sig == self.signature and torch.is_grad_enabled():
            if self.free:
                slot = self.free.pop()
            elif len(self.slots) < self.max_slots:
                slot = self.slot_type(self.fn, inputs, self.params, self.accumulators, self.warmup)
                self.slots.append(slot)
        if slot is None:
            self.eager_calls += 1
            return tuple(self.fn(*inputs))
        self.replays += 1
        self.most_in_flight = max(self.most_in_flight, len(self.slots) - len(self.free))
        return _Replay.apply(self, slot, *inputs)

    def release(self, slot: _Slot) -> None:
        self.free.append(slot)

    def begin_step(self) -> None:
        """Before a schedule step: every slot free, the gradient accumulators zero (a ``param.grad`` that still
        IS an accumulator from the last step is detached from it first)."""
        self.free = list(self.slots)
        for p, acc in zip(self.params, self.accumulators):
            if p.grad is acc:
                p.grad = acc.clone()
        if self.accumulators:
            torch._foreach_zero_(self.accumulators)

    def finish_step(self) -> None:
        """After a schedule step: the accumulated weight gradients into ``param.grad`` (the accumulator itself
        when the gradient was freed, the usual case; else added), in the parameter's dtype."""
        if not self.replays:
            return
        for p, acc in zip(self.params, self.accumulators):
            if p.grad is None:
                p.grad = acc if acc.dtype == p.dtype else acc.to(p.dtype)
            elif p.grad is not acc:
                p.grad.add_(acc.to(p.grad.dtype))
        self.replays = 0
