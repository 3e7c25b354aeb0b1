"""The model files the serving comparison needs, made on the GPU machine: one randomly initialised preset with a
byte-level BPE tokenizer trained on the embedded standard-library corpus, saved as our checkpoint, exported as an HF
``LlamaForCausalLM`` directory (for ``transformers serve``) and as one f16 GGUF file (for llama.cpp's
``llama-server``). All three servers then load the same weights and the same tokenizer.

    python benchmarks/serve_peers.py DIR [--config z2all-1.1b]      # DIR/ckpt, DIR/hf, DIR/model-f16.gguf
    python benchmarks/serve_peers.py DIR --config tiny               # the same in seconds on a CPU

Random weights decode as fast as trained ones (the work per token does not depend on the values), but they may pick
the end-of-text token at any step. The load generator (``benchmarks/serve_load.py``) asks ours and ``llama-server``
for exactly ``--max-tokens`` tokens with the ``ignore_eos`` extension. ``transformers serve`` refuses that field
(422), and a minimum of new tokens cannot be asked of it either (a ``min_new_tokens`` in its ``generation_config``
request field becomes a logits processor that its continuous batching drops). Its continuous batching stops a
request at ``max_tokens`` (exactly: the closing chunk's usage says how many) or at an id of the generation config's
``eos_token_id``, which it reads from the model directory's ``generation_config.json``. So the HF directory made
here is for benchmarking only: its ``generation_config.json`` names as end-of-text the id one past the last logit
(``vocab_size``), which no sampled token can equal, and every request there runs to ``max_tokens`` like the others
(serve_load's tokens-per-request column shows it). Our checkpoint and the GGUF file keep the model's own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def unreachable_eos(hf_dir: str | Path) -> int:
    """Rewrite ``hf_dir/generation_config.json`` (atomically) so that its ``eos_token_id`` is ``vocab_size``: an id
    no logit stands for, so generation never stops at an end-of-text token and runs to its ``max_new_tokens``
    (see the module's docstring). Returns that id."""
    from zero2all.fileio import save_json

    hf_dir = Path(hf_dir)
    vocab = int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])
    path = hf_dir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    gen["eos_token_id"] = vocab
    save_json(gen, path)
    return vocab


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
    eos = unreachable_eos(out / "hf")
    print(f"{out / 'hf'}: generation_config.json eos_token_id = {eos} (unreachable: no early stop)", flush=True)
    subprocess.run([sys.executable, "-m", "zero2all.cli", "export-gguf", "--ckpt", str(out / "ckpt"), "--out",
                    str(out / "model-f16.gguf"), "--dtype", "f16", "--overwrite"], check=True)
    print(f"checkpoint, HF and GGUF under {out} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
