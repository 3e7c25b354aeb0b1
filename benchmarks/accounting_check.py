"""Check ``zero2all.accounting``'s predictions against a real training step: memory by part and step time.

Builds the model of a preset on a device, trains a few steps on random tokens (bf16 autocast unless
``--precision fp32``, AdamW -- fused on CUDA) and prints predicted vs measured:

- weights + gradients + optimizer states (CUDA: allocated memory after ``optimizer.step()`` with gradients still
  alive; CPU: the bytes of every parameter, gradient and optimizer-state tensor),
- activations (what autograd saves for backward, through saved_tensors_hooks, and on CUDA also the allocated
  memory a forward adds), autocast's bf16 weight copies separately,
- peak memory of a step (CUDA only),
- step time: the prediction at ``--mfu`` against the median measured step, and the measured MFU.

    python benchmarks/accounting_check.py --config z2all-1.1b --device cuda --micro-batch 8 --steps 6
    python benchmarks/accounting_check.py --config tiny --device cpu --micro-batch 4 --seq 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from zero2all import accounting as acc
from zero2all.config import load_config
from zero2all.fileio import save_json
from zero2all.model.z2all import build_model


def _fused_ops_available() -> dict:
    """Which fused kernels exist in this tree (the switchboard imports them lazily)."""
    import importlib

    found = {}
    for name in ("rmsnorm", "swiglu", "rope", "cross_entropy"):
        try:
            importlib.import_module(f"zero2all.kernels.{name}")
            found[name] = True
        except ImportError:
            found[name] = False
    return found


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def run_check(config: str = "tiny", device: str = "cpu", micro_batch: int | None = None, seq_len: int | None = None,
              steps: int = 3, mfu_fraction: float = 0.4, peak_flops: float | None = None,
              precision: str = "bf16-amp", overrides: list[str] | None = None, seed: int = 0,
              ops: str = "auto") -> dict:
    """Run the check and return {"predicted": ..., "measured": ..., ...} (all sizes in bytes, times in s).

    ``ops="auto"`` uses the fused kernels present in the tree on CUDA; ``"torch"`` forces the plain ops."""
    dev = torch.device(device)
    cfg = load_config(config, overrides)
    mcfg = cfg.model
    have = _fused_ops_available() if dev.type == "cuda" and ops == "auto" else {}
    # on CPU (and for any kernel that does not exist yet) run the plain PyTorch ops
    for name in ("rmsnorm", "swiglu", "rope"):
        if not have.get(name):
            setattr(mcfg.ops, name, "torch")
    if not have.get("cross_entropy"):
        mcfg.ops.cross_entropy = "torch"
    if not (have.get("rmsnorm") and have.get("swiglu")):  # the lean fused linears are built on both kernels
        mcfg.ops.fused_linear = "torch"
    fused_kernels = mcfg.ops.rmsnorm != "torch" and mcfg.ops.swiglu != "torch"
    fused_ce = mcfg.ops.cross_entropy != "torch"
    fused_linear = mcfg.ops.fused_linear != "torch"
    B = micro_batch or cfg.train.micro_batch_size
    T = seq_len or cfg.data.seq_len or mcfg.max_seq_len
    if T > mcfg.max_seq_len:
        raise SystemExit(f"--seq {T} exceeds model.max_seq_len {mcfg.max_seq_len}")
    amp_dtype = None if precision == "fp32" else torch.bfloat16

    model = build_model(mcfg, device=dev, seed=seed)
    n_params = model.num_params()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=dev.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def batch():
        x = torch.randint(0, mcfg.vocab_size, (B, T + 1), generator=gen).to(dev)
        return x[:, :-1], x[:, 1:]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def train_step():
        tokens, targets = batch()
        with torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            _, loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        return loss

    # --- warm-up step: creates the optimizer states; then weights + grads + optimizer, counted two ways:
    # the bytes of every parameter, gradient and optimizer-state tensor, and (CUDA) the allocator's total, which also
    # holds the batch, RoPE tables and library workspaces
    train_step()
    sync()
    state_tensors = [t for s in optimizer.state.values() for t in s.values()]
    states_tensor_bytes = (_tensor_bytes(model.parameters()) + _tensor_bytes(p.grad for p in model.parameters())
                           + _tensor_bytes(state_tensors))
    states_allocated = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    optimizer.zero_grad(set_to_none=True)

    # --- timed steps; on CUDA their peak allocated memory is the step's peak -----------------------------------------
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(max(1, steps)):
        sync()
        t0 = time.perf_counter()
        train_step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    step_measured = statistics.median(times)
    peak_measured = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None

    # --- activations: saved tensors (any device) and, on CUDA, what one forward adds to allocated memory ---------
    tokens, targets = batch()
    saved = acc.saved_activation_bytes(model, tokens, targets, amp_dtype)
    forward_allocated = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        with torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits, loss = model(tokens, targets)
        torch.cuda.synchronize(dev)
        forward_allocated = torch.cuda.memory_allocated(dev) - base
        del logits, loss

    # --- predictions -------------------------------------------------------------------------------------------------
    layout = dict(n_gpus=1, precision=precision, zero=0, tp=1, pp=1, grad_accum_steps=1, recompute="none",
                  sequence_parallel=False, fused_kernels=fused_kernels, fused_cross_entropy=fused_ce,
                  fused_linear=fused_linear)
    predicted = acc.peak_memory_bytes(mcfg, B, T, **layout)  # model states, weight copies, logits
    # CPU SDPA repeats K/V heads for grouped-query attention (CUDA kernels read them in place)
    per_layer = acc.activation_bytes_per_token_per_layer(mcfg, precision, fused_kernels=fused_kernels,
                                                         fused_linear=fused_linear,
                                                         kv_repeated=dev.type == "cpu")["total"]
    head = acc.head_activation_bytes_per_token(mcfg, precision, fused_ce, fused_kernels)["total"]
    activations_pred = B * T * (mcfg.n_layers * per_layer + head)
    logits_fwd_pred = 0 if fused_ce else B * T * mcfg.padded_vocab_size * (2 if amp_dtype else 4)
    if peak_flops is None and dev.type == "cuda":
        peak_flops = acc.peak_flops_for_device_name(torch.cuda.get_device_name(dev))
    tokens_per_s = B * T / step_measured
    result = {
        "config": config, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "micro_batch": B, "seq_len": T, "params": n_params, "precision": precision,
        "ops": {"fused_kernels": fused_kernels, "fused_cross_entropy": fused_ce, "fused_linear": fused_linear,
                "attention": mcfg.ops.attention},
        "predicted": {
            "model_states": predicted["model_states"],
            "model_states_allocated": predicted["model_states"],
            "activations": activations_pred,
            "weight_copies": predicted["weight_copies"],
            "forward_allocated": activations_pred + predicted["weight_copies"] + logits_fwd_pred,
            "peak": predicted["total"] - predicted["activations"] + activations_pred,
            "step_seconds": (acc.step_seconds(mcfg, B * T, T, 1, peak_flops, mfu_fraction) if peak_flops else None),
        },
        "measured": {
            "model_states": states_tensor_bytes,
            "model_states_allocated": states_allocated,
            "activations": saved["activations"],
            "weight_copies": saved["weight_copies"],
            "forward_allocated": forward_allocated,
            "peak": peak_measured,
            "step_seconds": step_measured,
            "tokens_per_second": tokens_per_s,
            "mfu": acc.mfu(tokens_per_s, mcfg, T, peak_flops) if peak_flops else None,
        },
        "mfu_assumed": mfu_fraction, "peak_flops": peak_flops,
    }
    return result


def format_check(r: dict) -> str:
    pred, meas = r["predicted"], r["measured"]
    lines = [f"{r['config']} on {r['device_name']} (torch {r['torch']}), micro-batch {r['micro_batch']} x seq "
             f"{r['seq_len']}, {r['params']:,} parameters, {r['precision']}, fused kernels {r['ops']['fused_kernels']},"
             f" fused loss {r['ops']['fused_cross_entropy']}, attention {r['ops']['attention']}",
             f"{'quantity':34s} {'predicted':>14s} {'measured':>14s} {'error':>9s}"]

    def row(name, key, scale=1e6, unit="MB"):
        p, m = pred.get(key), meas.get(key)
        ps = f"{p / scale:,.2f} {unit}" if p is not None else "n/a"
        ms = f"{m / scale:,.2f} {unit}" if m is not None else "n/a"
        err = f"{(p - m) / m * 100:+.2f} %" if p is not None and m else ""
        lines.append(f"{name:34s} {ps:>14s} {ms:>14s} {err:>9s}")

    row("weights + grads + AdamW (tensors)", "model_states")
    row("  same, allocator after step", "model_states_allocated")
    row("activations (saved for backward)", "activations")
    row("autocast bf16 weight copies", "weight_copies")
    row("allocated by one forward", "forward_allocated")
    row("peak of a step", "peak")
    row(f"step time (pred. at MFU {r['mfu_assumed']:.0%})", "step_seconds", 1e-3, "ms")
    lines.append(f"measured throughput {meas['tokens_per_second']:,.0f} tokens/s"
                 + (f", MFU {meas['mfu'] * 100:.1f} % of {r['peak_flops'] / 1e12:.0f} TFLOP/s"
                    if meas["mfu"] is not None else " (no peak FLOP/s known for this device: pass --peak-flops)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up (median reported)")
    ap.add_argument("--mfu", type=float, default=0.4, help="MFU assumed for the predicted step time")
    ap.add_argument("--peak-flops", type=float, default=None, help="device peak FLOP/s (default: from GPU name)")
    ap.add_argument("--precision", default="bf16-amp", choices=["bf16-amp", "fp32"])
    ap.add_argument("--ops", default="auto", choices=["auto", "torch"],
                    help="auto: the fused kernels present in the tree (CUDA only); torch: plain PyTorch ops")
    ap.add_argument("--json", default=None, help="also write the result to this JSON file")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.n_layers=2")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    r = run_check(args.config, args.device, args.micro_batch, args.seq, args.steps, args.mfu, args.peak_flops,
                  args.precision, args.overrides, ops=args.ops)
    print(format_check(r))
    if args.json:
        save_json(r, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
