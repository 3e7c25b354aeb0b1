#!/bin/bash
# Training speed of two trees side by side in one call: an earlier commit ("before") and this tree ("after"), each
# running its own benchmarks/distributed_throughput.py, row by row, before then after, on the same machine.
#
#   git archive -o .whl/before.tar COMMIT           # here, then carry .whl/before.tar to the GPU machine
#   OUT=DIR bash benchmarks/before_after_gpu.sh .whl/before.tar [ROWS]
#
# ROWS (default D1,TP,PP,EP2), a comma list of
#   D1    z2all-1.1b on 1 GPU, seq 2048, micro-batch 8 x accumulation 4
#   TP    tp2 + SP (defaults), same shape           PP    pp2 1F1B (defaults), 4 pipeline microbatches of 2
#   FS    FSDP2 dp2 (fsdp_accum_no_sync)            EP1 / EP2   z2all-moe-1b, micro-batch 16 x 2: 1 GPU / ep2
# 3 warm-up + 10 timed steps per run (min / median / max printed), RUN_S (default 200) seconds at most each;
# DEADLINE_S (default 540) stops starting runs
# that would not finish inside the call.
set -u
OUT=${OUT:?set OUT to a folder for the outputs}
TAR=${1:?usage: OUT=DIR bash benchmarks/before_after_gpu.sh BEFORE.tar [ROWS]}
ROWS=${2:-D1,TP,PP,EP2}
DEADLINE_S=${DEADLINE_S:-540}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export PYTHONUNBUFFERED=1
AFTER=$PWD
BEFORE=/tmp/before-tree
rm -rf "$BEFORE" && mkdir -p "$BEFORE" && tar xf "$TAR" -C "$BEFORE" || { echo "cannot unpack $TAR"; exit 1; }
echo "before/after $(date -u +%FT%H:%M:%SZ) after=$(git log -1 --format=%h 2>/dev/null) $(python3 -c \
  'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0), "x", torch.cuda.device_count())')"
T0=$SECONDS
args_of() {  # the distributed_throughput.py arguments of a row
  local dense=(--steps 10 --warmup 3 --timeout 200)
  local moe=(--config z2all-moe-1b --seq-len 2048 --micro-batch 16 --accum 2 "${dense[@]}")
  case "$1" in
    D1) echo "${dense[@]} --gpus 1 --variants ours" ;;
    TP) echo "${dense[@]} --gpus 2 --variants ours-tp" ;;
    PP) echo "${dense[@]} --gpus 2 --variants ours-pp --pp-microbatches 4" ;;
    FS) echo "${dense[@]} --gpus 2 --variants ours-fsdp --fsdp-no-sync" ;;
    EP1) echo "${moe[@]} --gpus 1 --variants ours" ;;
    EP2) echo "${moe[@]} --gpus 2 --variants ours-fsdp --ep 2" ;;
    *) echo "unknown row $1" >&2; return 1 ;;
  esac
}
for row in ${ROWS//,/ }; do
  a=$(args_of "$row") || exit 2
  for side in before after; do
    [ "$side" = before ] && tree=$BEFORE || tree=$AFTER
    if [ $((SECONDS - T0)) -gt "$DEADLINE_S" ]; then echo "$row $side: not started (deadline)"; continue; fi
    t0=$SECONDS
    # shellcheck disable=SC2086
    (cd "$tree" && PYTHONPATH=$tree timeout -k 5 "${RUN_S:-200}" python3 benchmarks/distributed_throughput.py $a) \
      > "$OUT/$row-$side.txt" 2>&1
    echo "$row $side: rc $? ($((SECONDS - t0)) s)"
    grep -E '^\[(ours|tp|pp|fsdp)[^]]*\]|Error' "$OUT/$row-$side.txt" | tail -3 | cut -c1-330
  done
done
