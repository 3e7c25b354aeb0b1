"""`z2all eval`: bits per byte against a reference computed with transformers on the HF export."""

import json
import math
import random

import pytest
import torch
from data_helpers import english, exported_tiny_model

from zero2all.eval.perplexity import evaluate_texts, windows

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    rng = random.Random(0)
    exported_tiny_model(d, rng)
    data = d / "valid.jsonl"
    docs = [{"text": english(rng, 5), "data_src": "short"},
            {"text": english(rng, 9), "data_src": "short"},
            {"text": "ünïcödé 😀 " + english(rng, 70), "data_src": "long"},  # > 32 tokens: several windows
            {"text": english(rng, 3)}]                                       # no data_src: the file stem
    data.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in docs))
    return d, docs


def reference(hf_dir, texts, context, stride):
    """Summed NLL (nats) and token count per text with transformers: ids = [eos] + AutoTokenizer(text); the id at
    position t (t >= 1) is predicted by the window that ends at e(t) = min(C + ceil((t - C) / S) * S, n - 1)
    (e = min(C, n - 1) for t <= C), fed ids[max(0, e - C):e]."""
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    for text in texts:
        ids = [tok.convert_tokens_to_ids("<|endoftext|>")] + tok(text, add_special_tokens=False).input_ids
        last = len(ids) - 1
        nll = 0.0
        cache = {}
        for t in range(1, last + 1):
            e = min(context, last) if t <= context else min(context + math.ceil((t - context) / stride) * stride,
                                                            last)
            a = max(0, e - context)
            assert t - a >= min(t, context - stride)  # left context of at least C - S ids
            if e not in cache:
                with torch.no_grad():
                    cache[e] = torch.log_softmax(model(torch.tensor([ids[a:e]])).logits[0].double(), -1)
            nll -= float(cache[e][t - 1 - a, ids[t]])
        out.append((nll, last, len(text.encode("utf-8"))))
    return out


@pytest.mark.parametrize("n,context,stride", [(1, 4, 2), (2, 4, 2), (5, 4, 4), (40, 8, 3), (33, 32, 16)])
def test_windows_score_each_token_once_with_left_context(n, context, stride):
    seen = []
    for a, first, end in windows(n, context, stride):
        assert end - a <= context and a >= 0
        for t in range(first + 1, end + 1):
            assert t - a >= min(t, context - stride + 1)
            seen.append(t)
    assert seen == list(range(1, n))


def test_eval_bits_per_byte_equals_transformers(ckpt, tmp_path, capsys):
    from zero2all.cli import main

    d, docs = ckpt
    out = tmp_path / "eval.json"
    assert main(["eval", "--ckpt", str(d / "ours"), "--data", str(d / "valid.jsonl"), "--json", str(out),
                 "--no-progress", "--batch-size", "3"]) == 0
    printed = capsys.readouterr().out
    assert "bits/byte" in printed and "overall" in printed
    got = json.loads(out.read_text())
    assert set(got["overall"]) >= {"loss", "ppl", "bits_per_byte", "tokens", "bytes"}
    ref = reference(d / "hf", [x["text"] for x in docs], context=32, stride=16)
    assert ref[2][1] > 32 * 2  # the long document needs several windows
    nll, tokens, nbytes = (sum(r[i] for r in ref) for i in range(3))
    assert got["overall"]["tokens"] == tokens and got["overall"]["bytes"] == nbytes
    assert abs(got["overall"]["bits_per_byte"] - nll / math.log(2) / nbytes) < 1e-4
    assert abs(got["overall"]["loss"] - nll / tokens) < 1e-4
    assert abs(got["overall"]["ppl"] - math.exp(nll / tokens)) < 1e-3
    assert set(got["sources"]) == {"short", "long", "valid"}
    by_src = {"short": ref[:2], "long": ref[2:3], "valid": ref[3:]}
    for name, rows in by_src.items():
        n, b = sum(r[0] for r in rows), sum(r[2] for r in rows)
        assert abs(got["sources"][name]["bits_per_byte"] - n / math.log(2) / b) < 1e-4, name
        assert got["sources"][name]["docs"] == len(rows)


def test_eval_stride_and_batching_do_not_change_short_documents(ckpt):
    from zero2all import load_model, load_tokenizer

    d, docs = ckpt
    model, tok = load_model(d / "ours"), load_tokenizer(d / "ours")
    texts = [("s", x["text"]) for x in docs[:2] + docs[3:]]
    a = evaluate_texts(model, tok, texts, batch_size=1, progress=False).overall
    b = evaluate_texts(model, tok, texts, stride=5, batch_size=8, progress=False).overall
    assert a.tokens == b.tokens and abs(a.nll - b.nll) < 1e-6
    # a smaller context changes the long document's score, and it stays finite
    long_doc = [("l", docs[2]["text"])]
    c = evaluate_texts(model, tok, long_doc, context=8, stride=3, progress=False).overall
    assert c.tokens == len(tok.encode(docs[2]["text"])) and math.isfinite(c.nll)


def test_eval_errors_are_one_line(ckpt, tmp_path, capsys):
    from zero2all.cli import main

    d, _ = ckpt
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    assert main(["eval", "--ckpt", str(d / "ours"), "--data", str(empty), "--no-progress"]) == 2
    assert "no document with text" in capsys.readouterr().err
    assert main(["eval", "--ckpt", str(d / "ours"), "--data", str(d / "valid.jsonl"), "--context", "64",
                 "--no-progress"]) == 2
    assert "context: 64" in capsys.readouterr().err
