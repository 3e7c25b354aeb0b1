"""Model checkpoint directories: ours (``z2all.json`` + ``model.safetensors``) and HF Llama ones.

Our directory layout (also what the trainer writes in each ``ckpt-XXXXXX/``)::

    z2all.json            {"format": "zero2all", "model": {...ModelConfig...}, ...}
    model.safetensors     weights (never pickles)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json   (optional: the attached tokenizer)

``load_model(dir)`` accepts either kind of directory.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from zero2all.config import ConfigError, ModelConfig, from_dict, to_dict
from zero2all.fileio import atomic_dir, copy_file, save_json
from zero2all.model import hf as hfmap
from zero2all.model.z2all import Z2all, build_model

OUR_CONFIG = "z2all.json"
WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "z2all_tokenizer.json")


def is_our_dir(path: str | Path) -> bool:
    return (Path(path) / OUR_CONFIG).exists()


def is_hf_dir(path: str | Path) -> bool:
    return (Path(path) / hfmap.HF_CONFIG).exists() and not is_our_dir(path)


def read_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if is_our_dir(path):
        data = json.loads((path / OUR_CONFIG).read_text())
        if "model" not in data:
            raise ConfigError(f"{path / OUR_CONFIG}: no 'model' section")
        cfg = from_dict(ModelConfig, data["model"], "model")
        cfg.validate()
        return cfg
    if is_hf_dir(path):
        return hfmap.read_hf_config(path)
    raise FileNotFoundError(f"{path}: neither a Zero2all checkpoint ({OUR_CONFIG}) nor an HF model (config.json)")


def _unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # safetensors refuses shared storage; the tie is in the config
    return sd


def save_model(model: Z2all, path: str | Path, extra: dict | None = None, tokenizer_dir: str | Path | None = None,
               atomic: bool = True) -> Path:
    """Write ``model`` to directory ``path``. ``atomic``: built beside it and swapped in whole (``fileio.atomic_dir``),
    so a kill leaves the previous version; without it the files go straight into ``path``, for a caller that is
    itself writing a temporary directory (a training checkpoint)."""
    from safetensors.torch import save_file

    path = Path(path)
    if atomic:
        path.parent.mkdir(parents=True, exist_ok=True)
        where = atomic_dir(path)
    else:
        path.mkdir(parents=True, exist_ok=True)
        where = contextlib.nullcontext(path)
    with where as d:
        save_file(_unique_state_dict(model), str(d / WEIGHTS), metadata={"format": "pt"})
        meta = {"format": "zero2all", "model": to_dict(model.cfg)}
        meta.update(extra or {})
        save_json(meta, d / OUR_CONFIG)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, d)
    return path


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files that ``src`` has into ``dst``, each atomically; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.exists():
            copy_file(f, Path(dst) / name)
            copied.append(name)
    return copied


def load_state(model: Z2all, sd: dict[str, torch.Tensor], source: str) -> None:
    if model.cfg.tie_word_embeddings:
        sd = dict(sd)
        sd.setdefault("lm_head.weight", sd.get("embed_tokens.weight"))
    result = model.load_state_dict(sd, strict=False)
    missing = [k for k in result.missing_keys]
    if not missing and result.unexpected_keys and all(_is_lora_key(k) for k in result.unexpected_keys):
        raise ConfigError(f"{source}: the weights carry LoRA adapter tensors ({result.unexpected_keys[0]}, ...): "
                          f"load the checkpoint with zero2all.load_model or model.lora.load_merged_model, which "
                          f"merge its adapter/")
    if missing or result.unexpected_keys:
        raise ConfigError(f"{source}: weights do not match the config: missing {missing[:6]}, "
                          f"unexpected {result.unexpected_keys[:6]}")


def _is_lora_key(key: str) -> bool:
    return key.endswith((".lora_A", ".lora_B"))


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               ops: dict | None = None, drop_lora_tensors: bool = False) -> Z2all:
    """Load our checkpoint directory or an HF Llama directory; returns the model in eval mode.

    ``ops`` overrides the op switchboard, e.g. ``{"attention": "naive"}``. ``drop_lora_tensors``: a LoRA run's
    training checkpoint (``ckpt-XXXXXX/``) stores the adapter tensors beside the base weights (for exact resume)
    and the same adapter in ``adapter/``; with this flag the base loads alone (``load_merged_model`` then merges
    the adapter).
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_model_config(path)
    for k, v in (ops or {}).items():
        setattr(cfg.ops, k, v)
    cfg.validate()
    model = build_model(cfg, device="meta")
    if is_our_dir(path):
        wfile = path / WEIGHTS
        if not wfile.exists():
            raise FileNotFoundError(f"{path}: {WEIGHTS} is missing")
        sd = load_file(str(wfile))
        if drop_lora_tensors:
            sd = {k: v for k, v in sd.items() if not _is_lora_key(k)}
    else:
        sd = hfmap.state_dict_from_hf(hfmap.read_hf_weights(path), cfg, str(path))
    model = model.to_empty(device=device)
    load_state(model, sd, str(path))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def export_hf(ckpt: str | Path, out: str | Path, dtype: str = "float32", tokenizer_dir: str | Path | None = None,
              model: Z2all | None = None) -> Path:
    """Write an HF ``LlamaForCausalLM`` directory (config.json, model.safetensors, generation_config.json and the
    tokenizer files when the checkpoint carries them).

    The directory is built beside ``out`` and swapped in whole (``fileio.atomic_dir``): a process killed at any
    point of an export over an existing one leaves the previous export, complete, under ``out``."""
    from safetensors.torch import save_file

    model = model if model is not None else load_model(ckpt)
    cfg = model.cfg
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sd = hfmap.state_dict_to_hf({k: v.detach().cpu().to(torch_dtype) for k, v in model.state_dict().items()}, cfg)
    gen = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, key) is not None:
            gen[key] = getattr(cfg, key)
    src_tok = tokenizer_dir if tokenizer_dir is not None else ckpt
    with atomic_dir(out) as tmp:
        save_file(sd, str(tmp / WEIGHTS), metadata={"format": "pt"})
        save_json(hfmap.model_config_to_hf(cfg, dtype), tmp / hfmap.HF_CONFIG)
        save_json(gen, tmp / "generation_config.json")
        if src_tok is not None and Path(src_tok).is_dir():
            copy_tokenizer_files(src_tok, tmp)
    return out


def import_hf(hf_dir: str | Path, out: str | Path) -> Path:
    """Convert any Llama-architecture HF directory to our checkpoint format (tokenizer files carried along); the
    output directory is replaced whole, as by :func:`save_model`."""
    model = load_model(hf_dir)
    return save_model(model, out, extra={"imported_from": str(hf_dir)}, tokenizer_dir=hf_dir)
