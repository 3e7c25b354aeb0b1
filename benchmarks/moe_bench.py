"""MoE benchmarks in one invocation: training throughput of the z2all-moe-1b preset against HF Mixtral at the same
shape, the grouped GEMM against a dense GEMM of equal FLOPs, and a demo-size pretraining run's expert load.

    python benchmarks/moe_bench.py --out DIR [--parts train,gemm,balance] [--steps 6] [--micro-batch 4]
    python benchmarks/moe_bench.py --out DIR --parts balance [--balance-variants "OVERRIDES;..."]
        [--balance-steps 400 --balance-warmup 100 --balance-micro-batch 32 --balance-seq 256 --balance-seed 0]

Training rows: fp32 master weights, bf16 autocast, fused AdamW, random tokens, seq 2048; median step time after
warm-up; MFU on active FLOPs: tokens/s * (6 N_active + 6 L H T) / 989e12 (N_active = non-embedding parameters a
token goes through: attention, router, top_k experts, LM head). Writes results.json, balance.png and prints a table.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zero2all.accounting import mfu_flops_per_token  # noqa: E402
from zero2all.accounting.moe import moe_param_counts  # noqa: E402
from zero2all.config import load_config  # noqa: E402
from zero2all.model.z2all import build_model  # noqa: E402

PEAK = 989e12


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_train(model, cfg, mb, seq, steps, warmup=3, call=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (mb, seq), device="cuda")
        sync()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = call(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 1e9, float(loss)


def ours(cfg_over, compile_=False):
    cfg = load_config("z2all-moe-1b", cfg_over).model
    model = build_model(cfg, device="cuda", seed=0)
    if compile_:
        for b in model.layers:
            b.compile()
    return model, cfg, lambda m, x: m(x, x)[1]


def hf_mixtral(cfg, impl, compile_=False):
    from transformers import MixtralConfig, MixtralForCausalLM

    hc = MixtralConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_dim,
                       intermediate_size=cfg.expert_intermediate_size,
                       num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                       num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
                       num_local_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.top_k,
                       router_aux_loss_coef=cfg.moe.aux_loss_coef, output_router_logits=True,
                       rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False)
    hc._attn_implementation = "sdpa"
    model = MixtralForCausalLM._from_config(hc, attn_implementation="sdpa", experts_implementation=impl)
    model = model.cuda()
    if compile_:
        for b in model.model.layers:
            b.compile()
    return model, cfg, lambda m, x: m(input_ids=x, labels=x).loss


def bench_train(args, results):
    seq, mb = 2048, args.micro_batch
    base = load_config("z2all-moe-1b").model
    n_act = moe_param_counts(base).active_non_embedding  # N_active of the MFU formula (LM head counts)
    flops_tok = mfu_flops_per_token(base, seq)  # 6 N_active + 6 L H T
    rows = [("ours triton", lambda: ours(["model.ops.grouped_gemm=triton"])),
            ("ours torch._grouped_mm", lambda: ours(["model.ops.grouped_gemm=torch"])),
            ("ours triton, sigmoid router", lambda: ours(["model.ops.grouped_gemm=triton", "model.moe.router=sigmoid",
                                                           "model.moe.aux_loss_coef=0"])),
            ("ours triton, sigmoid router, balance_iters 8",
             lambda: ours(["model.ops.grouped_gemm=triton", "model.moe.router=sigmoid", "model.moe.aux_loss_coef=0",
                           "model.moe.balance_iters=8"])),
            ("HF Mixtral eager experts", lambda: hf_mixtral(base, "eager")),
            ("HF Mixtral grouped_mm", lambda: hf_mixtral(base, "grouped_mm")),
            ("ours triton + compile", lambda: ours(["model.ops.grouped_gemm=triton"], True)),
            ("ours torch._grouped_mm + compile", lambda: ours(["model.ops.grouped_gemm=torch"], True)),
            ("HF Mixtral grouped_mm + compile",
             lambda: hf_mixtral(base, "grouped_mm", True))]
    for name, make in rows:
        if args.rows and not any(r in name for r in args.rows.split(",")):
            continue
        try:
            t_start = time.time()
            model, cfg, call = make()
            dt, mem, loss = time_train(model, cfg, mb, seq, args.steps, call=call)
            tps = mb * seq / dt
            rec = {"row": name, "step_ms": dt * 1e3, "tokens_per_s": tps, "mfu_active": tps * flops_tok / PEAK,
                   "peak_gb": mem, "loss": loss, "wall_s": time.time() - t_start}
        except Exception as e:  # a row that fails is reported, the others still run
            rec = {"row": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(rec), flush=True)
        results["train"].append(rec)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))  # kept if a later row hangs
        model = call = None
        gc.collect()
        torch.cuda.empty_cache()
    results["train_meta"] = {"micro_batch": mb, "seq": seq, "active_non_embedding_params": n_act,
                             "flops_per_token": flops_tok}


def timer(fn, reps, warmup=None):
    """Median / min / max ms of ``fn`` over ``reps`` calls queued back to back, each between two CUDA events
    (no host sync inside the timed region, so Python launch overhead hides behind the GPU as in training; on the
    CPU a host clock)."""
    for _ in range(warmup if warmup is not None else 5 if torch.cuda.is_available() else 1):
        fn()
    if not torch.cuda.is_available():
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    else:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        sync()
        for a, b in ev:
            a.record()
            fn()
            b.record()
        sync()
        ts = [a.elapsed_time(b) for a, b in ev]
    return statistics.median(ts), min(ts), max(ts)


def host_timer(fn, reps=10, warmup=3):
    """The earlier method: host clock around each call with a sync after it (includes launch overhead)."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), min(ts), max(ts)


def graph_timer(fn, reps):
    """Median ms of one CUDA-graph replay of ``fn`` (captured after a warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timer(graph.replay, reps)


GEMM_SWEEP = {  # per product: (block_n, block_k, warps, stages); smem per stage (bm bk + bk bn') * 2 bytes
    "gate_up": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (128, 32, 8, 4)],
    "down": [(256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 8, 4), (128, 64, 4, 4)],
    "dh": [(256, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4)],
    "dx": [(256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 8, 4)],
    "wgrad": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3)],
}


def swiglu_backward(dh, gate_up):
    """[dgate | dup] of h = silu(gate) * up."""
    gate, up = gate_up.chunk(2, -1)
    s = torch.sigmoid(gate)
    return torch.cat([dh * up * s * (1 + gate * (1 - s)), dh * gate * s], -1)


def bench_gemm(args, results):
    """Each product of the Triton grouped SwiGLU MLP timed alone over a sweep of launch configurations (pointer
    loads and TMA descriptors, checked against a torch reference), the best combined, then the whole MLP forward
    and forward+backward against a dense MLP of equal FLOPs, torch._grouped_mm and the per-expert loop."""
    import zero2all.kernels.grouped_gemm as gg
    from zero2all.kernels.grouped_gemm import grouped_swiglu_mlp

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    if args.gemm_small:  # a dry run of the script's logic (CPU interpreter)
        E, H, I, M = 4, 32, 32, 200
    else:
        cfg = load_config("z2all-moe-1b").model
        E, H, I, k = cfg.moe.n_experts, cfg.hidden_dim, cfg.expert_intermediate_size, cfg.moe.top_k
        M = 8 * 2048 * k  # one micro-batch of 8 x 2048 tokens, top-2
    reps = args.gemm_reps
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, E, (M,), generator=g), minlength=E).to(dev)
    x = torch.randn(M, H, device=dev, dtype=dt, requires_grad=True)
    w1 = (torch.randn(E, 2 * I, H, device=dev, dtype=dt) * 0.02).requires_grad_()
    w2 = (torch.randn(E, H, I, device=dev, dtype=dt) * 0.02).requires_grad_()
    d1 = (torch.randn(2 * I, H, device=dev, dtype=dt) * 0.02).requires_grad_()
    d2 = (torch.randn(H, I, device=dev, dtype=dt) * 0.02).requires_grad_()
    dy = torch.randn(M, H, device=dev, dtype=dt)
    flops_fwd = 2 * M * H * 3 * I
    base_cfg = dict(gg.GPU_CONFIG if dev == "cuda" else gg.INTERPRET_CONFIG)

    # the products alone: inputs and float32 references from per-expert torch matmuls
    xs, w1s, w2s = x.detach(), w1.detach(), w2.detach()
    gu = torch.randn(M, 2 * I, device=dev, dtype=dt)
    h = torch.randn(M, I, device=dev, dtype=dt)
    dgu = torch.randn(M, 2 * I, device=dev, dtype=dt)
    bounds = [0] + torch.cumsum(counts, 0).tolist()
    rows = [slice(bounds[e], bounds[e + 1]) for e in range(E)]
    ref = {"gate_up": torch.cat([xs[r].float() @ w1s[e, :I].float().T for e, r in enumerate(rows)]),
           "down": torch.cat([h[r].float() @ w2s[e].float().T for e, r in enumerate(rows)]),
           "dh": swiglu_backward(torch.cat([dy[r].float() @ w2s[e].float() for e, r in enumerate(rows)]), gu.float()),
           "dx": torch.cat([dgu[r].float() @ w1s[e].float() for e, r in enumerate(rows)]),
           "wgrad": torch.stack([dgu[r].float().T @ xs[r].float() for r in rows])}
    outs = {"gate_up": (torch.empty(M, I, device=dev, dtype=dt), torch.empty(M, 2 * I, device=dev, dtype=dt)),
            "down": torch.empty(M, H, device=dev, dtype=dt), "dh": torch.empty(M, 2 * I, device=dev, dtype=dt),
            "dx": torch.empty(M, H, device=dev, dtype=dt)}
    prod_flops = {"gate_up": 2 * M * H * 2 * I, "down": 2 * M * H * I, "dh": 2 * M * H * I, "dx": 2 * M * H * 2 * I,
                  "wgrad": 2 * M * H * 2 * I}

    def product(name, tiles):
        if name == "gate_up":
            return lambda: gg._grouped(xs, w1s, True, I, H, tiles, 1, outs[name][0], outs[name][1], "gate_up")
        if name == "down":
            return lambda: gg._grouped(h, w2s, True, H, I, tiles, 0, outs[name], which="down")
        if name == "dh":
            return lambda: gg._grouped(dy, w2s, False, I, H, tiles, 2, outs[name], gu, which="dh")
        if name == "dx":
            return lambda: gg._grouped(dgu, w1s, False, H, 2 * I, tiles, 0, outs[name], which="dx")
        return lambda: gg._weight_grad(dgu, xs, tiles[3], E, dt)

    def check(name, fn):
        """rel. L2 error of one call against the reference (gate_up: its gate half, before SwiGLU)."""
        got = fn()
        if name == "gate_up":
            got = outs[name][1][:, :I]
        return float((got.float() - ref[name]).norm() / ref[name].norm())

    best = dict(base_cfg)
    results["gemm_products"] = []
    for name, cands in GEMM_SWEEP.items():
        if args.gemm_small:
            cands = [(16, 16, 16, 1, 1) if name == "wgrad" else (16, 16, 1, 1)]
        trials = [(c, tma, 0) for c in cands for tma in ((False,) if name == "wgrad" else (False, True))]
        timed = []
        for c, tma, pers in trials:
            gg.GPU_CONFIG = gg.INTERPRET_CONFIG = {**best, name: c if name == "wgrad" else (*c, tma),
                                                   "persistent": pers}
            tiles = gg.expert_tiles(counts, best["block_m"], M)
            rec = {"product": name, "config": list(c), "tma": tma}
            try:
                fn = product(name, tiles)
                rec["rel_err"] = check(name, fn)
                ms = timer(fn, reps)
                rec.update(ms=ms[0], ms_min=ms[1], ms_max=ms[2], tflops=prod_flops[name] / ms[0] / 1e9)
                if rec["rel_err"] < 2e-2:
                    timed.append((ms[0], c, tma))
            except Exception as e:  # a configuration that does not fit is reported, the sweep goes on
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            print(json.dumps(rec), flush=True)
            results["gemm_products"].append(rec)
        if timed:
            _, c, tma = min(timed)
            best[name] = c if name == "wgrad" else (*c, tma)
    print(json.dumps({"best_products": best}), flush=True)

    def full(backward, impl="triton"):
        if not backward:
            return lambda: grouped_swiglu_mlp(xs, counts, w1s, w2s, impl)
        return lambda: torch.autograd.grad(grouped_swiglu_mlp(x, counts, w1, w2, impl), (x, w1, w2), dy)

    def dense(backward):
        def f():
            gate, up = F.linear(x if backward else xs, d1 if backward else d1.detach()).chunk(2, -1)
            y = F.linear(F.silu(gate) * up, d2 if backward else d2.detach())
            return torch.autograd.grad(y, (x, d1, d2), dy) if backward else y
        return f

    # whole-MLP configurations: the per-product winners, with group_m 1 / 8, persistent 1 / 2 per SM, block_m 64
    whole = {"best": best, "best group_m=1": {**best, "group_m": 1}, "best persistent=1": {**best, "persistent": 1},
             "best persistent=2": {**best, "persistent": 2}, "best block_m=64": {**best, "block_m": 64},
             "previous default (128x128x64, 8 warps, 3 stages)": {
                 "block_m": 128, "gate_up": (128, 64, 8, 3, False), "down": (128, 64, 8, 3, False),
                 "dh": (128, 64, 8, 3, False), "dx": (128, 64, 8, 3, False), "wgrad": (128, 128, 64, 8, 3),
                 "group_m": 1, "persistent": 0}}
    if args.gemm_small:
        whole = {"best": best, "best persistent=1": {**best, "persistent": 1}}
    ref_out = grouped_swiglu_mlp(xs, counts, w1s, w2s, "loop").float()
    fb = {}
    for label, conf in whole.items():
        gg.GPU_CONFIG = gg.INTERPRET_CONFIG = conf
        rec = {"variant": f"triton {label}"}
        try:
            rec["rel_err_vs_loop"] = float((full(False)().float() - ref_out).norm() / ref_out.norm())
            for backward in (False, True):
                ms = timer(full(backward), reps)
                rec["fwd_bwd" if backward else "fwd"] = [ms[0], ms[1], ms[2], flops_fwd * (3 if backward else 1)
                                                         / ms[0] / 1e9]
            fb[label] = rec["fwd"][0] + rec["fwd_bwd"][0]
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(rec), flush=True)
        results["gemm"].append(rec)
    chosen = whole[min(fb, key=fb.get)] if fb else base_cfg
    gg.GPU_CONFIG = gg.INTERPRET_CONFIG = chosen
    results["gemm_best_config"] = chosen
    print(json.dumps({"chosen_config": chosen}), flush=True)

    # the comparison, timed three ways: events back to back (median of reps), CUDA-graph replay, host clock
    variants = [("dense (equal FLOPs)", dense), ("grouped triton", lambda b: full(b, "triton")),
                ("grouped torch._grouped_mm", lambda b: full(b, "torch")), ("dense (again)", dense),
                ("grouped triton (again)", lambda b: full(b, "triton"))]
    if dev == "cuda":
        variants.append(("loop", lambda b: full(b, "loop")))
    for name, make in variants:
        rec = {"variant": name}
        for backward in (False, True):
            key = "fwd_bwd" if backward else "fwd"
            try:
                ms = timer(make(backward), reps if name != "loop" else 10)
                rec[key] = [ms[0], ms[1], ms[2], flops_fwd * (3 if backward else 1) / ms[0] / 1e9]
            except Exception as e:
                rec[key + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(rec), flush=True)
        results["gemm"].append(rec)
    summary = {r["variant"]: (r.get("fwd", [0])[0], r.get("fwd_bwd", [0])[0]) for r in results["gemm"]
               if "fwd" in r}
    d = summary.get("dense (equal FLOPs)")
    if d:
        for name, (f, fbw) in summary.items():
            if f and fbw:
                print(f"{name:62s} fwd {f:7.3f} ms {d[0] / f:5.2f}x dense | fwd+bwd {fbw:7.3f} ms {d[1] / fbw:5.2f}x",
                      flush=True)
    # the same, replayed from a CUDA graph (no launch gaps) and timed the earlier way (host clock, sync per call)
    if dev == "cuda":
        for name, make in variants[:5]:
            rec = {"variant": name}
            for backward in (False, True):
                key = "fwd_bwd" if backward else "fwd"
                try:
                    rec[key + "_host_ms"] = list(host_timer(make(backward)))
                    rec[key + "_graph_ms"] = list(graph_timer(make(backward), reps))
                except Exception as e:
                    rec[key + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(rec), flush=True)
            results["gemm_graph_host"] = results.get("gemm_graph_host", []) + [rec]
    results["gemm_meta"] = {"rows": M, "experts": E, "hidden": H, "expert_intermediate": I, "reps": reps,
                            "counts_min_max": [int(counts.min()), int(counts.max())]}


def stdlib_bytes() -> tuple[torch.Tensor, list[tuple[int, str]]]:
    """The Python standard library's source as a byte stream (the demo corpus, vocabulary 256), and the
    (start offset, file) of each file in it."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, files, total = [], [], 0
    for p in sorted(root.rglob("*.py")):
        if "test" in p.parts:
            continue
        b = p.read_bytes()
        chunks.append(b)
        files.append((total, str(p.relative_to(root))))
        total += len(b)
        if total > 8_000_000:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long(), files


def quantiles(values: list[float], threshold: float = 1.3) -> dict:
    s = sorted(values)
    return {"median": statistics.median(s), "p95": s[int(0.95 * (len(s) - 1))], "max": s[-1],
            "steps_over": sum(v > threshold for v in s)}


def balance_run(args, over: list[str]) -> dict:
    """One demo-size pretraining run: the per-step, per-layer max / mean expert load and the losses.

    Besides the loads of the whole step it records, per layer and step, how far the B windows of the batch
    disagree about the experts (``window_spread``: the mean over experts of the standard deviation across windows
    of the expert's share of a window's assignments, divided by 1/E), and for the worst steps which windows (and
    files) the overloaded expert's tokens came from. Training windows come from the first 95 % of the bytes, the
    evaluation batches (language-model loss alone, at the end) from the last 5 %."""
    from zero2all.model.moe import moe_aux_loss, moe_layers, update_router_biases

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = load_config("tiny-moe", ["model.vocab_size=256"] + over).model
    model = build_model(cfg, device=dev, seed=args.balance_seed)
    data, files = stdlib_bytes()
    offsets = [o for o, _ in files]
    data = data.to(dev)
    split = int(0.95 * data.numel())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    mb, seq, steps, warm = args.balance_micro_batch, args.balance_seq, args.balance_steps, args.balance_warmup
    E, k = cfg.moe.n_experts, cfg.moe.top_k
    layers = moe_layers(model)
    routed = {}  # layer -> (mb, seq * k) experts of the last forward
    for i, moe in layers:
        moe.router.register_forward_hook(lambda mod, inp, out, i=i: routed.__setitem__(i, out.experts.detach()))
    history, spread, losses, lm_losses, windows = [], [], [], [], []
    g = torch.Generator(device=dev).manual_seed(args.balance_seed)
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 2e-3 * min(1.0, (step + 1) / warm)
        starts = torch.randint(0, split - seq - 1, (mb,), device=dev, generator=g)
        batch = data[starts[:, None] + torch.arange(seq + 1, device=dev)]
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            _, loss = model(batch[:, :-1], batch[:, 1:])
        aux = moe_aux_loss(model)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loads = torch.stack([moe.step_load for _, moe in layers])
        update_router_biases(model)
        # per window: (layers, mb, E) counts -> shares; spread across windows in units of the balanced share 1/E
        per_window = torch.stack([F.one_hot(routed[i].view(mb, -1), E).sum(1) for i, _ in layers]).float()
        share = per_window / per_window.sum(-1, keepdim=True)
        spread.append((share.std(1).mean(-1) * E).tolist())
        history.append((loads.max(1).values / loads.mean(1)).tolist())
        losses.append(loss.item())
        lm_losses.append(losses[-1] - (aux.item() if aux is not None else 0.0))
        if step >= warm and max(history[-1]) > 1.3:  # which windows carry the overloaded expert
            j = max(range(len(layers)), key=lambda j: history[-1][j])
            e = int(loads[j].argmax())
            top = per_window[j, :, e].argsort(descending=True)[:4].tolist()
            windows.append({"step": step, "layer": layers[j][0], "expert": e, "load_max": history[-1][j],
                            "expert_tokens_per_window": per_window[j, :, e].int().tolist(),
                            "top_windows": [files[bisect.bisect_right(offsets, int(starts[w])) - 1][1] for w in top]})
    train_s = time.time() - t0
    model.eval()
    ge = torch.Generator(device=dev).manual_seed(1234)
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
        evals = []
        for _ in range(args.balance_eval_batches):
            starts = torch.randint(split, data.numel() - seq - 1, (mb,), device=dev, generator=ge)
            batch = data[starts[:, None] + torch.arange(seq + 1, device=dev)]
            evals.append(model(batch[:, :-1], batch[:, 1:])[1].item())
    after = [max(h) for h in history[warm:]]
    per_layer = {i: quantiles([h[j] for h in history[warm:]]) for j, (i, _) in enumerate(layers)}
    return {"overrides": over, "steps": steps, "warmup": warm, "micro_batch": mb, "seq": seq,
            "seed": args.balance_seed, "tokens_per_expert_per_step": mb * seq * k / E, "train_s": train_s,
            "final_loss_mean_last_20": statistics.mean(losses[-20:]),
            "lm_loss_mean_last_20": statistics.mean(lm_losses[-20:]),
            "eval_lm_loss": statistics.mean(evals) if evals else None,
            "max_over_mean_after_warmup": quantiles(after), "per_layer_after_warmup": per_layer,
            "window_spread_median_per_layer": {i: statistics.median(sp[j] for sp in spread[warm:])
                                               for j, (i, _) in enumerate(layers)},
            "first_steps": [max(h) for h in history[:5]], "history": history, "window_spread": spread,
            "spike_windows": windows, "losses": losses}


def bench_balance(args, results, out: Path):
    """The demo run for each balancing setting of ``--balance-variants`` (';'-separated override lists,
    ',' between overrides; empty = the preset as it is)."""
    results["balance"] = []
    for variant in args.balance_variants.split(";"):
        rec = balance_run(args, [o for o in variant.split(",") if o])
        results["balance"].append(rec)
        print(json.dumps({k: v for k, v in rec.items()
                          if k not in ("history", "losses", "window_spread", "spike_windows")}), flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    try:
        plot_balance(results["balance"], out / "moe_balance.png")
    except Exception as e:  # the numbers are in results.json; --plot-balance redraws it
        print("plot failed:", e)


def plot_balance(records: list[dict], path: Path) -> None:
    """Per step, the worst MoE layer's max / mean expert load of each balancing setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for rec in records:
        label = ", ".join(o.removeprefix("model.moe.") for o in rec["overrides"]) or "preset"
        ax.plot([max(h) for h in rec["history"]], label=label, lw=0.9)
    ax.axhline(1.3, color="k", ls="--", lw=0.8)
    ax.axvline(records[0]["warmup"], color="grey", ls=":", lw=0.8)
    ax.set_ylim(0.95, 4.1)
    ax.set_xlabel("step")
    ax.set_ylabel("worst layer's max / mean load")
    ax.set_title("tiny-moe on stdlib bytes: sigmoid router, aux-loss-free bias balancing", fontsize=9)
    ax.legend(fontsize=6.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="gemm,train,balance")
    ap.add_argument("--rows", default="")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--gemm-reps", type=int, default=50)
    ap.add_argument("--gemm-small", action="store_true", help="tiny shapes: a dry run of the gemm part on the CPU")
    ap.add_argument("--balance-steps", type=int, default=400)
    ap.add_argument("--balance-warmup", type=int, default=100)
    ap.add_argument("--balance-micro-batch", type=int, default=32)
    ap.add_argument("--balance-seq", type=int, default=256)
    ap.add_argument("--balance-variants", default="")
    ap.add_argument("--balance-seed", type=int, default=0, help="model initialisation and data order")
    ap.add_argument("--balance-eval-batches", type=int, default=8)
    ap.add_argument("--plot-balance", default="", help="redraw the balance plot from a results.json into --out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_balance:
        plot_balance(json.loads(Path(args.plot_balance).read_text())["balance"], out / "moe_balance.png")
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = {"device": device, "train": [], "gemm": [], "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if "train" in args.parts:
        import transformers

        results["transformers"] = transformers.__version__
    print(json.dumps({k: results.get(k) for k in ("device", "torch", "transformers")}), flush=True)
    for part in args.parts.split(","):
        t0 = time.time()
        parts = {"gemm": bench_gemm, "train": bench_train, "balance": lambda a, r: bench_balance(a, r, out)}
        parts[part](args, results)
        print(f"# {part} took {time.time() - t0:.0f}s", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
