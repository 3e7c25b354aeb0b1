"""Configuration: plain dataclasses, TOML presets in ``configs/`` and dotted command-line overrides.

A run is described by one :class:`Config` with five sections::

    [model]     -> ModelConfig     (architecture; field names follow the original Z2all config)
    [train]     -> TrainConfig     (optimisation, precision, checkpoints, logging)
    [data]      -> DataConfig      (where the token shards are and how batches are drawn)
    [parallel]  -> ParallelConfig  (how a run is spread over processes)
    [post]      -> PostTrainConfig (sft / dpo: starting point, chat data, LoRA, DPO)
    [rl]        -> RLConfig        (z2all rl: PPO / GRPO rollouts, rewards, KL, clipping)

``load_config("tiny", ["model.n_layers=4", "train.lr=1e-3"])`` reads ``configs/tiny.toml`` (or any path to a
``.toml`` file), applies the overrides, and validates. :func:`build_config` also takes already-typed values by
dotted key (what the command line's options set)::

    build_config("tiny", ["train.lr=1e-3"], {"data.path": "runs/data", "train.out_dir": "runs/x"})

Precedence, lowest first: the dataclass defaults, the preset / file, ``values``, ``overrides`` (later overrides
win over earlier ones). A key set both in ``values`` and by an override is refused (the command line would say
the same thing twice, possibly differently). Each section validates itself (``TrainConfig.validate`` ...) and
:meth:`Config.validate` adds the checks across sections. Unknown keys, wrong types and values out of range are
rejected with a message that names the key, e.g. ``model.n_layer: unknown key (did you mean 'n_layers'?)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message names the key."""


class MissingPackageError(ConfigError, ImportError):
    """An optional package a command needs is not installed: one line naming the ``pip install`` that fixes it (a
    ConfigError, so the CLI exits 2 without a traceback; an ImportError, for callers that test for the package)."""


class TrainingDiverged(Exception):
    """A run stopped because its optimiser updates were skipped (non-finite gradients) ``train.max_skipped_updates``
    times in a row, or more than half of them by the end: no ``final/`` is written. ``exit_code`` 3."""

    exit_code = 3


class TrainingOutOfMemory(Exception):
    """A run ran out of device memory; the message is one line with what was allocated, by category, against
    ``z2all estimate``'s prediction, and what to change. ``exit_code`` 1 (a resource failure, like a full disk)."""

    exit_code = 1


class TrainingInterrupted(Exception):
    """SIGINT / SIGTERM stopped a training run after an update and a checkpoint; ``exit_code`` is 128 + the
    signal number (130 for Ctrl-C, 143 for SIGTERM), as shells report a process ended by that signal."""

    def __init__(self, signum: int, step: int, checkpoint=None):
        name = {2: "SIGINT", 15: "SIGTERM"}.get(signum, f"signal {signum}")
        where = f"saved {checkpoint}; continue with --resume auto" if checkpoint else "nothing saved"
        super().__init__(f"interrupted by {name} at step {step}: {where}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum


def _check_finite(section: Any, prefix: str) -> None:
    """Refuse NaN and infinity in every float field: both slip through range checks (``nan < 0`` and ``nan >= 0``
    are both false), and a NaN learning rate or epsilon only shows up as a NaN loss much later."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}.{f.name}: must be a finite number, got {value}")


def _check_choice(section: Any, name: str, choices: tuple[str, ...], prefix: str) -> None:
    value = getattr(section, name)
    if value not in choices:
        raise ConfigError(f"{prefix}.{name}: {value!r} is not one of {', '.join(choices)}")


def _check_choices(section: Any, prefix: str) -> None:
    """Each field named in the section's ``_CHOICES`` holds one of its choices (the command line's flags offer
    the same lists: ``config_fields``)."""
    for name, choices in type(section)._CHOICES.items():
        _check_choice(section, name, choices, prefix)


def _check_str_list(section: Any, name: str, prefix: str) -> None:
    value = getattr(section, name)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{prefix}.{name}: expected a list of strings, got {value!r}")


# --------------------------------------------------------------------------------------------------------------
# sections


@dataclass
class OpsConfig:
    """Which implementation each hot op uses. The switchboard in ``zero2all/model/ops.py`` reads these.

    ``torch``  : plain PyTorch (the reference every kernel is tested against).
    ``triton`` : our fused Triton kernel (``zero2all/kernels``).
    ``auto``   : ``triton`` for CUDA tensors when Triton is importable, else ``torch``.
    Attention: ``naive`` (explicit softmax, the reference), ``sdpa`` (torch scaled_dot_product_attention, flash /
    cuDNN backends on GPU), ``flex`` (FlexAttention; needed for document masks).
    Cross-entropy: ``torch`` materialises logits; ``fused`` computes the loss from hidden states in chunks.
    Fused linear: ``triton`` runs each block's projections as lean fused functions (norm + qkv / gate|up,
    SwiGLU + down, o) that keep far less for backward; they carry their own RMSNorm and SwiGLU kernels, so inside
    the blocks they take the place of ``rmsnorm`` / ``swiglu``. Used only where the projections are plain
    ``nn.Linear`` (not under LoRA).
    Linear precision: ``bf16`` runs the blocks' projections in the compute dtype; ``fp8_rowwise`` /
    ``fp8_tensorwise`` run their GEMMs on FP8 operands with dynamic per-row / per-tensor scales
    (``zero2all/kernels/fp8.py``; GPUs of compute capability >= 8.9, a float32 emulation on CPU). The LM head and
    the embedding stay in the compute dtype. FP8 options (docs/fp8.md; both change no value, only memory and
    speed): ``fp8_weight_cache`` = ``transposed`` (default) keeps each weight's W^T cast until the optimizer step
    and casts W per micro-batch, ``both`` keeps W too (1 byte per parameter more, no faster on an H100);
    ``fp8_fused_amax`` = true lets the norm and SwiGLU kernels write the maxima of what they produce for its FP8
    casts (one read less each). ``fp8_amax_history`` = n (2 .. 1024; ``fp8_tensorwise`` only; 0 = off, the
    default) is delayed scaling: each activation / gradient cast takes its scale from the largest amax of the
    n - 1 previous casts at the same place and records its own in the same pass (no amax pass; values beyond the
    scale saturate and are counted: docs/fp8.md).
    Step fusion (``zero2all/kernels/step_fusion.py``; only where training runs in one process without a
    data-parallel wrapper: the trainer and ``z2all bench train``): ``grads`` sums each weight gradient into the
    accumulated one inside its GEMM, in float32; ``all`` also casts each weight to bf16 once per optimizer step
    (2 bytes per parameter kept until the step); ``off`` (default): per use.
    """

    rmsnorm: str = "auto"          # RMSNorm: torch | triton | auto (triton on CUDA when importable)
    rope: str = "auto"             # rotary embedding: torch | triton | auto
    swiglu: str = "auto"           # SwiGLU: torch | triton | auto
    cross_entropy: str = "auto"    # torch (materialises logits) | fused (loss from hidden states in chunks) | auto
    # naive (explicit softmax) | sdpa (torch SDPA: flash / cuDNN) | flex (FlexAttention; document masks)
    attention: str = "sdpa"
    fused_linear: str = "auto"     # each block's projections as lean fused functions: torch | triton | auto
    grouped_gemm: str = "auto"     # MoE experts: auto | triton | torch (torch._grouped_mm) | loop (the reference)
    # the blocks' GEMMs: bf16 (compute dtype) | fp8_rowwise | fp8_tensorwise (docs/fp8.md)
    linear_precision: str = "bf16"
    # off | grads (sum weight gradients inside the GEMM) | all (also one bf16 weight cast per step)
    step_fusion: str = "off"
    fp8_weight_cache: str = "transposed"  # FP8: transposed (keep W^T's cast until the step) | both (keep W's too)
    fp8_fused_amax: bool = False   # FP8: the norm / SwiGLU kernels write the maxima of their outputs for the casts
    fp8_amax_history: int = 0      # fp8_tensorwise delayed scaling: window of 2 .. 1024 earlier casts (0 = off)

    _CHOICES = {
        "rmsnorm": ("torch", "triton", "auto"),
        "rope": ("torch", "triton", "auto"),
        "swiglu": ("torch", "triton", "auto"),
        "cross_entropy": ("torch", "fused", "auto"),
        "attention": ("naive", "sdpa", "flex"),
        "fused_linear": ("torch", "triton", "auto"),
        "grouped_gemm": ("auto", "triton", "torch", "loop"),
        "linear_precision": ("bf16", "fp8_rowwise", "fp8_tensorwise"),
        "step_fusion": ("off", "grads", "all"),
        "fp8_weight_cache": ("both", "transposed"),
    }

    def validate(self, prefix: str = "model.ops") -> None:
        _check_choices(self, prefix)
        n = self.fp8_amax_history
        if isinstance(n, bool) or not isinstance(n, int) or (n != 0 and not 2 <= n <= 1024):
            raise ConfigError(f"{prefix}.fp8_amax_history: {n!r} is neither 0 (off) nor a window of 2 .. 1024 casts")
        if n and self.fp8_fused_amax:
            raise ConfigError(f"{prefix}.fp8_amax_history: delayed scaling does not combine with "
                              f"{prefix}.fp8_fused_amax (a cast handed its operand's maxima scales from them)")
        if n and self.linear_precision != "fp8_tensorwise":
            raise ConfigError(f"{prefix}.fp8_amax_history: delayed scaling keeps one amax per tensor, so it needs "
                              f"{prefix}.linear_precision = 'fp8_tensorwise' (it is {self.linear_precision!r})")

    @classmethod
    def plain(cls) -> "OpsConfig":
        """Every op on its plain PyTorch path, attention through SDPA."""
        return cls(rmsnorm="torch", rope="torch", swiglu="torch", cross_entropy="torch", attention="sdpa",
                   fused_linear="torch", grouped_gemm="loop")


MOE_ROUTERS = ("softmax_topk", "sigmoid")


@dataclass
class MoEConfig:
    """Mixture of experts (``[model.moe]``, off while ``n_experts = 0``); the model code is ``model/moe.py``.

    Layer i is a MoE layer when ``i >= first_dense_layers`` and ``(i + 1) % moe_every == 0`` (Qwen2-MoE's
    ``mlp_only_layers`` / ``decoder_sparse_step``); other layers keep the dense MLP of ``intermediate_size``.
    ``router``: ``softmax_topk`` (softmax over experts, top-k, renormalised to sum 1 when ``renormalize``) or
    ``sigmoid`` (DeepSeek-V3: sigmoid scores, a per-expert bias added for the selection only and moved by
    ``bias_update_rate`` * sign(mean load - load) after each step, or with ``bias_update = "error"`` by
    ``bias_update_rate`` * clip((mean load - load) / mean load, -1, 1): balance without an auxiliary loss).
    ``seq_aux_loss_coef`` weighs the load-balancing loss computed within each sequence (DeepSeek-V3's complementary
    sequence-wise loss, beside the bias). ``capacity_factor`` 0 = dropless; c > 0 keeps at most
    ceil(c * tokens * top_k / n_experts) tokens per expert. ``balance_iters`` n > 0 (sigmoid router, training
    only): each micro-batch's selection bias is solved in n rounds, starting from the running bias, so that every
    expert receives nearly the same number of the batch's assignments (``model/moe.py: balanced_bias``); the
    running bias keeps following the load it alone would have given and is what evaluation and inference use.
    """

    n_experts: int = 0             # routed experts per MoE layer (0 = a dense model)
    top_k: int = 2                 # experts each token is sent to
    n_shared_experts: int = 0      # experts every token passes through, beside the routed ones
    expert_intermediate_size: int = 0      # width of each expert's MLP (0 = model.intermediate_size)
    shared_expert_gate: bool = False       # Qwen2-MoE: the shared experts' output scaled by sigmoid(x . w)
    moe_every: int = 1             # every this many layers is a MoE layer (Qwen2-MoE decoder_sparse_step)
    first_dense_layers: int = 0    # the first this many layers keep the dense MLP
    router: str = "softmax_topk"   # softmax_topk | sigmoid (DeepSeek-V3, bias-balanced)
    renormalize: bool = True               # softmax_topk: top-k weights divided by their sum (Mixtral)
    bias_update_rate: float = 1e-3         # sigmoid router: aux-loss-free balancing step
    bias_update: str = "sign"              # sign (DeepSeek-V3) | error (proportional to the relative load error)
    routed_scaling: float = 1.0            # routed experts' output multiplied by this (DeepSeek-V3)
    aux_loss_coef: float = 0.0             # Switch/GShard load-balancing loss weight
    seq_aux_loss_coef: float = 0.0         # the same loss per sequence, averaged (DeepSeek-V3 sequence-wise)
    z_loss_coef: float = 0.0               # router z-loss weight (ST-MoE)
    capacity_factor: float = 0.0           # c > 0: at most c x the even share of tokens per expert; 0 = dropless
    balance_iters: int = 0                 # sigmoid router, training: rounds of the per-batch bias (0 = off)

    _CHOICES = {"router": MOE_ROUTERS, "bias_update": ("sign", "error")}

    @property
    def enabled(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.enabled and i >= self.first_dense_layers and (i + 1) % self.moe_every == 0

    def validate(self, prefix: str = "model.moe") -> None:
        _check_finite(self, prefix)
        _check_choices(self, prefix)
        for name in ("n_experts", "n_shared_experts", "expert_intermediate_size", "first_dense_layers",
                     "aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef", "capacity_factor", "bias_update_rate",
                     "balance_iters"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}.{name}: must be >= 0, got {getattr(self, name)}")
        if self.moe_every < 1:
            raise ConfigError(f"{prefix}.moe_every: must be >= 1, got {self.moe_every}")
        if self.routed_scaling <= 0:
            raise ConfigError(f"{prefix}.routed_scaling: must be positive, got {self.routed_scaling}")
        if self.enabled and not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"{prefix}.top_k: must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.balance_iters and self.router != "sigmoid":
            raise ConfigError(f"{prefix}.balance_iters={self.balance_iters} solves the sigmoid router's selection "
                              f"bias; router is {self.router!r}")
        if self.shared_expert_gate and not self.n_shared_experts:
            raise ConfigError(f"{prefix}.shared_expert_gate needs {prefix}.n_shared_experts > 0")


@dataclass
class ModelConfig:
    """The Z2all (Llama-2) architecture. Defaults are the 1.1B reference model."""

    vocab_size: int = 64320        # tokens in the vocabulary
    hidden_dim: int = 2048         # width of the residual stream
    intermediate_size: int = 5632  # width of the dense SwiGLU MLP
    n_layers: int = 22             # transformer blocks
    n_heads: int = 32              # attention (query) heads
    n_kv_heads: int = 8            # key / value heads (grouped-query attention; divides n_heads)
    max_seq_len: int = 2048        # longest context the model is trained and run at
    initializer_range: float = 0.02  # std of the normal initialisation
    rms_norm_eps: float = 1e-5     # epsilon of every RMSNorm
    pad_token_id: int | None = None  # padding token id (none = no padding token)
    bos_token_id: int | None = None  # beginning-of-document token id (none = unset)
    eos_token_id: int | None = None  # end-of-document token id (none = unset)
    tie_word_embeddings: bool = False  # the LM head shares the embedding matrix
    rope_theta: float = 10000.0    # RoPE base frequency
    # None, or {"type": "linear" | "dynamic", "factor": float}; "dynamic" is dynamic NTK scaling, which also reads
    # "original_max_position_embeddings" (defaults to max_seq_len).
    rope_scaling: dict | None = None
    attention_bias: bool = False   # bias terms on the q / k / v / o projections
    attention_dropout: float = 0.0 # dropout on the attention probabilities
    dropout1: float = 0.0  # dropout on the attention block's output, before the residual add
    dropout2: float = 0.0  # dropout on the MLP block's output, before the residual add
    residual_in_fp32: bool = True  # keep the residual stream in float32 under bf16 / fp16
    # pad vocab_size up to a multiple of this (0 = leave as is); tensor cores like multiples of 64
    pad_vocab_to_multiple_of: int = 0
    # scale the init std of output projections (o_proj, down_proj) by 1/sqrt(2*n_layers) (GPT-2 / Megatron)
    scaled_init: bool = True
    ops: OpsConfig = field(default_factory=OpsConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe.expert_intermediate_size or self.intermediate_size

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_to_multiple_of
        if m and m > 1:
            return -(-self.vocab_size // m) * m
        return self.vocab_size

    def validate(self, prefix: str = "model") -> None:
        _check_finite(self, prefix)
        for name in ("vocab_size", "hidden_dim", "intermediate_size", "n_layers", "n_heads", "n_kv_heads",
                     "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}.{name}: must be positive, got {getattr(self, name)}")
        if self.hidden_dim % self.n_heads:
            raise ConfigError(f"{prefix}.hidden_dim: {self.hidden_dim} is not divisible by "
                              f"{prefix}.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"{prefix}.n_heads: {self.n_heads} is not divisible by "
                              f"{prefix}.n_kv_heads={self.n_kv_heads} (grouped-query attention needs whole groups)")
        if self.head_dim % 2:
            raise ConfigError(f"{prefix}: head_dim = hidden_dim / n_heads = {self.head_dim} must be even for RoPE")
        for name in ("attention_dropout", "dropout1", "dropout2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{prefix}.{name}: must be in [0, 1), got {getattr(self, name)}")
        for name in ("rms_norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}.{name}: must be positive, got {getattr(self, name)}")
        if self.initializer_range < 0:
            raise ConfigError(f"{prefix}.initializer_range: must be >= 0, got {self.initializer_range}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            if kind not in ("linear", "dynamic"):
                raise ConfigError(f"{prefix}.rope_scaling.type: {kind!r} is not one of linear, dynamic")
            factor = self.rope_scaling.get("factor")
            if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1.0:
                raise ConfigError(f"{prefix}.rope_scaling.factor: must be a number >= 1, got {factor!r}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.padded_vocab_size:
            raise ConfigError(f"{prefix}.pad_token_id: {self.pad_token_id} outside the vocabulary")
        self.ops.validate(prefix + ".ops")
        self.moe.validate(prefix + ".moe")


@dataclass
class DataConfig:
    """Where training batches come from (token shards written by ``z2all prepare``)."""

    path: str = ""                 # directory written by `z2all prepare`; "" = synthetic random tokens
    seq_len: int = 0               # tokens per training sequence (0 = model.max_seq_len)
    document_mask: bool = False    # return document boundaries per window (intra-document attention)

    def validate(self, prefix: str = "data") -> None:
        if self.seq_len < 0:
            raise ConfigError(f"{prefix}.seq_len: must be >= 0 (0 = model.max_seq_len), got {self.seq_len}")


# the choices of train.precision, train.schedule and train.fused_adamw (the trainer and optim.py, which read them,
# keep the same lists: config.py does not import the training code)
PRECISIONS = ("auto", "bf16", "fp16", "fp32", "fp64")
SCHEDULES = ("cosine", "wsd", "constant")
FP64_ON_GPU = ("{prefix}.precision = 'fp64' runs on the CPU only (it exists to compare runs at float64 rounding, "
               "and GPUs run float64 matmuls far slower than float32); set {prefix}.device = 'cpu' "
               "(it is {device!r}) or pick fp32 / bf16")
FUSED_ADAMW = ("auto", "true", "false")
TRAINABLE = ("all", "new_embeddings", "embeddings+norms")
OPTIMIZERS = ("adamw", "muon")


@dataclass
class TrainConfig:
    """Optimisation, precision, checkpointing and logging of one run."""

    out_dir: str = "runs/default"  # output directory: checkpoints, metrics, final/
    seed: int = 1337               # seed of initialisation, data order and sampling
    device: str = "auto"           # auto | cpu | cuda | cuda:N
    micro_batch_size: int = 2      # micro-batch size: sequences per data-parallel rank in one forward / backward
    grad_accum_steps: int = 1      # micro-batches summed into one optimiser update
    max_steps: int = 1000          # optimiser updates of the run
    # > 0: a wall-clock budget in seconds (training updates, evaluations, checkpoints): max_steps becomes an upper
    # bound, the LR schedule's length is fixed from the rate measured over the first updates (at the end of warmup,
    # at least 10 updates), and training stops when the time is up
    time_budget_s: float = 0.0
    # what the budget counts: all (the loop's wall time) | training (updates only: evaluations, samples and
    # checkpoints are left out, as the small-model speed records count their clocks)
    time_budget_counts: str = "all"
    # -- optimiser
    lr: float = 3e-4               # peak learning rate
    min_lr: float = 3e-5           # learning rate at the end of the schedule (<= lr)
    weight_decay: float = 0.1      # AdamW decoupled weight decay (matrices only)
    decay_embeddings: bool = False # apply weight decay to the embedding too
    beta1: float = 0.9             # AdamW beta1
    beta2: float = 0.95            # AdamW beta2
    eps: float = 1e-8              # AdamW epsilon
    grad_clip: float = 1.0         # gradient-norm clipping threshold (0 = off)
    fused_adamw: str = "auto"      # auto (fused on CUDA) | true | false
    # adamw | muon (train/muon.py: orthogonalised momentum for the blocks' weight matrices, AdamW for the rest)
    optimizer: str = "adamw"
    muon_lr: float = 0.0           # muon: the Muon matrices' peak learning rate (0 = train.lr), scheduled alike
    muon_momentum: float = 0.95    # muon: Nesterov momentum
    muon_ns_steps: int = 5         # muon: Newton-Schulz iterations
    muon_scale: str = "rms"        # muon: rms (0.2 sqrt(max(out, in)): AdamW's update size) | spectral
    # schedule: cosine (linear warmup then cosine to min_lr) | wsd (warmup, stable, linear decay) | constant
    schedule: str = "cosine"
    warmup_steps: int = 100        # updates of linear learning-rate warmup
    decay_fraction: float = 0.2    # wsd: fraction of max_steps spent decaying
    # precision: auto (bf16 on GPUs that support it, else fp32) | bf16 | fp16 | fp32 | fp64 (CPU only: parameters,
    # activations and optimizer state in float64, every op on its plain PyTorch path; for equivalence checks)
    precision: str = "auto"
    compile: bool = False          # torch.compile the model
    # -- evaluation / logging / checkpoints
    eval_every: int = 200          # updates between evaluations (0 = none)
    eval_batches: int = 20         # validation batches per evaluation
    # bits per byte on text files at each evaluation (`z2all eval`'s rules, per source: files, globs, NAME=PATH),
    # logged as eval/<source>/bits_per_byte; at most eval_data_max_docs documents in all
    eval_data: list[str] = field(default_factory=list)
    eval_data_max_docs: int = 200  # eval_data: documents scored at most, over all sources
    sample_every: int = 0          # updates between sampled continuations (0 = only at the end)
    log_every: int = 1             # updates between log lines (0 = none)
    ckpt_every: int = 500          # updates between checkpoints (0 = only the final one)
    keep_last: int = 3             # checkpoints kept in out_dir (older ones deleted; 0 = all)
    # stop (exit code 3, no final/) after this many optimiser updates in a row were skipped for non-finite
    # gradients (0 = never); a run that skipped more than half of its updates writes no final/ either
    max_skipped_updates: int = 20
    # the hang watchdog (train/watchdog.py): when no update completes for max(watchdog_min_s, watchdog_factor x the
    # median update time), every rank writes its threads' stacks to OUT/hang/, the ranks behind are named and the
    # run exits with code 4 (watchdog_factor = 0: off)
    watchdog_factor: float = 20.0
    watchdog_min_s: float = 300.0  # the hang watchdog's least wait in seconds (see watchdog_factor)
    # several processes: every this many updates, name a rank the others keep waiting for (train/watchdog.py,
    # StragglerMonitor; 0 = off); every update logs its data_wait_s and arrival_wait_s
    straggler_window: int = 20
    # CUDA: record allocations from the start and, on out-of-memory, write OUT/memory_snapshot.pickle for torch's
    # memory viewer (https://pytorch.org/memory_viz); costs host time per allocation
    memory_snapshot: bool = False
    tensorboard: bool = True       # write TensorBoard event files beside metrics.jsonl
    # experiment trackers beside metrics.jsonl and TensorBoard (train/trackers.py): wandb | mlflow
    trackers: list[str] = field(default_factory=list)
    tracker_project: str = "zero2all"  # project name given to the experiment trackers
    gpu_peak_flops: float = 0.0    # peak FLOP/s of MFU; 0 = detect from the GPU name (989e12 for H100/H200 bf16 dense)
    # resume: "" = fresh run (refuses an --out that already holds checkpoints) | auto (newest complete checkpoint
    # in out_dir, else fresh) | a checkpoint directory
    resume: str = ""
    z_loss: float = 0.0            # pretraining: weight of the PaLM z-loss (0 = off)
    # continued pretraining: start from this checkpoint's weights and architecture ("" = a fresh model), and train
    # all | new_embeddings (only embedding / LM-head rows a `z2all resize-vocab` added) | embeddings+norms
    init: str = ""
    trainable: str = "all"         # all | new_embeddings | embeddings+norms (see init)
    # -- sampled continuations at eval time and at the end ("" prompts = the first tokens of validation rows)
    num_samples: int = 3           # continuations sampled at each evaluation and at the end (0 = none)
    sample_new_tokens: int = 64    # tokens per sampled continuation
    sample_temperature: float = 0.8  # sampling temperature of the continuations
    sample_top_k: int = 50         # top-k of the continuations' sampling (0 = off)
    # prompts of the continuations ([] = the first tokens of validation rows)
    sample_prompts: list[str] = field(default_factory=list)

    _CHOICES = {"precision": PRECISIONS, "schedule": SCHEDULES, "fused_adamw": FUSED_ADAMW, "optimizer": OPTIMIZERS,
                "muon_scale": ("rms", "spectral"), "trainable": TRAINABLE, "time_budget_counts": ("all", "training")}

    def validate(self, prefix: str = "train") -> None:
        """Every field in range (naming it). ``LRSchedule`` (train/optim.py) checks the schedule fields again
        when the run starts; the same rules are kept here so that a bad value fails before any work."""
        _check_finite(self, prefix)
        for name in ("micro_batch_size", "grad_accum_steps", "max_steps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}.{name}: must be positive, got {getattr(self, name)}")
        for name in ("eval_every", "eval_batches", "log_every", "ckpt_every", "sample_every", "num_samples",
                     "sample_new_tokens", "warmup_steps", "keep_last", "sample_top_k", "weight_decay", "z_loss",
                     "max_skipped_updates",
                     "gpu_peak_flops", "sample_temperature", "time_budget_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}.{name}: must be >= 0, got {getattr(self, name)}")
        if self.grad_clip < 0:
            raise ConfigError(f"{prefix}.grad_clip: must be >= 0 (0 = off), got {self.grad_clip}")
        if self.lr <= 0:
            raise ConfigError(f"{prefix}.lr: must be positive, got {self.lr}")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"{prefix}.min_lr: must be in [0, {prefix}.lr={self.lr}], got {self.min_lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{prefix}.{name}: must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0:
            raise ConfigError(f"{prefix}.eps: must be positive, got {self.eps}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"{prefix}.decay_fraction: must be in (0, 1], got {self.decay_fraction}")
        _check_choices(self, prefix)
        if self.precision == "fp64" and self.device.startswith("cuda"):
            raise ConfigError(FP64_ON_GPU.format(prefix=prefix, device=self.device))
        for name in self.trackers:
            if name not in ("wandb", "mlflow"):
                raise ConfigError(f"{prefix}.trackers: {name!r} is not one of wandb, mlflow")
        if self.straggler_window < 0:
            raise ConfigError(f"{prefix}.straggler_window: must be >= 0 (0 = off), got {self.straggler_window}")
        if self.watchdog_factor < 0 or self.watchdog_min_s <= 0:
            raise ConfigError(f"{prefix}.watchdog_factor / watchdog_min_s: must be >= 0 / > 0, got "
                              f"{self.watchdog_factor} / {self.watchdog_min_s}")
        if self.muon_lr < 0:
            raise ConfigError(f"{prefix}.muon_lr: must be >= 0 (0 = {prefix}.lr), got {self.muon_lr}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"{prefix}.muon_momentum: must be in [0, 1), got {self.muon_momentum}")
        if self.muon_ns_steps < 1:
            raise ConfigError(f"{prefix}.muon_ns_steps: must be >= 1, got {self.muon_ns_steps}")
        _check_str_list(self, "sample_prompts", prefix)
        _check_str_list(self, "eval_data", prefix)
        if self.eval_data_max_docs < 1:
            raise ConfigError(f"{prefix}.eval_data_max_docs: must be at least 1, got {self.eval_data_max_docs}")
        if self.trainable == "new_embeddings" and not self.init:
            raise ConfigError(f"{prefix}.trainable: new_embeddings needs {prefix}.init (a `z2all resize-vocab` "
                              f"output: it says which rows are new)")



PARALLEL_MODES = ("auto", "none", "ddp", "fsdp", "zero1")
TP_IMPLS = ("local", "dtensor")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
PP_BALANCES = ("flops", "time")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")
AC_MODES = ("none", "full", "selective")
AC_SELECTIVE = ("blocks", "attention")


@dataclass
class ParallelConfig:
    """How a run is spread over processes (``[parallel]``; applied by ``zero2all/distributed/``, launched with
    torchrun). One process is world size 1: ``mode = "auto"`` then means no wrapping at all."""

    mode: str = "auto"             # auto (ddp when launched with >1 process, else none) | none | ddp | fsdp | zero1
    reshard_after_forward: bool = True   # fsdp: true = ZeRO-3-like (re-gather in backward), false = ZeRO-2-like
    fsdp_reduce_fp32: bool = True  # fsdp with bf16: reduce-scatter gradients in fp32 (false: in bf16)
    # fsdp with grad_accum_steps > 1: reduce-scatter once per update and keep the gathered parameters between
    # micro-batches (less communication; unsharded gradients and parameters cost memory). "auto": on with ep > 1
    # (the experts are sharded by ep, not by FSDP, so keeping the rest gathered costs little), off otherwise
    fsdp_accum_no_sync: bool | str = "auto"
    cpu_offload: bool = False      # fsdp: keep sharded parameters, gradients and optimizer state in CPU memory
    comm_hook: str = "none"        # ddp/zero1 gradient compression: none | bf16 (NCCL) | fp16 | powersgd
    powersgd_rank: int = 2         # powersgd: rank of the low-rank approximation
    powersgd_start_iter: int = 10  # powersgd: plain all-reduce for this many steps first
    activation_checkpointing: str = "none"   # none | full (every block) | selective
    ac_selective: str = "blocks"   # selective: blocks (every ac_every-th block) | attention (attention core only)
    ac_every: int = 2              # selective blocks: checkpoint blocks 0, k, 2k, ...
    timeout_s: float = 600.0       # a collective that does not complete within this many seconds fails the run
    ep: int = 1                    # expert parallel: experts divided over this many ranks (mesh dims ("dp", "ep"))
    # ep > 1: FSDP2 reshard_after_forward of the blocks (replaces reshard_after_forward there); false keeps the
    # gathered non-expert weights from forward to backward (they are small next to the experts)
    ep_reshard_after_forward: bool = False
    # -- the device mesh (distributed/mesh.py): pp x dp_replicate x dp_shard x cp x tp = the number of processes
    dp_replicate: int = 1          # HSDP replicas (gradients all-reduced across them)
    dp_shard: int = -1             # FSDP2 shards within a replica; -1 = the rest of the processes
    tp: int = 1                    # tensor parallel (Megatron 1-D: heads and MLP columns/rows split)
    pp: int = 1                    # pipeline stages across processes
    cp: int = 1                    # context parallel (ring attention over sequence chunks)
    sequence_parallel: bool = False  # with tp > 1: norms and the residual stream sharded along the sequence
    tp_impl: str = "local"         # tp: local (our kernels on local shards, one redistribution per region edge) |
                                   # dtensor (DTensor parallelize_module on every linear); distributed/tp.py
    tp_chunks: int = 1             # tp local + SP: each block runs as this many groups of whole sequences, so
                                   # one group's collectives overlap another's GEMMs (1 = one group)
    # tp local, CUDA: each block's forward / backward replayed as CUDA graphs (distributed/graphs.py); plain tp
    # only (no FSDP2, pp, cp, AC, compile). "auto": on wherever that holds (the reason printed where not)
    tp_graphs: bool | str = "auto"
    # tp_impl = dtensor + sequence_parallel + train.compile: torch's asynchronous tensor parallel (inductor's
    # micro-pipelining splits each all-gather / reduce-scatter + matmul pair into chunks over symmetric memory)
    async_tp: bool = False
    pp_schedule: str = "1f1b"      # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    # pipeline microbatches per micro-batch (must divide train.micro_batch_size); 0 = micro_batch_size, one
    # sequence per pipeline microbatch (the most microbatches, the smallest bubble (K-1)/(K+M-1))
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 1    # interleaved_1f1b / zero_bubble: virtual stages held by each pipeline rank
    # blocks per pipeline stage, first to last (e.g. [11, 11]); [] = balanced by pp_balance (distributed/pp.py)
    pp_split: list[int] = field(default_factory=list)
    pp_balance: str = "flops"      # stage costs: flops (the model's FLOPs) | time (timed on the devices at start)
    # each stage's blocks replayed as CUDA graphs (distributed/pp_graphs.py; CUDA, bf16 stages, no FSDP2 / tp / cp
    # / AC / zero_bubble). "auto": on wherever that holds (the reason printed where not)
    pp_cuda_graphs: bool | str = "auto"

    _CHOICES = {"mode": PARALLEL_MODES, "comm_hook": COMM_HOOKS, "activation_checkpointing": AC_MODES,
                "ac_selective": AC_SELECTIVE, "pp_schedule": PP_SCHEDULES, "tp_impl": TP_IMPLS,
                "pp_balance": PP_BALANCES}

    def uses_mesh(self) -> bool:
        """True when anything beyond plain data parallelism is asked for (tp, pp, cp or HSDP replicas)."""
        return self.tp > 1 or self.pp > 1 or self.cp > 1 or self.dp_replicate > 1

    def resolved_mode(self, world_size: int) -> str:
        """``auto`` -> fsdp with expert parallelism, ddp when several processes run, else none; ``mesh`` when tp /
        pp / cp / dp_replicate are used (data parallelism is then FSDP2 on the mesh's dp_shard (x cp) dimension)."""
        if self.uses_mesh():
            return "mesh"
        if self.mode == "auto":
            return "fsdp" if self.ep > 1 else "ddp" if world_size > 1 else "none"
        return self.mode

    def accum_no_sync(self) -> bool:
        """``fsdp_accum_no_sync`` resolved: "auto" is on with expert parallelism, off otherwise."""
        if self.fsdp_accum_no_sync == "auto":
            return self.ep > 1
        return bool(self.fsdp_accum_no_sync)

    def mesh_shape(self, world_size: int) -> dict[str, int]:
        """The size of each mesh dimension, outermost first: pp, dp_replicate, dp_shard, cp, tp (``dp_shard =
        -1`` resolved to the rest of ``world_size``). Raises ConfigError when the product is not the world size."""
        fixed = self.pp * self.dp_replicate * self.cp * self.tp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(f"parallel: pp={self.pp} x dp_replicate={self.dp_replicate} x cp={self.cp} x "
                                  f"tp={self.tp} = {fixed} does not divide the {world_size} processes")
            dp_shard = world_size // fixed
        if fixed * dp_shard != world_size:
            raise ConfigError(f"parallel: pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={dp_shard} x "
                              f"cp={self.cp} x tp={self.tp} = {fixed * dp_shard}, but {world_size} processes run")
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": dp_shard, "cp": self.cp,
                "tp": self.tp}

    def validate(self, world_size: int | None = None, prefix: str = "parallel") -> None:
        """Check every field on its own (naming it). What combines with what, and what ``world_size`` processes
        can run, is decided by the plan (``zero2all.distributed.plan.resolve``), from every parallel module's
        declared rules; ``world_size`` is accepted for the callers of earlier versions and not read here."""
        _check_finite(self, prefix)
        _check_choices(self, prefix)
        if self.ac_every < 1:
            raise ConfigError(f"{prefix}.ac_every: must be >= 1, got {self.ac_every}")
        if self.powersgd_rank < 1:
            raise ConfigError(f"{prefix}.powersgd_rank: must be >= 1, got {self.powersgd_rank}")
        if self.comm_hook == "powersgd" and self.powersgd_start_iter < 2:
            raise ConfigError(f"{prefix}.powersgd_start_iter: must be >= 2 (PowerSGD's error feedback needs "
                              f"warm-up steps of plain all-reduce)")
        if not self.timeout_s > 0:
            raise ConfigError(f"{prefix}.timeout_s: must be positive, got {self.timeout_s}")
        if self.ep < 1:
            raise ConfigError(f"{prefix}.ep: must be >= 1, got {self.ep}")
        if self.tp_chunks < 1:
            raise ConfigError(f"{prefix}.tp_chunks: must be >= 1, got {self.tp_chunks}")
        for name in ("tp_graphs", "pp_cuda_graphs", "fsdp_accum_no_sync"):
            if isinstance(getattr(self, name), str) and getattr(self, name) != "auto":
                raise ConfigError(f"{prefix}.{name}: expected true, false or \"auto\", got {getattr(self, name)!r}")
        for name in ("dp_replicate", "tp", "pp", "cp", "pp_stages_per_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name}: must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(f"{prefix}.dp_shard: must be >= 1 or -1 (the rest of the processes), "
                              f"got {self.dp_shard}")
        if self.pp_microbatches < 0:
            raise ConfigError(f"{prefix}.pp_microbatches: must be >= 0 (0 = train.micro_batch_size), "
                              f"got {self.pp_microbatches}")


# train-section keys of earlier versions that now live in [parallel] (read with a warning)
LEGACY_PARALLEL_KEYS = {"parallel": "mode", "dist_timeout_s": "timeout_s",
                        **{k: k for k in ("reshard_after_forward", "fsdp_reduce_fp32", "fsdp_accum_no_sync",
                                          "cpu_offload", "comm_hook", "powersgd_rank", "powersgd_start_iter",
                                          "activation_checkpointing", "ac_selective", "ac_every")}}


PACKINGS = ("pack", "pad")
ON_ERROR = ("raise", "skip")


@dataclass
class PostTrainConfig:
    """Post-training (``z2all sft`` / ``z2all dpo``, ``zero2all/train/posttrain.py``): starting point, chat data,
    LoRA and DPO settings. Unused by pretraining."""

    init: str = ""                 # pretrained checkpoint to start from (ours, HF Llama, or base + LoRA adapter)
    # training records: jsonl / json files, or one directory of prepared records
    data: list[str] = field(default_factory=list)
    valid: list[str] = field(default_factory=list)  # validation files ([] = valid_fraction of the data)
    valid_fraction: float = 0.0    # share of the samples held out for evaluation when `valid` is empty
    tokenizer: str = ""            # tokenizer directory ("" = the one stored with `init`)
    packing: str = "pack"          # sft: pack (several samples per row, attention kept inside each) | pad
    on_error: str = "raise"        # malformed records: raise (naming file:line) | skip (counted and reported)
    lora_rank: int = 0             # LoRA rank: 0 = full fine-tuning; > 0 = train LoRA adapters only
    lora_alpha: float = 16.0       # LoRA scaling numerator (scaling = alpha / rank)
    lora_dropout: float = 0.0      # dropout on the LoRA branch's input
    # qkv_proj o_proj gate_up_proj down_proj lm_head (or the HF names q_proj k_proj v_proj ...)
    lora_targets: list[str] = field(default_factory=lambda: ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    beta: float = 0.1              # dpo: strength of the KL anchor to the reference model
    ref: str = ""                  # dpo: reference model directory ("" = init)
    precompute_ref: bool = False   # dpo: reference log-probs computed once before training (no second model)
    prompt_tuning: str = ""        # "" | prompt | prefix: train virtual tokens only (zero2all/model/prompt_tuning.py)
    num_virtual_tokens: int = 16   # virtual tokens of prompt_tuning

    _CHOICES = {"packing": PACKINGS, "on_error": ON_ERROR, "prompt_tuning": ("", "prompt", "prefix")}

    def validate(self, prefix: str = "post") -> None:
        """Every field in range. That ``init`` and ``data`` are set is checked by ``posttrain_config``: a
        pretraining run leaves them empty."""
        _check_finite(self, prefix)
        _check_choices(self, prefix)
        for name in ("data", "valid", "lora_targets"):
            _check_str_list(self, name, prefix)
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ConfigError(f"{prefix}.valid_fraction: must be in [0, 1), got {self.valid_fraction}")
        if self.lora_rank < 0:
            raise ConfigError(f"{prefix}.lora_rank: must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.lora_alpha <= 0:
            raise ConfigError(f"{prefix}.lora_alpha: must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"{prefix}.lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        if self.beta <= 0:
            raise ConfigError(f"{prefix}.beta: must be positive, got {self.beta}")
        if self.num_virtual_tokens < 1:
            raise ConfigError(f"{prefix}.num_virtual_tokens: must be >= 1, got {self.num_virtual_tokens}")
        if self.prompt_tuning and self.lora_rank:
            raise ConfigError(f"{prefix}.prompt_tuning: one adapter kind at a time; set {prefix}.lora_rank=0")


RL_ALGOS = ("grpo", "ppo")
KL_ESTIMATORS = ("k1", "k3")


@dataclass
class RLConfig:
    """Online RL (``z2all rl``, ``zero2all/train/rl.py``); the prompts come from ``post.data``."""

    algo: str = "grpo"             # grpo (group-normalised rewards, no value model) | ppo (value head, GAE)
    reward_fn: str = ""            # Python reward function module:function, called as fn(completion, record)
    reward_model: str = ""         # or a reward model: a `z2all reward` model directory
    group_size: int = 8            # responses sampled per prompt (grpo: the group; ppo: 1 is usual)
    max_new_tokens: int = 64       # response length limit of a rollout
    temperature: float = 1.0       # rollout sampling temperature
    top_k: int = 0                 # rollout top-k (0 = off)
    kl_coef: float = 0.04          # weight of the KL to the reference (0 = no reference at all)
    kl_estimator: str = "k3"       # k1 (log-ratio) | k3 (exp(d) - d - 1); grpo puts it in the loss, ppo in the reward
    clip_eps: float = 0.2          # PPO ratio clipping
    epochs: int = 1                # optimiser updates per rollout (> 1: the ratio moves away from 1 and clips)
    scale_rewards: bool = True     # grpo: divide by the group's standard deviation
    gamma: float = 1.0             # ppo: discount
    lam: float = 0.95              # ppo: GAE lambda
    vf_coef: float = 0.1           # ppo: value loss weight
    value_clip: float = 0.2        # ppo: value clipping range
    fused_decode: str = "auto"     # rollouts with the fused decode kernels: auto | on | off

    _CHOICES = {"algo": RL_ALGOS, "kl_estimator": KL_ESTIMATORS, "fused_decode": ("auto", "on", "off")}

    def validate(self, prefix: str = "rl") -> None:
        _check_finite(self, prefix)
        _check_choices(self, prefix)
        if self.reward_fn and self.reward_model:
            raise ConfigError(f"{prefix}.reward_fn / {prefix}.reward_model: give one reward source, not both")
        if self.reward_fn and ":" not in self.reward_fn:
            raise ConfigError(f"{prefix}.reward_fn: expected module:function, got {self.reward_fn!r}")
        for name in ("group_size", "max_new_tokens", "epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name}: must be >= 1, got {getattr(self, name)}")
        if self.algo == "grpo" and self.group_size < 2:
            raise ConfigError(f"{prefix}.group_size: grpo compares responses within a group; needs >= 2, "
                              f"got {self.group_size}")
        if self.temperature <= 0:
            raise ConfigError(f"{prefix}.temperature: rollouts sample; must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"{prefix}.top_k: must be >= 0, got {self.top_k}")
        for name in ("kl_coef", "vf_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}.{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("clip_eps", "value_clip"):
            if not 0 < getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name}: must be in (0, 1), got {getattr(self, name)}")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"{prefix}.gamma / {prefix}.lam: must be in [0, 1], got {self.gamma}, {self.lam}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    post: PostTrainConfig = field(default_factory=PostTrainConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def validate(self, world_size: int | None = None) -> "Config":
        """Every section, then the rules across sections that are not about parallelism (those are the plan's:
        ``zero2all.distributed.plan.resolve(cfg, world_size)``); ``world_size`` is not read here."""
        self.model.validate("model")
        self.train.validate("train")
        self.data.validate("data")
        self.parallel.validate(world_size, "parallel")
        self.post.validate("post")
        self.rl.validate("rl")
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"data.seq_len: {self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        if self.train.precision == "fp64" and self.model.ops.linear_precision != "bf16":
            raise ConfigError(f"train.precision = 'fp64' with model.ops.linear_precision = "
                              f"{self.model.ops.linear_precision!r}: float64 runs every matmul in float64; set "
                              f"linear_precision = 'bf16' (the compute dtype) or pick fp32 / bf16")
        return self

    def to_dict(self) -> dict:
        return to_dict(self)


# --------------------------------------------------------------------------------------------------------------
# the settings, one per leaf field: what the command line's flags are generated from (zero2all/cli_flags.py)


@dataclass(frozen=True)
class ConfigField:
    """One setting: its dotted key, Python type, default, help text and choices (empty: any value of the type).

    The help text is the field's comment in this file: the comment lines right above the field (at the field's
    indentation) and the comment after it, with the lines that continue it further right. A comment line that
    starts with ``# --`` heads a group of fields and belongs to none of them."""

    key: str
    type: Any
    default: Any
    help: str
    choices: tuple = ()


@functools.lru_cache(maxsize=1)
def _field_comments() -> Mapping[tuple[str, str], str]:
    """(class name, field name) -> the field's comment text, read from this module's source (once: the source
    does not change while the process runs; the mapping is read-only)."""
    import ast
    import io
    import tokenize

    try:
        source = Path(__file__).read_text(encoding="utf-8")
    except OSError:  # pragma: no cover - a build without sources: flags without help
        return {}
    lines = source.splitlines()
    comments = {tok.start[0]: (tok.start[1], tok.string[1:].strip())
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}

    def alone(row: int) -> bool:   # a line holding only a comment
        return row in comments and lines[row - 1].lstrip().startswith("#")

    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            col, text = stmt.col_offset, []
            row = stmt.lineno - 1
            while alone(row) and comments[row][0] == col and not comments[row][1].startswith("--"):
                text.insert(0, comments[row][1])
                row -= 1
            text += [comments[r][1] for r in range(stmt.lineno, stmt.end_lineno + 1) if r in comments]
            row = stmt.end_lineno + 1
            while text and alone(row) and comments[row][0] > col:
                text.append(comments[row][1])
                row += 1
            out[(node.name, stmt.target.id)] = " ".join(t for t in text if t)
    return types.MappingProxyType(out)


@functools.lru_cache(maxsize=None)
def config_fields(cls: type | None = None) -> tuple[ConfigField, ...]:
    """Every leaf setting of ``cls`` (default :class:`Config`) in declaration order, sections recursed into
    (``model.ops.attention``); fields starting with ``_`` are not settings. Computed once per class."""
    return tuple(_fields(Config if cls is None else cls, "", _field_comments()))


def _fields(cls: type, prefix: str, comments: Mapping[tuple[str, str], str]) -> list[ConfigField]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out += _fields(hints[f.name], key, comments)
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        out.append(ConfigField(key, hints[f.name], default, comments.get((cls.__name__, f.name), ""),
                               tuple(getattr(cls, "_CHOICES", {}).get(f.name, ()))))
    return out


# --------------------------------------------------------------------------------------------------------------
# generic dict <-> dataclass with key-naming errors

# keys that earlier versions accepted and that are gone: a config that still sets one is told why
REMOVED_KEYS = {
    "data.num_workers": "was removed: it was never read (batches come from memory-mapped shards in the training "
                        "process, without loader workers); delete it",
}


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if not f.name.startswith("_")}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _check_type(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r} ({type(value).__name__})")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r} ({type(value).__name__})")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r} ({type(value).__name__})")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r} ({type(value).__name__})")
    if tp is list or origin is list:
        # a tuple is accepted from Python callers; a single string is not silently taken as a list of characters
        if isinstance(value, (list, tuple)):
            item = args[0] if args else Any
            return [_check_type(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        raise ConfigError(f"{key}: expected a list, got {value!r} ({type(value).__name__})")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key}: expected a table, got {value!r}")
    return value


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types with the key's dotted name."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            if dotted in REMOVED_KEYS:
                raise ConfigError(f"{dotted}: {REMOVED_KEYS[dotted]}")
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(fields)})"
            raise ConfigError(f"{dotted}: unknown key{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value, dotted)
        else:
            kwargs[key] = _check_type(value, tp, dotted)
    return cls(**kwargs)


def deep_merge(base: dict, extra: dict) -> dict:
    """``extra`` on top of ``base``, table by table; ``rope_scaling`` is replaced whole (a linear scaling's keys
    must not mix with a dynamic one's)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "rope_scaling":
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _split_key(key: str, what: str) -> list[str]:
    parts = key.strip().split(".")
    if not key.strip() or any(not part for part in parts):
        raise ConfigError(f"{what}: bad key")
    return parts


def _nest(keys: list[str], value: Any) -> dict:
    for k in reversed(keys):
        value = {k: value}
    return value


def _leaf_keys(data: Any, prefix: str = "") -> list[str]:
    """The dotted keys a nested dict sets (a table counts through its entries; an empty one as itself)."""
    if not isinstance(data, dict) or not data:
        return [prefix] if prefix else []
    return [leaf for k, v in data.items() for leaf in _leaf_keys(v, f"{prefix}.{k}" if prefix else k)]


def _overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``model.n_layers=4`` -> (["model", "n_layers"], 4). Values are parsed as TOML, falling back to a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. model.n_layers=4")
    key, raw = text.split("=", 1)
    keys = _split_key(key, f"override {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return keys, value


def preset_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" and p.exists():
        return p
    candidate = CONFIG_DIR / f"{name_or_path}.toml"
    if candidate.exists():
        return candidate
    known = sorted(q.stem for q in CONFIG_DIR.glob("*.toml"))
    raise ConfigError(f"config {str(name_or_path)!r}: no such file and no preset of that name "
                      f"(presets: {', '.join(known)})")


def list_presets() -> list[str]:
    return sorted(q.stem for q in CONFIG_DIR.glob("*.toml"))


def read_config_file(name_or_path: str | Path | None) -> dict:
    """The raw tables of a preset name or ``.toml`` path ({} for None)."""
    if name_or_path is None:
        return {}
    path = preset_path(name_or_path)
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None


def migrate_legacy_keys(data: dict, warn=None) -> dict:
    """Move the distributed keys that earlier versions kept in ``[train]`` (``train.parallel``, ...) to
    ``[parallel]``, saying so once per key through ``warn`` (default: print to stderr)."""
    train = data.get("train")
    if not isinstance(train, dict) or not any(k in LEGACY_PARALLEL_KEYS for k in train):
        return data
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    data = dict(data)
    train = dict(train)
    parallel = dict(data.get("parallel") or {})
    for old, new in LEGACY_PARALLEL_KEYS.items():
        if old in train:
            value = train.pop(old)
            if new in parallel and parallel[new] != value:
                raise ConfigError(f"train.{old}={value!r} and parallel.{new}={parallel[new]!r}: the first is the "
                                  f"old name of the second; set parallel.{new} only")
            parallel[new] = value
            warn(f"note: train.{old} is now parallel.{new} (read as parallel.{new}={value!r})")
    data["parallel"] = parallel
    if train:
        data["train"] = train
    else:  # nothing else was set in [train]: no empty table left to be taken for a setting of all its keys
        del data["train"]
    return data


def build_config_dict(preset_or_file: str | Path | None = None, overrides: Iterable[str] | None = None,
                      values: Mapping[str, Any] | None = None, *, sources: Mapping[str, str] | None = None,
                      warn=None) -> dict:
    """The merged, not yet checked tables of a run: ``preset_or_file``, then ``values``, then ``overrides``.

    ``values`` maps dotted keys to typed Python values (``{"data.path": "runs/x", "post.lora_rank": 8}``): what
    command-line options set, so they win over the file. ``overrides`` are ``key=value`` strings (TOML values);
    later ones win over earlier ones. A key given both in ``values`` and by an override with another value is
    refused, naming it and
    where each came from (``sources`` maps a dotted key to e.g. ``"--out"``). Keys of earlier versions
    (``train.parallel``) are moved to their new place in each layer separately (see :func:`migrate_legacy_keys`),
    so an override under the new name wins over a file that still uses the old one.
    """
    data = migrate_legacy_keys(read_config_file(preset_or_file), warn)
    layer: dict = {}
    given: list[tuple[str, str]] = []  # (leaf key, where it came from)
    for key, value in (values or {}).items():
        nested = migrate_legacy_keys(_nest(_split_key(key, f"value {key!r}"), value), warn)
        where = (sources or {}).get(key) or f"the value of {key}"
        given += [(leaf, where) for leaf in _leaf_keys(nested)]
        layer = deep_merge(layer, nested)
    data = deep_merge(data, layer)
    for text in overrides or []:
        nested = migrate_legacy_keys(_nest(*parse_override(text)), warn)
        for leaf in _leaf_keys(nested):
            for other, where in given:
                if leaf == other and _dotted_get(layer, leaf) == _dotted_get(nested, leaf):
                    continue  # the same value twice (e.g. --out DIR and train.out_dir=DIR) is no conflict
                if _overlap(leaf, other):
                    raise ConfigError(f"{other}: set twice, by {where} and by the override {text!r}; give it "
                                      f"once")
        data = deep_merge(data, nested)
    return data


def _dotted_get(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


_MISSING = object()


def build_config(preset_or_file: str | Path | None = None, overrides: Iterable[str] | None = None,
                 values: Mapping[str, Any] | None = None, *, sources: Mapping[str, str] | None = None,
                 warn=None) -> Config:
    """A checked :class:`Config` from a preset or ``.toml`` file, typed ``values`` and ``key=value`` overrides
    (precedence and conflicts: :func:`build_config_dict`)."""
    return from_dict(Config, build_config_dict(preset_or_file, overrides, values, sources=sources,
                                               warn=warn)).validate()


def load_config_dict(name_or_path: str | Path | None, overrides: list[str] | None = None) -> dict:
    """The merged tables of a file and ``key=value`` overrides, not yet checked (:func:`build_config_dict`)."""
    return build_config_dict(name_or_path, overrides)


def load_config(name_or_path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a preset name (``tiny``) or a ``.toml`` path, apply ``key=value`` overrides, validate."""
    return build_config(name_or_path, overrides)


def model_config_from_dict(data: dict) -> ModelConfig:
    cfg = from_dict(ModelConfig, data, "model")
    cfg.validate()
    return cfg


def load_model_config(name_or_path: str | Path, overrides: list[str] | None = None) -> ModelConfig:
    return load_config(name_or_path, overrides).model

