"""Our model against llama.cpp on the same GGUF file: logits and greedy tokens (not in CI: llama.cpp is a C++ build).

A tiny model (2 layers, 128 wide, grouped-query attention, random weights) with a byte-level BPE tokenizer trained
on a few English and code lines is exported with ``z2all export-gguf`` as f32 and f16; llama.cpp (through
``llama-cpp-python``) loads each file and evaluates the same token ids as our model (ids, so that the tokenizers'
pre-tokenisation cannot blur the comparison; the tokenizers are compared apart, on the same texts). Our side runs
the model rebuilt from the same file (``load_gguf``, fp32 compute), so both read the same rounded weights. Printed: the
largest |logit difference| relative to the largest |logit| over all prompt positions, and how many of 48 greedy
tokens agree, with llama.cpp's KV cache in f32 and in its default f16.

    pip install --target DIR llama-cpp-python      # a C++ build: minutes to an hour
    python benchmarks/llama_cpp_compare.py --site DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

TEXTS = ["the model reads text and predicts the next token of every document it sees.",
         "def forward(self, x):\n    return self.proj(x) * 2  # scaled\n",
         "while the tokenizer splits words into pieces learned from a corpus of plain english sentences."]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", default=None, help="directory where llama-cpp-python was installed (pip --target)")
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    if args.site:
        sys.path.append(args.site)  # after the environment's own packages (numpy, jinja2)
    import llama_cpp
    import numpy as np
    import torch

    from zero2all.config import ModelConfig, OpsConfig
    from zero2all.model.gguf import export_gguf, load_gguf
    from zero2all.model.io import save_model
    from zero2all.model.z2all import build_model
    from zero2all.tokenizer import train_tokenizer

    work = Path(tempfile.mkdtemp(prefix="z2all-llamacpp-"))
    corpus = work / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 40))
    tok = train_tokenizer([str(corpus)], 384, work / "tok", log=lambda *a: None)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_dim=128, intermediate_size=256, n_layers=2, n_heads=4,
                      n_kv_heads=2, max_seq_len=256, initializer_range=0.2, ops=OpsConfig.plain())
    model = build_model(cfg, seed=0).eval()
    save_model(model, work / "ck", tokenizer_dir=work / "tok")
    prompt = [tok.eos_id] + tok.encode(TEXTS[0] + " " + TEXTS[1])

    def run_ours(m):
        """Our logits over the prompt (float64) and our greedy continuation."""
        with torch.no_grad():
            logits = m(torch.tensor([prompt]))[0][0].double().numpy()
            out, ids = [], list(prompt)
            for _ in range(args.new_tokens):
                out.append(int(m(torch.tensor([ids]))[0][0, -1].argmax()))
                ids.append(out[-1])
        return logits, out

    print(json.dumps({"llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
                      "prompt_tokens": len(prompt), "vocab": tok.vocab_size}))
    f32 = llama_cpp.GGML_TYPE_F32
    for dtype, cache in (("f32", "f32"), ("f32", "f16"), ("f16", "f32"), ("f16", "f16"), ("q8_0", "f32")):
        path = export_gguf(work / "ck", work / f"tiny-{dtype}.gguf", dtype=dtype, log=lambda *a: None)
        # ours on the file's own weights (rounded to f16 for an f16 file): the same numbers llama.cpp reads
        ours, greedy = run_ours(load_gguf(path)[0].float().eval())
        kv = {"type_k": f32, "type_v": f32} if cache == "f32" else {}  # llama.cpp's default KV cache is f16
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=1,
                              n_batch=256, **kv)
        llm.eval(prompt)
        theirs = np.array(llm.scores[:len(prompt)], dtype=np.float64)
        rel = float(np.abs(theirs - ours).max() / np.abs(ours).max())
        theirs_greedy = []
        for _ in range(args.new_tokens):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            theirs_greedy.append(nxt)
            llm.eval([nxt])
        same_prefix = next((i for i, (a, b) in enumerate(zip(greedy, theirs_greedy)) if a != b), len(greedy))
        token_match = [llm.tokenize(t.encode(), add_bos=False, special=False) == tok.encode(t) for t in TEXTS]
        print(json.dumps({"dtype": dtype, "kv_cache": cache, "max_rel_logit_diff": rel,
                          "argmax_agree": int((theirs.argmax(-1) == ours.argmax(-1)).sum()),
                          "positions": len(prompt), "greedy_same_prefix": same_prefix,
                          "greedy_tokens": len(greedy), "tokenizer_ids_equal": token_match}), flush=True)
        llm.close()


if __name__ == "__main__":
    main()
