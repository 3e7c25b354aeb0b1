"""Host time of one forward + backward through a torch custom op with registered autograd, against the same body
in a plain ``torch.autograd.Function`` (what ``zero2all/kernels/eager.py`` does in eager mode).

The body is trivial (x * 2 and a zeros gradient) and the tensors tiny, so the difference is the dispatch path
alone: the custom op's Python autograd kernel, re-dispatch and schema checks, forward and backward. Runs on the
CPU, no GPU needed:

    python benchmarks/dispatch_overhead.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch


@torch.library.custom_op("z2all_bench::fwd", mutates_args=())
def _fwd(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], eps: float, dtype: torch.dtype,
         precision: str, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x.new_empty((0,))


@_fwd.register_fake
def _(x, w, b, eps, dtype, precision, kind):
    return torch.empty_like(x), x.new_empty((0,))


@torch.library.custom_op("z2all_bench::bwd", mutates_args=())
def _bwd(g: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    return g * 2, torch.zeros_like(w)


@_bwd.register_fake
def _(g, w, dtype, precision):
    return torch.empty_like(g), torch.empty_like(w)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad, _grad_counts):
    (w,) = ctx.saved_tensors
    dx, dw = _bwd(grad, w, torch.bfloat16, "bf16")
    return dx, dw, None, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup)
_fwd_body, _bwd_body = _fwd._init_fn, _bwd._init_fn


class _Plain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, eps, dtype, precision, kind):
        out = _fwd_body(x, w, b, eps, dtype, precision, kind)
        _setup(ctx, (x, w), out)
        return out

    @staticmethod
    def backward(ctx, grad, _grad_counts):
        (w,) = ctx.saved_tensors
        dx, dw = _bwd_body(grad, w, torch.bfloat16, "bf16")
        return dx, dw, None, None, None, None, None


def _no_op(x, w, *args):
    return x * 2, None


def per_call_us(fn, iters: int) -> float:
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def once():
        fn(x, w, None, 1e-5, torch.bfloat16, "bf16", "qkv")[0].sum().backward()

    for _ in range(50):
        once()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters // 5):
            once()
        rounds.append((time.perf_counter() - t0) / (iters // 5) * 1e6)
    return statistics.median(rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    torch.set_num_threads(1)
    base = per_call_us(_no_op, args.iters)
    print(f"torch {torch.__version__}, one CPU thread; forward + backward of a trivial body, median of 5 rounds")
    print(f"  plain torch ops (x * 2, no extra node):   {base:7.1f} us")
    for name, fn in (("custom op + register_autograd", _fwd), ("torch.autograd.Function", _Plain.apply)):
        us = per_call_us(fn, args.iters)
        print(f"  {name:<40} {us:7.1f} us  (+{us - base:.1f} us over the plain ops)")


if __name__ == "__main__":
    main()
