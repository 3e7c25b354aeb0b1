#!/bin/bash
# The pending GPU measurement of the MoE expert-load balance (docs/moe.md, BENCHMARKS.md "expert load balance,
# sequence-wise loss"): the tiny-moe demo run (400 steps, 100 warm-up, byte vocabulary, stdlib source) with the
# bias alone and with the sequence-wise balance loss beside it, at 32 x 256 and 128 x 64 tokens per step.
# About 15-20 s per run on one H100. Usage: OUT=DIR bash benchmarks/moe_balance_gpu_check.sh
set -u
OUT=${OUT:-runs/moe_balance}
B="python3 benchmarks/moe_bench.py --parts balance --balance-steps 400 --balance-warmup 100"
run() { # name timeout args...: each setting in its own process
  local n=$1 t=$2; shift 2; mkdir -p "$OUT/$n"
  timeout "$t" $B --out "$OUT/$n" "$@" > "$OUT/$n/log.txt" 2>&1; echo "[$n rc=$?]"
}
run a 60 --balance-micro-batch 32 --balance-seq 256 \
    --balance-variants "model.moe.seq_aux_loss_coef=0;model.moe.seq_aux_loss_coef=1e-2;model.moe.seq_aux_loss_coef=3e-2"
run b 45 --balance-micro-batch 128 --balance-seq 64 \
    --balance-variants "model.moe.seq_aux_loss_coef=0;model.moe.seq_aux_loss_coef=1e-2"
python3 benchmarks/moe_balance_summary.py "$OUT"/a/results.json "$OUT"/b/results.json
# the plot of the setting that meets the target: python3 benchmarks/moe_bench.py --out docs/ --plot-balance \
#     $OUT/a/results.json   (writes docs/moe_balance.png)
