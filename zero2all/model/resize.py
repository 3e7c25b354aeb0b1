"""``z2all resize-vocab``: give a checkpoint the embedding and LM-head rows of a new (usually extended) tokenizer.

Rules:

* The new tokenizer must keep every id of the checkpoint's tokenizer (same token string at the same id, as
  ``z2all extend-tokenizer`` writes it); ids it adds come after them.
* The model gets ``round_up(new tokenizer size, 64)`` rows. Shrinking is allowed only down to the ids the old
  tokenizer uses (rows no id of it reaches may go); anything smaller is refused.
* Rows ``< n_old`` (the ids of the old tokenizer) are copied. Each new row is the mean of the old rows (embedding
  and, separately, LM head) of the pieces the OLD tokenizer's model splits the new token's string into (its BPE
  merges applied to that one piece, no pre-tokenization: ``"Ġreturning"`` -> ``Ġre t ur n ing``). Special (added)
  tokens and tokens the old model cannot split into known ids get the mean of all old rows.
* The written directory is our model format (``z2all.json`` + ``model.safetensors``) with the new tokenizer's
  files; ``z2all.json`` records ``resize: {"old_vocab", "new_vocab", "from"}`` (``train.trainable =
  "new_embeddings"`` reads ``old_vocab``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from zero2all.config import ConfigError
from zero2all.tokenizer.hf import round_up


def _n_ids(tok) -> int:
    return tok.n_ids


def check_extends(old, new, old_name: str, new_name: str) -> int:
    """ConfigError unless ``new`` keeps every id of ``old``; returns the number of ids of ``old``."""
    n_old = _n_ids(old)
    if _n_ids(new) < n_old:
        raise ConfigError(f"{new_name}: has {_n_ids(new)} ids, fewer than the {n_old} the checkpoint's tokenizer "
                          f"({old_name}) uses: resizing would drop ids it encodes to")
    for i in range(n_old):
        a, b = old.id_to_token(i), new.id_to_token(i)
        if a != b:
            raise ConfigError(f"{new_name}: id {i} is {b!r}, but {a!r} in the checkpoint's tokenizer ({old_name}); "
                              f"the new tokenizer must keep the old ids (use `z2all extend-tokenizer`)")
    return n_old


def piece_ids(old, token: str) -> list[int] | None:
    """The old tokenizer's ids for the string of one new token (its BPE model on that piece), or None."""
    try:
        ids = old.model_piece_ids(token)
    except Exception:  # noqa: BLE001 - a model kind without tokenize(): no pieces
        return None
    n = _n_ids(old)
    return ids if ids and all(0 <= i < n for i in ids) else None


@torch.no_grad()
def resize_model(model, old_tok, new_tok, old_name: str = "old tokenizer", new_name: str = "new tokenizer"):
    """A new model with the rows of ``new_tok`` (see the module docstring); returns (model, info)."""
    from zero2all.model.z2all import build_model

    n_old = check_extends(old_tok, new_tok, old_name, new_name)
    n_new = _n_ids(new_tok)
    size = round_up(n_new)
    cfg = copy.deepcopy(model.cfg)
    cfg.vocab_size = size
    cfg.pad_vocab_to_multiple_of = 0
    new = build_model(cfg, device="meta").to_empty(device=model.embed_tokens.weight.device)
    new.tie_weights()
    sd = {k: v for k, v in model.state_dict().items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    missing = new.load_state_dict(sd, strict=False).missing_keys
    assert set(missing) <= {"embed_tokens.weight", "lm_head.weight"}, missing
    old_emb, old_head = model.embed_tokens.weight, model.lm_head.weight
    mats = [(new.embed_tokens.weight, old_emb)]
    if not cfg.tie_word_embeddings:
        mats.append((new.lm_head.weight, old_head))
    specials = set(new_tok.special_ids.values())
    split, fallback = 0, 0
    for dst, src in mats:
        dst[:n_old] = src[:n_old]
        mean_all = src[:n_old].float().mean(0).to(src.dtype)
        dst[n_old:] = mean_all
    for i in range(n_old, n_new):
        pieces = None if i in specials else piece_ids(old_tok, new_tok.id_to_token(i))
        if pieces is None:
            fallback += 1
            continue
        split += 1
        idx = torch.as_tensor(pieces, device=old_emb.device)
        for dst, src in mats:
            dst[i] = src[idx].float().mean(0).to(src.dtype)
    new.tie_weights()
    info = {"old_vocab": n_old, "new_vocab": n_new, "rows": size, "from_pieces": split, "mean_of_all": fallback}
    return new.eval(), info


def resize_vocab(ckpt: str | Path, tokenizer_dir: str | Path, out: str | Path, log=print) -> dict:
    """``z2all resize-vocab``: read ``ckpt`` (any directory ``load_model`` reads) and its tokenizer, write the
    resized model with the tokenizer of ``tokenizer_dir`` to ``out``."""
    from zero2all.fileio import claim_output_dir
    from zero2all.model.io import is_our_dir, load_model, save_model
    from zero2all.tokenizer import load_tokenizer

    ckpt, tokenizer_dir = Path(ckpt), Path(tokenizer_dir)
    claim_output_dir(out, "resize-vocab", inputs=[ckpt, tokenizer_dir])
    if not (ckpt / "tokenizer.json").exists():
        raise FileNotFoundError(f"{ckpt}: no tokenizer.json: resize-vocab needs the checkpoint's own tokenizer to "
                                f"know which rows its ids use")
    old_tok, new_tok = load_tokenizer(ckpt), load_tokenizer(tokenizer_dir)
    model = load_model(ckpt)
    if old_tok.vocab_size > model.cfg.padded_vocab_size:
        raise ConfigError(f"{ckpt}: its tokenizer has {old_tok.vocab_size} ids but the model only "
                          f"{model.cfg.padded_vocab_size} rows")
    new, info = resize_model(model, old_tok, new_tok, str(ckpt / "tokenizer.json"),
                             str(tokenizer_dir / "tokenizer.json"))
    extra = {"tokenizer_hash": new_tok.hash, "resize": {**info, "from": str(ckpt), "tokenizer": str(tokenizer_dir)}}
    if is_our_dir(ckpt):
        meta = json.loads((ckpt / "z2all.json").read_text(encoding="utf-8"))
        for key in ("imported_from",):
            if key in meta:
                extra[key] = meta[key]
    save_model(new, out, extra=extra, tokenizer_dir=tokenizer_dir, kind="resize-vocab")
    log(f"resized {ckpt}: {model.cfg.padded_vocab_size} -> {info['rows']} rows ({info['old_vocab']} ids kept, "
        f"{info['from_pieces']} new rows from the mean of their old pieces, {info['mean_of_all']} from the mean of "
        f"all rows); wrote {out}")
    return info
