#!/usr/bin/env bash
# The 4- and 8-GPU scaling runs (issue 22), one command per machine kind. Every row is its own torchrun job
# (benchmarks/distributed_throughput.py) under its own timeout; JSON and logs go to OUT_DIR, a summary is printed.
#
#   bash benchmarks/scaling_gpu_check.sh 4 OUT_DIR      # 4 GPUs of one host (nvidia-h200-x4)
#       z2all-1.7b: 1 GPU, then DDP, FSDP2, tp2 x dp2 (FSDP2 over the rest), pp2 x dp2 (1F1B) on 4;
#       z2all-moe-1b: 1 GPU and ep4; the estimates of the same meshes (z2all estimate)
#   bash benchmarks/scaling_gpu_check.sh 8 OUT_DIR      # 8 GPUs of one host (nvidia-h200-x8)
#       llama2-7b: tp2 x FSDP2 over 4, pp2 x tp2 x dp2 (1F1B and interleaved, 2 stages per rank);
#       z2all-moe-1b: 1 GPU and ep8; z2all-1.7b trained 20 steps on 8 GPUs with a checkpoint, then resumed on
#       2 GPUs and on 1 process for 10 more (the loss continues: summary at the end)
#   ONLY='dense-(1gpu|ddp)' bash benchmarks/scaling_gpu_check.sh 4 OUT_DIR   # only the rows whose name matches
#   SCALING_SMOKE=1 bash benchmarks/scaling_gpu_check.sh 4 OUT_DIR   # CPU, gloo, tiny presets: the plumbing only
#
# Per-GPU batch: MB (default 8) x ACCUM (default 8) x seq 2048 for the dense rows (MB=16 is the seed's setting
# where memory allows), micro-batch 4 x accum 2 for the MoE rows. With --count-comm each row also counts the bytes
# every collective sends per mesh dimension, for the comparison with `z2all estimate`.
set -u
cd "$(dirname "$0")/.."
N=${1:?usage: bash benchmarks/scaling_gpu_check.sh 4|8 OUT_DIR}
OUT=${2:?usage: bash benchmarks/scaling_gpu_check.sh 4|8 OUT_DIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-$PWD}
MB=${MB:-8}; ACCUM=${ACCUM:-8}
if [ -n "${SCALING_SMOKE:-}" ]; then
  DENSE="--config tiny --device cpu --seq-len 64 --micro-batch 2 --accum 2 --steps 1 --warmup 1 --override model.n_layers=4"
  BIG="$DENSE"; MOE="--config tiny-moe --device cpu --seq-len 64 --micro-batch 2 --accum 2 --steps 1 --warmup 1"
  PPM=2; TIMEOUT=240; DEV="train.device='cpu'"; RESUME_CFG=tiny; RESUME_SEQ=64
else
  DENSE="--config z2all-1.7b --seq-len 2048 --micro-batch $MB --accum $ACCUM --steps 3 --warmup 2 --count-comm"
  BIG="--config llama2-7b --seq-len 2048 --micro-batch 4 --accum 8 --steps 3 --warmup 2 --count-comm"
  MOE="--config z2all-moe-1b --seq-len 2048 --micro-batch 4 --accum 2 --steps 3 --warmup 2 --count-comm"
  PPM=4; TIMEOUT=420; DEV=""; RESUME_CFG=z2all-1.7b; RESUME_SEQ=2048
fi
B="$PY benchmarks/distributed_throughput.py --timeout $TIMEOUT"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c

row() {  # name, args...: one measurement, its JSON and log under $OUT
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return 0; fi
  echo "== $name ($(date -u +%H:%M:%S))"
  timeout $((TIMEOUT + 60)) $B "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || echo "[$name] failed: $OUT/$name.log"
  sed -n '/^variant /,$p' "$OUT/$name.log" | grep -vE '^$|^cpu,|^NVIDIA' | tail -n +2 | cut -c1-170
}
mesh() {  # name, config args, overrides...: an ours-mesh row on N GPUs
  local name=$1 cfg=$2; shift 2
  local ov=()
  for o in "$@"; do ov+=(--override "$o"); done
  row "$name" $cfg --gpus "$N" --variants ours-mesh "${ov[@]}"
}

case $N in
  4)
    row dense-1gpu $DENSE --gpus 1 --variants ours
    row dense-ddp4-fsdp4 $DENSE --gpus 4 --variants ours-ddp,ours-fsdp
    mesh dense-tp2dp2 "$DENSE" parallel.tp=2 parallel.sequence_parallel=true
    mesh dense-pp2dp2 "$DENSE" parallel.pp=2 "parallel.pp_schedule='1f1b'" parallel.pp_microbatches=$PPM
    row moe-1gpu $MOE --gpus 1 --variants ours
    row moe-ep4 $MOE --gpus 4 --variants ours-fsdp --ep 4
    if [ -z "${SCALING_SMOKE:-}" ] && [[ estimate =~ ${ONLY:-estimate} ]]; then
      for m in "--dp 4" "--dp 4 --zero 3" "--tp 2 --dp 2 --zero 3" "--pp 2 --dp 2"; do
        echo "== estimate z2all-1.7b $m"
        $PY -m zero2all.cli estimate --config z2all-1.7b --gpu h200 --micro-batch "$MB" --grad-accum "$ACCUM" \
          --seq 2048 $m > "$OUT/estimate-$(echo "$m" | tr -d ' -').txt" 2>&1
        grep -iE "communication|comm" "$OUT/estimate-$(echo "$m" | tr -d ' -').txt" | head -6
      done
    fi
    ;;
  8)
    mesh big-tp2fsdp4 "$BIG" parallel.tp=2 parallel.sequence_parallel=true
    mesh big-pp2tp2dp2-1f1b "$BIG" parallel.pp=2 parallel.tp=2 parallel.sequence_parallel=true \
      "parallel.pp_schedule='1f1b'" parallel.pp_microbatches=$PPM
    # interleaved: at least as many pipeline microbatches as virtual stages (2 ranks x 2 stages each)
    mesh big-pp2tp2dp2-interleaved "$BIG --micro-batch 4" parallel.pp=2 parallel.tp=2 \
      parallel.sequence_parallel=true "parallel.pp_schedule='interleaved_1f1b'" parallel.pp_stages_per_rank=2 \
      parallel.pp_microbatches=4
    row moe-1gpu $MOE --gpus 1 --variants ours
    row moe-ep8 $MOE --gpus 8 --variants ours-fsdp --ep 8
    # resume: 20 steps on 8 GPUs with a checkpoint at 20, then 10 more on 2 GPUs and on 1 process, the global
    # batch kept (64 sequences: micro-batch 2 x accumulation 4 x 8, 16 x 2, 32 x 1)
    echo "== resume ($(date -u +%H:%M:%S))"
    common=(--config "$RESUME_CFG" --no-progress "data.seq_len=$RESUME_SEQ" train.micro_batch_size=2
            train.ckpt_every=20 train.eval_every=0 train.num_samples=0 train.tensorboard=false train.log_every=1
            train.keep_last=0 $DEV)
    timeout "$TIMEOUT" $PY -m torch.distributed.run --standalone --nproc_per_node=8 -m zero2all.cli pretrain \
      "${common[@]}" train.grad_accum_steps=4 train.max_steps=20 --out "$OUT/resume8" parallel.mode=fsdp \
      > "$OUT/resume8.log" 2>&1 || echo "[resume8] failed: $OUT/resume8.log"
    for n in 2 1; do
      timeout "$TIMEOUT" $PY -m torch.distributed.run --standalone --nproc_per_node=$n -m zero2all.cli pretrain \
        "${common[@]}" train.grad_accum_steps=$((32 / n)) train.max_steps=30 --resume "$OUT/resume8/ckpt-000020" \
        --out "$OUT/resume-on-$n" parallel.mode=$([ $n = 1 ] && echo none || echo fsdp) \
        > "$OUT/resume-on-$n.log" 2>&1 || echo "[resume-on-$n] failed: $OUT/resume-on-$n.log"
    done
    for f in resume8 resume-on-2 resume-on-1; do
      echo "$f: $(grep -E '^step +(1|20|21|30) ' "$OUT/$f.log" | cut -d'|' -f1,2,4 | tr -s ' ' | tr '\n' ';')"
    done
    ;;
  *) echo "N must be 4 or 8" >&2; exit 2 ;;
esac
# scaling against the 1-GPU rows of this run (each row is its own invocation: the ratio crosses them)
$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
rows = {p.stem: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"))}
base = {name.split("-")[0]: r[0]["tokens_per_s"] for name, r in rows.items() if name.endswith("-1gpu") and r}
print(f"{'row':28s} {'variant':10s} {'GPUs':>4s} {'tok/s':>10s} {'MFU':>6s} {'vs 1 GPU':>8s}")
for name, results in rows.items():
    for r in results:
        b = base.get(name.split("-")[0])
        ratio = f"{r['tokens_per_s'] / b:.2f}x" if b else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        print(f"{name:28s} {r['variant']:10s} {r['gpus']:4d} {r['tokens_per_s']:10,.0f} {mfu:>6s} {ratio:>8s}")
PYEOF
echo "== done ($(date -u +%H:%M:%S))"
