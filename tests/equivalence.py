"""The equivalence harness of the distributed tests: the trainer (`z2all pretrain`'s loop) in float64
(``train.precision = "fp64"``) on one process and on a mesh of gloo processes, the same global batch, compared per
step on the loss AND the gradient norm (before clipping), and at the end on every parameter.

Why float64: in float32 the differences between a mesh and one process are rounding of summations in another
order (~1e-7 per step), which AdamW and clipping carry and amplify step after step, so a float32 bound must be
loose and still depends on the CPU. In float64 the same differences are ~1e-16..1e-13 and do not drift: a bound of
``RTOL`` separates them from any real bug (a wrongly scaled gradient, a block's gradient missing from a reduction)
by many orders of magnitude, on any CPU.

``train(out, *overrides)`` runs one process; ``launch(out, world, runs)`` runs each override list in turn on
``world`` gloo processes (one spawn); both return :class:`Run` (losses, gradient norms, final parameters).
``assert_equivalent(got, want, what)`` checks and returns the measured differences; with ``Z2ALL_EQUIV_LOG`` set
they are appended to that file (one JSON line per comparison), which is how the bounds were measured.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp

# Bounds, from the differences measured on every mesh of the distributed tests (float64, 2 and 4 gloo processes):
# losses differ by <= 4.4e-16 relative and gradient norms by <= 9.2e-16 (a few units of float64 rounding), the final
# parameters by <= 2.0e-13 of their tensor's largest element (AdamW's normalised update turns a rounding difference
# of a near-zero gradient into an update-sized one). Each bound is <= 100x its measurement and <= 1e-9; the planted
# bugs (tests/mutations.py) differ by 1e-4..1.
RTOL = 4e-14         # per step: loss and gradient norm
PARAM_RTOL = 1e-11   # final parameters, per tensor, relative to the tensor's largest element

# a tiny dense model, every op on its plain PyTorch path (the float64 reference), float64, a constant learning rate
# large enough that the parameters move (lr 0.01) and clipping that acts (0.5)
TINY = ["model.vocab_size=64", "model.hidden_dim=32", "model.intermediate_size=64", "model.n_layers=4",
        "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=16", "model.ops.rmsnorm='torch'",
        "model.ops.rope='torch'", "model.ops.swiglu='torch'", "model.ops.cross_entropy='torch'",
        "model.ops.fused_linear='torch'", "model.ops.attention='sdpa'", "model.ops.grouped_gemm='loop'",
        "train.grad_accum_steps=2", "train.eval_every=0", "train.sample_every=0", "train.num_samples=0",
        "train.tensorboard=false", "train.warmup_steps=2", "train.lr=0.01", "train.device='cpu'",
        "train.keep_last=0", "train.schedule='constant'", "train.precision='fp64'", "train.eval_batches=0",
        "train.log_every=0", "train.grad_clip=0.5"]

# the same model with MoE layers: 4 experts top-2 with a shared expert after one dense layer, the sigmoid router
# (its selection bias moved after every step from the load summed over the data-parallel ranks)
MOE = ["model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.n_shared_experts=1",
       "model.moe.expert_intermediate_size=24", "model.moe.first_dense_layers=1", "model.moe.router='sigmoid'"]


@dataclass
class Run:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    eval_losses: list[float] = field(default_factory=list)


def read_run(out: Path) -> Run:
    from safetensors.torch import load_file

    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = sorted((r for r in recs if r.get("kind") == "train"), key=lambda r: r["step"])
    final = out / "final" / "model.safetensors"
    return Run([r["loss"] for r in train], [r["grad_norm"] for r in train],
               load_file(str(final)) if final.exists() else {},
               [r["loss"] for r in recs if r.get("kind") == "eval" and "loss" in r])


def train(out: Path, *overrides: str, base: list[str] = TINY) -> Run:
    """One process (or, inside a spawned worker, this process's part of the mesh run)."""
    from zero2all.config import load_config
    from zero2all.train.trainer import Trainer

    cfg = load_config("tiny", [*base, f"train.out_dir='{out}'", *overrides])
    Trainer(cfg, show_progress=False).fit()
    return read_run(out)


def _entry(rank: int, world: int, port: int, out: str, runs: list[list[str]], base: list[str]):
    from test_distributed import gloo_worker

    from tests import cpu_ring_attention

    cpu_ring_attention.register()   # context parallel on CPU: torch's ring around the CPU SDPA kernel

    def work(env):
        for i, overrides in enumerate(runs):
            train(Path(out) / f"run{i}", *overrides, base=base)

    gloo_worker(rank, world, port, out, work, timeout_s=120.0)


def launch(out: Path, world: int, runs: list[list[str]], base: list[str] = TINY) -> list[Run]:
    """Each override list of ``runs`` trained in turn on ``world`` gloo processes (one spawn): out/run<i>."""
    from test_distributed import free_port

    torch.set_num_threads(1)
    mp.spawn(_entry, args=(world, free_port(), str(out), runs, base), nprocs=world, join=True)
    return [read_run(out / f"run{i}") for i in range(len(runs))]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def differences(got: Run, want: Run, first_step: int = 1) -> dict:
    """The largest relative differences: per step of the loss and of the gradient norm, and over the parameters
    (per tensor, the largest element difference relative to the tensor's largest element)."""
    assert len(got.losses) == len(want.losses), f"{len(got.losses)} steps vs {len(want.losses)}"
    worst_param, worst_name = 0.0, None
    if want.params:
        assert set(got.params) == set(want.params), sorted(set(got.params) ^ set(want.params))
        for name, w in want.params.items():
            d = float((got.params[name].double() - w.double()).abs().max()) / max(float(w.abs().max()), 1e-300)
            if d >= worst_param:
                worst_param, worst_name = d, name
    return {"loss": max(map(rel, got.losses, want.losses)), "grad_norm": max(map(rel, got.grad_norms,
                                                                                  want.grad_norms)),
            "params": worst_param, "worst_param": worst_name}


def log_measured(what: str, d: dict) -> dict:
    """Append a measured difference to the file named by Z2ALL_EQUIV_LOG (when set); returns ``d``."""
    log = os.environ.get("Z2ALL_EQUIV_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"what": what, **d}) + "\n")
    return d


def assert_equivalent(got: Run, want: Run, what: str, rtol: float = RTOL, params: bool = True,
                      param_rtol: float = PARAM_RTOL) -> dict:
    """Per step the loss and the gradient norm within ``rtol``, and (``params``) every final parameter within
    ``param_rtol``."""
    if params:
        assert got.params and want.params, f"{what}: no final model to compare"
    else:
        got = Run(got.losses, got.grad_norms)
    d = log_measured(what, differences(got, want))
    for step, (g, w, gn, wn) in enumerate(zip(got.losses, want.losses, got.grad_norms, want.grad_norms), 1):
        assert rel(g, w) <= rtol, f"{what}, step {step}: loss {g!r} vs one process {w!r} (rel {rel(g, w):.2e})"
        assert rel(gn, wn) <= rtol, f"{what}, step {step}: grad norm {gn!r} vs one process {wn!r} " \
                                    f"(rel {rel(gn, wn):.2e})"
    assert d["params"] <= param_rtol, f"{what}: final {d['worst_param']} differs by {d['params']:.2e} (relative)"
    return d
