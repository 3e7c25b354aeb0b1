"""The model files the serving comparison needs, made on the GPU machine: one randomly initialised preset with a
byte-level BPE tokenizer trained on the embedded standard-library corpus, saved as our checkpoint, exported as an HF
``LlamaForCausalLM`` directory (for ``transformers serve``) and as one f16 GGUF file (for llama.cpp's
``llama-server``). All three servers then load the same weights and the same tokenizer.

    python benchmarks/serve_peers.py DIR [--config z2all-1.1b]      # DIR/ckpt, DIR/hf, DIR/model-f16.gguf

Random weights decode as fast as trained ones (the work per token does not depend on the values); the load
generator (``benchmarks/serve_load.py``) asks every server for the same number of tokens with ``ignore_eos``
(``transformers serve`` has no such switch: a request there may stop early at the end-of-text token, and the
tokens/s column counts the tokens each server reports, so an early stop costs it nothing in that column).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--config", default="z2all-1.1b")
    ap.add_argument("--vocab-size", type=int, default=0, help="0 = the preset's")
    args = ap.parse_args(argv)

    import torch

    from zero2all.config import load_config
    from zero2all.model.io import export_hf, save_model
    from zero2all.model.z2all import Z2all
    from zero2all.tokenizer.train import train_tokenizer

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config).model
    t0 = time.time()
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        train_tokenizer(["stdlib"], args.vocab_size or cfg.vocab_size, out_dir=tok_dir)
    print(f"tokenizer {tok_dir} ({time.time() - t0:.0f} s)", flush=True)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Z2all(cfg)
    model = model.to(torch.bfloat16)
    save_model(model, out / "ckpt", tokenizer_dir=tok_dir)
    del model
    export_hf(out / "ckpt", out / "hf", dtype="bfloat16")
    subprocess.run([sys.executable, "-m", "zero2all.cli", "export-gguf", "--ckpt", str(out / "ckpt"), "--out",
                    str(out / "model-f16.gguf"), "--dtype", "f16", "--overwrite"], check=True)
    print(f"checkpoint, HF and GGUF under {out} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
