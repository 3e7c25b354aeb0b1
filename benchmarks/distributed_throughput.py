"""Multi-GPU training throughput: ours (DDP, FSDP2) against the peer (HF LlamaForCausalLM + torch DDP) on 1 and N
GPUs, side by side in one invocation, at the same per-GPU batch.

    python benchmarks/distributed_throughput.py                       # z2all-1.1b, micro-batch 8, accum 4, bf16
    python benchmarks/distributed_throughput.py --gpus 1,2 --steps 6 --warmup 3
    python benchmarks/distributed_throughput.py --smoke               # CPU, gloo, tiny preset: checks the plumbing

Each variant runs as its own ``torchrun --standalone --nproc_per_node=N`` job (a fresh process group and CUDA
context per measurement); this script collects rank 0's JSON and prints one table:

    variant       GPUs  tok/s (global)  tok/s per GPU  scaling  MFU   peak mem per GPU (GiB)

Variants (ours = ``Trainer.train_step`` of zero2all/train/trainer.py on synthetic tokens: exactly what
``z2all pretrain`` runs per update, logging collectives included)
    ours         1 GPU, no wrapper: the baseline for both scalings
    ours-ddp     N GPUs, DDP, no_sync on all but the last micro-step
    ours-fsdp    N GPUs, FSDP2 per block, bf16 params / fp32 reduce, reshard_after_forward per --reshard; with
                 ``--ep N`` (MoE configs) expert parallel: the experts divided over N ranks (distributed/ep.py)
    ours-pp      N GPUs, pipeline parallel over N stages (--pp-schedule, --pp-microbatches pipeline microbatches
                 per micro-batch, an update's accum micro-batches in one schedule; one data-parallel replica, so a
                 step holds micro-batch x accum sequences), with the measured bubble per rank (1 - busy / wall
                 time of the schedule steps) and its ideal value (K-1)/(K+M-1), M = accum x --pp-microbatches
    ours-tp      N GPUs, tensor parallel over N ranks with sequence parallel (one data-parallel replica); the
                 implementation by override: ``parallel.tp_impl='local'|'dtensor'``, ``parallel.tp_chunks=K``
    ours-cp      N GPUs, context parallel over N ranks (ring attention; FSDP2 over the cp ranks)
    ours-mesh    N GPUs, the mesh of the ``--override parallel.*`` given (e.g. parallel.tp=2 with
                 parallel.sequence_parallel=true: tp2 x FSDP2 over the rest; parallel.pp=2 parallel.tp=2:
                 pp2 x tp2 x dp); the pipeline's bubble is measured whenever parallel.pp > 1
    peer         HF transformers LlamaForCausalLM (sdpa; Liger kernels when ``liger_kernel`` imports), fp32
                 master weights + bf16 autocast, fused AdamW: 1 GPU and N GPUs with torch DDP + no_sync
Ours runs the model with ``ops = auto`` (Triton kernels on CUDA): DDP with fp32 master weights + bf16 autocast,
FSDP with its bf16 mixed-precision policy (fp32 sharded master weights).

Timing: ``--warmup`` steps, then the median of ``--steps`` optimizer steps (CUDA-synchronised). tokens/s counts
all ranks; scaling = N-GPU tokens/s / the same family's 1-GPU tokens/s; MFU per GPU by ``zero2all.accounting.mfu``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------- workers


def _peer_model(cfg, device):
    """HF Llama with our config's shapes (Liger's kernels patched in first when the package is present)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    liger = False
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        if device.type == "cuda":
            apply_liger_kernel_to_llama()
            liger = True
    except ImportError:
        pass
    hf_cfg = LlamaConfig(vocab_size=cfg.padded_vocab_size, hidden_size=cfg.hidden_dim,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.n_layers,
                         num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                         max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps,
                         rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
                         attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg)
    return model, liger


def _union_ns(spans) -> int:
    """Total length of the union of (start, end) intervals."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0 if cur_e is None else cur_e - cur_s)


def kernel_breakdown(kernels) -> str:
    """Where one step's GPU time goes, from the profiler's CUDA kernel events ``(name, start_ns, end_ns)``:
    time per category (step_profile's categories, with communication first), then the overlap that decides
    multi-GPU speed: communication kernels' union, the part of it no compute kernel runs beside (exposed), compute's
    union, and the idle time inside the span (no kernel at all)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_profile import category

    def cat(name: str) -> str:
        low = name.lower()
        if "nccl" in low or "all_to_all" in low or "alltoall" in low:
            return "communication (NCCL)"
        return "grouped GEMMs (MoE, Triton)" if "grouped" in low else category(name)

    per_cat: dict[str, float] = {}
    comm, compute = [], []
    for name, s, e in kernels:
        c = cat(name)
        per_cat[c] = per_cat.get(c, 0.0) + (e - s) / 1e6
        (comm if c.startswith("communication") else compute).append((s, e))
    if not kernels:
        return "no CUDA kernels recorded"
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    every, comm_u, compute_u = _union_ns(comm + compute), _union_ns(comm), _union_ns(compute)
    exposed = every - compute_u          # time when only communication kernels run
    lines = [f"GPU span {span / 1e6:.1f} ms: compute busy {compute_u / 1e6:.1f} ms, communication "
             f"{comm_u / 1e6:.1f} ms of which exposed (nothing else running) {exposed / 1e6:.1f} ms, idle "
             f"{(span - every) / 1e6:.1f} ms", f"{'category':40s} {'ms':>9s} {'of span':>8s}"]
    for c, ms in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"{c:40s} {ms:9.2f} {100 * ms * 1e6 / span:7.1f}%")
    return "\n".join(lines)


def _profile_step(step, sync, path: Path, rows: int = 28) -> None:
    """One step under ``torch.profiler``: the kernel breakdown (:func:`kernel_breakdown`), the ops with the most
    CUDA time (self), then those with the most host time (self: kernel launches, host waits), written to ``path``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    kernels = [(e.name(), e.start_ns(), e.start_ns() + e.duration_ns())
               for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60)
    host = averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(kernel_breakdown(kernels) + "\n\n" + table + "\n\nby host time (self CPU)\n" + host)


def worker(args) -> None:
    """One measurement inside torchrun: build, wrap, warm up, time; rank 0 writes the result JSON."""
    import torch

    from zero2all import accounting
    from zero2all import distributed as zd
    from zero2all.config import load_config
    from zero2all.train.metrics import detect_peak_flops

    family, mode = args.variant.split("-")[0], (args.variant.split("-") + ["none"])[1]
    pipeline = mode == "pp"
    mesh_kind = mode in ("pp", "tp", "cp", "mesh")
    env = zd.init_distributed(device=args.device)
    if env.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // env.world_size))
    device = env.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    overrides = list(args.override) + [
        f"train.micro_batch_size={args.micro_batch}", f"train.grad_accum_steps={args.accum}",
        f"train.precision='{'bf16' if dtype == torch.bfloat16 else 'fp32'}'",
        f"parallel.mode='{'auto' if mesh_kind else mode}'",
        f"parallel.activation_checkpointing='{args.ac}'", f"parallel.reshard_after_forward={str(args.reshard).lower()}",
        f"train.compile={str(args.compile).lower()}", f"train.out_dir='{Path(args.result).parent / args.variant}'",
        f"train.device='{device}'", "train.tensorboard=false", "train.eval_every=0", "train.num_samples=0",
        "train.warmup_steps=1"]
    if args.seq_len:
        overrides.append(f"data.seq_len={args.seq_len}")
    if pipeline:
        overrides += [f"parallel.pp={env.world_size}", f"parallel.pp_schedule='{args.pp_schedule}'",
                      f"parallel.pp_microbatches={args.pp_microbatches}"]
    if mode == "tp":
        overrides += [f"parallel.tp={env.world_size}", "parallel.sequence_parallel=true"]
    if mode == "cp":
        overrides += [f"parallel.cp={env.world_size}"]
    if mode == "fsdp" and args.fsdp_no_sync:
        overrides.append("parallel.fsdp_accum_no_sync=true")
    if mode == "fsdp" and args.ep > 1:
        overrides.append(f"parallel.ep={args.ep}")
    cfg = load_config(args.config, overrides)
    pipeline = pipeline or (mode == "mesh" and cfg.parallel.pp > 1)
    seq = args.seq_len or cfg.model.max_seq_len
    liger = False
    dp = env.world_size
    if family == "ours":
        # the trainer itself (synthetic data): parallelize + no_sync + clipping + AdamW + logging collectives
        from zero2all.train.trainer import Trainer

        trainer = Trainer(cfg, show_progress=False)
        dp = trainer.dp_size  # ranks that read different sequences (a pipeline's stages read the same ones)

        def step():
            return trainer.train_step()["loss"]
    else:
        model, liger = _peer_model(cfg.model, device)
        if args.compile:
            model = torch.compile(model)
        if env.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        gradient_as_bucket_view=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                      **({"fused": True} if device.type == "cuda" else {}))
        g = torch.Generator(device="cpu").manual_seed(1000 + env.rank)  # each rank its own tokens
        batches = [torch.randint(0, cfg.model.vocab_size, (args.micro_batch, seq), generator=g).to(device)
                   for _ in range(args.accum)]

        def step():
            for a, x in enumerate(batches):
                last = a == args.accum - 1
                no_sync = model.no_sync() if not last and hasattr(model, "no_sync") else contextlib.nullcontext()
                with no_sync, torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    loss = model(input_ids=x, labels=x).loss  # HF shifts the labels itself
                    (loss / args.accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if pipeline:
        trainer.pipeline.reset_measurement()
    times = []
    for _ in range(args.steps):
        zd.barrier(env)
        sync()
        t0 = time.perf_counter()
        last = step()
        sync()
        times.append(time.perf_counter() - t0)
    if args.profile and device.type == "cuda":  # one more step under the torch profiler, a table per rank
        _profile_step(step, sync, Path(args.profile) / f"{args.variant}-{args.seq_len or 'seq'}-r{env.rank}.txt")
    # the slowest rank sets the pace: median of each rank's step times, then the max over ranks
    median = zd.all_reduce_mean(statistics.median(times), env)  # equal after the barrier, up to noise
    memory = zd.gather_memory_stats(env)
    bubbles = zd.all_gather_object(trainer.pipeline.measured_bubble(), env) if pipeline else None
    graphs = zd.all_gather_object([(g.most_in_flight, len(g.slots), g.eager_calls)
                                  for g in trainer.pipeline.graphed_blocks()], env) \
        if pipeline else None   # pp_cuda_graphs: (most slots in use, captured, eager calls) per stage
    comm = None
    if args.count_comm and family == "ours":  # one more step with every collective's bytes counted
        from comm_count import CommCounter

        dims = trainer.run.dims
        names = {}
        if dims.mesh is not None:
            for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp"):
                if dims.size(name) > 1:
                    names.setdefault(dims[name].get_group().group_name, name)
        counter = CommCounter(names, env.world_size)
        try:
            with counter.counting():
                step()
                sync()
            summary = counter.summary()
        except Exception as e:  # the timing above stands; say why the count is missing
            summary = {"by_group": {}, "by_kind": {}, "error": f"{type(e).__name__}: {e}"}
        comm = zd.all_gather_object(summary, env)
    if env.is_main:
        tokens = args.micro_batch * args.accum * seq * dp
        tok_s = tokens / median
        peak = detect_peak_flops(device)
        mfu = accounting.mfu(tok_s / env.world_size, cfg.model, seq, peak) if peak else None
        key = "peak_alloc_gib" if "peak_alloc_gib" in memory[0] else "peak_rss_gib"
        result = {"variant": args.variant, "family": family, "mode": mode, "gpus": env.world_size,
                  "tokens_per_s": tok_s, "step_s": median, "mfu": mfu, "mem_gib": [m[key] for m in memory],
                  "mem_kind": key, "loss": float(last), "liger": liger, "seq_len": seq,
                  "micro_batch": args.micro_batch, "accum": args.accum, "device": str(device),
                  "ep": cfg.parallel.ep, "step_times_ms": [round(t * 1e3, 2) for t in times],
                  "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "torch": torch.__version__}
        if comm is not None:
            result["comm_per_rank"] = comm
        if pipeline:
            result.update(pp_schedule=cfg.parallel.pp_schedule, pp_microbatches=trainer.pipeline.n_microbatches,
                          bubble_measured=bubbles, bubble_ideal=trainer.pipeline.ideal_bubble(),
                          pp_layout=[len(ids) for ids in trainer.pipeline.layout], pp_graphs=graphs)
            if trainer.pipeline.costs:  # parallel.pp_balance = time: the measured ms per microbatch
                embed, blocks, head = trainer.pipeline.costs
                result["pp_costs_ms"] = [round(1e3 * embed, 2), round(1e3 * max(blocks), 2), round(1e3 * head, 2)]
        Path(args.result).write_text(json.dumps(result))
    zd.barrier(env)
    if family == "ours":
        trainer.run.release_graphs()   # tp_graphs: captured collectives would hang the group's destruction
    zd.destroy_distributed()
    zd.finish_process(0)  # the measurement is written: leave without gloo's teardown


# ---------------------------------------------------------------------------------------------------- driver


def run_variant(args, variant: str, nproc: int, tmp: Path) -> dict | None:
    if str(REPO) not in sys.path:  # the driver may run without the package installed
        sys.path.insert(0, str(REPO))
    from zero2all.bench.peers import step_spread

    result = tmp / f"{variant}-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), "--worker", "--variant", variant, "--result", str(result),
           "--config", args.config, "--micro-batch", str(args.micro_batch), "--accum", str(args.accum),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--device", args.device, "--ac", args.ac, "--reshard", str(args.reshard).lower()]
    cmd += ["--pp-schedule", args.pp_schedule, "--pp-microbatches", str(args.pp_microbatches)]
    cmd += ["--compile"] if args.compile else []
    cmd += ["--count-comm"] if args.count_comm else []
    cmd += ["--fsdp-no-sync"] if args.fsdp_no_sync else []
    cmd += ["--ep", str(args.ep)] if args.ep > 1 else []
    cmd += ["--profile", args.profile] if args.profile else []
    for o in args.override:
        cmd += ["--override", o]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.setdefault("PYTHONPATH", str(REPO))
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    took = time.time() - t0
    if proc.returncode != 0 or not result.exists():
        text = proc.stdout + proc.stderr
        # the workers' own exceptions first (torchrun's summary at the end names only exit codes)
        errors = list(dict.fromkeys(line for line in text.splitlines()
                                    if re.match(r"^(\[rank\d+\]:)?\s*[\w.]*(Error|Exception): ", line)
                                    and "ChildFailedError" not in line))
        print(f"[{variant} x{nproc}] FAILED (rc {proc.returncode}, {took:.0f}s):\n" + "\n".join(errors[:5])
              + f"\n{text[-3000:]}", flush=True)
        return None
    out = json.loads(result.read_text())
    out["wall_s"] = took
    print(f"[{variant} x{nproc}] {out['tokens_per_s']:,.0f} tok/s, step {out['step_s'] * 1e3:.0f} ms, "
          f"mem {max(out['mem_gib']):.1f} GiB ({took:.0f}s); {step_spread(out)}", flush=True)
    return out


def plan(args) -> list[tuple[str, int]]:
    gpus = [int(g) for g in args.gpus.split(",")]
    runs = []
    for variant in args.variants.split(","):
        for n in gpus:
            if variant == "ours" and n == 1:
                runs.append(("ours", 1))
            elif variant in ("ours-ddp", "ours-fsdp", "ours-pp", "ours-tp", "ours-cp", "ours-mesh") and n > 1:
                runs.append((variant, n))
            elif variant == "peer":
                runs.append(("peer" if n == 1 else "peer-ddp", n))
    return runs


def print_table(results: list[dict]) -> None:
    base = {r["family"]: r["tokens_per_s"] for r in results if r["gpus"] == 1}
    peer_by_n = {r["gpus"]: r["tokens_per_s"] for r in results if r["family"] == "peer"}
    print()
    print(f"{'variant':12s} {'GPUs':>4s} {'tok/s':>10s} {'tok/s/GPU':>10s} {'scaling':>8s} {'vs peer':>8s} "
          f"{'MFU':>6s}  peak memory per GPU (GiB)")
    for r in results:
        # a ratio needs its baseline in the same invocation; without it the column says "-"
        scaling = f"{r['tokens_per_s'] / base[r['family']]:.2f}x" if r["family"] in base else "-"
        vs_peer = f"{r['tokens_per_s'] / peer_by_n[r['gpus']]:.2f}x" if r["gpus"] in peer_by_n else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        mem = " ".join(f"{m:.1f}" for m in r["mem_gib"])
        name = r["variant"] + (" +liger" if r.get("liger") else "")
        print(f"{name:12s} {r['gpus']:>4d} {r['tokens_per_s']:>10,.0f} {r['tokens_per_s'] / r['gpus']:>10,.0f} "
              f"{scaling:>8s} {vs_peer:>8s} {mfu:>6s}  {mem}")
    for r in results:
        for rank, c in enumerate(r.get("comm_per_rank") or []):
            print(f"{r['variant']} x{r['gpus']} rank {rank}: sent per step "
                  + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in sorted(c["by_group"].items()))
                  + " | " + ", ".join(f"{k} {v / 2**30:.3f}" for k, v in sorted(c["by_kind"].items())))
        if "bubble_measured" in r:
            print(f"{r['variant']} x{r['gpus']}: {r['pp_schedule']}, {r['pp_microbatches']} pipeline microbatches per "
                  f"update (accum x --pp-microbatches); measured bubble per rank "
                  + " ".join(f"r{i}:{100 * b:.1f}%" for i, b in enumerate(r["bubble_measured"]))
                  + f" (ideal (K-1)/(K+M-1) = {100 * r['bubble_ideal']:.1f}%); blocks per stage "
                  + str(r.get("pp_layout")) + f"; loss {r['loss']:.4f}"
                  + (f"; CUDA graph (most in flight, slots, eager calls) per rank {r['pp_graphs']}"
                     if any(r.get("pp_graphs") or []) else "")
                  + (f" (measured ms per microbatch: embedding, block, head {r['pp_costs_ms']})"
                     if r.get("pp_costs_ms") else ""))
    if results:
        r = results[0]
        print(f"\n{r['device_name']}, torch {r['torch']}, micro-batch {r['micro_batch']} x accum {r['accum']} x "
              f"seq {r['seq_len']} per GPU; median of the timed steps; scaling vs the same family on 1 GPU "
              f"(ours-ddp / ours-fsdp vs ours); 'vs peer' = against the peer on the same number of GPUs")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="z2all-1.1b")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=0, help="0 = the model's max_seq_len")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpus", default="1,2", help="process counts to measure, e.g. 1,2 or 1,2,4,8")
    p.add_argument("--variants", default="ours,ours-ddp,ours-fsdp,peer")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--ac", default="none", help="activation checkpointing for ours: none | full | selective")
    p.add_argument("--reshard", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="FSDP reshard_after_forward (true = ZeRO-3-like, false = ZeRO-2-like)")
    p.add_argument("--fsdp-no-sync", action="store_true",
                   help="ours-fsdp: parallel.fsdp_accum_no_sync (one reduce-scatter per update, not per micro-step)")
    p.add_argument("--ep", type=int, default=1,
                   help="ours-fsdp: expert parallel, parallel.ep=N (MoE configs; FSDP2 over the rest; the blocks' "
                   "resharding is parallel.ep_reshard_after_forward, not --reshard)")
    p.add_argument("--pp-schedule", default="1f1b", help="ours-pp: gpipe | 1f1b | interleaved_1f1b | zero_bubble")
    p.add_argument("--pp-microbatches", type=int, default=8,
                   help="ours-pp: pipeline microbatches per micro-batch (must divide --micro-batch)")
    p.add_argument("--compile", action="store_true", help="torch.compile (ours per block, the peer whole)")
    p.add_argument("--count-comm", action="store_true",
                   help="ours: one extra step counting the bytes each rank sends, per collective and mesh dimension")
    p.add_argument("--profile", default="", help="ours: one extra step under torch.profiler, a table per rank "
                   "(top ops by CUDA time) written into this folder")
    p.add_argument("--override", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per variant")
    p.add_argument("--json", default="", help="also write all results to this file")
    p.add_argument("--smoke", action="store_true", help="tiny preset on CPU with gloo, 2 steps: plumbing only")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.config, args.device, args.micro_batch, args.accum = "tiny", "cpu", 2, 2
        args.seq_len, args.steps, args.warmup = args.seq_len or 64, 2, 1
        args.override = args.override or ["model.n_layers=2"]
        args.pp_microbatches = min(args.pp_microbatches, args.micro_batch)
    runs = plan(args)
    print(f"{len(runs)} runs: {', '.join(f'{v} x{n}' for v, n in runs)}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="z2all-dist-bench-") as tmp:
        for variant, n in runs:
            r = run_variant(args, variant, n, Path(tmp))
            if r is not None:
                results.append(r)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if len(results) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
