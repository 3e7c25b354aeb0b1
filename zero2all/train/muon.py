"""Muon: orthogonalised momentum for the hidden weight matrices, AdamW for everything else (``train.optimizer =
"muon"``).

For a weight matrix W (out x in) with gradient G, Muon keeps a Nesterov momentum and replaces the update by the
nearest semi-orthogonal matrix to it, i.e. its polar factor U V^T where U S V^T is the update's SVD: every direction
the update has moves by the same amount, instead of a few dominant directions taking all of the step::

    m      <- mu * m + G                       momentum (mu = train.muon_momentum)
    u      =  G + mu * m                       Nesterov
    O      ~  polar(u) = U V^T                 Newton-Schulz (below), per logical matrix
    W      <- W * (1 - lr * wd) - lr * scale(out, in) * O

Newton-Schulz
    The polar factor is approximated by an odd matrix polynomial iterated ``train.muon_ns_steps`` times on
    X_0 = u / ||u||_F (so every singular value starts in (0, 1]):  A = X X^T,  X <- a X + (b A + c A^2) X.
    On the singular values this is s <- a s + b s^3 + c s^5: the singular vectors stay exactly those of u. With the
    quintic coefficients (a, b, c) = (3.4445, -4.7750, 2.0315) of K. Jordan's Muon (2024), chosen to pull small
    singular values up fast rather than to converge, five steps bring every singular value of u above 3e-3 of
    its Frobenius norm into [0.68, 1.21]: close enough to U V^T for the optimiser, and cheap (15 matrix products, run
    in bfloat16 on GPUs). The iteration runs on the wider orientation (X X^T the smaller Gram matrix).

Update scale (``train.muon_scale``)
    ``rms`` (default): 0.2 * sqrt(max(out, in)) (J. Liu et al. 2025, "Muon is Scalable for LLM Training"): an
    orthogonal out x in matrix has RMS 1/sqrt(max(out, in)), so the update's RMS becomes 0.2, about AdamW's, and
    Muon can share AdamW's learning rate and weight decay (``train.muon_lr = 0``: use ``train.lr``).
    ``spectral``: sqrt(max(1, out / in)) (Jordan's scaling; pair it with ``train.muon_lr`` ~ 0.02).

Which parameters
    Muon: the 2-D weights inside the transformer blocks (attention and MLP projections; the experts' stacked
    (E, out, in) weights as E matrices), split into their logical matrices where one parameter holds several: the
    fused q/k/v projection into q, k and v, the fused gate/up projection into gate and up. AdamW (the trainer's
    usual two weight-decay groups): embeddings, the LM head, norms, biases and the MoE router.

Batched
    The momentum-corrected updates of all the group's logical matrices are stacked by shape and orthogonalised in
    one batched iteration per shape (e.g. q, k, v, o, gate, up and down of every block: at most a handful of
    shapes), not one matrix at a time: the matrix products are then few and large.

Distributed
    DDP and one process: the gradient is whole. FSDP2 / tensor parallel (DTensor parameters): each rank gathers
    the full momentum-corrected update of a matrix, orthogonalises it (the same result on every rank) and keeps its
    own shard; that costs one all-gather of the update per matrix per step and repeats the iteration on every rank.
    Tensor parallel stores fused parameters rank-major (``distributed/tp.py``): the layouts given to the optimizer
    put the rows back in canonical order before the split. ZeRO-1 is refused (its partitioned optimizer takes
    AdamW's keyword arguments only).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from zero2all.config import ConfigError, TrainConfig

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_SCALES = ("rms", "spectral")


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  dtype: torch.dtype | None = None, eps: float = 1e-7) -> torch.Tensor:
    """The Newton-Schulz approximation of the polar factor of ``g`` (..., m, n): batched over leading dimensions,
    computed in ``dtype`` (default ``g``'s), returned in ``g``'s dtype."""
    a, b, c = coefficients
    x = g.to(dtype or g.dtype)
    wide = x.size(-2) > x.size(-1)
    if wide:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if wide:
        x = x.mT
    return x.to(g.dtype)


def ns_singular_value(s: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS) -> torch.Tensor:
    """What ``newton_schulz`` does to a singular value s of the normalised input: the scalar polynomial iterated."""
    a, b, c = coefficients
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return s


def update_scale(rows: int, cols: int, kind: str) -> float:
    if kind == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    if kind == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    raise ConfigError(f"train.muon_scale: {kind!r} is not one of {', '.join(MUON_SCALES)}")


def orthogonalize(u: torch.Tensor, pieces: tuple[int, ...] | None, steps: int, scale: str,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """``u`` (..., rows, cols) split along the rows into ``pieces`` (None: one matrix), each piece orthogonalised
    and scaled, put back together."""
    parts = u.split(list(pieces), dim=-2) if pieces else (u,)
    return torch.cat([newton_schulz(p, steps, dtype=dtype) * update_scale(p.size(-2), p.size(-1), scale)
                      for p in parts], dim=-2)


def _muon_pieces(name: str, p: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[int, ...] | None:
    """The logical matrices stacked in a fused parameter's rows (global shape), or None for a plain matrix."""
    rows = p.shape[-2]
    if name.endswith("qkv_proj.weight"):
        q = rows * n_heads // (n_heads + 2 * n_kv_heads)
        kv = (rows - q) // 2
        return (q, kv, kv)
    if name.endswith("gate_up_proj") or name.endswith("gate_up_proj.weight"):
        return (rows // 2, rows // 2)
    return None


def is_muon_param(name: str, p: torch.Tensor, module: nn.Module) -> bool:
    """Hidden matrices inside the blocks: 2-D (or the experts' 3-D stacks), not embeddings, head or router."""
    if p.ndim < 2 or isinstance(module, nn.Embedding):
        return False
    parts = name.split(".")
    return "layers" in parts and "router" not in parts


def muon_param_groups(model: nn.Module, tcfg: TrainConfig) -> list[dict]:
    """The Muon group (with each parameter's pieces) first, then the AdamW groups of ``optim.param_groups`` over
    the rest."""
    from zero2all.train.optim import named_trainable, param_groups
    from zero2all.train.trainable import no_decay_modules

    cfg = getattr(model, "cfg", None)
    n_heads, n_kv = (cfg.n_heads, cfg.n_kv_heads) if cfg is not None else (1, 1)
    muon = {"params": [], "names": [], "pieces": [], "kind": "muon", "weight_decay": tcfg.weight_decay,
            "lr_ratio": (tcfg.muon_lr / tcfg.lr) if tcfg.muon_lr > 0 else 1.0}
    for name, _, _, p, module in named_trainable(model):
        if is_muon_param(name, p, module):
            muon["params"].append(p)
            muon["names"].append(name)
            muon["pieces"].append(_muon_pieces(name, p, n_heads, n_kv))
    rest = param_groups(model, tcfg.weight_decay, tcfg.decay_embeddings,
                        no_decay_modules(getattr(tcfg, "trainable", "all")), skip=is_muon_param)
    for g in rest:
        g.update(kind="adamw", lr_ratio=1.0)
    return ([muon] if muon["params"] else []) + rest


class Muon(torch.optim.Optimizer):
    """Muon on the groups of ``kind = "muon"``, AdamW on those of ``kind = "adamw"`` (see the module docstring).

    Every group has ``lr`` (set by the schedule, the same for all groups) and ``lr_ratio``: a group steps with
    ``lr * lr_ratio``, so ``train.muon_lr`` follows the schedule too. ``row_layouts`` maps a parameter to an object
    with ``to_canonical`` / ``to_rank_major`` (tensor parallel's fused rows) used around the split."""

    def __init__(self, groups: list[dict], lr: float, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, scale: str = "rms", betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 ns_dtype: torch.dtype | None = None, row_layouts: dict | None = None):
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"train.muon_momentum: must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ConfigError(f"train.muon_ns_steps: must be >= 1, got {ns_steps}")
        update_scale(1, 1, scale)
        defaults = dict(lr=lr, lr_ratio=1.0, weight_decay=0.0, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, scale=scale, betas=betas, eps=eps, kind="adamw")
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype
        self.row_layouts = row_layouts or {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        """Momentum for every matrix, then ONE batched Newton-Schulz per shape: the logical matrices of all the
        group's parameters (q, k, v, o, gate, up, down of every block, each expert) stacked by (rows, cols), so a
        model of L blocks runs 5 x 3 batched products per distinct shape instead of per matrix."""
        lr = group["lr"] * group["lr_ratio"]
        mu, wd = group["momentum"], group["weight_decay"]
        pieces = group.get("pieces") or [None] * len(group["params"])
        todo = []   # (param, whole update in canonical row order, its parts)
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for p, piece in zip(group["params"], pieces):
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            u = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
            full = self._whole(p, u)
            parts = full.split(list(piece), dim=-2) if piece else (full,)
            for part in parts:
                buckets.setdefault((part.shape[-2], part.shape[-1]), []).append(part.reshape(-1, *part.shape[-2:]))
            todo.append((p, full, parts))
        done: dict[tuple, list[torch.Tensor]] = {}
        for (m, n), mats in buckets.items():
            o = newton_schulz(torch.cat(mats), group["ns_steps"], dtype=self.ns_dtype)
            o = o * update_scale(m, n, group["scale"])
            done[(m, n)] = list(o.split([t.shape[0] for t in mats]))
        for p, full, parts in todo:
            outs = [done[(part.shape[-2], part.shape[-1])].pop(0).reshape(part.shape) for part in parts]
            o = self._to_param_layout(p, torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0])
            if wd:
                p.mul_(1.0 - lr * wd)
            p.add_(o, alpha=-lr)

    def _whole(self, p, u) -> torch.Tensor:
        """The whole update of ``p`` (gathered when sharded), rows in canonical order."""
        from zero2all.model import ops

        full = u.full_tensor() if ops.is_dtensor(u) else u
        layout = self.row_layouts.get(p)
        return layout.to_canonical(full) if layout is not None else full

    def _to_param_layout(self, p, o: torch.Tensor) -> torch.Tensor:
        """``o`` (whole, canonical rows) in ``p``'s layout: rank-major rows, and this rank's shard of a DTensor."""
        from zero2all.model import ops

        layout = self.row_layouts.get(p)
        if layout is not None:
            o = layout.to_rank_major(o)
        if not ops.is_dtensor(p):
            return o
        from torch.distributed.tensor import DTensor, Replicate

        whole = DTensor.from_local(o, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
        return whole.redistribute(p.device_mesh, p.placements)   # Replicate -> Shard: a local slice, no transfer

    def _adamw(self, group: dict) -> None:
        lr = group["lr"] * group["lr_ratio"]
        beta1, beta2 = group["betas"]
        params, grads, ms, vs = [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            params.append(p)
            grads.append(p.grad)
            ms.append(state["exp_avg"])
            vs.append(state["exp_avg_sq"])
        if not params:
            return
        step = float(self.state[params[0]]["step"])
        bias1, bias2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
        torch._foreach_lerp_(ms, grads, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, math.sqrt(bias2))
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(params, ms, denom, value=-lr / bias1)


def build_muon(model: nn.Module, tcfg: TrainConfig, device: torch.device, row_layouts: dict | None = None) -> Muon:
    """``train.optimizer = "muon"``: the optimizer over ``model``'s parameters (names of ``model``'s own)."""
    groups = muon_param_groups(model, tcfg)
    named = dict(model.named_parameters())
    layouts = {named[k]: v for k, v in (row_layouts or {}).items() if k in named}
    ns_dtype = torch.bfloat16 if device.type == "cuda" else None
    return Muon(groups, lr=tcfg.lr, momentum=tcfg.muon_momentum, ns_steps=tcfg.muon_ns_steps,
                scale=tcfg.muon_scale, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps, ns_dtype=ns_dtype,
                row_layouts=layouts)
