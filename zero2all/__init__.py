"""Zero2all: a readable and fast PyTorch stack for the whole small-LLM lifecycle.

    from zero2all import load_model, load_tokenizer
    model = load_model("runs/demo/final")          # our checkpoint dir or an HF Llama dir; eval mode
    tok = load_tokenizer("runs/demo/final")        # the tokenizer files the checkpoint carries
"""

__version__ = "0.1.0"


def load_model(path, device="cpu", dtype=None, ops=None):
    """Our checkpoint dir or an HF Llama dir, in eval mode. A directory that carries a LoRA adapter (PEFT files
    beside the weights or in ``adapter/``, or only the adapter naming its base) loads with the adapter merged in.
    ``ops`` overrides the op switchboard, e.g. ``{"attention": "naive"}``."""
    from zero2all.model.io import load_model as _load
    from zero2all.model.lora import find_adapter_dir, load_merged_model

    if find_adapter_dir(path) is None:
        return _load(path, device=device, dtype=dtype, ops=ops)
    model = load_merged_model(path, device=device, dtype=dtype)
    for key, value in (ops or {}).items():
        setattr(model.cfg.ops, key, value)
    model.cfg.validate()
    return model


def load_tokenizer(path):
    from zero2all.tokenizer import load_tokenizer as _load

    return _load(path)


__all__ = ["load_model", "load_tokenizer", "__version__"]
