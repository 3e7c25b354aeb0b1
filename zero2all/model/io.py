"""Model checkpoint directories: ours (``z2all.json`` + ``model.safetensors``) and HF Llama ones.

Our directory layout (also what the trainer writes in each ``ckpt-XXXXXX/``)::

    z2all.json            {"format": "zero2all", "model": {...ModelConfig...}, ...}
    model.safetensors     weights (never pickles)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json   (optional: the attached tokenizer)

``load_model(dir)`` is the one loader: it accepts either kind of directory, a training checkpoint of any world size,
and any of them with a LoRA adapter.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch

from zero2all.config import ConfigError, ModelConfig, from_dict, to_dict
from zero2all.fileio import atomic_dir, claim_output_dir, copy_file, save_json, save_safetensors
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


def read_our_json(f: Path) -> dict:
    """A checkpoint's ``z2all.json``; a damaged one is a ConfigError naming it (one line, exit code 2)."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{f}: damaged ({getattr(e, 'msg', 'not UTF-8 text')}); copy the checkpoint again, or "
                          f"point --ckpt at another one") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{f}: damaged (not a JSON object); copy the checkpoint again, or point --ckpt at another "
                          f"one")
    return data


def read_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if is_our_dir(path):
        data = read_our_json(path / OUR_CONFIG)
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
               atomic: bool = True, kind: str | None = None) -> Path:
    """Write ``model`` to directory ``path``. ``atomic``: built beside it and swapped in whole (``fileio.atomic_dir``),
    so a kill leaves the previous version; without it the files go straight into ``path``, for a caller that is
    itself writing a temporary directory (a training checkpoint). ``kind``: the output marker of the command that
    writes it (``fileio.claim_output_dir``, which the caller runs first)."""
    path = Path(path)
    if atomic:
        path.parent.mkdir(parents=True, exist_ok=True)
        where = atomic_dir(path, kind=kind)
    else:
        path.mkdir(parents=True, exist_ok=True)
        where = contextlib.nullcontext(path)
    with where as d:
        save_safetensors(_unique_state_dict(model), d / WEIGHTS, metadata={"format": "pt"})
        meta = {"format": "zero2all", "model": to_dict(model.cfg)}
        meta.update(extra or {})
        save_json(meta, d / OUR_CONFIG)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, d)
    return path


def copy_tokenizer_files(src: str | Path, dst: str | Path, for_transformers: bool = False) -> list[str]:
    """Copy the tokenizer files that ``src`` has into ``dst``, each atomically; returns the names copied.
    ``for_transformers``: ``dst`` is an HF export, so our chat template gets its guard against special-token text
    typed into a message (``zero2all.tokenizer.hf.guard_hf_chat_template``)."""
    copied = []
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.exists():
            copy_file(f, Path(dst) / name)
            copied.append(name)
    if for_transformers:
        from zero2all.tokenizer.hf import guard_hf_chat_template

        guard_hf_chat_template(dst)
    return copied


def load_state(model: Z2all, sd: dict[str, torch.Tensor], source: str) -> None:
    if model.cfg.tie_word_embeddings:
        sd = dict(sd)
        sd.setdefault("lm_head.weight", sd.get("embed_tokens.weight"))
    result = model.load_state_dict(sd, strict=False)
    missing = [k for k in result.missing_keys]
    if not missing and result.unexpected_keys and all(_is_lora_key(k) for k in result.unexpected_keys):
        raise ConfigError(f"{source}: the weights carry LoRA adapter tensors ({result.unexpected_keys[0]}, ...) "
                          f"but no adapter directory (adapter_config.json) to merge them with")
    if missing or result.unexpected_keys:
        raise ConfigError(f"{source}: weights do not match the config: missing {missing[:6]}, "
                          f"unexpected {result.unexpected_keys[:6]}")


def _is_lora_key(key: str) -> bool:
    return key.endswith((".lora_A", ".lora_B"))


def is_training_checkpoint(path: str | Path) -> bool:
    """A training checkpoint (torch.distributed.checkpoint files of any world size, ``zero2all/checkpoint/``)."""
    return (Path(path) / ".metadata").exists() and is_our_dir(path)


def load_checkpoint_weights(path: Path, model: Z2all) -> None:
    """The ``model`` part of a training checkpoint (torch.distributed.checkpoint files written by any number of
    processes) into ``model``, in this one process."""
    import warnings

    import torch.distributed.checkpoint as dcp

    sd = model.state_dict()
    with warnings.catch_warnings():  # no process group: one process reads every shard, by design
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": sd}, checkpoint_id=str(path))
    model.load_state_dict(sd)


def _has_weights(path: Path) -> bool:
    return is_our_dir(path) or is_hf_dir(path)


# model fields a loader may set differently from the directory's: they choose kernels and regularisation, not what
# the weights mean
MODEL_OVERRIDABLE = ("ops", "dropout1", "dropout2", "attention_dropout")


def _check_same_architecture(want: ModelConfig, have: ModelConfig, source: Path) -> None:
    a, b = to_dict(want), to_dict(have)
    diff = [f"model.{k}: {b[k]!r} in {source}, {a[k]!r} asked for" for k in a
            if k not in MODEL_OVERRIDABLE and a[k] != b.get(k)]
    if diff:
        raise ConfigError(f"{source}: the weights do not fit the requested architecture:\n  " + "\n  ".join(diff))


def weights_dir(path: str | Path) -> Path:
    """The directory holding the base weights of checkpoint ``path``: ``path`` itself, or for a lone LoRA adapter
    directory the base its ``base_model_name_or_path`` names."""
    from zero2all.model import lora

    path = Path(path)
    adapter = lora.find_adapter_dir(path)
    if adapter is None or _has_weights(path):
        return path
    _, raw = lora.read_adapter_config(adapter)
    base = Path(raw.get("base_model_name_or_path") or "")
    if not str(base) or not _has_weights(base):
        raise FileNotFoundError(f"{adapter / 'adapter_config.json'}: base_model_name_or_path {str(base)!r} is "
                                f"not a model directory (and {path} holds no base weights)")
    return base


def check_tokenizer_fits(tokenizer, cfg: ModelConfig, tokenizer_name: str, model_name: str = "",
                         training: bool = True) -> str | None:
    """The one check of a tokenizer against a model's vocabulary (training, and ``--tokenizer`` at inference).

    Raises ConfigError when the tokenizer's ids reach past the model's embedding rows; returns a ``warning:`` line
    when the model's vocabulary is larger than the tokenizer's (rows no id reaches: never trained, and ids the
    tokenizer cannot decode when generating), else None. Sizes compare as ``tokenizer.vocab_size`` (a multiple of
    64) against ``model.vocab_size`` (and its padded row count)."""
    n = int(tokenizer.vocab_size)
    model = f" {model_name}" if model_name else ""
    if n > cfg.padded_vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.vocab_size} is smaller than the tokenizer's vocabulary ({n} ids, "
                          f"tokenizer {tokenizer_name}): the model{model} has no embedding for ids >= "
                          f"{cfg.padded_vocab_size}; use the model's own tokenizer or a model with "
                          f"model.vocab_size >= {n}")
    if n < cfg.vocab_size:
        if training:
            return (f"warning: tokenizer {tokenizer_name} has {n} ids but the model{model} has a vocabulary of "
                    f"{cfg.vocab_size} (model.vocab_size): rows {n}..{cfg.vocab_size - 1} of the embedding and the "
                    f"LM head are never trained; set model.vocab_size={n} to leave them out")
        return (f"warning: tokenizer {tokenizer_name} has {n} ids but the model{model} has a vocabulary of "
                f"{cfg.vocab_size}: ids it generates from {n} on cannot be decoded")
    return None


def stored_tokenizer_hash(path: str | Path) -> tuple[str | None, str]:
    """(hash, where it was found) of the tokenizer checkpoint ``path`` was trained with: ``z2all.json``'s
    ``tokenizer_hash``, else the hash of the ``tokenizer.json`` stored with it; (None, "") when neither exists."""
    from zero2all.tokenizer.hf import canonical_hash

    path = Path(path)
    if is_our_dir(path):
        stored = read_our_json(path / OUR_CONFIG).get("tokenizer_hash")
        if stored:
            return stored, f"{path / OUR_CONFIG} tokenizer_hash"
    if (path / "tokenizer.json").exists():
        return canonical_hash((path / "tokenizer.json").read_text(encoding="utf-8")), str(path / "tokenizer.json")
    return None, ""


def check_inference_tokenizer(ckpt: str | Path, tokenizer, tokenizer_name: str) -> list[str]:
    """A tokenizer given instead of checkpoint ``ckpt``'s own (``--tokenizer`` of generate / chat / serve), checked
    before any weights are loaded: ConfigError when its ids exceed the model's vocabulary; ``warning:`` lines when
    it is not the tokenizer the checkpoint was trained with (both hashes named) or is smaller than the model's
    vocabulary."""
    ckpt = Path(ckpt)
    warnings = []
    line = check_tokenizer_fits(tokenizer, read_model_config(weights_dir(ckpt)), tokenizer_name, str(ckpt),
                                training=False)
    stored, where = stored_tokenizer_hash(ckpt)
    if stored is not None and stored != tokenizer.hash:
        warnings.append(f"warning: tokenizer {tokenizer_name} (hash {tokenizer.hash[:16]}) is not the one {ckpt} "
                        f"was trained with (hash {stored[:16]}, from {where}): its ids may stand for other text")
    if line:
        warnings.append(line)
    return warnings


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               ops: dict | None = None, config: ModelConfig | None = None, merge_lora: bool = True) -> Z2all:
    """THE model loader: every command and function that needs weights from a directory calls this one.

    ``path`` may be
      - our model directory (``z2all.json`` + ``model.safetensors``: ``final/``, ``import-hf`` output),
      - an HF Llama directory (``config.json`` + safetensors / .bin, sharded or not),
      - a training checkpoint ``ckpt-<step>/`` of any number of processes (its model part is read),
      - any of these with a LoRA adapter in PEFT layout beside the weights or in ``adapter/`` (merged in), or a
        lone adapter directory whose ``base_model_name_or_path`` names the base.
    ``ops`` overrides the op switchboard (e.g. ``{"attention": "naive"}``); ``config`` builds that architecture
    instead of the directory's (it must agree on everything but ops and dropouts: post-training sets those).
    ``merge_lora=False`` loads the base weights alone, leaving an attached adapter aside. Returns the model in eval
    mode on ``device`` (in ``dtype`` when given).
    """
    from zero2all.model import lora

    path = Path(path)
    adapter = lora.find_adapter_dir(path)
    base = weights_dir(path)
    stored = read_model_config(base)
    cfg = copy.deepcopy(config) if config is not None else stored
    if config is not None:
        _check_same_architecture(cfg, stored, base)
    for k, v in (ops or {}).items():
        setattr(cfg.ops, k, v)
    cfg.validate()
    model = build_model(cfg, device="meta").to_empty(device=device)
    model.tie_weights()
    if is_training_checkpoint(base):
        load_checkpoint_weights(base, model)
    elif is_our_dir(base):
        from safetensors.torch import load_file

        wfile = base / WEIGHTS
        if not wfile.exists():
            raise FileNotFoundError(f"{base}: {WEIGHTS} is missing")
        try:
            sd = load_file(str(wfile), device=str(device))
        except Exception as e:  # safetensors' own error: a truncated or foreign file
            if isinstance(e, OSError) and e.errno is not None:
                raise
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"{wfile}: damaged weights ({reason}); copy the checkpoint again, or point --ckpt at "
                              f"another one") from None
        if adapter is not None:  # a LoRA run's checkpoint of the earlier format kept the adapter tensors here too
            sd = {k: v for k, v in sd.items() if not _is_lora_key(k)}
        load_state(model, sd, str(base))
    else:
        sd = hfmap.state_dict_from_hf(hfmap.read_hf_weights(base), cfg, str(base))
        load_state(model, {k: v.to(device) for k, v in sd.items()}, str(base))
    model.tie_weights()
    if adapter is not None and merge_lora:
        lora.load_adapter(model, adapter)
        lora.merge_lora(model)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def export_hf(ckpt: str | Path, out: str | Path, dtype: str = "float32", tokenizer_dir: str | Path | None = None,
              model: Z2all | None = None) -> Path:
    """Write an HF ``LlamaForCausalLM`` directory (config.json, model.safetensors, generation_config.json and the
    tokenizer files when the checkpoint carries them).

    The directory is built beside ``out`` and swapped in whole (``fileio.atomic_dir``): a process killed at any
    point of an export over an existing one leaves the previous export, complete, under ``out``. ``out`` must be
    new, empty or an earlier export (``fileio.claim_output_dir``); the tokenizer is checked to load before anything
    is written."""
    src_tok = tokenizer_dir if tokenizer_dir is not None else ckpt
    claim_output_dir(out, "export-hf", inputs=[ckpt, tokenizer_dir])
    if src_tok is not None and (Path(src_tok) / "tokenizer.json").is_file():
        check_tokenizer_loads(src_tok, "--tokenizer" if tokenizer_dir is not None else "--ckpt")
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
    with atomic_dir(out, kind="export-hf") as tmp:
        save_safetensors(sd, tmp / WEIGHTS, metadata={"format": "pt"})
        save_json(hfmap.model_config_to_hf(cfg, dtype), tmp / hfmap.HF_CONFIG)
        save_json(gen, tmp / "generation_config.json")
        if src_tok is not None and Path(src_tok).is_dir():
            copy_tokenizer_files(src_tok, tmp, for_transformers=True)
    return out


def import_hf(hf_dir: str | Path, out: str | Path) -> Path:
    """Convert any Llama-architecture HF directory to our checkpoint format (tokenizer files carried along); the
    output directory is replaced whole, as by :func:`save_model`, and must be new, empty or an earlier import
    (``fileio.claim_output_dir``)."""
    claim_output_dir(out, "import-hf", inputs=[hf_dir])
    model = load_model(hf_dir)
    return save_model(model, out, extra={"imported_from": str(hf_dir)}, tokenizer_dir=hf_dir, kind="import-hf")


def check_tokenizer_loads(path: str | Path, option: str = "--tokenizer") -> None:
    """Raise ConfigError (one line naming the file) when the tokenizer files in ``path`` do not load, so that a
    command copying them refuses before writing anything rather than exporting a model no one can use."""
    from zero2all.tokenizer import load_tokenizer

    try:
        load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - truncated JSON, a model the tokenizers library rejects, ...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{option} {path}: its tokenizer does not load ({reason}); repair tokenizer.json or "
                          f"pass --tokenizer DIR") from None
