"""Peer rows of ``z2all bench train`` that need packages outside the project: torchao and torchtitan.

The peers are measured, never used by the product: nothing here is imported by the package except lazily, when
``z2all bench train`` is asked for one of these rows. ``benchmarks/peer_wheels.sh`` gathers their wheels for a
machine without network and prints the install recipe.

Rows (same model shape, batch and timing as the other rows of ``z2all bench train``):

    hf_ao_fp8           transformers' LlamaForCausalLM + torchao float8 training (dynamic ROWWISE scaling, every
                        decoder linear; LM head and embedding bf16) + each decoder layer under torch.compile;
                        fp32 master weights + bf16 autocast, fused AdamW: run in this process
    tt_compile          torchtitan's llama3 ``Trainer`` at our shape (a registered flavour), bf16 + per-block
                        torch.compile, random-token batches through a custom dataloader
    tt_fp8              tt_compile + torchtitan's float8 converter with the ROWWISE recipe (torchao underneath)
    tt_fp8_tensorwise   tt_compile + float8 with TENSORWISE scaling (torchtitan's default float8 recipe)

torchtitan's rows run its own ``Trainer`` (its optimizer container, fused AdamW, gradient clipping at 1.0, its
loss) in a ``torchrun`` child process, because the trainer needs a process group and takes over the process's
CUDA state; the same worker runs the 2-GPU variants of ``benchmarks/torchtitan_peer.py``. On one GPU torchtitan
trains with fp32 parameters under bf16 autocast (its own AMP path), the recipe of our rows. Activation
checkpointing is off everywhere (torchtitan's default is selective; ours does not recompute).

A row whose packages are missing prints why (:func:`missing_reason`) instead of a number.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROWS = ["hf_ao_fp8", "tt_compile", "tt_fp8", "tt_fp8_tensorwise"]
REQUIRES = {"hf_ao_fp8": ["transformers", "torchao"], "tt_compile": ["torchtitan", "tyro", "torchdata"],
            "tt_fp8": ["torchtitan", "tyro", "torchdata", "torchao"],
            "tt_fp8_tensorwise": ["torchtitan", "tyro", "torchdata", "torchao"]}
# the float8 recipe of each torchtitan row (None = bf16)
TT_FLOAT8 = {"tt_compile": None, "tt_fp8": "rowwise", "tt_fp8_tensorwise": "tensorwise"}
WHEELS_HINT = "carry the peer wheels: see benchmarks/peer_wheels.sh"
FLOAT8_CONVERTER = "quantize.linear.float8"  # torchtitan 0.2.2's registered name of its float8 linear converter


def missing_reason(row: str, find_spec=importlib.util.find_spec) -> str | None:
    """Why ``row`` cannot run here (the first missing package), or None when its packages import."""
    if row not in REQUIRES:
        raise ValueError(f"bench peers: unknown peer row {row!r} (known: {', '.join(ROWS)})")
    for name in REQUIRES[row]:
        try:
            found = find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{name} not installed ({WHEELS_HINT})"
    return None


# ------------------------------------------------------------------------------------------- HF + torchao float8


def build_hf_ao_fp8(base_cfg, row: str, device, seq: int):
    """HF Llama with every decoder linear swapped for torchao's Float8Linear (rowwise), blocks compiled."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from zero2all.bench import _build_hf, _compile_blocks

    model, loss_fn = _build_hf(base_cfg, "hf", device, seq)
    # the LM head stays bf16, as in our FP8 recipe and torchtitan's float8 defaults
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=lambda module, fqn: fqn != "lm_head")
    _compile_blocks(model.model.layers)
    return model, loss_fn


# ------------------------------------------------------------------------------------------- torchtitan


def titan_model_args(cfg, seq: int):
    """torchtitan ``TransformerModelArgs`` of our ModelConfig's shape.

    torchtitan sizes the SwiGLU width as ``multiple_of * ceil(int(m * int(2 * 4 * dim / 3)) / multiple_of)``;
    ``multiple_of = intermediate_size`` with ``m <= 1`` lands exactly on our width.
    """
    from torchtitan.models.llama3 import TransformerModelArgs

    if cfg.tie_word_embeddings:
        raise ValueError("bench peers: torchtitan's llama3 has no tied embeddings; use an untied preset")
    base = int(2 * 4 * cfg.hidden_dim / 3)
    mult = None if base <= cfg.intermediate_size else cfg.intermediate_size / base
    return TransformerModelArgs(dim=cfg.hidden_dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                                n_kv_heads=cfg.n_kv_heads, vocab_size=cfg.padded_vocab_size,
                                multiple_of=cfg.intermediate_size, ffn_dim_multiplier=mult,
                                norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, max_seq_len=seq)


def _stub_datasets() -> None:
    """torchtitan's llama3 package imports HF ``datasets`` for its text loaders, which we replace: when the
    package is absent, a module that refuses every call stands in for it."""
    if importlib.util.find_spec("datasets") is not None:
        return

    def refuse(*args, **kwargs):
        raise RuntimeError("datasets is not installed: the torchtitan peer trains on random tokens only")

    root, dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    root.Dataset, root.load_dataset, root.distributed = type("Dataset", (), {}), refuse, dist
    dist.split_dataset_by_node = refuse
    sys.modules.update({"datasets": root, "datasets.distributed": dist})


def _random_loader_builder(seq: int, vocab: int, accum: int):
    """A torchtitan dataloader builder: ``accum`` fixed random-token batches per data-parallel rank, cycled.

    Ranks of one data-parallel replica (tp, pp, cp) get the same sequences; each replica its own."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader

    class RandomTokens(BaseDataLoader):
        def __init__(self, dp_rank: int, batch: int):
            g = torch.Generator().manual_seed(1234 + dp_rank)
            self.batches = [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(accum)]

        def __iter__(self):
            while True:
                for b in self.batches:
                    yield {"input": b[:, :-1]}, b[:, 1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    def build(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
        return RandomTokens(dp_rank, job_config.training.local_batch_size)

    return build



def step_spread(result: dict) -> str:
    """tok/s of rank 0's fastest / median / slowest timed step of a benchmark result (``step_times_ms``,
    ``tokens_per_s`` and ``step_s`` keys; the headline itself is the median step)."""
    ms = result.get("step_times_ms") or []
    if not ms:
        return ""
    tokens = result["tokens_per_s"] * result["step_s"]
    fast, mid, slow = (tokens / (t / 1e3) for t in (min(ms), sorted(ms)[len(ms) // 2], max(ms)))
    return f"tok/s min/median/max over {len(ms)} steps: {slow:,.0f} / {mid:,.0f} / {fast:,.0f}"

def titan_job_config(*, mb: int, seq: int, accum: int, dp: int, tp: int = 1, pp: int = 1, cp: int = 1,
                     float8: str | None = None, compile: bool = True, dump_folder: str = ".", pp_mbs: int = 1):
    """torchtitan's JobConfig for one measurement (flavour ``z2all`` of the registered ``z2all_llama3`` spec)."""
    from torchtitan.config import JobConfig

    jc = JobConfig()
    jc.job.dump_folder = dump_folder
    jc.model.name, jc.model.flavor = "z2all_llama3", "z2all"
    jc.training.local_batch_size, jc.training.seq_len = mb, seq
    jc.training.global_batch_size = mb * accum * dp
    jc.training.steps = 10 ** 6
    jc.training.mixed_precision_param = "bfloat16"
    jc.lr_scheduler.warmup_steps = 1
    jc.optimizer.implementation = "fused"
    jc.metrics.log_freq = 10 ** 6  # only the first (warm-up) step logs
    jc.activation_checkpoint.mode = "none"
    jc.checkpoint.enable = False
    jc.validation.enable = False
    jc.compile.enable = compile
    jc.compile.components = ["model", "loss"]
    p = jc.parallelism
    p.data_parallel_shard_degree, p.data_parallel_replicate_degree = -1, 1
    p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree = tp, pp, cp
    p.pipeline_parallel_schedule, p.pipeline_parallel_microbatch_size = "1F1B", pp_mbs
    if float8:
        jc.model.converters = [FLOAT8_CONVERTER]
        jc.quantize.linear.float8.recipe_name = None if float8 == "tensorwise" else float8
        jc.quantize.linear.float8.filter_fqns = ["output"]  # the LM head stays bf16
    return jc


def titan_worker(args) -> None:
    """One torchtitan measurement inside torchrun; rank 0 writes the result JSON to ``args.result``."""
    _stub_datasets()
    import torch
    import torch.distributed as dist
    import torchtitan.models.llama3 as llama3
    from torchtitan.protocols.train_spec import register_train_spec
    from torchtitan.train import Trainer

    from zero2all import accounting
    from zero2all.config import load_config
    from zero2all.train.metrics import detect_peak_flops

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // (args.tp * args.pp * args.cp)
    cfg = load_config(args.config, list(args.override)).model
    spec = dataclasses.replace(llama3.get_train_spec(), model_args={"z2all": titan_model_args(cfg, args.seq)},
                               build_dataloader_fn=_random_loader_builder(args.seq, cfg.padded_vocab_size,
                                                                          args.accum),
                               build_tokenizer_fn=None, build_validator_fn=None, state_dict_adapter=None)
    register_train_spec("z2all_llama3", spec)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix="z2all-tt-") as dump:
        jc = titan_job_config(mb=args.micro_batch, seq=args.seq, accum=args.accum, dp=dp, tp=args.tp, pp=args.pp,
                              cp=args.cp, float8=args.float8 or None, compile=not args.no_compile,
                              dump_folder=dump, pp_mbs=args.pp_microbatch_size)
        trainer = Trainer(jc)
        precision = _titan_precision(trainer, args.amp)
        data = trainer.batch_generator(trainer.dataloader)
        times = []
        for _ in range(args.warmup + args.steps):
            trainer.step += 1
            trainer.gc_handler.run(trainer.step)
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.train_step(data)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        measured = times[args.warmup:]
        # the slowest rank sets the pace
        step_s = torch.tensor(statistics.median(measured), device=trainer.device)
        dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
        peaks = [None] * world
        dist.all_gather_object(peaks, torch.cuda.max_memory_allocated())
        if dist.get_rank() == 0:
            tokens = args.micro_batch * args.accum * args.seq * dp
            tok_s = tokens / step_s.item()
            peak = detect_peak_flops(trainer.device)
            result = {"variant": args.variant, "gpus": world, "tp": args.tp, "pp": args.pp, "cp": args.cp,
                      "dp": dp, "micro_batch": args.micro_batch, "accum": args.accum, "seq_len": args.seq,
                      "float8": args.float8 or None, "compile": not args.no_compile, "precision": precision,
                      "tokens_per_s": tok_s, "step_s": step_s.item(),
                      "step_times_ms": [round(t * 1000, 2) for t in measured],
                      "mfu": accounting.mfu(tok_s / world, cfg, args.seq, peak) if peak else None,
                      "peak_bytes": peaks, "device_name": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "torchtitan": _version("torchtitan"),
                      "torchao": _version("torchao")}
            Path(args.result).write_text(json.dumps(result))
        dist.barrier()
        trainer.close()
    dist.destroy_process_group()


def _titan_precision(trainer, amp: str) -> str:
    """Say (and, with ``amp = autocast``, fix) the precision torchtitan trains in.

    torchtitan mixes precision through FSDP2's policy when parameters are sharded and through autocast on one
    device; with TP or PP and no FSDP it trains in fp32. ``autocast`` wraps its train context in bf16 autocast
    there, so every variant runs the same fp32-master + bf16 recipe."""
    import torch

    dims = trainer.parallel_dims
    if dims.fsdp_enabled:
        return "bf16 (FSDP2 mixed precision)"
    if not (dims.tp_enabled or dims.pp_enabled):
        return "bf16 autocast"
    if amp == "native":
        return "fp32 (torchtitan: no AMP for TP/PP without FSDP)"
    inner = trainer.train_context

    @contextlib.contextmanager
    def with_autocast():
        with inner(), torch.autocast("cuda", dtype=torch.bfloat16):
            yield

    trainer.train_context = with_autocast
    return "bf16 autocast (added around torchtitan's train context)"


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def titan_command(*, nproc: int, variant: str, result: Path, config: str, micro_batch: int, seq: int,
                  accum: int, steps: int, warmup: int, tp: int = 1, pp: int = 1, cp: int = 1,
                  float8: str | None = None, compile: bool = True, amp: str = "autocast",
                  overrides: list[str] = (), pp_mbs: int = 1) -> list[str]:
    """The ``torchrun`` command line of one torchtitan measurement."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "zero2all.bench.peers", "--variant", variant, "--result", str(result), "--config", config,
           "--micro-batch", str(micro_batch), "--seq", str(seq), "--accum", str(accum), "--steps", str(steps),
           "--warmup", str(warmup), "--tp", str(tp), "--pp", str(pp), "--cp", str(cp), "--amp", amp]
    cmd += ["--float8", float8] if float8 else []
    cmd += ["--pp-microbatch-size", str(pp_mbs)] if pp_mbs != 1 else []
    cmd += [] if compile else ["--no-compile"]
    for o in overrides:
        cmd += ["--override", o]
    return cmd


def run_titan(cmd: list[str], result: Path, timeout: float, log=print) -> tuple[dict | None, str | None]:
    """Run one torchrun measurement; returns (result dict, None) or (None, the reason it failed)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [repo, env.get("PYTHONPATH", "")] if p)
    # its own process group: on a timeout the workers go too, not only torchrun (they would keep the GPU memory)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, f"timed out after {timeout:.0f} s"
    if proc.returncode == 0 and result.exists():
        return json.loads(result.read_text()), None
    log("\n".join(output.splitlines()[-40:]))
    return None, failure_reason(output, proc.returncode)


def failure_reason(output: str, returncode: int) -> str:
    """The line that says why a child run failed: the last exception line of its output, else its exit code."""
    for line in reversed(output.splitlines()):
        text = line.strip()
        if text.startswith("[rank") and "]:" in text:
            text = text.split("]:", 1)[1].strip()
        head = text.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Exit", "Interrupt")) and " " not in head:
            return text[:300]
    return f"exit code {returncode}"


def run_row(row: str, base_cfg, micro_batch: int, seq: int, accum: int, iters: int, warmup: int,
            config: str = "z2all-1.1b", overrides=(), sdpa_backend: str = "default", timeout: float = 900,
            log=print, grad_clip: float = 1.0):
    """One peer row of ``z2all bench train``: a BenchResult with numbers, or with the reason it could not run.
    ``grad_clip``: the clipping of the rows that run in this process (torchtitan clips in its own Trainer)."""
    from zero2all import bench

    reason = missing_reason(row)
    if reason is not None:
        return bench.BenchResult(row, bench.ROW_LABELS.get(row, row), micro_batch, seq, accum, error=reason)
    if row == "hf_ao_fp8":
        return bench.run_row(row, base_cfg, micro_batch, seq, accum, iters, warmup, sdpa_backend=sdpa_backend,
                             build=build_hf_ao_fp8, log=log, grad_clip=grad_clip)
    result = bench.BenchResult(row, bench.ROW_LABELS.get(row, row), micro_batch, seq, accum)
    with tempfile.TemporaryDirectory(prefix="z2all-tt-row-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = titan_command(nproc=1, variant=row, result=out, config=config, micro_batch=micro_batch, seq=seq,
                            accum=accum, steps=iters, warmup=warmup, float8=TT_FLOAT8[row],
                            overrides=list(overrides))
        got, error = run_titan(cmd, out, timeout, log=log)
    if got is None:
        result.error = error
        return result
    result.step_times_ms = got["step_times_ms"]
    result.step_ms = got["step_s"] * 1000
    result.tokens_per_s = got["tokens_per_s"]
    result.mfu = got["mfu"]
    result.peak_gb = max(got["peak_bytes"]) / 1e9
    return result


def worker_parser() -> argparse.ArgumentParser:
    """The options of the torchrun worker (what :func:`titan_command` writes)."""
    p = argparse.ArgumentParser(description="one torchtitan peer measurement (run under torchrun)")
    p.add_argument("--variant", default="tt")
    p.add_argument("--result", required=True)
    p.add_argument("--config", default="z2all-1.1b")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--pp-microbatch-size", type=int, default=1, help="sequences per pipeline microbatch")
    p.add_argument("--float8", choices=["rowwise", "tensorwise"], default=None)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--amp", choices=["autocast", "native"], default="autocast")
    p.add_argument("--override", action="append", default=[])
    return p


def main(argv=None) -> int:
    """The torchrun worker entry point (``python -m zero2all.bench.peers ...``)."""
    titan_worker(worker_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
