#!/bin/bash
# The bf16 path's GPU measurements in one command (one H100; ~4 minutes with cold compile caches):
#   bash benchmarks/bf16_gpu_check.sh [OUT_DIR]          (default ./bf16_gpu_check)
# 1. GPU tests of step fusion, the fused loss and the lean projections at real shapes;
# 2. every SDPA backend at the training shape (benchmarks/attention_backends.py);
# 3. one process, one model per variant: model.ops.step_fusion off / grads / all, cross-entropy chunk 2^30, a bf16
#    residual stream, the CUDA-graphed micro-step; a categorised one-step profile of off and of all
#    (benchmarks/step_profile.py);
# 4. the canonical rows: z2all bench train --rows use_all with step_fusion off and all.
# Each part runs in its own process under its own timeout; the summary goes to stdout, the details under OUT_DIR.
OUT=${1:-${OUT:-bf16_gpu_check}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== GPU tests"
TRITON_INTERPRET=0 timeout 300 $PY -m pytest -q -m gpu tests/test_kernels_step_fusion.py \
  tests/test_kernels_cross_entropy.py tests/test_kernels_fused_linear.py > "$OUT/gpu_tests.txt" 2>&1
echo "rc=$? $(tail -1 "$OUT/gpu_tests.txt")"

echo "== attention backends (B8 H32/4 T2048 D64 causal bf16)"
timeout 120 $PY benchmarks/attention_backends.py --reps 20 > "$OUT/attention.txt" 2>&1; echo "rc=$?"
grep -E "picks|fwd" "$OUT/attention.txt" | cut -c1-160

echo "== step variants (z2all-1.1b, mb 8 x accum 4, seq 2048)"
timeout 300 $PY benchmarks/step_profile.py --variants off,grads,all,all+ce30,all+res16,graph --profile off \
  --iters 5 --warmup 2 --out "$OUT/variants" > "$OUT/step.txt" 2>&1; echo "rc=$?"
grep -E " step |failed" "$OUT/step.txt" | sed 's/  steps .*//'
timeout 120 $PY benchmarks/step_profile.py --variants all --profile all --iters 3 --warmup 1 \
  --out "$OUT/profile_all" > "$OUT/step_all.txt" 2>&1; echo "rc=$?"
head -20 "$OUT/variants/profile_categories.txt"
head -20 "$OUT/profile_all/profile_categories.txt"

echo "== z2all bench train --rows use_all, step_fusion off / all"
for s in off all; do
  timeout 180 $PY benchmarks/train_throughput.py --rows use_all --iters 3 --warmup 1 \
    --out "$OUT/bench_$s.json" model.ops.step_fusion=$s > "$OUT/bench_$s.txt" 2>&1; echo "rc=$? step_fusion=$s"
  grep -E "use_all" "$OUT/bench_$s.txt" | tail -1
done
