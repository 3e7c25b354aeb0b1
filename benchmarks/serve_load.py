"""Serving under load: the OpenAI-compatible server with continuous batching, measured end to end over loopback HTTP.

Starts the server in this process on a checkpoint (``--ckpt``) or on a randomly initialised preset (``--config
tiny | z2all-1.1b | ...``, with a byte-level stand-in tokenizer, so no trained files are needed), or drives a
server already running (``--url``). For each concurrency level of ``--clients``, that many clients each send
``--requests`` streaming completions one after the other: a prompt of ``--prompt-len`` tokens (distinct per
request; ``--shared-prefix N`` puts the same N-token text in front of every prompt, as a system prompt repeated
across requests would be), ``--max-tokens`` new tokens, greedy, with the ``"ignore_eos": true`` extension so that
every request generates exactly that many tokens, and ``"stream_options": {"include_usage": true}`` so that the
server reports them. The clients run in a separate process (asyncio, one connection per request), so that their
work does not compete with the server for the interpreter lock; they time every streamed chunk.

``--minimal-request`` is for servers that refuse fields they do not know (``transformers serve`` answers 422 to
``ignore_eos``) or ignore ``stream_options``: the requests then carry only ``model``, ``prompt``, ``max_tokens``,
``temperature`` and ``stream``. Two things change. A request may stop early at the model's end-of-text token (give
that server a model whose end-of-text id no sampled token can hit: ``serve_peers.py`` does); the tokens-per-request
column shows any early stop. And a request's generated tokens come from its usage when the server still sends one
(``transformers serve`` 5.24 does on its last chunk), else from its streamed text chunks: these servers stream one
chunk per generated token, so the count is exact except for tokens that print nothing (special tokens the server
skips) and the pieces of a multi-byte character that the detokeniser holds back until it is whole; both only ever
undercount. Counting chunks is preferred to re-tokenising the streamed text: random weights emit token sequences
that the tokenizer would never produce, and re-encoding their text splits and merges pieces differently. Measured
on ``transformers serve`` 5.24 (CPU, the tiny preset, greedy, 8 requests, usage for reference): at 8 new tokens the
chunks gave 8 every time, re-encoding 8 to 17; at 128, the chunks 121 to 128 (mean 126.75), re-encoding 108 to 158.
Without usage, a request counts as completed when its stream closes with a ``finish_reason`` or ``[DONE]``; with
usage it must carry the usage, as before.

Per level::

    req/s        completed requests / wall time of the level
    tok/s        generated tokens (usage: completion_tokens; else text chunks) / wall time
    new tokens   generated tokens per request: min / mean / max (below --max-tokens: a request stopped early)
    TTFT         time to first token: request sent -> first chunk with text; p50 / p90 / p99 in ms
    ITL          inter-token latency: the gaps between a request's consecutive text chunks; p50 / p90 / p99 in ms
                 (one chunk per token, except where the detokeniser holds text back: multi-byte characters)
    rows/step    generated tokens per decode step: how full the batch was (in-process servers only)
    errors       failed requests by HTTP status ("conn": the connection failed, "stream": an error chunk, or a
                 stream that ended without its usage / without finishing)

    python benchmarks/serve_load.py                                      # z2all-1.1b, random init, 1/4/16/64 clients
    python benchmarks/serve_load.py --config z2all-1.1b --clients 1,16 --requests 8 --json serve_load.json
    python benchmarks/serve_load.py --ckpt runs/demo/sft/final --clients 1,4,16
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 4
    python benchmarks/serve_load.py --url http://127.0.0.1:8301 --model M/hf --tokenizer M/tokenizer \\
        --minimal-request                                                # transformers serve
    python benchmarks/serve_load.py --engine paged --shared-prefix 1000 --prompt-len 32 --clients 1,16  # prefix cache
    python benchmarks/serve_load.py --config tiny --device cpu --clients 1,4 --requests 2 --prompt-len 16 \\
        --max-tokens 16                                                  # a CPU smoke run (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import urlopen

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout's package, also when run as a script from anywhere
    sys.path.insert(0, str(ROOT))
WORDS = ("the model reads every weight once per step so a batch of rows shares that cost while each row keeps "
         "its own cache and sampling state").split()


# --------------------------------------------------------------------------------------------------------------
# the clients (run in a child process: ``serve_load.py --client-worker`` reads a job on stdin, writes results)


async def _one(host: str, port: int, body: bytes) -> dict:
    """One streamed request: its HTTP status, when it was sent, when each text chunk arrived, its usage (None when
    the server sent none) and whether the stream finished (a ``finish_reason`` or ``[DONE]`` came)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    except OSError:
        return {"status": "conn"}
    try:
        writer.write(head + body)
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            return {"status": "conn"}
        status = int(status_line.split()[1])
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass
        if status != 200:
            return {"status": status}
        times, usage, finished = [], None, False
        while True:
            line = await reader.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                finished = True
                break
            now = time.perf_counter()
            obj = json.loads(data)
            if "error" in obj:
                return {"status": "stream"}
            choice = obj["choices"][0] if obj.get("choices") else {}
            if choice.get("text"):  # one chunk per generated token (see the module's docstring)
                times.append(now)
            if choice.get("finish_reason"):
                finished = True
            if obj.get("usage"):    # its own chunk (OpenAI, ours) or on the last text chunk (llama-server)
                usage = obj["usage"]
        return {"status": 200, "sent": t0, "times": times, "usage": usage, "finished": finished}
    except (OSError, ValueError, IndexError):
        return {"status": "conn"}
    finally:
        writer.close()


async def _level(host: str, port: int, bodies: list[list[bytes]]) -> dict:
    """Every client sends its bodies one after the other; all clients at once."""
    async def client(mine):
        return [await _one(host, port, b) for b in mine]

    t0 = time.perf_counter()
    results = await asyncio.gather(*(client(mine) for mine in bodies))
    return {"wall": time.perf_counter() - t0, "requests": [r for rs in results for r in rs]}


def client_worker() -> int:
    job = json.loads(sys.stdin.read())
    bodies = [[b.encode() for b in mine] for mine in job["bodies"]]
    out = asyncio.run(_level(job["host"], job["port"], bodies))
    sys.stdout.write(json.dumps(out))
    return 0


def run_level(url: str, bodies: list[list[str]]) -> dict:
    parts = urlsplit(url)
    job = {"host": parts.hostname, "port": parts.port or 80, "bodies": bodies}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--client-worker"], input=json.dumps(job),
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the client process failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


# --------------------------------------------------------------------------------------------------------------
# numbers


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def draft_options(args, device: str, dtype: str, tok) -> dict:
    """The scheduler's draft-model arguments for ``--draft-model`` (loaded like the model), or none."""
    if not args.draft_model:
        return {}
    from zero2all.infer.generate import load_for_inference

    draft, _ = load_for_inference(args.draft_model, device=device, dtype=dtype, tokenizer=tok)
    return {"draft_model": draft, "speculative_tokens": args.speculative_tokens}


def completed(r: dict) -> bool:
    """A request that succeeded: HTTP 200 and, if the server sent usage, the usage; without usage (a server that
    has none, or ``--minimal-request``), a stream that finished."""
    return r["status"] == 200 and bool(r.get("usage") or r.get("finished"))


def generated_tokens(r: dict) -> int:
    """A completed request's generated tokens: its usage's ``completion_tokens``, else its text chunks (one per
    token, see the module's docstring)."""
    return r["usage"]["completion_tokens"] if r.get("usage") else len(r["times"])


def summarise(clients: int, level: dict, steps: int | None) -> dict:
    reqs = level["requests"]
    ok = [r for r in reqs if completed(r)]
    errors: dict[str, int] = {}
    for r in reqs:
        if not completed(r):
            key = str(r["status"] if r["status"] != 200 else "stream")
            errors[key] = errors.get(key, 0) + 1
    per_request = [generated_tokens(r) for r in ok]
    tokens = sum(per_request)
    with_usage = [r for r in ok if r.get("usage")]
    counted_from = ("usage" if len(with_usage) == len(ok) else "text chunks" if not with_usage
                    else "usage and text chunks")
    ttft = [(r["times"][0] - r["sent"]) * 1e3 for r in ok if r["times"]]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r["times"], r["times"][1:])]
    wall = level["wall"]
    return {"clients": clients, "requests": len(reqs), "ok": len(ok), "wall_s": wall,
            "req_per_s": len(ok) / wall, "tok_per_s": tokens / wall, "generated_tokens": tokens,
            "tokens_per_request": {"min": min(per_request, default=0), "max": max(per_request, default=0),
                                   "mean": tokens / max(1, len(ok))},
            "tokens_counted_from": counted_from if ok else None,
            # prompt and cached tokens: known only from usage (None when no request reported it)
            "prompt_tokens_mean": (sum(r["usage"]["prompt_tokens"] for r in with_usage) / len(with_usage)
                                   if with_usage else None),
            "cached_tokens_mean": (sum(((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                                       for r in with_usage) / len(with_usage) if with_usage else None),
            "ttft_ms": {q: percentile(ttft, float(q[1:])) for q in ("p50", "p90", "p99")},
            "itl_ms": {q: percentile(itl, float(q[1:])) for q in ("p50", "p90", "p99")},
            "rows_per_step": tokens / steps if steps else None, "errors": errors}


def _mean_ttft(level: dict) -> float:
    ttft = [(r["times"][0] - r["sent"]) * 1e3 for r in level["requests"] if r["status"] == 200 and r["times"]]
    return sum(ttft) / len(ttft) if ttft else float("nan")


def table(rows: list[dict]) -> str:
    """The levels as one Markdown table; a note under it when tokens were counted from text chunks."""
    out = ["| clients | requests | req/s | tok/s | new tokens min / mean / max | TTFT p50 / p90 / p99 ms "
           "| ITL p50 / p90 / p99 ms | rows/step | cached prompt tokens | errors |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    chunks = False
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "none"
        per_step = f"{r['rows_per_step']:.1f}" if r["rows_per_step"] else "-"
        n = r.get("tokens_per_request") or {}
        star = "*" if r.get("tokens_counted_from") not in (None, "usage") else ""
        chunks = chunks or bool(star)
        new = f"{n['min']} / {n['mean']:.1f} / {n['max']}{star}" if n and r["ok"] else "-"
        cached = r.get("cached_tokens_mean")
        out.append(f"| {r['clients']} | {r['ok']}/{r['requests']} | {r['req_per_s']:.2f} | {r['tok_per_s']:,.0f} | "
                   f"{new} | {t['p50']:.1f} / {t['p90']:.1f} / {t['p99']:.1f} | {i['p50']:.2f} / {i['p90']:.2f} / "
                   f"{i['p99']:.2f} | {per_step} | {'-' if cached is None else f'{cached:.0f}'} | {errors} |")
    if chunks:
        out.append("\n\\* no usage from the server: generated tokens counted from the streamed text chunks (one per "
                   "token; tokens that print nothing are not counted)")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------------------
# the server


class ByteStandIn:
    """A tokenizer for randomly initialised presets: text is bytes (ids 0..255); any id decodes to a visible piece
    (printable ASCII as itself, others as ``<id>``), so random weights stream one piece per token."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_id, self.pad_id, self.im_start_id, self.im_end_id = vocab_size - 1, 0, None, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special: bool = False) -> str:
        return "".join(chr(i) if 32 <= i < 127 else f"<{i}>" for i in ids)


def start_server(args):
    """(httpd, app, base URL) of an in-process server, serving on a free loopback port."""
    import threading

    import torch

    from zero2all.infer.generate import Generator, load_for_inference
    from zero2all.infer.server import InferenceApp, bind

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    if args.ckpt:
        model, tok = load_for_inference(args.ckpt, device=device, dtype=dtype)
        name = Path(args.ckpt).resolve().name
    else:
        from zero2all.config import load_config
        from zero2all.model.z2all import build_model

        cfg = load_config(args.config).model
        model = build_model(cfg, device=device, seed=args.seed).to(getattr(torch, dtype)).eval()
        tok, name = ByteStandIn(cfg.vocab_size), args.config
    fused = {"auto": None, "fused": True, "generic": False}[args.decode]
    generator = Generator(model, tok, fused=fused)
    t0 = time.perf_counter()
    app = InferenceApp(generator, name, max_tokens_limit=args.max_tokens, max_queue=args.max_queue,
                       max_batch=args.max_batch,
                       engine_options=dict(engine=args.engine, block_size=args.block_size,
                                           kv_cache_gb=args.kv_cache_gb, prefix_caching=not args.no_prefix_caching,
                                           max_num_batched_tokens=args.max_num_batched_tokens,
                                           speculative_ngram=args.speculative_ngram,
                                           prefill_graphs=args.prefill_graphs, **draft_options(args, device,
                                                                                                      dtype, tok)))
    setup = time.perf_counter() - t0
    httpd, _ = bind(app, "127.0.0.1", 0, quiet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    host, port = httpd.server_address[:2]
    session = app.scheduler.session
    if app.scheduler.paged:
        engine = (f"paged engine, {session.pool.total} blocks of {session.block_size} tokens, prefix caching "
                  f"{'on' if session.pool.prefix_caching else 'off'}")
    else:
        engine = (f"column engine, {app.scheduler.cache_len} slots a row; decode step: "
                  f"{'fused' if session.fused else 'generic'}{', CUDA graphs' if session.graphs else ''}")
    print(f"server: {name} on {device} ({dtype}), {model.num_params():,} parameters; {app.max_batch} rows; "
          f"{engine} (set up in {setup:.1f} s)", flush=True)
    return httpd, app, f"http://{host}:{port}", tok


def prompt_text(tokenizer, n_tokens: int, key: int) -> str:
    """A distinct text of about ``n_tokens`` tokens (exactly, with a byte-level tokenizer), the separator the server
    puts in front included; ``key`` makes it unique."""
    words, text = [f"request {key}:"], ""
    i = key
    while True:
        i = (i * 1103515245 + 12345) % (1 << 31)
        candidate = " ".join(words + [WORDS[i % len(WORDS)]])
        size = len(tokenizer.encode(candidate)) if tokenizer is not None else len(candidate) // 4
        if size > n_tokens - 1:
            break
        words.append(WORDS[i % len(WORDS)])
        text = candidate
    if tokenizer is not None and isinstance(tokenizer, ByteStandIn):
        text = (text + " " * n_tokens)[:n_tokens - 1]
    return text or words[0]


def shared_text(tokenizer, n_tokens: int) -> str:
    """The text of ``--shared-prefix``: the same for every request (a key of :func:`prompt_text` that no request
    uses as its own), followed by a space; empty for 0."""
    return prompt_text(tokenizer, n_tokens, 999_999_999) + " " if n_tokens else ""


def request_body(model: str, prompt: str, max_tokens: int, minimal: bool = False) -> str:
    """One streamed, greedy completion request (JSON). Unless ``minimal``, with the ``ignore_eos`` extension (every
    request generates ``max_tokens``) and ``stream_options.include_usage`` (the server reports its tokens);
    ``minimal`` leaves both out, for servers that refuse fields they do not know (``--minimal-request``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if not minimal:
        body.update(ignore_eos=True, stream_options={"include_usage": True})
    return json.dumps(body)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:] == ["--client-worker"]:
        return client_worker()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--config", default=None, help="a preset, randomly initialised (default z2all-1.1b)")
    src.add_argument("--ckpt", default=None, help="a checkpoint directory (with its tokenizer)")
    src.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="with --url: the model id (default: the server's first)")
    ap.add_argument("--tokenizer", default=None, help="with --url: the server's tokenizer directory, so that prompts "
                    "are exactly --prompt-len tokens (default: about 4 characters a token)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--decode", default="auto", choices=["auto", "fused", "generic"],
                    help="the decode step: auto (fused on CUDA where supported), fused kernels, or the model's own")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="batch rows (default: z2all serve's, server.default_rows)")
    ap.add_argument("--engine", default="auto", choices=["auto", "paged", "column"],
                    help="the scheduler's engine (auto: z2all serve's default)")
    ap.add_argument("--block-size", type=int, default=16, help="paged engine: tokens per KV block")
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="paged engine: GiB for the KV block pool")
    ap.add_argument("--no-prefix-caching", action="store_true", help="paged engine: no prefix caching")
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="one-prompt prefills as CUDA graphs of length buckets (default: the server's, on CUDA)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="paged engine: tokens per step")
    ap.add_argument("--speculative-ngram", type=int, default=0, help="paged engine: prompt-lookup draft tokens")
    ap.add_argument("--draft-model", default=None, help="paged engine: a draft model's checkpoint for speculative "
                    "decoding (sharing the model's tokenizer)")
    ap.add_argument("--speculative-tokens", type=int, default=4, help="with --draft-model: draft tokens a step")
    ap.add_argument("--max-queue", type=int, default=None, help="waiting sequences (default: the most clients)")
    ap.add_argument("--clients", default="1,4,16,64", help="concurrency levels, comma-separated")
    ap.add_argument("--requests", type=int, default=4, help="requests per client at each level")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=128, help="generated tokens per request")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of one text put in front of every prompt "
                    "(a repeated system prompt: what the paged engine's prefix cache serves)")
    ap.add_argument("--minimal-request", action="store_true",
                    help="send only model, prompt, max_tokens, temperature and stream: no ignore_eos and no "
                    "stream_options, which servers such as transformers serve refuse or ignore. Requests may then "
                    "stop at the end-of-text token (the new-tokens column shows it); tokens come from usage if the "
                    "server sends it, else from the streamed text chunks")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent first, not measured")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.clients.split(",") if c.strip()]
    if not levels or min(levels) < 1 or args.requests < 1 or args.prompt_len < 2 or args.max_tokens < 1:
        ap.error("--clients, --requests, --max-tokens must be positive and --prompt-len at least 2")
    if not (args.ckpt or args.url):
        args.config = args.config or "z2all-1.1b"
    if args.max_queue is None:
        args.max_queue = max(levels)

    httpd = app = tok = None
    info: dict = {"python": platform.python_version()}
    if args.url:
        url = args.url.rstrip("/")
        model = args.model or json.load(urlopen(f"{url}/v1/models"))["data"][0]["id"]
        if args.tokenizer:
            from zero2all.tokenizer.hf import load_tokenizer

            tok = load_tokenizer(args.tokenizer)
    else:
        import torch

        httpd, app, url, tok = start_server(args)
        model = app.model_name
        info.update(torch=torch.__version__, device=torch.cuda.get_device_name() if app.generator.device.type
                    == "cuda" else "cpu", max_batch=app.max_batch)
        ctx = app.context
        if args.shared_prefix + args.prompt_len + args.max_tokens > ctx:
            ap.error(f"--shared-prefix + --prompt-len + --max-tokens must fit the model's context of {ctx}")
    shared = shared_text(tok, args.shared_prefix)

    def body(key: int) -> str:
        return request_body(model, shared + prompt_text(tok, args.prompt_len, key), args.max_tokens,
                            args.minimal_request)

    try:
        if args.warmup:
            run_level(url, [[body(10 ** 6 + i) for i in range(args.warmup)]])
        results = []
        for level, clients in enumerate(levels):
            bodies = [[body(10_000 * level + 100 * c + r) for r in range(args.requests)] for c in range(clients)]
            steps0 = app.scheduler.steps if app else None
            ttft0 = (app.metrics.ttft.sum, app.metrics.ttft.count) if app else None
            parts0 = dict(app.scheduler.stats()["ttft_parts"]) if app else None
            out = run_level(url, bodies)
            steps = app.scheduler.steps - steps0 if app else None
            results.append(summarise(clients, out, steps))
            r = results[-1]
            if app is not None and app.metrics.ttft.count > ttft0[1]:
                # the server's own TTFT (request parsed -> first token in its event loop): the client's TTFT minus
                # this is the HTTP side (connection, request, the first chunk's way back)
                r["server_ttft_ms_mean"] = 1e3 * (app.metrics.ttft.sum - ttft0[0]) / (app.metrics.ttft.count - ttft0[1])
                parts = app.scheduler.stats()["ttft_parts"]
                n = parts["n"] - parts0["n"]
                if n:  # the engine's share, per sequence: waiting for a row, prefill (host view), the first draw
                    r["engine_ttft_ms_mean"] = {k: 1e3 * (parts[k] - parts0[k]) / n
                                                for k in ("queue", "prefill", "first_draw")}
            if app is not None and app.scheduler.spec_method != "off":
                s = app.scheduler.stats()
                r["spec_acceptance_rate"] = s["spec_acceptance_rate"]  # cumulative, warm-up included
            server = (f"; TTFT mean {_mean_ttft(out):.1f} ms at the client, {r['server_ttft_ms_mean']:.1f} ms in the "
                      "server" if "server_ttft_ms_mean" in r else "")
            if "engine_ttft_ms_mean" in r:
                e = r["engine_ttft_ms_mean"]
                server += (f" (engine: {e['queue']:.1f} waiting for a row, {e['prefill']:.1f} prefill, "
                           f"{e['first_draw']:.1f} to the first token drawn)")
            print(f"  {clients} clients: {r['ok']}/{r['requests']} ok in {r['wall_s']:.1f} s{server}", flush=True)
    finally:
        if httpd is not None:
            from zero2all.infer.server import shutdown

            shutdown(httpd, app, drain_timeout=5.0)
    src = args.ckpt or args.config or args.url
    pre = f"a shared prefix of {args.shared_prefix} tokens + " if args.shared_prefix else ""
    eos = "minimal requests: no ignore_eos" if args.minimal_request else "ignore_eos"
    print(f"\n{src}: prompt {pre}{args.prompt_len} tokens, {args.max_tokens} new tokens per request (greedy, "
          f"{eos}), {args.requests} requests per client\n")
    print(table(results))
    if results and "spec_acceptance_rate" in results[-1]:
        print(f"\nspeculative decoding ({app.scheduler.spec_method}): {results[-1]['spec_acceptance_rate']:.1%} of "
              "the draft tokens accepted")
    if args.json:
        payload = {**info, "source": src, "prompt_len": args.prompt_len, "shared_prefix": args.shared_prefix,
                   "max_tokens": args.max_tokens, "minimal_request": args.minimal_request,
                   "requests_per_client": args.requests, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "results": results}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    failed = sum(r["requests"] - r["ok"] for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
