"""Check the MFU a `z2all pretrain` run logged against an independent computation from its step times.

    python benchmarks/trainer_mfu_check.py RUN_DIR [--peak 989e12]

Independent of the trainer's timer and formula code: the step time is the wall-clock gap between consecutive
``metrics.jsonl`` records (their ``time`` stamps), the parameter count comes from a meta-device model, and
MFU = tokens/s x (6N + 6 L H T) / peak is written out here (N = non-embedding parameters, the LM head counts;
the causal attention counted as the kernel computes it, half of T x T).
The first two steps (warm-up) are left out. Prints a per-step table and the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from zero2all.config import ModelConfig, from_dict
from zero2all.model.z2all import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="output directory of a `z2all pretrain` run")
    ap.add_argument("--peak", type=float, default=989e12, help="peak FLOP/s of one device (default H100/H200 bf16)")
    args = ap.parse_args()
    run = Path(args.run)
    cfg = json.loads((run / "config.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    model_cfg = from_dict(ModelConfig, cfg["model"], "model")
    model = build_model(model_cfg, device="meta")
    n_non_embedding = sum(p.numel() for name, p in model.named_parameters() if name != "embed_tokens.weight")
    seq_len = cfg["data"]["seq_len"] or model_cfg.max_seq_len
    tokens_per_step = cfg["train"]["grad_accum_steps"] * cfg["train"]["micro_batch_size"] * seq_len
    flops_per_token = 6 * n_non_embedding + 6 * model_cfg.n_layers * model_cfg.hidden_dim * seq_len
    print(f"non-embedding parameters {n_non_embedding:,}; tokens per step {tokens_per_step:,}; "
          f"FLOPs per token {flops_per_token:.4e}")
    print("step  wall gap (s)  logged step (s)  independent MFU  logged MFU")
    rows = []
    for prev, cur in zip(train[2:], train[3:]):
        gap = cur["time"] - prev["time"]
        independent = tokens_per_step / gap * flops_per_token / args.peak
        rows.append((independent, cur["mfu"]))
        print(f"{cur['step']:4d}  {gap:12.4f}  {cur['step_time_s']:15.4f}  {100 * independent:14.2f}%  "
              f"{100 * cur['mfu']:9.2f}%")
    ind, logged = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    print(f"median independent MFU {100 * ind:.2f}%, median logged MFU {100 * logged:.2f}%, "
          f"ratio {logged / ind:.4f}")


if __name__ == "__main__":
    main()
