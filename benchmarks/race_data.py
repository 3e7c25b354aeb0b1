"""The race's data: one `z2all corpus` folder (train.jsonl / valid.jsonl, split by package) converted to each peer's
input format, so that all three sides train on the same text and are scored on the same held-out text.

    python benchmarks/race_data.py nanochat CORPUS OUT          # parquet shards of text (nanochat's format)
    python benchmarks/race_data.py modded CORPUS OUT --gpt2 DIR  # GPT-2 token shards (modded-nanogpt's .bin format)

nanochat reads every ``*.parquet`` of its data folder in name order, a column ``text`` per row group, and takes the
LAST file as validation: train documents go to ``shard_00000.parquet``, ``shard_00001.parquet``, ... and the
validation documents to ``shard_99999.parquet`` (row groups of 1,024 documents, their order kept).

modded-nanogpt reads ``fineweb_train_*.bin`` / ``fineweb_val_*.bin``: a header of 256 int32 (magic 20240520,
version 1, token count) then uint16 GPT-2 ids; each document is ``[<|endoftext|>] + encode_ordinary(text)`` (its
own data script's layout). Its validation loss is the mean token loss over the first ``val_tokens`` predictions
of the validation stream (targets ``stream[1 : val_tokens + 1]``, read in sequences of ``val_seq_len`` ids and in
groups of 8 sequences, its gradient-accumulation factor on one GPU). ``val_meta.json`` records the largest
``val_tokens`` its loader can read without wrapping round (a multiple of 8 x ``val_seq_len`` below the stream's
length), the UTF-8 bytes of exactly those targets (an ``<|endoftext|>`` target counts 0 bytes) and how many
targets are ``<|endoftext|>``: ``benchmarks/race_score.py`` turns the mean loss into bits per byte with them.

The GPT-2 encoding is built from its two public files (``encoder.json``, ``vocab.bpe``; their SHA-256 checked,
the same hashes tiktoken pins), so no network is needed: ``bash benchmarks/race_gpu.sh pack`` puts them in
``.whl/race/gpt2/``. Outputs are written to a temporary name and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

MAGIC, VERSION = 20240520, 1
EOT = 50256  # GPT-2's <|endoftext|>
MAX_DOC_CHARS = 6000  # ~1,650 tokens of code at ~3.6 bytes a token: a piece fits one of nanochat's 2,048-token rows
MAX_DOC_TOKENS = 16384  # a third of modded-nanogpt's 48k-token training sequence (see to_modded)
GPT2_SHA256 = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
               "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
# GPT-2's pre-tokenisation pattern as tiktoken writes it (equivalent to the original release's)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
ROW_GROUP_DOCS = 1024
VAL_SHARD = "shard_99999.parquet"


def read_texts(path: str | os.PathLike) -> Iterator[str]:
    """The text of each record of a corpus file, in file order, read as `z2all eval` reads it (the readers'
    schema: ``content``, or ``text``), empty texts skipped: the same documents our side is scored on."""
    from zero2all.eval.perplexity import iter_documents

    for _src, text in iter_documents([str(path)]):
        if text:
            yield text


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------- nanochat


def write_parquet(texts: Sequence[str], path: Path, row_group_docs: int = ROW_GROUP_DOCS) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": pa.array(list(texts), type=pa.string())})
    _atomic(path, lambda p: pq.write_table(table, p, row_group_size=row_group_docs))


def split_text(text: str, max_chars: int) -> list[str]:
    """``text`` in pieces of at most ``max_chars`` characters, cut after a line where one fits (a longer line is
    cut inside); the pieces joined give ``text`` back."""
    if max_chars < 1:
        raise ValueError(f"--max-doc-chars: {max_chars} must be at least 1")
    if len(text) <= max_chars:
        return [text]
    pieces: list[str] = []
    cur = ""
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:  # a line longer than a piece: cut it, after what is held
            if cur:
                pieces.append(cur)
                cur = ""
            pieces.append(line[:max_chars])
            line = line[max_chars:]
        if len(cur) + len(line) > max_chars:
            pieces.append(cur)
            cur = ""
        cur += line
    if cur:
        pieces.append(cur)
    return pieces


def to_nanochat(corpus: Path, out: Path, shard_docs: int = 16 * ROW_GROUP_DOCS,
                max_doc_chars: int = MAX_DOC_CHARS) -> dict:
    """Train shards (``shard_docs`` documents each) then the validation shard, which sorts last.

    Training documents longer than ``max_doc_chars`` are cut at line ends into pieces (each a document of its
    own): nanochat's loader starts every row at a document and crops what does not fit its 2,048-token rows, so a
    source file of ~5,000 tokens would give only its first row's worth (on this corpus ~3/4 of the text was never
    read and the rest read 7 times in a 5-minute run). Validation documents stay whole."""
    out.mkdir(parents=True, exist_ok=True)
    stats = {"train_docs": 0, "train_shards": 0, "valid_docs": 0, "train_docs_cut": 0, "train_pieces": 0,
             "max_doc_chars": max_doc_chars}
    buf: list[str] = []

    def flush():
        write_parquet(buf, out / f"shard_{stats['train_shards']:05d}.parquet")
        stats["train_pieces"] += len(buf)
        stats["train_shards"] += 1
    for text in read_texts(corpus / "train.jsonl"):
        pieces = split_text(text, max_doc_chars)
        stats["train_docs"] += 1
        stats["train_docs_cut"] += len(pieces) > 1
        for piece in pieces:
            buf.append(piece)
            if len(buf) == shard_docs:
                flush()
                buf = []
    if buf:
        flush()
    if stats["train_shards"] > 99999 - 1:
        raise ValueError("too many train shards for the validation shard to sort last; raise --shard-docs")
    valid = list(read_texts(corpus / "valid.jsonl"))
    if not valid or not stats["train_docs"]:
        raise ValueError(f"{corpus}: train.jsonl and valid.jsonl must both hold documents")
    write_parquet(valid, out / VAL_SHARD)
    stats["valid_docs"] = len(valid)
    return stats


# ----------------------------------------------------------------------------------------------- modded-nanogpt


def gpt2_encoding(folder: str | os.PathLike):
    """tiktoken's GPT-2 encoding from the two files in ``folder`` (hashes checked)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    folder = Path(folder)
    for name in GPT2_SHA256:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: missing (bash benchmarks/race_gpu.sh pack fetches it)")
    ranks = data_gym_to_mergeable_bpe_ranks(str(folder / "vocab.bpe"), str(folder / "encoder.json"),
                                            vocab_bpe_hash=GPT2_SHA256["vocab.bpe"],
                                            encoder_json_hash=GPT2_SHA256["encoder.json"])
    return tiktoken.Encoding(name="gpt2", explicit_n_vocab=50257, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT})


def write_bin(tokens: np.ndarray, path: Path) -> None:
    """modded-nanogpt's shard: 256 int32 of header (magic, version, count), then the ids as uint16."""
    if tokens.size >= 2**31:
        raise ValueError(f"{path}: {tokens.size} tokens do not fit one shard")
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = MAGIC, VERSION, tokens.size

    def write(p: Path) -> None:
        with open(p, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype(np.uint16).tobytes())
    _atomic(path, write)


def read_bin(path: str | os.PathLike) -> np.ndarray:
    raw = Path(path).read_bytes()
    header = np.frombuffer(raw[:1024], dtype=np.int32)
    if header[0] != MAGIC or header[1] != VERSION:
        raise ValueError(f"{path}: not a version-{VERSION} token shard")
    tokens = np.frombuffer(raw[1024:], dtype=np.uint16)
    if tokens.size != header[2]:
        raise ValueError(f"{path}: header says {header[2]} tokens, file holds {tokens.size}")
    return tokens


def doc_stream(texts: Iterable[str], encode_batch: Callable[[list[str]], list[list[int]]], eot: int = EOT,
               batch_docs: int = 512) -> Iterator[np.ndarray]:
    """Arrays of ``[eot] + ids`` per document, encoded ``batch_docs`` at a time."""
    batch: list[str] = []

    def flush():
        for ids in encode_batch(batch):
            yield np.asarray([eot] + list(ids), dtype=np.int64)
    for text in texts:
        batch.append(text)
        if len(batch) == batch_docs:
            yield from flush()
            batch = []
    if batch:
        yield from flush()


def split_document(doc: np.ndarray, max_tokens: int, eot: int = EOT) -> list[np.ndarray]:
    """``[eot] + ids`` as pieces of at most ``max_tokens`` tokens, each starting with ``eot``."""
    if max_tokens < 2:
        raise ValueError(f"--max-doc-tokens: {max_tokens} must be at least 2")
    ids, step = doc[1:], max_tokens - 1
    if ids.size <= step:
        return [doc]
    return [np.concatenate([[eot], ids[i:i + step]]).astype(doc.dtype) for i in range(0, ids.size, step)]


def scored_val_tokens(n_stream: int, val_seq_len: int, accum: int = 8) -> int:
    """The most validation predictions modded-nanogpt's loader reads from a stream of ``n_stream`` ids without
    loading a next file: it reads groups of ``accum`` sequences of ``val_seq_len`` ids and refuses a group unless
    ``position + accum * val_seq_len + 1 < n_stream``."""
    group = accum * val_seq_len
    return max(0, (n_stream - 2) // group) * group


def target_bytes(stream: np.ndarray, n_scored: int, token_bytes: Callable[[int], int],
                 eot: int = EOT) -> tuple[int, int]:
    """(UTF-8 bytes, end-of-text count) of the targets ``stream[1 : n_scored + 1]``; an end-of-text target is no
    text and counts 0 bytes."""
    targets = stream[1:n_scored + 1]
    ids, counts = np.unique(targets, return_counts=True)
    nbytes = sum(int(c) * (0 if int(i) == eot else token_bytes(int(i))) for i, c in zip(ids, counts))
    return nbytes, int(counts[ids == eot].sum()) if (ids == eot).any() else 0


def to_modded(corpus: Path, out: Path, encode_batch: Callable[[list[str]], list[list[int]]],
              token_bytes: Callable[[int], int], val_seq_len: int = 16384, shard_tokens: int = 100_000_000,
              eot: int = EOT, max_doc_tokens: int = MAX_DOC_TOKENS) -> dict:
    """``out/data/fineweb10B/fineweb_{train,val}_*.bin`` (the paths modded-nanogpt's ``DATA_PATH`` points into)
    and ``out/val_meta.json``.

    Training documents longer than ``max_doc_tokens`` are cut into pieces of at most that many tokens, each after
    its own end-of-text: modded-nanogpt's loader starts every sequence at an end-of-text and looks for the next
    ones within twice a sequence's length per micro-step, which web documents (its data) always offer and a long
    source file does not (it stops with an assertion). Validation text is left whole (read as one stream)."""
    data = out / "data" / "fineweb10B"
    data.mkdir(parents=True, exist_ok=True)
    val = np.concatenate(list(doc_stream(read_texts(corpus / "valid.jsonl"), encode_batch, eot)))
    n_scored = scored_val_tokens(val.size, val_seq_len)
    if n_scored == 0:
        raise ValueError(f"{corpus}/valid.jsonl: {val.size} GPT-2 tokens are too few for one validation group of "
                         f"8 x {val_seq_len} (lower --val-seq-len)")
    write_bin(val, data / "fineweb_val_000000.bin")
    nbytes, n_eot = target_bytes(val, n_scored, token_bytes, eot)
    train_tokens, shards, buf, held, cut = 0, 0, [], 0, 0
    for doc in doc_stream(read_texts(corpus / "train.jsonl"), encode_batch, eot):
        pieces = split_document(doc, max_doc_tokens, eot)
        cut += len(pieces) > 1
        arr = np.concatenate(pieces)
        buf.append(arr)
        held += arr.size
        if held >= shard_tokens:
            shards += 1
            write_bin(np.concatenate(buf), data / f"fineweb_train_{shards:06d}.bin")
            train_tokens += held
            buf, held = [], 0
    if buf:
        shards += 1
        write_bin(np.concatenate(buf), data / f"fineweb_train_{shards:06d}.bin")
        train_tokens += held
    meta = {"val_stream_tokens": int(val.size), "val_seq_len": val_seq_len, "val_tokens": n_scored,
            "val_scored_bytes": nbytes, "val_eot_targets": n_eot,
            "val_text_bytes": sum(len(t.encode("utf-8")) for t in read_texts(corpus / "valid.jsonl")),
            "train_tokens": train_tokens, "train_shards": shards, "train_docs_cut": cut,
            "max_doc_tokens": max_doc_tokens}
    _atomic(out / "val_meta.json", lambda p: p.write_text(json.dumps(meta, indent=1) + "\n"))
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="fmt", required=True)
    n = sub.add_parser("nanochat", help="parquet shards of text")
    n.add_argument("corpus")
    n.add_argument("out")
    n.add_argument("--shard-docs", type=int, default=16 * ROW_GROUP_DOCS)
    n.add_argument("--max-doc-chars", type=int, default=MAX_DOC_CHARS,
                   help="training documents longer than this are cut at line ends into pieces")
    m = sub.add_parser("modded", help="GPT-2 .bin token shards and val_meta.json")
    m.add_argument("corpus")
    m.add_argument("out")
    m.add_argument("--gpt2", required=True, help="folder with GPT-2's encoder.json and vocab.bpe")
    m.add_argument("--val-seq-len", type=int, default=16384)
    m.add_argument("--max-doc-tokens", type=int, default=MAX_DOC_TOKENS,
                   help="training documents longer than this are cut into pieces, each after an end-of-text")
    m.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    corpus, out = Path(args.corpus), Path(args.out)
    try:
        for name in ("train.jsonl", "valid.jsonl"):
            if not (corpus / name).is_file():
                raise ValueError(f"{corpus / name}: missing (make the corpus with `z2all corpus --out {corpus}`)")
        if args.fmt == "nanochat":
            stats = to_nanochat(corpus, out, args.shard_docs, args.max_doc_chars)
        else:
            if args.val_seq_len <= 0 or args.val_seq_len % 128:
                raise ValueError(f"--val-seq-len: {args.val_seq_len} must be a positive multiple of 128")
            enc = gpt2_encoding(args.gpt2)
            stats = to_modded(corpus, out, lambda b: enc.encode_ordinary_batch(b, num_threads=args.threads),
                              lambda i: len(enc.decode_single_token_bytes(i)), args.val_seq_len,
                              max_doc_tokens=args.max_doc_tokens)
    except (ValueError, FileNotFoundError) as e:
        print(f"race_data: {e}", file=sys.stderr)
        return 2
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
