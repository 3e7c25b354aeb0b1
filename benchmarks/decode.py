"""Decode throughput: our generator against HF ``generate`` on the same (exported) weights, in one run.

For each batch size, every variant generates ``--new-tokens`` tokens greedily after a ``--prompt-len`` prompt of
random ids (no early stop: every row produces all its tokens) and reports, as the median of ``--repeats`` runs
after a warm-up:

    new tok/s      batch * new tokens / wall time of the whole call (prefill included, as a user sees it)
    ms/step        decode step time: (t(N new) - t(1 new)) / (N - 1), prefill excluded
    TB/s           bytes a decode step must read (weights + the KV cache at the mean context) / step time
    roofline       the share of the HBM roofline the decode steps reach. A step must read every weight once
                   (the input embedding only for the rows' tokens), so it takes at least weight_bytes / bandwidth;
                   roofline tok/s = batch * bandwidth / weight_bytes. "+kv" also counts the KV cache bytes read.

Variants (``--variants``; the ones needing CUDA are skipped on CPU):

    ours-eager           our static KV cache, decode step run eagerly
    ours-graph           the generic decode step (the model's forward) captured as CUDA graphs and replayed
    ours-fused-graph     the fused decode step (zero2all/infer/fused_decode.py: four Triton kernels per layer),
                         one CUDA graph for every slot (the default on CUDA)
    ours-compile-graph   the step compiled by torch.compile (plain-torch ops, fused by inductor), then captured
    ours-cdt-graph       ours-compile-graph with inductor's coordinate-descent tuning of its Triton kernels
    ours-autotune-graph  the step compiled with mode="max-autotune-no-cudagraphs" (inductor benchmarks Triton GEMM
                         templates against cuBLAS for every matmul shape), then captured
    hf-dynamic           transformers LlamaForCausalLM.generate, dynamic cache (its default)
    hf-static            generate with cache_implementation="static" (on CUDA transformers compiles the forward
                         itself with mode="reduce-overhead": CUDA graphs)

    python benchmarks/decode.py                                    # z2all-1.1b, bf16, batch 1 and 16, on CUDA
    python benchmarks/decode.py --batch-sizes 1 --variants ours-fused-graph --timeline   # where a step goes
    python benchmarks/decode.py --config tiny --device cpu --dtype float32 --prompt-len 16 --new-tokens 16 \\
        --batch-sizes 1 4 --repeats 1                              # a CPU smoke test
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# HBM bandwidth by GPU name (vendor numbers, bytes/s), most specific first
HBM_BANDWIDTH = [("h100 pcie", 2.0e12), ("h100", 3.35e12), ("gh200", 4.9e12), ("h200", 4.8e12),
                 ("b200", 8.0e12), ("a100-sxm4-40gb", 1.555e12), ("a100", 2.039e12), ("l40s", 0.864e12),
                 ("4090", 1.008e12), ("a10g", 0.6e12), ("l4", 0.3e12)]
ALL_VARIANTS = ("ours-eager", "ours-graph", "ours-fused-graph", "ours-compile-graph", "ours-cdt-graph",
                "ours-autotune-graph",
                "hf-dynamic", "hf-static")
GRAPH_VARIANTS = ("ours-graph", "ours-fused-graph", "ours-compile-graph", "ours-cdt-graph", "ours-autotune-graph")


def spec_bandwidth(device: torch.device) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    for key, bw in HBM_BANDWIDTH:
        if key in name.lower():
            return bw, name
    return None, name


def measured_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes moved per second (read + write) by a large device-to-device copy, median of 10."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * a.numel() * a.element_size() / statistics.median(times[2:])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of weights a decode step reads: everything but the input embedding, plus its ``batch`` rows."""
    emb = model.embed_tokens.weight
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or p is emb:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    if model.cfg.tie_word_embeddings:
        total += emb.numel() * emb.element_size()  # read in full as the LM head
    return total + batch * emb.size(1) * emb.element_size()


def kv_bytes_per_step(cfg, batch: int, context: int, dtype: torch.dtype) -> int:
    return 2 * cfg.n_layers * batch * cfg.n_kv_heads * cfg.head_dim * context * torch.finfo(dtype).bits // 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="z2all-1.1b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS))
    ap.add_argument("--hbm-bandwidth", type=float, default=None, help="bytes/s (default: from the GPU's name)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="", help="comma-separated variants to profile (torch profiler, CUDA "
                    "kernels of --profile-tokens decode steps at the first batch size): prints a kernel table")
    ap.add_argument("--profile-tokens", type=int, default=32)
    ap.add_argument("--timeline", action="store_true", help="after the runs: the fused step's graph at batch 1, "
                    "replayed alone, with each product's and the attention's share of the step (CUDA only)")
    args = ap.parse_args(argv)

    import transformers
    from transformers import LlamaForCausalLM

    from zero2all.config import load_config
    from zero2all.fileio import save_json
    from zero2all.infer.generate import Generator, SamplingParams
    from zero2all.model.io import export_hf
    from zero2all.model.z2all import build_model

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = getattr(torch, args.dtype)
    cfg = load_config(args.config).model
    if args.prompt_len + args.new_tokens > cfg.max_seq_len:
        ap.error(f"--prompt-len + --new-tokens must fit the context of {cfg.max_seq_len}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in ALL_VARIANTS:
            ap.error(f"--variants: unknown {v!r} (known: {', '.join(ALL_VARIANTS)})")
    if device.type != "cuda":
        skipped = [v for v in variants if v in GRAPH_VARIANTS]
        if skipped:
            print(f"(skipping {', '.join(skipped)}: they need CUDA)")
        variants = [v for v in variants if v not in skipped]

    model = build_model(cfg, device=device, seed=args.seed).to(dtype).eval()
    plain_ops = dict(vars(model.cfg.ops))
    bw_spec, device_name = spec_bandwidth(device)
    bandwidth = args.hbm_bandwidth or bw_spec
    bw_measured = measured_copy_bandwidth(device)
    print(f"device {device_name}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"python {platform.python_version()}")
    print(f"model {args.config}: {model.num_params():,} parameters, {args.dtype}; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, greedy, median of {args.repeats}")
    if bandwidth:
        print(f"HBM bandwidth {bandwidth / 1e12:.2f} TB/s ({'given' if args.hbm_bandwidth else 'spec'}); "
              f"measured copy {bw_measured / 1e12:.2f} TB/s")

    hf_model = None
    tmp = tempfile.TemporaryDirectory(prefix="decode-bench-")
    if any(v.startswith("hf") for v in variants):
        hf_dir = export_hf(None, Path(tmp.name) / "hf", dtype=args.dtype, model=model)
        hf_model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
        hf_model.generation_config.pad_token_id = 0

    g = torch.Generator().manual_seed(args.seed)
    results = []
    for batch in args.batch_sizes:
        prompts = torch.randint(0, cfg.vocab_size, (batch, args.prompt_len), generator=g)
        w_bytes = weight_bytes_per_step(model, batch)
        kv_bytes = kv_bytes_per_step(cfg, batch, args.prompt_len + args.new_tokens // 2, dtype)
        for variant in variants:
            run_n = make_runner(variant, model, hf_model, prompts, device, Generator, SamplingParams, plain_ops,
                                args.new_tokens)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                run_n(args.new_tokens)                                     # warm-up: compile, capture
                run_n(1)
                t_full = median_time(lambda: run_n(args.new_tokens), device, args.repeats)
                t_one = median_time(lambda: run_n(1), device, args.repeats)
            except Exception as e:  # noqa: BLE001 - report and go on with the other variants
                print(f"  {variant} batch {batch}: failed: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            if variant in args.profile.split(",") and device.type == "cuda":
                profile_kernels(variant, batch, run_n, args.profile_tokens)
            step = (t_full - t_one) / max(1, args.new_tokens - 1)
            row = {"variant": variant, "batch": batch, "new_tok_per_s": batch * args.new_tokens / t_full,
                   "ms_per_step": step * 1e3, "seconds": t_full}
            row["achieved_bytes_per_s"] = (w_bytes + kv_bytes) / step   # weights + mean KV read per step
            if bandwidth:
                row["roofline_fraction"] = (w_bytes / bandwidth) / step
                row["roofline_fraction_with_kv"] = ((w_bytes + kv_bytes) / bandwidth) / step
            if device.type == "cuda":
                row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
            results.append(row)
            print_row(row)
        best_hf = max((r["new_tok_per_s"] for r in results if r["batch"] == batch and r["variant"].startswith("hf")),
                      default=None)
        best_ours = max((r["new_tok_per_s"] for r in results if r["batch"] == batch and
                         r["variant"].startswith("ours")), default=None)
        if best_hf and best_ours:
            print(f"  batch {batch}: ours / best HF = {best_ours / best_hf:.2f}x")
    print_table(results, bandwidth)
    if args.timeline and device.type == "cuda":
        fused_step_timeline(model, args.prompt_len, args.new_tokens, w_bytes=weight_bytes_per_step(model, 1))
    if args.json:
        save_json({"device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
                   "config": args.config, "dtype": args.dtype, "prompt_len": args.prompt_len,
                   "new_tokens": args.new_tokens, "hbm_bandwidth": bandwidth, "measured_copy_bandwidth": bw_measured,
                   "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "results": results}, args.json)
    tmp.cleanup()
    return 0


def make_runner(variant, model, hf_model, prompts, device, Generator, SamplingParams, ops_config,
                max_new_tokens):
    """A function n -> generate n new tokens for every row with this variant."""
    if variant.startswith("ours"):
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = variant == "ours-cdt-graph"
        ops = model.cfg.ops
        for name, value in ops_config.items():  # the config's ops, unless changed below
            setattr(ops, name, value)
        compiled = variant in ("ours-compile-graph", "ours-cdt-graph", "ours-autotune-graph")
        if compiled:
            # inductor fuses the plain-torch elementwise ops itself; hand-written kernels would split its graph
            for name in ("rmsnorm", "rope", "swiglu", "fused_linear"):
                setattr(ops, name, "torch")
        # one cache length for every call of this run (1 or N new tokens): one session, one capture / compile
        needed = prompts.size(1) + max_new_tokens
        mode = "max-autotune-no-cudagraphs" if variant == "ours-autotune-graph" else True
        gen = Generator(model, cuda_graph=variant != "ours-eager", compile=mode if compiled else False,
                        fused=variant == "ours-fused-graph",
                        max_sessions=8, length_bucket=-(-needed // 128) * 128)
        rows = prompts.tolist()
        return lambda n: gen.generate(rows, SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=[]))
    ids = prompts.to(device)
    mask = torch.ones_like(ids)
    extra = {"cache_implementation": "static"} if variant == "hf-static" else {}

    def run(n):
        with torch.inference_mode():
            return hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, **extra)

    return run


def profile_kernels(variant, batch, run_n, n_tokens, top=30):
    """GPU kernels of a generate call of ``n_tokens`` new tokens (prefill + decode steps), grouped by name:
    total and per-step microseconds, calls per step. Kernels replayed inside CUDA graphs are included."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_n(n_tokens)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in kernels.values())
    print(f"  profile {variant} batch {batch}: {n_tokens} new tokens, {sum(len(v) for v in kernels.values())} "
          f"kernels, {total / 1e3:.2f} ms of GPU time ({total / n_tokens:.1f} us per token)")
    if variant == "ours-fused-graph":
        from zero2all.kernels.decode import tuned_configs

        for key, cfg in tuned_configs().items():
            print(f"    tuned {key}: {cfg}")
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, times in rows:
        print(f"    {sum(times) / n_tokens:8.1f} us/step  {len(times) / n_tokens:6.1f} calls/step  "
              f"{sum(times) / len(times):7.2f} us/call  {name[:110]}")


def fused_step_timeline(model, prompt_len, new_tokens, w_bytes, replays=20):
    """The fused step's CUDA graph at batch 1 (cache slot mid-generation), replayed back to back: its time per
    replay, and per kernel kind the "marginal" time, the end of a kernel minus the end of the one before it
    (kernels overlap through programmatic launch, so their own durations do not add up to the step; these do)."""
    from torch.profiler import ProfilerActivity, profile

    from zero2all.infer.fused_decode import graph_replay_ms
    from zero2all.infer.generate import DecodeSession
    from zero2all.kernels.decode import tuned_configs

    needed = prompt_len + new_tokens
    session = DecodeSession(model, 1, -(-needed // 128) * 128, cuda_graph=True, fused=True)
    session.prefill([[(7 * i) % model.cfg.vocab_size for i in range(prompt_len)]], 0)
    session.tokens.fill_(1)
    session.slot.fill_(prompt_len + new_tokens // 2)
    graph = session.graph
    per_replay = graph_replay_ms(graph, replays) * 1e3
    print(f"timeline: fused step graph at batch 1, slot {prompt_len + new_tokens // 2}: {per_replay:.1f} us per "
          f"replay ({w_bytes / per_replay / 1e6:.2f} TB/s of weights)")
    for key, cfg in tuned_configs().items():
        print(f"  tiles {key}: {cfg}")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    kinds = ["qkv (+norm)", "attention", "o", "gate|up (+norm)", "down (+swiglu)"] * model.cfg.n_layers
    kinds.append("lm head (+norm)")
    if len(kernels) != replays * len(kinds):
        print(f"  ({len(kernels)} kernels for {replays} replays, expected {replays * len(kinds)}: no table)")
        return
    marginal: dict[str, float] = {}
    for r in range(1, replays):  # the first replay's start has no previous kernel to measure from
        for i in range(len(kinds)):
            k = r * len(kinds) + i
            marginal[kinds[i]] = marginal.get(kinds[i], 0.0) + (kernels[k].time_range.end -
                                                                 kernels[k - 1].time_range.end)
    _, w_qkv, _, w_o, _, _, w_gu, w_down = session.fused.layers[0]
    weights = dict(zip(kinds[:5], (w_qkv, None, w_o, w_gu, w_down)), **{kinds[-1]: session.fused.lm_head})
    for kind, total in marginal.items():
        per_step = total / (replays - 1)
        calls = kinds.count(kind)
        w = weights[kind]
        nbytes = 0 if w is None else w.numel() * w.element_size()
        rate = f"{nbytes * calls / per_step / 1e6:5.2f} TB/s" if nbytes else ""
        print(f"  {kind:18s} {per_step:7.1f} us/step  {per_step / calls:6.2f} us each  {rate}")


def print_row(r):
    extra = ""
    if "roofline_fraction" in r:
        extra = f"  roofline {100 * r['roofline_fraction']:5.1f} % (+kv {100 * r['roofline_fraction_with_kv']:5.1f} %)"
    if "peak_memory_gb" in r:
        extra += f"  peak {r['peak_memory_gb']:.1f} GB"
    print(f"  {r['variant']:20s} batch {r['batch']:3d}: {r['new_tok_per_s']:9.1f} new tok/s  "
          f"{r['ms_per_step']:7.2f} ms/step  {r['achieved_bytes_per_s'] / 1e12:5.2f} TB/s{extra}", flush=True)


def print_table(results, bandwidth):
    if not results:
        return
    head = "| variant | batch | new tok/s | ms/step |" + (" roofline | roofline +kv |" if bandwidth else "")
    print("\n" + head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        line = f"| {r['variant']} | {r['batch']} | {r['new_tok_per_s']:.1f} | {r['ms_per_step']:.2f} |"
        if bandwidth:
            line += f" {100 * r['roofline_fraction']:.1f} % | {100 * r['roofline_fraction_with_kv']:.1f} % |"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
