"""FP8 linears, the parts that need no Triton: formats, the scaling rule's PyTorch reference, the GEMM
(``torch._scaled_mm`` on a GPU, a float32 emulation elsewhere), the three GEMMs of a linear, an autograd Function
and the saturation statistics. ``zero2all/kernels/fp8.py`` has the rules in full and the Triton kernels of the
same quantisation.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("fp8_rowwise", "fp8_tensorwise")
KINDS = ("qkv", "o", "gate_up", "down")
AMAX_FLOOR = 1e-12
FAST_ACCUM_FORWARD = True       # the forward GEMM only; the gradient GEMMs accumulate with full promotion



def grad_dtype(recipe: str) -> torch.dtype:
    """The FP8 format of gradients: E4M3 with rowwise scaling, E5M2 with tensorwise (see the module docstring)."""
    return E4M3 if recipe == "fp8_rowwise" else E5M2


def scaling_of(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"fp8: recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    return "axis" if recipe == "fp8_rowwise" else "tensor"


@functools.lru_cache(maxsize=None)
def _device_check(index: int) -> None:
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        raise RuntimeError(
            f"model.ops.linear_precision: FP8 needs a GPU with FP8 tensor cores (compute capability >= 8.9: Ada, "
            f"Hopper or newer); {torch.cuda.get_device_name(index)} has {major}.{minor}. Use linear_precision = "
            f"'bf16'")


def check_fp8_device(device: torch.device) -> None:
    """Refuse FP8 on a GPU without FP8 tensor cores. On CPU the GEMMs are a float32 emulation (allowed)."""
    if device.type == "cuda":
        _device_check(device.index if device.index is not None else torch.cuda.current_device())



# --------------------------------------------------------------------------------------------------------------
# quantisation: the reference


@dataclass
class Quantized:
    """An operand in FP8. ``q`` (M, K) row-scaled by ``q_scale`` (M,) (or one scale, shape ()); ``qt`` (K, M), the
    transposed copy, column-scaled by ``qt_scale`` (K,) (or ()); either may be None when not asked for.
    ``counts`` (2,) int64: saturated and underflowed elements over the casts written."""

    q: Optional[torch.Tensor]
    q_scale: Optional[torch.Tensor]
    qt: Optional[torch.Tensor]
    qt_scale: Optional[torch.Tensor]
    counts: torch.Tensor


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"fp8 quantize: expected a 2-D tensor, got shape {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def _cast_torch(xf: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
    fmax = torch.finfo(dtype).max
    a = amax.clamp_min(AMAX_FLOOR)
    r = torch.full_like(a, fmax) / a        # a true division (``fmax / a`` would be reciprocal(a) * fmax)
    q = (xf * r).clamp(-fmax, fmax).to(dtype)
    qf = q.float()
    counts = torch.stack([(qf.abs() >= fmax).sum(), ((xf != 0) & (qf == 0)).sum()])
    return q, a / torch.full_like(a, fmax), counts        # a true division on every device (see r above)


def quantize_torch(x: torch.Tensor, dtype: torch.dtype, scaling: str, want_q: bool = True, want_qt: bool = False,
                   history: Optional["AmaxSite"] = None, observe: bool = True,
                   hints: Optional["AmaxHints"] = None) -> Quantized:
    """The reference of ``quantize``: the same rule in PyTorch (torch's float8 casts round to nearest even).
    ``history`` (tensorwise only): delayed scaling from that site's recorded maxima (``AmaxHistory``); with
    ``observe`` the operand's own amax is recorded there. ``hints`` is accepted for the kernels' signature and
    unused: the reference computes every maximum itself."""
    xf = _rows2d(x).float()
    counts = torch.zeros(2, dtype=torch.int64, device=x.device)
    q = q_s = qt = qt_s = None
    if scaling == "tensor":
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
        if history is not None:
            amax = history.reference_amax(amax, observe)
        if want_q:
            q, q_s, c = _cast_torch(xf, amax, dtype)
            counts += c
        if want_qt:
            qt, qt_s, c = _cast_torch(xf.t(), amax, dtype)
            qt, counts = qt.contiguous(), counts + c
        return Quantized(q, q_s, qt, qt_s, counts)
    if want_q:
        amax = xf.abs().amax(1) if xf.shape[1] else xf.new_zeros(xf.shape[0])
        q, q_s, c = _cast_torch(xf, amax[:, None], dtype)
        q_s, counts = q_s[:, 0], counts + c
    if want_qt:
        amax = xf.abs().amax(0) if xf.shape[0] else xf.new_zeros(xf.shape[1])
        qt, qt_s, c = _cast_torch(xf.t(), amax[:, None], dtype)
        qt, qt_s, counts = qt.contiguous(), qt_s[:, 0], counts + c
    return Quantized(q, q_s, qt, qt_s, counts)


# --------------------------------------------------------------------------------------------------------------
# the GEMM


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[:t.shape[0], :t.shape[1]] = t
    return out


def fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, bt: torch.Tensor, bt_scale: torch.Tensor,
           out_dtype: torch.dtype, out: Optional[torch.Tensor] = None, fast_accum: bool = False) -> torch.Tensor:
    """``(a * a_scale[:, None]) @ (bt * bt_scale[:, None])^T`` for FP8 ``a`` (M, K) and ``bt`` (N, K), both
    row-major, scales per row (M,) / (N,) or one per tensor (shape ()); written into ``out`` (M, N) when given.

    On a GPU: ``torch._scaled_mm`` (float32 accumulation; ``fast_accum`` lets the tensor cores keep partial sums
    at their own precision between promotions, as is usual for the forward GEMM); dims that are not multiples of
    16 are zero-padded. Elsewhere: the float32 emulation of the same product."""
    M, K = a.shape
    N = bt.shape[0]
    if not a.is_cuda:
        af = a.float() * (a_scale[:, None] if a_scale.dim() else a_scale)
        bf = bt.float() * (bt_scale[:, None] if bt_scale.dim() else bt_scale)
        res = (af @ bf.t()).to(out_dtype)
        return out.copy_(res) if out is not None else res
    rowwise = a_scale.dim() == 1
    Mp, Np, Kp = (-(-n // 16) * 16 for n in (M, N, K))
    padded = (Mp, Np, Kp) != (M, N, K)
    if padded:
        a, bt = _pad_to(a, Mp, Kp), _pad_to(bt, Np, Kp)
        if rowwise:
            a_scale = torch.nn.functional.pad(a_scale, (0, Mp - M), value=1.0)
            bt_scale = torch.nn.functional.pad(bt_scale, (0, Np - N), value=1.0)
    # rowwise scaling writes bfloat16 only; tensorwise writes the asked dtype
    mm_dtype = torch.bfloat16 if rowwise else out_dtype
    sa = a_scale[:, None].contiguous() if rowwise else a_scale.reshape(())
    sb = bt_scale[None, :].contiguous() if rowwise else bt_scale.reshape(())
    if out is not None and not padded and out.dtype == mm_dtype and out.is_contiguous():
        return torch._scaled_mm(a, bt.t(), scale_a=sa, scale_b=sb, out_dtype=mm_dtype, use_fast_accum=fast_accum,
                                out=out)
    res = torch._scaled_mm(a, bt.t(), scale_a=sa, scale_b=sb, out_dtype=mm_dtype, use_fast_accum=fast_accum)
    if padded:
        res = res[:M, :N]
    if out is not None:
        return out.copy_(res)
    return res.to(out_dtype) if not padded else res.to(out_dtype).contiguous()


# --------------------------------------------------------------------------------------------------------------
# the weights' casts, once per optimizer step


class WeightCasts:
    """The FP8 casts of the weights, made once per optimizer step instead of once per micro-batch.

    A weight is cast twice per micro-batch: W row-scaled (over K) for the forward GEMM, W^T column-scaled (over N)
    for d input. Between two optimizer steps the weights do not change, so with gradient accumulation the casts of
    the first micro-batch can serve the others (the speed-up is measured in BENCHMARKS.md). By default
    (``keep_forward = False``, ``model.ops.fp8_weight_cache = "transposed"``) only W^T is kept, the slower cast (a
    maximum per column, then the transposed write): 1 byte per parameter. The forward copy is then made per
    micro-batch: with tensorwise scaling it is W^T transposed back (the very same codes and scale: a byte copy),
    with rowwise scaling its own one-pass cast of the weight (its scales are per row of W, W^T's per column, so
    it cannot be made from W^T exactly). ``keep_forward = True`` (``both``) keeps W as well: 2 bytes per
    parameter, 1 GB more for z2all-1.1b, and no faster on an H100 (72.8k / 74.4k tok/s rowwise / tensorwise
    against 72.3k / 74.4k with W^T alone, BENCHMARKS.md).

    An entry is keyed by the weight's storage address, shape, strides, dtype and the cast asked for, and used only
    while it describes the very same tensor object (a weak reference) at the same ``_version`` (any in-place write
    to the weight bumps it). The model's numerics context (``kernels/numerics.py``) owns the cache and empties it
    after each step of the optimizer it is attached to (the trainer's), and so does ``clear()``. Under FSDP2 the
    gathered weight of a layer is the same unsharded parameter object on every gather: an entry it hits holds the
    cast of that layer's weight in the same step (the values do not change before the step), and where the gather
    bumped ``_version`` it is cast again; another layer's weight at a reused address is another object and never
    hits.
    """

    def __init__(self):
        self.enabled = True
        self.keep_forward = False      # model.ops.fp8_weight_cache = "transposed" (the default)
        self._entries: dict[tuple, tuple] = {}

    def get(self, weight: torch.Tensor, scaling: str, transposed: bool, quant) -> Quantized:
        """``quant(weight, E4M3, scaling)`` (transposed: only W^T, else only W), from the cache when current."""
        if not self.enabled or weight.is_inference():       # inference tensors have no version counter
            return self._cast(weight, scaling, transposed, quant)
        if not transposed and not self.keep_forward:
            if scaling == "tensor":                         # the same codes and scale as W^T's
                wt = self._cached(weight, scaling, True, quant)
                return Quantized(wt.qt.t().contiguous(), wt.qt_scale, None, None, wt.counts)
            return self._cast(weight, scaling, False, quant)
        return self._cached(weight, scaling, transposed, quant)

    def _cached(self, weight, scaling, transposed, quant) -> Quantized:
        key = (weight.data_ptr(), weight.device, tuple(weight.shape), weight.stride(), weight.dtype, scaling,
               transposed, quant)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            return entry[2]
        q = self._cast(weight, scaling, transposed, quant)
        self._entries[key] = (weakref.ref(weight), weight._version, q)
        return q

    @staticmethod
    def _cast(weight, scaling, transposed, quant):
        return quant(weight, E4M3, scaling, want_q=not transposed, want_qt=transposed)

    def clear(self, *_args) -> None:
        self._entries.clear()


def cast_weight(casts: Optional[WeightCasts], weight: torch.Tensor, scaling: str, transposed: bool,
                quant) -> Quantized:
    """The FP8 cast of a weight through ``casts`` (a model's cache), or made here when there is none."""
    if casts is None:
        return WeightCasts._cast(weight, scaling, transposed, quant)
    return casts.get(weight, scaling, transposed, quant)


# --------------------------------------------------------------------------------------------------------------
# delayed scaling: tensorwise scales from the maxima of earlier casts


class AmaxSite:
    """The recorded maxima of one cast site (a linear's input or its output gradient): a ring of
    ``length + 1`` float32 slots on the device (``buf``) and how many maxima were recorded (``n``, host side).
    One slot is always 0: the one the next cast writes to.

    A cast with ``observe`` takes the slot ``n % (length + 1)`` (holding 0), takes its scale from the maximum of
    the slots other than it and the one after it (that is, of the ``length - 1`` previous maxima), writes its
    own amax into its slot in the same pass (``kernels/fp8.py``: each program an atomic maximum) and zeroes the
    one after it, the next cast's; without ``observe`` it takes the maximum of every slot. The first cast of a
    site (nothing recorded) scales from its own amax, as dynamic scaling does, and records it."""

    def __init__(self, ref, length: int, device: torch.device):
        self.ref, self.n = ref, 0
        self.buf = torch.zeros(length + 1, dtype=torch.float32, device=device)

    @property
    def empty(self) -> bool:
        return self.n == 0

    def record(self, amax: torch.Tensor) -> None:
        """Record an amax computed elsewhere (the first cast, or a cast whose maxima were handed over)."""
        slot, nxt = self.open_slot()
        # device kernels only: ``buf[slot] = value`` with a Python number would copy from the host and wait
        self.buf.narrow(0, slot, 1).copy_(amax.reshape(1))
        self.buf.narrow(0, nxt, 1).zero_()

    def open_slot(self) -> tuple[int, int]:
        """(the slot this cast's amax goes to, the slot to zero for the next cast)."""
        slots = self.buf.numel()
        slot = self.n % slots
        self.n += 1
        return slot, (slot + 1) % slots

    def reference_amax(self, own: torch.Tensor, observe: bool) -> torch.Tensor:
        """``quantize_torch``'s rule: the amax the scale is taken from, given the operand's own (``own``)."""
        if self.empty:
            if observe:
                self.record(own)
            return own
        if not observe:
            return self.buf.max()
        slot, nxt = self.open_slot()
        idx = torch.arange(self.buf.numel(), device=self.buf.device)
        used = torch.where((idx != slot) & (idx != nxt), self.buf, torch.zeros_like(self.buf)).max()
        self.buf.narrow(0, slot, 1).copy_(own.reshape(1))
        self.buf.narrow(0, nxt, 1).zero_()
        return used


class AmaxHistory:
    """Delayed scaling (``model.ops.fp8_amax_history = length``; ``fp8_tensorwise`` only): the scale of a cast is
    taken from the largest amax recorded by the ``length - 1`` previous casts at the same site, not from the
    operand itself, so the cast needs no amax pass of its own (its amax is recorded in the same pass).

    Sites: ``(weight, "x")`` the input of the linear with that weight, ``(weight, "g")`` its output gradient. The
    backward's transposed cast of the input (for d W) reads the input's site without recording (its values are
    the forward's, already recorded). Elements beyond the scale's range saturate (clamped to the format's largest
    value) and are counted in the saturation statistics (the model's ``Fp8Stats``). A site is keyed by the weight object
    (a weak reference: under FSDP2 the unsharded parameter is the same object at every gather) and lives until
    its weight is freed or ``clear()``; the maxima are not part of checkpoints (after a resume the first cast of
    each site scales from its own amax). ``length = 0``: off (every scale from the operand's own amax)."""

    def __init__(self):
        self.length = 0
        self._sites: dict[tuple, AmaxSite] = {}

    def site(self, weight: Optional[torch.Tensor], role: str) -> Optional[AmaxSite]:
        if not self.length or weight is None or torch.compiler.is_compiling():
            return None
        key = (id(weight), role)
        entry = self._sites.get(key)
        if entry is not None and entry.ref() is weight and entry.buf.numel() == self.length + 1:
            return entry
        self._sites = {k: e for k, e in self._sites.items() if e.ref() is not None}
        entry = AmaxSite(weakref.ref(weight), self.length, weight.device)
        self._sites[key] = entry
        return entry

    def clear(self) -> None:
        self._sites.clear()


AMAX_HISTORY_MAX = 1024


def _site(numerics, weight: Optional[torch.Tensor], scaling: str, role: str, observe: bool = True) -> dict:
    """The keyword arguments of a quantiser for the cast at (weight, role) in ``numerics`` (a model's context,
    ``kernels/numerics.py``, or None): the site of delayed scaling and the hints of fused maxima, where on."""
    if numerics is None:
        return {}
    kwargs = {"hints": numerics.amax_hints} if numerics.amax_hints.enabled else {}
    site = numerics.amax_history.site(weight, role) if scaling == "tensor" else None
    if site is not None:
        kwargs.update(history=site, observe=observe)
    return kwargs


class AmaxHints:
    """Partial maxima that the kernel producing a tensor wrote next to it (``kernels/fp8.py``: the norm and
    SwiGLU kernels), handed to the next ``quantize`` of that very tensor so that it skips its amax pass (one read
    of the operand less). Each model's numerics context owns one (``model.ops.fp8_fused_amax``).

    An entry is keyed by the tensor's address and used only if, at that call, the tensor (or the base it is a
    view of) is the same object, with the same shape, strides and ``_version`` (unchanged since the kernel
    wrote it); it is used once. Entries whose tensor has been freed are dropped. Values are unchanged: the
    maxima are those ``_amax_kernel`` would compute (partial maxima over other tiles, the same maximum).
    Off by default (``enabled = True`` turns it on: the producing kernels then write the maxima); not yet
    measured on a GPU."""

    def __init__(self):
        self.enabled = False
        self._entries: dict[int, tuple] = {}

    def put(self, x: torch.Tensor, row_part: torch.Tensor, col_part: Optional[torch.Tensor]) -> None:
        if not self.enabled:
            return
        self._entries = {k: e for k, e in self._entries.items() if e[0]() is not None}
        owner = x if x._base is None else x._base
        self._entries[x.data_ptr()] = (weakref.ref(owner), tuple(x.shape), x.stride(), x._version, row_part,
                                       col_part)

    def take(self, x: torch.Tensor):
        """(row_part (S, M), col_part (B, K) or None) for ``x`` (2-D), or None."""
        if not self._entries:
            return None
        entry = self._entries.pop(x.data_ptr(), None)
        if entry is None:
            return None
        ref, shape, stride, version, row_part, col_part = entry
        base = x if x._base is None else x._base
        owner = ref()
        if owner is None or base is not owner or tuple(x.shape) != shape \
                or x.stride() != stride or x._version != version:
            return None
        return row_part, col_part

    def clear(self) -> None:
        self._entries.clear()


def hints_of(numerics) -> Optional[AmaxHints]:
    """The hints of ``numerics`` where fused maxima are on (the producing kernels write them), else None."""
    return numerics.amax_hints if numerics is not None and numerics.amax_hints.enabled else None


# --------------------------------------------------------------------------------------------------------------
# the three GEMMs of a linear (used by the lean fused projections in fused_linear.py and by FP8Linear below)


def linear_forward(a2d: torch.Tensor, weight: torch.Tensor, recipe: str, out_dtype: torch.dtype,
                   quant=quantize_torch, out: Optional[torch.Tensor] = None, numerics=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``a2d @ W^T`` with both operands in E4M3 (into ``out`` when given); returns (out (M, N), counts (2,)).
    ``a2d`` may come already quantised (a ``Quantized`` with ``q``, cast by the op that produced it).
    ``numerics``: the model's context (weight casts, delayed scaling, hints; None: none)."""
    scaling = scaling_of(recipe)
    qa = a2d if isinstance(a2d, Quantized) else quant(a2d, E4M3, scaling, **_site(numerics, weight, scaling, "x"))
    qw = cast_weight(numerics.weight_casts if numerics is not None else None, weight, scaling, False, quant)
    y = fp8_mm(qa.q, qa.q_scale, qw.q, qw.q_scale, out_dtype, out=out, fast_accum=FAST_ACCUM_FORWARD)
    return y, qa.counts + qw.counts


class LinearBackward:
    """The two backward GEMMs of ``y = a W^T`` from one quantisation of the gradient ``g`` (M, N): ``q`` (row
    scaled) for d a = g W, ``qt`` (column scaled, transposed) for d W = g^T a. ``counts`` covers g's casts.
    ``weight``: the layer's weight, whose sites delayed scaling uses; ``numerics``: the model's context (its
    ``AmaxHistory``, weight casts and hints; None: none)."""

    def __init__(self, g2d: torch.Tensor, recipe: str, want_da: bool, want_dw: bool, quant=quantize_torch,
                 weight: Optional[torch.Tensor] = None, numerics=None):
        self.recipe, self.scaling, self.quant, self.weight = recipe, scaling_of(recipe), quant, weight
        self.numerics = numerics
        self.g = quant(g2d, grad_dtype(recipe), self.scaling, want_q=want_da, want_qt=want_dw,
                       **_site(numerics, weight, self.scaling, "g"))
        self.counts = self.g.counts

    def grad_input(self, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        casts = self.numerics.weight_casts if self.numerics is not None else None
        wt = cast_weight(casts, weight, self.scaling, True, self.quant)                  # W^T (K, N)
        return fp8_mm(self.g.q, self.g.q_scale, wt.qt, wt.qt_scale, out_dtype)

    def grad_weight(self, a2d: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        at = self.quant(a2d, E4M3, self.scaling, want_q=False, want_qt=True,            # a^T (K, M)
                        **_site(self.numerics, self.weight, self.scaling, "x", observe=False))
        return fp8_mm(self.g.qt, self.g.qt_scale, at.qt, at.qt_scale, out_dtype)


# --------------------------------------------------------------------------------------------------------------
# monitoring


class Fp8Stats:
    """Saturated and underflowed FP8 elements per layer kind, summed on the device between reads.

    ``add(kind, numel, counts)`` after each op (counts: (2,) int64 on the device; numel: elements cast);
    ``read()`` returns {"fp8_saturated_<kind>": fraction, "fp8_underflow_<kind>": fraction} for the kinds seen
    since the last read (one device-to-host copy) and starts a new window.
    """

    def __init__(self):
        self.enabled = True
        self._counts: dict[str, torch.Tensor] = {}
        self._numel: dict[str, int] = {}

    def add(self, kind: Optional[str], numel: int, counts: torch.Tensor) -> None:
        # under torch.compile (tracing: counts is then a fake or functional tensor subclass) nothing is recorded
        if not self.enabled or kind is None or torch.compiler.is_compiling() or type(counts) is not torch.Tensor:
            return
        if kind in self._counts:
            self._counts[kind] += counts
        else:
            self._counts[kind] = counts.clone()
        self._numel[kind] = self._numel.get(kind, 0) + numel

    def read(self) -> dict[str, float]:
        out = {}
        if self._counts:
            kinds = list(self._counts)
            values = torch.stack([self._counts[k] for k in kinds]).cpu().tolist()
            for kind, (sat, under) in zip(kinds, values):
                n = max(self._numel[kind], 1)
                out[f"fp8_saturated_{kind}"] = sat / n
                out[f"fp8_underflow_{kind}"] = under / n
        self._counts, self._numel = {}, {}
        return out


# --------------------------------------------------------------------------------------------------------------
# a plain FP8 linear (the reference path of ops.fp8_linear_torch, and any linear outside the fused blocks)


class FP8Linear(torch.autograd.Function):
    """``y = x W^T + b`` with the three GEMMs in FP8 (rules above); ``quant`` picks the quantiser (the Triton
    kernels or ``quantize_torch``). Saves x and W (not their casts); the output is in ``out_dtype``."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, out_dtype, quant, kind, numerics=None):
        x2 = x.reshape(-1, x.shape[-1])
        out, counts = linear_forward(x2, weight, recipe, out_dtype, quant, numerics=numerics)
        if numerics is not None:
            numerics.fp8_stats.add(kind, x2.numel() + weight.numel(), counts)
        if bias is not None:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.quant, ctx.out_dtype, ctx.has_bias, ctx.kind = recipe, quant, out_dtype, bias is not None, kind
        ctx.numerics = numerics
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, weight.shape[0])
        need = ctx.needs_input_grad
        bwd = LinearBackward(g2, ctx.recipe, need[0], need[1], ctx.quant, weight=weight, numerics=ctx.numerics)
        if ctx.numerics is not None:
            ctx.numerics.fp8_stats.add(ctx.kind, g2.numel() * (int(need[0]) + int(need[1])), bwd.counts)
        dx = bwd.grad_input(weight, x.dtype).view(x.shape) if need[0] else None
        dw = bwd.grad_weight(x.reshape(-1, x.shape[-1]), weight.dtype) if need[1] else None
        db = g2.float().sum(0).to(weight.dtype) if ctx.has_bias and need[2] else None
        return dx, dw, db, None, None, None, None, None


def _triton_quantize():
    from zero2all.kernels.fp8 import quantize

    return quantize


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: str,
               out_dtype: Optional[torch.dtype] = None, use_triton: bool = True, kind: Optional[str] = None,
               numerics=None) -> torch.Tensor:
    """``F.linear`` with FP8 GEMMs (``recipe``: fp8_rowwise / fp8_tensorwise); ``kind`` names the layer in
    the model's ``Fp8Stats`` (None: not counted); ``numerics``: the model's context (``kernels/numerics.py``: its weight
    casts, delayed scaling and hints; None: every cast made here, scaled from its operand)."""
    scaling_of(recipe)
    check_fp8_device(x.device)
    quant = _triton_quantize() if use_triton else quantize_torch
    return FP8Linear.apply(x, weight, bias, recipe, out_dtype or x.dtype, quant, kind, numerics)
