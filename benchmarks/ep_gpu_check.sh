#!/usr/bin/env bash
# Expert-parallel scaling of z2all-moe-1b on 2 GPUs (issue 18): one command for the whole measurement.
#
#   bash benchmarks/ep_gpu_check.sh [OUT_DIR]            # 2 GPUs of one host: 15 rows (2 compiled) + the all-to-all alone
#   EP_CHECK_SMOKE=1 bash benchmarks/ep_gpu_check.sh     # CPU (gloo), tiny-moe, two rows: the plumbing only
#
# 1. the per-GPU batch sweep: micro-batch 16, 8, 4 (x accum 2 x seq 2048) for the 1-GPU baseline (no wrapper),
#    ep2 (experts over 2 ranks, FSDP2 on the rest, the defaults) and plain FSDP2 dp2, at the same per-GPU batch
#    and the same settings otherwise; scaling = 2-GPU tokens/s / 1-GPU tokens/s at the same micro-batch
# 2. ep2 at micro-batch 16 with one profiled step per rank (all-to-all kernel time, host waits) and the bytes of
#    every collective counted; then one knob at a time: NCCL_PROTO=Simple, fsdp_accum_no_sync,
#    ep_reshard_after_forward=true; then both with torch.compile (--compile)
# 3. the all-to-all alone at the sizes of one layer's exchange (benchmarks/all_to_all_bandwidth.py) and the
#    estimated volume per step (z2all estimate --ep 2)
# Every row is its own process under its own timeout; results/logs/profiles go to OUT_DIR, summary.txt last.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-runs/ep-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-$PWD}
if [ -n "${EP_CHECK_SMOKE:-}" ]; then
  CFG="--config tiny-moe --device cpu --seq-len 64 --steps 1 --warmup 1 --override model.n_layers=2"
  MBS="2"; ROW_TIMEOUT=240
else
  CFG="--config z2all-moe-1b --seq-len 2048 --steps 3 --warmup 2"
  MBS="16 8 4"; ROW_TIMEOUT=300
fi
B="$PY benchmarks/distributed_throughput.py $CFG --accum 2 --timeout $ROW_TIMEOUT"

row() {  # name, args...: one measurement, its JSON and log under $OUT
  local name=$1; shift
  echo "== $name"
  timeout $((ROW_TIMEOUT + 30)) $B "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || echo "[$name] failed: $OUT/$name.log"
  grep -E '^\[' "$OUT/$name.log" | cut -c1-160
}

for mb in $MBS; do
  row "base1-mb$mb" --micro-batch "$mb" --gpus 1 --variants ours
  row "ep2-mb$mb" --micro-batch "$mb" --gpus 2 --variants ours-fsdp --ep 2
  [ -n "${EP_CHECK_SMOKE:-}" ] || row "dp2-mb$mb" --micro-batch "$mb" --gpus 2 --variants ours-fsdp
done
if [ -z "${EP_CHECK_SMOKE:-}" ]; then
  rm -rf "$OUT/prof"
  row ep2-mb16-profile --micro-batch 16 --gpus 2 --variants ours-fsdp --ep 2 --count-comm --profile "$OUT/prof"
  NCCL_PROTO=Simple row ep2-mb16-simple --micro-batch 16 --gpus 2 --variants ours-fsdp --ep 2
  row ep2-mb16-nosync --micro-batch 16 --gpus 2 --variants ours-fsdp --ep 2 --fsdp-no-sync
  row ep2-mb16-reshard --micro-batch 16 --gpus 2 --variants ours-fsdp --ep 2 \
    --override parallel.ep_reshard_after_forward=true
  # torch.compile: per block under ep (the exchanges stay eager), the whole model on 1 GPU; cold compile caches
  row base1-mb16-compile --micro-batch 16 --gpus 1 --variants ours --compile
  row ep2-mb16-compile --micro-batch 16 --gpus 2 --variants ours-fsdp --ep 2 --compile
  echo "== all-to-all alone"
  timeout 120 $PY -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/all_to_all_bandwidth.py \
    --tokens 8192,16384,32768 > "$OUT/a2a.log" 2>&1 || echo "[a2a] failed: $OUT/a2a.log"
  grep -vE '^(W|I)[0-9]' "$OUT/a2a.log" | tail -n 5
fi

$PY - "$OUT" "${EP_CHECK_SMOKE:-}" <<'EOF' | tee "$OUT/summary.txt"
"""One table: tokens/s, step, memory and scaling vs the 1-GPU row of the same micro-batch; the profiled
all-to-all time against the estimated volume."""
import json
import subprocess
import sys
from pathlib import Path

out, smoke = Path(sys.argv[1]), bool(sys.argv[2])
rows = {}
for f in sorted(out.glob("*.json")):
    data = json.loads(f.read_text())
    if data:
        rows[f.stem] = data[0]
print(f"{'row':18s} {'tok/s':>9s} {'step ms':>8s} {'GiB/GPU':>8s} {'scaling':>8s}")
for name, r in rows.items():
    base = rows.get(f"base1-mb{r['micro_batch']}")
    scale = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
    print(f"{name:18s} {r['tokens_per_s']:9,.0f} {1e3 * r['step_s']:8.0f} {max(r['mem_gib']):8.1f} {scale:>8s}")
if rows:
    r = next(iter(rows.values()))
    print(f"{r['device_name']}, torch {r['torch']}, seq {r['seq_len']}, accum {r['accum']}")
if not smoke:
    est = subprocess.run([sys.executable, "-m", "zero2all.cli", "estimate", "--config", "z2all-moe-1b", "--gpus", "2",
                          "--ep", "2", "--gpu", "h200", "--micro-batch", "16", "--grad-accum", "2", "--seq", "2048"],
                         capture_output=True, text=True).stdout
    line = next((x for x in est.splitlines() if x.startswith("all-to-all")), "all-to-all: estimate failed")
    print(f"estimate (micro-batch 16 x accum 2): {line}")
    for rank in (0, 1):
        prof = out / "prof" / f"ours-fsdp-2048-r{rank}.txt"
        if prof.exists():
            # columns: name, self CPU %, self CPU, CPU total %, CPU total, CPU avg, self CUDA, ..., calls;
            # the first table (by CUDA time), then the second (by host time): the first line of each name
            seen = set()
            for line in prof.read_text().splitlines():
                f = line.split()
                key = f[0] if f and f[0] in ("nccl:all_to_all", "cudaEventSynchronize") else line[:15]
                if key in seen or not (f and (key == f[0] or line.startswith("Self"))):
                    continue
                seen.add(key)
                print(f"profiled step, rank {rank}: " + (line.strip() if line.startswith("Self") else
                      f"{f[0]} self CUDA {f[-5]}, self CPU {f[2]}, {f[-1]} calls"))
EOF
