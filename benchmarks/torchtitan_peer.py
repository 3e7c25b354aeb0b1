"""torchtitan's parallelisms as the peer of ours: FSDP2, tp2 (+ sequence parallel), pp2 1F1B, cp2, on N GPUs.

    bash benchmarks/peer_wheels.sh download .peer-wheels             # where there is network (about 5 MiB)
    eval "$(bash benchmarks/peer_wheels.sh install .peer-wheels)"     # on the GPU machine: torchtitan 0.2.2 + deps
    python benchmarks/torchtitan_peer.py                              # 2 GPUs: fsdp,tp2,pp2,tp2@16384x1,cp2@65536x1
    python benchmarks/torchtitan_peer.py --nproc 1 --variants fsdp --steps 1 --warmup 1 model.n_layers=2   # smoke

Each variant is its own ``torchrun --standalone --nproc_per_node=N -m zero2all.bench.peers`` job: torchtitan's own
``Trainer`` (llama3 at our preset's shape through a registered flavour, random tokens through a custom
dataloader, fused AdamW, gradient clipping at 1.0, per-block torch.compile, no activation checkpointing), timed
over ``--steps`` optimizer steps after ``--warmup`` (median of each rank, max over ranks). The table has the format
of benchmarks/distributed_throughput.py.

Variants: ``fsdp`` (FSDP2 over all ranks), ``tpN`` / ``ppN`` / ``cpN`` (that degree, the rest data parallel,
FSDP2 when the rest is > 1 or with cp), optionally ``@SEQ`` and ``xMB`` (sequence length, micro-batch), e.g.
``cp2@65536x1``. Batch semantics are ours: micro-batch x accumulation sequences per data-parallel replica and
step (tp / pp / cp ranks of one replica see the same sequences); pp splits each micro-batch into pipeline
microbatches of one sequence (8 with micro-batch 8) under 1F1B; tp applies torchtitan's TP plan, which shards the
norms' activations over the sequence (sequence parallel) and uses loss parallel; cp shards the sequence with
torchtitan's head-tail load balancing (ring attention on SDPA).

Precision: FSDP2's bf16 mixed-precision policy where parameters are sharded; elsewhere bf16 autocast over fp32
parameters. torchtitan itself turns AMP off for TP/PP without FSDP (fp32); ``--amp native`` measures that.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zero2all.bench import peers as bench_peers  # noqa: E402

DEFAULT_VARIANTS = "fsdp,tp2,pp2,tp2@16384x1,cp2@65536x1"


@dataclass
class Variant:
    name: str
    tp: int = 1
    pp: int = 1
    cp: int = 1
    seq: int | None = None
    micro_batch: int | None = None


def parse_variant(text: str, nproc: int) -> Variant:
    """``fsdp`` or ``(tp|pp|cp)N...`` with optional ``@SEQ`` and ``xMB``; the degrees must divide ``nproc``."""
    m = re.fullmatch(r"(fsdp|(?:(?:tp|pp|cp)\d+)+)(?:@(\d+))?(?:x(\d+))?", text.strip())
    if not m:
        raise ValueError(f"torchtitan peer: bad variant {text!r} (e.g. fsdp, tp2, pp2, cp2@65536x1, tp2pp2)")
    v = Variant(text.strip(), seq=int(m.group(2)) if m.group(2) else None,
                micro_batch=int(m.group(3)) if m.group(3) else None)
    for kind, degree in re.findall(r"(tp|pp|cp)(\d+)", m.group(1)):
        setattr(v, kind, int(degree))
    model_parallel = v.tp * v.pp * v.cp
    if model_parallel < 1 or nproc % model_parallel:
        raise ValueError(f"torchtitan peer: variant {text!r} needs tp*pp*cp = {model_parallel} to divide the "
                         f"{nproc} processes")
    return v


def format_table(results: list[dict]) -> str:
    """One line per variant, as benchmarks/distributed_throughput.py prints them."""
    lines = [f"{'variant':16s} {'GPUs':>4s} {'seq':>6s} {'mb':>3s} {'tok/s':>10s} {'tok/s/GPU':>10s} {'MFU':>6s}  "
             f"peak memory per GPU (GiB)"]
    for r in results:
        if r.get("error"):
            lines.append(f"{r['variant']:16s} {r['gpus']:>4d} FAILED: {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        mem = " ".join(f"{b / 2 ** 30:.1f}" for b in r["peak_bytes"])
        lines.append(f"{r['variant']:16s} {r['gpus']:>4d} {r['seq_len']:>6d} {r['micro_batch']:>3d} "
                     f"{r['tokens_per_s']:>10,.0f} {r['tokens_per_s'] / r['gpus']:>10,.0f} {mfu:>6s}  {mem}")
    ok = [r for r in results if not r.get("error")]
    if ok:
        r = ok[0]
        lines.append(f"\n{r['device_name']}, torch {r['torch']}, torchtitan {r['torchtitan']}, torchao "
                     f"{r['torchao']}, accum {r['accum']}, per data-parallel replica micro-batch x accum x seq; "
                     f"median of the timed steps; precision: "
                     + "; ".join(sorted({f"{x['variant']}: {x['precision']}" for x in ok})))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="z2all-1.1b")
    p.add_argument("--nproc", type=int, default=2, help="GPUs (torchrun --nproc_per_node)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pp-microbatch-size", type=int, default=1, help="pp variants: sequences per pipeline "
                   "microbatch (1: micro-batch 8 gives 8 microbatches; 2: 4 of 2 sequences)")
    p.add_argument("--float8", choices=["rowwise", "tensorwise"], default=None, help="torchtitan's float8")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--amp", choices=["autocast", "native"], default="autocast")
    p.add_argument("--timeout", type=int, default=300, help="seconds per variant (its processes are killed after)")
    p.add_argument("--json", default="", help="also write all results to this file")
    p.add_argument("overrides", nargs="*", help="config overrides of the preset, e.g. model.n_layers=2")
    args = p.parse_args(argv)
    variants = [parse_variant(v, args.nproc) for v in args.variants.split(",") if v.strip()]
    missing = bench_peers.missing_reason("tt_fp8" if args.float8 else "tt_compile")
    if missing:
        print(f"torchtitan peer: {missing}")
        return 2
    print(f"{len(variants)} variants on {args.nproc} GPU(s): {', '.join(v.name for v in variants)}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="z2all-tt-peer-") as tmp:
        for v in variants:
            out = Path(tmp) / f"{v.name}.json"
            seq, mb = v.seq or args.seq, v.micro_batch or args.micro_batch
            cmd = bench_peers.titan_command(nproc=args.nproc, variant=v.name, result=out, config=args.config,
                                            micro_batch=mb, seq=seq, accum=args.accum, steps=args.steps,
                                            warmup=args.warmup, tp=v.tp, pp=v.pp, cp=v.cp, float8=args.float8,
                                            compile=not args.no_compile, amp=args.amp, overrides=args.overrides,
                                            pp_mbs=args.pp_microbatch_size)
            t0 = time.time()
            got, error = bench_peers.run_titan(cmd, out, args.timeout)
            if got is None:
                got = {"variant": v.name, "gpus": args.nproc, "error": error}
                print(f"[{v.name}] FAILED ({time.time() - t0:.0f}s): {error}", flush=True)
            else:
                print(f"[{v.name}] {got['tokens_per_s']:,.0f} tok/s, step {got['step_s'] * 1e3:.0f} ms, "
                      f"peak {max(got['peak_bytes']) / 2 ** 30:.1f} GiB ({time.time() - t0:.0f}s); "
                      f"{bench_peers.step_spread(got)}", flush=True)
            results.append(got)
    print()
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(not r.get("error") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
