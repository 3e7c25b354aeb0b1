"""Token loss, perplexity and bits per byte of a model on text (``z2all eval``).

The rules:

* **Documents.** Each record of the input files (``zero2all.corpus.readers.iter_records``: json, jsonl, parquet,
  txt, compressed or not) is one document, scored on its own: nothing is packed across documents.
* **First token.** A document is scored from its first token: the ids are ``[start] + encode(text)`` and every id
  of ``encode(text)`` is predicted, the first one conditioned on ``start`` alone. ``start`` is the tokenizer's
  end-of-text token (``<|endoftext|>``), which is what precedes every document in the pretraining stream (an eos
  after each document); a tokenizer without one uses the model's ``bos_token_id`` (HF Llama models).
* **Long documents.** A document whose ids do not fit the context ``C`` (the model's ``max_seq_len`` unless
  ``context`` says less) is scored with a sliding window of ``C`` ids moving ``stride`` ids at a time (default
  ``C // 2``): the first window scores its ``C`` predictions, each further window scores only its last ``stride``
  predictions (the last window: those not yet scored), so every token is scored exactly once and with at least
  ``C - stride`` ids of left context.
* **Numbers.** Per source and overall: ``loss`` = summed negative log-likelihood (nats) / scored tokens,
  ``ppl`` = exp(loss), ``bits_per_byte`` = summed NLL / ln 2 / UTF-8 bytes of the scored text (tokenizer
  independent: models with different tokenizers compare on it), ``tokens``, ``bytes``, ``docs``.
* **Sources.** A record's own ``data_src`` field when it has one, else the reader's source name (``NAME=PATH``,
  or the file stem).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F


@dataclass
class Totals:
    nll: float = 0.0  # nats
    tokens: int = 0
    bytes: int = 0
    docs: int = 0

    def add(self, nll: float, tokens: int, nbytes: int) -> None:
        self.nll += nll
        self.tokens += tokens
        self.bytes += nbytes
        self.docs += 1

    def to_dict(self) -> dict:
        loss = self.nll / self.tokens if self.tokens else float("nan")
        return {"loss": loss, "ppl": math.exp(loss) if self.tokens else float("nan"),
                "bits_per_byte": self.nll / math.log(2) / self.bytes if self.bytes else float("nan"),
                "tokens": self.tokens, "bytes": self.bytes, "docs": self.docs,
                "bytes_per_token": self.bytes / self.tokens if self.tokens else float("nan")}


@dataclass
class EvalResult:
    overall: Totals = field(default_factory=Totals)
    sources: dict[str, Totals] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"overall": self.overall.to_dict(), "sources": {k: v.to_dict() for k, v in self.sources.items()},
                "settings": dict(self.settings)}

    def table(self) -> str:
        rows = [("source", "docs", "tokens", "bytes", "loss", "ppl", "bits/byte", "bytes/token")]
        items = list(self.sources.items()) + [("overall", self.overall)]
        for name, t in items:
            d = t.to_dict()
            rows.append((name, f"{d['docs']:,}", f"{d['tokens']:,}", f"{d['bytes']:,}", f"{d['loss']:.4f}",
                         f"{d['ppl']:.3f}", f"{d['bits_per_byte']:.4f}", f"{d['bytes_per_token']:.3f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = []
        for j, r in enumerate(rows):
            lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
            if j == 0 or j == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def windows(n_ids: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows over a document of ``n_ids`` ids (start token included): (a, first, end) = the window feeds
    ids ``[a, end)`` and scores the predictions of ids ``first+1 .. end`` (id ``t`` is predicted at position
    ``t - 1``). The predictions of ids 1 .. n_ids - 1 are each scored once."""
    if context < 2:
        raise ValueError(f"context: {context} is too small (at least 2)")
    if not 1 <= stride <= context:
        raise ValueError(f"stride: {stride} must be between 1 and the context {context}")
    last = n_ids - 1  # the last id to predict
    out = []
    if last < 1:
        return out
    end = min(context, last)
    out.append((0, 0, end))
    while end < last:
        new_end = min(end + stride, last)
        out.append((new_end - context, end, new_end))
        end = new_end
    return out


@torch.no_grad()
def score_documents(model, docs: Sequence[Sequence[int]], context: int | None = None, stride: int | None = None,
                    batch_size: int = 8, progress: bool | None = None) -> list[tuple[float, int]]:
    """(summed NLL in nats, scored tokens) of each document in ``docs`` (each a list of ids that starts with the
    conditioning id, which is not scored). Windows of all documents are batched, longest first; rows are padded on
    the right (causal attention: padding never reaches a real position)."""
    context = int(context or model.cfg.max_seq_len)
    if context > model.cfg.max_seq_len:
        raise ValueError(f"context: {context} is larger than the model's max_seq_len {model.cfg.max_seq_len}")
    stride = int(stride or max(1, context // 2))
    device = model.embed_tokens.weight.device
    jobs = []  # (doc index, ids of the window, offset of the first scored prediction, number scored)
    for i, ids in enumerate(docs):
        for a, first, end in windows(len(ids), context, stride):
            jobs.append((i, ids[a:end + 1], first - a, end - first))  # fed ids[a:end], targets up to ids[end]
    jobs.sort(key=lambda j: -len(j[1]))
    nll = [0.0] * len(docs)
    counts = [0] * len(docs)
    bar = None
    if progress is None:
        progress = sys.stderr.isatty()
    if progress and jobs:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(j[3] for j in jobs), desc="eval", unit="tok", dynamic_ncols=True)
    for b in range(0, len(jobs), batch_size):
        batch = jobs[b:b + batch_size]
        width = max(len(j[1]) for j in batch) - 1
        tokens = torch.zeros((len(batch), width), dtype=torch.long)
        targets = torch.full((len(batch), width), -100, dtype=torch.long)
        for r, (_, ids, off, n) in enumerate(batch):
            tokens[r, :len(ids) - 1] = torch.as_tensor(ids[:-1], dtype=torch.long)
            # position p predicts ids[p + 1]; scored positions off .. off + n - 1
            targets[r, off:off + n] = torch.as_tensor(ids[off + 1:off + 1 + n], dtype=torch.long)
        tokens, targets = tokens.to(device), targets.to(device)
        logits, _ = model(tokens)
        for r, (i, _, off, n) in enumerate(batch):
            row = F.cross_entropy(logits[r].float(), targets[r], ignore_index=-100, reduction="sum")
            nll[i] += float(row.double())
            counts[i] += n
        if bar is not None:
            bar.update(sum(j[3] for j in batch))
    if bar is not None:
        bar.close()
    return list(zip(nll, counts))


def start_id(tokenizer, model) -> int:
    """The id each document is conditioned on: the tokenizer's end-of-text token, else the model's BOS."""
    if getattr(tokenizer, "eos_id", None) is not None:
        return int(tokenizer.eos_id)
    if model.cfg.bos_token_id is not None:
        return int(model.cfg.bos_token_id)
    raise ValueError("the tokenizer has no end-of-text token and the model config no bos_token_id: nothing to "
                     "condition a document's first token on")


def evaluate_texts(model, tokenizer, docs: Iterable[tuple[str, str]], context: int | None = None,
                   stride: int | None = None, batch_size: int = 8, progress: bool | None = None,
                   chunk_docs: int = 256) -> EvalResult:
    """Score ``docs``, an iterable of (source name, text), with ``model`` and ``tokenizer`` (see the module
    docstring for the rules). Documents are read and scored ``chunk_docs`` at a time (bounded memory)."""
    context = int(context or model.cfg.max_seq_len)
    stride = int(stride or max(1, context // 2))
    if tokenizer.vocab_size > model.cfg.padded_vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                         f"{model.cfg.padded_vocab_size} embedding rows (model.vocab_size)")
    start = start_id(tokenizer, model)
    result = EvalResult(settings={"context": context, "stride": stride, "start_id": start,
                                  "first_token": "conditioned on the start id (end-of-text, else BOS)"})

    def flush(chunk):
        ids = [[start] + tokenizer.encode(text) for _, text in chunk]
        for (src, text), (nll, n) in zip(chunk, score_documents(model, ids, context, stride, batch_size, progress)):
            nbytes = len(text.encode("utf-8", "surrogatepass"))
            result.overall.add(nll, n, nbytes)
            result.sources.setdefault(src, Totals()).add(nll, n, nbytes)

    chunk = []
    for src, text in docs:
        if not text:
            continue
        chunk.append((src, text))
        if len(chunk) >= chunk_docs:
            flush(chunk)
            chunk = []
    if chunk:
        flush(chunk)
    return result


def iter_documents(data: Sequence[str], max_docs: int | None = None, text_field: str | None = None,
                   txt_mode: str = "file", strict: bool = False):
    """(source, text) of the records of ``data`` (paths, globs, ``NAME=PATH``), at most ``max_docs``; the source
    is a record's own ``data_src`` field, else the reader's source name."""
    from zero2all.corpus.readers import iter_records

    n = 0
    for rec in iter_records(list(data), text_field=text_field, txt_mode=txt_mode, strict=strict):
        if max_docs is not None and n >= max_docs:
            return
        own = rec["others"].get("data_src")
        yield (own if isinstance(own, str) and own else rec["data_src"]), rec["content"]
        n += 1


def evaluate_files(ckpt: str | Path, data: Sequence[str], max_docs: int | None = None, device: str = "auto",
                   dtype: str = "auto", context: int | None = None, stride: int | None = None,
                   batch_size: int = 8, tokenizer=None, progress: bool | None = None, text_field: str | None = None,
                   txt_mode: str = "file") -> EvalResult:
    """Load checkpoint ``ckpt`` (any directory ``load_model`` reads) and its tokenizer, and score ``data``."""
    from zero2all.infer.generate import load_for_inference

    model, tok = load_for_inference(str(ckpt), device=device, dtype=dtype, tokenizer=tokenizer)
    result = evaluate_texts(model, tok, iter_documents(data, max_docs, text_field, txt_mode), context=context,
                            stride=stride, batch_size=batch_size, progress=progress)
    result.settings.update({"ckpt": str(ckpt), "data": [str(d) for d in data], "dtype": str(
        model.embed_tokens.weight.dtype).replace("torch.", ""), "device": str(model.embed_tokens.weight.device)})
    return result


def write_json(result: EvalResult, path: str | Path) -> None:
    from zero2all.fileio import save_json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_json(result.to_dict(), Path(path))
