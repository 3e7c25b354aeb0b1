#!/bin/bash
# The serving engines on one GPU, in one call: the paged engine's GPU tests, then both engines under the same load,
# then the prefix cache on a repeated system prompt.
#
#   OUT=DIR bash benchmarks/paged_gpu_check.sh [ROWS]
#
# z2all-1.1b randomly initialised in bf16, benchmarks/serve_load.py (in-process server, loopback HTTP, streamed,
# greedy, ignore_eos). ROWS (default T,PG,CO,PF; add CD for the column engine's default rows), a comma list of
#   T    pytest -m gpu on the serving and decode-kernel tests (the CUDA-only paths: graphs, pinned uploads,
#        draft-model speculation, grammar masks on CUDA logits, strided kernel inputs)
#   PG   --engine paged  --max-batch 256, 128-token prompts, 128 new tokens, clients 1,64,256, 2 requests each
#   CO   --engine column --max-batch 256, the same load
#   CD   --engine column with its default rows (256 on a GPU with the memory, z2all serve's default), the same load
#   C16  --engine column --max-batch 16 (the fused step's rows, the default before row buckets), the same load
#   CDE  CD with --no-prefill-graphs (one-prompt prefills eager, launched op by op), then CD again beside it
#        (same call: the TTFT split's prefill part without and with the graphs)
#   PFE  PF and PFN with --no-prefill-graphs (the paged engine's one-row prefill chunks eager)
#   PF   the paged engine with a shared 1,000-token prefix before 32 distinct prompt tokens, 32 new tokens, clients
#        1,16, 4 requests each: with prefix caching, then with --no-prefix-caching (the TTFT cut)
set -u
OUT=${OUT:?set OUT to a folder for the outputs}
ROWS=",${1:-T,PG,CO,PF},"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
echo "paged check $(date -u +%FT%H:%M:%SZ) $(git log -1 --format=%h 2>/dev/null) $(python3 -c \
  'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))')"
want() { [[ "$ROWS" == *",$1,"* ]]; }
row() {  # row NAME LIMIT_S CMD...
  local name=$1 lim=$2; shift 2
  want "$name" || return 0
  local t0=$SECONDS
  timeout -k 5 "$lim" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: rc $? ($((SECONDS - t0)) s)"
  grep -E '^\|| clients: | passed| failed|Error|error:' "$OUT/$name.txt" | tail -10 | cut -c1-260
}
L=(python3 benchmarks/serve_load.py --config z2all-1.1b --requests 2 --clients 1,64,256 --prompt-len 128
   --max-tokens 128)
P=(python3 benchmarks/serve_load.py --config z2all-1.1b --engine paged --shared-prefix 1000 --prompt-len 32
   --max-tokens 32 --clients 1,16 --requests 4)
row T 400 python3 -m pytest -q -m gpu tests/test_paged.py tests/test_scheduler.py tests/test_speculative.py \
  tests/test_structured_output.py tests/test_kernels_paged_attention.py tests/test_kernels_decode.py
row PG 200 "${L[@]}" --engine paged --max-batch 256 --json "$OUT/PG.json"
row CO 200 "${L[@]}" --engine column --max-batch 256 --json "$OUT/CO.json"
row CD 300 "${L[@]}" --engine column --json "$OUT/CD.json"
row C16 300 "${L[@]}" --engine column --max-batch 16 --json "$OUT/C16.json"
row CDE 300 "${L[@]}" --engine column --no-prefill-graphs --json "$OUT/CDE.json"
want CDE && ! want CD && ROWS="$ROWS,CD2," && row CD2 300 "${L[@]}" --engine column --json "$OUT/CD2.json"
row PF 150 "${P[@]}" --json "$OUT/PF.json"
want PF && ROWS="$ROWS,PFN,"
row PFN 150 "${P[@]}" --no-prefix-caching --json "$OUT/PFN.json"
want PFE && ROWS="$ROWS,PFEN,"
row PFE 150 "${P[@]}" --no-prefill-graphs --json "$OUT/PFE.json"
row PFEN 150 "${P[@]}" --no-prefill-graphs --no-prefix-caching --json "$OUT/PFEN.json"
