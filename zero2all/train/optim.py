"""Optimiser, learning-rate schedules and the fp16 loss scaler.

Weight decay groups
    Decoupled weight decay (AdamW) shrinks a weight towards zero each step: w <- w - lr * wd * w. It is meant for
    the matrices that mix features (every ``nn.Linear`` weight). Norm gains (their "zero" would switch a channel
    off), biases (shifts, no capacity to regularise) and - unless ``decay_embeddings`` - the embedding table (a
    row is only updated when its token occurs, so decay would erase rare tokens) are left undecayed.

Schedules (``lr_at(it)`` for the optimiser update with 0-based index ``it``; ``W`` = warmup_steps, ``S`` =
max_steps, ``lr`` the peak and ``min_lr`` the floor)
    warmup (all schedules):  lr * (it + 1) / W                                   for it < W
    cosine:                  min_lr + 0.5 * (lr - min_lr) * (1 + cos(pi * p)),   p = (it - W + 1) / (S - W)
    wsd (warmup-stable-decay, Hu et al. 2024 "MiniCPM"): lr until the last D = round(decay_fraction * S) steps,
                             then linear from lr to min_lr: lr - (lr - min_lr) * (it - (S - D) + 1) / D
    constant:                lr after warmup
    Each phase's last step reaches its end value exactly (the last warmup step uses lr, the last step min_lr).

Loss scaling (fp16 only)
    fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The loss is multiplied by ``scale`` before
    backward so small gradients stay representable, and gradients are divided by it before the update. If any
    gradient overflowed (inf/nan) the update is skipped and the scale halved; after ``growth_interval`` clean steps
    it doubles. bf16 has fp32's exponent range and needs none of this.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from zero2all.config import ConfigError, TrainConfig
from zero2all.train.trainable import no_decay_modules

SCHEDULES = ("cosine", "wsd", "constant")


# --------------------------------------------------------------------------------------------------------------
# parameter groups and AdamW


def is_decayed(name: str, param: torch.Tensor, module: nn.Module, decay_embeddings: bool,
               held: bool = False) -> bool:
    """True for parameters that get weight decay: matrices of linear layers (and embeddings if asked). ``held``:
    the module is one whose rows must not move (``train.trainable = new_embeddings``: train/trainable.py)."""
    if param.ndim < 2 or held:  # norm gains and biases; rows that must stay
        return False
    if isinstance(module, nn.Embedding):
        return decay_embeddings
    return True


def named_trainable(model: nn.Module):
    """``(name, module_name, param_name, param, module)`` of each trainable tensor, a shared one once (with the
    first module that owns it: a tied LM head goes with the embedding)."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{module_name}.{pname}" if module_name else pname), module_name, pname, p, module


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = False,
                 no_decay_modules: tuple[str, ...] = (), skip=None) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group (shared tensors counted once). The
    parameters of modules named in ``no_decay_modules`` (their own name, the last part of the path) get none;
    ``skip(name, param, module)`` true leaves a parameter out (another optimizer's, e.g. Muon's matrices).

    Each group carries ``names`` (for printing and tests); torch's optimisers ignore unknown group keys.
    A tied LM head shares the embedding tensor: it is classified by the first module that owns it (the embedding).
    """
    decay, no_decay = {"params": [], "names": [], "weight_decay": weight_decay}, \
        {"params": [], "names": [], "weight_decay": 0.0}
    for name, module_name, pname, p, module in named_trainable(model):
        if skip is not None and skip(name, p, module):
            continue
        held = module_name.rsplit(".", 1)[-1] in no_decay_modules
        group = decay if is_decayed(pname, p, module, decay_embeddings, held) else no_decay
        group["params"].append(p)
        group["names"].append(name)
    return [g for g in (decay, no_decay) if g["params"]]


def describe_groups(groups: list[dict]) -> list[str]:
    """Lines like ``decayed parameter tensors: 29, with 7,077,888 parameters``."""
    lines = []
    for i, g in enumerate(groups):
        # param_groups() puts the decay group first; with train.weight_decay = 0 it is still that group
        kind = "decayed" if g["weight_decay"] > 0 or (i == 0 and len(groups) == 2) else "non-decayed"
        off = " (weight decay 0: off)" if kind == "decayed" and g["weight_decay"] == 0 else ""
        lines.append(f"{kind} parameter tensors: {len(g['params'])}, with "
                     f"{sum(p.numel() for p in g['params']):,} parameters{off}")
    return lines


def use_fused_adamw(setting: str, device: torch.device) -> bool:
    if setting == "auto":
        return device.type == "cuda"
    if setting in ("true", "false"):
        return setting == "true"
    raise ConfigError(f"train.fused_adamw: {setting!r} is not one of auto, true, false")


def build_optimizer(model: nn.Module, tcfg: TrainConfig, device: torch.device,
                    row_layouts: dict | None = None) -> torch.optim.Optimizer:
    """AdamW over the two weight-decay groups; the fused CUDA kernel (one launch for all tensors) when on GPU.
    ``train.optimizer = "muon"``: Muon for the blocks' matrices and AdamW for the rest (train/muon.py; tensor
    parallel's fused row layouts by parameter name in ``row_layouts``)."""
    if getattr(tcfg, "optimizer", "adamw") == "muon":
        from zero2all.train.muon import build_muon

        return build_muon(model, tcfg, device, row_layouts)
    groups = param_groups(model, tcfg.weight_decay, tcfg.decay_embeddings,
                          no_decay_modules(getattr(tcfg, "trainable", "all")))
    fused = use_fused_adamw(tcfg.fused_adamw, device)
    kwargs = {"fused": True} if fused else {"foreach": device.type == "cuda"}
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps, **kwargs)


# --------------------------------------------------------------------------------------------------------------
# learning-rate schedules


class LRSchedule:
    """The learning rate as a pure function of the update index (so resuming needs only the step number)."""

    def __init__(self, kind: str, lr: float, min_lr: float, warmup_steps: int, max_steps: int,
                 decay_fraction: float = 0.2):
        if kind not in SCHEDULES:
            raise ConfigError(f"train.schedule: {kind!r} is not one of {', '.join(SCHEDULES)}")
        if max_steps <= 0:
            raise ConfigError(f"train.max_steps: must be positive, got {max_steps}")
        if warmup_steps < 0:  # warmup longer than the run is allowed (a short trial of a long config)
            raise ConfigError(f"train.warmup_steps: must be >= 0, got {warmup_steps}")
        if not 0.0 <= decay_fraction <= 1.0:
            raise ConfigError(f"train.decay_fraction: must be in [0, 1], got {decay_fraction}")
        if min_lr > lr:
            raise ConfigError(f"train.min_lr: {min_lr} is larger than train.lr={lr}")
        self.kind, self.lr, self.min_lr = kind, lr, min_lr
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.decay_steps = max(0, min(max_steps - warmup_steps, round(decay_fraction * max_steps)))

    @classmethod
    def from_config(cls, tcfg: TrainConfig) -> "LRSchedule":
        return cls(tcfg.schedule, tcfg.lr, tcfg.min_lr, tcfg.warmup_steps, tcfg.max_steps, tcfg.decay_fraction)

    def lr_at(self, it: int) -> float:
        W, S = self.warmup_steps, self.max_steps
        if it < W:
            return self.lr * (it + 1) / W
        if self.kind == "constant":
            return self.lr
        if self.kind == "cosine":
            p = min(1.0, (it - W + 1) / max(1, S - W))
            return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * p))
        # wsd
        decay_start = S - self.decay_steps
        if it < decay_start or self.decay_steps == 0:
            return self.lr
        p = min(1.0, (it - decay_start + 1) / self.decay_steps)
        return self.lr - (self.lr - self.min_lr) * p

    def warning(self) -> str | None:
        """A line for the start of a run whose warmup is longer than the run (its LR never reaches ``lr``)."""
        if self.warmup_steps <= self.max_steps:
            return None
        peak = self.max_steps / self.warmup_steps
        return (f"warning: train.warmup_steps={self.warmup_steps} is longer than the run (train.max_steps="
                f"{self.max_steps}): the learning rate peaks at {100 * peak:.0f}% of train.lr={self.lr:g}")

    def state_dict(self) -> dict:
        return {"kind": self.kind, "lr": self.lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "max_steps": self.max_steps, "decay_steps": self.decay_steps}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------------------------------------------------
# dynamic loss scaling (fp16)


class DynamicLossScaler:
    """Loss scaling for fp16 training (see the module docstring). Disabled (scale 1, never skips) otherwise.

    Use per optimiser update::

        (scaler.scale * loss).backward()          # for each micro-batch
        scaler.unscale_(params)                   # grads /= scale
        norm = total grad norm (clipping)         # a non-finite norm means an overflow somewhere
        if scaler.update(found_inf=not finite):   # True: apply the update; False: skip it (scale was halved)
            optimizer.step()
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, min_scale: float = 1.0):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.clean_steps = 0      # consecutive updates without overflow since the last scale change
        self.skipped_steps = 0    # total updates skipped because of overflow

    @torch.no_grad()
    def unscale_(self, params) -> None:
        if not self.enabled or self.scale == 1.0:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, found_inf: bool) -> bool:
        """Adjust the scale after an update attempt; returns whether the optimiser step should be applied."""
        if not self.enabled:
            return not found_inf
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.clean_steps = 0
            self.skipped_steps += 1
            return False
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.enabled = bool(sd["enabled"])
        self.scale = float(sd["scale"])
        self.clean_steps = int(sd["clean_steps"])
        self.skipped_steps = int(sd["skipped_steps"])


def grad_norm_and_clip(params, max_norm: float) -> torch.Tensor:
    """Total L2 norm of all gradients (before clipping); scales them to ``max_norm`` when it is exceeded.

    ``max_norm`` <= 0 only measures. Returns a 0-dim tensor (may be inf/nan on overflow: the caller checks).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    from zero2all.distributed.mesh import mesh_grad_norm_and_clip, needs_mesh_norm

    if needs_mesh_norm(params):  # tensor / sequence / expert parallel: several meshes
        return mesh_grad_norm_and_clip(params, max_norm)
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return torch.nn.utils.get_total_norm(grads, foreach=True)
