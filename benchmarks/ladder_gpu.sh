#!/usr/bin/env bash
# A scaling ladder on one GPU: 5 rungs at 20 tokens per parameter, the fit, the prediction of a run 4x larger than
# the largest rung made before it runs, then that run (--check) and the prediction's error. One command:
#
#   bash benchmarks/ladder_gpu.sh [OUT_DIR]          # GPU: the site-packages corpus, <= ~8.5 minutes in all
#   LADDER_SMOKE=1 bash benchmarks/ladder_gpu.sh DIR # CPU: the same steps scaled down (the plumbing only)
#
# Results: OUT_DIR/ladder/ladder.json (every rung, the fit with its bootstrap uncertainty, the prediction, the check)
# and ladder.png, copied to benchmarks/results/ladder-<date>-<gpu>/ with the logs. The family: hidden = 32 x depth,
# head size 32, depths 1-5 (0.14M-2.2M non-embedding parameters with a 4,096-token vocabulary, the LM head
# counted), sequences of 512 tokens; the check run is depth 9 (10.1M, 4.5x the largest rung, 203M tokens, 6,191
# updates of 64 x 512 tokens, AdamW 3e-3 cosine to 3e-4). The recipe per run (docs/scaling-ladder.md): at least
# 1,000 updates (depths 1-4 train at micro-batch 5, 14, 28, 51 instead of 64; they ran 89-811 updates in the
# 2026-11-27 ladder, which missed the check by 18.9 %), warmup 2 % of the updates, lr x (288 / hidden)^0.5 (9e-3 at
# depth 1, 3e-3 at depth 9), the same 20 x 64 x 512 validation tokens for each.
# Timing on one H200 (2026-11-27, the old recipe): corpus 38 s, tokenizer 10 s, shards 22 s, rungs 101 s, check
# 289 s (4.7 min), 469 s in all. The new recipe runs ~2,600 more rung updates, at small batches (~10 ms each on that
# GPU): ~500 s expected, under 8.5 minutes.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
Z="$PY -m zero2all.cli"
STAMP=$(date -u +%Y-%m-%d)
if [ -n "${LADDER_SMOKE:-}" ]; then
  OUT=${1:?usage: LADDER_SMOKE=1 bash benchmarks/ladder_gpu.sh OUT_DIR}
  CORPUS_MB=${CORPUS_MB:-4}; VOCAB=512; SEQ=64; MB=4; RATIO=${RATIO:-0.02}; DEPTHS=1,2,3,4,5; ASPECT=16; HEAD=16
  MIN_UPDATES=${MIN_UPDATES:-3}; PREDICT=8; DEVICE=cpu; TAG=cpu-smoke
else
  OUT=${1:-runs/ladder-gpu}
  CORPUS_MB=${CORPUS_MB:-400}; VOCAB=4096; SEQ=512; MB=64; RATIO=${RATIO:-20}; DEPTHS=1,2,3,4,5; ASPECT=32; HEAD=32
  MIN_UPDATES=${MIN_UPDATES:-1000}; PREDICT=9
  DEVICE=cuda; TAG=$($PY -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo gpu)
fi
mkdir -p "$OUT"
t0=$SECONDS
say() { echo "== $* ($(date -u +%H:%M:%S), +$((SECONDS - t0)) s)"; }
say "corpus: site-packages, at most $CORPUS_MB MB"
[ -f "$OUT/corpus/manifest.json" ] || $Z corpus --out "$OUT/corpus" --max-mb "$CORPUS_MB" > "$OUT/corpus.log" 2>&1 \
  || { echo "corpus failed: $OUT/corpus.log"; exit 1; }
tail -1 "$OUT/corpus.log"
say "tokenizer ($VOCAB tokens, on the train split)"
[ -f "$OUT/tok/tokenizer.json" ] || $Z train-tokenizer --input "$OUT/corpus/train.jsonl" --vocab-size $VOCAB \
  --max-memory-gb 2 --out "$OUT/tok" > "$OUT/tok.log" 2>&1 || { echo "train-tokenizer failed: $OUT/tok.log"; exit 1; }
say "token shards (validation = the held-out packages)"
[ -f "$OUT/data/meta.json" ] || $Z prepare --input "$OUT/corpus" --tokenizer "$OUT/tok" --out "$OUT/data" \
  --seq-len $SEQ --no-progress > "$OUT/data.log" 2>&1 || { echo "prepare failed: $OUT/data.log"; exit 1; }
say "ladder: depths $DEPTHS, $RATIO tokens per parameter, >= $MIN_UPDATES updates each, then the check run"
$Z ladder --config tiny --data "$OUT/data" --out "$OUT/ladder" --depths $DEPTHS --aspect $ASPECT --head-dim $HEAD \
  --ratio $RATIO --min-updates $MIN_UPDATES --warmup-fraction 0.02 --lr-width-exponent 0.5 --predict-depth $PREDICT \
  --check --device $DEVICE model.vocab_size=$VOCAB model.max_seq_len=$SEQ data.seq_len=$SEQ \
  train.micro_batch_size=$MB train.lr=3e-3 train.min_lr=3e-4 train.eval_batches=20 \
  train.log_every=0 > "$OUT/ladder.log" 2>&1 || { echo "ladder failed: $OUT/ladder.log"; tail -3 "$OUT/ladder.log"; exit 1; }
grep "^ladder: \(fit\|warning\|backtest\|prediction\|check\)" "$OUT/ladder.log"
say "done"
RES=benchmarks/results/ladder-$STAMP-$TAG
mkdir -p "$RES"
cp "$OUT/ladder/ladder.json" "$OUT/ladder.log" "$OUT/corpus/manifest.json" "$RES/" 2>/dev/null
[ -f "$OUT/ladder/ladder.png" ] && cp "$OUT/ladder/ladder.png" "$RES/"
echo "total $((SECONDS - t0)) s; results in $RES"
