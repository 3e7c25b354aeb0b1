#!/bin/bash
# CUDA graphs of the tensor-parallel blocks (parallel.tp_graphs) on 2 GPUs, in one call: correctness first, then
# speed side by side with our eager tp2 + SP and our FSDP2, optionally the torchtitan tp2 peer.
#
#   OUT=DIR bash benchmarks/tp_graphs_gpu_check.sh [PEER_WHEELS_DIR]
#
# Run from the repository root on a machine with 2 GPUs (z2all-1.1b, seq 2048, micro-batch 8 x accumulation 4,
# 2 warm-up + 3 timed steps; about 3 minutes without the peer). Each row is its own process under its own
# timeout; every output goes to $OUT/*.txt, one summary line per row to stdout:
#   T    tests/test_parallel_mesh_graphs.py -k gpu: graphs vs eager loss sequence (6 steps) and the eager
#        fall-back for a second forward before the first one's backward
#   G1   tp2 + SP, tp_graphs, one group of sequences (+ one profiled step: $OUT/prof-g1/)
#   G2   tp2 + SP, tp_graphs, tp_chunks = 2 (collectives of one group are graph branches beside the other's GEMMs)
#   G2S  G2 with NCCL_PROTO=Simple
#   A    tp2 + SP eager (the default): its last loss must equal G1's up to bf16 / NCCL noise
#   D    our FSDP2 (fsdp_accum_no_sync), the 0.85x target's reference
#   P    torchtitan tp2 + compile (only with PEER_WHEELS_DIR; benchmarks/peer_wheels.sh)
set -u
OUT=${OUT:?set OUT to a folder for the outputs}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
echo "tp graphs check $(date -u +%FT%H:%M:%SZ) $(git log -1 --format=%h 2>/dev/null) torch $(python3 -c \
  'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' 2>&1)"

row() {  # row NAME LIMIT_S CMD...: run, then print its result line (or why it failed)
  local name=$1 lim=$2; shift 2
  local out="$OUT/$name.txt" t0=$SECONDS
  timeout -k 5 "$lim" "$@" > "$out" 2>&1
  local rc=$? line
  [ "$rc" -ge 124 ] && sleep 3   # let a killed run's GPU memory go
  line=$(grep -E '^\[(ours|tp2)' "$out" | tail -1)
  if [ "$name" = T ]; then
    echo "$name: rc $rc ($((SECONDS - t0))s)"; grep -E "losses|grad norm|passed|failed" "$out" | tail -4 | cut -c1-200
  elif [ -n "$line" ] && ! grep -q FAILED <<< "$line"; then
    echo "$name: ${line#*] }"
  else
    echo "$name: FAILED rc $rc ($((SECONDS - t0))s)"
    grep -E 'Error|error:|Traceback|assert' "$out" | grep -v Warning | tail -3 | cut -c1-200
  fi
}
loss() {  # the last timed step's loss and the peak memory per GPU of a row's JSON
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))[0]; print('   loss', r['loss'], 'peak GiB', \
[round(m, 1) for m in r['mem_gib']])" "$1" 2>/dev/null
}

B=(python3 benchmarks/distributed_throughput.py --gpus 2 --steps 3 --warmup 2 --timeout 300)
G=(--variants ours-tp --override=parallel.tp_graphs=true)
row T 120 python3 -m pytest -q -x -s tests/test_parallel_mesh_graphs.py -k gpu
row G1 90 "${B[@]}" "${G[@]}" --json "$OUT/g1.json" --profile "$OUT/prof-g1"; loss "$OUT/g1.json"
grep -q "replayed as CUDA graphs" "$OUT/G1.txt" && echo "   start-up line: blocks replayed as CUDA graphs"
row G2 60 "${B[@]}" "${G[@]}" --override=parallel.tp_chunks=2 --json "$OUT/g2.json"; loss "$OUT/g2.json"
row G2S 60 env NCCL_PROTO=Simple "${B[@]}" "${G[@]}" --override=parallel.tp_chunks=2 --json "$OUT/g2s.json"
loss "$OUT/g2s.json"
row A 60 "${B[@]}" --variants ours-tp --json "$OUT/a.json"; loss "$OUT/a.json"
row D 60 "${B[@]}" --variants ours-fsdp --fsdp-no-sync --json "$OUT/d.json"; loss "$OUT/d.json"
if [ -n "${1:-}" ]; then
  eval "$(bash benchmarks/peer_wheels.sh install "$1")"
  row P 150 python3 benchmarks/torchtitan_peer.py --variants tp2 --steps 3 --warmup 2 --timeout 140
fi
