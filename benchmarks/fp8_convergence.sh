#!/usr/bin/env bash
# FP8 convergence check: the same 108M-parameter model and data, FP8 rowwise linears then bf16 linears, same seed.
# usage: benchmarks/fp8_convergence.sh DATA_DIR RUN_DIR SECONDS_PER_RUN [extra overrides...]
set -u
data=$1; out=$2; limit=$3; shift 3
mkdir -p "$out"
for precision in fp8_rowwise bf16; do
  timeout "$limit" python -m zero2all.cli pretrain --config benchmarks/fp8_convergence.toml --no-progress \
    data.path="$data" train.out_dir="$out/$precision" model.ops.linear_precision=$precision "$@" \
    > "$out/$precision.log" 2>&1
  echo "$precision: exit $?"; grep -E "eval  step" "$out/$precision.log" | tail -2; tail -2 "$out/$precision.log"
done
