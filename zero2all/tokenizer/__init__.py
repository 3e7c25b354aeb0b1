"""Tokenizers: training (``train.py``: byte-level BPE or SentencePiece BPE) and the run-time tokenizer stored as HF
files (``hf.py``).

    from zero2all.tokenizer import train_tokenizer, load_tokenizer
    tok = train_tokenizer("stdlib", vocab_size=8192, out_dir="runs/tok")
    tok = load_tokenizer("runs/tok")
    ids = tok.encode("def f(x):\\n    return x\\n")        # raw text: never a special id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
"""

from zero2all.tokenizer.hf import CHAT_TEMPLATE, EOS, IM_END, IM_START, PAD, Tokenizer, load_tokenizer, special_tokens


def train_tokenizer(inputs, vocab_size, out_dir=None, backend="hf", **kwargs) -> Tokenizer:
    """See :func:`zero2all.tokenizer.train.train_tokenizer` (imported lazily: it pulls in the readers)."""
    from zero2all.tokenizer.train import train_tokenizer as _train

    return _train(inputs, vocab_size, out_dir, backend=backend, **kwargs)


__all__ = ["Tokenizer", "load_tokenizer", "train_tokenizer", "special_tokens", "CHAT_TEMPLATE", "EOS", "PAD",
           "IM_START", "IM_END"]
