"""Zero2all: a readable and fast PyTorch stack for the whole small-LLM lifecycle.

    from zero2all import load_model, load_tokenizer
    model = load_model("runs/demo/final")          # our model dir, an HF Llama dir or a training checkpoint; eval
    tok = load_tokenizer("runs/demo/final")        # the tokenizer files the checkpoint carries
"""

__version__ = "0.1.0"


def load_model(path, device="cpu", dtype=None, ops=None, config=None):
    """The one model loader (``zero2all.model.io.load_model``): our model directory, an HF Llama directory or a
    training checkpoint of any world size, with a LoRA adapter merged in when the directory carries one. ``ops``
    overrides the op switchboard, e.g. ``{"attention": "naive"}``. Eval mode."""
    from zero2all.model.io import load_model as _load

    return _load(path, device=device, dtype=dtype, ops=ops, config=config)


def load_tokenizer(path):
    from zero2all.tokenizer import load_tokenizer as _load

    return _load(path)


__all__ = ["load_model", "load_tokenizer", "__version__"]
