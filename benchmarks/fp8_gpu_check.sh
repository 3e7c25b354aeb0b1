#!/usr/bin/env bash
# The pending FP8 measurements on one H100, as one command (about 9 minutes; each part has its own timeout):
#
#   bash benchmarks/fp8_gpu_check.sh OUT_DIR [PEER_WHEELS_DIR]
#
# 1. the FP8 GPU tests (kernels bit for bit, including the handed-over maxima; _scaled_mm; compiled model)
# 2. where the peak memory goes (benchmarks/fp8_memory.py), default and with model.ops.fp8_weight_cache=transposed
# 3. the opt-in switches against the defaults, FP8 rowwise and tensorwise (z2all bench train, separate processes):
#    model.ops.fp8_fused_amax=true, model.ops.fp8_weight_cache=transposed, both
# 4. with PEER_WHEELS_DIR (benchmarks/peer_wheels.sh): the one-invocation comparison with the torchtitan peers
# Full logs go to OUT_DIR; a summary is printed.
set -u
OUT=${1:?usage: bash benchmarks/fp8_gpu_check.sh OUT_DIR [PEER_WHEELS_DIR]}
WHEELS=${2:-}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_check_common.sh"

step "GPU tests"
timeout 240 "$P" -m pytest -q -p no:cacheprovider tests/test_kernels_fp8.py tests/test_fp8_numerics.py \
  tests/test_fp8_routing.py -k gpu > "$OUT/gpu_tests.log" 2>&1
echo "rc=$?: $(tail -1 "$OUT/gpu_tests.log")"

step "memory breakdown"
timeout 90 "$P" benchmarks/fp8_memory.py --rows use_all_fp8,use_all_fp8_tensorwise --quiet --out "$OUT" \
  > "$OUT/memory.log" 2>&1
timeout 90 "$P" benchmarks/fp8_memory.py --rows use_all_fp8,use_all_fp8_tensorwise --quiet --out "$OUT" \
  --tag transposed model.ops.fp8_weight_cache=transposed >> "$OUT/memory.log" 2>&1
grep -E "^==" "$OUT/memory.log"

step "switches"
variant() {   # name, overrides...
  local name=$1; shift
  timeout 120 "$P" -m zero2all.cli bench train --rows use_all_fp8,use_all_fp8_tensorwise --iters 3 --warmup 1 \
    --out "$OUT/bench_$name.json" "$@" > "$OUT/bench_$name.log" 2>&1
  echo "$name rc=$?"; grep -E "^\s+->" "$OUT/bench_$name.log"
}
variant defaults
variant fused_amax model.ops.fp8_fused_amax=true
variant transposed model.ops.fp8_weight_cache=transposed
variant both model.ops.fp8_fused_amax=true model.ops.fp8_weight_cache=transposed

if [ -n "$WHEELS" ]; then
  step "one invocation with the peers"
  eval "$(PYTHON=$P bash benchmarks/peer_wheels.sh install "$WHEELS")"
  timeout 420 "$P" -m zero2all.cli bench train \
    --rows use_all_fp8,use_all_fp8_tensorwise,use_all_fp8_mb16,tt_fp8_tensorwise,tt_compile --iters 3 --warmup 1 \
    --out "$OUT/bench_peers.json" > "$OUT/bench_peers.log" 2>&1
  echo "rc=$?"; sed -n '/^row  /,$p' "$OUT/bench_peers.log"
fi
step "done"
