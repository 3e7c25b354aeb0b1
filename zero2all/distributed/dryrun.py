"""``z2all pretrain --dry-run --world N``: a mesh of N ranks tried in one process before GPUs are rented.

For each rank it joins torch's *fake* process group (collectives return at once and move nothing) as that rank of
N, builds the model on the meta device (shapes without memory), and applies the same ``parallelize`` the real run
applies: the plan's refusals, the device mesh, tensor / pipeline / expert parallelism and FSDP2 all run, so each
rank's parameter shards are the ones the real run would hold. From them, per rank:

    model states   = local parameters x (weight + gradient bytes) + optimizer state (AdamW: 8 B per parameter;
                     Muon's matrices: 4 B, one momentum)
    activations    = ``z2all estimate``'s activation, autocast-copy and logits terms for this layout (the same
                     formulas, at the run's micro-batch and sequence length)
    peak           = model states + activations, against the GPU named (its memory less 2 GB kept for the CUDA
                     context)

and the communication per GPU per step from ``z2all estimate``. Nothing is allocated, no GPU is needed, and a
rank takes ~0.1 s.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import torch

from zero2all.config import Config, ConfigError

GB = 1e9
RESERVE = 2 * GB      # the CUDA context and workspaces (as z2all estimate keeps)


@dataclass
class RankShape:
    rank: int
    coords: dict[str, int]
    params: int            # local elements of this rank's parameters
    muon_params: int       # of which under Muon (one momentum each instead of AdamW's two moments)
    blocks: int            # transformer blocks held (pipeline stages hold a share)


def layout_of(cfg: Config, world: int, gpu: str):
    """The ``z2all estimate`` layout of this run on ``world`` ranks: the plan's (``plan.Plan.layout``)."""
    from zero2all.distributed.plan import resolve

    return resolve(cfg, world).layout(cfg, gpu)


def rank_shape(cfg: Config, world: int, rank: int, plan=None) -> RankShape:
    """Join the fake process group as ``rank`` of ``world``, parallelize a meta model, count what it holds."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zero2all.distributed as zd
    from zero2all.distributed.env import DistEnv
    from zero2all.distributed.plan import resolve
    from zero2all.model.z2all import Z2all
    from zero2all.train.muon import is_muon_param

    plan = plan or resolve(cfg, world)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        env = DistEnv(rank, world, rank, world, torch.device("cpu"), "fake", cfg.parallel.timeout_s)
        with torch.device("meta"):
            model = Z2all(cfg.model)
        if plan.mode in ("ddp", "zero1", "none"):
            plain, dims = model, None           # every rank holds the whole model (DDP checks real values)
        else:
            with contextlib.redirect_stdout(io.StringIO()):   # the run's own description of its layout
                run = zd.parallelize(model, cfg.parallel, env, precision="bf16", plan=plan)
            plain, dims = run.plain, run.dims
        params = muon = 0
        for module_name, module in plain.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                n = (p.to_local() if hasattr(p, "to_local") else p).numel()
                params += n
                name = f"{module_name}.{pname}" if module_name else pname
                if cfg.train.optimizer == "muon" and is_muon_param(name, p, module):
                    muon += n
        coords = {}
        mesh = getattr(dims, "mesh", None)
        if mesh is not None:
            coords = {d: c for d, c in zip(mesh.mesh_dim_names, mesh.get_coordinate()) if mesh.size(
                mesh.mesh_dim_names.index(d)) > 1}
        elif world > 1:
            coords = {"dp": rank}
        blocks = len(getattr(plain, "layers", []))
        return RankShape(rank, coords, params, muon, blocks)
    finally:
        dist.destroy_process_group()


def dry_run(cfg: Config, world: int, gpu: str = "h100", max_ranks: int = 1024) -> dict:
    """Every rank's shape and memory, the communication per step, and whether each rank fits ``gpu``."""
    from zero2all.accounting import estimate, get_gpu, peak_memory_bytes

    if world < 1:
        raise ConfigError(f"--world {world}: must be >= 1")
    if world > max_ranks:
        raise ConfigError(f"--world {world}: at most {max_ranks} ranks are tried in one dry run")
    from zero2all.distributed.plan import resolve

    cfg.validate()
    plan = resolve(cfg, world)              # every refusal of the plan, with its reason
    L = plan.layout(cfg, gpu)
    model_cfg = cfg.model
    if cfg.model.moe.enabled:               # the activations of a token's active path (accounting_moe)
        from zero2all.accounting_moe import active_dense_config

        model_cfg = active_dense_config(cfg.model)
    est = estimate(model_cfg, L)
    from zero2all.accounting import _memory_kwargs

    mem = peak_memory_bytes(model_cfg, L.micro_batch_size, L.seq_len // L.cp, **_memory_kwargs(L))
    transient = mem["weight_copies"] + mem["activations"] + mem["logits"]
    capacity = get_gpu(gpu).memory_bytes - RESERVE
    ranks = []
    for r in range(world):
        s = rank_shape(cfg, world, r, plan)
        states = s.params * (4 + 4) + (s.params - s.muon_params) * 8 + s.muon_params * 4
        peak = states + transient     # the first pipeline stage's activations: an upper bound for later stages
        ranks.append({"rank": r, "coords": s.coords, "params": s.params, "blocks": s.blocks,
                      "model_states_bytes": states, "peak_bytes": peak, "fits": peak <= capacity})
    comm = est["communication"]
    return {"world": world, "gpu": gpu, "capacity_bytes": capacity, "layout": est["layout"], "ranks": ranks,
            "transient_bytes": transient, "communication": comm, "estimate": est}


def format_dry_run(d: dict, name: str) -> str:
    lay = d["layout"]
    lines = [f"dry run: {name} on {d['world']} ranks (fake process group, meta tensors): tp {lay['tp']}, pp "
             f"{lay['pp']}, cp {lay['cp']}, dp {lay['dp']} (ZeRO {lay['zero']}), micro-batch {lay['micro_batch_size']} "
             f"x accumulation {lay['grad_accum_steps']} x seq {lay['seq_len']}",
             f"{'rank':>4s}  {'coordinates':28s} {'blocks':>6s} {'parameters':>14s} {'model states':>13s} "
             f"{'peak (est.)':>12s}  fits {d['gpu']} ({d['capacity_bytes'] / GB:.0f} GB usable)"]
    for r in d["ranks"]:
        coords = ", ".join(f"{k} {v}" for k, v in r["coords"].items()) or "-"
        lines.append(f"{r['rank']:4d}  {coords:28s} {r['blocks']:6d} {r['params']:14,d} "
                     f"{r['model_states_bytes'] / GB:10.2f} GB {r['peak_bytes'] / GB:9.2f} GB  "
                     f"{'yes' if r['fits'] else 'NO'}")
    lines.append(f"activations, autocast weight copies and logits per rank (z2all estimate): "
                 f"{d['transient_bytes'] / GB:.2f} GB (the first pipeline stage's; later stages hold less)")
    comm = d["communication"]
    if comm:
        dp = comm.get("data_parallel", {})
        lines.append(f"communication per GPU per step (z2all estimate): data parallel "
                     f"{dp.get('bytes_per_step', 0) / GB:.2f} GB ({dp.get('collective', '-')}), tensor parallel "
                     f"{comm.get('tensor_parallel_bytes_per_step', 0) / GB:.2f} GB, pipeline "
                     f"{comm.get('pipeline_bytes_per_step', 0) / GB:.2f} GB, context parallel "
                     f"{comm.get('context_parallel_bytes_per_step', 0) / GB:.2f} GB")
    bad = [r["rank"] for r in d["ranks"] if not r["fits"]]
    lines.append(f"does NOT fit on ranks {bad[:16]}{' ...' if len(bad) > 16 else ''}" if bad else
                 "every rank fits")
    return "\n".join(lines)
