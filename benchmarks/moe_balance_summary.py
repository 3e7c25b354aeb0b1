"""One line per balance run of moe_bench.py results.json files: worst-layer max / mean load after warm-up (median,
p95, max, steps over 1.3), per-layer max, language-model losses.

    python benchmarks/moe_balance_summary.py DIR/results.json [...]
"""

import json
import sys

for path in sys.argv[1:]:
    try:
        recs = json.load(open(path))["balance"]
    except (OSError, ValueError, KeyError) as e:
        print(f"{path}: no results ({type(e).__name__})")
        continue
    for r in recs:
        q = r["max_over_mean_after_warmup"]
        layers = " ".join(f"L{i}:{v['median']:.2f}/{v['p95']:.2f}/{v['max']:.2f}"
                          for i, v in r["per_layer_after_warmup"].items())
        name = ",".join(o.removeprefix("model.moe.") for o in r["overrides"]) or "preset"
        print(f"{name} mb{r['micro_batch']}x{r['seq']} s{r['seed']}: {q['median']:.2f}/{q['p95']:.2f}/{q['max']:.2f} "
              f">1.3:{q['steps_over']} [{layers}] lm {r['lm_loss_mean_last_20']:.3f} eval {r['eval_lm_loss']:.3f} "
              f"{r['train_s']:.0f}s")
