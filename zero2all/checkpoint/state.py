"""The parts of a training checkpoint, each a ``Stateful`` object that torch.distributed.checkpoint (DCP) saves
and loads in place.

- :class:`ModelState`: the plain model's parameters by name (``layers.0.mlp.down_proj.weight``), whatever wraps
  them (DDP, FSDP2 DTensor shards, torch.compile): DCP reshards on load.
- :class:`OptimizerState`: the optimizer's per-parameter state keyed by the same names (ZeRO-1: each rank
  contributes the parameters it owns). Hyper-parameters are not restored: they come from the resuming run's
  config, so a run may change its learning rate or weight decay on resume (the trainer prints what changed).
- :class:`JsonState`: counters, the LR schedule, the loss scaler: small values shared by every rank, stored as one
  JSON string.
- :class:`RankStates`: what each rank has of its own (data iterator position, RNG states, DDP comm hook state),
  stored under ``rank<r>``; on load every old rank's value is read, and the owner decides what a rank of the new
  layout continues from (the data iterator rescales; RNG falls back to rank 0's).
"""

from __future__ import annotations

import base64
import io
import json
import random
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn


class ModelState:
    """``fused``: layout objects by parameter name, each with ``save_value(v)`` / ``load_value(v, like)`` (tensor
    parallelism's fused parameters: stored in the canonical layout [q | k | v], [gate | up] whatever the mesh, and
    converted back on load). The checkpoint code calls them and knows no parallelism."""

    def __init__(self, model: nn.Module, fused: dict | None = None):
        self.model, self.fused = model, fused or {}

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return _canonical(get_model_state_dict(self.model), self.fused)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        if self.fused:
            sd = _rank_major(sd, get_model_state_dict(self.model), self.fused)
        set_model_state_dict(self.model, sd)


class OptimizerState:
    """``optimizer`` is the optimizer holding this rank's state (ZeRO-1: its local partition); ``fused`` as for
    :class:`ModelState` (the moments of a fused parameter have its layout)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, fused: dict | None = None):
        self.model, self.optimizer, self.fused = model, optimizer, fused or {}

    def _full(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # a fresh optimizer is given its state first (a zero-learning-rate step), so the template has every entry
        with _mixed_params(self.model):
            return get_optimizer_state_dict(self.model, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        state = self._full()["state"]
        return {"state": {k: _canonical(v, {n: self.fused[k] for n in v}) if k in self.fused else v
                          for k, v in state.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        current = self._full()
        loaded = sd["state"]
        if self.fused:
            loaded = {k: _rank_major(v, current["state"][k], {n: self.fused[k] for n in v if n != "step"})
                      if k in self.fused else v for k, v in loaded.items()}
        current["state"] = loaded  # param_groups stay this run's (its config's hyper-parameters)
        with _mixed_params(self.model):
            set_optimizer_state_dict(self.model, self.optimizer, current)


def _mixed_params(model: nn.Module):
    """Tensor parallel without sequence parallel keeps the norm weights plain beside DTensor shards; the
    optimizer's multi-tensor kernels (run by DCP's state-dict helpers) take them as replicated."""
    from contextlib import nullcontext

    if any(hasattr(p, "device_mesh") for p in model.parameters()):
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()
    return nullcontext()


def _canonical(sd: dict[str, Any], fused: dict) -> dict[str, Any]:
    """``sd`` with every value that has a layout object in ``fused`` as that layout stores it (``save_value``: a
    tensor-parallel fused parameter in the canonical row layout); others unchanged."""
    return {k: fused[k].save_value(v) if k in fused else v for k, v in sd.items()}


def _rank_major(sd: dict[str, Any], like: dict[str, Any], fused: dict) -> dict[str, Any]:
    """The inverse of :func:`_canonical` (``load_value``), ``like`` the current values."""
    return {k: fused[k].load_value(v, like[k]) if k in fused else v for k, v in sd.items()}


class JsonState:
    """An object with ``state_dict()`` / ``load_state_dict()`` of plain JSON values, stored as one string."""

    def __init__(self, get: Callable[[], dict], put: Callable[[dict], None]):
        self.get, self.put = get, put

    def state_dict(self) -> dict[str, str]:
        return {"json": json.dumps(self.get(), default=_json_default)}

    def load_state_dict(self, sd: dict[str, str]) -> None:
        self.put(json.loads(sd["json"]))


class RankStates:
    """Per-rank values: saved under ``rank<r>`` by rank r; loaded as the list of every old rank's value
    (``saved_world`` of them), handed to ``put``. Values are JSON (``binary=False``) or picklable objects
    (``binary=True``, stored as bytes)."""

    def __init__(self, rank: int, get: Callable[[], Any], put: Callable[[list], None], saved_world: int = 1,
                 binary: bool = False):
        self.rank, self.get, self.put, self.saved_world, self.binary = rank, get, put, saved_world, binary

    def state_dict(self) -> dict[str, Any]:
        value = self.get()
        if self.binary:
            buf = io.BytesIO()
            torch.save(value, buf)
            return {f"rank{self.rank}": buf.getvalue()}
        return {f"rank{self.rank}": json.dumps(value, default=_json_default)}

    def template(self) -> dict[str, Any]:
        return {f"rank{r}": b"" if self.binary else "" for r in range(self.saved_world)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        values = [sd[f"rank{r}"] for r in range(self.saved_world)]
        if self.binary:
            self.put([torch.load(io.BytesIO(v), map_location="cpu", weights_only=False) for v in values])
        else:
            self.put([json.loads(v) for v in values])


class LoadTemplate:
    """Wraps a :class:`RankStates` for loading: DCP asks ``state_dict()`` for what to read (every old rank's key),
    then hands the values to the part."""

    def __init__(self, part: RankStates):
        self.part = part

    def state_dict(self) -> dict[str, Any]:
        return self.part.template()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.part.load_state_dict(sd)


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    raise TypeError(f"checkpoint state: {type(obj).__name__} is not JSON-serialisable")


# --------------------------------------------------------------------------------------------------------------
# RNG states, as JSON


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict:
    """Python, NumPy, torch CPU and every CUDA device's generator state, as JSON values."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)},
             "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = [_unb64(s) for s in state["cuda"]]
        for i, s in enumerate(saved[:torch.cuda.device_count()]):  # another GPU count: the ones both runs have
            torch.cuda.set_rng_state(s, i)
