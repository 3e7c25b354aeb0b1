"""Time the FP8 cast kernels (``zero2all/kernels/fp8.py``) at z2all-1.1b's shapes against their byte time.

For each operand of a block's linears (micro-batch 8 x 2048 tokens: activations and gradients in bf16, weights in
float32) and each cast the training step makes of it, prints the median time, the bytes moved (the operand read
once, the FP8 copies written) and the achieved bandwidth. With ``--sweep`` it also tries other tile shapes, and
with ``--baseline FILE`` it times a second implementation of ``quantize`` (another fp8.py) the same way.

    python benchmarks/fp8_cast_bench.py [--sweep] [--baseline old_fp8.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

import torch
from triton.testing import do_bench

from zero2all.kernels import fp8
from zero2all.kernels.fp8_ref import E4M3, E5M2

TOKENS, D, QKV, FFN = 8 * 2048, 2048, 2560, 5632

# (name, shape, dtype, fp8 format, scaling, want_q, want_qt)
CASES = [
    ("x rowwise fwd (M x 2048)", (TOKENS, D), torch.bfloat16, E4M3, "axis", True, False),
    ("a rowwise fwd (M x 5632)", (TOKENS, FFN), torch.bfloat16, E4M3, "axis", True, False),
    ("W rowwise fwd (11264 x 2048 fp32)", (2 * FFN, D), torch.float32, E4M3, "axis", True, False),
    ("g qkv q+qT (M x 2560)", (TOKENS, QKV), torch.bfloat16, E4M3, "axis", True, True),
    ("g gate_up q+qT (M x 11264)", (TOKENS, 2 * FFN), torch.bfloat16, E4M3, "axis", True, True),
    ("x qT bwd (M x 2048)", (TOKENS, D), torch.bfloat16, E4M3, "axis", False, True),
    ("a qT bwd (M x 5632)", (TOKENS, FFN), torch.bfloat16, E4M3, "axis", False, True),
    ("W qT bwd (11264 x 2048 fp32)", (2 * FFN, D), torch.float32, E4M3, "axis", False, True),
    ("W qT bwd (2048 x 5632 fp32)", (D, FFN), torch.float32, E4M3, "axis", False, True),
    ("g gate_up tensorwise q+qT", (TOKENS, 2 * FFN), torch.bfloat16, E5M2, "tensor", True, True),
    ("x tensorwise q fwd", (TOKENS, D), torch.bfloat16, E4M3, "tensor", True, False),
]


def bytes_moved(shape, dtype, want_q, want_qt):
    n = shape[0] * shape[1]
    return n * torch.finfo(dtype).bits // 8 + n * (int(want_q) + int(want_qt))


def time_all(quantize, label):
    total = 0.0
    for name, shape, dtype, f8, scaling, wq, wqt in CASES:
        x = torch.randn(shape, device="cuda", dtype=torch.float32).to(dtype)
        ms = do_bench(lambda: quantize(x, f8, scaling, wq, wqt), warmup=10, rep=50)
        gb = bytes_moved(shape, dtype, wq, wqt) / 1e9
        total += ms
        print(f"{label:10s} {name:36s} {ms * 1e3:8.1f} us  {gb * 1e3:7.1f} MB  {gb / ms:6.2f} TB/s", flush=True)
    print(f"{label:10s} {'sum':36s} {total * 1e3:8.1f} us", flush=True)
    return total


def time_fused():
    """The casts made inside their producers against producer + separate cast."""
    import triton

    from zero2all.kernels.rmsnorm import _add_rmsnorm_fwd_kernel, _warps
    from zero2all.kernels.swiglu import triton_swiglu

    gu = torch.randn(TOKENS, 2 * FFN, device="cuda", dtype=torch.bfloat16)
    sep = do_bench(lambda: fp8.quantize(triton_swiglu(gu), E4M3, "axis"), warmup=10, rep=50)
    fused = do_bench(lambda: fp8.quantize_swiglu(gu, torch.bfloat16), warmup=10, rep=50)
    a, b = fp8.quantize(triton_swiglu(gu), E4M3, "axis"), fp8.quantize_swiglu(gu, torch.bfloat16)
    same = torch.equal(a.q.float(), b.q.float()) and torch.equal(a.q_scale, b.q_scale)
    print(f"swiglu + rowwise cast (M x 11264): separate {sep * 1e3:.1f} us, fused {fused * 1e3:.1f} us, "
          f"bit-exact {same}", flush=True)
    x, res = (torch.randn(TOKENS, D, device="cuda", dtype=t) for t in (torch.bfloat16, torch.float32))
    w = torch.ones(D, device="cuda")
    res_out, rstd, yhat = torch.empty_like(res), torch.empty(TOKENS, device="cuda"), torch.empty_like(x)
    warps, block = _warps(triton.next_power_of_2(D)), triton.next_power_of_2(D)

    def separate():
        normed = torch.empty_like(x)
        _add_rmsnorm_fwd_kernel[(TOKENS,)](x, res, w, normed, res_out, rstd, yhat, D, 1e-5, HAS_RESIDUAL=True,
                                           BLOCK=block, WRITE_Y=True, num_warps=warps)
        return fp8.quantize(normed, E4M3, "axis")

    sep = do_bench(separate, warmup=10, rep=50)
    fused = do_bench(lambda: fp8.norm_quantize(x, res, w, 1e-5, res_out, rstd, yhat, torch.bfloat16, warps),
                     warmup=10, rep=50)
    a = separate()
    y1 = yhat.clone()
    b = fp8.norm_quantize(x, res, w, 1e-5, res_out, rstd, yhat, torch.bfloat16, warps)
    same = torch.equal(a.q.float(), b.q.float()) and torch.equal(a.q_scale, b.q_scale) and torch.equal(y1, yhat)
    print(f"add + rmsnorm + rowwise cast (M x 2048): separate {sep * 1e3:.1f} us, fused {fused * 1e3:.1f} us, "
          f"bit-exact {same}", flush=True)


def check_exact():
    """The kernels on the GPU against quantize_torch, bit for bit, on odd shapes (a multi-band, multi-split grid)."""
    from zero2all.kernels.fp8_ref import quantize_torch

    bad = 0
    for shape in ((1000, 1030), (4099, 300), (17, 5000)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 3, shape[0],
                                                                                       device="cuda")[:, None]
        for f8 in (E4M3, E5M2):
            for scaling, wq, wqt in (("axis", True, False), ("axis", True, True), ("axis", False, True),
                                     ("tensor", True, True)):
                got, want = fp8.quantize(x, f8, scaling, wq, wqt), quantize_torch(x, f8, scaling, wq, wqt)
                for name in ("q", "q_scale", "qt", "qt_scale", "counts"):
                    a, b = getattr(got, name), getattr(want, name)
                    if a is not None and not torch.equal(a.float(), b.float()):
                        bad += 1
                        print(f"MISMATCH {shape} {f8} {scaling} {wq} {wqt} {name}", flush=True)
    print(f"bit-exact check on GPU: {'ok' if not bad else f'{bad} mismatches'}", flush=True)
    return not bad


def choose(out_path):
    """Check the hardware-rounding kernels bit for bit (else fall back to the float32 rounding), time the tile
    shapes of the transposed cast, and write the choice as JSON."""
    import json

    native = check_exact()
    if not native:
        fp8.NATIVE_CAST = False
        check_exact()
    best = None
    for bm, bk, warps in [(128, 128, 8), (64, 128, 4), (64, 64, 4)]:
        fp8.TILE = {"BM": bm, "BK": bk, "num_warps": warps}
        total = time_all(fp8.quantize, f"{bm}x{bk}w{warps}")
        if best is None or total < best[0]:
            best = (total, dict(fp8.TILE))
    time_fused()
    with open(out_path, "w") as f:
        json.dump({"native": fp8.NATIVE_CAST, "tile": best[1]}, f)
    print("chosen:", {"native": fp8.NATIVE_CAST, "tile": best[1]}, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--baseline", default="")
    p.add_argument("--choose", default="", help="check, time the tile shapes, write the choice (JSON) here")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if args.choose:
        return choose(args.choose)
    check_exact()
    if args.baseline:
        spec = importlib.util.spec_from_file_location("fp8_baseline", args.baseline)
        base = importlib.util.module_from_spec(spec)
        sys.modules["fp8_baseline"] = base
        spec.loader.exec_module(base)
        time_all(base.quantize, "baseline")
    time_all(fp8.quantize, "current")
    time_fused()
    if args.sweep:
        default = dict(fp8.TILE)
        for bm, bk, warps in [(128, 128, 4), (64, 128, 4), (128, 64, 4), (64, 64, 4), (256, 64, 8)]:
            fp8.TILE = {"BM": bm, "BK": bk, "num_warps": warps}
            time_all(fp8.quantize, f"{bm}x{bk}w{warps}")
        fp8.TILE = default
        for tile in (4096, 16384):
            fp8.ROWWISE_TILE = tile
            time_all(fp8.quantize, f"row{tile}")


if __name__ == "__main__":
    main()
