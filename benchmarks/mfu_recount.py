"""Recount an MFU figure measured with the attention over the full s x s as the causal kernel computes it.

    python benchmarks/mfu_recount.py PRESET SEQ [OLD_MFU_PERCENT ...] [key=value overrides]
    python benchmarks/mfu_recount.py z2all-1.1b 65536 66.0        # cp2 at 64k: 66.0 % -> 38.3 %

MFU is proportional to tokens/s, so a figure printed with the old formula, tokens/s x (6N + 12 l h s) / peak,
becomes old x (6N + 6 l h s) / (6N + 12 l h s) under the current one (``zero2all.accounting.mfu``), with N, l and h
taken from the preset through ``zero2all.accounting`` (MoE presets: the active non-embedding parameters). Prints
the factor and one line "old -> new" per figure given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zero2all.accounting import mfu_flops_per_token  # noqa: E402
from zero2all.config import ConfigError, load_config  # noqa: E402


def recount_factor(model_cfg, seq_len: int) -> float:
    """(6N + 6 l h s) / (6N + 12 l h s): new MFU / MFU counted over the full s x s."""
    new = mfu_flops_per_token(model_cfg, seq_len)
    full = new + 6.0 * model_cfg.n_layers * model_cfg.hidden_dim * seq_len
    return new / full


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", help="a preset name or a config file (z2all-1.1b, llama2-7b, z2all-moe-1b, ...)")
    ap.add_argument("seq", type=int, help="sequence length the figure was measured at")
    ap.add_argument("rest", nargs="*", help="old MFU figures in percent, and key=value config overrides")
    args = ap.parse_args(argv)
    overrides = [a for a in args.rest if "=" in a]
    try:
        olds = [float(a.rstrip("%")) for a in args.rest if "=" not in a]
        cfg = load_config(args.preset, overrides).model
    except (ValueError, ConfigError, OSError) as e:
        print(f"mfu_recount: {e}", file=sys.stderr)
        return 2
    if args.seq < 1:
        print(f"mfu_recount: seq {args.seq}: must be >= 1", file=sys.stderr)
        return 2
    factor = recount_factor(cfg, args.seq)
    print(f"{args.preset} seq {args.seq}: (6N + 6lhs) / (6N + 12lhs) = {factor:.4f}")
    for old in olds:
        print(f"{old:.1f} % -> {old * factor:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
