"""Host cost of one decode step of the paged engine against the column engine, on the CPU.

The model is so small (2 layers, hidden 64, vocabulary 260) that its arithmetic is negligible, so a step's wall
time is nearly all host work: Python, tensor construction, and the dispatch of each torch op. For each engine and
each row count (1, 16, 64 occupied rows) it times ``--steps`` decode steps ``--repeats`` times and prints per step:
the whole step, the bare model forward at the same shape (tokens (B, 1), no cache), and the difference (the
engine's own host cost: cache addressing, attention over the cache, bookkeeping), min / median / max over repeats.
Then the same with the step itself replaced by a ready result ("outside the step"): what is left per step on the
host when the step is replayed from a CUDA graph (bookkeeping, uploads of the step's inputs, the logits' handling).

It also counts the torch ops one decode step dispatches (``torch.profiler`` on the CPU, operators at the top level
of the dispatcher only): on a GPU each of those is a launch costing the host ~5-10 us unless the step is replayed
from a CUDA graph, and unlike the times the counts are not noisy. With ``--profile`` it prints cProfile's top
functions of the paged step at the largest row count.

    PYTHONPATH=. python benchmarks/paged_host_overhead.py [--steps 50] [--repeats 7] [--rows 1 16 64] [--profile]

A CPU timing only: what it says about a GPU is the op count and the Python time, not the GPU step time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from zero2all.config import ModelConfig, OpsConfig
from zero2all.infer.generate import DecodeSession
from zero2all.infer.paged import PagedSession
from zero2all.model.z2all import build_model

PROMPT = 20        # tokens per row before decoding starts
MAX_LEN = 256


def tiny_model():
    cfg = ModelConfig(vocab_size=260, hidden_dim=64, intermediate_size=96, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=MAX_LEN, ops=OpsConfig.plain())
    return build_model(cfg, seed=0).eval()


class PagedEngine:
    name = "paged"

    def __init__(self, model, rows: int):
        self.s = PagedSession(model, rows, MAX_LEN)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 260, (PROMPT,), generator=g).tolist() for _ in range(rows)]
        self.tokens = self.s.prefill_rows(list(range(rows)), prompts).argmax(-1)

    def step(self):
        self.tokens = self.s.decode(self.tokens).argmax(-1)

    def stub_step(self):
        """What a CUDA graph replay leaves on the host: the step itself replaced by a ready result."""
        out = self.s._decode_step(self.s.bucket_for(len(self.s.rows)))
        self.s._decode_step = lambda bucket: out

    def reset(self):  # back to the prompt's end, so repeats time the same lengths
        for st in self.s.rows:
            del st.tokens[PROMPT:]
            st.computed = PROMPT
            del st.names[PROMPT // self.s.block_size:]


class ColumnEngine:
    name = "column"

    def __init__(self, model, rows: int):
        self.s = DecodeSession(model, rows, MAX_LEN, cuda_graph=False)
        self.tokens = self.s.prefill([[5] * PROMPT] * rows, 0).argmax(-1)
        self.slot = PROMPT

    def step(self):
        self.tokens = self.s.decode(self.tokens, self.slot).argmax(-1)
        self.slot += 1

    def stub_step(self):
        out = self.s.step_fn(self.s.windows[-1])
        self.s.step_fn = lambda window: out

    def reset(self):
        self.slot = PROMPT


@torch.inference_mode()
def time_steps(engine, steps: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        engine.reset()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        out.append((time.perf_counter() - t0) / steps)
    return out


@torch.inference_mode()
def time_forward(model, rows: int, steps: int, repeats: int) -> list[float]:
    tokens = torch.zeros(rows, 1, dtype=torch.long)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            model(tokens)[0][:, -1].float().argmax(-1)
        out.append((time.perf_counter() - t0) / steps)
    return out


@torch.inference_mode()
def count_ops(engine) -> int:
    engine.step()  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    # top-level ops only (an aten op called from inside another one is not a separate launch)
    return sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))


def fmt(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:7.3f} {statistics.median(xs) * 1e3:7.3f} {max(xs) * 1e3:7.3f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--profile", action="store_true", help="cProfile the paged step at the largest row count")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_model()
    print(f"torch {torch.__version__}, 1 thread; per step in ms: min median max over {args.repeats} repeats of "
          f"{args.steps} steps")
    print(f"{'engine':>7} {'rows':>4} | {'step':^23} | {'bare forward':^23} | {'step - forward (median)':^23} | ops"
          f" | {'outside the step':^23} | ops")
    for rows in args.rows:
        fwd = time_forward(model, rows, args.steps, args.repeats)
        fwd_ops = count_ops(type("F", (), {"step": lambda self: model(torch.zeros(rows, 1, dtype=torch.long))})())
        for cls in (ColumnEngine, PagedEngine):
            eng = cls(model, rows)
            t = time_steps(eng, args.steps, args.repeats)
            eng.reset()
            ops = count_ops(eng)
            over = [x - statistics.median(fwd) for x in t]
            eng.stub_step()   # the host's part around the step: all that runs per step when the step is a graph
            outside = time_steps(eng, args.steps, args.repeats)
            eng.reset()
            out_ops = count_ops(eng)
            print(f"{eng.name:>7} {rows:4d} | {fmt(t)} | {fmt(fwd)} | {fmt(over)} | {ops} (forward {fwd_ops}) | "
                  f"{fmt(outside)} | {out_ops}")
    if args.profile:
        eng = PagedEngine(model, max(args.rows))
        eng.reset()
        prof = cProfile.Profile()
        with torch.inference_mode():
            prof.enable()
            for _ in range(args.steps):
                eng.step()
            prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
