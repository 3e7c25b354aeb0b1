"""Zero2all: a readable and fast PyTorch stack for the whole small-LLM lifecycle.

    from zero2all import load_model, load_tokenizer
    model = load_model("runs/demo/final")          # our checkpoint dir or an HF Llama dir; eval mode
    tok = load_tokenizer("runs/demo/final")        # the tokenizer files the checkpoint carries
"""

__version__ = "0.1.0"


def load_model(path, device="cpu", dtype=None, ops=None):
    from zero2all.model.io import load_model as _load

    return _load(path, device=device, dtype=dtype, ops=ops)


def load_tokenizer(path):
    from zero2all.tokenizer import load_tokenizer as _load

    return _load(path)


__all__ = ["load_model", "load_tokenizer", "__version__"]
