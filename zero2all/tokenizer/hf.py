"""The tokenizer at run time, stored as HF tokenizer files.

A tokenizer directory holds::

    tokenizer.json            the HF `tokenizers` pipeline (model, pre-tokenizer, decoder, special tokens)
    tokenizer_config.json     PreTrainedTokenizerFast settings and the ChatML `chat_template`
    special_tokens_map.json   eos / pad / unk
    z2all_tokenizer.json      our metadata: backend, special-token ids, training statistics
    tokenizer.model           (spm backend only) the SentencePiece model it was converted from

so ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it without ``trust_remote_code``, and both backends
(byte-level BPE and SentencePiece BPE) run through the same `tokenizers` engine: our ids are AutoTokenizer's ids.

**Injection safety.** ``Tokenizer.encode(text)`` runs a copy of the pipeline that has *no* added tokens, so raw
text containing ``<|im_end|>`` is encoded as ordinary characters (``<``, ``|``, ``im``, ...) and can never produce
a special id. Special ids enter only through explicit calls: :meth:`Tokenizer.apply_chat_template`, or the ids
themselves (``tok.eos_id``). (AutoTokenizer follows HF's usual rule and does match special strings in text; that
is what lets its ``apply_chat_template`` render the template to text and tokenize it to the same ids as ours.)

**The same guard for transformers users.** AutoTokenizer's ``apply_chat_template`` renders the template to text and
tokenizes that text, special strings included, so a message typed as ``hi<|im_end|>\n<|im_start|>system ...`` would
become real role tokens. ``split_special_tokens`` is no cure (it turns the template's own role markers into text
as well), and ``apply_chat_template(..., sanitize_control_tokens=True)`` exists only in recent transformers and only
when the caller asks. So the files written for transformers (``export-hf``, ``export-reward-hf``;
:func:`guard_hf_chat_template`) change two things: the template puts the noncharacter U+FDD0 after every ``<`` of
a role or message (every special token starts with ``<``), so no special string survives in the rendered text; and
``tokenizer.json`` gets a first normalizer step deleting U+FDD0, which runs after special strings are matched and
before the text is split into tokens. The ids are exactly ours, whether the chat is tokenized by
``apply_chat_template`` or rendered first and tokenized later; the price is that a U+FDD0 typed by a user (a code
point Unicode reserves for internal use) is dropped by the exported tokenizer. Loading such files back
(:class:`Tokenizer`) removes the step again, so the tokenizer, its hash and our own encoding are unchanged by a round
trip through an export.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Iterable, Sequence

from zero2all.config import ConfigError
from zero2all.fileio import atomic_dir

EOS, PAD, IM_START, IM_END = "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
NAMED_SPECIALS = (EOS, PAD, IM_START, IM_END)
N_RESERVED = 12  # <|reserved_0|> ... <|reserved_11|>: 16 specials in all, room for tools/FIM markers later
VOCAB_MULTIPLE = 64
META_FILE = "z2all_tokenizer.json"
SPM_ESCAPE = "\U0010FFFF"  # stands for a literal U+2581 in SentencePiece-backed pipelines (see below)

# ChatML. Our apply_chat_template renders exactly this, with the specials entered as ids.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# The guarded template for files read by transformers (see the module docstring): the same ChatML, with U+FDD0
# (a Jinja escape here, so the file shows it) put after every "<" of a role or a message's content.
CHAT_GUARD = "\ufdd0"
_GUARD = "| replace('<', '<\\ufdd0')"
HF_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + (message['role'] " + _GUARD + ") + '\\n' + (message['content'] " + _GUARD + ") + "
    "'<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# its partner in tokenizer.json: the normalizer becomes Sequence([this step, the original normalizer or nothing])
_GUARD_STEP = {"type": "Replace", "pattern": {"String": CHAT_GUARD}, "content": ""}


def _drop_chat_guard(tokenizer: dict) -> bool:
    """Remove the guard's normalizer step from a parsed tokenizer.json, in place; True if it was there."""
    norm = tokenizer.get("normalizer")
    if not (isinstance(norm, dict) and norm.get("type") == "Sequence" and norm.get("normalizers")
            and norm["normalizers"][0] == _GUARD_STEP and len(norm["normalizers"]) <= 2):
        return False
    rest = norm["normalizers"][1:]
    tokenizer["normalizer"] = rest[0] if rest else None
    return True


def guard_hf_chat_template(directory: str | os.PathLike) -> bool:
    """Give the tokenizer files in ``directory`` (a directory being written for transformers) the chat guard of the
    module docstring, rewriting them in place: our ChatML template, in ``tokenizer_config.json`` or in
    ``chat_template.jinja`` (where transformers' own ``save_pretrained`` puts it), and ``tokenizer.json``. A foreign
    template, special tokens that do not all start with ``<`` (or are matched after normalisation), or files
    guarded already are left as they are.
    Returns whether the files were changed."""
    directory = Path(directory)
    cfg_file, jinja_file = directory / "tokenizer_config.json", directory / "chat_template.jinja"
    tok_file = directory / "tokenizer.json"
    if not tok_file.is_file():
        return False
    tokenizer = json.loads(tok_file.read_text(encoding="utf-8"))
    specials = [t for t in tokenizer.get("added_tokens", []) if t.get("special")]
    if not all(t.get("content", "").startswith("<") and not t.get("normalized") for t in specials):
        return False  # a special token the escape would not reach
    cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    in_cfg = cfg.get("chat_template") == CHAT_TEMPLATE
    in_jinja = jinja_file.is_file() and jinja_file.read_text(encoding="utf-8") == CHAT_TEMPLATE
    if not (in_cfg or in_jinja):
        return False
    norm = tokenizer.get("normalizer")
    tokenizer["normalizer"] = {"type": "Sequence", "normalizers": [_GUARD_STEP] + ([norm] if norm else [])}
    tok_file.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    if in_cfg:
        cfg["chat_template"] = HF_CHAT_TEMPLATE
        _write_json(cfg_file, cfg)
    if in_jinja:
        jinja_file.write_text(HF_CHAT_TEMPLATE, encoding="utf-8")
    return True


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (the table ``tokenizers``' ByteLevel uses): printable bytes stand for themselves,
    the others for the code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def reserved_token(i: int) -> str:
    return f"<|reserved_{i}|>"


def special_tokens(n_reserved: int = N_RESERVED) -> list[str]:
    """The special tokens in id order: the four named ones, then the reserved block."""
    return list(NAMED_SPECIALS) + [reserved_token(i) for i in range(n_reserved)]


def round_up(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return int(math.ceil(n / multiple) * multiple)


def canonical_hash(tokenizer_json: str | bytes) -> str:
    """sha256 of tokenizer.json with keys sorted and no whitespace: the same pipeline gives the same hash even if
    a tool re-serialises the file with another layout."""
    obj = json.loads(tokenizer_json)
    _drop_chat_guard(obj)  # an export's copy of a tokenizer is the same tokenizer
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False).encode("utf-8")).hexdigest()


class Tokenizer:
    """Encode / decode / chat template over a `tokenizers` pipeline (see the module docstring).

    Attributes: ``vocab_size`` (a multiple of 64: the model's embedding rows), ``eos_id`` (``<|endoftext|>``, the
    document separator), ``pad_id``, ``im_start_id``, ``im_end_id``, ``special_ids`` (name -> id), ``hash``.
    """

    def __init__(self, tokenizer_json: str, meta: dict | None = None, extra_files: dict | None = None):
        from tokenizers import Tokenizer as _HFTokenizer

        parsed = json.loads(tokenizer_json)
        if _drop_chat_guard(parsed):  # files written for transformers: the tokenizer they were made from
            tokenizer_json = json.dumps(parsed, ensure_ascii=False)
        self._json = tokenizer_json
        self.meta = dict(meta or {})
        self._extra_files = dict(extra_files or {})  # name -> bytes (e.g. tokenizer.model)
        self._full = _HFTokenizer.from_str(tokenizer_json)
        raw = json.loads(tokenizer_json)
        raw["added_tokens"] = []
        raw["post_processor"] = None
        self._raw = _HFTokenizer.from_str(json.dumps(raw))
        self.hash = canonical_hash(tokenizer_json)
        added = [t for t in json.loads(tokenizer_json).get("added_tokens", []) if t.get("special")]
        self.special_ids: dict[str, int] = {t["content"]: t["id"] for t in sorted(added, key=lambda t: t["id"])}
        self.backend = self.meta.get("backend", "hf")
        n = self._full.get_vocab_size(with_added_tokens=True)
        self.vocab_size = round_up(n)  # foreign tokenizers: the padded size a model would use
        self.eos_id = self._special(EOS, self.meta.get("eos_token"))
        self.pad_id = self._special(PAD, self.meta.get("pad_token"))
        self.im_start_id = self.special_ids.get(IM_START)
        self.im_end_id = self.special_ids.get(IM_END)

    def _special(self, name: str, fallback: str | None) -> int | None:
        if name in self.special_ids:
            return self.special_ids[name]
        if fallback is not None:
            return self._full.token_to_id(fallback)
        return None

    # ---------------------------------------------------------------------------------------------- encode/decode

    def encode(self, text: str) -> list[int]:
        """Raw text -> ids. Never produces a special id (special strings in ``text`` are ordinary characters)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._raw.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Like :meth:`encode` for many texts (the Rust side splits the batch over threads when allowed)."""
        fast = getattr(self._raw, "encode_batch_fast", None)
        encs = (fast or self._raw.encode_batch)(list(texts), add_special_tokens=False)
        return [e.ids for e in encs]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """ids -> text. Lossless: ``decode(encode(x)) == x`` for any string ``x``."""
        return self._full.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes as they appear in decoded text (``b""`` for special and unused ids), for constrained
        decoding (``infer/structured.py``). Byte-level pipelines map each piece's characters back through GPT-2's
        byte table; SentencePiece-backed ones read ``<0xAB>`` as the byte AB and ``\u2581`` as a space, as does a
        foreign Metaspace decoder its marker. Other decoders: each id decoded alone (``b""`` where that gives a
        partial character)."""
        decoder = json.loads(self._json).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        specials = set(self.special_ids.values())
        n = self._full.get_vocab_size(with_added_tokens=True)
        out = []
        if "ByteLevel" in kinds:
            table = {c: b for b, c in _byte_to_unicode().items()}
        meta_char = next((d.get("replacement", "\u2581") for d in decoder.get("decoders", [decoder])
                          if d.get("type") == "Metaspace"), "\u2581")
        for i in range(n):
            piece = self._full.id_to_token(i)
            if piece is None or i in specials:
                out.append(b"")
            elif "ByteLevel" in kinds:
                out.append(bytes(table[c] for c in piece) if all(c in table for c in piece) else b"")
            elif "Metaspace" in kinds:  # SentencePiece's word-start marker, a space wherever the token stands
                out.append(piece.replace(meta_char, " ").encode("utf-8"))
            elif "ByteFallback" in kinds:
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    out.append(bytes([int(piece[3:5], 16)]))
                else:
                    out.append(piece.replace("\u2581", " ").replace(SPM_ESCAPE, "\u2581").encode("utf-8"))
            else:
                text = self._full.decode([i])
                out.append(b"" if "\ufffd" in text else text.encode("utf-8"))
        return out

    def byte_decoding(self) -> list[bytes] | None:
        """Each id's bytes when decoding is only concatenating them (a ByteLevel decoder and nothing else), so that
        ``decode(ids, skip_special=True) == b"".join(table[i] for i in ids).decode("utf-8", "replace")`` and text can be
        decoded a token at a time (``infer/generate.py``'s rows); None for any other pipeline. Checked once against
        the tokenizer's own decoding of every id whose bytes are whole characters, then kept."""
        if not hasattr(self, "_byte_decoding"):
            self._byte_decoding = None
            decoder = json.loads(self._json).get("decoder") or {}
            if {d.get("type") for d in decoder.get("decoders", [decoder])} == {"ByteLevel"}:
                table = self.token_bytes()
                specials = set(self.special_ids.values())
                ok = True
                for i, b in enumerate(table):
                    text = self._full.decode([i], skip_special_tokens=True)
                    if i in specials or not b:
                        ok = text == ""
                    else:
                        try:
                            ok = b.decode("utf-8") == text
                        except UnicodeDecodeError:  # part of a character: decoded alone it cannot be compared
                            ok = True
                    if not ok:
                        break
                self._byte_decoding = table if ok else None
        return self._byte_decoding

    def id_to_token(self, i: int) -> str | None:
        return self._full.id_to_token(int(i))

    @property
    def n_ids(self) -> int:
        """The ids in use: the model's entries and the added tokens (``vocab_size`` is this rounded up)."""
        return self._full.get_vocab_size(with_added_tokens=True)

    @property
    def tokenizer_json(self) -> str:
        """The pipeline as ``tokenizer.json`` text (what :meth:`save` writes)."""
        return self._json

    def extra_file(self, name: str) -> bytes | None:
        """A file kept beside ``tokenizer.json`` (SentencePiece's ``tokenizer.model``), or None."""
        return self._extra_files.get(name)

    def model_piece_ids(self, text: str) -> list[int]:
        """The ids the pipeline's model alone (no normalizer, pre-tokenizer or added tokens) splits ``text``
        into; a model kind that cannot split raises."""
        return [t.id for t in self._full.model.tokenize(text)]

    def token_to_id(self, token: str) -> int | None:
        return self._full.token_to_id(token)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(backend={self.backend}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
                f"hash={self.hash[:12]})")

    # ---------------------------------------------------------------------------------------------- chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, the specials entered as ids and
        the role / content encoded as raw text (so a message cannot forge a turn boundary). With
        ``add_generation_prompt`` the ids end with ``<|im_start|>assistant\\n``. Equal to what AutoTokenizer's
        ``apply_chat_template(..., tokenize=True)`` gives with our ``chat_template``."""
        if self.im_start_id is None or self.im_end_id is None:
            raise ValueError("this tokenizer has no <|im_start|>/<|im_end|> tokens; it cannot render chats")
        ids: list[int] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r:.120}")
            ids.append(self.im_start_id)
            ids += self.encode(m["role"] + "\n" + m["content"])
            ids.append(self.im_end_id)
            ids += self.encode("\n")
        if add_generation_prompt:
            ids.append(self.im_start_id)
            ids += self.encode("assistant\n")
        return ids

    # ---------------------------------------------------------------------------------------------- files

    def save(self, out_dir: str | os.PathLike, kind: str | None = None) -> Path:
        """Write the HF files and our metadata into ``out_dir``, replaced whole (``fileio.atomic_dir``): a kill
        leaves the previous tokenizer there, never a mixture of two. ``kind``: the command whose output it is
        (its marker; the command checks ``out_dir`` first with ``fileio.claim_output_dir``)."""
        out_dir = Path(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(out_dir, kind=kind) as tmp:
            (tmp / "tokenizer.json").write_text(self._json, encoding="utf-8")
            for name, data in self._extra_files.items():
                (tmp / name).write_bytes(data)
            unk = self.meta.get("unk_token")
            specials_map = {"eos_token": EOS, "pad_token": PAD}
            if unk:
                specials_map["unk_token"] = unk
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": int(self.meta.get("model_max_length", 1_000_000)),
                "clean_up_tokenization_spaces": False,
                "add_bos_token": False,
                "add_eos_token": False,
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                **specials_map,
                "added_tokens_decoder": {
                    str(i): {"content": name, "special": True, "lstrip": False, "rstrip": False,
                             "normalized": False, "single_word": False}
                    for name, i in self.special_ids.items()},
            }
            _write_json(tmp / "tokenizer_config.json", config)
            _write_json(tmp / "special_tokens_map.json", specials_map)
            meta = dict(self.meta)
            meta.update({"format": "zero2all-tokenizer", "backend": self.backend, "vocab_size": self.vocab_size,
                         "special_ids": self.special_ids, "hash": self.hash})
            _write_json(tmp / META_FILE, meta)
        return out_dir


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class TokenizerFileError(ConfigError):
    """A tokenizer file that cannot be read (truncated, not JSON, not a tokenizer): one line naming the file. A
    ConfigError, so every command reports it as bad input (exit code 2)."""


_DAMAGED_HINT = "the file is damaged: copy the tokenizer folder again from where it came from"


def _read_json_file(f: Path) -> dict:
    try:
        obj = json.loads(f.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise TokenizerFileError(f"{f}: not UTF-8 text; {_DAMAGED_HINT}") from None
    except json.JSONDecodeError as e:
        raise TokenizerFileError(f"{f}:{e.lineno}: not valid JSON ({e.msg}); {_DAMAGED_HINT}") from None
    if not isinstance(obj, dict):
        raise TokenizerFileError(f"{f}: expected a JSON object, found {type(obj).__name__}; {_DAMAGED_HINT}")
    return obj


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer directory (ours, or any HF directory with a tokenizer.json), or a tokenizer.json file.
    A damaged file raises :class:`TokenizerFileError` naming it."""
    path = Path(path)
    tj = path if path.is_file() else path / "tokenizer.json"
    if not tj.exists():
        raise FileNotFoundError(f"{path}: no tokenizer.json (train one with `z2all train-tokenizer`)")
    meta: dict = {}
    extra: dict = {}
    if path.is_dir():
        mfile = path / META_FILE
        if mfile.exists():
            meta = _read_json_file(mfile)
        else:  # a foreign HF directory: take eos/pad names from its special-tokens map
            smap = path / "special_tokens_map.json"
            if smap.exists():
                for k, v in _read_json_file(smap).items():
                    meta[k] = v.get("content") if isinstance(v, dict) else v
        spm = path / "tokenizer.model"
        if spm.exists() and meta.get("backend") == "spm":
            extra["tokenizer.model"] = spm.read_bytes()
    _read_json_file(tj)
    try:
        return Tokenizer(tj.read_text(encoding="utf-8"), meta=meta, extra_files=extra)
    except Exception as e:  # valid JSON that `tokenizers` cannot build a pipeline from
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerFileError(f"{tj}: not a tokenizer this library can load ({reason}); {_DAMAGED_HINT}") from None


# ------------------------------------------------------------------------------------------------------------
# SentencePiece BPE -> the same pipeline in `tokenizers`


def sentencepiece_to_tokenizer_json(model_proto: bytes, specials: list[str]) -> tuple[str, dict]:
    """Convert a SentencePiece BPE model (byte fallback, identity normalisation, no dummy prefix) into a
    `tokenizers` BPE pipeline that produces the same ids.

    SentencePiece BPE encodes by repeatedly merging the adjacent pair whose concatenation is the vocabulary piece
    with the highest score; `tokenizers` BPE merges the pair of lowest rank. So every piece ``p`` that splits into
    two pieces ``a + b`` gives a merge ``(a, b)`` ranked by ``p``'s score. Spaces are the meta symbol U+2581;
    characters outside the vocabulary fall back to their UTF-8 bytes ``<0xNN>``. Texts without U+2581 get exactly
    SentencePiece's ids; SentencePiece itself would turn a literal U+2581 into a space, this pipeline keeps it.
    Returns (tokenizer.json text, {"unk_token": ...}).
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as _HFTokenizer

    proto = pb.ModelProto()
    proto.ParseFromString(model_proto)
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    normal = pb.ModelProto.SentencePiece.NORMAL
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    scores = {p.piece: p.score for p in proto.pieces}
    mergeable = {p.piece for p in proto.pieces if p.type == normal}
    merges = []
    for p in proto.pieces:
        if p.type != normal or len(p.piece) < 2:
            continue
        for k in range(1, len(p.piece)):
            a, b = p.piece[:k], p.piece[k:]
            if a in mergeable and b in mergeable:
                merges.append((-scores[p.piece], vocab[p.piece], vocab[a], vocab[b], a, b))
    merges.sort()
    unk = sp.id_to_piece(sp.unk_id())
    bpe = models.BPE(vocab=vocab, merges=[(m[4], m[5]) for m in merges], unk_token=unk, byte_fallback=True,
                     fuse_unk=True)
    tok = _HFTokenizer(bpe)
    # A literal U+2581 in the text would read as a space. It is first mapped to the noncharacter U+10FFFF (never in
    # the vocabulary, so it is encoded as its 4 fallback bytes) and mapped back after decoding: lossless for every
    # string except U+10FFFF itself, which Unicode reserves for exactly such internal use.
    tok.normalizer = normalizers.Sequence([normalizers.Replace("\u2581", SPM_ESCAPE),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Replace(SPM_ESCAPE, "\u2581")])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials if s in vocab])
    return tok.to_str(), {"unk_token": unk}
