"""LoRA (Hu et al., 2021): low-rank adapters on the model's linear layers, merge / unmerge, PEFT-compatible files.

A LoRA linear computes ``y = x W^T + b + scaling * dropout(x) A^T B^T`` with A (r, in) and B (out, r), scaling =
alpha / r (alpha / sqrt(r) with rsLoRA). B starts at zero, so training starts from the base model exactly; A
starts like an ``nn.Linear`` weight (Kaiming-uniform). Merging adds ``scaling * B A`` into W (no extra cost at
inference); unmerging subtracts it again.

Targets are named by module: ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, ``lm_head`` (default: the
first four). The HF names ``q_proj, k_proj, v_proj`` (and ``gate_proj, up_proj``) are accepted as a whole group,
since here they are one fused projection.

Adapters are saved alone in the PEFT layout (``adapter_config.json`` + ``adapter_model.safetensors``) under HF
Llama module names, so ``peft.PeftModel.from_pretrained(hf_model, dir)`` loads them onto the exported HF model.
The fused projections map exactly: for ``qkv_proj`` with (A, B), the rows of B split as the weight's rows do::

    q_proj: A, B[:q]      k_proj: A, B[q:q+kv]      v_proj: A, B[q+kv:]        (all three share A)

since (B A)[rows] = B[rows] A. Loading goes the other way; adapters trained elsewhere (separate A per part, or
only some of q/k/v) load exactly too, as a block LoRA of rank (number of parts) * r: A = [A_q; A_k; A_v] and B
block-diagonal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero2all.fileio import save_json, write_bytes

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OUR_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
DEFAULT_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FUSED_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
HF_TO_FUSED = {part: fused for fused, parts in FUSED_GROUPS.items() for part in parts}


@dataclass
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    use_rslora: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def resolved_targets(self) -> tuple[str, ...]:
        """Our module names; HF names must come as whole fused groups."""
        if self.rank < 1:
            raise ValueError(f"lora.rank: must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout: must be in [0, 1), got {self.dropout}")
        names = ("all-linear",) if self.targets == "all-linear" else tuple(self.targets)
        out: list[str] = []
        for name in names:
            if name == "all-linear":
                out += [t for t in DEFAULT_TARGETS if t not in out]
            elif name in OUR_TARGETS:
                out.append(name)
            elif name in HF_TO_FUSED:
                fused = HF_TO_FUSED[name]
                missing = [p for p in FUSED_GROUPS[fused] if p not in names]
                if missing:
                    raise ValueError(f"lora.targets: {name} is part of the fused {fused} here; target all of "
                                     f"{', '.join(FUSED_GROUPS[fused])} (or {fused}), missing {', '.join(missing)}")
                out.append(fused)
            else:
                raise ValueError(f"lora.targets: unknown module {name!r} (known: {', '.join(OUR_TARGETS)}, the HF "
                                 f"names {', '.join(HF_TO_FUSED)}, or all-linear)")
        return tuple(dict.fromkeys(out))


class LoRALinear(nn.Module):
    """An ``nn.Linear`` with a low-rank update. Keeps the base's ``weight`` / ``bias`` parameters (same names, so
    the model's state dict keeps its keys) and adds ``lora_A`` (r, in) and ``lora_B`` (out, r)."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = scaling
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.merged = False

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B @ self.lora_A) * self.scaling          # (out, in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.merged:
            return y
        return y + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling

    @torch.no_grad()
    def merge(self):
        if not self.merged:
            self.weight += self.delta_weight().to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        if self.merged:
            self.weight -= self.delta_weight().to(self.weight.dtype)
            self.merged = False

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding the merged weight."""
        self.merge()
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = self.weight
        lin.bias = self.bias
        return lin

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, rank={self.lora_A.size(0)}, "
                f"scaling={self.scaling:g}, merged={self.merged}")


# --------------------------------------------------------------------------------------------------------------
# applying, merging, trainable parameters


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def _set_module(model: nn.Module, name: str, module: nn.Module):
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Wrap every target linear in a :class:`LoRALinear` (in place) and make only the LoRA weights trainable."""
    targets = cfg.resolved_targets()
    if getattr(model.cfg, "tie_word_embeddings", False) and "lm_head" in targets:
        raise ValueError("lora.targets: lm_head is tied to the embedding in this model; leave it out")
    found = 0
    # MoE blocks keep their weights (their shared experts' names have no PEFT counterpart in HF): LoRA goes on
    # attention and the dense MLPs
    from zero2all.model.moe import MoE

    moe = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, MoE))
    for name, module in list(model.named_modules()):
        in_moe = bool(moe) and name.startswith(moe)
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets and not in_moe:
            _set_module(model, name, LoRALinear(module, cfg.rank, cfg.scaling, cfg.dropout))
            found += 1
    if not found:
        raise ValueError(f"lora.targets: no module named {', '.join(targets)} in the model")
    model.lora_config = cfg
    mark_only_lora_trainable(model)
    return model


def mark_only_lora_trainable(model: nn.Module) -> tuple[int, int]:
    """requires_grad only on lora_A / lora_B; returns (trainable, total) parameter counts."""
    trainable = total = 0
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(("lora_A", "lora_B")))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total


def set_merged(model: nn.Module, merged: bool) -> None:
    for m in lora_modules(model).values():
        m.merge() if merged else m.unmerge()


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight and put plain ``nn.Linear`` modules back (in place)."""
    for name, m in lora_modules(model).items():
        _set_module(model, name, m.to_linear())
    if hasattr(model, "lora_config"):
        del model.lora_config
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.endswith(("lora_A", "lora_B"))}


# --------------------------------------------------------------------------------------------------------------
# PEFT files


def _hf_prefix(name: str) -> str:
    """Our module path -> PEFT's key prefix on the HF model (``layers.3.mlp.down_proj`` ->
    ``base_model.model.model.layers.3.mlp.down_proj``)."""
    return "base_model.model." + (name if name == "lm_head" else "model." + name)


def _split_sizes(model: nn.Module, fused: str) -> list[int]:
    c = model.cfg
    if fused == "qkv_proj":
        return [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
    return [c.intermediate_size, c.intermediate_size]


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights under PEFT's HF Llama names (fused projections split by rows of B, A shared)."""
    out = {}
    for name, m in lora_modules(model).items():
        leaf = name.rsplit(".", 1)[-1]
        A, B = m.lora_A.detach().cpu(), m.lora_B.detach().cpu()
        if leaf in FUSED_GROUPS:
            parent = name.rsplit(".", 1)[0]
            for part, b in zip(FUSED_GROUPS[leaf], B.split(_split_sizes(model, leaf), dim=0)):
                out[f"{_hf_prefix(parent + '.' + part)}.lora_A.weight"] = A.clone()
                out[f"{_hf_prefix(parent + '.' + part)}.lora_B.weight"] = b.contiguous()
        else:
            out[f"{_hf_prefix(name)}.lora_A.weight"] = A.contiguous()
            out[f"{_hf_prefix(name)}.lora_B.weight"] = B.contiguous()
    return out


def save_adapter(model: nn.Module, out_dir: str | Path, base_model_name_or_path: str = "") -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT layout) to ``out_dir``."""
    from safetensors.torch import save

    cfg: LoRAConfig = getattr(model, "lora_config", None)
    if cfg is None or not lora_modules(model):
        raise ValueError("save_adapter: the model has no LoRA layers (apply_lora first)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = []
    for t in cfg.resolved_targets():
        targets += list(FUSED_GROUPS.get(t, (t,)))
    tensors = adapter_tensors(model)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": targets,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": cfg.use_rslora, "use_dora": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }
    # each file is replaced atomically (the directory may hold other files, e.g. the tokenizer's)
    write_bytes(out_dir / ADAPTER_WEIGHTS, save(tensors, metadata={"format": "pt"}))
    save_json(config, out_dir / ADAPTER_CONFIG)
    return out_dir


def read_adapter_config(adapter_dir: str | Path) -> tuple[LoRAConfig, dict]:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.exists():
        raise FileNotFoundError(f"{adapter_dir}: no {ADAPTER_CONFIG}")
    raw = json.loads(path.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {raw.get('peft_type')!r} is not LORA")
    for key in ("use_dora",):
        if raw.get(key):
            raise ValueError(f"{path}: {key}=true is not supported")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise ValueError(f"{path}: per-module rank_pattern / alpha_pattern are not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={raw['bias']!r} is not supported (only 'none')")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    cfg = LoRAConfig(rank=int(raw["r"]), alpha=float(raw.get("lora_alpha", raw["r"])),
                     dropout=float(raw.get("lora_dropout", 0.0)), targets=tuple(targets),
                     use_rslora=bool(raw.get("use_rslora", False)))
    return cfg, raw


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Attach a PEFT-layout adapter (ours or trained with ``peft``) to our model, exactly (see the docstring)."""
    from safetensors.torch import load_file

    cfg, raw = read_adapter_config(adapter_dir)
    wfile = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not wfile.exists():
        raise FileNotFoundError(f"{adapter_dir}: no {ADAPTER_WEIGHTS}")
    tensors = {k.replace(".default.", "."): v for k, v in load_file(str(wfile)).items()}
    # group the adapter's tensors by our module: {our module name: {part: (A, B)}}
    grouped: dict[str, dict[str, list]] = {}
    for key, t in tensors.items():
        if not key.startswith("base_model.model.") or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(f"{wfile}: unexpected tensor {key}")
        module = key[len("base_model.model."):].rsplit(".lora_", 1)[0]
        module = module[len("model."):] if module.startswith("model.") else module
        parent, _, leaf = module.rpartition(".")
        ours, part = (f"{parent}.{HF_TO_FUSED[leaf]}", leaf) if leaf in HF_TO_FUSED else (module, leaf)
        ab = grouped.setdefault(ours, {}).setdefault(part, [None, None])
        ab[0 if ".lora_A." in key else 1] = t
    modules = dict(model.named_modules())
    for ours, parts in grouped.items():
        base = modules.get(ours)
        if not isinstance(base, nn.Linear):
            raise ValueError(f"{wfile}: adapter for {ours}, which is not a linear layer of this model")
        for part, (a, b) in parts.items():
            if a is None or b is None:
                raise ValueError(f"{wfile}: {ours} ({part}) lacks lora_A or lora_B")
        leaf = ours.rsplit(".", 1)[-1]
        w = base.weight
        if leaf in FUSED_GROUPS:
            names = FUSED_GROUPS[leaf]
            sizes = _split_sizes(model, leaf)
            present = [n for n in names if n in parts]
            As = [parts[n][0] for n in present]
            if len(present) == len(names) and all(torch.equal(As[0], a) for a in As[1:]):
                A = As[0]
                B = torch.cat([parts[n][1] for n in names], dim=0)
            else:  # exact block form: rank r per present part
                A = torch.cat(As, dim=0)
                B = torch.zeros(sum(sizes), A.size(0), dtype=A.dtype)
                row0 = dict(zip(names, [sum(sizes[:i]) for i in range(len(names))]))
                col = 0
                for n in present:
                    b = parts[n][1]
                    B[row0[n]:row0[n] + b.size(0), col:col + b.size(1)] = b
                    col += b.size(1)
        else:
            A, B = parts[leaf][0], parts[leaf][1]
        if A.size(1) != base.in_features or B.size(0) != base.out_features:
            raise ValueError(f"{wfile}: {ours} adapter shapes A {tuple(A.shape)}, B {tuple(B.shape)} do not fit "
                             f"the layer ({base.out_features} x {base.in_features})")
        lora = LoRALinear(base, A.size(0), cfg.scaling, cfg.dropout)
        with torch.no_grad():
            lora.lora_A.copy_(A.to(w.dtype))
            lora.lora_B.copy_(B.to(w.dtype))
        _set_module(model, ours, lora)
    cfg.targets = tuple(dict.fromkeys(o.rsplit(".", 1)[-1] for o in grouped))
    model.lora_config = cfg
    mark_only_lora_trainable(model)
    return model


def find_adapter_dir(ckpt: str | Path) -> Path | None:
    """The adapter directory of a checkpoint: the directory itself or its ``adapter/`` subdirectory."""
    for d in (Path(ckpt), Path(ckpt) / "adapter"):
        if (d / ADAPTER_CONFIG).exists():
            return d
    return None
