"""Bytes sent per GPU by the collectives of a code region, counted at torch's Python entry points.

Counts every call of torch.distributed's collectives (FSDP2's all-gather / reduce-scatter, DDP's all-reduce,
pipeline send / recv) and of the functional collectives that DTensor uses (tensor-parallel all-reduce,
all-gather, reduce-scatter, loss parallel's all-reduces, ring attention's exchanges), and converts each buffer to
the bytes one rank sends with ring algorithms over n ranks (the same factors as ``zero2all.accounting``):
all-reduce 2(n-1)/n x buffer, all-gather (n-1) x input shard, reduce-scatter (n-1)/n x input, all-to-all
(n-1)/n x input, a pipeline send (batch_isend_irecv) the tensor once. Each call is also attributed to the mesh
dimension whose group it ran on (tp, cp, pp, dp...), where the group is one of the mesh's.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

_FUNCOL_PREFIXES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# send / isend themselves stay untouched: P2POp checks its op by identity against them; pipeline traffic is
# counted at batch_isend_irecv
_C10D = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
         "reduce_scatter_single", "all_to_all_single", "batch_isend_irecv", "broadcast")
_SECOND_ARG_INPUT = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single")


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        local = x.to_local() if hasattr(x, "to_local") else x
        return local.numel() * local.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind.startswith("all_reduce"):
        return 2.0 * (n - 1) / n
    if kind.startswith("all_gather"):
        return float(n - 1)
    if kind.startswith(("reduce_scatter", "all_to_all")):
        return (n - 1) / n
    return 1.0


class CommCounter:
    """``with counter.counting(): ...`` sums bytes sent by this rank, per collective kind and per group label."""

    def __init__(self, group_names: dict | None = None, default_size: int = 1):
        self.by_kind: dict[str, float] = defaultdict(float)
        self.by_group: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.group_names = group_names or {}      # process-group name -> label (tp, cp, ...)
        self.default_size = default_size

    def _group(self, group):
        """(size, label) of a group given as a ProcessGroup, a group name, a DeviceMesh or (mesh, dim)."""
        from torch.distributed.device_mesh import DeviceMesh

        try:
            if group is None:
                pg = dist.group.WORLD
            elif isinstance(group, tuple):
                pg = group[0].get_group(group[1])
            elif isinstance(group, DeviceMesh):
                pg = group.get_group()
            elif isinstance(group, str):
                pg = dist.distributed_c10d._resolve_process_group(group)
            else:
                pg = group
            return dist.get_world_size(pg), self.group_names.get(pg.group_name, "world" if group is None else "other")
        except Exception:
            return self.default_size, "unresolved"

    def add(self, kind: str, tensor, group) -> None:
        n, label = self._group(group)
        sent = _factor(kind, n) * _nbytes(tensor)
        self.by_kind[kind] += sent
        self.by_group[label] += sent
        self.calls[kind] += 1

    @contextmanager
    def counting(self):
        from torch.distributed import _functional_collectives as funcol

        saved = []

        def wrap(module, name, kind, group_pos, group_kw):
            fn = getattr(module, name)

            def counted(*args, **kwargs):
                group = kwargs.get(group_kw, args[group_pos] if len(args) > group_pos else None)
                if kind == "batch_isend_irecv":
                    for op in args[0]:
                        if op.op in (dist.isend, dist.send):
                            self.add("send", op.tensor, op.group)
                else:
                    self.add(kind, args[0] if args else kwargs.get("tensor"), group)
                return fn(*args, **kwargs)

            saved.append((module, name, fn))
            setattr(module, name, counted)

        for name in dir(funcol):
            if name.startswith(_FUNCOL_PREFIXES) and callable(getattr(funcol, name)):
                # funcol.f(tensor, ..., group): the group is the last positional argument or ``group``
                pos = {"all_reduce": 2, "all_gather_tensor": 2, "all_gather_tensor_autograd": 2,
                       "reduce_scatter_tensor": 3, "reduce_scatter_tensor_autograd": 3}.get(name, 2)
                wrap(funcol, name, name, pos, "group")
        for name in _C10D:
            if hasattr(dist, name):
                pos = {"all_reduce": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3,
                       "all_gather_single": 2, "reduce_scatter_single": 3,
                       "all_to_all_single": 4, "broadcast": 2}.get(name, 2)
                kind = name
                if name in _SECOND_ARG_INPUT:  # (output, input, ...): count the input
                    fn = getattr(dist, name)

                    def make(fn=fn, kind=kind, pos=pos):
                        def counted(*args, **kwargs):
                            inp = args[1] if len(args) > 1 else kwargs.get("input")
                            group = kwargs.get("group", args[pos] if len(args) > pos else None)
                            self.add(kind, inp, group)
                            return fn(*args, **kwargs)
                        return counted

                    saved.append((dist, name, fn))
                    setattr(dist, name, make())
                else:
                    wrap(dist, name, kind, pos, "group")
        try:
            yield self
        finally:
            for module, name, fn in reversed(saved):
                setattr(module, name, fn)

    def summary(self) -> dict:
        return {"by_kind": dict(self.by_kind), "by_group": dict(self.by_group), "calls": dict(self.calls)}
