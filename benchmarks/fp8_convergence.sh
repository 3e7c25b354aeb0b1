#!/usr/bin/env bash
# FP8 convergence check: the same 108M-parameter model and data, one run per setting, same seed.
# usage: benchmarks/fp8_convergence.sh DATA_DIR RUN_DIR SECONDS_PER_RUN [SETTING ...]
# SETTING: bf16 | fp8_rowwise | fp8_tensorwise | fp8_delayed (tensorwise, model.ops.fp8_amax_history=16);
# default: fp8_rowwise bf16. Runs go to RUN_DIR/SETTING (metrics.jsonl), logs to RUN_DIR/SETTING.log.
set -u
data=$1; out=$2; limit=$3; shift 3
settings=("$@")
[ ${#settings[@]} -eq 0 ] && settings=(fp8_rowwise bf16)
mkdir -p "$out"
P=$(command -v python || command -v python3)
for setting in "${settings[@]}"; do
  case $setting in
    bf16|fp8_rowwise|fp8_tensorwise) overrides=(model.ops.linear_precision=$setting) ;;
    fp8_delayed) overrides=(model.ops.linear_precision=fp8_tensorwise model.ops.fp8_amax_history=16) ;;
    *) echo "unknown setting $setting (bf16 | fp8_rowwise | fp8_tensorwise | fp8_delayed)" >&2; exit 2 ;;
  esac
  timeout "$limit" "$P" -m zero2all.cli pretrain --config benchmarks/fp8_convergence.toml --no-progress \
    data.path="$data" train.out_dir="$out/$setting" "${overrides[@]}" > "$out/$setting.log" 2>&1
  echo "$setting: exit $?"; grep -E "eval  step" "$out/$setting.log" | tail -2; tail -2 "$out/$setting.log"
done
