"""Where a training step's peak GPU memory goes: static state, saved activations by kind, FP8 weight casts.

Builds a row of ``z2all bench train`` (same model, AdamW and batches), runs one warm-up update, then one update
in phases (forward / backward of each micro-batch, the optimizer step) with the peak reset at each phase's start,
and prints:

- static state: parameters, gradients (at the end of the last backward), AdamW's moments;
- the model's ``numerics.weight_casts`` (the FP8 copies of the weights held until the optimizer step);
- what autograd keeps from one micro-batch's forward, by storage (a view keeps its whole storage alive; the
  parameters a Function saves are not counted again), grouped by dtype and bytes per token, with the shapes seen;
- each phase's allocated memory at its start and its peak (the step's peak is the largest of them).

    python benchmarks/fp8_memory.py --rows use_all_fp8,use_all_fp8_tensorwise [--out DIR] [--tag T] [overrides...]

e.g. ``model.ops.fp8_weight_cache=transposed`` as an override (the bench rows take the FP8 options from it).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from pathlib import Path

import torch

GB = 1e9
DEVICE = "cuda"


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type != DEVICE:
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _cache_bytes(model) -> int:
    ts = []
    for entry in model.numerics.weight_casts._entries.values():
        q = entry[2]
        ts += [q.q, q.q_scale, q.qt, q.qt_scale]
    return _bytes(ts)


class SavedTensors:
    """A saved-tensors hook that records each saved tensor's storage once (parameters excluded)."""

    def __init__(self, param_ptrs: set, tokens: int):
        self.param_ptrs, self.tokens = param_ptrs, tokens
        self.seen: dict[int, tuple] = {}

    def pack(self, t):
        if isinstance(t, torch.Tensor) and t.device.type == DEVICE:
            s = t.untyped_storage()
            if s.data_ptr() not in self.param_ptrs and s.data_ptr() not in self.seen:
                self.seen[s.data_ptr()] = (s.nbytes(), str(t.dtype).replace("torch.", ""), tuple(t.shape))
        return t

    @staticmethod
    def unpack(t):
        return t

    def table(self) -> tuple[list[dict], int]:
        groups: dict[tuple, list] = collections.defaultdict(list)
        for nbytes, dtype, shape in self.seen.values():
            groups[(dtype, round(nbytes / self.tokens, 1))].append(shape)
        rows = []
        for (dtype, per_tok), shapes in sorted(groups.items(), key=lambda kv: -kv[0][1] * len(kv[1])):
            rows.append({"dtype": dtype, "bytes_per_token": per_tok, "count": len(shapes),
                         "gb": per_tok * self.tokens * len(shapes) / GB,
                         "shapes": sorted({str(s) for s in shapes})[:3]})
        return rows, sum(n for n, _, _ in self.seen.values())


def measure(row: str, base_cfg, micro_batch: int, seq: int, accum: int, log=print) -> dict:
    from zero2all.bench import _build_ours

    device = torch.device(DEVICE)
    torch.cuda.empty_cache()
    model, loss_fn = _build_ours(base_cfg, row, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    model.numerics.attach(opt)
    g = torch.Generator(device="cpu").manual_seed(1234)
    batches = [torch.randint(0, base_cfg.padded_vocab_size, (micro_batch, seq + 1), generator=g).to(device)
               for _ in range(accum)]
    params = list(model.parameters())
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    tokens = micro_batch * seq
    out = {"row": row, "micro_batch": micro_batch, "seq": seq, "accum": accum, "phases": []}

    def fwd(b):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            return loss_fn(b[:, :-1], b[:, 1:]) / accum

    for b in batches:                                   # warm-up update (allocates AdamW's state)
        fwd(b).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    def phase(name, fn):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        r = fn()
        torch.cuda.synchronize()
        out["phases"].append({"phase": name, "start_gb": start / GB, "peak_gb": torch.cuda.max_memory_allocated() / GB,
                              "end_gb": torch.cuda.memory_allocated() / GB})
        return r

    for i, b in enumerate(batches):
        if i == 0:
            hook = SavedTensors(param_ptrs, tokens)
            before = torch.cuda.memory_allocated()
            with torch.autograd.graph.saved_tensors_hooks(hook.pack, hook.unpack):
                loss = phase(f"forward {i}", lambda: fwd(b))
            out["forward_delta_gb"] = (torch.cuda.memory_allocated() - before) / GB
            rows, saved = hook.table()
            out["saved"], out["saved_gb"] = rows, saved / GB
            out["weight_casts_gb"] = _cache_bytes(model) / GB
        else:
            loss = phase(f"forward {i}", lambda: fwd(b))
        phase(f"backward {i}", loss.backward)
        del loss
    out["params_gb"] = _bytes(params) / GB
    out["grads_gb"] = _bytes([p.grad for p in params]) / GB
    out["weight_casts_end_gb"] = _cache_bytes(model) / GB
    phase("optimizer", opt.step)
    out["adam_state_gb"] = _bytes([t for s in opt.state.values() for t in s.values()
                                   if isinstance(t, torch.Tensor)]) / GB
    opt.zero_grad(set_to_none=True)
    out["step_peak_gb"] = max(p["peak_gb"] for p in out["phases"])
    peak_phase = max(out["phases"], key=lambda p: p["peak_gb"])
    out["peak_phase"] = peak_phase["phase"]
    model = opt = loss_fn = None
    torch.cuda.empty_cache()
    return out


def report(m: dict) -> str:
    lines = [f"== {m['row']} (mb {m['micro_batch']} x seq {m['seq']} x accum {m['accum']}): step peak "
             f"{m['step_peak_gb']:.2f} GB in '{m['peak_phase']}'",
             f"params {m['params_gb']:.2f} GB, grads {m['grads_gb']:.2f}, AdamW state {m['adam_state_gb']:.2f}, "
             f"FP8 weight casts {m['weight_casts_end_gb']:.2f}; forward of one micro-batch +"
             f"{m['forward_delta_gb']:.2f} GB, saved by autograd {m['saved_gb']:.2f} GB:"]
    for r in m["saved"]:
        lines.append(f"  {r['dtype']:>14} {r['bytes_per_token']:>9.1f} B/tok x {r['count']:>3} = {r['gb']:6.2f} GB"
                     f"  {' '.join(r['shapes'])}")
    for p in m["phases"]:
        lines.append(f"  {p['phase']:<12} start {p['start_gb']:6.2f}  peak {p['peak_gb']:6.2f}  end "
                     f"{p['end_gb']:6.2f} GB")
    return "\n".join(lines)


def main(argv=None) -> int:
    from zero2all.config import load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="use_all_fp8")
    p.add_argument("--config", default="z2all-1.1b")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--out", default=None, help="a folder for memory_ROW.json / .txt")
    p.add_argument("--tag", default="", help="appended to the output file names")
    p.add_argument("--quiet", action="store_true", help="print one line per row")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_memory: needs a CUDA GPU")
        return 2
    base = load_config(args.config, args.overrides).model
    base = dataclasses.replace(base, max_seq_len=max(base.max_seq_len, args.seq))
    for row in args.rows.split(","):
        m = measure(row, base, args.micro_batch, args.seq, args.accum)
        text = report(m)
        print(text.splitlines()[0] if args.quiet else text, flush=True)
        if args.out:
            d = Path(args.out)
            d.mkdir(parents=True, exist_ok=True)
            row = row + (f"_{args.tag}" if args.tag else "")
            (d / f"memory_{row}.json").write_text(json.dumps(m, indent=1))
            (d / f"memory_{row}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
