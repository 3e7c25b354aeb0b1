#!/bin/bash
# Serving side by side on one GPU, in one call: ours (`z2all serve`'s engine, in process through serve_load.py),
# `transformers serve` (continuous batching, paged attention) on our HF export, and llama.cpp's `llama-server`
# (built here from source for CUDA) on our f16 GGUF export; the same weights, tokenizer, prompts and load.
#
#   OUT=DIR bash benchmarks/serve_peers.sh WHEELS_DIR LLAMA_CPP_TARBALL [ROWS]
#
# WHEELS_DIR: wheels for `transformers serve` that the GPU machine lacks (fastapi, openai, starlette, uvicorn,
# pydantic, ...: `pip download` them for CPython 3.12 x86-64); LLAMA_CPP_TARBALL: a llama.cpp source archive (its
# CMakeLists.txt, cmake, ggml, src, include, common, tools, vendor, scripts). ROWS (default all): a comma list of
#   B   build llama-server (CUDA, sm_90) in the background, into .serve-peers/llama-build (kept while the machine is)
#   W   wait for that build to finish (a call of B,P,W builds and prepares; a call right after it measures O,H,L)
#   P   the model files: benchmarks/serve_peers.py (tokenizer, random z2all-1.1b, HF and GGUF exports)
#   O   ours: serve_load.py --ckpt (--max-batch $MAX_BATCH, default 256)
#   H   transformers serve --continuous-batching (its defaults: sdpa_paged attention), driven over HTTP, on one GPU, the
#       first visible one, as ours (CUDA_VISIBLE_DEVICES narrowed to it: with two GPUs visible it spreads the model over
#       both, and its continuous batching worker dies on tensors of two devices), with an HF hub cache folder of its own
#       (a fresh machine has none, and its /v1/models answers 500 without one), readiness probed on /health;
#       serve_load.py --minimal-request, as it answers 422 to ignore_eos; its model directory's generation_config.json
#       names an unreachable end-of-text id (serve_peers.py), so its requests also run to $NEW_TOKENS (the table's
#       new-tokens column shows it)
#   L   llama-server -ngl 99 (flash attention: its default, auto), $LLAMA_SLOTS slots of 256 tokens each (default 256), driven over HTTP
# Load: $CLIENTS (default 1,64,256) clients, $REQUESTS (default 2) streamed requests each, prompts of $PROMPT_LEN
# tokens (default 128), $NEW_TOKENS new tokens (default 128), greedy, ignore_eos where the server has it (O, L; H: no
# end-of-text id, see above). Each row prints serve_load.py's table.
# A CPU check of rows O and H (no GPU, no llama.cpp; the tiny preset made beforehand, so that P has nothing to do):
#   python3 benchmarks/serve_peers.py .serve-peers/model --config tiny
#   OUT=/tmp/peers CLIENTS=1,4 PROMPT_LEN=16 NEW_TOKENS=8 bash benchmarks/serve_peers.sh /nonexistent none O,H
set -u
OUT=${OUT:?set OUT to a folder for the outputs}
WHEELS=${1:?wheels dir}; TARBALL=${2:?llama.cpp tarball}
ROWS=",${3:-B,P,O,H,L},"
CLIENTS=${CLIENTS:-1,64,256}; REQUESTS=${REQUESTS:-2}; MAX_BATCH=${MAX_BATCH:-256}; LLAMA_SLOTS=${LLAMA_SLOTS:-256}
PROMPT_LEN=${PROMPT_LEN:-128}; NEW_TOKENS=${NEW_TOKENS:-128}
mkdir -p "$OUT"
CACHE=$PWD/.serve-peers; M=$CACHE/model; mkdir -p "$CACHE"
export PYTHONUNBUFFERED=1
python3 -m pip install --quiet --no-index --no-deps --target /tmp/serve-peers-site "$WHEELS"/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/serve-peers-site
echo "serve peers $(date -u +%FT%H:%M:%SZ) $(git log -1 --format=%h 2>/dev/null) $(python3 -c 'import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")')"
want() { [[ "$ROWS" == *",$1,"* ]]; }
LOAD=(python3 benchmarks/serve_load.py --clients "$CLIENTS" --requests "$REQUESTS" --prompt-len "$PROMPT_LEN" \
  --max-tokens "$NEW_TOKENS")
wait_up() {  # wait_up URL PID SECONDS
  for _ in $(seq "$3"); do
    python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}
stop() { kill "$1" 2>/dev/null; for _ in $(seq 20); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done; kill -9 "$1" 2>/dev/null; }

BUILD_PID=
if want B && [ ! -x "$CACHE/llama-build/bin/llama-server" ]; then
  ( t0=$SECONDS; rm -rf "$CACHE/llama.cpp"; tar xzf "$TARBALL" -C "$CACHE" &&
    cmake -S "$CACHE/llama.cpp" -B "$CACHE/llama-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON > "$OUT/llama-cmake.txt" 2>&1 &&
    cmake --build "$CACHE/llama-build" --target llama-server -j 14 > "$OUT/llama-build.txt" 2>&1
    echo "llama-server build: rc $? ($((SECONDS - t0)) s)" ) &
  BUILD_PID=$!
fi
if want P && [ ! -f "$M/model-f16.gguf" ]; then
  python3 benchmarks/serve_peers.py "$M" > "$OUT/prepare.txt" 2>&1; echo "prepare: rc $?"; tail -2 "$OUT/prepare.txt"
fi
if want O; then
  timeout 400 "${LOAD[@]}" --ckpt "$M/ckpt" --max-batch "$MAX_BATCH" --json "$OUT/ours.json" > "$OUT/ours.txt" 2>&1
  echo "ours: rc $?"; tail -8 "$OUT/ours.txt"
fi
if want H; then
  # idempotent: also for model files an earlier version of serve_peers.py made
  python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from serve_peers import unreachable_eos
print("generation_config.json eos_token_id:", unreachable_eos(sys.argv[1]))' "$M/hf"
  mkdir -p "$CACHE/hf-hub"
  gpu=${CUDA_VISIBLE_DEVICES:-0}
  CUDA_VISIBLE_DEVICES=${gpu%%,*} HF_HUB_CACHE=$CACHE/hf-hub HF_HUB_OFFLINE=1 \
    transformers serve "$M/hf" --continuous-batching --port 8301 --host 127.0.0.1 > "$OUT/hf-server.txt" 2>&1 &
  pid=$!
  if wait_up http://127.0.0.1:8301/health $pid 240; then
    timeout 400 "${LOAD[@]}" --url http://127.0.0.1:8301 --model "$M/hf" --tokenizer "$M/tokenizer" \
      --minimal-request --json "$OUT/hf.json" > "$OUT/hf.txt" 2>&1
    echo "transformers serve: rc $?"; tail -10 "$OUT/hf.txt"
  else
    echo "transformers serve did not come up:"; tail -15 "$OUT/hf-server.txt"
  fi
  stop $pid
fi
[ -n "$BUILD_PID" ] && { want L || want W; } && wait "$BUILD_PID"
if want L; then
  if [ -x "$CACHE/llama-build/bin/llama-server" ]; then
    "$CACHE/llama-build/bin/llama-server" -m "$M/model-f16.gguf" -ngl 99 -np "$LLAMA_SLOTS" \
      -c $((256 * LLAMA_SLOTS)) --host 127.0.0.1 --port 8302 > "$OUT/llama-server.txt" 2>&1 &
    pid=$!
    if wait_up http://127.0.0.1:8302/health $pid 240; then
      python3 - > "$OUT/llama-raw.txt" 2>&1 <<'PY'
import json, urllib.request
body = {"model": "z2all", "prompt": "request 1: the model reads", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
req = urllib.request.Request("http://127.0.0.1:8302/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
print(urllib.request.urlopen(req, timeout=60).read().decode(errors="replace")[:6000])
PY
      timeout 400 "${LOAD[@]}" --url http://127.0.0.1:8302 --model z2all --tokenizer "$M/tokenizer" \
        --json "$OUT/llama.json" > "$OUT/llama.txt" 2>&1
      echo "llama-server: rc $?"; tail -8 "$OUT/llama.txt"
    else
      echo "llama-server did not come up:"; tail -15 "$OUT/llama-server.txt"
    fi
    stop $pid
  else
    echo "no llama-server binary:"; tail -20 "$OUT/llama-build.txt" 2>/dev/null; tail -5 "$OUT/llama-cmake.txt"
  fi
fi
wait
