"""Pipeline parallelism: the model's blocks split into stages over ranks, driven by torch.distributed.pipelining.

Idea (GPipe, Huang et al. 2019; PipeDream-Flush / 1F1B, Narayanan et al. 2021): K ranks each hold a contiguous
run of blocks. A micro-batch of ``micro_batch_size`` sequences is split into M pipeline microbatches; stage k
works on microbatch m while stage k+1 works on m-1. The start and the drain leave ranks idle: with equal stages the
idle share of a step (the *bubble*) is

    bubble = (K - 1) / (K + M - 1)                          GPipe and 1F1B (same bubble; 1F1B keeps <= K
                                                            microbatches of activations alive instead of M)
    bubble = (K - 1) / (V * M + K - 1)                      interleaved 1F1B with V virtual stages per rank

Zero-bubble schedules (Qi et al. 2023) split each backward into the input gradient (on the critical path) and
the weight gradient (deferred into the idle slots), which removes most of the remaining bubble.

What this module does, mapped to the code:

- :func:`split_layers`: stage boundaries balanced by training FLOPs per token (6 x parameters of each matmul
  plus 12 * H * T for attention; the LM head weighs 6 * V * H, the embedding its optimizer work 2 * V * H),
  found by a linear-partition dynamic program that minimises the largest stage; with ``pp_balance = "time"`` the
  same program on costs timed on the devices (``pp_balance.py``), or the explicit block counts of ``pp_split``.
- :class:`StageModule`: one stage: its blocks under the plain model's names (``layers.5...``), the embedding on
  the first stage, the final norm + LM head + loss on the last. It sends ``(x, residual)`` to the next stage. A
  rank holds one stage, or ``pp_stages_per_rank`` = V of them round-robin (stage s on pp rank s mod K).
- :class:`PipelineRun`: the schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``), the loss scaling, the global gradient norm over the pp group, the report of
  the loss from the last stage to every rank, and the measured bubble. A schedule step runs inside
  ``ops.weight_cast_cache()``: each weight is cast to the compute dtype once per update, not twice per microbatch.

Gradient accumulation is expressed as microbatches: the ``grad_accum_steps`` micro-batches of an update, each
split into ``pp_microbatches``, run as ONE schedule of M = accum x pp_microbatches microbatches, so the pipeline
fills and drains once per update.

Loss: the single process computes, per micro-batch, the mean over its valid tokens; its accumulation divides by
``grad_accum_steps``. Pipeline microbatches hold different numbers of valid (label != -100) tokens, so the last
stage returns the model's own ``head_loss(..., reduction="sum")`` of each microbatch (its token losses summed,
its MoE terms times its valid-token count) and the schedule's loss function multiplies it by 1 / (valid tokens of
the micro-batch it belongs to), passed per row as the schedule's target (``scale_grads=False``): the gradients
of the cross-entropy are those of the single process exactly. A microbatch is a forward of its own, so its MoE
auxiliary losses are over its tokens (as under gradient accumulation); every stage weighs them by the
microbatch's share of the micro-batch's valid tokens (the last stage through ``head_loss``, the others as they
attach them to their activations, the per-row weights passed to every stage as ``loss_weight``).

Composition on the device mesh (``mesh.py``): data-parallel replicas of a pipeline shard each stage with FSDP2
over the ``dp_shard`` (x ``dp_replicate``) dimensions, the runtime reducing FSDP's gradients at the end of each
schedule step; tensor parallelism is applied to the blocks before the split (``tp.py``) and the last stage's
cross-entropy then runs under loss parallel. Checkpoints: every rank's modules carry the plain model's parameter
names, so a pipeline checkpoint is the one DCP format and resumes on one process or on another mesh.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from zero2all.config import MULTI_STAGE_SCHEDULES, ConfigError, ModelConfig, ParallelConfig
from zero2all.distributed.env import DistEnv, collective_timeout
from zero2all.model import ops


def check_pipeline_model(model_cfg: ModelConfig) -> None:
    """A rule of :func:`refusals` (the plan's): a tied embedding and LM head would be one
    matrix on two ranks."""
    if model_cfg.tie_word_embeddings:
        raise ConfigError("parallel.pp > 1 with model.tie_word_embeddings = true: the embedding (first stage) and "
                          "the LM head (last stage) would be one matrix on two ranks; untie them")


def check_pipeline_mesh(pc: ParallelConfig, shape: dict[str, int]) -> None:
    """Combinations refused on the built mesh, naming the numbers. ``pp_balance = "time"`` with tensor
    parallelism: the timed blocks would run its collectives too. Torch's zero-bubble schedule with FSDP-sharded
    stages (dp_shard or dp_replicate > 1): it does not reproduce the single process, other gradients from the
    second update on (measured on CPU, torch 2.13; its deferred weight-gradient steps and FSDP2's gradient
    reduction do not compose); GPipe, 1F1B and interleaved 1F1B with FSDP2 match."""
    if pc.pp_balance == "time" and shape.get("tp", 1) > 1:
        raise ConfigError(f"parallel.pp_balance='time' with tp={shape['tp']}: the timed blocks would run the "
                          f"tensor-parallel collectives too; use pp_balance = 'flops' or an explicit pp_split")
    if pc.pp_schedule == "zero_bubble" and shape.get("dp_shard", 1) * shape.get("dp_replicate", 1) > 1:
        raise ConfigError(f"parallel.pp_schedule='zero_bubble' with dp_replicate={shape.get('dp_replicate', 1)} x "
                          f"dp_shard={shape.get('dp_shard', 1)} data-parallel ranks: its deferred weight gradients "
                          f"and FSDP2's gradient reduction do not reproduce the single process; use 1f1b or "
                          f"interleaved_1f1b with data parallelism")


def check_pipeline_graphs(pc: ParallelConfig, shape: dict[str, int], device: torch.device,
                          linear_precision: str = "bf16") -> None:
    """``pp_cuda_graphs`` graphs plain bf16 stages on CUDA devices only (``pp_graphs.py``); the rest is refused
    here, naming what is in the way (FP8 linears keep host-side statistics and weight caches per call, which a
    replay would not update)."""
    if linear_precision != "bf16":
        raise ConfigError(f"parallel.pp_cuda_graphs = true with model.ops.linear_precision = {linear_precision!r}: "
                          f"not available (FP8 statistics and weight caches are kept per call); use 'bf16'")
    if device.type != "cuda":
        raise ConfigError(f"parallel.pp_cuda_graphs = true needs CUDA devices (this run is on {device.type}); "
                          f"set it to false")
    others = {k: v for k, v in shape.items() if k != "pp" and v > 1}
    if others:
        raise ConfigError(f"parallel.pp_cuda_graphs = true graphs plain pipeline stages only, not with {others} "
                          f"(FSDP / tensor / context parallel collectives inside the blocks); set it to false")
    if pc.activation_checkpointing != "none":
        raise ConfigError(f"parallel.pp_cuda_graphs = true with parallel.activation_checkpointing = "
                          f"{pc.activation_checkpointing!r}: not available; use one or the other")


def pipeline_graphs_wanted(pc: ParallelConfig, shape: dict[str, int], device: torch.device,
                           linear_precision: str = "bf16", moe: bool = False) -> tuple[bool, str]:
    """Whether the stages' blocks run as CUDA graphs, and why not when they don't: ``pp_cuda_graphs = true``
    insists (refused where they cannot work), ``false`` turns them off, ``"auto"`` (the default) turns them on
    wherever :func:`check_pipeline_graphs` accepts the run, the schedule is not zero_bubble and the blocks are
    dense (a mixture-of-experts block routes a varying number of tokens to each expert)."""
    if pc.pp_cuda_graphs is False or pc.pp < 2:
        return False, ""
    if pc.pp_cuda_graphs is True:
        if moe:
            raise ConfigError("parallel.pp_cuda_graphs = true with a MoE model: mixture-of-experts blocks route a "
                              "varying number of tokens per expert, which a graph replay cannot follow; set it to "
                              "false or auto")
        check_pipeline_graphs(pc, shape, device, linear_precision)
        return True, ""
    if pc.pp_schedule == "zero_bubble":
        return False, "the zero_bubble schedule splits a backward in two"
    if moe:
        return False, "mixture-of-experts blocks route a varying number of tokens per expert"
    try:
        check_pipeline_graphs(pc, shape, device, linear_precision)
    except ConfigError as e:
        return False, str(e).replace("parallel.pp_cuda_graphs = true ", "", 1)
    return True, ""


def graph_slots(schedule: str, n_stages: int, stage: int, n_microbatches: int) -> int:
    """The most microbatches in flight (forward done, backward not yet) on ``stage``: 1F1B runs K - k forwards
    before its first backward and then alternates, GPipe runs all M forwards first. Interleaved schedules: at
    most every stage's share of a round, 2 x K (a forward beyond the slots runs eagerly, still correct)."""
    if schedule == "1f1b":
        return max(1, min(n_microbatches, n_stages - stage))
    if schedule == "gpipe":
        return n_microbatches
    return min(n_microbatches, 2 * n_stages)


# --------------------------------------------------------------------------------------------------------------
# balancing the stages


def unit_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, list[float], float]:
    """Training FLOPs per token of (embedding, each block, final norm + LM head): 6 x the parameters of every
    matmul, plus 12 * H * T per block for attention scores over the full T x T (the MFU formula counts the causal
    half, 6 * H * T; the split keeps the full count, which puts fewer blocks beside the LM head). The embedding does
    no matmul; it weighs in with its gradient and optimizer traffic, taken as 2 * V * H."""
    H, V = cfg.hidden_dim, cfg.padded_vocab_size
    attn_params = H * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * H
    block = 6.0 * (attn_params + 3 * H * cfg.intermediate_size) + 12.0 * H * seq_len
    return 2.0 * V * H, [block] * cfg.n_layers, 6.0 * V * H


def split_layers(block_costs: list[float], n_stages: int, first_extra: float = 0.0,
                 last_extra: float = 0.0) -> list[list[int]]:
    """Contiguous runs of block indices, one per stage, minimising the most expensive stage (``first_extra`` is
    added to stage 0, ``last_extra`` to the last). Dynamic program over (stages used, blocks placed); ties go to
    the split that puts blocks earlier. Every stage gets at least one block."""
    n = len(block_costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} blocks into {n_stages} stages (each needs at least one block)")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, i: int, j: int) -> float:  # blocks [i, j) as stage `stage`
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == n_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]   # best[s][j]: first j blocks in s stages
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [], n
    for s in range(n_stages, 0, -1):
        bounds.append((cut[s][j], j))
        j = cut[s][j]
    return [list(range(i, j)) for i, j in reversed(bounds)]


def stage_layout(cfg: ModelConfig, pc: ParallelConfig, seq_len: int,
                 costs: tuple[float, list[float], float] | None = None) -> list[list[int]]:
    """The blocks of each of the pp x pp_stages_per_rank stages: ``parallel.pp_split`` block counts when given
    (checked by the plan, :func:`refusals`), else balanced by ``costs`` (embedding, each block, head), by default
    :func:`unit_costs` (FLOPs; ``pp_balance.measured_unit_costs`` gives seconds)."""
    if pc.pp_split:
        bounds = [sum(pc.pp_split[:s]) for s in range(len(pc.pp_split) + 1)]
        return [list(range(bounds[s], bounds[s + 1])) for s in range(len(pc.pp_split))]
    embed, blocks, head = costs or unit_costs(cfg, seq_len)
    return split_layers(blocks, pc.pp * pc.pp_stages_per_rank, embed, head)


def stage_rank(stage: int, pp: int) -> int:
    """Round-robin placement: stage s on pp rank s mod pp (interleaved schedules' layout)."""
    return stage % pp


# --------------------------------------------------------------------------------------------------------------
# stage modules


class StageModule(nn.Module):
    """One pipeline stage of a Z2all model. Its submodules ARE the model's (same tensors, same names:
    ``embed_tokens``, ``layers.<i>``, ``norm``, ``lm_head``), so its state dict is a slice of the model's.

    forward: first stage ``tokens`` -> ``(x, residual)``; middle ``(x, residual)`` -> ``(x, residual)``; last
    ``(x, residual)`` -> the model's ``head_loss(..., reduction="sum")`` of this microbatch, shape (1,).
    ``labels`` and ``loss_weight`` (per row, 1 / valid tokens of its micro-batch) are passed to every stage: the
    last computes the loss, the others weigh their MoE auxiliary losses by the microbatch's share of the tokens."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool, z_loss: float = 0.0,
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = model.cfg
        self.first, self.last, self.z_loss = first, last, z_loss
        self.every_chunk_valid = False   # set per micro-batch by PipelineRun (head_loss's ``counted``)
        # what crosses a stage boundary, whatever autocast does inside: x in the compute dtype, the residual
        # stream in fp32 with residual_in_fp32 (the runtime sizes its receive buffers from these dtypes)
        residual_dtype = compute_dtype if compute_dtype == torch.float64 or not model.cfg.residual_in_fp32 \
            else torch.float32
        self.boundary_dtypes = (compute_dtype, residual_dtype)
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.numerics = model.numerics   # what the model's head_loss reads (the fused loss's step-fusion marks)
        self.parallel_loss = None        # under tp the last stage's loss runs on sharded logits (loss parallel)
        self._rope_cache: dict = {}
        self.graphed = None   # a pp_graphs.GraphedBlocks over run_blocks (parallel.pp_cuda_graphs)
        from zero2all.model.moe import moe_layers

        # MoE blocks of a stage other than the last: their auxiliary losses (load-balancing, sequence-wise, router
        # z) of each microbatch join the training loss weighted by the microbatch's share of the valid tokens x
        # ``multiplier`` (set per step by PipelineRun), their values in aux_reported. The last stage's are in
        # head_loss.
        self.moe_blocks = [moe for _, moe in moe_layers(self.layers)]
        self.multiplier = 1.0
        self.aux_reported: list[torch.Tensor] = []
        self.in_chunk = False   # True inside the schedule's forward of a real microbatch (PipelineRun sets it)

    def _rope_tables(self, T: int, device, position_ids):
        """cos, sin for this microbatch: the tables of positions 0..T-1 are the same for every microbatch, so
        they are built once per (T, device) and reused (per-row ``position_ids`` are built each time)."""
        from zero2all.model.z2all import Z2all

        if position_ids is not None:
            return Z2all.rope_tables(self, 0, T, device, position_ids)  # uses only self.cfg
        key = (T, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = Z2all.rope_tables(self, 0, T, device)
        return self._rope_cache[key]

    def forward(self, *inputs, labels=None, loss_weight=None, doc_ids=None, position_ids=None):
        kwargs = dict(labels=labels, loss_weight=loss_weight, doc_ids=doc_ids, position_ids=position_ids)
        if self.moe_blocks and not self.in_chunk and self.training:
            from zero2all.model.moe import statistics_kept

            # the runtime's shape inference: the MoE blocks' statistics stay those of the real microbatches
            with statistics_kept(self.layers):
                return self._forward(*inputs, **kwargs)
        return self._forward(*inputs, **kwargs)

    def _forward(self, *inputs, labels=None, loss_weight=None, doc_ids=None, position_ids=None):
        from zero2all.model.z2all import Z2all

        if self.first:
            (tokens,) = inputs
            x, residual = Z2all.embed(self, tokens), None
        else:
            x, residual = inputs
        # the sequence length from the labels (every stage gets them): under sequence parallelism x holds only
        # this tensor-parallel rank's slice of the sequence
        T = labels.shape[1] if labels is not None else x.shape[1]
        graphed = self.graphed is not None and self.graphed.enabled and torch.is_grad_enabled()
        if graphed and x.device.type != "meta" and doc_ids is None and position_ids is None and T == x.shape[1]:
            x, residual = self.graphed(x) if residual is None else self.graphed(x, residual)
        else:
            x, residual = self.run_blocks(x, residual, self._rope_tables(T, x.device, position_ids), doc_ids)
        if not self.last:
            x = self._attach_moe_losses(x, labels, loss_weight)
            return _boundary(x, self.boundary_dtypes[0]), _boundary(residual, self.boundary_dtypes[1])
        # the model's own seams (self has its cfg, norm, lm_head, numerics and this stage's MoE blocks)
        h = Z2all.final_norm(self, x, residual)
        if h.device.type == "meta":  # shape inference of older torch versions: only the shape matters
            return ops.upcast(h).sum().reshape(1)
        _, loss = Z2all.head_loss(self, h, labels, self.z_loss, reduction="sum", counted=self.every_chunk_valid)
        # a plain tensor of shape (1,), never a view (FSDP hooks the stage's outputs); the vocab-parallel
        # cross-entropy's replicated value is the same on every tensor-parallel rank
        return (loss.to_local() if hasattr(loss, "to_local") else loss).reshape(1) * 1.0

    def _attach_moe_losses(self, x: torch.Tensor, labels, loss_weight) -> torch.Tensor:
        """This microbatch's MoE auxiliary losses of the stage's blocks (a stage other than the last), attached to
        the stage's activations: a microbatch is a forward of its own (its losses are over its tokens, as under
        gradient accumulation), weighted as the last stage's ``head_loss(reduction="sum")`` weighs its own: by the
        microbatch's share of its micro-batch's valid tokens (sum over rows of valid tokens x ``loss_weight``),
        times the trainer's multiplier. The unscaled shares are kept for the reported loss."""
        from zero2all.model.moe import attach_loss, moe_aux_loss

        aux = moe_aux_loss(self.layers) if self.moe_blocks else None
        if aux is None or x.device.type == "meta" or loss_weight is None:
            return x
        share = ((labels != -100).sum(1).to(loss_weight.dtype) * loss_weight).sum().to(aux.dtype)
        self.aux_reported.append(ops.upcast(aux.detach() * share))
        return attach_loss(x, aux, share * self.multiplier)

    def run_blocks(self, x, residual=None, rope=None, doc_ids=None):
        """The stage's blocks on ``(x, residual)`` (residual None before the first block of the model); ``rope``:
        the (cos, sin) tables, by default those of positions 0..T-1 (what the CUDA graphs capture)."""
        from zero2all.model.z2all import Z2all

        cos, sin = rope if rope is not None else self._rope_tables(x.shape[1], x.device, None)
        return Z2all.blocks(self, x, residual, cos, sin, None, 0, doc_ids, None, layers=self.layers.values())


def _boundary(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stage output sent to the next stage, in ``dtype``. Never a view: the zero-bubble schedule detaches its
    stage outputs in place after the input-gradient half of a backward, which torch refuses on a view (a MoE
    block's output reshaped to (B, T, H) is one when no auxiliary loss is attached to it); a view is copied."""
    t = t.to(dtype)
    return t.clone() if t._is_view() else t


@functools.cache
def stage_class():
    """torch's ``PipelineStage`` with what this run adds to its per-microbatch work, as methods of a subclass:
    each forward / backward chunk timed while ``timer.measure`` (``PipelineRun.reset_measurement``), and
    ``module.in_chunk`` set during a forward chunk, so that any other call of the stage module (the runtime's shape
    inference, on uninitialised tensors) stays out of the MoE blocks' load statistics. Built on first use:
    ``torch.distributed.pipelining`` is imported only by runs with stages."""
    from torch.distributed.pipelining import PipelineStage

    class RunStage(PipelineStage):
        def __init__(self, module: StageModule, stage_index: int, num_stages: int, device, group, timer: BusyTimer):
            super().__init__(module, stage_index, num_stages, device, group=group)
            self.stage_module, self.timer = module, timer

        def _run(self, fn, *args, **kwargs):
            return self.timer.wrap(fn)(*args, **kwargs) if self.timer.measure else fn(*args, **kwargs)

        def forward_one_chunk(self, *args, **kwargs):
            self.stage_module.in_chunk = True
            try:
                return self._run(super().forward_one_chunk, *args, **kwargs)
            finally:
                self.stage_module.in_chunk = False

        def backward_one_chunk(self, *args, **kwargs):
            return self._run(super().backward_one_chunk, *args, **kwargs)

        def backward_weight_one_chunk(self, *args, **kwargs):
            return self._run(super().backward_weight_one_chunk, *args, **kwargs)

    return RunStage


class RankModel(nn.Module):
    """The union of one rank's stages under the plain model's names (``layers`` is a ModuleDict keyed by the
    block index): what checkpoints, the optimizer and the weight gather see."""

    def __init__(self, cfg: ModelConfig, stages: list[StageModule], total_params: int, non_embedding: int):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleDict()
        for st in stages:
            for name in ("embed_tokens", "norm", "lm_head"):
                if getattr(st, name) is not None:
                    setattr(self, name, getattr(st, name))
            for i, block in st.layers.items():
                self.layers[i] = block
        self._counts = (total_params, non_embedding)

    def num_params(self, non_embedding: bool = False) -> int:
        """The whole model's count (what the run trains), not this rank's share."""
        return self._counts[1] if non_embedding else self._counts[0]


# --------------------------------------------------------------------------------------------------------------
# the run


def _schedule_class(name: str):
    from torch.distributed import pipelining as P

    if name == "gpipe":
        return P.ScheduleGPipe
    if name == "1f1b":
        return P.Schedule1F1B
    if name == "interleaved_1f1b":
        return P.ScheduleInterleaved1F1B
    return P.ScheduleInterleavedZeroBubble


@dataclass
class BusyTimer:
    """Per-rank busy time of the stage computations in one schedule step (CUDA events on a GPU, wall clock on a
    CPU), for the measured bubble: 1 - busy / step time."""

    cuda: bool
    spans: list = field(default_factory=list)
    cpu_busy: float = 0.0
    measure: bool = False   # time the stage computations (PipelineRun.reset_measurement turns it on)

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self.spans.append((start, end))
                return out
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.cpu_busy += time.perf_counter() - t0
            return out
        return timed

    def busy_s(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.spans) / 1e3
        return self.cpu_busy

    def reset(self) -> None:
        self.spans.clear()
        self.cpu_busy = 0.0


class PipelineRun:
    """This rank's stages, the schedule that drives them, and the pp-group collectives the trainer needs."""

    def __init__(self, model: nn.Module, pc: ParallelConfig, env: DistEnv, dims,
                 param_dtype: torch.dtype = torch.float32):
        self.pc, self.env, self.dims = pc, env, dims
        self.pp_group = dims["pp"].get_group()
        self.pp_rank = dims.rank("pp")
        self.costs = None      # measured seconds per microbatch of (embedding, blocks, head): pp_balance = time
        if pc.pp_balance == "time" and not pc.pp_split:
            from zero2all.distributed.pp_balance import measured_unit_costs

            self.costs = measured_unit_costs(model, model.cfg.max_seq_len, env.device, param_dtype)
        self.layout = stage_layout(model.cfg, pc, model.cfg.max_seq_len, self.costs)
        if env.is_main and self.costs:
            embed, blocks, head = self.costs
            print(f"pipeline stages balanced by measured time per microbatch: embedding {embed * 1e3:.2f} ms, "
                  f"block {max(blocks) * 1e3:.2f} ms, norm + LM head + loss {head * 1e3:.2f} ms -> blocks per "
                  f"stage {[len(ids) for ids in self.layout]}", flush=True)
        n_stages = len(self.layout)
        self.stage_ids = [s for s in range(n_stages) if stage_rank(s, pc.pp) == self.pp_rank]
        self.last_pp_rank = stage_rank(n_stages - 1, pc.pp)
        total, non_embedding = model.num_params(), model.num_params(non_embedding=True)
        self.modules = [StageModule(model, self.layout[s], s == 0, s == n_stages - 1, compute_dtype=param_dtype)
                        for s in self.stage_ids]
        self.plain = RankModel(model.cfg, self.modules, total, non_embedding)
        self.sharded = dims.size("dp_shard_cp") > 1 or dims.enabled("dp_replicate")
        if self.sharded:
            self._shard(param_dtype)
        self.timer = BusyTimer(env.device.type == "cuda")
        self.stages = [stage_class()(m, s, n_stages, env.device, self.pp_group, self.timer)
                       for m, s in zip(self.modules, self.stage_ids)]
        self._cast_store = None   # pp_cuda_graphs: weight cast copies kept across updates, refreshed in place
        self._graphed_counts: set[int] = set()   # microbatch counts whose schedule has run once (graphs on)
        graphs, why_not = pipeline_graphs_wanted(pc, dims.shape, env.device, model.cfg.ops.linear_precision,
                                                 moe=model.cfg.moe.n_experts > 0)
        if graphs:
            self._enable_graphs()
        elif why_not and env.device.type == "cuda" and env.is_main:
            print(f"parallel.pp_cuda_graphs = auto: the stages run eagerly, since {why_not}", flush=True)
        self._schedules: dict = {}  # by number of microbatches, built when the batch size is known
        self.n_microbatches = 0
        self._multiplier = 1.0
        self._reported: list[torch.Tensor] = []
        self.wall_s = 0.0          # schedule-step wall time since the last reset_measurement (measure = True)

    def set_objective(self, objective) -> None:
        """The last stage computes the loss itself: next-token cross-entropy (pretraining, SFT) with the
        objective's z-loss weight. Other objectives (DPO's paired sequences) are refused, naming the objective."""
        if getattr(objective, "name", None) not in ("pretrain", "sft"):
            raise ConfigError(f"parallel.pp > 1: the {getattr(objective, 'name', objective)!r} objective is not "
                              f"available under pipeline parallelism (pretrain and sft are)")
        for m in self.modules:
            m.z_loss = float(getattr(objective, "z_loss", 0.0))

    def _schedule_for(self, n_microbatches: int):
        """The schedule for ``n_microbatches`` pipeline microbatches (one per count, built when first needed)."""
        if n_microbatches not in self._schedules:
            cls = _schedule_class(self.pc.pp_schedule)
            target = self.stages if self.pc.pp_schedule in MULTI_STAGE_SCHEDULES else self.stages[0]
            # scale_grads=False: the loss function already divides by the micro-batch's token count (torch
            # versions without the argument never rescale)
            extra = {"scale_grads": False} if "scale_grads" in inspect.signature(cls.__init__).parameters else {}
            self._schedules[n_microbatches] = cls(target, n_microbatches=n_microbatches, loss_fn=self._loss, **extra)
        self.n_microbatches = n_microbatches
        n_stages = len(self.layout)
        for sid, m in zip(self.stage_ids, self.modules):
            if m.graphed is not None:
                m.graphed.max_slots = max(m.graphed.max_slots,
                                          graph_slots(self.pc.pp_schedule, n_stages, sid, n_microbatches))
        return self._schedules[n_microbatches]

    def _enable_graphs(self) -> None:
        """Every stage's block stack replayed through CUDA graphs (``pp_graphs.py``); slots per stage are set
        from the schedule when the number of microbatches is known (:meth:`_schedule_for`)."""
        from zero2all.distributed.pp_graphs import GraphedBlocks

        check_pipeline_graphs(self.pc, self.dims.shape, self.env.device, self.modules[0].cfg.ops.linear_precision)
        self._cast_store = {}
        for m in self.modules:
            m.graphed = GraphedBlocks(m.run_blocks, list(m.layers.parameters()), max_slots=1)

    def graphed_blocks(self) -> list:
        """This rank's ``pp_graphs.GraphedBlocks`` (one per stage; empty without ``pp_cuda_graphs``)."""
        return [m.graphed for m in self.modules if m.graphed is not None]

    def _shard(self, param_dtype: torch.dtype) -> None:
        """FSDP2 over the dp dimension: every block one unit, then each stage's root (embedding, norm, head)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy() if param_dtype in (torch.float32, torch.float64) else \
            MixedPrecisionPolicy(param_dtype=param_dtype,
                                 reduce_dtype=torch.float32 if self.pc.fsdp_reduce_fp32 else param_dtype)
        d = self.dims
        dp_mesh = d.mesh["dp_replicate", "dp_shard_cp"] if d.enabled("dp_replicate") else d["dp_shard_cp"]
        for m in self.modules:
            for block in m.layers.values():
                fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=self.pc.reshard_after_forward)
            fully_shard(m, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=self.pc.reshard_after_forward)

    # -- loss ---------------------------------------------------------------------------------------------------
    def _loss(self, output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage. ``output`` is the microbatch's token-loss sum; its
        ``target`` chunk ``weight`` holds, per row, 1 / (valid tokens of the micro-batch the row belongs to), so
        the microbatches of a micro-batch add up to its token mean; times the trainer's multiplier (loss scale /
        grad_accum_steps). The unscaled value is kept for the report."""
        mean_share = output.sum() * weight[0]
        self._reported.append(mean_share.detach())
        return mean_share * self._multiplier

    def _prepare(self, batches: list[dict]) -> tuple:
        """The micro-batches of an update as one pipeline batch: inputs, labels and extra keyword inputs
        concatenated, per-row loss weights, and the number of pipeline microbatches (``pp_microbatches`` per
        micro-batch, 0 = one sequence each). One host read: every micro-batch's valid-token count."""
        rows = batches[0]["input_ids"].size(0)
        m = self.pc.pp_microbatches or rows
        if rows % m or any(b["input_ids"].size(0) != rows for b in batches):
            raise ConfigError(f"parallel.pp_microbatches={m} does not divide every micro-batch of {rows} sequences")
        labels = torch.cat([b["labels"] for b in batches])
        per_chunk = (labels != -100).reshape(len(batches) * m, -1).sum(1).tolist()
        per_batch = [sum(per_chunk[i * m:(i + 1) * m]) for i in range(len(batches))]
        weight = torch.tensor([1.0 / max(n, 1) for n in per_batch], device=labels.device).repeat_interleave(rows)
        for module in self.modules:
            module.every_chunk_valid = min(per_chunk) > 0
        kwargs = {k: torch.cat([b[k] for b in batches]) for k in ("doc_ids", "position_ids")
                  if batches[0].get(k) is not None}
        kwargs["loss_weight"] = weight   # every stage weighs its MoE terms by it (the last: the target)
        return torch.cat([b["input_ids"] for b in batches]), labels, weight, kwargs, len(batches) * m

    def step(self, batches: list[dict], multiplier: float) -> torch.Tensor:
        """Forward and backward of an update's micro-batches as ONE pipeline schedule (gradient accumulation
        expressed as microbatches: grad_accum_steps x pp_microbatches of them, so the pipeline fills and drains
        once per update). Returns the sum of the micro-batches' mean token losses on the last stage's rank, 0
        elsewhere, plus the MoE auxiliary losses of this rank's stages (:meth:`from_last_stage` sums the pipeline's
        shares on every rank)."""
        tokens, labels, weight, kwargs, n_micro = self._prepare(batches)
        self._multiplier = multiplier
        self._reported = []
        for m in self.modules:
            m.multiplier, m.aux_reported = multiplier, []
        schedule = self._schedule_for(n_micro)
        if self.timer.measure:
            self._sync()
            t0 = time.perf_counter()
        if self._cast_store:   # CUDA graphs read these copies: the weights changed in the last optimizer step
            from zero2all.kernels.eager import refresh_weight_casts

            refresh_weight_casts(self._cast_store)
        for g in self.graphed_blocks():   # the first step of a schedule runs eagerly: torch's runtime infers its
            g.enabled = n_micro in self._graphed_counts   # shapes then (one forward without a backward)
            g.begin_step()
        with self._loss_context(), ops.weight_cast_cache(self._cast_store):  # weights fixed until the optimizer
            schedule.step(*self._first_stage_args(tokens), target=weight, labels=labels, **kwargs)
        for g in self.graphed_blocks():
            g.finish_step()
        self._graphed_counts.add(n_micro)
        if self.timer.measure:
            self._sync()
            self.wall_s += time.perf_counter() - t0
        total = self._reported_sum(tokens.device)
        for m in self.modules:   # MoE auxiliary losses of this rank's stages (the last n_micro forwards are real)
            if m.aux_reported:
                total = total + torch.stack(m.aux_reported[-n_micro:]).sum().to(total.device)
            m.aux_reported = []
        return total

    def _first_stage_args(self, tokens: torch.Tensor) -> tuple:
        """The positional inputs of a schedule step: the tokens on the rank holding the first stage, nothing
        elsewhere (the other stages receive activations; older torch versions refuse inputs there)."""
        return (tokens,) if 0 in self.stage_ids else ()

    def _loss_context(self):
        """Tensor parallel: the last stage's cross-entropy of vocab-sharded logits, forward and backward."""
        if not self.dims.enabled("tp"):
            return contextlib.nullcontext()
        from zero2all.distributed.tp import loss_parallel_context

        return loss_parallel_context()

    def _sync(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    def _reported_sum(self, device) -> torch.Tensor:
        """The sum of the microbatches' shares; on the first step the runtime's shape inference also runs the
        loss function (on placeholder tensors) before the real microbatches: only the last M values count."""
        if not self._reported:
            return torch.zeros((), device=device)
        return torch.stack(self._reported[-self.n_microbatches:]).sum()

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> torch.Tensor:
        """Forward-only pipeline pass: the micro-batch's mean token loss on every rank."""
        tokens, labels, weight, kwargs, n_micro = self._prepare([batch])
        self._multiplier = 1.0
        self._reported = []
        schedule = self._schedule_for(n_micro)
        if not hasattr(schedule, "eval"):
            raise ConfigError(f"validation under parallel.pp > 1 needs a torch whose pipeline schedules have eval() "
                              f"(this is {torch.__version__}); set train.eval_batches = 0")
        with self._loss_context(), ops.weight_cast_cache():
            schedule.eval(*self._first_stage_args(tokens), target=weight, labels=labels, **kwargs)
        return self.from_last_stage(self._reported_sum(tokens.device))

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """The pipeline's loss on every rank: the sum over the pp group of each rank's share (the last stage's
        cross-entropy, every stage's MoE auxiliary losses; 0 elsewhere)."""
        t = value.detach().to(torch.float64).reshape(1).clone()  # one dtype on every rank, whatever computed it
        with collective_timeout(self.env, "all-reduce of the loss over the pipeline stages"):
            dist.all_reduce(t, group=self.pp_group)
        return t.reshape(())

    def sum_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the ranks holding the same stages (data / context parallel: the ranks whose
        blocks saw other tokens), e.g. the expert loads of this rank's MoE blocks."""
        if not self.dims.enabled("dp_cp"):
            return t
        t = t.detach().clone()
        with collective_timeout(self.env, "all-reduce of the MoE statistics over the data-parallel ranks"):
            dist.all_reduce(t, group=self.dims["dp_cp"].get_group())
        return t

    def gather_from_stages(self, metrics: dict) -> dict:
        """The union of every stage's ``metrics`` (per-layer entries: each rank has its own blocks') on every rank
        of the pipeline."""
        parts: list = [None] * dist.get_world_size(self.pp_group)
        with collective_timeout(self.env, "gathering metrics from the pipeline stages"):
            dist.all_gather_object(parts, metrics, group=self.pp_group)
        merged: dict = {}
        for part in parts:
            merged.update(part or {})
        return dict(sorted(merged.items()))

    # -- gradients ------------------------------------------------------------------------------------------------
    def grad_norm_and_clip(self, params, max_norm: float) -> torch.Tensor:
        """The global gradient norm over every stage (and FSDP shard): each rank's squared norm summed over the pp
        group, then ``min(1, max_norm / (norm + 1e-6))`` applied to every gradient (``clip_grad_norm_``'s rule)."""
        from zero2all.distributed.mesh import mesh_grad_norm_and_clip, needs_mesh_norm

        params = [p for p in params if p.grad is not None]
        if needs_mesh_norm(params):  # tp shards / FSDP 2-D shards / partial sums: per-layout norms
            local = mesh_grad_norm_and_clip(params, 0.0)
        else:
            local = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
            local = local.full_tensor() if hasattr(local, "full_tensor") else local
        grads = [p.grad for p in params]
        sq = (local.double() ** 2).reshape(1).to(self.env.device)
        with collective_timeout(self.env, "all-reduce of the gradient norm over the pipeline stages"):
            dist.all_reduce(sq, group=self.pp_group)
        norm = sq.sqrt().reshape(())
        if max_norm > 0:
            coef = min(1.0, max_norm / (float(norm) + 1e-6))
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return norm

    # -- measurement ----------------------------------------------------------------------------------------------
    def reset_measurement(self) -> None:
        """Start measuring: every following :meth:`step` is timed (wall clock around the schedule step, busy time
        inside the stage computations) until :meth:`measured_bubble` is read."""
        self.timer.measure = True
        self.timer.reset()
        self.wall_s = 0.0

    def measured_bubble(self) -> float:
        """1 - (this rank's busy time in stage forward / backward computations) / (wall time of the schedule
        steps) since :meth:`reset_measurement`: the idle share of the pipeline on this rank, to compare with
        :meth:`ideal_bubble`. Point-to-point waits and transfers count as idle."""
        busy = self.timer.busy_s()
        return max(0.0, 1.0 - busy / self.wall_s) if self.wall_s > 0 else 0.0

    def ideal_bubble(self) -> float:
        from zero2all.accounting import pipeline_bubble_fraction

        return pipeline_bubble_fraction(self.pc.pp, self.n_microbatches, self.pc.pp_stages_per_rank)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on global rank 0 (CPU tensors; every rank takes part), None elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        with collective_timeout(self.env, "gathering the full model from the pipeline stages"):
            full = self.sharded or self.dims.enabled("tp")  # DTensors: gathered whole on every rank of the group
            sd = get_model_state_dict(self.plain, options=StateDictOptions(full_state_dict=full))
            sd = {k: v.detach().cpu() for k, v in sd.items()}
            # one copy per stage: the first rank of each stage's data-parallel group sends its tensors
            first = self.dims.rank("dp") == 0 and self.dims.rank("cp") == 0 and self.dims.rank("tp") == 0
            parts: list = [None] * self.env.world_size
            dist.all_gather_object(parts, sd if first else None)
        if not self.env.is_main:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part or {})
        return merged


def _reason(check, *args) -> list[str]:
    """A raising check as a declared rule: its ConfigError's sentence, or nothing."""
    try:
        check(*args)
    except ConfigError as e:
        return [str(e)]
    return []


def refusals(req) -> list[str]:
    """Pipeline parallelism's declared rules (``plan.resolve``): a block for every stage, at least as many
    pipeline microbatches as stages, dividing each micro-batch; untied embedding and head; no cp; the schedule's
    and the CUDA graphs' own limits (:func:`check_pipeline_mesh`, :func:`check_pipeline_graphs`)."""
    pc, model, p, out = req.parallel, req.model, req.parallel.pp, []
    if pc.pp_stages_per_rank > 1 and pc.pp_schedule not in MULTI_STAGE_SCHEDULES:
        out.append(f"parallel.pp_stages_per_rank={pc.pp_stages_per_rank} needs parallel.pp_schedule = "
                   f"{' or '.join(MULTI_STAGE_SCHEDULES)} (got {pc.pp_schedule!r})")
    if pc.pp_cuda_graphs is True and (p == 1 or pc.pp_schedule == "zero_bubble"):
        out.append(f"parallel.pp_cuda_graphs needs parallel.pp > 1 and a schedule other than zero_bubble (got pp={p}, "
                   f"pp_schedule={pc.pp_schedule!r}): the graphs replay whole block forwards and backwards, "
                   f"zero_bubble splits a backward in two")
    if p == 1:
        if pc.pp_split:
            out.append(f"parallel.pp_split={list(pc.pp_split)} needs parallel.pp > 1")
        return out
    if pc.cp > 1:
        out.append(f"parallel.pp={p} with cp={pc.cp}: pipeline stages are not combined with context parallelism in "
                   f"this version; use one of the two")
    shape = req.shape or {d: req.size(d) for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    out += _reason(check_pipeline_mesh, pc, shape)
    stages = p * pc.pp_stages_per_rank
    if model is not None:
        out += _reason(check_pipeline_model, model)
        if model.n_layers < stages:
            out.append(f"parallel: {stages} pipeline stages (pp={p} x pp_stages_per_rank={pc.pp_stages_per_rank}) "
                       f"but model.n_layers={model.n_layers}; use fewer stages")
        split = list(pc.pp_split)
        if split and (len(split) != stages or min(split) < 1 or sum(split) != model.n_layers):
            out.append(f"parallel.pp_split={split}: needs {stages} block counts (pp={p} x pp_stages_per_rank="
                       f"{pc.pp_stages_per_rank}), each >= 1, summing to model.n_layers={model.n_layers} (got "
                       f"{len(split)} summing to {sum(split)})")
        if pc.pp_cuda_graphs is True and model.moe.enabled:
            out.append("parallel.pp_cuda_graphs = true with a MoE model: mixture-of-experts blocks route a varying "
                       "number of tokens per expert, which a graph replay cannot follow; set it to false or auto")
        if pc.pp_cuda_graphs is True and req.device is not None:
            out += _reason(check_pipeline_graphs, pc, shape, req.device, model.ops.linear_precision)
    batch = req.train.micro_batch_size if req.train is not None else pc.pp_microbatches
    micro = pc.pp_microbatches or batch
    if batch and batch % micro:
        out.append(f"parallel.pp_microbatches={micro} does not divide train.micro_batch_size={batch}")
    if micro and micro < stages:
        out.append(f"parallel.pp_microbatches={micro} is fewer than the {stages} pipeline stages (0 means "
                   f"train.micro_batch_size={batch})")
    if req.train is not None and req.train.z_loss and pc.tp > 1:
        out.append("train.z_loss with parallel.pp and parallel.tp: not available (loss parallel computes the "
                   "cross-entropy only); set train.z_loss = 0")
    return out
