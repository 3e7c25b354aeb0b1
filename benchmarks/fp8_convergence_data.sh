#!/usr/bin/env bash
# The data of the FP8 convergence check, made from what any machine with this Python has: a 16k BPE trained on
# the standard library, and shards of the standard library, the torch and transformers package sources and
# /usr/share/doc (50 MB of text at most; 1 % held out).
#   bash benchmarks/fp8_convergence_data.sh OUT_DIR        -> OUT_DIR/tok, OUT_DIR/shards
set -euo pipefail
out=${1:?usage: bash benchmarks/fp8_convergence_data.sh OUT_DIR}
P=$(command -v python || command -v python3)
site=$("$P" -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
mkdir -p "$out"
inputs=(stdlib "torch=$site/torch/**/*.py")
[ -d "$site/transformers" ] && inputs+=("transformers=$site/transformers/**/*.py")
[ -d /usr/share/doc ] && compgen -G "/usr/share/doc/**/*.txt" > /dev/null && inputs+=("doc=/usr/share/doc/**/*.txt")
"$P" -m zero2all.cli train-tokenizer --input stdlib --vocab-size 16384 --out "$out/tok"
"$P" -m zero2all.cli prepare --input "${inputs[@]}" --tokenizer "$out/tok" --out "$out/shards" \
  --valid-fraction 0.01 --target-mb 50 --no-progress
