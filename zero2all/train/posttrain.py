"""Post-training runs, ``z2all sft`` and ``z2all dpo``: the shared trainer with another objective and other data.

What this file adds to pretraining, and nothing else:

- **the starting point**: ``post.init`` names a pretrained checkpoint (ours, an HF Llama directory, or a base
  model with a LoRA adapter, merged on load). The model section of the run config is that checkpoint's; only the
  op choices and dropouts may be overridden (``model.ops.attention=...``), since the weights fix the rest.
- **the data**: chat records (``zero2all/data/chat.py``: instruction or conversation format, rendered with the
  tokenizer's chat template, labels on assistant tokens only), packed or padded (``post.packing``), from jsonl
  files in memory or from a ``z2all prepare-sft`` directory read by memory map (``zero2all/data/sft_shards.py``);
  DPO pairs ``{"prompt" | "conversations", "chosen", "rejected"}``.
- **the objective**: :class:`~zero2all.train.objectives.SFTObjective` or
  :class:`~zero2all.train.objectives.DPOObjective`; the loop, checkpoints and exact resume are the trainer's.
- **LoRA** (``post.lora_rank`` > 0): only the adapters train (the optimiser sees no other parameter). Training
  checkpoints keep the full state (base + adapter tensors, so resume is exact) plus ``adapter/`` in the PEFT
  layout; ``final/`` holds the unchanged base weights with ``final/adapter/`` beside them, which
  ``z2all generate/chat/serve --ckpt OUT/final`` and ``export-hf --merge-lora`` merge on load, and which
  ``peft.PeftModel.from_pretrained`` loads onto the exported base model.
- **the DPO reference**: a frozen copy of ``post.ref`` (default: the initial model) next to the policy, or, with
  ``post.precompute_ref``, its log-probs of every pair computed once before training (cached in
  ``OUT/reference_logprobs.pt``) so that only one model is in memory during training.

Resuming (``--resume auto``) also checks that the post-training settings that shape the run (init, data, packing,
LoRA, beta, reference) are the checkpoint's.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from zero2all import checkpoint as ckpt_io
from zero2all import distributed as zd
from zero2all.checkpoint.compat import CheckpointMismatch
from zero2all.config import Config, ConfigError, build_config_dict, deep_merge, from_dict, to_dict
from zero2all.fileio import OutputDirError, atomic_write
from zero2all.train.objectives import DPOObjective, SFTObjective
from zero2all.train.trainer import Trainer, autocast_context, claim_run_dir, data_seq_len, resolve_precision

# train-section defaults of the two stages (a --config file and key=value overrides come on top)
SFT_TRAIN_DEFAULTS = {"out_dir": "runs/sft", "lr": 2e-5, "min_lr": 2e-6, "warmup_steps": 20, "weight_decay": 0.0,
                      "max_steps": 1000, "micro_batch_size": 8, "eval_every": 100, "eval_batches": 10,
                      "ckpt_every": 200, "num_samples": 0, "sample_temperature": 0.7}
DPO_TRAIN_DEFAULTS = {"out_dir": "runs/dpo", "lr": 1e-6, "min_lr": 1e-7, "warmup_steps": 10, "weight_decay": 0.0,
                      "max_steps": 500, "micro_batch_size": 4, "eval_every": 100, "eval_batches": 10,
                      "ckpt_every": 100, "num_samples": 0}
# reward models (zero2all/train/reward.py) and online RL (zero2all/train/rl_run.py) start like post-training runs
REWARD_TRAIN_DEFAULTS = dict(DPO_TRAIN_DEFAULTS, out_dir="runs/reward", lr=1e-5, min_lr=1e-6)
RL_TRAIN_DEFAULTS = dict(DPO_TRAIN_DEFAULTS, out_dir="runs/rl", lr=1e-6, min_lr=1e-6, warmup_steps=0,
                         micro_batch_size=8, eval_batches=4)
STAGE_TRAIN_DEFAULTS = {"sft": SFT_TRAIN_DEFAULTS, "dpo": DPO_TRAIN_DEFAULTS, "reward": REWARD_TRAIN_DEFAULTS,
                        "rl": RL_TRAIN_DEFAULTS}
# model fields a run may change relative to its init checkpoint (the weights fix everything else)
MODEL_OVERRIDABLE = ("ops", "dropout1", "dropout2", "attention_dropout")
# post-section fields a resumed run must share with its checkpoint
MUST_MATCH_POST = {"sft": ("init", "data", "valid", "valid_fraction", "packing", "lora_rank", "lora_alpha",
                           "lora_dropout", "lora_targets", "prompt_tuning", "num_virtual_tokens"),
                   "dpo": ("init", "data", "valid", "valid_fraction", "lora_rank", "lora_alpha", "lora_dropout",
                           "lora_targets", "beta", "ref", "prompt_tuning", "num_virtual_tokens"),
                   "reward": ("init", "data", "valid", "valid_fraction"),
                   "rl": ("init", "data", "valid", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "ref")}
REFERENCE_CACHE = "reference_logprobs.pt"
PROMPT_ADAPTER = "prompt_adapter"  # final/prompt_adapter/: a prompt / prefix tuning adapter in PEFT's layout


# --------------------------------------------------------------------------------------------------------------
# configuration


def posttrain_config(stage: str, config_file: str | Path | None = None, overrides: list[str] | None = None,
                     values: dict | None = None, *, sources: dict | None = None) -> Config:
    """The run config of an ``sft`` / ``dpo`` run. Lowest first: the stage's train defaults, ``config_file`` (a
    .toml; its model section may only set ops / dropouts), ``values`` (typed, by dotted key: what the command
    line's options set), ``key=value`` overrides; a key both in ``values`` and in an override is refused (see
    ``zero2all.config.build_config_dict``). The model section is read from ``post.init``."""
    from zero2all.model.io import read_model_config

    if stage not in STAGE_TRAIN_DEFAULTS:
        raise ValueError(f"stage: {stage!r} is not one of {', '.join(STAGE_TRAIN_DEFAULTS)}")
    user = build_config_dict(config_file, overrides, values, sources=sources)
    post = user.get("post", {})
    if not isinstance(post, dict):
        raise ConfigError(f"post: expected a table, got {post!r}")
    init = post.get("init", "")
    if not isinstance(init, str):
        raise ConfigError(f"post.init: expected a string, got {init!r}")
    if not init:
        raise ConfigError("post.init: a post-training run starts from a pretrained checkpoint (--init DIR)")
    if not Path(init).is_dir():
        raise FileNotFoundError(f"post.init: {init} is not a checkpoint directory")
    for key in user.get("model") or {}:
        if key not in MODEL_OVERRIDABLE:
            raise ConfigError(f"model.{key}: comes from the --init checkpoint {init}; only "
                              f"{', '.join('model.' + k for k in MODEL_OVERRIDABLE)} may be overridden")
    defaults = {"model": to_dict(read_model_config(init)),
                "train": STAGE_TRAIN_DEFAULTS[stage]}
    cfg = from_dict(Config, deep_merge(defaults, user)).validate()  # the post section is checked there too
    if not cfg.post.data:
        raise ConfigError("post.data: no training data (--data FILE...)")
    if not cfg.data.path:  # for the run's description and report only: the trainer is given the datasets
        cfg.data.path = ", ".join(cfg.post.data)
    return cfg


def check_resume_compatible(cfg: Config, stage: str) -> None:
    """Refuse to resume from a checkpoint whose post-training settings differ (naming every field)."""
    t = cfg.train
    if t.resume == "":
        return
    ckpt = ckpt_io.newest_verified(t.out_dir)[0] if t.resume == "auto" else Path(t.resume)
    if ckpt is None or not (Path(ckpt) / ckpt_io.RUN_CONFIG).exists():
        return
    saved = json.loads((Path(ckpt) / ckpt_io.RUN_CONFIG).read_text(encoding="utf-8")).get("post", {})
    now = to_dict(cfg.post)
    problems = [f"post.{k}: {saved.get(k)!r} in the checkpoint, {now[k]!r} now"
                for k in MUST_MATCH_POST[stage] if saved.get(k) != now[k]]
    if problems:
        raise CheckpointMismatch(f"checkpoint {ckpt} does not match this run:\n  " + "\n  ".join(problems))


# --------------------------------------------------------------------------------------------------------------
# model and tokenizer


def load_pretrained(path: str | Path, model_cfg, device) -> torch.nn.Module:
    """``path``'s weights in a model of ``model_cfg`` (the checkpoint's architecture, maybe other ops or dropouts),
    through the one loader, in training mode."""
    from zero2all.model.io import load_model

    return load_model(path, device=device, config=model_cfg).train()


def apply_lora_from_config(model: torch.nn.Module, cfg: Config) -> tuple[int, int]:
    """Wrap the target linears with LoRA adapters; returns (trainable, total) parameter counts."""
    from zero2all.model.lora import LoRAConfig, apply_lora, mark_only_lora_trainable

    p = cfg.post
    lcfg = LoRAConfig(rank=p.lora_rank, alpha=p.lora_alpha, dropout=p.lora_dropout, targets=tuple(p.lora_targets))
    torch.manual_seed(cfg.train.seed)  # lora_A's initialisation: the same in every run of this seed
    try:
        apply_lora(model, lcfg)
    except ValueError as e:
        raise ConfigError(str(e).replace("lora.", "post.lora_", 1)) from None
    return mark_only_lora_trainable(model)


def base_weights_model(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model sharing ``model``'s base weights (LoRA tensors left out, nothing merged or copied)."""
    from zero2all.model.z2all import build_model

    plain = build_model(model.cfg, device="meta")
    sd = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith(("lora_A", "lora_B"))}
    plain.load_state_dict(sd, assign=True)
    plain.tie_weights()
    return plain


def load_run_tokenizer(cfg: Config, out_dir: Path, env: zd.DistEnv | None = None):
    """The run's tokenizer (``post.tokenizer``, else the init checkpoint's), copied to ``OUT/tokenizer`` (the
    trainer copies it into every checkpoint from there); returns (tokenizer, that directory)."""
    from zero2all.model.io import copy_tokenizer_files
    from zero2all.tokenizer import load_tokenizer

    src = Path(cfg.post.tokenizer or cfg.post.init)
    try:
        tok = load_tokenizer(src)
    except (FileNotFoundError, OSError, ValueError) as e:
        raise ConfigError(f"post.tokenizer: no usable tokenizer in {src} ({e}); pass --tokenizer DIR") from None
    if getattr(tok, "im_end_id", None) is None or getattr(tok, "im_start_id", None) is None:
        raise ConfigError(f"post.tokenizer: {src} has no <|im_start|>/<|im_end|> tokens, so no chat template")
    if tok.vocab_size > cfg.model.padded_vocab_size:
        raise ConfigError(f"post.tokenizer: {src} has {tok.vocab_size} tokens but the model {cfg.post.init} only "
                          f"{cfg.model.padded_vocab_size}")
    tok_dir = out_dir / "tokenizer"
    if env is None or env.is_main:
        tok_dir.mkdir(parents=True, exist_ok=True)
        if not copy_tokenizer_files(src, tok_dir):
            raise ConfigError(f"post.tokenizer: {src} holds no tokenizer files")
    if env is not None:
        zd.barrier(env)
    return tok, tok_dir


def _pad_id(tok) -> int:
    return tok.pad_id if tok.pad_id is not None else tok.eos_id


# --------------------------------------------------------------------------------------------------------------
# data


def _split_holdout(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, valid): a seeded random ``fraction`` of the items held out (at least one when fraction > 0)."""
    if fraction <= 0 or len(items) < 2:
        return items, []
    order = np.random.default_rng(seed).permutation(len(items))
    n_valid = min(len(items) - 1, max(1, round(fraction * len(items))))
    held = set(order[:n_valid].tolist())
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def _report(what: str, stats, rank: int = 0) -> None:
    if rank != 0:
        return
    print(f"{what}: {stats.summary()}")
    for msg in stats.errors[:3]:
        print(f"  skipped: {msg}")


def build_sft_data(cfg: Config, tok, rank: int = 0, world_size: int = 1):
    """(train, valid or None) SFT datasets for ``cfg.post``; both carry ``tokenizer_hash``."""
    from zero2all.data.chat import SFTDataset, load_sft_samples
    from zero2all.data.sft_shards import SFTShardDataset, is_sft_shard_dir

    p, seq_len, pad = cfg.post, data_seq_len(cfg), _pad_id(tok)
    if len(p.data) == 1 and Path(p.data[0]).is_dir():
        if not is_sft_shard_dir(p.data[0]):
            raise ConfigError(f"post.data: {p.data[0]} is a directory but not a `z2all prepare-sft` output")
        train = SFTShardDataset(p.data[0], seq_len, pad, p.packing, "train", rank, world_size, tokenizer=tok)
        _report(f"{p.data[0]} (train)", train.stats, rank)
        valid = SFTShardDataset(p.data[0], seq_len, pad, p.packing, "valid", rank, world_size, tokenizer=tok)
        valid = valid if len(valid) else None
    else:
        samples, valid_samples, stats = _load_with_holdout(load_sft_samples, cfg, tok, seq_len, rank)
        if not samples:
            raise ConfigError(f"post.data: no usable SFT samples in {', '.join(p.data)} ({stats.summary()})")
        train = SFTDataset(samples, seq_len, pad, p.packing, rank, world_size)
        valid = SFTDataset(valid_samples, seq_len, pad, p.packing, rank, world_size) if valid_samples else None
        if valid is not None and len(valid) == 0:
            valid = None
    for ds in (train, valid):
        if ds is not None:
            ds.tokenizer_hash = tok.hash
    n_label = sum(int((train[i]["labels"] != -100).sum()) for i in range(min(len(train), 64)))
    if rank == 0:
        print(f"SFT data: {len(train):,} {'packed' if p.packing == 'pack' else 'padded'} rows of {seq_len} tokens"
              + (f", {len(valid):,} validation rows" if valid is not None else ", no validation split")
              + f"; {n_label / max(1, min(len(train), 64) * seq_len):.0%} of the tokens are learned")
    return train, valid


class ReferenceLogprobDataset:
    """DPO pairs whose batches also carry precomputed reference log-probs ``ref_chosen_logps`` and
    ``ref_rejected_logps`` (B,), taken from ``ref`` (N, 2) by pair index."""

    def __init__(self, pairs_dataset, ref: torch.Tensor):
        if ref.shape != (len(pairs_dataset), 2):
            raise ValueError(f"reference log-probs of shape {tuple(ref.shape)} for {len(pairs_dataset)} pairs")
        self.base, self.ref = pairs_dataset, ref.float()
        self.tokenizer_hash = getattr(pairs_dataset, "tokenizer_hash", None)

    def __len__(self) -> int:
        return len(self.base)

    def batch(self, indices):
        out = self.base.batch(indices)
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        out["ref_chosen_logps"] = self.ref[idx, 0]
        out["ref_rejected_logps"] = self.ref[idx, 1]
        return out

    def iterator(self, batch_size: int, seed: int = 0, shuffle: bool = True):
        from zero2all.data.chat import ItemIterator

        return ItemIterator(self, batch_size, seed, shuffle)


def _load_with_holdout(load, cfg: Config, tok, seq_len: int, rank: int):
    """(train items, valid items, train stats): ``post.valid`` files when given, else a seeded holdout of
    ``post.valid_fraction`` of ``post.data``. ``load`` is load_sft_samples or load_dpo_samples."""
    p = cfg.post
    items, stats = load(p.data, tok, max_len=seq_len + 1, on_error=p.on_error)
    _report(", ".join(p.data), stats, rank)
    if p.valid:
        valid, vstats = load(p.valid, tok, max_len=seq_len + 1, on_error=p.on_error)
        _report(", ".join(p.valid), vstats, rank)
    else:
        items, valid = _split_holdout(items, p.valid_fraction, cfg.train.seed)
    return items, valid, stats


def build_dpo_data(cfg: Config, tok, rank: int = 0, world_size: int = 1):
    """(train, valid or None) DPO pair datasets for ``cfg.post``."""
    from zero2all.data.chat import DPODataset, load_dpo_samples
    from zero2all.data.sft_shards import DPOShardDataset, is_sft_shard_dir

    p, seq_len, pad = cfg.post, data_seq_len(cfg), _pad_id(tok)
    if len(p.data) == 1 and Path(p.data[0]).is_dir():
        if not is_sft_shard_dir(p.data[0], "dpo"):
            raise ConfigError(f"post.data: {p.data[0]} is a directory but not a `z2all prepare-dpo` output")
        train = DPOShardDataset(p.data[0], seq_len, pad, "train", rank, world_size, tokenizer=tok)
        _report(f"{p.data[0]} (train)", train.stats, rank)
        if not len(train):
            raise ConfigError(f"post.data: no usable preference pairs in {p.data[0]} ({train.stats.summary()})")
        valid = DPOShardDataset(p.data[0], seq_len, pad, "valid", rank, world_size, tokenizer=tok)
    else:
        pairs, valid_pairs, stats = _load_with_holdout(load_dpo_samples, cfg, tok, seq_len, rank)
        if not pairs:
            raise ConfigError(f"post.data: no usable preference pairs in {', '.join(p.data)} ({stats.summary()})")
        train = DPODataset(pairs, seq_len, pad, rank, world_size)
        valid = DPODataset(valid_pairs, seq_len, pad, rank, world_size) if valid_pairs else None
    if valid is not None and len(valid) == 0:
        valid = None
    for ds in (train, valid):
        if ds is not None:
            ds.tokenizer_hash = tok.hash
    if rank == 0:
        print(f"DPO data: {len(train):,} pairs" + (f", {len(valid):,} validation pairs" if valid else ""))
    return train, valid


def _pairs_fingerprint(pairs, ref_dir: Path, precision: str) -> str:
    h = hashlib.sha256()
    h.update(str(ref_dir.resolve()).encode() + precision.encode())
    for f in sorted(ref_dir.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".json"):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for pair in pairs:
        for s in (pair.chosen, pair.rejected):
            h.update(np.asarray(s.input_ids, dtype=np.int64).tobytes())
            h.update(np.asarray(s.labels, dtype=np.int64).tobytes())
    return h.hexdigest()


def reference_logprobs(ref_model, dataset, cfg: Config, device, precision: str, cache: Path | None) -> torch.Tensor:
    """(N, 2) [chosen, rejected] log-probs of the dataset's pairs under the frozen reference, under the run's
    autocast (so they equal what the frozen-model mode computes during training). Cached in ``cache`` with a
    fingerprint of the pairs and the reference files; a resumed run reuses them."""
    from zero2all.train.dpo import precompute_reference_logprobs

    ref_dir = Path(cfg.post.ref or cfg.post.init)
    fingerprint = _pairs_fingerprint(dataset.pairs, ref_dir, precision)
    if cache is not None and cache.exists():
        saved = torch.load(cache, map_location="cpu", weights_only=True)
        if saved.get("fingerprint") == fingerprint:
            print(f"reference log-probs: reusing {cache}")
            return saved["logprobs"]
    with autocast_context(precision, device):
        ref = precompute_reference_logprobs(ref_model, dataset.pairs, dataset.pad_id,
                                            batch_size=cfg.train.micro_batch_size, device=device)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(cache, "wb") as f:
            torch.save({"fingerprint": fingerprint, "logprobs": ref}, f)
    return ref


# --------------------------------------------------------------------------------------------------------------
# the trainer, with LoRA adapters written in the PEFT layout and chat-formatted samples


class PostTrainer(Trainer):
    """The shared :class:`~zero2all.train.trainer.Trainer`; with LoRA it also writes ``adapter/`` (PEFT layout)
    into each checkpoint and lays out ``final/`` as base weights + ``final/adapter/``. Samples are replies to
    ``train.sample_prompts`` sent as user messages through the chat template."""

    def __init__(self, cfg: Config, objective, *, init_dir: str | Path, **kwargs):
        self.init_dir = Path(init_dir)
        super().__init__(cfg, objective, **kwargs)   # LoRA with FSDP is refused by the plan (fsdp.refusals)

    @property
    def uses_lora(self) -> bool:
        from zero2all.model.lora import lora_modules

        return bool(lora_modules(self.raw_model))

    def write_adapter(self, path: Path) -> Path:
        """``path/adapter_config.json`` + ``adapter_model.safetensors`` (+ the tokenizer files, so the adapter
        directory alone serves ``--ckpt``: its base is ``post.init``)."""
        from zero2all.model.io import copy_tokenizer_files
        from zero2all.model.lora import find_adapter_dir, save_adapter

        base = "" if find_adapter_dir(self.init_dir) is not None else str(self.init_dir.resolve())
        save_adapter(self.raw_model, path, base_model_name_or_path=base)
        if self.tokenizer_dir is not None:
            copy_tokenizer_files(self.tokenizer_dir, path)
        return path

    @property
    def uses_prompt_tuning(self) -> bool:
        from zero2all.model.prompt_tuning import PromptTuned

        return isinstance(self.raw_model, PromptTuned)

    def write_prompt_adapter(self, path: Path) -> Path:
        from zero2all.model.prompt_tuning import save_prompt_adapter

        return save_prompt_adapter(self.raw_model, path, base_model_name_or_path=str(self.init_dir.resolve()))

    def write_checkpoint_extras(self, tmp: Path) -> None:
        super().write_checkpoint_extras(tmp)
        if self.uses_lora:  # the adapter alone in the PEFT layout, inside the checkpoint (covered by its manifest)
            self.write_adapter(tmp / "adapter")
        if self.uses_prompt_tuning:
            self.write_prompt_adapter(tmp / PROMPT_ADAPTER)

    def final_model(self):
        """With LoRA, ``final/`` holds the unchanged base weights; the adapter is written beside them (prompt or
        prefix tuning: the base weights and ``final/prompt_adapter/``)."""
        if self.uses_prompt_tuning:
            return self.raw_model.model if self.is_main else None
        if not self.uses_lora:
            return super().final_model()
        return base_weights_model(self.raw_model) if self.is_main else None

    def finish(self) -> dict:
        summary = super().finish()
        if self.is_main and self.uses_lora:
            adapter = self.write_adapter(Path(summary["final"]) / "adapter")
            self._print(f"wrote the LoRA adapter (PEFT layout) to {adapter}")
            summary["adapter"] = str(adapter)
        if self.is_main and self.uses_prompt_tuning:
            adapter = self.write_prompt_adapter(Path(summary["final"]) / PROMPT_ADAPTER)
            self._print(f"wrote the {self.raw_model.method} tuning adapter (PEFT layout) to {adapter}")
            summary["adapter"] = str(adapter)
        return summary

    def _sample_prompts(self):
        t, tok = self.tcfg, self.tokenizer
        if not t.sample_prompts or tok is None:
            return super()._sample_prompts()
        return [(p, list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)))
                for p in t.sample_prompts[:t.num_samples]]


# --------------------------------------------------------------------------------------------------------------
# the two runs


def _prepare(cfg: Config, stage: str):
    """Check resume settings, join the process group (under torchrun), load tokenizer and model (+ LoRA). The
    environment is handed to the trainer, which joins no group of its own; the precision is the trainer's rule
    (``resolve_precision``), needed here for DPO's reference log-probs before the trainer exists."""
    check_resume_compatible(cfg, stage)
    from zero2all.distributed.plan import launched_world_size, resolve

    resolve(cfg, launched_world_size())   # every parallel refusal, before the process group exists
    try:  # before the model loads: the trainer claims it again and locks it when it starts
        claim_run_dir(cfg.train.out_dir, stage)
    except OutputDirError as e:
        raise ConfigError(str(e)) from None
    env = zd.init_distributed(cfg.train.device, timeout_s=cfg.parallel.timeout_s)
    if env.is_main:  # marked before the run's tokenizer is copied into it
        claim_run_dir(cfg.train.out_dir, stage, mark=True)
    device, out_dir = env.device, Path(cfg.train.out_dir)
    precision = resolve_precision(cfg.train.precision, device)
    tok, tok_dir = load_run_tokenizer(cfg, out_dir, env)
    say = print if env.is_main else (lambda *a, **k: None)
    say(f"{stage}: starting from {cfg.post.init}; tokenizer {tok.vocab_size} tokens ({tok.hash[:12]})")
    model = load_pretrained(cfg.post.init, cfg.model, device)
    if cfg.post.lora_rank > 0:
        trainable, total = apply_lora_from_config(model, cfg)
        say(f"LoRA rank {cfg.post.lora_rank}, alpha {cfg.post.lora_alpha:g} on {', '.join(cfg.post.lora_targets)}: "
            f"{trainable:,} trainable of {total:,} parameters ({trainable / total:.2%})")
    if cfg.post.prompt_tuning:
        model = apply_prompt_tuning(model, cfg, stage)
        say(f"{cfg.post.prompt_tuning} tuning: {cfg.post.num_virtual_tokens} virtual tokens, "
            f"{model.prompt_embeddings.numel():,} trainable parameters")
    return env, out_dir, precision, tok, tok_dir, model


def apply_prompt_tuning(model: torch.nn.Module, cfg: Config, stage: str):
    """The frozen model with ``post.num_virtual_tokens`` trainable virtual tokens (prompt or prefix tuning)."""
    from zero2all.model.prompt_tuning import PromptTuned

    if stage not in ("sft", "dpo"):
        raise ConfigError(f"post.prompt_tuning: available for sft and dpo, not {stage}")
    if stage == "sft" and cfg.post.packing != "pad":
        raise ConfigError("post.prompt_tuning: trains on padded rows; pass --packing pad")
    room = cfg.model.max_seq_len - cfg.post.num_virtual_tokens  # the virtual tokens take positions too
    if not cfg.data.seq_len:
        cfg.data.seq_len = room
    elif cfg.data.seq_len > room:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} + {cfg.post.num_virtual_tokens} virtual tokens exceed "
                          f"model.max_seq_len={cfg.model.max_seq_len}")
    torch.manual_seed(cfg.train.seed)
    return PromptTuned(model, cfg.post.num_virtual_tokens, cfg.post.prompt_tuning)


def sft(cfg: Config, show_progress: bool = True) -> dict:
    """``z2all sft``: supervised fine-tuning of ``post.init`` on chat data (loss on assistant tokens only)."""
    env, out_dir, precision, tok, tok_dir, model = _prepare(cfg, "sft")
    train, valid = build_sft_data(cfg, tok, env.rank, env.world_size)
    trainer = PostTrainer(cfg, SFTObjective(), init_dir=cfg.post.init, model=model, train_data=train,
                          eval_data=valid, tokenizer=tok, tokenizer_dir=tok_dir, show_progress=show_progress, env=env)
    summary = trainer.fit()
    zd.destroy_distributed()
    return summary


def dpo(cfg: Config, show_progress: bool = True) -> dict:
    """``z2all dpo``: preference optimisation of ``post.init`` against a frozen reference (``post.ref``, default
    the initial model) or its precomputed log-probs (``post.precompute_ref``)."""
    env, out_dir, precision, tok, tok_dir, model = _prepare(cfg, "dpo")
    device = env.device
    train, valid = build_dpo_data(cfg, tok, env.rank, env.world_size)
    cache = out_dir / (REFERENCE_CACHE if env.world_size == 1 else f"reference_logprobs.rank{env.rank}.pt")
    p = cfg.post
    if p.ref:
        reference = load_pretrained(p.ref, cfg.model, device)
    elif p.prompt_tuning:  # the frozen base itself, without the virtual tokens
        reference = model.model
    else:  # the initial policy; with LoRA the base weights are shared with the policy and frozen anyway
        reference = copy.deepcopy(model) if p.lora_rank == 0 else base_weights_model(model)
    reference.eval().requires_grad_(False)
    if p.precompute_ref:
        if env.is_main:
            print(f"reference log-probs: computing them for {len(train):,} pairs (the reference then leaves memory)")
        train = ReferenceLogprobDataset(train, reference_logprobs(reference, train, cfg, device, precision, cache))
        if valid is not None:
            valid = ReferenceLogprobDataset(valid, reference_logprobs(reference, valid, cfg, device, precision,
                                                                      None))
        del reference
        reference = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    objective = DPOObjective(beta=p.beta, reference_model=reference)
    trainer = PostTrainer(cfg, objective, init_dir=p.init, model=model, train_data=train, eval_data=valid, env=env,
                          tokenizer=tok, tokenizer_dir=tok_dir, show_progress=show_progress)
    summary = trainer.fit()
    zd.destroy_distributed()
    return summary
