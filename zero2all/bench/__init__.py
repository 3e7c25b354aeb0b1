"""Training-throughput benchmark: our kernel ablations and the HF transformers peer, in one invocation, one table.

Every row trains the same architecture (a preset, z2all-1.1b by default) on random tokens with the same recipe:
float32 master weights, bf16 autocast, AdamW (torch's fused implementation unless the row says otherwise), one
optimizer step per ``accum`` micro-batches of ``micro_batch x seq`` tokens. Each step does what a step of
``z2all pretrain`` does around the optimizer: the gradient norm over every parameter, clipping to
``train.grad_clip`` (the config's, 1.0 by default; ``train.grad_clip=0`` measures the norm only), the norm read
on the host (pretrain's finite check: a non-finite norm skips the update). A row is timed over ``iters`` optimizer
steps after ``warmup`` steps (CUDA-synchronised wall clock per step, median reported), and its peak allocated GPU
memory is recorded. MFU uses the project's formula (``accounting.mfu``):

    MFU = tokens/s * (6 N + 6 L H T) / peak,    N = non-embedding parameters (LM head counts), peak = 989e12 (H100)

(the causal attention counted as computed: half of the T x T score/value products).

Rows (``--rows``, comma separated; ``all`` = the ablation table and the peers):

    naive              plain PyTorch ops, naive (explicit softmax) attention
    use_all            every fused kernel, SDPA attention, fused AdamW
    no_flash           use_all with naive attention                      ("w/o flash-attn")
    no_rope / no_cross_entropy / no_rmsnorm / no_swiglu   use_all with that one op on its PyTorch path (without
                       the rmsnorm or swiglu kernel the blocks' fused linears are off too: they are built on them)
    no_fused_linear    use_all with the blocks' projections as plain nn.Linear under autocast (no lean fused
                       norm+linear / SwiGLU+linear / o projection): the memory those save
    no_adamw           use_all with the for-each (unfused) AdamW          ("w/o AdamW")
    use_all_compile    use_all with each decoder block under torch.compile (regional compilation)
    hf / hf_compile / hf_liger   transformers' LlamaForCausalLM (sdpa), eager / decoder layers compiled the same
                                 way / with Liger kernels (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy)
    hf_ao_fp8 / tt_compile / tt_fp8 / tt_fp8_tensorwise   HF + torchao float8 (rowwise) + compile; torchtitan's
                       llama3 at our shape, bf16 + compile / + float8 rowwise / tensorwise (zero2all/bench/peers.py)
    mb16               use_all at micro-batch 16 (twice the tokens per step)
    seq8192            use_all at seq 8192 with micro-batch * seq kept equal to the base run's
    layout_bsh / layout_sbh   use_all with plain projections (fused_linear off), activations kept (batch, seq,
                              hidden) or (seq, batch, hidden) by the model itself; they differ only in the layout
    use_all_flash / use_all_cudnn   use_all with that SDPA backend first in the priority order
    use_all_fp8        use_all with the blocks' projections on FP8 GEMMs, rowwise scaling (linear_precision =
                       fp8_rowwise; LM head and embedding stay bf16); use_all_fp8_mb16 the same at micro-batch 16;
                       use_all_fp8_tensorwise with tensorwise scaling; use_all_fp8_delayed tensorwise with
                       delayed scaling (model.ops.fp8_amax_history = 16) (fp8 = the four). The override
                       model.ops.linear_precision=fp8_rowwise runs every other row of ours with FP8 linears
                       (the ablation table in FP8); model.ops.step_fusion=grads|all likewise applies the
                       per-step weight-gradient sums / weight casts (kernels/step_fusion.py) to every row of ours

``--device cpu`` runs the same rows on the CPU (bf16 autocast on the CPU, no memory or MFU column: there is no
GPU peak to divide by): with ``--config tiny`` and a few short steps it checks, in seconds, that the rows build,
train and fill the table (the Triton rows then need ``TRITON_INTERPRET=1``; a row that cannot run says why).
Its timings say nothing about a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zero2all.config import config_fields
from zero2all.fileio import save_json, write_text

ABLATION_ROWS = ["naive", "use_all", "no_flash", "no_rope", "no_cross_entropy", "no_rmsnorm", "no_swiglu",
                 "no_fused_linear", "no_adamw", "use_all_compile"]
PEER_ROWS = ["hf", "hf_compile", "hf_liger", "hf_ao_fp8", "tt_compile", "tt_fp8", "tt_fp8_tensorwise"]
EXTERNAL_PEER_ROWS = ["hf_ao_fp8", "tt_compile", "tt_fp8", "tt_fp8_tensorwise"]  # run by bench/peers.py
EXTRA_ROWS = ["mb16", "seq8192", "layout_bsh", "layout_sbh", "use_all_flash", "use_all_cudnn"]
FP8_ROWS = ["use_all_fp8", "use_all_fp8_mb16", "use_all_fp8_tensorwise", "use_all_fp8_delayed"]
DELAYED_HISTORY = 16        # use_all_fp8_delayed: model.ops.fp8_amax_history
ROW_LABELS = {"naive": "naive", "use_all": "use_all", "no_flash": "w/o flash-attn", "no_rope": "w/o rope",
              "no_cross_entropy": "w/o cross_entropy", "no_rmsnorm": "w/o rmsnorm", "no_swiglu": "w/o swiglu",
              "no_fused_linear": "w/o fused_linear",
              "no_adamw": "w/o AdamW", "use_all_compile": "use_all + compile", "hf": "HF Llama (sdpa) eager",
              "hf_compile": "HF Llama + torch.compile", "hf_liger": "HF Llama + Liger", "mb16": "use_all mb16",
              "seq8192": "use_all seq 8192", "layout_bsh": "layout (batch, seq, hidden)",
              "layout_sbh": "layout (seq, batch, hidden)", "use_all_flash": "use_all, SDPA flash first",
              "use_all_cudnn": "use_all, SDPA cuDNN first", "use_all_fp8": "use_all FP8 rowwise",
              "use_all_fp8_mb16": "use_all FP8 rowwise mb16", "use_all_fp8_tensorwise": "use_all FP8 tensorwise",
              "use_all_fp8_delayed": "use_all FP8 tensorwise delayed",
              "hf_ao_fp8": "HF + torchao fp8 rw + compile", "tt_compile": "torchtitan + compile",
              "tt_fp8": "torchtitan fp8 rw + compile",
              "tt_fp8_tensorwise": "torchtitan fp8 tw + compile"}  # rw / tw: rowwise / tensorwise scaling


@dataclass
class BenchResult:
    row: str
    label: str
    micro_batch: int
    seq: int
    accum: int
    step_ms: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gb: float | None = None
    step_times_ms: list = field(default_factory=list)
    error: str | None = None


def _ops_for(row: str):
    from zero2all.config import OpsConfig

    fused = dict(rmsnorm="triton", rope="triton", swiglu="triton", cross_entropy="fused", attention="sdpa",
                 fused_linear="triton")
    if row == "naive":
        return OpsConfig(rmsnorm="torch", rope="torch", swiglu="torch", cross_entropy="torch", attention="naive",
                         fused_linear="torch")
    if row == "no_flash":
        fused["attention"] = "naive"
    for op in ("rope", "rmsnorm", "swiglu", "fused_linear"):
        if row == f"no_{op}":
            fused[op] = "torch"
    if row in ("no_rmsnorm", "no_swiglu"):  # the fused linears carry those kernels inside the blocks
        fused["fused_linear"] = "torch"
    if row == "no_cross_entropy":
        fused["cross_entropy"] = "torch"
    if row in FP8_ROWS:
        fused["linear_precision"] = ("fp8_tensorwise" if row.endswith(("tensorwise", "delayed"))
                                     else "fp8_rowwise")
    return OpsConfig(**fused)


# --------------------------------------------------------------------------------------------------------------
# a forward in either activation layout (for the layout question)


def layout_forward(model, tokens, targets, layout: str):
    """Our model's forward and loss with activations kept (batch, seq, hidden) (``bsh``) or (seq, batch, hidden)
    (``sbh``: ``model.set_seq_first()``, set here on every call) throughout, through the model's own seams (``embed``,
    ``blocks``, ``final_norm``, ``head_loss``).

    The GEMMs see (B*T, hidden) either way; the layouts differ in how attention's inputs and outputs are strided
    (RoPE reads q/k through strides; SDPA takes (B, H, T, D) views) and in the one permute after attention.
    """
    cos, sin = model.rope_tables(0, tokens.shape[1], tokens.device)
    model.set_seq_first(layout == "sbh")
    if layout == "sbh":
        tokens, targets = tokens.t(), targets.t()                           # (T, B)
    x, residual = model.blocks(model.embed(tokens), None, cos, sin)         # (T, B, C) or (B, T, C)
    return model.head_loss(model.final_norm(x, residual), targets)[1]


# --------------------------------------------------------------------------------------------------------------
# building a row


def _build_ours(base_cfg, row: str, device):
    from zero2all.model.z2all import build_model

    ops = _ops_for("use_all" if row in EXTRA_ROWS else row)
    if row not in FP8_ROWS:  # model.ops.linear_precision=... on the command line applies to every row of ours
        ops.linear_precision = base_cfg.ops.linear_precision
    ops.step_fusion = base_cfg.ops.step_fusion  # model.ops.step_fusion=... applies to every row of ours
    ops.fp8_weight_cache, ops.fp8_fused_amax = base_cfg.ops.fp8_weight_cache, base_cfg.ops.fp8_fused_amax
    if ops.linear_precision == "fp8_tensorwise":
        ops.fp8_amax_history = DELAYED_HISTORY if row == "use_all_fp8_delayed" else base_cfg.ops.fp8_amax_history
    if row.startswith("layout_"):  # the blocks' plain projections: the layout rows' measurement, as ever
        ops.fused_linear = "torch"
    cfg = dataclasses.replace(base_cfg, ops=ops)
    model = build_model(cfg, device=device, seed=0)
    if cfg.ops.step_fusion != "off":  # one process, no wrapper (kernels/step_fusion.py)
        model.numerics.mark(model, cfg.ops.step_fusion)
    if row.startswith("layout_"):
        layout = row.split("_")[1]
        return model, (lambda tokens, targets: layout_forward(model, tokens, targets, layout))
    if row == "use_all_compile":
        _compile_blocks(model.layers)
    return model, (lambda tokens, targets: model(tokens, targets)[1])


def _compile_blocks(layers) -> None:
    """Regional compilation: each decoder block is compiled, and the 22 identical blocks share one compiled graph
    (compiling once instead of tracing the whole unrolled model keeps the compile time to tens of seconds)."""
    for layer in layers:
        layer.compile()


def _build_hf(base_cfg, row: str, device, seq: int):
    import transformers

    from zero2all.model.hf import model_config_to_hf

    if row == "hf_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    hf_dict = model_config_to_hf(base_cfg)
    hf_dict["max_position_embeddings"] = max(seq, base_cfg.max_seq_len)
    hf_dict["use_cache"] = False
    config = transformers.LlamaConfig(**{k: v for k, v in hf_dict.items() if k not in ("architectures",
                                                                                          "torch_dtype")})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model.train()
    if row == "hf_compile":
        _compile_blocks(model.model.layers)
    # labels = the inputs: HF shifts them inside, so each row predicts the next token as ours does
    return model, (lambda tokens, targets: model(input_ids=tokens, labels=tokens, use_cache=False).loss)


def _sdpa_context(backend: str):
    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = {"cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                       SDPBackend.MATH],
             "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}[backend]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # torch < 2.6: no priorities, only a set of allowed backends
        return sdpa_kernel(order)


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_row(row: str, base_cfg, micro_batch: int, seq: int, accum: int, iters: int, warmup: int,
            device="cuda", peak_flops: float = 989e12, sdpa_backend: str = "default", profile_dir=None,
            log=print, build=None, grad_clip: float = 1.0) -> BenchResult:
    """Train ``iters + warmup`` optimizer steps of one row; returns its timing and memory. ``build(base_cfg, row,
    device, seq) -> (model, loss_fn)`` replaces the row's own model builder. Each step clips the gradients to
    ``grad_clip`` (0: the norm only) as ``z2all pretrain`` does. On the CPU (``device="cpu"``) no memory or MFU is
    recorded."""
    from zero2all.accounting import mfu
    from zero2all.train import optim as train_optim

    result = BenchResult(row, ROW_LABELS.get(row, row), micro_batch, seq, accum)
    model = opt = loss_fn = None
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        if build is not None:
            model, loss_fn = build(base_cfg, row, device, seq)
        elif row.startswith("hf"):
            model, loss_fn = _build_hf(base_cfg, row, device, seq)
        else:
            model, loss_fn = _build_ours(base_cfg, row, device)
        fused = row != "no_adamw"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=fused, foreach=None if fused else True)
        numerics = getattr(model, "numerics", None)
        if numerics is not None:  # our model: its kept casts are dropped after each step of this optimizer
            numerics.attach(opt)
        g = torch.Generator(device="cpu").manual_seed(1234)
        vocab = base_cfg.padded_vocab_size
        batches = [torch.randint(0, vocab, (micro_batch, seq + 1), generator=g).to(device) for _ in range(accum)]
        params = [p for group in opt.param_groups for p in group["params"]]

        def step():
            for b in batches:
                with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                    loss = loss_fn(b[:, :-1], b[:, 1:])
                (loss / accum).backward()
            # what the trainer does between backward and the optimizer (Trainer.train_step)
            norm = train_optim.grad_norm_and_clip(params, grad_clip)
            if math.isfinite(float(norm)):
                opt.step()
            opt.zero_grad(set_to_none=True)

        backend = {"use_all_flash": "flash", "use_all_cudnn": "cudnn"}.get(row, sdpa_backend)
        with _sdpa_context(backend):
            times = []
            for i in range(warmup + iters):
                _synchronize(device)
                t0 = time.perf_counter()
                step()
                _synchronize(device)
                times.append((time.perf_counter() - t0) * 1000)
                if i == 0:
                    log(f"  {row}: first step {times[0] / 1000:.1f} s")
            if profile_dir is not None:
                _profile(step, row, profile_dir, device)
        measured = times[warmup:]
        result.step_times_ms = [round(t, 2) for t in measured]
        result.step_ms = statistics.median(measured)
        result.tokens_per_s = micro_batch * seq * accum / (result.step_ms / 1000)
        if cuda:
            result.mfu = mfu(result.tokens_per_s, base_cfg, seq, peak_flops)
            result.peak_gb = torch.cuda.max_memory_allocated(device) / 1e9
    except torch.cuda.OutOfMemoryError:
        result.error = "out of memory"
        result.peak_gb = torch.cuda.max_memory_allocated(device) / 1e9
    except Exception as e:  # a row that cannot run (missing package, backend error) is reported, not fatal
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        model = opt = loss_fn = None  # free the row's GPU memory before the next row
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        try:
            torch._dynamo.reset()
        except Exception:
            pass
    return result


def _profile(step, row, profile_dir, device):
    from torch.profiler import ProfilerActivity, profile

    profile_dir = Path(profile_dir)
    profile_dir.mkdir(parents=True, exist_ok=True)
    cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        _synchronize(device)
    sort = ("cuda_time_total" if _has_cuda_total(prof) else "device_time_total") if cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=70)
    write_text(profile_dir / f"profile_{row}.txt", table)


def _has_cuda_total(prof) -> bool:
    try:
        evt = prof.key_averages()[0]
        return hasattr(evt, "cuda_time_total") and not hasattr(evt, "device_time_total")
    except Exception:
        return False


# --------------------------------------------------------------------------------------------------------------
# the table


def format_table(results: list[BenchResult]) -> str:
    peers = [r for r in results if r.row in PEER_ROWS and r.tokens_per_s]
    best_peer = max(peers, key=lambda r: r.tokens_per_s) if peers else None
    head = f"{'row':<30} {'mb':>3} {'seq':>5} {'step ms':>9} {'tok/s':>9} {'MFU %':>6} {'peak GB':>8} " \
           f"{'vs best peer':>12}"
    lines = [head, "-" * len(head)]
    for r in results:
        if r.error:
            peak = f"{r.peak_gb:8.1f}" if r.peak_gb else f"{'':>8}"
            lines.append(f"{r.label:<30} {r.micro_batch:>3} {r.seq:>5} {r.error[:40]:>33} {peak}")
            continue
        ratio = f"{r.tokens_per_s / best_peer.tokens_per_s:11.2f}x" if best_peer else f"{'':>12}"
        mfu = f"{100 * r.mfu:6.1f}" if r.mfu is not None else f"{'-':>6}"      # the CPU has no peak to divide by
        peak = f"{r.peak_gb:8.1f}" if r.peak_gb is not None else f"{'-':>8}"
        lines.append(f"{r.label:<30} {r.micro_batch:>3} {r.seq:>5} {r.step_ms:9.1f} {r.tokens_per_s:9.0f} "
                     f"{mfu} {peak} {ratio}")
    if best_peer:
        lines.append(f"best peer: {best_peer.label} ({best_peer.tokens_per_s:.0f} tok/s)")
    return "\n".join(lines)


def add_arguments(p) -> None:
    """The options of ``z2all bench train`` and ``benchmarks/train_throughput.py``."""
    p.add_argument("--config", default="z2all-1.1b", help="preset or .toml (default z2all-1.1b)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (default; the numbers) or cpu (a check that the rows run: e.g. --config tiny "
                        "--seq 32 --micro-batch-size 2 --grad-accum-steps 1 --iters 2 --warmup 1; no MFU or memory "
                        "column)")
    p.add_argument("--rows", default="all",
                   help="comma-separated rows, or all / ablations / fp8 / peers / extras (default all): "
                        + ", ".join(ROW_LABELS))
    # the names and help of train.micro_batch_size / train.grad_accum_steps (the earlier names stay as aliases);
    # the defaults are this benchmark's
    helps = {f.key: f.help for f in config_fields()}
    p.add_argument("--micro-batch-size", "--micro-batch", type=int, default=8, metavar="N",
                   help=helps["train.micro_batch_size"] + " (default 8)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--grad-accum-steps", "--accum", type=int, default=4, metavar="N",
                   help=helps["train.grad_accum_steps"] + " (default 4)")
    p.add_argument("--iters", type=int, default=5, help="timed optimizer steps per row (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    p.add_argument("--sdpa-backend", default="default", choices=["default", "cudnn", "flash"],
                   help="SDPA backend priority for every row (default: torch's own order)")
    p.add_argument("--out", default=None, help="write the results as JSON here (a new file, or an existing one "
                                               "with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file (refused otherwise)")
    p.add_argument("--profile", default="", help="comma-separated rows to profile for one extra step")
    p.add_argument("--profile-dir", default=".", help="where profile_ROW.txt tables go")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.n_layers=4")


def main_from_args(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("z2all bench train: error: no CUDA GPU is visible; --device cpu runs the rows on the CPU (a check that "
              "they run, not a measurement)", file=sys.stderr)
        return 2
    bench_train(config=args.config, rows=args.rows, micro_batch=args.micro_batch_size, seq=args.seq,
                accum=args.grad_accum_steps,
                iters=args.iters, warmup=args.warmup, sdpa_backend=args.sdpa_backend, out=args.out,
                profile=args.profile, profile_dir=args.profile_dir, overrides=args.overrides, device=args.device,
                overwrite=args.overwrite)
    return 0


def bench_train(config: str = "z2all-1.1b", rows: str = "all", micro_batch: int = 8, seq: int = 2048,
                accum: int = 4, iters: int = 5, warmup: int = 2, sdpa_backend: str = "default",
                out: str | None = None, profile: str = "", profile_dir: str | None = None,
                overrides: list[str] | None = None, log=print, device: str = "cuda",
                overwrite: bool = False) -> list[BenchResult]:
    """Run the rows named in ``rows`` and print the table; write JSON to ``out`` when given (an existing file only
    with ``overwrite``: checked before any row runs). ``device="cpu"``: the same rows on the CPU (a check that they
    run; no MFU or memory)."""
    from zero2all.config import load_config
    from zero2all.fileio import claim_output_file

    if out:
        claim_output_file(out, overwrite)

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench train: needs a CUDA GPU")
    names = []
    for part in rows.split(","):
        part = part.strip()
        if part == "all":
            names += ABLATION_ROWS + FP8_ROWS + PEER_ROWS + EXTRA_ROWS
        elif part == "fp8":
            names += FP8_ROWS
        elif part == "ablations":
            names += ABLATION_ROWS
        elif part == "peers":
            names += PEER_ROWS
        elif part == "extras":
            names += EXTRA_ROWS
        elif part in ROW_LABELS:
            names.append(part)
        elif part:
            raise ValueError(f"bench train: unknown row {part!r} (known: {', '.join(ROW_LABELS)})")
    # Liger patches transformers' Llama classes in place: run it after the other HF rows
    if "hf_liger" in names:
        names = [n for n in names if n != "hf_liger"]
        last_hf = max([i for i, n in enumerate(names) if n.startswith("hf")], default=len(names) - 1)
        names.insert(last_hf + 1, "hf_liger")
    full_cfg = load_config(config, overrides)
    base_cfg, grad_clip = full_cfg.model, full_cfg.train.grad_clip
    base_cfg = dataclasses.replace(base_cfg, max_seq_len=max(base_cfg.max_seq_len, seq, 8192))
    results = []
    profiled = set(p for p in profile.split(",") if p)
    for name in names:
        mb, s = micro_batch, seq
        if name in ("mb16", "use_all_fp8_mb16"):
            mb = 16
        elif name == "seq8192":
            s, mb = 8192, max(1, micro_batch * seq // 8192)
        log(f"row {name}: micro-batch {mb}, seq {s}, accum {accum}")
        if name in EXTERNAL_PEER_ROWS and device != "cuda":
            r = BenchResult(name, ROW_LABELS.get(name, name), mb, s, accum, error="needs a CUDA GPU")
        elif name in EXTERNAL_PEER_ROWS:
            from zero2all.bench import peers

            r = peers.run_row(name, base_cfg, mb, s, accum, iters, warmup, config=config,
                              overrides=overrides or [], sdpa_backend=sdpa_backend, log=log, grad_clip=grad_clip)
        else:
            r = run_row(name, base_cfg, mb, s, accum, iters, warmup, device=device, sdpa_backend=sdpa_backend,
                        grad_clip=grad_clip,
                        profile_dir=(profile_dir or ".") if name in profiled else None, log=log)
        mfu = f", {100 * r.mfu:.1f} % MFU" if r.mfu is not None else ""
        log(f"  -> {r.error or f'{r.step_ms:.1f} ms/step, {r.tokens_per_s:.0f} tok/s{mfu}'}"
            + (f", peak {r.peak_gb:.1f} GB" if r.peak_gb else ""))
        results.append(r)
    table = format_table(results)
    cpu = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; not a measurement)"
    env = (f"device: {torch.cuda.get_device_name() if device == 'cuda' else cpu}, torch {torch.__version__}, "
           f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, config {config}, accum {accum}, "
           f"iters {iters} (median) after {warmup} warm-up, sdpa backend {sdpa_backend}, grad clip "
           f"{grad_clip or 'off (norm only)'}")
    log(env)
    log(table)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_json({"env": env, "results": results, "table": table}, path)
    return results


def bench_attention(B: int = 8, H: int = 32, Hkv: int = 8, T: int = 2048, D: int = 64, iters: int = 20,
                    log=print) -> dict:
    """Causal attention forward+backward through each SDPA backend, GQA native (enable_gqa) and with K/V
    repeated, bf16; median ms and TFLOP/s (4 * B * H * T^2 * D / 2 causal FLOPs forward, 2.5x that fwd+bwd)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    flops = 2.5 * 4 * B * H * T * T * D / 2
    out = {}
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        for gqa in ("enable_gqa", "repeat_kv"):
            def run():
                kk, vv = k, v
                kwargs = {"enable_gqa": True}
                if gqa == "repeat_kv":
                    kk, vv, kwargs = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1), {}
                y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kwargs)
                y.backward(grad)
            name = f"{backend.lower()} {gqa}"
            try:
                with sdpa_kernel([getattr(SDPBackend, backend)]):
                    for _ in range(3):
                        run()
                    times = []
                    for _ in range(iters):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        run()
                        e.record()
                        torch.cuda.synchronize()
                        times.append(s.elapsed_time(e))
                ms = statistics.median(times)
                out[name] = ms
                log(f"attention {name:34s} {ms:7.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s")
            except Exception as e:
                log(f"attention {name:34s} unavailable: {str(e).splitlines()[0][:100]}")
            q.grad = k.grad = v.grad = None
    return out
