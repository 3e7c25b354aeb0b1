"""Plot the FP8 convergence check: training and validation loss of the bf16 and FP8 runs in one PNG.

usage: python benchmarks/fp8_convergence_plot.py BF16_METRICS.jsonl FP8_METRICS.jsonl OUT.png [FP8_LABEL]
FP8_LABEL names the FP8 run (default "FP8 rowwise"). Prints the final validation losses and FP8's relative
difference.
"""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from zero2all.fileio import atomic_write  # noqa: E402
from zero2all.train.metrics import read_metrics  # noqa: E402


def smooth(values, k=25):
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def main(bf16_path, fp8_path, out_png, fp8_label="FP8 rowwise"):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    finals = {}
    for name, path, color in (("bf16", bf16_path, "tab:blue"), (fp8_label, fp8_path, "tab:red")):
        recs = read_metrics(path)
        train = [r for r in recs if r.get("kind") == "train"]
        evals = [r for r in recs if r.get("kind") == "eval"]
        ax.plot([r["step"] for r in train], smooth([r["loss"] for r in train]), color=color, alpha=0.5,
                lw=1, label=f"{name} train (moving mean of 25)")
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], color=color, marker="o", lw=2,
                label=f"{name} validation")
        finals[name] = evals[-1]["loss"]
    ax.set_xlabel("update")
    ax.set_ylabel("loss (nats / token)")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    rel = finals[fp8_label] / finals["bf16"] - 1
    ax.set_title(f"108M Z2all, real text, 2,000 updates: final validation loss bf16 {finals['bf16']:.4f}, "
                 f"{fp8_label} {finals[fp8_label]:.4f} ({100 * rel:+.2f} %)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_write(out_png, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    print(f"final validation loss: bf16 {finals['bf16']:.4f}, {fp8_label} {finals[fp8_label]:.4f}, "
          f"FP8 / bf16 - 1 = {100 * rel:+.3f} %")


if __name__ == "__main__":
    main(*sys.argv[1:5])
