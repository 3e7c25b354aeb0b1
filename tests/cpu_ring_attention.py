"""Ring attention on CPU, for the context-parallel tests only.

torch's context parallel routes SDPA to ring attention for the CUDA kernels (flash, efficient, cudnn); CPU's SDPA
kernel (``_scaled_dot_product_flash_attention_for_cpu``) has no ring handler, so a gloo test would stop there.
This registers torch's own ring algorithm (``_templated_ring_attention`` and its backward: the same rotation of
K/V, the same load-balanced causal schedule, the same log-sum-exp merge) around the CPU kernel, so that the CPU
tests check everything of ours (batch sharding, positions, loss and gradient averaging) with torch's ring.
Private torch internals: kept in the tests, never in the package.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

aten = torch.ops.aten


def _unwrap(args):
    mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
    return mesh, [a.to_local() if isinstance(a, DTensor) else a for a in args]


def _wrap(mesh, tensors):
    return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in tensors)


def _merge_in(q: torch.Tensor) -> None:
    """torch's ring merges the blocks' outputs in float32 (``convert_to_f32``): float64 runs
    (``train.precision = "fp64"``) merge in float64 instead, else the merge alone differs from one process by ~1e-9."""
    cp_attention._cp_options.convert_to_f32 = q.dtype != torch.float64


def _forward(op_call, args, kwargs):
    mesh, (q, k, v, *rest) = _unwrap(args)
    _merge_in(q)
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    out, lse = cp_attention._templated_ring_attention(
        mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu, query=q, key=k, value=v,
        is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"))[:2]
    return _wrap(mesh, (out, lse))


def _backward(op_call, args, kwargs):
    mesh, (grad_out, q, k, v, out, lse, dropout_p, is_causal) = _unwrap(args)
    _merge_in(q)
    grads = cp_attention._templated_ring_attention_backward(
        mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=grad_out,
        grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=is_causal,
        dropout_p=dropout_p, scale=kwargs.get("scale"))
    return _wrap(mesh, grads[:3])


def register() -> None:
    """Add the CPU kernel to the ops that context parallel routes to ring attention."""
    cp_attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _forward
    cp_attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _backward
