"""``z2all extend-tokenizer``: add up to N tokens learned on a new corpus to a byte-level BPE tokenizer.

The rule: a byte-level BPE is trained on the corpus with the base's own normaliser and pre-tokenizer (the same
pieces, the same byte alphabet); its merges are then walked in the order they were learned, and a merge ``(a, b)``
is appended to the base's merges when ``a + b`` is not a token of the base yet and ``a`` and ``b`` both are tokens
(of the base, or appended before it), until N tokens were added. Appended merges rank after every base merge, so a
text is first merged exactly as by the base and only then by the new merges: text of the base's own domain changes
little. Every id of the base keeps its token (special tokens included); the new tokens take the ids after the
base's, and the vocabulary is padded with reserved special tokens to a multiple of 64.

SentencePiece BPE tokenizers (``backend="spm"``, stored with their ``tokenizer.model``) are extended in the
model proto (:func:`extend_spm`): a SentencePiece BPE is trained on the corpus with the base's settings, and its
pieces that the base lacks are appended to the base proto in the order learned, each with a score below every
base piece's (so their merges rank after the base's), a multi-character piece only when it splits into two pieces
already there (its parts are added first); the base's reserved padding tokens become control pieces at their ids
first, so every base id (user pieces, byte pieces and special tokens included) keeps its piece. The tokenizer.json
is converted from the extended proto, as for a freshly trained one.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from zero2all.fileio import claim_output_dir
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
    raw = json.loads(base.tokenizer_json)
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
    n_base = base.n_ids

    learner = _HFTokenizer(models.BPE())
    full = _HFTokenizer.from_str(base.tokenizer_json)
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


def extend_spm(base: Tokenizer, texts: Sequence[str], n_add: int, seed: int = 0) -> tuple[Tokenizer, dict]:
    """The SentencePiece base tokenizer with up to ``n_add`` pieces learned on ``texts`` (see the module
    docstring); returns (tokenizer, info)."""
    from zero2all.tokenizer.hf import sentencepiece_to_tokenizer_json

    if n_add < 1:
        raise ValueError(f"--add: {n_add} must be at least 1")
    proto = _spm_base_proto(base)
    n_base = base.n_ids
    added = _append_spm_pieces(proto, _learn_spm_pieces(proto, texts, n_add, seed), n_add)
    n_new = len(proto.pieces)
    _pad_spm_proto(proto)
    new_proto = proto.SerializeToString()
    specials = [p.piece for p in proto.pieces if p.type == _spm_piece_type().CONTROL]
    text, extra = sentencepiece_to_tokenizer_json(new_proto, specials)
    meta = dict(base.meta)
    meta.pop("hash", None)
    meta.update(extra)
    meta["extended"] = {"base_hash": base.hash, "base_ids": n_base, "added": len(added), "asked": n_add,
                        "reserved_padding": len(proto.pieces) - n_new}
    return Tokenizer(text, meta=meta, extra_files={"tokenizer.model": new_proto}), meta["extended"]


def _spm_piece_type():
    from sentencepiece import sentencepiece_model_pb2 as pb

    return pb.ModelProto.SentencePiece


def _spm_base_proto(base: Tokenizer):
    """The base's ``tokenizer.model`` proto (a SentencePiece BPE), with the base's reserved padding (added tokens
    after the proto's pieces) entered as control pieces at their ids: one piece per id of the base."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    data = base.extra_file("tokenizer.model")
    if data is None:
        raise ValueError("--base: a SentencePiece tokenizer (backend spm) without its tokenizer.model; the "
                         "proto is needed to extend it")
    proto = pb.ModelProto()
    proto.ParseFromString(data)
    if proto.trainer_spec.model_type != pb.TrainerSpec.BPE:
        raise ValueError("--base: tokenizer.model is not a SentencePiece BPE model (trainer_spec.model_type)")
    for i in range(len(proto.pieces), base.n_ids):
        name = base.id_to_token(i)
        if name is None or name not in base.special_ids:
            raise ValueError(f"--base: id {i} ({name!r}) of tokenizer.json is neither a piece of tokenizer.model "
                             f"nor a special token: the two files do not belong together")
        proto.pieces.add(piece=name, score=0.0, type=_spm_piece_type().CONTROL)
    return proto


def _learn_spm_pieces(proto, texts: Sequence[str], n_add: int, seed: int) -> list[str]:
    """The normal pieces of a SentencePiece BPE trained on ``texts`` with the base proto's own settings
    (normalisation, whitespace, digits, coverage), in the order learned."""
    import io

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    from zero2all.tokenizer.train import SPM_MAX_SENTENCE_BYTES, _spm_sentences

    spec = proto.trainer_spec
    chars = {c for t in texts for c in t if c != "\n"}
    model = io.BytesIO()
    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=_spm_sentences(texts), model_writer=model, model_type="bpe",
        vocab_size=len(chars) + 2 * n_add + 300, hard_vocab_limit=False, byte_fallback=True, unk_id=0, bos_id=-1,
        eos_id=-1, pad_id=-1, normalization_rule_name="identity",
        add_dummy_prefix=proto.normalizer_spec.add_dummy_prefix,
        remove_extra_whitespaces=proto.normalizer_spec.remove_extra_whitespaces,
        allow_whitespace_only_pieces=spec.allow_whitespace_only_pieces, split_digits=spec.split_digits,
        character_coverage=spec.character_coverage, max_sentence_length=SPM_MAX_SENTENCE_BYTES,
        input_sentence_size=0, shuffle_input_sentence=False, num_threads=os.cpu_count() or 1, minloglevel=2)
    learned = pb.ModelProto()
    learned.ParseFromString(model.getvalue())
    return [p.piece for p in learned.pieces if p.type == _spm_piece_type().NORMAL]


def _append_spm_pieces(proto, pieces: list[str], n_add: int) -> list[str]:
    """Append to ``proto`` up to ``n_add`` of the learned ``pieces`` it lacks, in order, each scored below every
    piece before it; a multi-character piece only when it splits into two pieces already there or learned (its
    parts are appended first). Returns the pieces appended."""
    Piece = _spm_piece_type()
    have = {p.piece for p in proto.pieces}
    mergeable = {p.piece for p in proto.pieces if p.type == Piece.NORMAL}
    lowest = min((p.score for p in proto.pieces if p.type == Piece.NORMAL), default=0.0)
    known = set(pieces)
    added: list[str] = []

    def add(piece: str) -> bool:
        """Make ``piece`` a piece (its parts first); False when the budget is spent or it cannot be reached."""
        if piece in have:
            return piece in mergeable
        if len(added) >= n_add:
            return False
        if len(piece) > 1:
            for k in range(1, len(piece)):
                a, b = piece[:k], piece[k:]
                if (a in mergeable or a in known) and (b in mergeable or b in known):
                    if add(a) and add(b):
                        break
            else:
                return False
            if len(added) >= n_add:
                return False
        proto.pieces.add(piece=piece, score=lowest - 1.0 - len(added), type=Piece.NORMAL)
        have.add(piece)
        mergeable.add(piece)
        added.append(piece)
        return True

    for piece in pieces:
        if len(added) >= n_add:
            break
        add(piece)
    return added


def _pad_spm_proto(proto) -> None:
    """Reserved control pieces (names no piece has) up to a multiple of 64 pieces; the trainer spec's vocabulary
    size set to the total."""
    taken, k, n = {p.piece for p in proto.pieces}, 0, len(proto.pieces)
    for _ in range(round_up(n) - n):
        while reserved_token(k) in taken:
            k += 1
        taken.add(reserved_token(k))
        proto.pieces.add(piece=reserved_token(k), score=0.0, type=_spm_piece_type().CONTROL)
    proto.trainer_spec.vocab_size = len(proto.pieces)


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
    claim_output_dir(out_dir, "extend-tokenizer", inputs=[base_dir, *inputs, *base_text])
    base = load_tokenizer(base_dir)
    docs = _read(inputs, text_field, txt_mode)
    if not docs:
        raise ValueError(f"--input {' '.join(map(str, inputs))}: no text")
    if len(docs) >= 2 and heldout_every > 1:
        heldout = docs[::heldout_every]
        train = [d for i, d in enumerate(docs) if i % heldout_every]
    else:
        heldout, train = docs, docs
    if base.backend == "spm":
        tok, info = extend_spm(base, train, n_add)
    else:
        tok, info = extend_bpe(base, train, n_add, min_frequency=min_frequency)
    report = {**info, "heldout": {"docs": len(heldout), "bytes_per_token_before": bytes_per_token(base, heldout),
                                  "bytes_per_token_after": bytes_per_token(tok, heldout)}}
    if base_text:
        own = _read(base_text, text_field, txt_mode)
        report["base_domain"] = {"docs": len(own), "bytes_per_token_before": bytes_per_token(base, own),
                                 "bytes_per_token_after": bytes_per_token(tok, own)}
    tok.meta["extended"] = report
    tok.save(out_dir, kind="extend-tokenizer")
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


__all__ = ["extend_bpe", "extend_spm", "extend_tokenizer", "bytes_per_token"]

