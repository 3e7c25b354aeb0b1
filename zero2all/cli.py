"""``z2all <command>``: argument parsing only; each command calls one function of the package.

Each command registers itself with ``@command(name, help, examples)`` on a function that adds its arguments and
returns the function to run. Heavy imports (torch, tokenizers) happen inside the runner, so ``z2all --help`` is
quick.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

_COMMANDS: list[tuple[str, str, str, Callable]] = []


def command(name: str, help: str, examples: str = ""):
    def register(fn):
        _COMMANDS.append((name, help, examples, fn))
        return fn

    return register


def _overrides(p: argparse.ArgumentParser):
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides, e.g. model.n_layers=4 train.lr=1e-3")


# ---------------------------------------------------------------------------------------------------- model


@command("info", "print a config's architecture and parameter counts (no weights are allocated)",
         "  z2all info --config z2all-1.1b\n  z2all info --config tiny model.n_layers=8")
def _info(p):
    p.add_argument("--config", default="z2all-1.1b", help="preset name or .toml path")
    _overrides(p)

    def run(args):
        from zero2all.config import load_config, to_dict
        from zero2all.model.z2all import build_model

        cfg = load_config(args.config, args.overrides).model
        model = build_model(cfg, device="meta")
        for k, v in to_dict(cfg).items():
            print(f"{k:26s} {v}")
        print(f"{'parameters':26s} {model.num_params():,}")
        print(f"{'non-embedding parameters':26s} {model.num_params(non_embedding=True):,}")

    return run


@command("export-hf", "write a checkpoint as an HF LlamaForCausalLM directory (config.json + safetensors)",
         "  z2all export-hf --ckpt runs/demo/final --out runs/demo/hf\n"
         "  z2all export-hf --ckpt runs/demo/final --out hf-bf16 --dtype bfloat16")
def _export_hf(p):
    p.add_argument("--ckpt", required=True, help="our checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokenizer", default=None, help="tokenizer directory to include (default: the checkpoint's)")
    p.add_argument("--merge-lora", action="store_true", help="merge LoRA adapters into the weights first")

    def run(args):
        from zero2all.model.io import export_hf

        model = None
        if args.merge_lora:
            from zero2all.model.lora import load_merged_model

            model = load_merged_model(args.ckpt)
        out = export_hf(args.ckpt, args.out, dtype=args.dtype, tokenizer_dir=args.tokenizer, model=model)
        print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained('{out}'))")

    return run


@command("import-hf", "convert an HF Llama-architecture directory into our checkpoint format",
         "  z2all import-hf --hf path/to/llama --out runs/imported")
def _import_hf(p):
    p.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors or *.bin)")
    p.add_argument("--out", required=True)

    def run(args):
        from zero2all.model.io import import_hf

        print(f"wrote {import_hf(args.hf, args.out)}")

    return run


# ---------------------------------------------------------------------------------------------------- data
# (train-tokenizer, prepare)

# ---------------------------------------------------------------------------------------------------- training
# (pretrain, sft, dpo, demo)

# ---------------------------------------------------------------------------------------------------- inference
# (generate, chat, serve)

# ---------------------------------------------------------------------------------------------------- accounting
# (estimate)

# ---------------------------------------------------------------------------------------------------- benchmarks
# (bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="z2all", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Zero2all: data, tokenizer, Llama-2 model, training, post-training and inference.",
        epilog="Run `z2all COMMAND --help` for a command's options and examples.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, examples, fn in _COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text,
                           epilog=("examples:\n" + examples) if examples else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(_run=fn(p))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    from zero2all.config import ConfigError

    try:
        result = args._run(args)
    except ConfigError as e:
        print(f"z2all {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"z2all {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
