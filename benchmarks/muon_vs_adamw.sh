#!/usr/bin/env bash
# Muon against AdamW in our trainer at equal steps (and the wall time each took), on the embedded corpus (the
# Python standard library): one command.
#
#   bash benchmarks/muon_vs_adamw.sh OUT_DIR            # GPU: a 33M-parameter Z2all (hidden 512, 8 layers), seq 512
#   MUON_SMOKE=1 bash benchmarks/muon_vs_adamw.sh DIR   # CPU: the tiny preset, 20 steps: the plumbing only
#
# Rows (same model, data order, batch 32 x 512 tokens, warmup 50, cosine to lr / 10, grad clip 1.0, STEPS updates):
#   adamw-2e-3, adamw-4e-3                AdamW at two peak learning rates
#   muon-rms-2e-3, muon-rms-4e-3          Muon (muon_scale = rms: the update sized like AdamW's, lr shared)
#   muon-spectral-0.02                    Muon with Jordan's scaling at muon_lr 0.02 (AdamW 2e-3 for the rest)
# The summary prints each row's validation loss at every evaluation, its final value and the training wall time.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash benchmarks/muon_vs_adamw.sh OUT_DIR}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
Z="$PY -m zero2all.cli"
if [ -n "${MUON_SMOKE:-}" ]; then
  STEPS=${STEPS:-20}; MODEL=(); SEQ=256; EVAL=10; MB=4
else
  STEPS=${STEPS:-600}; SEQ=512; EVAL=100; MB=32
  MODEL=(model.hidden_dim=512 model.intermediate_size=1376 model.n_layers=8 model.n_heads=8 model.n_kv_heads=4
         model.max_seq_len=512)
fi
mkdir -p "$OUT"
[ -f "$OUT/tok/tokenizer.json" ] || $Z train-tokenizer --input stdlib --vocab-size 8192 --out "$OUT/tok" > "$OUT/tok.log" 2>&1 \
  || { echo "train-tokenizer failed: $OUT/tok.log"; exit 1; }
[ -f "$OUT/data/meta.json" ] || $Z prepare --input stdlib --tokenizer "$OUT/tok" --out "$OUT/data" --seq-len $SEQ > "$OUT/data.log" 2>&1 \
  || { echo "prepare failed: $OUT/data.log"; exit 1; }
COMMON=("${MODEL[@]}" model.vocab_size=8192 data.seq_len=$SEQ train.micro_batch_size=$MB train.max_steps=$STEPS
        train.warmup_steps=$((STEPS < 100 ? 2 : 50)) train.eval_every=$EVAL train.eval_batches=20 train.num_samples=0
        train.ckpt_every=1000000 train.keep_last=1 train.tensorboard=false train.log_every=50 train.schedule="'cosine'")
row() {  # name, overrides...
  local name=$1; shift
  echo "== $name ($(date -u +%H:%M:%S))"
  local t0=$SECONDS
  $Z pretrain --config tiny --data "$OUT/data" --out "$OUT/$name" --no-progress "${COMMON[@]}" "$@" \
    > "$OUT/$name.log" 2>&1 || echo "[$name] failed: $OUT/$name.log"
  echo "$name: $((SECONDS - t0)) s"
}
row adamw-2e-3 train.lr=2e-3 train.min_lr=2e-4
row adamw-4e-3 train.lr=4e-3 train.min_lr=4e-4
row muon-rms-2e-3 train.optimizer="'muon'" train.lr=2e-3 train.min_lr=2e-4
row muon-rms-4e-3 train.optimizer="'muon'" train.lr=4e-3 train.min_lr=4e-4
row muon-spectral-0.02 train.optimizer="'muon'" train.muon_scale="'spectral'" train.muon_lr=0.02 train.lr=2e-3 train.min_lr=2e-4
$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'row':22s} {'final val':>9s} {'train s':>8s}  validation loss at each evaluation")
for run in sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists()):
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ev = [(r["step"], r["loss"]) for r in recs if r.get("kind") == "eval" and "loss" in r]
    tr = [r for r in recs if r.get("kind") == "train"]
    secs = sum(r["step_time_s"] for r in tr)
    final = f"{ev[-1][1]:.4f}" if ev else "-"
    print(f"{run.name:22s} {final:>9s} {secs:8.1f}  " + " ".join(f"{s}:{v:.3f}" for s, v in ev))
PYEOF
