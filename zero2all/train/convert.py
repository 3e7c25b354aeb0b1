"""``z2all convert-checkpoint``: a training checkpoint of an earlier zero2all version into the current format.

Two earlier layouts existed. Single-process runs wrote ``model.safetensors`` + ``trainer_state.pt`` (optimizer
state keyed by parameter index, counters, every RNG state) + ``data_state.json``. Multi-process runs wrote DCP
files with ``model.*`` / ``optim.state.*`` keys (the same names the current format uses), ``rank<r>.pt`` per rank
(data position, RNG, PowerSGD state) and ``z2all.json`` of format ``zero2all-sharded`` with the counters. Both are
read here once and written as one current checkpoint with the same world size, so resuming continues the same
run. PowerSGD's error feedback is not carried over (it restarts from zero; the log says so).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from zero2all.checkpoint.files import LEGACY_SHARDED_FORMAT, META, RUN_CONFIG, CheckpointError, legacy_kind
from zero2all.checkpoint.state import JsonState, ModelState, OptimizerState, capture_rng_state
from zero2all.config import Config, from_dict, migrate_legacy_keys, to_dict
from zero2all.distributed.env import DistEnv

COUNTERS = ("step", "tokens_seen", "skipped_total", "elapsed_s", "objective", "scaler", "schedule")


class _AllRanks:
    """Every old rank's value written from this one process under ``rank<r>`` (what RankStates reads back)."""

    def __init__(self, values: list):
        self.values = values

    def state_dict(self) -> dict:
        return {f"rank{r}": json.dumps(v) for r, v in enumerate(self.values)}

    def load_state_dict(self, sd: dict) -> None:  # pragma: no cover - written only
        raise NotImplementedError


def _rng_as_json(old: dict) -> dict:
    """An RNG state of the earlier format (tuples, tensors) as the current JSON form (``capture_rng_state``)."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        random.setstate(tuple(old["python"]) if not isinstance(old["python"], tuple) else old["python"])
        n = old["numpy"]
        keys = n["keys"].numpy() if torch.is_tensor(n["keys"]) else np.asarray(n["keys"])
        np.random.set_state((n["kind"], keys.astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
        torch.set_rng_state(old["torch"])
        state = capture_rng_state()
        state.pop("cuda", None)
        return state
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def convert_checkpoint(old: str | Path, new: str | Path | None = None, log=print) -> Path:
    """Write ``old`` (an earlier-format training checkpoint) as a current checkpoint at ``new`` (default:
    ``OLD-v2`` beside it); returns ``new``."""
    from zero2all import checkpoint as ckpt_io
    from zero2all.model.z2all import build_model
    from zero2all.train.optim import build_optimizer

    old = Path(old)
    kind = legacy_kind(old)
    if kind is None:
        raise CheckpointError(f"{old}: not a training checkpoint of an earlier format (nothing to convert)")
    new = Path(new) if new is not None else old.with_name(f"{old.name}-v{ckpt_io.FORMAT_VERSION}")
    if new.exists():
        raise CheckpointError(f"{new} exists already; choose another --out")
    cfg: Config = from_dict(Config, migrate_legacy_keys(json.loads((old / RUN_CONFIG).read_text()), warn=log))
    model = build_model(cfg.model, device="cpu")
    if cfg.post.lora_rank > 0:  # the run trained adapters: the checkpoint holds base + adapter tensors
        from zero2all.train.posttrain import apply_lora_from_config

        apply_lora_from_config(model, cfg)
    optimizer = build_optimizer(model, cfg.train, torch.device("cpu"))
    meta = json.loads((old / META).read_text())
    if kind == "single-process":
        from safetensors.torch import load_file

        sd = load_file(str(old / "model.safetensors"))
        if cfg.model.tie_word_embeddings:
            sd.setdefault("lm_head.weight", sd["embed_tokens.weight"])
        model.load_state_dict(sd)
        state = torch.load(old / "trainer_state.pt", map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state["optimizer"])  # index-keyed, in build_optimizer's parameter order
        counters = {k: state[k] for k in COUNTERS if k in state}
        world = 1
        data = [json.loads((old / "data_state.json").read_text())]
        rngs = [_rng_as_json(state["rng"])]
    else:
        assert meta.get("format") == LEGACY_SHARDED_FORMAT
        import torch.distributed.checkpoint as dcp

        world = int(meta["world_size"])
        parts = {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}
        dcp.load(parts, checkpoint_id=str(old))
        counters = {k: meta["trainer"][k] for k in COUNTERS if k in meta["trainer"]}
        own = [torch.load(old / f"rank{r}.pt", map_location="cpu", weights_only=False) for r in range(world)]
        data = [o["data_state"] for o in own]
        rngs = [_rng_as_json(o["rng"]) for o in own]
        if any("comm_hook" in o for o in own):
            log(f"{old}: PowerSGD error feedback is not converted; it restarts from zero on resume")
    counters.setdefault("objective", meta.get("trainer", {}).get("objective", "pretrain"))
    step = int(counters["step"])
    parts = {"model": ModelState(model), "optim": OptimizerState(model, optimizer),
             "trainer": JsonState(lambda: counters, None), "data": _AllRanks(data), "rng": _AllRanks(rngs)}

    def extras(tmp: Path) -> None:
        from zero2all.fileio import copy_file

        for f in sorted(old.iterdir()):  # run config, tokenizer files (and a LoRA run's adapter/ is copied below)
            if f.is_file() and f.name not in ("model.safetensors", "trainer_state.pt", "data_state.json", META,
                                              ".metadata") and not f.name.endswith((".distcp", ".pt")):
                copy_file(f, tmp / f.name)
        if (old / "adapter").is_dir():
            (tmp / "adapter").mkdir()
            for f in (old / "adapter").iterdir():
                copy_file(f, tmp / "adapter" / f.name)

    ckpt_io.save(new, parts, DistEnv(), {"step": step, "world_size": world, "parallel": "converted",
                                         "model": to_dict(cfg.model), "objective": counters["objective"],
                                         "tokenizer_hash": meta.get("tokenizer_hash",
                                                                    meta.get("trainer", {}).get("tokenizer_hash")),
                                         "converted_from": str(old)}, write_extra=extras)
    log(f"converted {old} ({kind}, {world} process{'es' if world > 1 else ''}, step {step}) -> {new}")
    return new
