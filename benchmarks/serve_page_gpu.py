"""The chat page's HTTP calls against ``z2all serve`` on a GPU, with the fused decode step (run once on a GPU; no
browser there: the calls are the page's own, made with the standard library).

Two models, each served with an API key on loopback through ``create_server`` (what ``z2all serve`` runs):
  * ``scripted`` (``tests/scripted_model.py``, Triton ops): greedy output known in advance (``<script>`` repeated);
    the streamed text must be exactly that;
  * ``random``: a 12-layer 768-wide model (bf16) with random weights: the streamed text must equal the
    non-streamed one at temperature 0 (``ignore_eos``, so that it runs to max_tokens); the stream's pieces per
    second (one piece per token, plus the first role chunk) are printed.
For each: the page and its files, /v1/models with and without the key, a streamed chat cut off by the client (as
the page's Stop button does) after which /health shows no running sequence, and that the scheduler's decode
session uses the fused step.

    python benchmarks/serve_page_gpu.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

KEY = "gpu-check-key"
WORDS = ("the model reads text and predicts the next token of every document it sees while the tokenizer splits "
         "words into pieces that are learned from a corpus of plain english sentences").split()


def call(base, path, body=None, key=KEY, timeout=120):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers=headers, method="POST" if data else "GET")
    return urllib.request.urlopen(req, timeout=timeout)


def stream_chat(base, body, stop_after=None):
    """The page's streaming call: text pieces until [DONE], or until ``stop_after`` characters (then the
    connection is closed, as the page's AbortController does). Returns (text, finish, seconds, pieces)."""
    t0, text, finish, pieces = time.perf_counter(), "", None, 0
    with call(base, "/v1/chat/completions", {**body, "stream": True}) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
                pieces += 1
                finish = choice["finish_reason"] or finish
            if stop_after is not None and len(text) >= stop_after:
                break  # leaving the `with` closes the connection
    return text, finish, time.perf_counter() - t0, pieces


def check(name, ckpt, expected=None, device="cuda", max_tokens=512):
    from zero2all.infer.server import create_server

    httpd, app = create_server(ckpt, port=0, device=device, model_name=name, api_key=KEY, quiet=True,
                               max_tokens_limit=2000)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = "http://%s:%d" % httpd.server_address[:2]
    out = {"model": name, "fused_decode": app.scheduler.session.fused is not None}
    try:
        page = [call(base, p, key=None).status for p in ("/", "/app.js", "/style.css")]
        out["page_files"] = page
        try:
            call(base, "/v1/models", key=None)
            out["models_without_key"] = 200
        except urllib.error.HTTPError as e:
            out["models_without_key"] = e.code
        info = json.load(call(base, "/v1/models"))["data"][0]
        out["context_length"] = info["context_length"]
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]
        body = {"model": name, "messages": messages, "temperature": 0, "top_p": 0.95, "max_tokens": max_tokens}
        if expected is None:  # random weights may end at once: run to max_tokens to time the stream
            body["ignore_eos"] = True
        stream_chat(base, {**body, "max_tokens": 8})  # warm-up: the decode step's graph is captured here
        text, finish, seconds, pieces = stream_chat(base, body)
        plain = json.load(call(base, "/v1/chat/completions", body))["choices"][0]["message"]["content"]
        out.update(stream_equals_plain=text == plain, finish=finish, pieces=pieces,
                   stream_tokens_per_s=round(pieces / seconds, 1))
        if expected is not None:
            out["stream_is_expected_text"] = text == (expected * len(text))[:len(text)] and len(text) > 20
            out["text_head"] = text[:24]
        cut, _, _, _ = stream_chat(base, {**body, "max_tokens": 2000}, stop_after=40)
        deadline = time.monotonic() + 5
        while json.load(call(base, "/health", key=None))["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        out["after_stop"] = json.load(call(base, "/health", key=None))
        out["cancelled"] = app.scheduler.stats()["finished"].get("cancelled", 0)
    finally:
        httpd.shutdown()
        httpd.server_close()
        app.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/serve_page_gpu")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()
    import torch
    from scripted_model import scripted_model

    from zero2all.config import ModelConfig
    from zero2all.model.io import save_model
    from zero2all.model.z2all import build_model
    from zero2all.tokenizer import train_tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    corpus = out / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(60))}) + "\n"
                              for _ in range(200)))
    tok = train_tokenizer([str(corpus)], 512, out / "tok", log=lambda *a: None)
    scripted = scripted_model(tok, out / "tok", out / "scripted", "<script>", hidden_dim=256, n_heads=4,
                              max_seq_len=4096, plain=False)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_dim=768, intermediate_size=2048, n_layers=12, n_heads=12,
                      n_kv_heads=4, max_seq_len=4096)
    save_model(build_model(cfg, seed=0).eval(), out / "random", tokenizer_dir=out / "tok")
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(json.dumps({"device": gpu, "torch": torch.__version__}))
    for name, ckpt, expected in (("scripted", scripted, "<script>"), ("random", out / "random", None)):
        print(json.dumps(check(name, ckpt, expected, args.device, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
