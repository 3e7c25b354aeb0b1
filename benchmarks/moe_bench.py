"""MoE benchmarks in one invocation: training throughput of the z2all-moe-1b preset against HF Mixtral at the same
shape, the grouped GEMM against a dense GEMM of equal FLOPs, and a demo-size pretraining run's expert load.

    python benchmarks/moe_bench.py --out DIR [--parts train,gemm,balance] [--steps 6] [--micro-batch 4]

Training rows: fp32 master weights, bf16 autocast, fused AdamW, random tokens, seq 2048; median step time after
warm-up; MFU on active FLOPs: tokens/s * (6 N_active + 12 L H T) / 989e12 (N_active = non-embedding parameters a
token goes through: attention, router, top_k experts, LM head). Writes results.json, balance.png and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zero2all.accounting_moe import moe_param_counts  # noqa: E402
from zero2all.config import load_config  # noqa: E402
from zero2all.model.z2all import build_model  # noqa: E402

PEAK = 989e12


def sync():
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
    flops_tok = 6 * n_act + 12 * base.n_layers * base.hidden_dim * seq
    rows = [("ours triton", lambda: ours(["model.ops.grouped_gemm=triton"])),
            ("ours torch._grouped_mm", lambda: ours(["model.ops.grouped_gemm=torch"])),
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


def bench_gemm(args, results):
    from zero2all.kernels.grouped_gemm import grouped_swiglu_mlp

    cfg = load_config("z2all-moe-1b").model
    E, H, I, k = cfg.moe.n_experts, cfg.hidden_dim, cfg.expert_intermediate_size, cfg.moe.top_k
    M = 8 * 2048 * k  # one micro-batch of 8 x 2048 tokens, top-2
    g = torch.Generator().manual_seed(0)
    assign = torch.randint(0, E, (M,), generator=g)
    counts = torch.bincount(assign, minlength=E).cuda()
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    d1 = (torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    d2 = (torch.randn(H, I, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    dy = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    flops_fwd = 2 * M * H * 3 * I

    def dense():
        gate, up = F.linear(x, d1).chunk(2, -1)
        return F.linear(F.silu(gate) * up, d2)

    def timeit(fn, backward):
        for _ in range(3):
            y = fn()
            if backward:
                y.backward(dy)
        sync()
        ts = []
        for _ in range(10):
            t0 = time.perf_counter()
            y = fn()
            if backward:
                y.backward(dy)
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    variants = {"dense (equal FLOPs)": dense,
                "grouped triton": lambda: grouped_swiglu_mlp(x, counts, w1, w2, "triton"),
                "grouped torch._grouped_mm": lambda: grouped_swiglu_mlp(x, counts, w1, w2, "torch"),
                "loop": lambda: grouped_swiglu_mlp(x, counts, w1, w2, "loop")}
    ref = variants["loop"]().float()
    import zero2all.kernels.grouped_gemm as gg

    for blocks in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
                   (128, 64, 64, 4, 4), (128, 128, 32, 4, 4)]:
        gg.GPU_BLOCKS = blocks
        for backward in (False, True):
            try:
                t = timeit(variants["grouped triton"], backward)
                rec = {"variant": f"triton blocks {blocks}", "backward": backward, "ms": t * 1e3,
                       "tflops": flops_fwd * (3 if backward else 1) / t / 1e12}
            except Exception as e:
                rec = {"variant": f"triton blocks {blocks}", "error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(json.dumps(rec), flush=True)
            results["gemm"].append(rec)
    gg.GPU_BLOCKS = (128, 128, 64, 8, 3)
    for name, fn in variants.items():
        for backward in (False, True):
            try:
                t = timeit(fn, backward)
                fl = flops_fwd * (3 if backward else 1)
                rec = {"variant": name, "backward": backward, "ms": t * 1e3, "tflops": fl / t / 1e12}
                if not backward and name != "dense (equal FLOPs)":
                    out = fn().float()
                    rec["rel_err_vs_loop"] = float((out - ref).norm() / ref.norm())
            except Exception as e:
                rec = {"variant": name, "backward": backward, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps(rec), flush=True)
            results["gemm"].append(rec)
    results["gemm_meta"] = {"rows": M, "experts": E, "hidden": H, "expert_intermediate": I,
                            "counts_min_max": [int(counts.min()), int(counts.max())]}


def stdlib_bytes() -> torch.Tensor:
    """The Python standard library's source as a byte stream (the demo corpus, vocabulary 256)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "test" in p.parts:
            continue
        b = p.read_bytes()
        chunks.append(b)
        total += len(b)
        if total > 8_000_000:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def bench_balance(args, results, out: Path):
    from zero2all.model.moe import moe_layers, update_router_biases

    cfg = load_config("tiny-moe", ["model.vocab_size=256", "model.ops.grouped_gemm=torch"]).model
    model = build_model(cfg, device="cuda", seed=0)
    data = stdlib_bytes().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=True)
    mb, seq, steps, warm = 32, 256, args.balance_steps, args.balance_warmup
    layers = moe_layers(model)
    history, losses = [], []
    g = torch.Generator(device="cuda").manual_seed(0)
    for step in range(steps):
        lr = 2e-3 * min(1.0, (step + 1) / warm)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, data.numel() - seq - 1, (mb,), device="cuda", generator=g)
        idx = starts[:, None] + torch.arange(seq + 1, device="cuda")
        batch = data[idx]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loads = [moe.step_load.clone() for _, moe in layers]
        update_router_biases(model)
        history.append([(l.max() / l.mean()).item() for l in loads])
        losses.append(loss.item())
    after = [max(h) for h in history[warm:]]
    rec = {"steps": steps, "warmup": warm, "final_loss": losses[-1],
           "max_over_mean_after_warmup": {"median": statistics.median(after), "max": max(after),
                                          "p95": sorted(after)[int(0.95 * (len(after) - 1))]},
           "first_steps_max_over_mean": [max(h) for h in history[:5]]}
    print(json.dumps(rec), flush=True)
    results["balance"] = rec
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for j, (i, _) in enumerate(layers):
            ax.plot([h[j] for h in history], label=f"layer {i}", lw=1)
        ax.axhline(1.3, color="k", ls="--", lw=0.8, label="1.3")
        ax.axvline(warm, color="grey", ls=":", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("max / mean expert load")
        ax.set_title("tiny-moe on stdlib bytes, sigmoid router + bias balancing")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "moe_balance.png", dpi=120)
    except Exception as e:
        print("plot failed:", e)
    results["balance_history"] = history
    results["balance_losses"] = losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="gemm,train,balance")
    ap.add_argument("--rows", default="")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--balance-steps", type=int, default=400)
    ap.add_argument("--balance-warmup", type=int, default=100)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    results = {"train": [], "gemm": [], "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps({k: results[k] for k in ("device", "torch", "transformers")}), flush=True)
    for part in args.parts.split(","):
        t0 = time.time()
        parts = {"gemm": bench_gemm, "train": bench_train, "balance": lambda a, r: bench_balance(a, r, out)}
        parts[part](args, results)
        print(f"# {part} took {time.time() - t0:.0f}s", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
