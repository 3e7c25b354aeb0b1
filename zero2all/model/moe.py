"""Mixture of experts: the router, token permutation and the MoE block (shared + routed experts).

A MoE layer replaces a block's dense MLP (``model.moe``, ``MoEConfig``). For the N tokens x (N, H) of a batch::

    logits  = x Wr^T                                   (N, E), float32
    softmax_topk:  p = softmax(logits); (w, idx) = topk(p, k); w /= sum(w) if renormalize     (Mixtral)
    sigmoid:       s = sigmoid(logits); idx = topk(s + b, k); w = s[idx] / sum(s[idx])        (DeepSeek-V3)
    y = shared(x) [* sigmoid(x wg)]  +  routed_scaling * sum_j w_j * expert_{idx_j}(x)

The bias b of the sigmoid router is used for the selection only and carries no gradient; after each optimizer
step it moves against the expert's load error (aux-loss-free balancing, DeepSeek-V3 sec 2.1.2; :meth:`MoE.update_bias`).

Auxiliary losses (added to the training loss by the model, their weights in the config):
- load balancing (Switch / GShard): ``aux = E * sum_e f_e * P_e``, f_e the fraction of the N*k assignments that go
  to expert e, P_e the mean router probability of e; 1 when perfectly balanced.
- sequence-wise load balancing (DeepSeek-V3): the same within each sequence, averaged over the sequences; beside
  the bias, it asks every sequence to be balanced, so that no mix of sequences' content overloads an expert.
- router z-loss (ST-MoE): ``mean(logsumexp(logits)^2)``, keeps the logits small.

Permutation: the N*k (token, expert) assignments are sorted by expert (stable, so each expert sees its tokens in
order), the rows gathered into x_sorted, the experts run on contiguous row ranges (``kernels/grouped_gemm.py``),
and the outputs scattered back to their (token, slot) place and summed over the k slots with the router weights.
With ``capacity_factor`` c > 0 an expert keeps at most ceil(c N k / E) of its assignments (the first ones in
token order); the others are dropped (their slot contributes zero; the residual stream carries the token on) and
the dropped fraction is counted. Dropless (c = 0) is the default.

Expert parallelism (``distributed/ep.py``) swaps the :class:`LocalDispatch` for one that exchanges the sorted
rows between ranks with all-to-all; this file knows nothing else of it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero2all.config import ModelConfig
from zero2all.kernels.grouped_gemm import grouped_swiglu_mlp
from zero2all.model import ops


@dataclass
class Routing:
    """One forward's routing: weights (N, k) float32, experts (N, k) int64, logits (N, E) float32, probs (N, E)."""

    weights: torch.Tensor
    experts: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.moe = m
        self.weight = nn.Parameter(torch.empty(m.n_experts, cfg.hidden_dim))
        # sigmoid router: the selection bias (a buffer: no gradient, saved with the model)
        self.register_buffer("expert_bias", torch.zeros(m.n_experts), persistent=m.router == "sigmoid")
        self.base_counts: torch.Tensor | None = None  # with balance_iters: the last forward's load under expert_bias

    def forward(self, x: torch.Tensor) -> Routing:
        m = self.moe
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(ops.upcast(x), ops.upcast(self.weight))                    # (N, E)
        if m.router == "softmax_topk":
            probs = logits.softmax(dim=-1)
            weights, experts = probs.topk(m.top_k, dim=-1)
            if m.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            probs = torch.sigmoid(logits)
            bias = self.expert_bias
            self.base_counts = None
            if self.training and m.balance_iters:
                with torch.no_grad():
                    # the running bias's own load (what update_bias corrects), then this batch's refinement
                    self.base_counts = expert_counts((probs + bias).topk(m.top_k, dim=-1).indices, m.n_experts)
                    bias = balanced_bias(probs, bias, m.top_k, m.balance_iters)
            _, experts = (probs + bias).topk(m.top_k, dim=-1)
            weights = probs.gather(1, experts)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights, experts, logits, probs)


@torch.no_grad()
def balanced_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, iters: int, damping: float = 0.7
                  ) -> torch.Tensor:
    """A selection bias that gives each expert (nearly) the same number of this batch's N*k assignments
    (``model.moe.balance_iters``), searched from ``bias`` in ``iters`` rounds.

    Token t picks expert e iff s_te + b_e beats its rival r_te: the k-th largest biased score of t when e is not
    among its top k, else the (k+1)-th (the expert that e's leaving would let in). With the margins
    m_te = s_te - r_te, expert e keeps exactly n tokens when -b_e lies between the n-th and (n+1)-th largest
    margins of its column, n = N*k/E. Each round moves every b_e ``damping`` of the way there at once, the rivals
    taken from the current biases (a damped Jacobi step: undamped steps can oscillate when the scores cluster, as
    a language model's do), and the bias of the best round (lowest largest load) is returned, so the result is
    never worse than ``bias``. Ties aside, the selection stays top-k of scores + bias: the weights are the
    unbiased scores as before, and no token is dropped."""
    N, E = scores.shape
    if N < 2 or k >= E or iters <= 0:
        return bias
    n = min(N - 1, max(1, round(N * k / E)))
    s = scores.float()
    b = bias.float().clone()
    best, best_max = b, None
    for i in range(iters + 1):
        biased = s + b
        top = biased.topk(k + 1, dim=-1).values
        chosen = biased >= top[:, k - 1:k]
        largest = chosen.sum(0).max()
        if best_max is None:
            best, best_max = b, largest
        else:   # no host sync: the comparison stays on the device
            better = largest < best_max
            best, best_max = torch.where(better, b, best), torch.minimum(largest, best_max)
        if i == iters:
            break
        margin = s - torch.where(chosen, top[:, k:k + 1], top[:, k - 1:k])
        hi, lo = _nth_largest(margin, n)
        b = b + damping * (-(hi + lo) / 2 - b)
    return best.to(bias.dtype)


EDGE_METHOD = "topk"   # how balanced_bias finds each column's n-th / (n+1)-th largest margin: sort | topk | kthvalue


def _nth_largest(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n-th and (n+1)-th largest values of each column of ``x`` (N, E), n < N (the same values by every
    method; ``benchmarks/moe_balance_solve_time.py`` times them)."""
    if EDGE_METHOD == "topk":
        v = x.topk(n + 1, dim=0).values
        return v[n - 1], v[n]
    if EDGE_METHOD == "kthvalue":
        N = x.shape[0]
        return x.kthvalue(N - n + 1, dim=0).values, x.kthvalue(N - n, dim=0).values
    v = x.t().contiguous().sort(dim=-1, descending=True).values       # rows: one segmented sort per expert
    return v[:, n - 1], v[:, n]


def load_balancing_loss(routing: Routing, n_experts: int, groups: int = 1) -> torch.Tensor:
    """Switch / GShard: E * sum_e f_e P_e (f from the hard assignments, no gradient; P carries it), computed
    within each of ``groups`` equal runs of tokens and averaged over them.

    ``groups = 1``: over the whole micro-batch (Switch / GShard). ``groups = B``, one group per sequence: the
    complementary sequence-wise balance loss of DeepSeek-V3 (sec. 2.1.2), which asks every *sequence* to spread
    its tokens over the experts, whatever mix of them a batch holds, where a batch-wise loss (and the bias, which
    acts between steps) balances only the average batch. Like the batch-wise loss it is also lowered by flatter
    scores P, which do not move the hard assignments: keep its weight small."""
    N, k = routing.experts.shape
    group = torch.arange(N, device=routing.experts.device).div_(N // groups, rounding_mode="floor")
    slot = (group[:, None] * n_experts + routing.experts).reshape(-1)            # (group, expert) of each slot
    f = expert_counts(slot, groups * n_experts).view(groups, n_experts).to(routing.probs.dtype) / (k * (N // groups))
    probs = routing.probs / routing.probs.sum(-1, keepdim=True)  # sigmoid scores normalised like softmax's
    return n_experts * (f * probs.view(groups, N // groups, n_experts).mean(1)).sum(-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """ceil(c * N * k / E): the assignments one expert keeps when ``capacity_factor`` c > 0."""
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert, (E,) int64, without a host sync (``bincount`` reads the maximum on the host; a
    scatter-add keeps decoding capturable in a CUDA graph)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


@dataclass
class Permutation:
    """Assignments sorted by expert: ``order`` indexes the flat (token, slot) list (the kept ones), ``counts`` (E,)
    per expert after drops, ``n_assignments`` = N k before drops."""

    order: torch.Tensor
    counts: torch.Tensor
    n_assignments: int


def permute(experts: torch.Tensor, n_experts: int, capacity: int = 0, counts: torch.Tensor | None = None
            ) -> Permutation:
    """Sort the flat assignments by expert (stable); with ``capacity`` > 0 keep each expert's first ``capacity``.
    ``counts``: the assignments per expert before drops when already computed (:func:`expert_counts`)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, n_experts) if counts is None else counts
    if capacity:
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        order = order[rank_in_expert < capacity]
        counts = counts.clamp(max=capacity)
    return Permutation(order, counts, flat.numel())


class _GatherRows(torch.autograd.Function):
    """``out[r] = x[order[r] // k]``: each token's row once per kept (token, slot) assignment, in expert order.

    Plain indexing (``x[idx]``) has a scatter-add backward that sorts the indices (a radix sort and an
    ``index_put`` per MoE layer). The structure is known here: ``order`` lists distinct (token, slot) positions,
    so the backward writes each gradient row to its own slot and sums a token's k slots, with no sort and no
    atomics: ``dx = sum_j scatter(g, order)[:, j]``. Dropped slots (capacity) stay zero."""

    @staticmethod
    def forward(ctx, x, order, k):
        ctx.save_for_backward(order)
        ctx.k, ctx.n = k, x.shape[0]
        return x.index_select(0, order // k if k > 1 else order)

    @staticmethod
    def backward(ctx, g):
        (order,) = ctx.saved_tensors
        full = g.new_zeros(ctx.n * ctx.k, g.shape[-1]).index_copy_(0, order, g)
        return (full.view(ctx.n, ctx.k, -1).sum(1) if ctx.k > 1 else full), None, None


def gather_rows(x: torch.Tensor, order: torch.Tensor, k: int = 1) -> torch.Tensor:
    """Rows ``x[order // k]`` for distinct slot indices ``order`` (a permutation of rows when k = 1), with a
    sort-free backward (:class:`_GatherRows`)."""
    return _GatherRows.apply(x, order, k)


def unpermute(y_sorted: torch.Tensor, perm: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """Scatter expert outputs back to their (token, slot) place, weight them and sum the k slots: (N, H).
    Dropped assignments contribute zero."""
    N, k = weights.shape
    full = y_sorted.new_zeros(perm.n_assignments, y_sorted.shape[-1])
    full = full.index_copy(0, perm.order, y_sorted)
    return (full.view(N, k, -1) * weights.unsqueeze(-1).to(full.dtype)).sum(1)


class LocalDispatch:
    """All experts on this process: run the grouped MLP on the expert-sorted rows as they are.

    A dispatch works in two calls: ``plan(counts)`` as soon as the per-expert counts exist (expert parallelism
    starts its exchange of split sizes there, so the rest of the layer's launches overlap it), then
    ``dispatch(moe, x_sorted, plan)`` runs the experts."""

    def plan(self, counts: torch.Tensor) -> torch.Tensor:
        return counts

    def __call__(self, moe: "MoE", x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return moe.experts(x_sorted, counts)


class Experts(nn.Module):
    """E SwiGLU MLPs as two stacked tensors in ``nn.Linear`` layout: gate_up_proj (E, 2I, H) = [gate | up] rows,
    down_proj (E, H, I) (the layout of transformers 5's MixtralExperts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.moe.n_experts, cfg.hidden_dim, cfg.expert_intermediate_size
        self.cfg = cfg
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.grad_scale = 1.0  # set by expert parallelism (distributed/ep.py)
        self.compute_dtype: torch.dtype | None = None  # ep without FSDP on the experts: their bf16 cast

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights of the experts this process holds (a DTensor's local shard under expert parallelism)."""
        w1, w2 = self.gate_up_proj, self.down_proj
        if hasattr(w1, "to_local"):
            w1, w2 = w1.to_local(), w2.to_local()
        if self.grad_scale != 1.0:
            w1, w2 = _ScaleGrad.apply(w1, self.grad_scale), _ScaleGrad.apply(w2, self.grad_scale)
        if self.compute_dtype is not None:
            w1, w2 = w1.to(self.compute_dtype), w2.to(self.compute_dtype)
        return w1, w2

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.local_weights()
        return grouped_swiglu_mlp(x_sorted, counts, w1, w2, impl=self.cfg.ops.grouped_gemm)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale`` (expert parallelism: an expert's gradient is the
    sum over the ranks that sent it tokens, each rank's loss a mean over its own tokens)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class SharedExperts(nn.Module):
    """The always-on experts (DeepSeek): n_shared experts of size I fused into one SwiGLU MLP of n_shared * I."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        inter = cfg.moe.n_shared_experts * cfg.expert_intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_dim, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_dim, bias=False)

    def forward(self, x):
        from zero2all.model import ops

        return self.down_proj(ops.swiglu(self.gate_up_proj(x), impl=self.cfg.ops.swiglu))


class MoE(nn.Module):
    """The MoE block: (B, T, H) -> (B, T, H). After each training forward, ``aux_loss`` holds the weighted
    auxiliary losses of that forward (a tensor with gradient, or None); the buffers ``load`` (read by
    :func:`moe_window_metrics`), ``step_load`` (read by :func:`update_router_biases`) and ``sums`` count since their
    last read. ``dispatch`` runs the experts: locally, or across ranks under expert parallelism."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        m = cfg.moe
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared = SharedExperts(cfg) if m.n_shared_experts else None
        self.shared_gate = nn.Linear(cfg.hidden_dim, 1, bias=False) if m.shared_expert_gate else None
        self.dispatch = LocalDispatch()
        self.aux_loss: torch.Tensor | None = None
        # running sums since the last read (metrics) / bias update: tokens per expert, dropped, aux terms
        self.register_buffer("load", torch.zeros(m.n_experts), persistent=False)
        self.register_buffer("step_load", torch.zeros(m.n_experts), persistent=False)
        # the load under the running bias alone, which update_bias corrects (= step_load unless balance_iters)
        self.register_buffer("bias_load", torch.zeros(m.n_experts), persistent=False)
        # [aux loss, z-loss, dropped, assignments, forwards, sequence-wise aux loss]
        self.register_buffer("sums", torch.zeros(6), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.cfg.moe
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        routing = self.router(flat)
        capacity = expert_capacity(flat.size(0), m.top_k, m.n_experts, m.capacity_factor) if m.capacity_factor \
            else 0
        # expert parallelism: the split-size exchange starts right after the router, before the sort
        counts = expert_counts(routing.experts, m.n_experts)
        plan = self.dispatch.plan(counts.clamp(max=capacity) if capacity else counts)
        # work that does not need the exchange's result is launched before the dispatch waits for it
        perm = permute(routing.experts, m.n_experts, capacity, counts)
        x_sorted = gather_rows(flat, perm.order, m.top_k)
        self._account(routing, perm, B)
        s = None
        if self.shared is not None:
            s = self.shared(flat)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(flat)) * s
        y_sorted = self.dispatch(self, x_sorted, plan)
        out = unpermute(y_sorted, perm, routing.weights)
        if m.routed_scaling != 1.0:
            out = out * m.routed_scaling
        if s is not None:
            out = out + s
        return out.view(B, T, H).to(x.dtype)

    def _account(self, routing: Routing, perm: Permutation, batch: int) -> None:
        """This forward's weighted auxiliary losses into ``aux_loss``; in training, the window's statistics."""
        m = self.cfg.moe
        self.aux_loss = None
        if not self.training:
            return
        aux = load_balancing_loss(routing, m.n_experts)
        seq_aux = load_balancing_loss(routing, m.n_experts, batch) if m.seq_aux_loss_coef else aux.new_zeros(())
        z = router_z_loss(routing.logits)
        terms = [c * t for c, t in ((m.aux_loss_coef, aux), (m.seq_aux_loss_coef, seq_aux), (m.z_loss_coef, z)) if c]
        if terms:
            self.aux_loss = sum(terms[1:], terms[0])
        with torch.no_grad():
            counts = perm.counts.float()
            self.load += counts
            self.step_load += counts
            base = self.router.base_counts
            self.bias_load += counts if base is None else base.float()
            dropped = float(perm.n_assignments - perm.order.numel())
            # new_full fills on the device: new_tensor would copy from the host and wait for the GPU
            self.sums += torch.stack([aux.detach(), z.detach(), aux.new_full((), dropped),
                                      aux.new_full((), float(perm.n_assignments)), aux.new_full((), 1.0),
                                      seq_aux.detach()])

    @torch.no_grad()
    def update_bias(self, step_load: torch.Tensor) -> None:
        """Aux-loss-free balancing (sigmoid router), with the step's load l_e and its mean l̄:

            sign:   b_e += rate * sign(l̄ - l_e)                         (DeepSeek-V3)
            error:  b_e += rate * clip((l̄ - l_e) / l̄, -1, 1)

        The sign rule moves every bias by the full rate at every step, balanced or not: it settles into an
        oscillation of that amplitude, and a rate small enough for a quiet oscillation is too slow to follow the
        router weights while they move fast (early training, a high learning rate). The error rule is a
        proportional controller: large corrections for large imbalances, vanishing ones near balance."""
        m = self.cfg.moe
        if m.router != "sigmoid":
            return
        mean = step_load.mean()
        if m.bias_update == "sign":
            step = torch.sign(mean - step_load)
        else:
            step = ((mean - step_load) / mean.clamp_min(1.0)).clamp(-1.0, 1.0)
        self.router.expert_bias += m.bias_update_rate * step


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(layer index, MoE block) of every MoE layer of ``model`` (unwrapped or not)."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            parts = [p for p in name.split(".") if p.isdigit()]
            out.append((int(parts[0]) if parts else len(out), module))
    return out


@torch.no_grad()
def update_router_biases(model: nn.Module, all_reduce=None) -> None:
    """After an optimizer step: each sigmoid router's bias moves against its layer's load over the step (summed
    over the data-parallel ranks by ``all_reduce`` when given); the step's load counters restart. With
    ``balance_iters`` the load is the one the running bias alone would have given (the batches themselves were
    balanced by :func:`balanced_bias`), so that the running bias, used at evaluation and inference, keeps
    following the router."""
    for _, moe in moe_layers(model):
        load = moe.bias_load if all_reduce is None else all_reduce(moe.bias_load.clone())
        moe.update_bias(load)
        moe.step_load.zero_()
        moe.bias_load.zero_()


@torch.no_grad()
def moe_window_metrics(model: nn.Module, all_reduce_sum=None) -> dict[str, float]:
    """Per MoE layer i, over the training forwards since the last call (summed over ranks by ``all_reduce_sum``),
    then the counters restart::

        moe/layer{i}/load_max, load_min   max_e / mean, min_e / mean of the tokens per expert (1 = balanced)
        moe/layer{i}/load_entropy         -sum p_e log p_e / log E of the load shares (1 = uniform)
        moe/layer{i}/aux_loss, z_loss     mean unweighted load-balancing loss and router z-loss per forward
        moe/layer{i}/seq_aux_loss         the same of the sequence-wise balance loss (when its weight is set)
        moe/layer{i}/dropped              fraction of the (token, expert) assignments dropped by the capacity
    """
    out = {}
    for i, moe in moe_layers(model):
        load, sums = moe.load.clone().double(), moe.sums.clone().double()
        if all_reduce_sum is not None:
            load, sums = all_reduce_sum(load), all_reduce_sum(sums)
        moe.load.zero_()
        moe.sums.zero_()
        if load.sum() <= 0:
            continue
        mean, share = load.mean(), load / load.sum()
        entropy = -(share * share.clamp_min(1e-30).log()).sum() / math.log(load.numel())
        forwards = max(float(sums[4]), 1.0)
        key = f"moe/layer{i}"
        out.update({f"{key}/load_max": float(load.max() / mean), f"{key}/load_min": float(load.min() / mean),
                    f"{key}/load_entropy": float(entropy), f"{key}/aux_loss": float(sums[0]) / forwards,
                    f"{key}/z_loss": float(sums[1]) / forwards,
                    f"{key}/dropped": float(sums[2]) / max(float(sums[3]), 1.0)})
        if moe.cfg.moe.seq_aux_loss_coef:
            out[f"{key}/seq_aux_loss"] = float(sums[5]) / forwards
    return out


@contextlib.contextmanager
def statistics_kept(model: nn.Module):
    """Forwards inside this context (timing runs, a pipeline runtime's shape inference) leave the MoE blocks' load
    counters and window sums as they were."""
    saved = [(b, b.clone()) for _, moe in moe_layers(model) for b in moe.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, old in saved:
                b.copy_(old)


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the last forward's auxiliary losses over the MoE layers (None when there are none)."""
    total = None
    for _, moe in moe_layers(model):
        if moe.aux_loss is not None:
            total = moe.aux_loss if total is None else total + moe.aux_loss
    return total


class _AttachedLoss(torch.autograd.Function):
    """A copy of ``x`` (not a view: a pipeline stage's outputs are detached in place by the schedule); in backward,
    the gradient of ``weight * loss`` joins the graph through ``loss``."""

    @staticmethod
    def forward(ctx, x, loss, weight):
        ctx.weight = weight
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        w = ctx.weight
        grad_loss = w.detach().to(device=grad.device, dtype=ctx.loss_dtype).expand(ctx.loss_shape).clone() \
            if isinstance(w, torch.Tensor) else torch.full(ctx.loss_shape, w, dtype=ctx.loss_dtype, device=grad.device)
        return grad, grad_loss, None


def attach_loss(x: torch.Tensor, loss: torch.Tensor | None, weight: float | torch.Tensor) -> torch.Tensor:
    """``x`` unchanged, with ``weight * loss`` added to whatever objective ``x``'s gradient comes from: a loss computed
    where the objective is not (a pipeline stage's MoE auxiliary losses, whose objective is on the last stage)
    takes part in the backward pass of the objective without being sent along. ``weight``: a number or a scalar
    tensor (kept on the device: no host read)."""
    if loss is None or not loss.requires_grad or not torch.is_grad_enabled():
        return x
    return _AttachedLoss.apply(x, loss, weight if isinstance(weight, torch.Tensor) else float(weight))


@torch.no_grad()
def init_moe_(moe: MoE, std: float, out_std: float, generator=None) -> None:
    """N(0, std) router and gate|up weights, N(0, out_std) down projections (scaled like the dense MLP's)."""
    moe.router.weight.normal_(0.0, std, generator=generator)
    moe.router.expert_bias.zero_()
    moe.experts.gate_up_proj.normal_(0.0, std, generator=generator)
    moe.experts.down_proj.normal_(0.0, out_std, generator=generator)
