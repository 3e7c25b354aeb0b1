"""``z2all extend-tokenizer``: add up to N tokens learned on a new corpus to a byte-level BPE tokenizer.

The rule: a byte-level BPE is trained on the corpus with the base's own normaliser and pre-tokenizer (the same
pieces, the same byte alphabet); its merges are then walked in the order they were learned, and a merge ``(a, b)``
is appended to the base's merges when ``a + b`` is not a token of the base yet and ``a`` and ``b`` both are tokens
(of the base, or appended before it), until N tokens were added. Appended merges rank after every base merge, so a
text is first merged exactly as by the base and only then by the new merges: text of the base's own domain changes
little. Every id of the base keeps its token (special tokens included); the new tokens take the ids after the
base's, and the vocabulary is padded with reserved special tokens to a multiple of 64.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from zero2all.tokenizer.hf import Tokenizer, load_tokenizer, reserved_token, round_up


def _merge_pair(m) -> tuple[str, str]:
    return tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1])


def extend_bpe(base: Tokenizer, texts: Sequence[str], n_add: int, min_frequency: int = 2) -> tuple[Tokenizer, dict]:
    """The base tokenizer with up to ``n_add`` tokens learned on ``texts`` (see the module docstring); returns
    (tokenizer, info)."""
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import models, trainers

    if n_add < 1:
        raise ValueError(f"--add: {n_add} must be at least 1")
    raw = json.loads(base._json)
    model = raw.get("model") or {}
    if model.get("type") != "BPE" or "merges" not in model:
        raise ValueError("--base: not a BPE tokenizer (tokenizer.json model.type must be BPE with merges)")
    if model.get("byte_fallback"):
        raise ValueError("--base: a SentencePiece-style BPE (byte_fallback); extending those is not supported, only "
                         "byte-level BPE")
    vocab: dict[str, int] = dict(model["vocab"])
    # the library numbers an added token that is not a model entry after the model's entries: every added token
    # becomes an entry at its own id, so that new entries cannot shift them
    for t in raw.get("added_tokens", []):
        vocab.setdefault(t["content"], t["id"])
    merges = [list(_merge_pair(m)) for m in model["merges"]]
    n_base = base._full.get_vocab_size(with_added_tokens=True)

    learner = _HFTokenizer(models.BPE())
    full = _HFTokenizer.from_str(base._json)
    if full.normalizer is not None:
        learner.normalizer = full.normalizer
    if full.pre_tokenizer is not None:
        learner.pre_tokenizer = full.pre_tokenizer
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 4 * n_add + 256, min_frequency=min_frequency,
                                  initial_alphabet=alphabet, show_progress=False)
    learner.train_from_iterator(texts, trainer)
    learned = json.loads(learner.to_str())["model"]["merges"]
    added: list[str] = []
    next_id = n_base
    for m in learned:
        a, b = _merge_pair(m)
        tok = a + b
        if tok in vocab or a not in vocab or b not in vocab:
            continue
        vocab[tok] = next_id
        next_id += 1
        merges.append([a, b])
        added.append(tok)
        if len(added) >= n_add:
            break
    model["vocab"] = vocab
    model["merges"] = merges
    # reserved special tokens up to a multiple of 64, with explicit ids after the new tokens (the library would
    # number them from the model's entry count, which the base's added tokens leave below the largest id)
    taken = {t["content"] for t in raw.get("added_tokens", [])}
    n_pad, k = round_up(next_id) - next_id, 0
    for j in range(n_pad):
        while reserved_token(k) in taken or reserved_token(k) in vocab:
            k += 1
        taken.add(reserved_token(k))
        vocab[reserved_token(k)] = next_id + j
        raw.setdefault("added_tokens", []).append(
            {"id": next_id + j, "content": reserved_token(k), "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True})
    text = json.dumps(raw, ensure_ascii=False)
    meta = dict(base.meta)
    meta.pop("hash", None)
    meta["extended"] = {"base_hash": base.hash, "base_ids": n_base, "added": len(added), "asked": n_add,
                        "reserved_padding": n_pad}
    return Tokenizer(text, meta=meta), meta["extended"]


def bytes_per_token(tok: Tokenizer, texts: Sequence[str]) -> float:
    n_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    n_tok = sum(len(ids) for ids in tok.encode_batch(list(texts)))
    return n_bytes / n_tok if n_tok else float("nan")


def _read(inputs, text_field=None, txt_mode="file") -> list[str]:
    from zero2all.corpus.readers import iter_records

    return [r["content"] for r in iter_records(list(inputs), text_field=text_field, txt_mode=txt_mode) if r["content"]]


def extend_tokenizer(base_dir: str | os.PathLike, inputs: Sequence[str], n_add: int, out_dir: str | os.PathLike,
                     base_text: Sequence[str] = (), heldout_every: int = 10, min_frequency: int = 2,
                     text_field: str | None = None, txt_mode: str = "file", log=print) -> dict:
    """``z2all extend-tokenizer``: learn on ``inputs`` (every ``heldout_every``-th document held out), write the
    extended tokenizer to ``out_dir`` and report bytes/token before/after on the held-out documents and on
    ``base_text`` (text of the base's own domain, optional). Returns the report."""
    base = load_tokenizer(base_dir)
    docs = _read(inputs, text_field, txt_mode)
    if not docs:
        raise ValueError(f"--input {' '.join(map(str, inputs))}: no text")
    if len(docs) >= 2 and heldout_every > 1:
        heldout = docs[::heldout_every]
        train = [d for i, d in enumerate(docs) if i % heldout_every]
    else:
        heldout, train = docs, docs
    tok, info = extend_bpe(base, train, n_add, min_frequency=min_frequency)
    report = {**info, "heldout": {"docs": len(heldout), "bytes_per_token_before": bytes_per_token(base, heldout),
                                  "bytes_per_token_after": bytes_per_token(tok, heldout)}}
    if base_text:
        own = _read(base_text, text_field, txt_mode)
        report["base_domain"] = {"docs": len(own), "bytes_per_token_before": bytes_per_token(base, own),
                                 "bytes_per_token_after": bytes_per_token(tok, own)}
    tok.meta["extended"] = report
    tok.save(out_dir)
    log(f"added {info['added']} tokens (asked {n_add}) to {base_dir}: vocab {base.vocab_size} -> {tok.vocab_size}; "
        f"wrote {out_dir} (hash {tok.hash[:16]})")
    for key, name in (("heldout", "held-out corpus text"), ("base_domain", "base-domain text")):
        if key in report:
            r = report[key]
            log(f"bytes/token on {name} ({r['docs']} docs): {r['bytes_per_token_before']:.3f} -> "
                f"{r['bytes_per_token_after']:.3f}")
    if info["added"] < n_add:
        log(f"warning: the corpus gave only {info['added']} new tokens of the {n_add} asked for (add text or lower "
            f"--min-frequency)")
    return report


__all__ = ["extend_bpe", "extend_tokenizer", "bytes_per_token"]

