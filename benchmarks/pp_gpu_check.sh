#!/usr/bin/env bash
# Pipeline parallel on 2 GPUs: CUDA graphs of the stages (parallel.pp_cuda_graphs) and the microbatch size,
# side by side with torchtitan's pp2, in one invocation. Run from the repository root on a 2-GPU machine:
#
#   bash benchmarks/pp_gpu_check.sh OUT_DIR [PEER_WHEELS_DIR]      # about 4 minutes; full logs in OUT_DIR
#
# 1. the GPU tests of the graphed stages (a graphed stage vs the eager one, in 1F1B order, two updates)
# 2. z2all-1.1b, seq 2048, micro-batch 8 x accumulation 4, 1F1B, blocks [12, 10]; each row its own process:
#    eager and graphed with 8 pipeline microbatches of one sequence per micro-batch (M = 32 per update), then
#    with 4 of two sequences (M = 16); the benchmark prints tok/s, the measured bubble per rank, the last loss
#    and the graph slots / eager calls per rank
# 3. torchtitan 0.2.2 pp2 1F1B + compile (its own microbatching: each of the 4 micro-batches of an update is one
#    schedule of 8 one-sequence microbatches, so its pipeline fills and drains 4 times per update)
set -uo pipefail
OUT=${1:?usage: bash benchmarks/pp_gpu_check.sh OUT_DIR [PEER_WHEELS_DIR]}
WHEELS=${2:-}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
D="python3 benchmarks/distributed_throughput.py --gpus 2 --variants ours-pp --steps 3 --warmup 2 --timeout 110"
S="parallel.pp_split=[12,10]"

row() {  # name command...
  local name=$1; shift
  timeout 120 "$@" > "$OUT/$name.log" 2>&1
  echo "== $name (rc $?)"
  grep -E "^\[[a-z0-9@-]+( x[0-9])?\].*tok/s|measured bubble|passed|failed|Error" "$OUT/$name.log" | cut -c1-400 | tail -3
}

row gpu_tests python3 -m pytest -q tests/test_parallel_pp_graphs.py -k gpu
row eager_m32 $D --pp-microbatches 8 --override "$S"
row graphs_m32 $D --pp-microbatches 8 --override "$S" --override parallel.pp_cuda_graphs=true
row eager_m16 $D --pp-microbatches 4 --override "$S"
row graphs_m16 $D --pp-microbatches 4 --override "$S" --override parallel.pp_cuda_graphs=true
if [ -n "$WHEELS" ]; then
  eval "$(bash benchmarks/peer_wheels.sh install "$WHEELS")"
  row torchtitan_pp2 python3 benchmarks/torchtitan_peer.py --variants pp2 --steps 3 --warmup 2 --timeout 110
fi
