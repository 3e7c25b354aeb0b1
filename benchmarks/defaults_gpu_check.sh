#!/bin/bash
# The multi-GPU defaults on 2 GPUs of one host, in one call: the CUDA-graph tests (a `z2all pretrain` with tp
# graphs must exit), then ours with default settings side by side with torchtitan (its own Trainer + compile).
#
#   OUT=DIR bash benchmarks/defaults_gpu_check.sh PEER_WHEELS_DIR [ROWS]
#
# z2all-1.1b, seq 2048, micro-batch 8 x accumulation 4 per replica, 3 warm-up + 10 timed steps (min / median /
# max printed per row). ROWS (default all): a comma list of
#   T     pytest -m gpu on the tp / pp graph tests (incl. `z2all pretrain` under torchrun with tp graphs: exit 0)
#   TP    ours tp2 + SP, defaults (tp_graphs = auto: on)        TPE   the same with parallel.tp_graphs=false
#   FS    ours FSDP2 dp2 (fsdp_accum_no_sync), the 0.85x reference
#   PP    ours pp2 1F1B, defaults (pp_cuda_graphs = auto: on), 16 pipeline microbatches of 2 sequences
#   PP32  the same with 32 microbatches of 1
#   TT    torchtitan tp2          TTP   torchtitan pp2 1F1B, 16 microbatches of 2 (its best configuration)
#   TPC2  ours tp2 + SP with tp_chunks = 2 (two groups of sequences per block: collectives beside GEMMs)
#   TP7 / TT7   llama2-7b tp2 + SP, seq 4096, micro-batch 2 x 4: ours (defaults) / torchtitan tp2
#   EP1 / EP2   z2all-moe-1b, micro-batch 16 x accum 2 per GPU: ours on 1 GPU / ours ep2 (defaults)
#   EP2S  ep2 with a reduce-scatter every micro-step (fsdp_accum_no_sync = false, the earlier default)
#   EP1C / EP2C  the same two with train.compile (per block)
#   TPD / TPA   tp2 + SP with tp_impl = dtensor + train.compile, without / with parallel.async_tp
# PROFILE=1: every row of ours also profiles one extra step, a table per rank under $OUT/profiles/ (the kernel
# breakdown first: compute, communication and the exposed part of it, idle)
set -u
OUT=${OUT:?set OUT to a folder for the outputs}
WHEELS=${1:-}
ROWS=",${2:-T,TP,FS,PP,TT,TTP},"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
echo "defaults check $(date -u +%FT%H:%M:%SZ) $(git log -1 --format=%h 2>/dev/null) $(python3 -c \
  'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0), "x", torch.cuda.device_count())')"

want() { [[ "$ROWS" == *",$1,"* ]]; }
row() {  # row NAME LIMIT_S CMD...: run under its own timeout, then print its result lines
  local name=$1 lim=$2; shift 2
  want "$name" || return 0
  local out="$OUT/$name.txt" t0=$SECONDS
  timeout -k 5 "$lim" "$@" > "$out" 2>&1
  local rc=$?
  [ "$rc" -ge 124 ] && sleep 3
  echo "$name: rc $rc ($((SECONDS - t0)) s)"
  grep -E '^\[(ours|tp|pp|fsdp)[^]]*\]|passed|failed|bubble|exit [0-9]+ after|Error' "$out" | tail -4 | cut -c1-330
}
PROF=()
[ -n "${PROFILE:-}" ] && PROF=(--profile "$OUT/profiles")
B=(python3 benchmarks/distributed_throughput.py --gpus 2 --steps 10 --warmup 3 --timeout 200 "${PROF[@]}")
row T 200 python3 -m pytest -q -s -m gpu tests/test_parallel_mesh_graphs.py tests/test_parallel_pp_graphs.py
row TP 150 "${B[@]}" --variants ours-tp
row TPE 120 "${B[@]}" --variants ours-tp --override=parallel.tp_graphs=false
row FS 120 "${B[@]}" --variants ours-fsdp --fsdp-no-sync
row PP 150 "${B[@]}" --variants ours-pp --pp-microbatches 4
row PP32 150 "${B[@]}" --variants ours-pp --pp-microbatches 8
row TPC2 150 "${B[@]}" --variants ours-tp --override=parallel.tp_chunks=2
row TPD 210 "${B[@]}" --variants ours-tp --compile --override=parallel.tp_impl=\'dtensor\'
row TPA 210 "${B[@]}" --variants ours-tp --compile --override=parallel.tp_impl=\'dtensor\' --override=parallel.async_tp=true
row TP7 240 "${B[@]}" --config llama2-7b --seq-len 4096 --micro-batch 2 --variants ours-tp
M=(python3 benchmarks/distributed_throughput.py --config z2all-moe-1b --seq-len 2048 --micro-batch 16 --accum 2
   --steps 10 --warmup 3 --timeout 200 "${PROF[@]}")
row EP1 150 "${M[@]}" --gpus 1 --variants ours
row EP2 150 "${M[@]}" --gpus 2 --variants ours-fsdp --ep 2
row EP2S 150 "${M[@]}" --gpus 2 --variants ours-fsdp --ep 2 --override=parallel.fsdp_accum_no_sync=false
row EP1C 210 "${M[@]}" --gpus 1 --variants ours --compile
row EP2C 210 "${M[@]}" --gpus 2 --variants ours-fsdp --ep 2 --compile
if [ -n "$WHEELS" ] && { want TT || want TTP || want TT7; }; then
  eval "$(bash benchmarks/peer_wheels.sh install "$WHEELS")"
  T=(python3 benchmarks/torchtitan_peer.py --steps 10 --warmup 3 --timeout 200)
  row TT 210 "${T[@]}" --variants tp2
  row TTP 210 "${T[@]}" --variants pp2 --pp-microbatch-size 2
  row TT7 300 "${T[@]}" --config llama2-7b --variants tp2@4096x2
fi
