"""DistributedDataParallel: every rank holds the whole model and optimizer; gradients are all-reduced in buckets
that overlap the backward pass.

Optional gradient compression with torch's own comm hooks (``parallel.comm_hook``): ``bf16`` (NCCL) / ``fp16``
send each bucket in 16 bits (half the bytes); ``powersgd`` sends a rank-r approximation with error feedback
(Vogels et al. 2019) after ``powersgd_start_iter`` plain steps. PowerSGD's state (error feedback, warm-start
matrices, iteration) belongs to this rank: :class:`CommHook` keeps it and hands it to checkpoints.
Memory per GPU for P parameters with fp32 master weights + AdamW: 16P bytes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from zero2all.config import ConfigError, ParallelConfig
from zero2all.distributed.env import DistEnv


class CommHook:
    """The comm hook registered on a DDP module, with its per-rank state (PowerSGD) for checkpoints.

    torch's PowerSGD keeps its error feedback and warm-start matrices per gradient *bucket*, as flat tensors laid
    out in the bucket's parameter order. That layout is not stable: DDP rebuilds its buckets after the first
    iteration of every new DDP module (from the order gradients became ready), so a resumed run's first update
    would add the saved error to the wrong elements. This class therefore keeps the state per *parameter* across
    a layout change and in checkpoints: before each bucket is compressed, :meth:`_match_layout` checks that the
    bucket's state was laid out for the parameters it holds now, and if not, cuts every bucket's state into
    per-parameter pieces and rebuilds the bucket's from them. A steady layout costs one tuple comparison per bucket.
    """

    def __init__(self, kind: str = "none", powersgd_state=None, names: dict | None = None):
        self.kind, self.powersgd_state = kind, powersgd_state
        self.names = names or {}          # id(parameter) -> its name in the model
        self._layouts: dict[int, tuple] = {}   # bucket index -> ((name, shape), ...) its state is laid out for
        self._owner: dict[str, int] = {}       # parameter name -> the bucket index its state lives in
        self._pieces: dict[str, dict] = {}     # parameter name -> {"error": tensor, "q": tensor}, between layouts

    # -- the hook ----------------------------------------------------------------------------------------------
    def powersgd_hook(self, state, bucket):
        """torch's ``powerSGD_hook`` on a state laid out for this bucket's parameters."""
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        if state.iter >= state.start_powerSGD_iter:
            self._match_layout(bucket)
        return powerSGD_hook.powerSGD_hook(state, bucket)

    def _layout(self, bucket) -> tuple:
        return tuple((self.names.get(id(p), str(id(p))), tuple(p.shape)) for p in bucket.parameters())

    def _match_layout(self, bucket) -> None:
        index, layout = bucket.index(), self._layout(bucket)
        if self._layouts.get(index) == layout:
            return
        if index in self._layouts or any(name in self._owner for name, _ in layout):
            self._to_pieces()  # the buckets were rebuilt: every bucket's state to per-parameter pieces first
        self._from_pieces(index, layout)
        self._layouts[index] = layout
        for name, _ in layout:
            self._owner[name] = index

    def _q_slices(self, layout: tuple) -> list[tuple[str, int]]:
        """(name, length) of each warm-start Q of a bucket in ``powerSGD_hook``'s order: the compressed matrices
        grouped by shape in order of first appearance, each group in bucket order."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        s = self.powersgd_state
        groups: dict[tuple, list] = {}
        for name, shape in layout:
            n = shape[0] if shape else 1
            m = math.prod(shape) // n if n else 0
            rank = min(n, m, s.matrix_approximation_rank)
            if _should_compress(n, m, rank, s.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, m * rank, n * rank))
        return [item for group in groups.values() for item in group]

    def _to_pieces(self) -> None:
        s = self.powersgd_state
        for index, layout in self._layouts.items():
            error = s.error_dict.pop(index, None)
            q = s.q_memory_dict.pop(index, None)
            s.p_memory_dict.pop(index, None)
            if error is not None:
                offset = 0
                for name, shape in layout:
                    numel = math.prod(shape)
                    self._pieces.setdefault(name, {})["error"] = error[offset:offset + numel].clone()
                    offset += numel
            if q is not None:
                offset = 0
                for name, length, _ in self._q_slices(layout):
                    self._pieces.setdefault(name, {})["q"] = q[offset:offset + length].clone()
                    offset += length
        self._layouts.clear()
        self._owner.clear()

    def _from_pieces(self, index: int, layout: tuple) -> None:
        s = self.powersgd_state
        pieces = [self._pieces.get(name, {}) for name, _ in layout]
        if pieces and all("error" in piece for piece in pieces):
            s.error_dict[index] = torch.cat([piece["error"] for piece in pieces])
        slices = self._q_slices(layout)
        if slices and all("q" in self._pieces.get(name, {}) for name, _, _ in slices):
            q = torch.cat([self._pieces[name]["q"] for name, _, _ in slices])
            s.q_memory_dict[index] = q
            s.p_memory_dict[index] = torch.empty(sum(p for _, _, p in slices), dtype=q.dtype, device=q.device)
        for name, _ in layout:
            self._pieces.pop(name, None)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict | None:
        s = self.powersgd_state
        if s is None:
            return None
        self._to_pieces()  # per parameter: valid whatever bucket layout the resumed run starts with
        saved = {slot: getattr(s, slot) for slot in s.__slots__
                 if slot not in ("process_group", "error_dict", "p_memory_dict", "q_memory_dict")}
        saved["per_parameter"] = dict(self._pieces)
        return saved

    def load_state_dict(self, saved: dict | None) -> bool:
        """Restore :meth:`state_dict` (same world size only: error feedback is per rank); True if restored."""
        s = self.powersgd_state
        if s is None or not saved:
            return False
        for slot, value in saved.items():
            if slot in s.__slots__ and slot != "process_group":
                setattr(s, slot, value)  # a checkpoint of an earlier version: its per-bucket dicts as they were
        if "per_parameter" in saved:
            s.error_dict, s.p_memory_dict, s.q_memory_dict = {}, {}, {}
            self._layouts.clear()
            self._owner.clear()
            self._pieces = dict(saved["per_parameter"])
        return True


def apply_ddp(model: nn.Module, pc: ParallelConfig, env: DistEnv, seed: int = 0) -> tuple[nn.Module, CommHook]:
    """Wrap ``model`` (already on ``env.device``) in DDP and register the configured comm hook. DDP broadcasts
    rank 0's weights, so every rank starts from the same model."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [env.device.index] if env.device.type == "cuda" else None
    ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    hook = CommHook(pc.comm_hook)
    if pc.comm_hook == "bf16":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ConfigError("parallel.comm_hook=bf16: torch's bf16 all-reduce hook needs CUDA + NCCL; "
                              "use fp16 on CPU/gloo")
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif pc.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif pc.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=pc.powersgd_rank,
            start_powerSGD_iter=pc.powersgd_start_iter, use_error_feedback=True, warm_start=True,
            random_seed=seed)
        hook.names = {id(p): name for name, p in model.named_parameters()}
        hook.powersgd_state = state
        ddp.register_comm_hook(state, hook.powersgd_hook)
    return ddp, hook


def refusals(req) -> list[str]:
    """DDP's declared rules (``plan.resolve``): gradient compression hooks belong to DDP / ZeRO-1's all-reduce."""
    pc = req.parallel
    if pc.comm_hook != "none" and req.mode not in ("ddp", "zero1") and (req.world_size or pc.mode != "auto") \
            and not pc.uses_mesh():
        return [f"parallel.comm_hook={pc.comm_hook!r} needs parallel.mode = ddp or zero1 (got {req.mode!r}); FSDP "
                f"reduces in its mixed-precision policy's reduce dtype instead"]
    return []
