"""The race's scoring: bits per byte on the same validation text for all three sides, and each side's result line.

    bpb = (sum of the token losses in nats) / (ln 2 x UTF-8 bytes of the text scored)

How each side's number is obtained (the same held-out packages of the site-packages corpus, `valid.jsonl`):

* **ours**: ``z2all eval --ckpt RUN/final --data valid.jsonl`` (``zero2all/eval/perplexity.py``): every document
  alone, ``[<|endoftext|>] + encode(text)``, every text token predicted once with windows of the context moving by
  half of it. Its JSON gives the summed loss and the bytes; this file only divides.
* **nanochat**: its final checkpoint, loaded with its own ``checkpoint_manager.load_model``, scored by THE SAME code
  (``evaluate_texts`` of ``zero2all/eval/perplexity.py``) through two adapters (``ForeignModel``,
  ``ForeignTokenizer``): ``[<|bos|>] + encode(text)``, the same windows, the same byte count. nanochat's own
  ``evaluate_bpb`` (its validation curve during training) uses the same definition (summed nats of targets with a
  byte length over ln 2 x their bytes, special tokens excluded) but on its best-fit packed rows, where ~1/3 of
  the tokens of long documents are cropped and the rows cycle through the validation file: its curve is read from
  its log as it prints it, its final number is ours.
* **modded-nanogpt**: its validation loss is a mean over the first ``val_tokens`` predictions of the GPT-2 token
  stream (``benchmarks/race_data.py`` writes ``val_meta.json`` with that count and the UTF-8 bytes of exactly
  those targets): bpb = mean loss x val_tokens / (ln 2 x bytes). Its mean also includes the predictions of the
  ``<|endoftext|>`` between documents (0 bytes, ``val_eot_targets`` of them; nanochat and we skip the document
  separator): that puts their loss, at most a few nats each, on modded's side of the ledger; the result line
  prints their share of the targets.

    python benchmarks/race_score.py ours --run RUN --eval eval.json --out result.json
    python benchmarks/race_score.py nanochat --base-dir DIR --valid valid.jsonl --log train.log --out result.json
    python benchmarks/race_score.py modded --log train.log --meta val_meta.json --out result.json
    python benchmarks/race_score.py summary race-ours.json race-nanochat.json race-modded.json   # the table

Each prints one line ``race: side=... params=... tokens=... train_s=... bpb=...`` and writes the JSON with the
validation curve (seconds of training, bits per byte) where the side logs one.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

LN2 = math.log(2)


def bits_per_byte(nll_nats: float, nbytes: int) -> float:
    """Summed token losses (nats) over ln 2 x the UTF-8 bytes of the scored text."""
    if nbytes <= 0:
        raise ValueError(f"bits per byte of {nbytes} bytes")
    return nll_nats / (LN2 * nbytes)


def bpb_from_mean_loss(mean_loss: float, n_tokens: int, nbytes: int) -> float:
    """A mean token loss (nats) over ``n_tokens`` predictions whose targets hold ``nbytes`` UTF-8 bytes."""
    return bits_per_byte(mean_loss * n_tokens, nbytes)


# ------------------------------------------------------------------------ a foreign model under our eval's rules


@dataclass
class _Cfg:
    max_seq_len: int
    padded_vocab_size: int
    bos_token_id: int | None = None


class _Device:
    def __init__(self, device):
        self.device = device


class ForeignModel:
    """What ``zero2all.eval.perplexity.score_documents`` asks of a model, around any ``logits_fn(tokens (B, T)) ->
    logits (B, T, V)``: ``cfg.max_seq_len``, ``cfg.padded_vocab_size``, ``embed_tokens.weight.device`` and
    ``model(tokens) -> (logits, None)``."""

    def __init__(self, logits_fn: Callable, max_seq_len: int, vocab_size: int, device="cpu"):
        self.logits_fn = logits_fn
        self.cfg = _Cfg(max_seq_len, vocab_size)
        self.embed_tokens = type("E", (), {"weight": _Device(device)})()

    def __call__(self, tokens):
        return self.logits_fn(tokens), None


class ForeignTokenizer:
    """``encode(text) -> ids``, the id each document is conditioned on (``eos_id``) and ``vocab_size``."""

    def __init__(self, encode: Callable[[str], list], start_id: int, vocab_size: int):
        self.encode, self.eos_id, self.vocab_size = encode, start_id, vocab_size


def score_foreign(logits_fn, encode, start_id: int, vocab_size: int, context: int, docs, device="cpu",
                  batch_size: int = 8) -> dict:
    """Our eval's numbers (``overall``: loss, bits_per_byte, tokens, bytes, docs) for a foreign model."""
    from zero2all.eval.perplexity import evaluate_texts

    model = ForeignModel(logits_fn, context, vocab_size, device)
    tok = ForeignTokenizer(encode, start_id, vocab_size)
    result = evaluate_texts(model, tok, docs, context=context, batch_size=batch_size, progress=False)
    return result.to_dict()


def score_nanochat(base_dir: str, valid: str, context: int, device: str = "cuda", max_docs: int | None = None,
                   batch_size: int = 8) -> dict:
    """nanochat's final base checkpoint (under ``NANOCHAT_BASE_DIR`` = ``base_dir``; nanochat importable)."""
    import os

    import torch

    os.environ["NANOCHAT_BASE_DIR"] = base_dir
    from nanochat.checkpoint_manager import load_model  # their code: on sys.path by the race script

    from zero2all.eval.perplexity import iter_documents

    model, tokenizer, _meta = load_model("base", torch.device(device), phase="eval")

    def logits_fn(tokens):
        with torch.no_grad():
            return model(tokens)

    docs = list(iter_documents([valid], max_docs=max_docs))
    return score_foreign(logits_fn, lambda t: tokenizer.encode(t), tokenizer.get_bos_token_id(),
                         tokenizer.get_vocab_size(), context, docs, device, batch_size)


# ------------------------------------------------------------------------------------------------- log readers

_NC_EVAL = re.compile(r"^Step (\d+) \| Validation bpb: ([0-9.]+)")
_NC_STEP = re.compile(r"^step (\d+)/(\d+) .*\| total time: ([0-9.]+)m")
_NC_BATCH = re.compile(r"^Total batch size ([0-9,]+)")
_NC_PARAM = re.compile(r"^(wte|value_embeds|lm_head|transformer_matrices|scalars|total)\s*: ([0-9,]+)")
_MD_VAL = re.compile(r"^step:(\d+)/(\d+) val_loss:([0-9.]+) train_time:(\d+)ms")
_MD_STEP = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms")
_MD_PARAM = re.compile(r"^race-params total=(\d+) embedding=(\d+)")


def _num(s: str) -> int:
    return int(s.replace(",", ""))


def read_nanochat_log(text: str) -> dict:
    """Steps, the tokens per step, the parameter counts, the training seconds (nanochat's own clock, which leaves
    out its first 11 steps: compilation) and the validation curve [(seconds, bpb)] it printed."""
    batch, params, step_time, curve, last_step = 0, {}, {0: 0.0}, [], 0
    evals = []
    for line in text.splitlines():
        if m := _NC_BATCH.match(line):
            batch = _num(m.group(1))
        elif m := _NC_PARAM.match(line):
            params[m.group(1)] = _num(m.group(2))
        elif m := _NC_STEP.match(line):
            last_step = int(m.group(1)) + 1  # the line is printed after update `step` (counted from 0)
            step_time[last_step] = 60 * float(m.group(3))
        elif m := _NC_EVAL.match(line):
            evals.append((int(m.group(1)), float(m.group(2))))
    for step, bpb in evals:
        curve.append((round(step_time.get(step, 0.0), 1), bpb))
    non_emb = params.get("transformer_matrices", 0) + params.get("lm_head", 0) + params.get("scalars", 0)
    return {"steps": last_step, "tokens": batch * last_step, "train_s": round(step_time[last_step], 1),
            "params": non_emb, "params_total": params.get("total", 0), "curve": curve}


def read_modded_log(text: str, meta: dict) -> dict:
    """Steps, tokens, parameters (printed by the race's patch), training seconds (its clock: validation and
    compilation left out) and the curve with each validation loss turned into bits per byte."""
    curve, last_step, train_ms, params = [], 0, 0, (0, 0)
    for line in text.splitlines():
        if m := _MD_VAL.match(line):
            loss = float(m.group(3))
            curve.append((round(int(m.group(4)) / 1000, 1),
                          bpb_from_mean_loss(loss, meta["val_tokens"], meta["val_scored_bytes"]), loss))
        elif m := _MD_STEP.match(line):
            last_step, train_ms = int(m.group(1)), int(m.group(3))
        elif m := _MD_PARAM.match(line):
            params = (int(m.group(1)), int(m.group(2)))
    tokens_per_step = int(meta.get("train_tokens_per_step", 8 * 48 * 1024))  # its train_seq_len x 8 micro-steps
    return {"steps": last_step, "tokens": tokens_per_step * last_step, "train_s": round(train_ms / 1000, 1),
            "params": params[0] - params[1], "params_total": params[0],
            "curve": [(s, b) for s, b, _ in curve], "final_loss": curve[-1][2] if curve else None,
            "bpb": curve[-1][1] if curve else None}


def read_ours(run: Path, eval_json: Path) -> dict:
    """Our run: metrics.jsonl (each record's wall ``time``; the ``info`` record's sizes), and the `z2all eval
    --json` of the final model. Training seconds leave the evaluations out, as the peers' clocks do: an
    evaluation's span runs from the record before it (the update it follows, or the start) to its bits-per-byte
    record; ``wall_s`` keeps them in (what ``train.time_budget_s`` counts)."""
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    info = next((r for r in recs if r.get("kind") == "info"), {})
    start = float(info.get("time", recs[0]["time"] if recs else 0.0))
    prev, spent, curve, last_step, last_train, spent_then = start, 0.0, [], 0, start, 0.0
    for r in recs:
        if r.get("kind") == "train":
            prev = last_train = float(r["time"])
            spent_then = spent  # evaluations after the last update count neither way
            last_step = max(last_step, int(r["step"]))
        elif r.get("kind") == "eval" and "overall/bits_per_byte" in r:
            curve.append((round(prev - start - spent, 1), r["overall/bits_per_byte"]))
            spent += float(r["time"]) - prev
            prev = float(r["time"])
    overall = json.loads(eval_json.read_text())["overall"]
    return {"steps": last_step, "tokens": last_step * int(info.get("tokens_per_step", 0)),
            "train_s": round(last_train - start - spent_then, 1), "wall_s": round(last_train - start, 1),
            "curve": curve, "bpb": bits_per_byte(overall["loss"] * overall["tokens"], overall["bytes"]),
            "scored_tokens": overall["tokens"], "scored_bytes": overall["bytes"],
            "params": info.get("non_embedding_params", 0), "params_total": info.get("params", 0)}


def time_to(curve: list, target: float) -> float | None:
    """The first training time at which a curve [(seconds, bpb)] reaches ``target`` (linear between its points),
    None if it never does."""
    prev = None
    for t, b in curve:
        if b <= target:
            if prev is None or prev[1] == b:
                return float(t)
            t0, b0 = prev
            return t0 + (t - t0) * (b0 - target) / (b0 - b)
        prev = (t, b)
    return None


def summary(results: dict) -> str:
    """The race table from the sides' result JSONs: each side's numbers and the time it takes to reach nanochat's
    final bits per byte (nanochat reaches it at its own end, ``train_s``), on curves scored on the same text as
    the finals where the side logs one (ours: every evaluation on the whole validation split; modded: its
    validation loss; nanochat's own curve is on its packed rows, so only its final enters)."""
    nc = results.get("nanochat")
    rows = ["| side | params (blocks + head) | tokens | training s | final bits per byte | s to nanochat's final |",
            "|---|---|---|---|---|---|"]
    for side in ("ours", "nanochat", "modded"):
        r = results.get(side)
        if r is None:
            continue
        if nc is None:
            reach = "-"
        elif side == "nanochat":
            reach = f"{nc['train_s']:.0f}"
        else:
            t = time_to(r.get("curve", []), nc["bpb"])
            reach = "not reached" if t is None else f"{t:.0f} ({t / nc['train_s']:.2f}x)"
        rows.append(f"| {side} | {r.get('params', 0) / 1e6:.1f}M | {r.get('tokens', 0) / 1e6:.0f}M | "
                    f"{r.get('train_s', 0):.0f} | {r['bpb']:.4f} | {reach} |")
    return "\n".join(rows)


def result_line(side: str, r: dict) -> str:
    extra = f" eot_share={r['eot_share']:.4f}" if "eot_share" in r else ""
    return (f"race: side={side} params={r.get('params', 0) / 1e6:.1f}M (total {r.get('params_total', 0) / 1e6:.1f}M)"
            f" tokens={r.get('tokens', 0) / 1e6:.1f}M train_s={r.get('train_s', 0):.0f} bpb={r['bpb']:.4f}{extra}"
            f" curve=" + ",".join(f"{s:.0f}s:{b:.4f}" for s, b in r.get("curve", [])))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="side", required=True)
    o = sub.add_parser("ours")
    o.add_argument("--run", required=True)
    o.add_argument("--eval", required=True, help="the JSON of `z2all eval --json` on the final model")
    n = sub.add_parser("nanochat")
    n.add_argument("--base-dir", required=True)
    n.add_argument("--valid", required=True)
    n.add_argument("--log", required=True)
    n.add_argument("--context", type=int, default=2048)
    n.add_argument("--device", default="cuda")
    n.add_argument("--max-docs", type=int, default=None)
    sm = sub.add_parser("summary", help="the race table from race-<side>.json files")
    sm.add_argument("results", nargs="+")
    m = sub.add_parser("modded")
    m.add_argument("--log", required=True)
    m.add_argument("--meta", required=True)
    for p in (o, n, m):
        p.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.side == "summary":
        try:
            results = {json.loads(Path(f).read_text())["side"]: json.loads(Path(f).read_text()) for f in args.results}
        except (OSError, ValueError, KeyError) as e:
            print(f"race_score: {e}", file=sys.stderr)
            return 2
        print(summary(results))
        return 0
    try:
        if args.side == "ours":
            r = read_ours(Path(args.run), Path(args.eval))
        elif args.side == "nanochat":
            r = read_nanochat_log(Path(args.log).read_text(errors="replace"))
            scored = score_nanochat(args.base_dir, args.valid, args.context, args.device, args.max_docs)["overall"]
            r.update(bpb=bits_per_byte(scored["loss"] * scored["tokens"], scored["bytes"]),
                     scored_tokens=scored["tokens"], scored_bytes=scored["bytes"])
        else:
            meta = json.loads(Path(args.meta).read_text())
            r = read_modded_log(Path(args.log).read_text(errors="replace"), meta)
            if r["bpb"] is None:
                raise ValueError(f"{args.log}: no validation loss line (step:N/M val_loss:...)")
            r.update(scored_tokens=meta["val_tokens"], scored_bytes=meta["val_scored_bytes"],
                     eot_share=meta["val_eot_targets"] / meta["val_tokens"])
    except (OSError, ValueError, KeyError) as e:
        print(f"race_score: {e}", file=sys.stderr)
        return 2
    r["side"] = args.side
    Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
    print(result_line(args.side, r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
