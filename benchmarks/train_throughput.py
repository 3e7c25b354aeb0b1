"""Training throughput on one GPU: our kernel ablations and the HF transformers peer in one table.

    python benchmarks/train_throughput.py                      # every row, z2all-1.1b, seq 2048, micro-batch 8
    python benchmarks/train_throughput.py --rows use_all,hf_liger --iters 10

The same as ``z2all bench train``; the logic lives in ``zero2all/bench.py``.
"""

import argparse
import sys

from zero2all.bench import add_arguments, main_from_args

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main_from_args(parser.parse_args()))
