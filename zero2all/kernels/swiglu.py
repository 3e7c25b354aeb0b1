"""SwiGLU, silu(gate) * up, reading the fused [gate | up] projection output directly (no split copies).

Forward, with s = sigmoid(gate) (computed in float32, stored in the input dtype)::

    out = gate * s * up

Backward, recomputing s from the saved input instead of storing silu(gate) (one fewer activation kept)::

    d up   = g * gate * s
    d gate = g * up * s * (1 + gate * (1 - s))          (d/dx silu(x) = s + x s (1 - s))

The gradient is written into one (..., 2I) tensor laid out as the input, so the gate|up projection's backward
consumes it as is. The backward kernel can also write the recomputed ``out`` (``swiglu_linear`` in
``fused_linear.py`` uses it so that the down projection's input need not be kept from the forward).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_fwd_kernel(GU, OUT, I, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(GU + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(OUT + row * I + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(G, GU, DGU, A, I, stride_row, BLOCK: tl.constexpr, WRITE_A: tl.constexpr = False):
    # WRITE_A: also write the recomputed forward output a = silu(gate) * up (in A's dtype, rows of I), for the
    # weight gradient of the projection that consumed it (swiglu_linear); it costs only this write.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(G + row * I + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(GU + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    d_up = g * gate * s
    d_gate = g * up * s * (1.0 + gate * (1.0 - s))
    tl.store(DGU + row * (2 * I) + cols, d_gate.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * (2 * I) + I + cols, d_up.to(DGU.dtype.element_ty), mask=mask)
    if WRITE_A:
        tl.store(A + row * I + cols, (gate * s * up).to(A.dtype.element_ty), mask=mask)


_BLOCK = 1024


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@torch.library.custom_op("z2all::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate_up: torch.Tensor) -> torch.Tensor:
    I = gate_up.shape[-1] // 2
    gu = _rows(gate_up)
    out = torch.empty((gu.shape[0], I), dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] and I:
        block = min(_BLOCK, triton.next_power_of_2(I))
        _swiglu_fwd_kernel[(gu.shape[0], triton.cdiv(I, block))](gu, out, I, gu.stride(0), BLOCK=block,
                                                                  num_warps=4)
    return out.view(*gate_up.shape[:-1], I)


@_swiglu_fwd.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("z2all::swiglu_bwd", mutates_args=())
def _swiglu_bwd(grad_out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    I = gate_up.shape[-1] // 2
    gu = _rows(gate_up)
    g = grad_out.reshape(-1, I).contiguous()
    dgu = torch.empty((gu.shape[0], 2 * I), dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] and I:
        block = min(_BLOCK, triton.next_power_of_2(I))
        _swiglu_bwd_kernel[(gu.shape[0], triton.cdiv(I, block))](g, gu, dgu, dgu, I, gu.stride(0), BLOCK=block,
                                                                  num_warps=4)
    return dgu.view(gate_up.shape)


@_swiglu_bwd.register_fake
def _(grad_out, gate_up):
    return gate_up.new_empty(gate_up.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad_out):
    (gate_up,) = ctx.saved_tensors
    return _swiglu_bwd(grad_out, gate_up)


_swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


def triton_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``gate_up`` (..., 2 I) laid out as [gate | up]; returns (..., I) in the input dtype."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: last dimension {gate_up.shape[-1]} must be even ([gate | up])")
    return _swiglu_fwd(gate_up)
