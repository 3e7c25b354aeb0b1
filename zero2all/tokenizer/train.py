"""Tokenizer training: byte-level BPE with HF `tokenizers` (``backend="hf"``) or SentencePiece BPE with byte fallback
(``backend="spm"``), both saved as HF tokenizer files (``zero2all.tokenizer.hf``).

Vocabulary layout (both backends): the 16 special tokens ``<|endoftext|>`` (the document separator), ``<|pad|>``,
``<|im_start|>``, ``<|im_end|>``, ``<|reserved_0..11|>``; the learned vocabulary; then more
``<|reserved_k|>`` tokens until the size is a multiple of 64 (embedding and LM-head rows that tensor cores like).

**Pre-tokenization (hf backend).** Byte-level BPE never merges across the boundaries of the pieces that
:data:`PRETOKENIZE_REGEX` cuts the text into. The alternatives, tried in order at each position:

1. ``'s 't 'm 'd 'll 've 're``: English contractions are their own pieces;
2. an optional non-letter/non-digit character, then a run of Han / Hiragana / Katakana / Hangul: CJK text has no
   spaces, so a whole run is one piece and BPE learns the frequent words inside it; a CJK run never fuses with
   Latin letters (``Hello世界`` -> ``Hello`` + ``世界``);
3. an optional leading non-letter/non-digit (a space, ``_``, ``.``, ``(``), then a run of other letters and marks:
   words with their leading space (``" return"``), identifiers with their sigil (``".append"``);
4. 1 to 3 digits: numbers split into groups of at most three (``12345`` -> ``123`` + ``45``), so the vocabulary
   spends no entries on arbitrary numbers and digits never merge with letters;
5. an optional space, then a run of punctuation / symbols with trailing newlines: operators (``" =="``, ``"):\\n"``);
6. whitespace ending in newlines (``"\\n\\n"``);
7. a run of spaces/tabs not followed by a non-space, i.e. all but the last space of an indentation, whose last
   space then joins the next word (``"        return"`` -> ``"       "`` + ``" return"``): indentation
   widths become single tokens and keywords keep their usual ``" return"`` token;
8. any other whitespace.
Then every byte of a piece maps to one of 256 printable characters (GPT-2's byte-level alphabet), so any string
encodes without an unknown token and decodes back exactly.

**Bounded memory.** The `tokenizers` trainer holds one entry per distinct pre-token plus, per distinct pair, the
set of words containing it; the SentencePiece trainer holds every sentence it is given. Both grow with the text
fed, so the text fed is capped: ``max_memory_gb`` (default 8) buys
``(max_memory_gb * 1e9 - BASE_MEMORY_BYTES) / MEMORY_PER_TEXT_BYTE[backend]`` bytes of text (~190 MB for hf,
~450 MB for spm at 8 GB). A first pass measures the corpus; if it is larger, documents are sampled with a fixed,
seeded hash of their position at rate ``budget / corpus_bytes`` (and feeding stops at the budget in any case), so
memory does not depend on corpus size. A long document reaches the trainer in pieces of at most
``zero2all.corpus.pieces.MAX_PIECE_CHARS`` characters, cut where the pre-tokenizer cuts anyway (the same word
counts), and batches are bounded in characters, so one huge document does not cost ~100 bytes per character of
transient memory either. The factors were measured on high-diversity text (BENCHMARKS.md) with a
margin. Peak RSS is reported in the log and in ``z2all_tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import io
import os
import resource
import sys
import time
from typing import Iterator

from zero2all.corpus.pieces import MAX_PIECE_CHARS, text_pieces
from zero2all.corpus.readers import ReadStats, SourceSpec, check_out_outside_inputs, iter_records
from zero2all.fileio import check_writable, claim_output_dir, remove_empty_dirs
from zero2all.tokenizer.hf import (
    N_RESERVED,
    VOCAB_MULTIPLE,
    Tokenizer,
    reserved_token,
    round_up,
    sentencepiece_to_tokenizer_json,
    special_tokens,
)

_CJK = r"\p{Han}\p{Hiragana}\p{Katakana}\p{Hangul}"
PRETOKENIZE_REGEX = (
    r"'(?:[sdmt]|ll|ve|re)"
    rf"|[^\r\n\p{{L}}\p{{N}}]?[{_CJK}]+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}&&[^{_CJK}]]+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|[^\S\r\n]+(?!\S)"
    r"|\s+"
)

DEFAULT_MAX_MEMORY_GB = 8.0
# Peak trainer RSS per byte of text fed, measured on high-diversity text (benchmarks/tokenizer_memory.py: a third
# each of perturbed code, generated Chinese and generated English; 100 MB -> 3.5 GB peak for hf, 1.5 GB for spm),
# plus a ~15 % margin. Every CJK run between punctuation is its own pre-token, so Chinese costs the most; natural
# English or code has fewer distinct words per byte and stays well under the cap.
MEMORY_PER_TEXT_BYTE = {"hf": 40.0, "spm": 17.0}
BASE_MEMORY_BYTES = 400e6  # interpreter, imports, reader buffers
SPM_MAX_SENTENCE_BYTES = 16384


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e6 if sys.platform == "darwin" else peak * 1024 / 1e6


def text_budget_bytes(max_memory_gb: float | None, backend: str = "hf") -> float:
    """Bytes of text the trainer may be fed under a memory cap (inf when uncapped)."""
    if not max_memory_gb or max_memory_gb <= 0:
        return float("inf")
    usable = max_memory_gb * 1e9 - BASE_MEMORY_BYTES
    if usable <= 0:
        raise ValueError(f"max_memory_gb={max_memory_gb}: below the ~{BASE_MEMORY_BYTES / 1e9:.1f} GB a run needs")
    return usable / MEMORY_PER_TEXT_BYTE[backend]


def _keep(index: int, rate: float, seed: int) -> bool:
    """Seeded, order-independent Bernoulli(rate) choice for document ``index``."""
    if rate >= 1.0:
        return True
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < rate


class _SampledTexts:
    """The documents to train on: all of them, or a seeded sample that fits the byte budget."""

    def __init__(self, inputs, text_field, txt_mode, strict, budget: float, seed: int, log):
        self.inputs, self.kw = inputs, dict(text_field=text_field, txt_mode=txt_mode, strict=strict)
        self.budget, self.seed, self.log = budget, seed, log
        self.stats = ReadStats()
        self.corpus_bytes = None
        self.rate = 1.0
        if budget != float("inf"):
            total = 0
            for rec in iter_records(self.inputs, stats=ReadStats(), **self.kw):
                total += len(rec["content"].encode("utf-8", "surrogatepass"))
            self.corpus_bytes = total
            self.rate = min(1.0, budget / max(total, 1))
            log(f"corpus: {total / 1e6:,.1f} MB of text; memory cap allows {budget / 1e6:,.1f} MB -> "
                f"sampling rate {self.rate:.4f}")
        self.fed_bytes = 0
        self.fed_docs = 0

    def __iter__(self) -> Iterator[str]:
        for rec in iter_records(self.inputs, stats=self.stats, **self.kw):
            if not _keep(rec["gid"], self.rate, self.seed):
                continue
            text = rec["content"]
            n = len(text.encode("utf-8", "surrogatepass"))
            if self.fed_bytes + n > self.budget:
                break
            self.fed_bytes += n
            self.fed_docs += 1
            yield text

    def batches(self, size: int = 256, max_chars: int = 1 << 20,
                piece_chars: int = MAX_PIECE_CHARS) -> Iterator[list[str]]:
        """The texts in batches of at most ``size`` texts and about ``max_chars`` characters, a document longer
        than ``piece_chars`` cut into pieces (``zero2all.corpus.pieces``: at pre-token boundaries, so the trainer
        counts the same words), so the trainer's per-batch working memory is bounded whatever the document size."""
        batch, chars = [], 0
        for t in self:
            for piece in text_pieces(t, piece_chars):
                batch.append(piece)
                chars += len(piece)
                if len(batch) == size or chars >= max_chars:
                    yield batch
                    batch, chars = [], 0
        if batch:
            yield batch


def _priority(seed: int, text: str) -> float:
    """A document's seeded sampling priority in [0, 1): a hash of its content, so the sample does not depend on the
    order the documents are read in (nor on how the corpus is cut into shards)."""
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=seed.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") / 2**64


class ByteReservoir:
    """The documents of least priority that fit ``budget`` bytes: add documents in any order, in any number of
    reservoirs, merge them, and the result is the same set, the longest run of the documents sorted by priority
    whose UTF-8 bytes total at most ``budget``. (A document evicted once can never come back: documents of lower
    priority only add bytes in front of it.) Holds at most ``budget`` bytes of text plus the one being added."""

    def __init__(self, budget: float, seed: int = 0):
        import heapq

        self._heapq, self.budget, self.seed = heapq, budget, seed
        self.heap: list = []   # (-priority, n bytes, text): the largest priority on top
        self.bytes = 0
        self.seen_docs = self.seen_bytes = 0
        self.full = False       # something was evicted (or refused): the sample is not the whole input

    def add(self, text: str, priority: float | None = None) -> None:
        n = len(text.encode("utf-8", "surrogatepass"))
        self.seen_docs += 1
        self.seen_bytes += n
        self._push(self._priority(text) if priority is None else priority, n, text)

    def _priority(self, text: str) -> float:
        return _priority(self.seed, text)

    def _push(self, p: float, n: int, text: str) -> None:
        if self.full and self.heap and p >= -self.heap[0][0]:
            return  # above everything kept once the budget is reached: it would be evicted at once
        self._heapq.heappush(self.heap, (-p, n, text))
        self.bytes += n
        while self.bytes > self.budget and self.heap:
            _, m, _ = self._heapq.heappop(self.heap)
            self.bytes -= m
            self.full = True

    def merge(self, other: "ByteReservoir") -> None:
        self.seen_docs += other.seen_docs
        self.seen_bytes += other.seen_bytes
        self.full |= other.full
        for negp, n, text in other.heap:
            self._push(-negp, n, text)

    def texts(self) -> list[str]:
        """The sample, in priority order (the same order whatever order the corpus was read in)."""
        return [t for _, _, t in sorted(self.heap, key=lambda e: (-e[0], e[2]))]


def reservoir_of_file(path: str, budget: float, seed: int, kw: dict) -> tuple[ByteReservoir, dict]:
    """One input file's reservoir and its read counts (a Ray task per file under ``--ray``)."""
    stats = ReadStats()
    r = ByteReservoir(budget, seed)
    for rec in iter_records(path, stats=stats, **kw):
        r.add(rec["content"])
    return r, stats.to_dict()


class _ReservoirTexts(_SampledTexts):
    """``--sample-bytes``: a bounded, seeded sample (:class:`ByteReservoir`) drawn in one pass over every input
    file (on Ray, one task per file, the reservoirs merged as they come back)."""

    def __init__(self, inputs, text_field, txt_mode, strict, budget: float, seed: int, log, ray: bool = False):
        self.inputs, self.kw = inputs, dict(text_field=text_field, txt_mode=txt_mode, strict=strict)
        self.budget, self.seed, self.log = budget, seed, log
        self.stats = ReadStats()
        reservoir = ByteReservoir(budget, seed)
        if ray:
            self._draw_on_ray(reservoir)
        else:
            for rec in iter_records(self.inputs, stats=self.stats, **self.kw):
                reservoir.add(rec["content"])
        self.corpus_bytes = reservoir.seen_bytes
        self.sample = reservoir.texts()
        self.rate = round(reservoir.bytes / max(reservoir.seen_bytes, 1), 6)
        log(f"corpus: {reservoir.seen_bytes / 1e6:,.1f} MB of text in {reservoir.seen_docs:,} documents; sample "
            f"{reservoir.bytes / 1e6:,.1f} MB in {len(self.sample):,} documents (--sample-bytes "
            f"{budget / 1e6:,.1f} MB, seed {seed})")
        self.fed_bytes = 0
        self.fed_docs = 0

    def _draw_on_ray(self, reservoir: ByteReservoir) -> None:
        from collections import deque

        from zero2all.corpus.on_ray import RETRIES, connect, ray_workers
        from zero2all.corpus.readers import expand_paths

        ray = connect()
        task = ray.remote(reservoir_of_file).options(max_retries=RETRIES, retry_exceptions=True)
        in_flight = 2 * ray_workers(ray, None)
        pending: deque = deque()

        def take():
            part, counts = ray.get(pending.popleft())
            reservoir.merge(part)
            self.stats.merge_dict(counts)

        for spec in self.inputs:
            paths = spec.paths if isinstance(spec, SourceSpec) else [spec]
            for p in paths:
                for f in expand_paths(str(p)):
                    pending.append(task.remote(f, self.budget, self.seed, self.kw))
                    if len(pending) >= in_flight:
                        take()
        while pending:
            take()

    def __iter__(self) -> Iterator[str]:
        for text in self.sample:
            self.fed_bytes += len(text.encode("utf-8", "surrogatepass"))
            self.fed_docs += 1
            yield text


def _normalise_inputs(inputs) -> list:
    if isinstance(inputs, (str, os.PathLike, SourceSpec)):
        inputs = [inputs]
    return [x if isinstance(x, SourceSpec) else str(x) for x in inputs]


def train_tokenizer(inputs, vocab_size: int, out_dir=None, backend: str = "hf", *, text_field: str | None = None,
                    txt_mode: str = "file", strict: bool = False, max_memory_gb: float | None = DEFAULT_MAX_MEMORY_GB,
                    seed: int = 0, min_frequency: int = 2, n_reserved: int = N_RESERVED,
                    log=print, sample_bytes: float | None = None, ray: bool | None = None) -> Tokenizer:
    """Train a tokenizer on ``inputs`` (paths, globs, ``"stdlib"``, ``NAME=PATH`` specs) and save it to
    ``out_dir`` (when given; checked writable before training). ``vocab_size`` includes the special tokens and is
    rounded up to a multiple of 64 (logged when that changes it); it must be at least 256 bytes + the specials + 64.
    A corpus that supports fewer merges gives a smaller vocabulary (the learned tokens padded with reserved ones to
    a multiple of 64) and a ``warning:`` line saying so. ``max_memory_gb`` caps the trainer's memory (None or 0: no
    cap, everything is fed). ``sample_bytes``: train on a bounded sample instead (:class:`ByteReservoir`: at most
    this many bytes of text, the same documents for a seed however the corpus is read or sharded; the memory cap
    still bounds it); ``ray``: draw it on Ray, one task per file. Returns the Tokenizer; its ``meta["training"]``
    holds time, peak RSS, bytes fed and
    the bad-input report."""
    if backend not in ("hf", "spm"):
        raise ValueError(f"backend: {backend!r} is not one of hf, spm")
    specials = special_tokens(n_reserved)
    base = len(specials) + 256 + (1 if backend == "spm" else 0)  # specials, the bytes (+ spm's unknown piece)
    min_size = base + VOCAB_MULTIPLE
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size}: must be at least {min_size} (256 byte tokens + {base - 256} "
                         f"special tokens + {VOCAB_MULTIPLE} tokens to learn)")
    target = round_up(vocab_size, VOCAB_MULTIPLE)
    # an --out inside a directory input would be read back by the next run; a folder of the user's own, or an
    # unwritable --out, fails now, not after the training
    if out_dir is not None:
        sources = [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs
        check_out_outside_inputs(sources, out_dir)
        claim_output_dir(out_dir, "train-tokenizer", inputs=sources)
    created = check_writable(out_dir) if out_dir is not None else []
    try:
        return _train(inputs, vocab_size, out_dir, backend, target, specials, text_field, txt_mode, strict,
                      max_memory_gb, seed, min_frequency, n_reserved, log, sample_bytes, ray)
    except BaseException:
        remove_empty_dirs(created)
        raise


def _train(inputs, vocab_size, out_dir, backend, target, specials, text_field, txt_mode, strict, max_memory_gb,
           seed, min_frequency, n_reserved, log, sample_bytes=None, ray=None) -> Tokenizer:
    base = len(specials) + 256 + (1 if backend == "spm" else 0)
    if target != vocab_size:
        log(f"vocab_size {vocab_size} rounded up to {target} (a multiple of {VOCAB_MULTIPLE}: the model's "
            f"embedding rows)")
    t0 = time.time()
    from zero2all.corpus.on_ray import ray_requested

    if sample_bytes is not None or ray_requested(ray):
        budget = min(sample_bytes or float("inf"), text_budget_bytes(max_memory_gb, backend))
        if budget == float("inf"):
            raise ValueError("--ray: give --sample-bytes (or a --max-memory-gb cap): the sample drawn across the "
                             "cluster needs a bound")
        texts = _ReservoirTexts(_normalise_inputs(inputs), text_field, txt_mode, strict, budget, seed, log,
                                ray=ray_requested(ray))
    else:
        texts = _SampledTexts(_normalise_inputs(inputs), text_field, txt_mode, strict,
                              text_budget_bytes(max_memory_gb, backend), seed, log)
    if backend == "hf":
        tokenizer_json, extra_meta, extra_files = _train_bytelevel_bpe(texts, target, specials, min_frequency)
    else:
        tokenizer_json, extra_meta, extra_files = _train_sentencepiece_bpe(texts, target, specials, seed)
    if texts.fed_docs == 0:
        raise ValueError(f"no usable text in {inputs!r}: {texts.stats.report()}")
    tokenizer_json, n_pad = _pad_vocab(tokenizer_json, n_reserved)
    seconds = time.time() - t0
    meta = {
        "backend": backend,
        "eos_token": specials[0],
        "pad_token": specials[1],
        **extra_meta,
        "pretokenize_regex": PRETOKENIZE_REGEX if backend == "hf" else None,
        "training": {
            "inputs": [str(x) if not isinstance(x, SourceSpec) else f"{x.name}={','.join(x.paths)}"
                       for x in _normalise_inputs(inputs)],
            "vocab_size_requested": vocab_size, "vocab_size_target": target, "reserved_padding": n_pad,
            "max_memory_gb": max_memory_gb, "corpus_bytes": texts.corpus_bytes, "sampling_rate": texts.rate,
            "sample_bytes": sample_bytes, "fed_bytes": texts.fed_bytes, "fed_docs": texts.fed_docs,
            "seconds": round(seconds, 2),
            "peak_rss_mb": round(peak_rss_mb(), 1), "seed": seed, "read": texts.stats.to_dict()},
    }
    tok = Tokenizer(tokenizer_json, meta=meta, extra_files=extra_files)
    if texts.stats.bad:
        log(texts.stats.report())
    log(f"trained {backend} tokenizer: vocab {tok.vocab_size} ({n_pad} reserved padding), "
        f"{texts.fed_docs:,} docs / {texts.fed_bytes / 1e6:,.1f} MB in {seconds:.1f}s, "
        f"peak RSS {peak_rss_mb():,.0f} MB")
    size = tok.vocab_size
    if size < target:
        learned = size - n_pad - base
        if backend == "hf":
            why = (f"byte-level BPE found no more pairs occurring at least --min-frequency {min_frequency} times "
                   f"after {learned:,} merges")
            more = "add text" + (" or lower --min-frequency" if min_frequency > 1 else "")
        else:
            why = f"SentencePiece found no more pieces to learn after {learned:,}"
            more = "add text"
        log(f"warning: the corpus supports a vocabulary of {size}, not the {target} asked for: {why} (the rest up "
            f"to a multiple of {VOCAB_MULTIPLE} is {n_pad} reserved tokens); {more} to get a larger one")
    if out_dir is not None:
        tok.save(out_dir, kind="train-tokenizer")
        log(f"wrote {out_dir} (hash {tok.hash[:16]})")
    return tok


def _pad_vocab(tokenizer_json: str, n_reserved: int) -> tuple[str, int]:
    """Append ``<|reserved_k|>`` special tokens until the vocabulary size is a multiple of 64."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as _HFTokenizer

    tok = _HFTokenizer.from_str(tokenizer_json)
    n = tok.get_vocab_size(with_added_tokens=True)
    pad = round_up(n) - n
    k = n_reserved
    names = []
    while len(names) < pad:
        if tok.token_to_id(reserved_token(k)) is None:
            names.append(reserved_token(k))
        k += 1
    if names:
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in names])
    return tok.to_str(), pad


def _train_bytelevel_bpe(texts: _SampledTexts, target: int, specials: list[str], min_frequency: int):
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as _HFTokenizer

    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=target, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts.batches(), trainer)
    return tok.to_str(), {}, {}


def _spm_sentences(texts: _SampledTexts) -> Iterator[str]:
    """SentencePiece learns from "sentences" without newlines: one per non-blank line, cut to its length limit
    (newlines themselves are encoded through byte fallback)."""
    for doc in texts:
        for line in doc.split("\n"):
            if line.strip():
                while len(line.encode("utf-8", "surrogatepass")) > SPM_MAX_SENTENCE_BYTES:
                    yield line[: SPM_MAX_SENTENCE_BYTES // 4]
                    line = line[SPM_MAX_SENTENCE_BYTES // 4:]
                yield line


def _train_sentencepiece_bpe(texts: _SampledTexts, target: int, specials: list[str], seed: int):
    import sentencepiece as spm

    model = io.BytesIO()
    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=_spm_sentences(texts), model_writer=model,
        model_type="bpe", vocab_size=target, hard_vocab_limit=False,
        byte_fallback=True, control_symbols=specials, unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,
        # lossless: no normalisation, no dummy prefix, whitespace kept as is (runs become "▁▁▁▁" pieces)
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True, character_coverage=0.9995,
        max_sentence_length=SPM_MAX_SENTENCE_BYTES, input_sentence_size=0, shuffle_input_sentence=False,
        num_threads=os.cpu_count() or 1, minloglevel=2)
    proto = model.getvalue()
    tokenizer_json, extra = sentencepiece_to_tokenizer_json(proto, specials)
    return tokenizer_json, extra, {"tokenizer.model": proto}
