#!/usr/bin/env bash
# Delayed scaling (model.ops.fp8_amax_history) on one H100, in two parts (each under 10 minutes):
#
#   bash benchmarks/fp8_delayed_gpu_check.sh speed OUT_DIR [PEER_WHEELS_DIR]
#       the GPU tests of the FP8 kernels (delayed casts bit for bit against the reference), one invocation of
#       z2all bench train with FP8 rowwise / tensorwise / tensorwise delayed and (with the wheels,
#       benchmarks/peer_wheels.sh) the torchtitan float8 and bf16 peers, then the profile of one delayed step
#   bash benchmarks/fp8_delayed_gpu_check.sh convergence OUT_DIR
#       the data (benchmarks/fp8_convergence_data.sh), then 2,000 updates of the 108M model with bf16 and with
#       FP8 tensorwise delayed linears, same seed (benchmarks/fp8_convergence.sh)
set -u
MODE=${1:?usage: bash benchmarks/fp8_delayed_gpu_check.sh speed|convergence OUT_DIR [PEER_WHEELS_DIR]}
OUT=${2:?usage: bash benchmarks/fp8_delayed_gpu_check.sh speed|convergence OUT_DIR [PEER_WHEELS_DIR]}
WHEELS=${3:-}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_check_common.sh"

case $MODE in
  speed)
    step "GPU tests"
    timeout 150 "$P" -m pytest -q -p no:cacheprovider tests/test_fp8_delayed.py \
      -k gpu > "$OUT/gpu_tests.log" 2>&1
    echo "rc=$?: $(tail -1 "$OUT/gpu_tests.log")"
    [ -n "$WHEELS" ] && eval "$(PYTHON=$P bash benchmarks/peer_wheels.sh install "$WHEELS")"
    rows=use_all_fp8_tensorwise,use_all_fp8_delayed,use_all_fp8
    [ -n "$WHEELS" ] && rows=$rows,tt_fp8_tensorwise,tt_compile
    step "one invocation: $rows"
    timeout 330 "$P" -m zero2all.cli bench train --rows "$rows" --iters 3 --warmup 1 \
      --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    echo "rc=$?"; sed -n '/^row  /,$p' "$OUT/bench.log"
    step "profile of one delayed step"
    timeout 100 "$P" benchmarks/step_profile.py --row use_all_fp8_delayed --variants off --profile off \
      --out "$OUT/profile" > "$OUT/profile.log" 2>&1
    echo "rc=$?"; head -22 "$OUT"/profile/*.txt 2>/dev/null | head -24
    ;;
  convergence)
    step "data"
    bash benchmarks/fp8_convergence_data.sh "$OUT/data" > "$OUT/data.log" 2>&1
    echo "rc=$?"; tail -3 "$OUT/data.log"
    step "runs"
    bash benchmarks/fp8_convergence.sh "$OUT/data/shards" "$OUT/runs" 210 fp8_delayed bf16
    ;;
  *) echo "unknown mode $MODE (speed | convergence)" >&2; exit 2 ;;
esac
step "done"
