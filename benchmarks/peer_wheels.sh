#!/usr/bin/env bash
# Wheels of the benchmark peers (torchtitan, torchao, Liger) for a GPU machine without network, and their install.
#
#   bash benchmarks/peer_wheels.sh download DIR     # here (network): the pinned wheels for linux x86_64, CPython 3.12
#   eval "$(bash benchmarks/peer_wheels.sh install DIR [TARGET])"   # there: installs, then exports PYTHONPATH
#
# torch is NOT downloaded: the GPU machine's own (2.11+cu130) is used. Pins, and why:
#   torchtitan 0.2.2    0.3.0 needs torch.distributed.fsdp.DataParallelMeshDims (torch > 2.11); its unused HF
#                       `datasets` import is satisfied by a stub module (zero2all/bench/peers.py)
#   tyro, torchdata, docstring_parser, typeguard, typing_extensions >= 4.16   torchtitan's imports missing there
#   torchao 0.18.0      abi3 wheel built for CUDA 13; it also ships a top-level `test` package that would shadow
#                       Python's own, so it goes into its own target directory with that package removed
#   liger-kernel 0.8.5  the hf_liger row
# Everything together is about 5 MiB (the carried total must stay under 40 MiB).
set -euo pipefail

WHEELS=(torchtitan==0.2.2 torchao==0.18.0 tyro==1.0.17 torchdata==0.11.0 docstring_parser==0.18.0
        typeguard==4.6.0 typing_extensions==4.16.0 liger-kernel==0.8.5)
PY=${PYTHON:-python3}

usage() { sed -n '2,5p' "$0" >&2; exit 2; }

case "${1:-}" in
  download)
    dir=${2:?$(usage)}
    mkdir -p "$dir"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$dir" "${WHEELS[@]}"
    total=$(du -sm "$dir" | cut -f1)
    echo "$(ls "$dir"/*.whl | wc -l) wheels in $dir, ${total} MiB" >&2
    if [ "$total" -ge 40 ]; then echo "peer wheels: ${total} MiB is over the 40 MiB budget" >&2; exit 1; fi
    ;;
  install)
    dir=${2:?$(usage)}
    target=${3:-/tmp/z2all-peers}
    ls "$dir"/torchtitan-*.whl >/dev/null 2>&1 || { echo "peer wheels: no torchtitan wheel in $dir" >&2; exit 1; }
    ao=$(ls "$dir"/torchao-*.whl)
    others=$(ls "$dir"/*.whl | grep -v '/torchao-')
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$target/site" $others >&2
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$target/ao" "$ao" >&2
    rm -rf "$target/ao/test"  # torchao's own tests: a top-level `test` package would shadow Python's
    echo "export PYTHONPATH=$target/site:$target/ao\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
  *) usage ;;
esac
