"""The numerics context of one model: every piece of state its fused ops keep between calls.

A model (``model.numerics``, built by the constructor from ``model.ops``) owns:

* ``weight_casts``: the FP8 casts of its weights, made once per optimizer step (``fp8_ref.WeightCasts``;
  ``model.ops.fp8_weight_cache``);
* ``amax_history``: the recorded maxima of delayed scaling, one site per (weight, role)
  (``fp8_ref.AmaxHistory``; ``model.ops.fp8_amax_history``);
* ``amax_hints``: the partial maxima a kernel wrote next to its output for the next FP8 cast of that tensor
  (``fp8_ref.AmaxHints``; ``model.ops.fp8_fused_amax``);
* ``fp8_stats``: the saturation and underflow counts of its FP8 casts, read by the trainer once per logging
  window (``fp8_ref.Fp8Stats``);
* ``compute_casts`` and the step-fusion marks: which of its parameters have their compute-dtype cast kept for
  the step and their gradient summed inside the GEMM (``kernels/step_fusion.py``; ``model.ops.step_fusion``).

Nothing of this lives in module globals, on parameters or in hooks registered at import: two models in one
process (an RL policy with FP8 delayed scaling next to its reference model in bf16) keep their own options,
caches and histories, and building one never changes the other. The caches hold copies of weights that are
valid until the weights change; whoever steps an optimizer over the model's parameters calls
:meth:`Numerics.attach` once (the trainer does), which registers :meth:`Numerics.after_step` on that optimizer
alone. An entry is in any case used only while its weight is the same object at the same ``_version``, so a
forgotten attach costs memory, never a stale value.

The ops receive the context as an argument (``ops.norm_linear(..., numerics=...)``). The block's torch custom
ops (``kernels/fused_linear.py``, ``kernels/cross_entropy.py``) can only take tensors and plain values, so they
receive :attr:`Numerics.handle`, an integer that :func:`lookup` turns back into the context while the model
lives (a weak table: it keeps no context alive and holds no numerics state). ``None`` / handle 0: no context, every
op then casts per call and scales from its operand's own maxima (the values are those of the default options).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from zero2all.kernels.fp8_ref import AMAX_HISTORY_MAX, AmaxHints, AmaxHistory, Fp8Stats, WeightCasts
from zero2all.kernels.step_fusion import SETTINGS, ComputeCasts

WEIGHT_CACHES = ("both", "transposed")


class Numerics:
    """The per-model numerics state (see the module docstring). ``weight_cache``, ``fused_amax``,
    ``amax_history``: ``model.ops.fp8_weight_cache``, ``fp8_fused_amax``, ``fp8_amax_history``."""

    def __init__(self, weight_cache: str = "transposed", fused_amax: bool = False, amax_history: int = 0):
        if weight_cache not in WEIGHT_CACHES:
            raise ValueError(f"model.ops.fp8_weight_cache: {weight_cache!r} is not one of {', '.join(WEIGHT_CACHES)}")
        if amax_history != 0 and not 2 <= amax_history <= AMAX_HISTORY_MAX:
            raise ValueError(f"model.ops.fp8_amax_history: {amax_history} is neither 0 (off) nor in 2 .. "
                             f"{AMAX_HISTORY_MAX}")
        self.options = (weight_cache, bool(fused_amax), amax_history)
        self.weight_casts = WeightCasts()
        self.weight_casts.keep_forward = weight_cache == "both"
        self.amax_history = AmaxHistory()
        self.amax_history.length = amax_history
        self.amax_hints = AmaxHints()
        self.amax_hints.enabled = bool(fused_amax)
        self.fp8_stats = Fp8Stats()
        self.compute_casts = ComputeCasts()
        self.step_fusion = "off"
        self._grad_in_gemm: dict[int, weakref.ref] = {}
        self._step_cast: dict[int, weakref.ref] = {}
        self.handle = next(_HANDLES)
        _LIVE[self.handle] = self

    def __reduce__(self):
        """A copy (``copy.deepcopy`` of a model, as RL makes its reference) or an unpickled model gets a context of
        its own with the same options, empty and unmarked: its parameters are other objects."""
        return (Numerics, self.options)

    @classmethod
    def from_ops(cls, ops) -> "Numerics":
        """The context of a model whose ``ModelConfig.ops`` is ``ops``. The FP8 options apply only with an FP8
        ``linear_precision`` (a bf16 model gets the defaults: no history, no hints)."""
        if ops.linear_precision == "bf16":
            return cls()
        return cls(ops.fp8_weight_cache, ops.fp8_fused_amax, ops.fp8_amax_history)

    # -- step fusion: which parameters ---------------------------------------------------------------------------
    def mark(self, module: torch.nn.Module, setting: str = "all") -> int:
        """Mark the matrix parameters (2-D, float32) of ``module`` for step fusion ``setting`` (one of
        ``step_fusion.SETTINGS``; ``off`` clears every mark); returns how many matrices were marked. Only the
        lean projections and the fused loss read the marks, through this context."""
        if setting not in SETTINGS:
            raise ValueError(f"step_fusion: {setting!r} is not one of {', '.join(SETTINGS)}")
        self.step_fusion = setting
        self._grad_in_gemm.clear()
        self._step_cast.clear()
        self.compute_casts.clear()
        if setting == "off":
            return 0
        n = 0
        for p in module.parameters():
            if p.dim() == 2 and p.dtype == torch.float32 and id(p) not in self._grad_in_gemm:
                self._grad_in_gemm[id(p)] = weakref.ref(p)
                if setting == "all":
                    self._step_cast[id(p)] = weakref.ref(p)
                n += 1
        return n

    def grad_in_gemm(self, weight: torch.Tensor) -> bool:
        """Whether ``weight``'s gradient is summed inside its GEMM (``step_fusion.weight_grad``)."""
        ref = self._grad_in_gemm.get(id(weight))
        return ref is not None and ref() is weight

    def step_cast(self, weight: torch.Tensor) -> bool:
        """Whether ``weight``'s compute-dtype cast is kept until the optimizer step (``step_fusion.cast``)."""
        ref = self._step_cast.get(id(weight))
        return ref is not None and ref() is weight

    # -- the optimizer step ----------------------------------------------------------------------------------------
    def after_step(self, *_args) -> None:
        """Drop the weight casts (FP8 and compute dtype): the weights have changed. Amax histories are kept
        (delayed scaling reads the maxima of earlier steps)."""
        self.weight_casts.clear()
        self.compute_casts.clear()

    def attach(self, optimizer: torch.optim.Optimizer):
        """Register :meth:`after_step` on ``optimizer`` (a step post-hook of that optimizer only); returns the
        handle that removes it."""
        return optimizer.register_step_post_hook(self.after_step)

    def clear(self) -> None:
        """Forget every cast, recorded maximum and pending hint (the options and the marks stay)."""
        self.after_step()
        self.amax_history.clear()
        self.amax_hints.clear()


_HANDLES = itertools.count(1)
_LIVE: "weakref.WeakValueDictionary[int, Numerics]" = weakref.WeakValueDictionary()


def numerics_of(module: torch.nn.Module) -> Optional[Numerics]:
    """The numerics context of ``module`` or of the first of its submodules that has one (a model inside a
    wrapper: a reward or value head, LoRA), else None."""
    for m in module.modules():
        found = getattr(m, "numerics", None)
        if isinstance(found, Numerics):
            return found
    return None


def handle_of(numerics: Optional[Numerics]) -> int:
    """The integer that stands for ``numerics`` in a custom op's arguments (0: none)."""
    return 0 if numerics is None else numerics.handle


def lookup(handle: int) -> Optional[Numerics]:
    """The live context of ``handle`` (None for 0, or once its model is gone)."""
    return _LIVE.get(handle) if handle else None
