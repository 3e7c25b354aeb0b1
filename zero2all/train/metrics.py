"""Training metrics: MFU, peak memory, and where the numbers go (console, JSONL, TensorBoard, PNG, markdown).

MFU (model FLOPs utilisation) = achieved model FLOP/s / the device's peak, with the model FLOPs of a token
(Kaplan / PaLM): 6 * N for the matmuls of forward + backward (N = non-embedding parameters; the LM head counts)
plus 6 * L * H * T for the attention scores and values of a causal model (L layers, H hidden size, T sequence
length; half of the T x T products, the lower triangle the causal kernel computes)::

    MFU = tokens_per_s * (6 * N + 6 * L * H * T) / peak_flops

Recomputation is not counted (that would be hardware FLOPs utilisation). The formula itself lives in one place,
``zero2all.accounting.mfu``; this module only finds the peak and formats the numbers.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch

from zero2all.fileio import atomic_write, write_text


def detect_peak_flops(device: torch.device, configured: float = 0.0) -> float | None:
    """The device's dense bf16 peak (FLOP/s): ``configured`` when > 0, else looked up by GPU name; None on CPU or
    an unknown GPU (MFU is then not reported)."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    from zero2all.accounting import peak_flops_for_device_name  # the one GPU table

    return peak_flops_for_device_name(torch.cuda.get_device_name(device))


def compute_mfu(tokens_per_s: float, model_cfg, seq_len: int, peak_flops: float | None) -> float | None:
    """MFU as a fraction (0.42 = 42 %) of one device's peak, or None without a known peak."""
    if not peak_flops:
        return None
    from zero2all.accounting import mfu

    return float(mfu(tokens_per_s, model_cfg, seq_len, peak_flops))


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory since the last reset; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


def format_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def format_step_line(rec: dict) -> str:
    """One console line per logged step."""
    parts = [f"step {rec['step']:>6d}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.3e}",
             f"grad norm {rec['grad_norm']:.3f}", f"{rec['tokens_per_s']:,.0f} tok/s"]
    parts.append(f"MFU {100 * rec['mfu']:.1f}%" if rec.get("mfu") is not None else "MFU -")
    parts.append(f"{1000 * rec['step_time_s']:.0f} ms")
    parts.append(f"peak mem {rec['peak_mem_bytes'] / 2 ** 30:.2f} GiB")
    if rec.get("skipped"):
        parts.append(f"SKIPPED (non-finite gradients; {rec['skipped_total']} so far)")
    if "loss_scale" in rec:
        parts.append(f"scale {rec['loss_scale']:.0f}")
    for key in sorted(k for k in rec if k.startswith("train_")):  # the objective's own metrics (DPO rewards, ...)
        parts.append(f"{key[len('train_'):]} {rec[key]:.4g}")
    return " | ".join(parts)


class MetricsLogger:
    """Appends one JSON object per event to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Records have a ``kind`` (``train``, ``eval``, ``sample``, ``info``) and a ``step``. On resume,
    ``truncate_after(step)`` drops records a killed run wrote after its last checkpoint, so the file reads as one
    uninterrupted run.
    """

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, enabled: bool = True,
                 trackers: list[str] | None = None, project: str = "zero2all"):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        self.trackers = []          # train/trackers.py: W&B / MLflow runs, opened by open_trackers()
        self._tracker_names, self._project = list(trackers or []), project
        if enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:  # tensorboard not installed: JSONL only
                    SummaryWriter = None
                if SummaryWriter is not None:
                    self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))

    def truncate_after(self, step: int) -> int:
        """Rewrite metrics.jsonl keeping only records with step <= ``step``; returns how many were dropped."""
        if not self.enabled or not self.path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                dropped += 1
                continue
            if rec.get("step", 0) <= step:
                kept.append(line)
            else:
                dropped += 1
        write_text(self.path, "".join(line + "\n" for line in kept))
        return dropped

    def open_trackers(self, config: dict) -> None:
        """Start (or resume) the experiment trackers asked for and give them the run's config."""
        if not self.enabled or not self._tracker_names or self.trackers:
            return
        from zero2all.train.trackers import open_trackers

        self.trackers = open_trackers(self._tracker_names, self.out_dir, self._project, self.out_dir.name)
        for t in self.trackers:
            t.config(config)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": time.time(), **record}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        for t in self.trackers:
            t.log(record)
        if self._tb is not None:
            kind, step = record.get("kind", "train"), record.get("step", 0)
            for key, value in record.items():
                if key in ("time", "step", "kind") or isinstance(value, bool):
                    continue
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
                elif isinstance(value, str) and kind == "sample":
                    self._tb.add_text(f"sample/{key}", value, step)

    def close(self, artifacts: list[Path] | None = None, failed: bool = True) -> None:
        """Close TensorBoard and the trackers (after uploading ``artifacts``); a run closed without ``failed =
        False`` is marked failed in the trackers (it stopped on an error or a signal)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            if artifacts:
                t.artifacts([Path(p) for p in artifacts if p and Path(p).exists()])
            t.close(failed)

    def close_tensorboard(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str | Path) -> list[dict]:
    out = []
    p = Path(path)
    if p.exists():
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def plot_loss_curve(records: list[dict], path: str | Path, title: str = "") -> Path | None:
    """Training loss (raw and smoothed) and validation loss against step, saved as a PNG (written atomically)."""
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and math.isfinite(r["loss"])]
    evals = [(r["step"], r["loss"]) for r in records if r.get("kind") == "eval" and "loss" in r]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*train)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss")
    window = max(1, min(50, len(losses) // 20))
    if window > 1:  # trailing moving average
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, color="tab:blue", linewidth=1.6, label=f"train loss (mean of {window})")
    if evals:
        es, el = zip(*evals)
        ax.plot(es, el, "o-", color="tab:orange", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format="png")
    finally:
        plt.close(fig)
    return path


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return float("nan") if n == 0 else (s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2]))


def summarize(records: list[dict]) -> dict:
    """Numbers for the run report: first / last / best losses, median throughput (first logged step excluded,
    it includes warm-up), skipped steps."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval" and "loss" in r]  # not the bits-per-byte records
    steady = train[1:] if len(train) > 1 else train
    out: dict = {"steps": train[-1]["step"] if train else 0}
    if train:
        k = max(1, min(10, len(train) // 10))
        out["first_loss"] = train[0]["loss"]
        out["first_loss_mean"] = sum(r["loss"] for r in train[:k]) / k
        out["last_loss_mean"] = sum(r["loss"] for r in train[-k:]) / k
        out["mean_window"] = k
        out["median_tokens_per_s"] = _median([r["tokens_per_s"] for r in steady])
        out["median_step_time_s"] = _median([r["step_time_s"] for r in steady])
        mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
        out["median_mfu"] = _median(mfus) if mfus else None
        out["peak_mem_bytes"] = max(r["peak_mem_bytes"] for r in train)
        out["skipped_steps"] = train[-1].get("skipped_total", 0)
        out["tokens_seen"] = train[-1].get("tokens_seen", 0)
    if evals:
        out["first_eval_loss"] = evals[0]["loss"]
        out["last_eval_loss"] = evals[-1]["loss"]
        if "ppl" in evals[-1]:  # objectives whose loss is a per-token cross-entropy
            out["last_eval_ppl"] = evals[-1]["ppl"]
        best = min(evals, key=lambda r: r["loss"])
        out["best_eval_loss"], out["best_eval_step"] = best["loss"], best["step"]
    return out


def write_run_report(path: str | Path, header: dict, records: list[dict], samples: list[dict],
                     loss_png: str | None) -> Path:
    """A short markdown report: setup, results, samples, the loss curve (written atomically)."""
    s = summarize(records)
    lines = [f"# Run report: {header.get('name', '')}", ""]
    lines += ["## Setup", "", "| | |", "|---|---|"]
    for key, value in header.items():
        if key != "name":
            lines.append(f"| {key} | {value} |")
    lines += ["", "## Results", "", "| | |", "|---|---|"]
    if "first_loss" in s:
        k = s["mean_window"]
        lines.append(f"| steps | {s['steps']:,} |")
        lines.append(f"| tokens seen | {s['tokens_seen']:,} |")
        lines.append(f"| train loss, first {k} steps (mean) | {s['first_loss_mean']:.4f} |")
        lines.append(f"| train loss, last {k} steps (mean) | {s['last_loss_mean']:.4f} |")
        lines.append(f"| median tokens/s | {s['median_tokens_per_s']:,.0f} |")
        lines.append(f"| median step time | {1000 * s['median_step_time_s']:.1f} ms |")
        mfu = s["median_mfu"]
        lines.append(f"| median MFU | {'-' if mfu is None else f'{100 * mfu:.1f} %'} |")
        lines.append(f"| peak memory | {s['peak_mem_bytes'] / 2 ** 30:.2f} GiB |")
        lines.append(f"| skipped steps (non-finite gradients) | {s['skipped_steps']} |")
    if "last_eval_loss" in s:
        lines.append(f"| validation loss, first eval | {s['first_eval_loss']:.4f} |")
        ppl = f" (perplexity {s['last_eval_ppl']:.2f})" if "last_eval_ppl" in s else ""
        lines.append(f"| validation loss, last eval | {s['last_eval_loss']:.4f}{ppl} |")
        lines.append(f"| best validation loss | {s['best_eval_loss']:.4f} at step {s['best_eval_step']} |")
    if loss_png:
        lines += ["", "## Loss curve", "", f"![loss curve]({loss_png})"]
    if samples:
        lines += ["", f"## Samples (step {samples[0].get('step', '?')})", ""]
        for smp in samples:
            lines += [f"Prompt: `{smp['prompt']!r}`", "", "```", smp["prompt"] + smp["completion"], "```", ""]
    return write_text(path, "\n".join(lines) + "\n")


class NumericsMonitor:
    """Numerics per logging window, with a warning when a trend rises (watch the overflow ratio early, as it
    usually climbs before a run diverges).

    At the end of each window ``window(rec)`` adds to the step's record:

    * ``skip_ratio``: updates skipped for non-finite gradients (fp16 overflow) / updates in the window, and
      ``loss_scale`` where a loss scaler runs (fp16);
    * with FP8 linears, ``fp8_saturated_<kind>`` and ``fp8_underflow_<kind>`` for kind in qkv, o, gate_up, down:
      the fraction of elements cast in the window that landed on the format's largest value, or that were
      non-zero and became zero (counted by the cast kernels; one device-to-host read per window).

    A key's trend "rises" when each of its last ``patience`` windows is higher than the one before and the latest
    is at least twice the value ``patience`` windows earlier and above ``floor``; ``window`` returns one warning
    line per such key (once per rise).
    """

    def __init__(self, patience: int = 3, floor: float = 1e-4, fp8_stats=None):
        self.patience, self.floor = patience, floor
        self.fp8_stats = fp8_stats      # the trained model's FP8 saturation counts (kernels/numerics.py), or None
        self.history: dict[str, list[float]] = {}
        self._updates = self._skipped = 0
        self._warned: set[str] = set()

    def observe(self, rec: dict) -> None:
        """Count one update (every step, whether or not it ends a window)."""
        self._updates += 1
        self._skipped += bool(rec.get("skipped"))

    def window(self, rec: dict) -> list[str]:
        values = {"skip_ratio": self._skipped / max(self._updates, 1)}
        if self.fp8_stats is not None:
            values.update(self.fp8_stats.read())
        self._updates = self._skipped = 0
        rec.update(values)
        warnings = []
        for key, value in values.items():
            series = self.history.setdefault(key, [])
            series.append(value)
            del series[:-(self.patience + 1)]
            if self._rising(series):
                if key not in self._warned:
                    warnings.append(f"warning: {key} is rising: " + " -> ".join(f"{v:.3g}" for v in series)
                                    + f" over the last {self.patience} logging windows")
                    self._warned.add(key)
            else:
                self._warned.discard(key)
        return warnings

    def _rising(self, series: list[float]) -> bool:
        if len(series) <= self.patience:
            return False
        steps_up = all(b > a for a, b in zip(series, series[1:]))
        return steps_up and series[-1] >= 2 * series[0] and series[-1] > self.floor
