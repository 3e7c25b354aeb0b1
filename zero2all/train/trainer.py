"""THE training loop, shared by pretraining, SFT and DPO. What differs between stages is an objective
(``objectives.py``) that turns a batch into a loss; this file knows nothing of which stage it runs.

One optimiser update ("step")::

    lr = schedule(step)
    for each of grad_accum_steps micro-batches:          # tokens per step = accum * world * micro_batch_size * seq_len
        with autocast(bf16 | fp16 | off):                # fp32 master weights; activations in low precision
            loss = objective.loss(model, batch)
        backward(loss * loss_scale / grad_accum_steps)   # mean over micro-batches = mean over the whole batch
    unscale (fp16); norm = ||grads||; clip to grad_clip
    if norm is finite: optimizer.step()  else: skip the update (fp16: halve the loss scale), count it
    zero grads; log; maybe evaluate / sample / checkpoint

Determinism: every random source is seeded (Python, NumPy, torch CPU and CUDA); the data iterator and the
schedule are functions of the seed and the step; evaluation and sampling draw from their own generators. A
checkpoint stores all of that, so on CPU a resumed run reproduces the uninterrupted run exactly (tested).

Several processes (``torchrun ... -m zero2all.cli pretrain``): the trainer joins the process group, takes
``rank`` / ``world_size`` and its GPU from torchrun, builds its data iterator for that rank, and lets
``zero2all/distributed/`` wrap the plain ``raw_model`` into the training ``model`` (DDP, FSDP2, ZeRO-1, activation
checkpointing; ``no_sync`` on all but the last micro-batch). The collectives it calls are the identity on one
process, so the loop has no ``if distributed`` branches. It logs on rank 0 only (global loss and tokens/s, every
rank's memory). Checkpoints are one format for every world size (``zero2all/checkpoint/``): saved by N processes
of one parallelism kind, resumed by M processes of another.

Interrupts: SIGINT (Ctrl-C) or SIGTERM finishes the current update, saves a checkpoint and raises
:class:`TrainingInterrupted` (the CLI exits 130 / 143 with one line); a second Ctrl-C aborts at once.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from zero2all import checkpoint as ckpt_io
from zero2all import distributed as zd
from zero2all.checkpoint.compat import CheckpointMismatch, check_compatible
from zero2all.config import Config, ConfigError, TrainingDiverged, TrainingInterrupted, to_dict
from zero2all.data.synthetic import SyntheticDataset
from zero2all.distributed.plan import launched_world_size
from zero2all.distributed.plan import resolve as resolve_plan
from zero2all.fileio import (
    LOCK_FILE,
    OUTPUT_MARKER,
    OutputDirError,
    OutputLock,
    OutputLockedError,
    claim_output_dir,
    read_output_marker,
    save_json,
    write_output_marker,
)
from zero2all.kernels.numerics import numerics_of
from zero2all.model import ops
from zero2all.model.io import check_tokenizer_fits, copy_tokenizer_files, load_model, save_model
from zero2all.model.z2all import build_model
from zero2all.train.metrics import (
    MetricsLogger,
    NumericsMonitor,
    compute_mfu,
    detect_peak_flops,
    format_count,
    format_step_line,
    peak_memory_bytes,
    plot_loss_curve,
    read_metrics,
    reset_peak_memory,
    summarize,
    write_run_report,
)
from zero2all.train.objectives import Objective, PretrainObjective
from zero2all.train.optim import (
    DynamicLossScaler,
    LRSchedule,
    build_optimizer,
    describe_groups,
    grad_norm_and_clip,
    set_lr,
)
from zero2all.train.trainable import apply_trainable

PRECISIONS = ("auto", "bf16", "fp16", "fp32", "fp64")


class _StopSignals:
    """While active: the first SIGINT / SIGTERM only sets ``received`` (the loop stops after the update in
    flight); a second SIGINT raises KeyboardInterrupt at once. Handlers are restored on exit. Only the main thread
    can install handlers; elsewhere this does nothing."""

    def __init__(self):
        self.received: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this update and saving a checkpoint "
              f"(press Ctrl-C again to abort at once)", flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


# --------------------------------------------------------------------------------------------------------------
# device, precision, seeds


def pick_device(setting: str = "auto") -> torch.device:
    """``auto``: the first CUDA GPU if there is one, else the CPU. Otherwise ``cpu``, ``cuda`` or ``cuda:N``."""
    return zd.resolve_device(setting)


def resolve_precision(setting: str, device: torch.device) -> str:
    """``auto``: bf16 autocast on GPUs that support it (Ampere and newer), else fp32. ``fp64`` is refused on a GPU."""
    if setting not in PRECISIONS:
        raise ConfigError(f"train.precision: {setting!r} is not one of {', '.join(PRECISIONS)}")
    if setting == "fp64" and device.type != "cpu":
        from zero2all.config import FP64_ON_GPU

        raise ConfigError(FP64_ON_GPU.format(prefix="train", device=str(device)))
    if setting == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return setting


def autocast_context(precision: str, device: torch.device):
    """Autocast for the forward pass; parameters (master weights) and optimiser state stay float32 (float64 with
    ``fp64``, which runs without autocast)."""
    if precision in ("fp32", "fp64"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)  # also seeds every CUDA device


# --------------------------------------------------------------------------------------------------------------
# data


def data_seq_len(cfg: Config) -> int:
    return cfg.data.seq_len or cfg.model.max_seq_len


def read_data_meta(data_dir: str | Path) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{data_dir}: no meta.json (is this a directory written by `z2all prepare`?)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


def tokenizer_dir_of(data_dir: str | Path, meta: dict) -> Path | None:
    """The tokenizer directory that ``meta.json`` names (absolute, or relative to the data directory)."""
    for key in ("tokenizer_dir", "tokenizer"):
        value = meta.get(key)
        if isinstance(value, dict):
            value = value.get("dir") or value.get("path")
        if isinstance(value, str) and value:
            p = Path(value)
            if not p.is_absolute() and not p.exists():
                p = Path(data_dir) / p
            return p
    return None


def build_datasets(cfg: Config, rank: int = 0, world_size: int = 1):
    """(train dataset, validation dataset or None, tokenizer or None, tokenizer dir or None) for ``cfg.data``.

    ``data.path = ""`` gives :class:`SyntheticDataset`; otherwise the packed token shards of ``z2all prepare``.
    """
    seq_len = data_seq_len(cfg)
    if not cfg.data.path:
        vocab = cfg.model.vocab_size
        return (SyntheticDataset(vocab, seq_len, "train", rank, world_size),
                SyntheticDataset(vocab, seq_len, "valid", rank, world_size), None, None)
    from zero2all.data.datasets import PackedDataset
    from zero2all.data.pretokenize import ShardError

    data_dir = Path(cfg.data.path)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data.path: {data_dir} is not a directory")
    meta = read_data_meta(data_dir)
    doc_ids = cfg.data.document_mask
    tok_vocab = meta["tokenizer"].get("vocab_size") if isinstance(meta.get("tokenizer"), dict) else None
    if isinstance(tok_vocab, int):  # a model smaller than the shards' tokenizer: said before any shard is scanned
        check_tokenizer_fits(SimpleNamespace(vocab_size=tok_vocab), cfg.model, str(tokenizer_dir_of(data_dir, meta)))
    vocab = cfg.model.padded_vocab_size  # ids up to the embedding's last row are accepted, as for the tokenizer
    train = PackedDataset(data_dir, seq_len, split="train", rank=rank, world_size=world_size, return_doc_ids=doc_ids,
                          model_vocab_size=vocab)
    try:
        valid = PackedDataset(data_dir, seq_len, split="valid", rank=rank, world_size=world_size,
                              return_doc_ids=doc_ids, model_vocab_size=vocab)
    except ShardError:  # a damaged validation shard is as wrong as a damaged training shard
        raise
    except (FileNotFoundError, ValueError) as e:
        print(f"no validation split in {data_dir} ({e}); evaluation is off")
        valid = None
    if not isinstance(meta.get("tokenizer"), dict):  # not `prepare`'s meta.json: a tokenizer folder it may name
        tok_dir = tokenizer_dir_of(data_dir, meta)
        if tok_dir is None or not tok_dir.is_dir():
            return train, valid, None, None
        from zero2all.tokenizer import load_tokenizer

        return train, valid, load_tokenizer(tok_dir), tok_dir
    from zero2all.data.pretokenize import TokenizerMismatchError, shard_tokenizer

    try:  # the copy kept with the shards; for older outputs the recorded folder, checked by hash
        tok_dir, tokenizer = shard_tokenizer(data_dir, meta, log=print)
    except TokenizerMismatchError as e:
        raise ConfigError(str(e)) from None
    return train, valid, tokenizer, tok_dir


# --------------------------------------------------------------------------------------------------------------
# sampling (a small greedy / temperature sampler on the model's KV cache; the full one is zero2all.infer)


@torch.no_grad()
def sample_continuation(model, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8,
                        top_k: int = 0, generator: torch.Generator | None = None, eos_id: int | None = None,
                        autocast=contextlib.nullcontext) -> list[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens (stops at ``eos_id``); returns the new ids.

    temperature 0 = greedy. The prompt is processed in one forward pass filling the KV cache, then one token per
    step. Sampling draws from ``generator`` (CPU), never from the global RNG, so training stays reproducible.
    """
    device = next(model.parameters()).device
    max_len = model.cfg.max_seq_len
    prompt_ids = list(prompt_ids)[-(max_len - 1):] or [0]
    max_new_tokens = min(max_new_tokens, max_len - len(prompt_ids))
    cache = model.new_kv_cache(1, len(prompt_ids) + max_new_tokens)
    tokens = torch.tensor([prompt_ids], device=device)
    pos, out = 0, []
    for _ in range(max_new_tokens):
        with autocast():
            logits, _ = model(tokens, kv_cache=cache, start_pos=pos)
        pos += tokens.size(1)
        logits = logits[0, -1, :model.cfg.vocab_size].float().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        out.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
        tokens = torch.tensor([[nxt]], device=device)
    return out


# --------------------------------------------------------------------------------------------------------------
# the trainer


def wall_clock() -> float:
    """Seconds on a monotonic clock: what ``train.time_budget_s`` is measured with (a seam for tests)."""
    return time.perf_counter()


class Trainer:
    """``Trainer(cfg, objective).fit()``. Datasets, model and tokenizer are built from ``cfg`` unless given.

    Outputs in ``cfg.train.out_dir``: ``config.json``, ``metrics.jsonl``, ``tensorboard/``, ``ckpt-XXXXXX/``,
    ``final/`` (model + tokenizer), ``loss.png`` and ``report.md``.
    """

    def __init__(self, *args, **kwargs):
        """See :meth:`_build`. A run that fails while being built (bad data, a model that does not fit) lets go of
        its output folder again, and removes it when it holds nothing but the marker and lock written here."""
        self._lock = None
        try:
            self._build(*args, **kwargs)
        except BaseException:
            self._abandon_out_dir()
            raise

    def _abandon_out_dir(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        out = getattr(self, "out_dir", None)
        if out is None or not getattr(self, "is_main", False) or not Path(out).is_dir():
            return
        ours = {OUTPUT_MARKER, LOCK_FILE}
        if getattr(self, "_created_out_dir", False) and {p.name for p in Path(out).iterdir()} <= ours:
            for name in ours:
                (Path(out) / name).unlink(missing_ok=True)
            Path(out).rmdir()

    def _build(self, cfg: Config, objective: Objective | None = None, model: torch.nn.Module | None = None,
               train_data=None, eval_data=None, tokenizer=None, tokenizer_dir: str | Path | None = None,
               rank: int = 0, world_size: int = 1, show_progress: bool = True, env: zd.DistEnv | None = None,
               output_kind: str | None = None):
        """``output_kind``: the command whose output ``out_dir`` is (its marker, ``fileio.claim_output_dir``);
        None: the objective's (pretrain, sft, dpo, reward; rl for the RL algorithms)."""
        self.cfg, self.tcfg = cfg, cfg.train
        # under torchrun: join the process group; rank, world size and this process's GPU come from the launcher
        # (``env``: a caller that already joined it, e.g. post-training, which loads its model first)
        # the plan (distributed/plan.py): the mesh and every refusal, before the process group exists
        self.cfg.validate()
        self.plan = resolve_plan(cfg, env.world_size if env is not None else launched_world_size(world_size))
        self.dist = env or zd.init_distributed(cfg.train.device, timeout_s=cfg.parallel.timeout_s)
        if self.dist.is_distributed:
            rank, world_size = self.dist.rank, self.dist.world_size
        self.rank, self.world_size = rank, world_size
        # the data-parallel coordinate: pipeline (and tp / cp) ranks of one replica read the same sequences
        self.dp_rank, self.dp_size = self.plan.dp_coords(rank)
        self.is_main = rank == 0
        self.objective = objective or PretrainObjective(z_loss=cfg.train.z_loss)
        self._check_config()
        self.device = self.dist.device
        self.precision = resolve_precision(self.tcfg.precision, self.device)
        self.out_dir = Path(self.tcfg.out_dir)
        self.output_kind = output_kind or run_kind(self.objective.name)
        self._lock_out_dir()  # before anything is written into it; released at the end of fit()
        self.seq_len = data_seq_len(cfg)
        self.show_progress = show_progress
        seed_everything(self.tcfg.seed)

        if train_data is None:
            train_data, built_eval, built_tok, built_tok_dir = build_datasets(cfg, self.dp_rank, self.dp_size)
            eval_data = eval_data if eval_data is not None else built_eval
            tokenizer = tokenizer if tokenizer is not None else built_tok
            tokenizer_dir = tokenizer_dir if tokenizer_dir is not None else built_tok_dir
        self.train_data, self.eval_data = train_data, eval_data
        self.tokenizer, self.tokenizer_dir = tokenizer, tokenizer_dir
        self.tokenizer_hash = getattr(train_data, "tokenizer_hash", None)
        if tokenizer is not None:
            self._attach_tokenizer(tokenizer)

        if model is None and self.tcfg.init:  # continued pretraining (cfg.model was read from it: pretrain())
            model = load_model(self.tcfg.init, device=self.device, config=cfg.model).train()
        if model is None:
            model = build_model(cfg.model, device=self.device, seed=self.tcfg.seed)
        self.raw_model = model.to(self.device)
        if self.precision == "fp64":  # parameters, buffers and so optimizer state and activations in float64
            self.raw_model = self.raw_model.to(torch.float64)
        if self.tcfg.trainable != "all":
            self.trainable_line = apply_trainable(self.raw_model, self.tcfg.trainable, self.tcfg.init)
        # DDP / FSDP2 / ZeRO-1 and activation checkpointing are applied from outside (zero2all/distributed/). FSDP
        # shards raw_model in place (so the optimizer is built after wrapping) and compiles per block.
        fsdp = self.plan.mode in ("fsdp", "mesh")
        self.run = zd.parallelize(self.raw_model, cfg.parallel, self.dist, precision=self.precision,
                                  compile_blocks=self.tcfg.compile and fsdp, seed=self.tcfg.seed,
                                  plan=resolve_plan(cfg, self.dist.world_size, self.dist.device,
                                                    compile_blocks=self.tcfg.compile and fsdp))
        self.parallel = self.run.mode
        # the model's numerics context (kernels/numerics.py): its weight casts, FP8 histories, step-fusion marks
        self.model_numerics = numerics_of(self.raw_model)
        if cfg.model.ops.step_fusion != "off":  # kernels/step_fusion.py (Config.validate: one process, no wrapper)
            self.model_numerics.mark(self.raw_model, cfg.model.ops.step_fusion)
        self.pipeline = self.run.pipeline  # pp > 1: this rank's stages and their schedule (distributed/pp.py)
        if self.pipeline is not None:
            self.pipeline.set_objective(self.objective)
            self.raw_model = self.run.plain  # this rank's share, under the plain model's names
        self.model = torch.compile(self.run.model) if self.tcfg.compile and not fsdp else self.run.model
        self.optimizer = self.run.shard_optimizer(build_optimizer(self.raw_model, self.tcfg, self.device,
                                                                  self.run.fused_rows))
        if self.model_numerics is not None:  # the casts kept for a step are dropped after each step of this one
            self.model_numerics.attach(self.optimizer)
        self.schedule = LRSchedule.from_config(self.tcfg)
        self.scaler = DynamicLossScaler(enabled=self.precision == "fp16")
        self.autocast = lambda: autocast_context(self.precision, self.device)
        self.peak_flops = detect_peak_flops(self.device, self.tcfg.gpu_peak_flops)
        self.non_embedding_params = self.raw_model.num_params(non_embedding=True) \
            if hasattr(self.raw_model, "num_params") else sum(p.numel() for p in self.raw_model.parameters())

        self.train_iter = self.train_data.iterator(self.tcfg.micro_batch_size, seed=self.tcfg.seed)
        self.step = 0
        self.tokens_seen = 0
        self.skipped_total = 0
        self.skipped_in_a_row = 0
        self.elapsed_s = 0.0
        self.wall_s = 0.0  # the time budget's clock over all sessions: the loop's wall time (train.time_budget_counts)
        self.budget_steps: int | None = None  # train.time_budget_s: the run's length once fixed from the rate
        self.resumed_from: Path | None = None
        self.last_samples: list[dict] = []
        self.logger = MetricsLogger(self.out_dir, tensorboard=self.tcfg.tensorboard, enabled=self.is_main,
                                    trackers=self.tcfg.trackers, project=self.tcfg.tracker_project)
        self.numerics = NumericsMonitor(
            fp8_stats=self.model_numerics.fp8_stats if self.model_numerics is not None else None)

    # -- setup helpers ----------------------------------------------------------------------------------------
    def _check_config(self) -> None:
        """Every section checks itself (``Config.validate``) and the plan holds for this run's number of
        processes (``plan.resolve``, already asked before the process group with the launcher's count)."""
        self.cfg.validate()
        if self.plan.world_size != self.dist.world_size:
            self.plan = resolve_plan(self.cfg, self.dist.world_size)

    def _attach_tokenizer(self, tok) -> None:
        """The model must cover the tokenizer's ids; the special ids go into the model config (for export)."""
        m = self.cfg.model
        warning = check_tokenizer_fits(tok, m, str(self.tokenizer_dir))  # more ids than rows: ConfigError
        if warning:
            self._print(warning)
        if m.eos_token_id is None and getattr(tok, "eos_id", None) is not None:
            m.eos_token_id = tok.eos_id
        if m.pad_token_id is None and getattr(tok, "pad_id", None) is not None:
            m.pad_token_id = tok.pad_id

    def _print(self, msg: str = "") -> None:
        if not self.is_main:
            return
        if getattr(self, "_bar", None) is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    @property
    def tokens_per_step(self) -> int:
        return self.tcfg.grad_accum_steps * self.dp_size * self.tcfg.micro_batch_size * self.seq_len

    def describe(self) -> list[str]:
        """The start-of-run summary."""
        t = self.tcfg
        dev = str(self.device) + (f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda"
                                  else f" ({torch.get_num_threads()} threads)")
        lines = [
            f"device: {dev} | precision: {self.precision}"
            + (" autocast, fp32 master weights" if self.precision in ("bf16", "fp16") else "")
            + (" + dynamic loss scaling" if self.precision == "fp16" else ""),
            f"model: {format_count(self.raw_model.num_params())} parameters "
            f"({self.non_embedding_params:,} non-embedding), {self.cfg.model.n_layers} layers, "
            f"hidden {self.cfg.model.hidden_dim}, vocab {self.cfg.model.padded_vocab_size}",
            f"objective: {self.objective.name} | data: {self.cfg.data.path or 'synthetic (arithmetic sequences)'}",
            f"tokens per iteration will be: {self.tokens_per_step:,}",
            f"breaks down as: {t.grad_accum_steps} grad accum steps * {self.dp_size} data-parallel ranks * "
            f"{t.micro_batch_size} micro-batch size * {self.seq_len} max seq len",
        ]
        if self.dist.is_distributed:
            mesh = f" ({self.run.dims.describe()})" if self.parallel == "mesh" else ""
            lines.append(f"parallel: {self.parallel}{mesh} on {self.world_size} processes ({self.dist.backend}) | "
                         f"activation checkpointing: {self.cfg.parallel.activation_checkpointing}")
        groups = self.optimizer.param_groups
        muon = [g for g in groups if g.get("kind") == "muon"]
        if muon:
            lines.append(f"muon parameter tensors: {len(muon[0]['params'])}, with "
                         f"{sum(p.numel() for p in muon[0]['params']):,} parameters (lr {t.lr * muon[0]['lr_ratio']:g}"
                         f" peak, momentum {t.muon_momentum}, {t.muon_ns_steps} Newton-Schulz steps, scale "
                         f"{t.muon_scale}); AdamW for the rest:")
        lines += describe_groups([g for g in groups if g.get("kind") != "muon"])
        if getattr(self, "trainable_line", None):
            lines.append(self.trainable_line)
        fused = bool(self.optimizer.defaults.get("fused"))
        name = "Muon + AdamW" if muon else "AdamW"
        lines.append(f"optimizer: {name}{' (fused)' if fused else ''} lr {t.lr:g} -> {t.min_lr:g}, betas "
                     f"({t.beta1}, {t.beta2}), weight decay {t.weight_decay} | schedule {t.schedule}, warmup "
                     f"{t.warmup_steps}, {t.max_steps} steps | grad clip {t.grad_clip or 'off'}")
        if self.peak_flops:
            lines.append(f"MFU against a peak of {self.peak_flops / 1e12:g} TFLOP/s")
        return lines

    # -- checkpoints ------------------------------------------------------------------------------------------
    def counters(self) -> dict:
        """The run's counters, LR schedule and loss scaler (the same on every rank)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_total": self.skipped_total,
                "elapsed_s": self.elapsed_s, "objective": self.objective.name, "scaler": self.scaler.state_dict(),
                "schedule": self.schedule.state_dict(), "wall_s": self.wall_s, "budget_steps": self.budget_steps}

    def load_counters(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.skipped_total, self.elapsed_s = int(state["skipped_total"]), float(state["elapsed_s"])
        self.wall_s = float(state.get("wall_s", self.elapsed_s))
        if state.get("budget_steps") and self.tcfg.time_budget_s:  # the length a budgeted run fixed
            self._set_length(int(state["budget_steps"]))
        self.scaler.load_state_dict(state["scaler"])

    def _set_length(self, steps: int) -> None:
        """Fix the run's length (``train.time_budget_s``): the loop's end, the LR schedule, the checkpoints'
        recorded ``max_steps`` and the progress bar."""
        self.budget_steps = steps
        self.tcfg.max_steps = steps
        self.schedule = LRSchedule.from_config(self.tcfg)
        if getattr(self, "_bar", None) is not None:
            self._bar.total = steps
            self._bar.refresh()

    # the updates a time-budgeted run times before fixing its length (at least; and at least until warmup ends)
    BUDGET_WINDOW = 10

    def _budget_check(self, wall0: float, window: tuple[int, float], eval_s: float, clock) -> bool:
        """``train.time_budget_s``: at the end of the measuring window fix the run's length from the measured rate
        (seconds per update since ``window`` = (step, time) after this session's first update, plus the
        evaluations' share, ``eval_s`` per evaluation); True when the time is up (every rank agrees). ``clock``:
        the budget's clock (the wall clock, less the evaluations' and checkpoints' time when the budget counts
        training only)."""
        t = self.tcfg
        now = clock()
        self.wall_s = now - wall0
        if self.budget_steps is None and self.step >= max(t.warmup_steps, window[0] + self.BUDGET_WINDOW):
            per_update = zd.all_reduce_mean((now - window[1]) / max(1, self.step - window[0]), self.dist)
            per_step = per_update + (eval_s / t.eval_every if t.eval_every else 0.0)
            remaining = max(0.0, t.time_budget_s - self.wall_s)
            steps = min(t.max_steps, self.step + max(1, int(remaining / per_step)))
            self._print(f"time budget {t.time_budget_s:g} s: {1000 * per_update:.0f} ms per update measured over "
                        f"updates {window[0] + 1}-{self.step}" + (f", {eval_s:.1f} s per evaluation" if eval_s else "")
                        + f" -> {steps} updates in all (at most train.max_steps); the LR schedule ends there")
            self._set_length(steps)
        return zd.any_true(self.wall_s >= t.time_budget_s, self.dist)

    def _load_data_states(self, states: list[dict]) -> None:
        try:
            self.train_iter.load_state_dict(self.train_iter.rescaled_state(states))
        except ValueError as e:  # the data layout changed: the batch sequence would not continue
            raise CheckpointMismatch(f"checkpoint {self._loading}: does not match this run's data: {e}") from None

    def _restore_rng(self, states: list[dict]) -> None:
        # another world size: ranks that did not exist take rank 0's generators (they only drive dropout)
        ckpt_io.restore_rng_state(states[self.rank] if self.rank < len(states) else states[0])

    def checkpoint_parts(self, saved_world: int | None = None, comm_hook: bool | None = None,
                         saved_dp: int | None = None) -> dict:
        """The Stateful parts of this run's checkpoints (``saved_world`` / ``saved_dp``: the world size and the
        data-parallel size of the run that wrote the checkpoint being loaded)."""
        saved_world = saved_world or self.world_size
        parts = {
            "model": ckpt_io.ModelState(self.run.plain, self.run.fused_rows),
            "optim": ckpt_io.OptimizerState(self.run.plain, zd.local_optimizer(self.optimizer), self.run.fused_rows),
            "trainer": ckpt_io.JsonState(self.counters, self.load_counters),
            "data": ckpt_io.RankStates(self.dp_rank, self.train_iter.state_dict, self._load_data_states,
                                       saved_dp or self.dp_size),
            "rng": ckpt_io.RankStates(self.rank, ckpt_io.capture_rng_state, self._restore_rng, saved_world),
        }
        hook = self.run.comm_hook
        if hook.powersgd_state is not None and (comm_hook is None or (comm_hook and saved_world == self.world_size)):
            # PowerSGD's error feedback is this rank's own: restored only for an unchanged world size
            parts["comm_hook"] = ckpt_io.RankStates(self.rank, hook.state_dict, lambda states: hook.load_state_dict(
                states[self.rank]), saved_world, binary=True)
        return parts

    def write_checkpoint_extras(self, tmp: Path) -> None:
        """Rank 0, into a checkpoint being written: the run config and the tokenizer files."""
        save_json(to_dict(self.cfg), tmp / ckpt_io.RUN_CONFIG)
        if self.tokenizer_dir is not None:
            copy_tokenizer_files(self.tokenizer_dir, tmp)

    def save_checkpoint(self) -> Path:
        """Every rank: ``OUT/ckpt-<step>`` in the one checkpoint format (zero2all/checkpoint/), then pruning."""
        path = self.out_dir / ckpt_io.checkpoint_name(self.step)
        t0 = time.perf_counter()
        meta = {"step": self.step, "parallel": self.parallel, "data_parallel": self.dp_size,
                "model": to_dict(self.cfg.model),
                "tokenizer_hash": self.tokenizer_hash, "objective": self.objective.name,
                "comm_hook": self.run.comm_hook.powersgd_state is not None}
        ckpt_io.save(path, self.checkpoint_parts(), self.dist, meta, write_extra=self.write_checkpoint_extras)
        if self.is_main:
            for old in ckpt_io.prune(self.out_dir, self.tcfg.keep_last, newest=path):
                self._print(f"removed old checkpoint {old} (train.keep_last={self.tcfg.keep_last})")
        zd.barrier(self.dist)
        self._print(f"saved checkpoint {path} in {time.perf_counter() - t0:.1f} s"
                    + (f" ({self.world_size} processes, {self.parallel})" if self.world_size > 1 else ""))
        return path

    def resume(self, ckpt: str | Path) -> None:
        """Restore model, optimizer, counters, schedule, scaler, data position and RNG states from ``ckpt``,
        whatever number of processes and parallelism kind wrote it."""
        ckpt = Path(ckpt)
        problems = ckpt_io.verify(ckpt) if self.is_main else []
        problems = zd.broadcast_object(problems, self.dist)
        if problems:
            raise ckpt_io.CheckpointError(f"cannot resume from {ckpt}: " + "; ".join(problems))
        meta = ckpt_io.read_meta(ckpt)
        saved_cfg = json.loads((ckpt / ckpt_io.RUN_CONFIG).read_text(encoding="utf-8"))
        saved_world = int(meta["world_size"])
        saved_dp = int(meta.get("data_parallel", saved_world))  # data-parallel replicas decide the global batch
        changed = check_compatible(ckpt, saved_cfg, self.cfg, self.seq_len, self.dp_size, saved_dp,
                                   meta.get("tokenizer_hash"), self.tokenizer_hash)
        self._loading = ckpt
        ckpt_io.load(ckpt, self.checkpoint_parts(saved_world, comm_hook=bool(meta.get("comm_hook")),
                                                 saved_dp=saved_dp), self.dist)
        self.resumed_from = ckpt
        how = f" (written by {saved_world} processes, {meta.get('parallel')})" if saved_world != self.world_size \
            or meta.get("parallel") != self.parallel else ""
        self._print(f"resumed from {ckpt} at step {self.step}{how}"
                    + (f" (changed since: {'; '.join(changed)})" if changed else ""))

    def _maybe_resume(self) -> None:
        setting = self.tcfg.resume
        if setting == "":
            existing = ckpt_io.list_checkpoints(self.out_dir)
            if existing:
                raise ConfigError(f"train.out_dir: {self.out_dir} already holds checkpoints (newest "
                                  f"{existing[-1][1].name}); pass --resume auto to continue that run, or choose "
                                  f"another --out")
            return
        if setting == "auto":
            found, skipped = ckpt_io.newest_verified(self.out_dir) if self.is_main else (None, [])
            found, skipped = zd.broadcast_object((found, skipped), self.dist)
            for path, why in skipped:
                self._print(f"--resume auto: skipping {path}: {why}")
            if found is None:
                self._print(f"--resume auto: no usable checkpoint in {self.out_dir}, starting fresh")
                self._start_line(-1)
                return
            ckpt = found
        else:
            ckpt = Path(setting)
            if not ckpt.is_dir():
                raise FileNotFoundError(f"train.resume: {setting} is not a checkpoint directory (or use 'auto')")
        self.resume(ckpt)
        self._start_line(self.step)

    def _start_line(self, step: int) -> None:
        """Checkpoints of ``out_dir`` later than the resumed step belong to an abandoned line: move them aside so
        this run's checkpoints never mix with theirs."""
        if self.is_main:
            aside, moved = ckpt_io.move_aside_after(self.out_dir, step)
            if moved:
                self._print(f"resuming at step {max(step, 0)} starts a new line: moved {len(moved)} later "
                            f"checkpoint(s) ({', '.join(p.name for p in moved)}) aside to {aside}")
        zd.barrier(self.dist)

    # -- one optimiser update ---------------------------------------------------------------------------------
    def _to_device(self, batch: dict) -> dict:
        non_blocking = self.device.type == "cuda"
        return {k: v.to(self.device, non_blocking=non_blocking) if torch.is_tensor(v) else v
                for k, v in batch.items()}

    def forward_backward(self, batch: dict, loss_multiplier: float) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch and its backward pass (the point a DDP wrapper makes ``no_sync``)."""
        with self.autocast():
            loss, metrics = self.objective.loss(self.model, batch)
        (loss * loss_multiplier).backward()
        return loss.detach(), metrics

    def train_step(self) -> dict:
        """One optimiser update over ``grad_accum_steps`` micro-batches; returns the step's log record."""
        t = self.tcfg
        t0 = time.perf_counter()
        lr = self.schedule.lr_at(self.step)
        set_lr(self.optimizer, lr)
        self.model.train()
        accum = t.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64 if self.precision == "fp64" else None)
        metric_sums: dict[str, torch.Tensor | float] = {}
        tokens = 0
        data_wait = 0.0

        def fetch():
            nonlocal data_wait
            t_fetch = time.perf_counter()
            batch = self._to_device(next(self.train_iter))
            data_wait += time.perf_counter() - t_fetch
            return batch

        if self.pipeline is not None:  # the update's micro-batches as one pipeline schedule (distributed/pp.py)
            batches = [fetch() for _ in range(accum)]
            with self.autocast():
                loss_sum += ops.upcast(self.pipeline.step(batches, self.scaler.scale / accum))
            tokens = sum(self.objective.num_tokens(b) for b in batches)
            loss_sum = self.pipeline.from_last_stage(loss_sum)  # computed on the last stage: every rank gets it
        else:
            for micro in range(accum):
                batch = fetch()
                # DDP: one all-reduce per update; tp: loss parallel; cp: the sequences split, ring attention
                with self.run.gradient_sync(micro == accum - 1), self.run.train_context(batch):
                    loss, metrics = self.forward_backward(batch, self.scaler.scale / accum)
                loss_sum += ops.upcast(loss)
                tokens += self.objective.num_tokens(batch)
                for k, v in metrics.items():
                    v = ops.upcast(v.detach()) if torch.is_tensor(v) else float(v)
                    metric_sums[k] = metric_sums[k] + v if k in metric_sums else v
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.scaler.unscale_(params)
        norm = self.pipeline.grad_norm_and_clip(params, t.grad_clip) if self.pipeline is not None else \
            grad_norm_and_clip(params, t.grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # one host sync per update
        found_inf = not math.isfinite(grad_norm)
        applied = self.scaler.update(found_inf)
        if applied:
            with self.run.optimizer_context():  # tp: plain norm weights beside DTensor shards
                self.optimizer.step()
        else:
            self.skipped_total += 1
        moe_stats = self._moe_step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss_sum) / accum  # waits for the update to finish: the step time below is real
        t_arrive = time.perf_counter()
        loss_value = self.run.dims.reduce_mean(loss_value)  # the global batch's loss (over dp x cp)
        arrival_wait = time.perf_counter() - t_arrive       # how long this rank waited for the others
        dt = time.perf_counter() - t0
        self.step += 1
        self.tokens_seen += tokens * self.dp_size
        self.elapsed_s += dt
        tokens_per_s = tokens / dt  # this data-parallel replica; MFU is per device (a replica spans several)
        rec = {"kind": "train", "step": self.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": tokens_per_s * self.dp_size,
               "mfu": compute_mfu(tokens_per_s * self.dp_size / self.world_size, self.cfg.model, self.seq_len,
                                  self.peak_flops),
               "step_time_s": dt, "peak_mem_bytes": peak_memory_bytes(self.device),
               "tokens_seen": self.tokens_seen, "skipped": not applied, "skipped_total": self.skipped_total,
               "data_wait_s": data_wait}
        if self.dist.world_size > 1:
            rec["arrival_wait_s"] = arrival_wait
        if self.scaler.enabled:
            rec["loss_scale"] = self.scaler.scale
        if self.dist.is_distributed:
            per_rank = zd.gather_memory_stats(self.dist)
            rec["mem_per_rank"] = zd.format_memory(per_rank)
        for k in sorted(metric_sums):  # the objective's extra metrics (e.g. DPO margins), global like the loss
            value = float(metric_sums[k]) / accum
            rec[f"train_{k}"] = zd.all_reduce_mean(value, self.dist)
        rec.update(moe_stats)
        return rec

    def _moe_step(self) -> dict:
        """MoE models: the sigmoid routers' bias update after each step, and at the end of each logging window
        its expert-load statistics (``model/moe.py: moe_window_metrics``); {} otherwise."""
        if not self.cfg.model.moe.enabled:
            return {}
        from zero2all.model.moe import moe_window_metrics, update_router_biases

        def reduce(t):
            return zd.all_reduce_sum(t, self.dist)

        # pipeline: each rank holds some blocks; their loads are summed over the ranks holding the same blocks
        reduce_fn = self.pipeline.sum_over_replicas if self.pipeline is not None else reduce
        update_router_biases(self.run.plain, reduce_fn)
        log_every = self.tcfg.log_every or 1
        if (self.step + 1) % log_every:
            return {}
        metrics = moe_window_metrics(self.run.plain, reduce_fn)
        return self.pipeline.gather_from_stages(metrics) if self.pipeline is not None else metrics

    # -- evaluation and samples -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """The validation loss (:meth:`evaluate_loss`), then bits per byte on ``train.eval_data``
        (:meth:`evaluate_text`); returns the validation-loss record."""
        rec = self.evaluate_loss()
        self.evaluate_text()
        return rec

    def evaluate_text(self) -> dict | None:
        """Bits per byte, loss and perplexity of the model on the documents of ``train.eval_data``, per source
        (``zero2all/eval/perplexity.py``: the rules of ``z2all eval``), logged as one ``eval`` record with keys
        ``<source>/bits_per_byte`` etc. (TensorBoard ``eval/<source>/bits_per_byte``). Every process computes it
        (sharded parameters need all of them in each forward pass); the main one logs it."""
        if not self.tcfg.eval_data:
            return None
        if self.pipeline is not None:
            self._print("train.eval_data: bits per byte is not evaluated under pipeline parallelism (parallel.pp > "
                        "1); evaluate the checkpoint with `z2all eval`")
            return None
        from zero2all.eval.perplexity import evaluate_texts, iter_documents

        if self.tokenizer is None:
            raise ConfigError("train.eval_data: needs the run's tokenizer (data.tokenizer) to encode the text")
        if getattr(self, "_eval_docs", None) is None:  # read once: the same documents at every evaluation
            try:
                self._eval_docs = list(iter_documents(self.tcfg.eval_data, max_docs=self.tcfg.eval_data_max_docs))
            except (OSError, ValueError) as e:
                raise ConfigError(f"train.eval_data: {e}") from e
            if not self._eval_docs:
                raise ConfigError(f"train.eval_data: no document with text in {self.tcfg.eval_data}")
        self.raw_model.eval()
        with self.autocast():
            result = evaluate_texts(self.raw_model, self.tokenizer, self._eval_docs,
                                    context=min(self.raw_model.cfg.max_seq_len, self.seq_len),
                                    batch_size=self.tcfg.micro_batch_size, progress=False)
        self.raw_model.train()
        rec: dict = {"kind": "eval", "step": self.step}
        for name, totals in [*result.sources.items(), ("overall", result.overall)]:
            d = totals.to_dict()
            for key in ("bits_per_byte", "loss", "ppl"):
                rec[f"{name}/{key}"] = d[key]
        self.logger.log(rec)
        self._print(f"eval  step {self.step:>6d} | bits/byte " + " | ".join(
            f"{name} {t.to_dict()['bits_per_byte']:.4f}" for name, t in result.sources.items()))
        return rec

    def evaluate_loss(self) -> dict | None:
        """Mean validation loss and metrics over ``eval_batches`` fixed batches (the same ones every time); the
        perplexity (exp of the loss) when the objective's loss is a per-token cross-entropy."""
        if self.eval_data is None or self.tcfg.eval_batches == 0:
            return None
        self.model.eval()
        it = self.eval_data.iterator(self.tcfg.micro_batch_size, seed=self.tcfg.seed)
        losses, metrics = [], {}
        for _ in range(self.tcfg.eval_batches):
            try:
                batch = self._to_device(next(it))
            except StopIteration:
                break
            with self.autocast():
                if self.pipeline is not None:
                    loss, extra = self.pipeline.eval_loss(batch), {}
                else:
                    with self.run.train_context(batch):
                        loss, extra = self.objective.eval_loss(self.model, batch)
            losses.append(ops.upcast(loss))
            for key, value in extra.items():
                metrics.setdefault(key, []).append(value)
        self.model.train()
        if not losses:
            return None
        mean = zd.all_reduce_mean(float(torch.stack(losses).mean()), self.dist)
        rec = {"kind": "eval", "step": self.step, "loss": mean, "batches": len(losses)}
        if self.objective.loss_is_token_nll:  # a per-token cross-entropy: its exp is the perplexity
            rec["ppl"] = math.exp(min(mean, 50.0))
        for key, values in metrics.items():
            rec[key] = zd.all_reduce_mean(sum(float(v) for v in values) / len(values), self.dist)
        self.logger.log(rec)
        shown = ([f"perplexity {rec['ppl']:.2f}"] if "ppl" in rec else []) + \
            [f"{key} {rec[key]:.4f}" for key in self.objective.eval_printed if key in rec]
        self._print(f"eval  step {self.step:>6d} | val loss {mean:.4f}" + "".join(f" | {x}" for x in shown))
        return rec

    def _sample_prompts(self) -> list[tuple[str, list[int]]]:
        """(display text, ids): the configured prompts, else the first 16 tokens of the first validation rows."""
        t, tok = self.tcfg, self.tokenizer
        if t.sample_prompts and tok is not None:
            return [(p, tok.encode(p)) for p in t.sample_prompts[:t.num_samples]]
        source = self.eval_data or self.train_data
        batch = next(source.iterator(max(1, t.num_samples), seed=t.seed + 1))
        out = []
        for row in batch["input_ids"][:t.num_samples]:
            ids = row[:16].tolist()
            out.append((tok.decode(ids) if tok is not None else " ".join(map(str, ids)), ids))
        return out

    @torch.no_grad()
    def sample(self) -> list[dict]:
        """A few sampled continuations, logged and printed (a fixed generator: same samples for the same model)."""
        t = self.tcfg
        if t.num_samples == 0 or t.sample_new_tokens == 0:
            return []
        # FSDP: every rank takes part in gathering the weights; rank 0 samples from a plain CPU copy
        model = self.run.gather_plain_model()
        if not self.is_main:
            return []
        was_training = model.training
        model.eval()
        gen = torch.Generator().manual_seed(t.seed)
        eos = getattr(self.tokenizer, "eos_id", None)
        samples = []
        for text, ids in self._sample_prompts():
            new = sample_continuation(model, ids, t.sample_new_tokens, t.sample_temperature, t.sample_top_k,
                                      gen, eos, self.autocast)
            completion = self.tokenizer.decode(new) if self.tokenizer is not None else \
                " " + " ".join(map(str, new))
            samples.append({"kind": "sample", "step": self.step, "prompt": text, "completion": completion})
        model.train(was_training)
        for s in samples:
            self.logger.log(s)
            self._print(f"sample (step {self.step}) >>> {s['prompt']}{s['completion']}")
        self.last_samples = samples
        return samples

    # -- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to ``max_steps`` (resuming first if asked); returns the run summary. ``out_dir`` is claimed
        (:func:`claim_run_dir`) and locked against a second run for the whole time."""
        try:
            return self._fit()
        finally:
            self.logger.close()    # the trackers of a run that stopped on an error are marked failed
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _lock_out_dir(self) -> None:
        """Rank 0 checks that ``out_dir`` is new, empty or a run of this kind, and takes its lock; every rank
        raises the same ConfigError when it cannot."""
        self._lock, problem = None, None
        if self.is_main:
            self._created_out_dir = not Path(self.out_dir).exists()
            try:
                claim_run_dir(self.out_dir, self.output_kind, mark=True)
                self._lock = OutputLock(self.out_dir, on_takeover=self._print).acquire()
            except (OutputDirError, OutputLockedError) as e:
                problem = str(e)
        problem = zd.broadcast_object(problem, self.dist)
        if problem is not None:
            raise ConfigError(problem)

    def _fit(self) -> dict:
        t = self.tcfg
        self._maybe_resume()
        if self.is_main:
            dropped = self.logger.truncate_after(self.step)
            if dropped:
                self._print(f"metrics.jsonl: dropped {dropped} records written after step {self.step}")
            save_json(to_dict(self.cfg), self.out_dir / "config.json")
            self.logger.open_trackers(to_dict(self.cfg))
            for line in self.describe():
                self._print(line)
            if self.schedule.warning():
                self._print(self.schedule.warning())
            self.logger.log({"kind": "info", "step": self.step, "device": str(self.device),
                             "precision": self.precision, "tokens_per_step": self.tokens_per_step,
                             "params": self.raw_model.num_params(), "non_embedding_params":
                             self.non_embedding_params})
        reset_peak_memory(self.device)
        start_step = self.step
        self._bar = None
        if self.is_main and self.show_progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                             disable=None)
        from zero2all.train.memory import start_snapshot
        from zero2all.train.watchdog import StragglerMonitor, Watchdog, default_store

        self._snapshot_on = t.memory_snapshot and start_snapshot(self.device)

        self.watchdog = Watchdog(self.out_dir, self.dist.rank, self.dist.world_size, t.watchdog_factor,
                                 t.watchdog_min_s, default_store(), print_fn=print).start()
        self.stragglers = StragglerMonitor(self.dist.rank, self.dist.world_size, t.straggler_window,
                                           default_store())
        try:
            with _StopSignals() as stop:
                self._loop(stop)
        finally:
            self.watchdog.close()
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        if self.resumed_from is not None and self.step == start_step:
            # resumed a finished run: its final eval and samples are logged, and its checkpoint is this step's
            self._last_eval = self._last_sample = self.step
            if self.resumed_from.parent.resolve() == self.out_dir.resolve():
                self._last_ckpt = self.step
        if self._last_eval != self.step:
            self.evaluate()
        if self._last_sample != self.step:
            self.sample()
        if self._last_ckpt != self.step:
            self.save_checkpoint()
        try:
            if self.skipped_total * 2 > self.step:  # a final/ that looks trained from a run that mostly did not train
                raise TrainingDiverged(f"{self.skipped_total} of {self.step} updates were skipped for non-finite "
                                       f"gradients, so no final/ was written (checkpoints are in {self.out_dir}); "
                                       f"lower train.lr or check the data and rewards")
            return self.finish()
        finally:
            self.run.release_graphs()  # captured collectives would keep the process group from being destroyed

    def _loop(self, stop: "_StopSignals") -> None:
        t = self.tcfg
        self._last_eval = self._last_sample = self._last_ckpt = None
        # the budget's clock: with train.time_budget_counts = training, the time of evaluations, samples and
        # checkpoints is taken off it (``left_out``), so that it counts updates only
        left_out = 0.0
        training_only = t.time_budget_counts == "training"

        def clock() -> float:
            return wall_clock() - left_out
        start = clock()
        wall0 = start - self.wall_s  # a budget counts the earlier sessions of the run too
        eval_s = 0.0
        if self.step == 0 and t.eval_every:  # the starting point of the validation curve
            self.evaluate()
            self._last_eval = 0
            spent = wall_clock() - start  # (nothing is left out yet: the clock is the wall clock)
            if training_only:
                left_out += spent
            else:
                eval_s = spent
        window = None
        while self.step < t.max_steps:
            try:
                with zd.collective_timeout(self.dist, f"training update {self.step + 1}"):
                    rec = self.train_step()  # a hung collective fails after parallel.timeout_s, saying so
            except torch.OutOfMemoryError:
                raise self._out_of_memory(f"in update {self.step + 1}") from None
            self.watchdog.beat(self.step, rec["step_time_s"])
            more, warning = self.stragglers.observe(self.step, rec["step_time_s"], rec["data_wait_s"],
                                                    rec.get("arrival_wait_s", 0.0))
            rec.update(more)
            if warning and self.is_main:
                self._print(warning)
            self._check_diverged(rec)
            if self.is_main:
                self.numerics.observe(rec)
                window_end = bool(t.log_every) and self.step % t.log_every == 0
                for warning in self.numerics.window(rec) if window_end else ():
                    self._print(warning)
                self.logger.log(rec)
                if rec["skipped"] or window_end:
                    self._print(format_step_line(rec)
                                + (f" | mem/rank {rec['mem_per_rank']}" if "mem_per_rank" in rec else ""))
                if self._bar is not None:
                    self._bar.update(1)
                    self._bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.2e}")
            paused = wall_clock() if training_only else 0.0  # (read only when used: tests count the readings)
            with self.watchdog.pause():  # these have their own collective timeout
                if t.eval_every and self.step % t.eval_every == 0:
                    self.evaluate()
                    self._last_eval = self.step
                if t.sample_every and self.step % t.sample_every == 0:
                    self.sample()
                    self._last_sample = self.step
                if t.ckpt_every and self.step % t.ckpt_every == 0:
                    self.save_checkpoint()
                    self._last_ckpt = self.step
            if training_only:
                left_out += wall_clock() - paused
            if t.time_budget_s:
                window = window or (self.step, clock())
                if self._budget_check(wall0, window, eval_s, clock):
                    self._print(f"time budget of {t.time_budget_s:g} s used up after update {self.step} "
                                f"(of {t.max_steps})")
                    break
            else:
                self.wall_s = clock() - wall0
            # every rank stops at the same update, whichever of them got the signal
            if zd.any_true(stop.received is not None, self.dist):
                path = self.save_checkpoint() if self._last_ckpt != self.step else \
                    self.out_dir / ckpt_io.checkpoint_name(self.step)
                self.logger.close()
                raise TrainingInterrupted(stop.received or signal.SIGTERM, self.step, path)

    def _out_of_memory(self, where: str) -> Exception:
        """The one-line report of an out-of-memory error (train/memory.py), with the snapshot when recorded."""
        from zero2all.config import TrainingOutOfMemory
        from zero2all.train import memory

        breakdown = memory.state_breakdown(self.raw_model, zd.local_optimizer(self.optimizer))
        snapshot = None
        if self._snapshot_on:
            snapshot = memory.dump_snapshot(self.out_dir / f"memory_snapshot_rank{self.dist.rank}.pickle")
        line = memory.oom_line(where, self.device, breakdown, memory.predicted_peak(self.cfg, self.world_size),
                               snapshot)
        self.logger.close()
        return TrainingOutOfMemory(line if self.dist.world_size == 1 else f"rank {self.dist.rank}: {line}")

    def _check_diverged(self, rec: dict) -> None:
        """Stop after ``train.max_skipped_updates`` updates in a row were skipped (every rank decides alike: the
        gradient norm is global). The weights are those of the last applied update, so the newest checkpoint is
        still good; nothing more is written."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if rec["skipped"] else 0
        limit = self.tcfg.max_skipped_updates
        if limit and self.skipped_in_a_row >= limit:
            if self.is_main:
                self.logger.log(rec)
            self.logger.close()
            raise TrainingDiverged(
                f"training diverged: the last {self.skipped_in_a_row} updates (to step {self.step}) were all "
                f"skipped for non-finite gradients (loss {rec['loss']:.4g}, grad norm {rec['grad_norm']:.4g}, "
                f"lr {rec['lr']:.3g}); stopped without writing final/. Lower train.lr, check the data (or the "
                f"reward function), or raise train.max_skipped_updates")

    def final_model(self):
        """The model that ``final/`` holds, on rank 0 (a collective under FSDP)."""
        return self.run.gather_plain_model()

    def finish(self) -> dict:
        """Final model directory, loss curve, run report; returns the summary numbers."""
        self.logger.close_tensorboard()
        plain = self.final_model()  # FSDP: all ranks gather, rank 0 gets the copy
        if not self.is_main:
            return {}
        final = save_model(plain, self.out_dir / "final", tokenizer_dir=self.tokenizer_dir,
                           extra={"step": self.step, "tokenizer_hash": self.tokenizer_hash})
        records = read_metrics(self.logger.path)
        png = plot_loss_curve(records, self.out_dir / "loss.png", title=f"{self.objective.name}: {self.out_dir.name}")
        header = {
            "name": str(self.out_dir), "objective": self.objective.name, "device": str(self.device),
            "precision": self.precision, "parameters": f"{self.raw_model.num_params():,}",
            "tokens per step": f"{self.tokens_per_step:,} ({self.tcfg.grad_accum_steps} x {self.dp_size} x "
                               f"{self.tcfg.micro_batch_size} x {self.seq_len})",
            "data": self.cfg.data.path or "synthetic", "schedule": f"{self.tcfg.schedule}, lr {self.tcfg.lr:g}",
            "resumed from": str(self.resumed_from) if self.resumed_from else "-",
            "training time": f"{self.elapsed_s:.1f} s",
        }
        samples = self.last_samples
        if not samples:  # e.g. a resumed run that was already finished: the samples it logged before
            logged = [r for r in records if r.get("kind") == "sample"]
            samples = [r for r in logged if r["step"] == logged[-1]["step"]] if logged else []
        report = write_run_report(self.out_dir / "report.md", header, records, samples, png.name if png else None)
        summary = summarize(records)
        summary.update({"final": str(final), "report": str(report), "loss_png": str(png) if png else None})
        self.logger.close(artifacts=[report, png], failed=False)
        self._print(f"wrote {final}, {report}" + (f", {png}" if png else ""))
        return summary


def run_kind(objective_name: str) -> str:
    """The command a run of this objective is the output of (the RL objectives are named after the algorithm)."""
    return "rl" if objective_name in ("grpo", "ppo") else objective_name


def _is_legacy_run_dir(path: Path) -> bool:
    """A run folder written before outputs carried a marker: its metrics, a checkpoint or its final model."""
    return (path / "metrics.jsonl").is_file() or (path / "final" / "z2all.json").is_file() or any(
        ckpt_io.step_of(p) is not None and p.is_dir() for p in path.iterdir())


def claim_run_dir(out_dir: str | Path, kind: str, mark: bool = False) -> str:
    """``fileio.claim_output_dir`` for a training run's ``train.out_dir``: new, empty, or a run of the same command
    (to resume or to start over in; ``train.resume`` decides). A run folder is never replaced whole: the trainer
    writes its own names only (config.json, metrics.jsonl, ckpt-*, final/, ...). ``mark``: create the folder and
    its marker (one process: rank 0)."""
    state = claim_output_dir(out_dir, kind, legacy=_is_legacy_run_dir)
    if mark:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        if read_output_marker(out_dir) is None:
            write_output_marker(out_dir, kind)
    return state


def pretrain(cfg: Config, show_progress: bool = True) -> dict:
    """``z2all pretrain``: the shared trainer with the next-token objective."""
    try:  # before the data and the model are built: the trainer claims and locks it again when the run starts
        claim_run_dir(cfg.train.out_dir, "pretrain")
    except OutputDirError as e:
        raise ConfigError(str(e)) from None
    if cfg.train.init:  # continued pretraining: the architecture is the init checkpoint's (ops from the config)
        from zero2all.model.io import read_model_config, weights_dir

        stored = read_model_config(weights_dir(cfg.train.init))
        stored.ops = cfg.model.ops
        cfg.model = stored
    summary = Trainer(cfg, PretrainObjective(z_loss=cfg.train.z_loss), show_progress=show_progress).fit()
    zd.destroy_distributed()  # after a failure torchrun ends the processes (and restarts them with --max-restarts)
    return summary
