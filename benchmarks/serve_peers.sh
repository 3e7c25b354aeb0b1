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
#   H   transformers serve --continuous-batching (its defaults: sdpa_paged attention), driven over HTTP
#   L   llama-server -ngl 99 (flash attention: its default, auto), $LLAMA_SLOTS slots of 256 tokens each (default 256), driven over HTTP
# Load: $CLIENTS (default 1,64,256) clients, $REQUESTS (default 2) streamed requests each, 128-token prompts,
# 128 new tokens, greedy, ignore_eos where the server has it. Each row prints serve_load.py's table.
set -u
OUT=${OUT:?set OUT to a folder for the outputs}
WHEELS=${1:?wheels dir}; TARBALL=${2:?llama.cpp tarball}
ROWS=",${3:-B,P,O,H,L},"
CLIENTS=${CLIENTS:-1,64,256}; REQUESTS=${REQUESTS:-2}; MAX_BATCH=${MAX_BATCH:-256}; LLAMA_SLOTS=${LLAMA_SLOTS:-256}
mkdir -p "$OUT"
CACHE=$PWD/.serve-peers; M=$CACHE/model; mkdir -p "$CACHE"
export PYTHONUNBUFFERED=1
python3 -m pip install --quiet --no-index --no-deps --target /tmp/serve-peers-site "$WHEELS"/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/serve-peers-site
echo "serve peers $(date -u +%FT%H:%M:%SZ) $(git log -1 --format=%h 2>/dev/null) $(python3 -c \
  'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))')"
want() { [[ "$ROWS" == *",$1,"* ]]; }
LOAD=(python3 benchmarks/serve_load.py --clients "$CLIENTS" --requests "$REQUESTS" --prompt-len 128 --max-tokens 128)
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
  transformers serve "$M/hf" --continuous-batching --port 8301 --host 127.0.0.1 \
    > "$OUT/hf-server.txt" 2>&1 &
  pid=$!
  if wait_up http://127.0.0.1:8301/v1/models $pid 240; then
    timeout 400 "${LOAD[@]}" --url http://127.0.0.1:8301 --model "$M/hf" --tokenizer "$M/tokenizer" \
      --json "$OUT/hf.json" > "$OUT/hf.txt" 2>&1
    echo "transformers serve: rc $?"; tail -8 "$OUT/hf.txt"
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
