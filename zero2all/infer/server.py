"""An OpenAI-compatible HTTP server on the standard library (``http.server``), over a continuous-batching scheduler.

Endpoints::

    GET  /v1/models             {"object": "list", "data": [{"id": MODEL, "object": "model", ...}]}
    POST /v1/completions        {"model", "prompt": str | [str, ...], "max_tokens", "temperature", "top_p",
                                 "stop", "stream", "seed", + extensions "top_k", "repetition_penalty",
                                 "ignore_eos"}
                                (a prompt starts a new document: the end-of-text separator goes in front)
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "max_tokens" |
                                 "max_completion_tokens", ... as above}
    GET  /health                {"status": "ok", "running", "waiting", "cancelled"} (sequences decoding,
                                waiting for a row, cancelled so far; 503 {"status": "draining"} while shutting down)
    GET  /                      the chat page (``infer/web/``: index.html, app.js, style.css; no build step)

``/v1/models`` also gives ``context_length`` (the model's context) and ``max_tokens_limit`` (this server's limit).

Access: with an API key (``serve --api-key KEY`` or the ``Z2ALL_API_KEY`` environment variable) every ``/v1`` route
needs ``Authorization: Bearer KEY``, as OpenAI clients send it; the key is compared in constant time
(``hmac.compare_digest``) and a missing or wrong one is 401 ``invalid_api_key``. The page and ``/health`` stay open
(they hold no secret; the page asks for the key and sends it with its own calls). No CORS header is sent unless
``cors_origin`` names the one origin allowed to call the API from another site's pages.

``"stream": true`` answers with server-sent events: one ``data: {chunk}`` line per generated piece and a final
``data: [DONE]`` (with ``"stream_options": {"include_usage": true}`` a usage chunk comes before it). Errors are
JSON ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field at fault: 400 for malformed
JSON, missing or invalid fields (a number must be finite: ``NaN`` and ``Infinity``, which Python's JSON reader
accepts, are refused), ``max_tokens`` above the server's limit or a prompt that does not fit the context; 404 for
an unknown model or path; 413 for a body over 1 MiB; 429 when the queue is full; 503 while shutting down.
``"ignore_eos": true`` (an extension) keeps generating through stop tokens up to ``max_tokens`` (stop strings still
apply): every such request produces the same number of tokens, for load tests.

A field sent as ``null`` is absent (OpenAI's own rule; some clients send ``"max_tokens": null``). Without
``max_tokens`` the budget is ``default_max_tokens`` cut to what the longest prompt leaves of the context, so it never
overflows; an explicit ``max_tokens`` that does not fit is refused, unless the request says ``"fit_context": true``
(an extension, sent by the chat page): then it is an upper bound, cut the same way.

Concurrency: continuous batching (``infer/scheduler.py``). One background thread owns the model and a pool of
``max_batch`` KV-cache rows; each decode step advances every running sequence by one token, a new sequence joins
the batch between two steps (its prompt is prefilled into a free row, the other rows untouched; prompts that arrive
together are prefilled together, in one forward) and a finished or cancelled one leaves it, its row reused at once.
Each sequence keeps its own sampling parameters, random stream (a seeded request gives the same text whatever else
runs), stop strings, budget and stream; a prompt list in one completions request is one sequence per prompt. Up to
``max_queue`` sequences wait for a row in arrival order; a request beyond that is refused at once with 429 and a
``Retry-After`` header rather than piling up threads. A client that disconnects cancels its request (noticed at the
next write, or within half a second while it waits).
The HTTP side stays one thread per connection (``ThreadingHTTPServer``): those threads only parse, wait for their
request's events (blocked on a queue, not polling) and write; a stream's events that are ready at once (a handler
that fell behind the steps) go out in one write.

Connections are bounded (:class:`_Server`): a whole request (the wait for it on a kept-alive connection, its
request line, headers and body) must arrive within ``read_timeout`` seconds (30), a total, not a limit per read, so a
client trickling bytes is cut off too (a half-sent body gets 408); a write that a client does not read for as long
fails and cancels the request. At most ``max_connections`` (256) are open: a new connection past that closes the
one that has waited longest for its request, or, when every connection is being answered, gets 503
``too_many_connections`` with ``Retry-After``, without a thread. The API key is checked as soon as its header line
arrives (a wrong one ends the reading there: 401 and close), before the other headers and the body. A POST whose
``Content-Type`` is not JSON is 415 (no Content-Type is taken as JSON); HEAD answers as GET without the body;
OPTIONS is the CORS preflight, and like PUT, DELETE and the other methods 405 otherwise. What the standard library
refuses itself (a malformed request line, a header line over 64 KiB, over 100 headers) is JSON too.

Shutdown (``serve``; SIGTERM or Ctrl-C): the server stops accepting (the listening socket closes; a request on a
kept-alive connection gets 503), lets the running and waiting requests finish for up to ``drain_timeout`` seconds
(a second signal cuts the wait short), then cancels what is left: those end with ``finish_reason``
``"cancelled"`` (a stream still ends with ``data: [DONE]``). The exit status is 0 when every request finished and
143 (128 + SIGTERM) when some had to be cancelled.
"""

from __future__ import annotations

import errno
import hmac
import io
import ipaddress
import json
import math
import select
import signal
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Callable

from zero2all.infer.generate import Generator, SamplingParams
from zero2all.infer.scheduler import QueueFull, Scheduler, ShuttingDown

MAX_BODY_BYTES = 1 << 20
EXIT_CANCELLED = 143  # the exit status when the drain timeout ran out and requests were cancelled
READ_TIMEOUT = 30.0  # seconds a whole request (request line, headers, body) may take to arrive
MAX_CONNECTIONS = 256  # connections open at once (each one holds a thread)
GONE = (BrokenPipeError, ConnectionError, TimeoutError)  # a write that failed because the client is gone or stuck


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _show(value) -> str:
    """A request value for an error message, cut short (a 4000-digit integer would flood the message)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class InferenceApp:
    """Request validation and the OpenAI response shapes over a :class:`Scheduler`; the HTTP handler only moves
    bytes. ``max_batch`` None: 16 rows on CUDA (the fused decode step's most), 8 on CPU. ``max_queue``: sequences
    that may wait for a row (a waiting request costs a thread and its prompt, no cache); more get 429."""

    def __init__(self, generator: Generator, model_name: str, max_tokens_limit: int = 1024,
                 default_max_tokens: int = 256, max_queue: int = 64, max_batch: int | None = None,
                 document_start: bool = True, cache_len: int | None = None):
        if generator.tokenizer is None:
            raise ValueError("the server needs a tokenizer")
        if max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {max_tokens_limit}")
        self.generator = generator
        self.model_name = model_name
        if max_batch is None:
            max_batch = 16 if generator.device.type == "cuda" else 8
        self.scheduler = Scheduler(generator, max_batch=max_batch, max_queue=max_queue, cache_len=cache_len)
        self.context = self.scheduler.context
        # the limit is what was asked for, even above the context: a request that does not fit is then told so
        # (400 "context_length_exceeded"), instead of the limit being lowered behind the operator's back
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = min(default_max_tokens, max_tokens_limit)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.document_start = document_start
        self.created = int(time.time())
        self._inflight = 0
        self._inflight_cond = threading.Condition()

    def close(self):
        """Cancel whatever still runs and stop the scheduler's thread."""
        self.scheduler.stop()

    @property
    def accepting(self) -> bool:
        return self.scheduler._accepting

    @contextmanager
    def tracked(self):
        """Counts a request from its arrival to its last byte written (the shutdown waits for them)."""
        with self._inflight_cond:
            self._inflight += 1
        try:
            yield
        finally:
            with self._inflight_cond:
                self._inflight -= 1
                self._inflight_cond.notify_all()

    def wait_responses(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._inflight_cond:
            while self._inflight and (left := deadline - time.monotonic()) > 0:
                self._inflight_cond.wait(left)
            return self._inflight == 0

    # -- validation -------------------------------------------------------------------------------------------
    def _number(self, body, key, default, lo=None, hi=None, integer=False, lo_open=False):
        value = body.get(key, default)
        if value is None:
            return default
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if not ok or isinstance(value, bool):
            raise RequestError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, got "
                                    f"{_show(value)}", key)
        if not integer:
            try:
                value = float(value)
            except OverflowError:  # an integer beyond any float
                value = math.inf
            if not math.isfinite(value):  # NaN passes every comparison below
                raise RequestError(400, f"'{key}' must be a finite number, got {_show(body.get(key))}", key)
        if lo is not None and (value <= lo if lo_open else value < lo):
            raise RequestError(400, f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {_show(value)}", key)
        if hi is not None and value > hi:
            raise RequestError(400, f"'{key}' must be <= {hi}, got {_show(value)}", key)
        return value

    def _flag(self, body, key) -> bool:
        value = body.get(key, False)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise RequestError(400, f"'{key}' must be true or false, got {_show(value)}", key)
        return value

    def parse_common(self, body: dict, chat: bool) -> tuple[SamplingParams, bool, bool]:
        """(sampling parameters, stream, include_usage). A null field means the field is absent."""
        if body.get("model") is None:  # null is absent
            raise RequestError(400, "missing required field 'model'", "model", "missing_field")
        if body["model"] != self.model_name:
            raise RequestError(404, f"model {_show(body['model'])} does not exist; this server serves "
                                    f"{self.model_name!r}", "model", "model_not_found")
        # null is "not given", as OpenAI's API defines it; in a chat a null max_completion_tokens leaves max_tokens
        key = next((k for k in (("max_completion_tokens", "max_tokens") if chat else ("max_tokens",))
                    if body.get(k) is not None), "max_tokens")
        max_tokens = self._number(body, key, self.default_max_tokens, lo=1, integer=True)
        if max_tokens > self.max_tokens_limit:
            raise RequestError(400, f"'{key}' is {_show(max_tokens)}, above this server's limit of "
                                    f"{self.max_tokens_limit}", key, "max_tokens_exceeded")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > 4 or any(not isinstance(s, str) or not s for s in stop):
            raise RequestError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
        n = body.get("n", 1)
        if n is not None and (n != 1 or isinstance(n, bool)):
            raise RequestError(400, "only n=1 is supported", "n")
        stream = self._flag(body, "stream")
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
            raise RequestError(400, "logprobs are not supported by this server", "logprobs")
        for key in ("tools", "functions"):  # silently ignored, a client would wait for tool calls that never come
            if body.get(key):
                raise RequestError(400, f"'{key}' is not supported by this server (no tool calling)", key)
        response_format = body.get("response_format")
        if response_format is not None and response_format != {"type": "text"}:
            raise RequestError(400, f"'response_format' {_show(response_format)} is not supported by this server: "
                                    "only {\"type\": \"text\"} (no JSON mode)", "response_format")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)
                                 or not -(1 << 63) <= seed < (1 << 64)):
            raise RequestError(400, f"'seed' must be a 64-bit integer, got {_show(seed)}", "seed")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError(400, "'stream_options' must be an object", "stream_options")
        include_usage = bool(options.get("include_usage"))
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=self._number(body, "temperature", 1.0, lo=0, hi=2),
            top_p=self._number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True),
            top_k=self._number(body, "top_k", 0, lo=0, integer=True),
            repetition_penalty=self._number(body, "repetition_penalty", 1.0, lo=0, lo_open=True),
            stop=tuple(stop), seed=seed,
            stop_token_ids=[] if self._flag(body, "ignore_eos") else None)
        return params, stream, include_usage

    def completion_prompts(self, body: dict) -> list[list[int]]:
        prompt = body.get("prompt")
        if prompt is None:
            raise RequestError(400, "missing required field 'prompt'", "prompt", "missing_field")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or any(not isinstance(p, str) for p in prompts):
            raise RequestError(400, "'prompt' must be a string or a non-empty list of strings", "prompt")
        if len(prompts) > self.max_batch:
            raise RequestError(400, f"at most {self.max_batch} prompts per request", "prompt")
        tok = self.generator.tokenizer
        if any(not p for p in prompts):
            raise RequestError(400, "'prompt' must not be empty", "prompt")
        # a prompt starts a new document: the pretraining data has the end-of-text separator before each one
        head = [tok.eos_id] if self.document_start and tok.eos_id is not None else []
        return [head + list(tok.encode(p)) for p in prompts]

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if messages is None:
            raise RequestError(400, "missing required field 'messages'", "messages", "missing_field")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise RequestError(400, f"messages[{i}] must have a role of system, user or assistant",
                                   f"messages[{i}].role")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                       for p in content):
                    raise RequestError(400, f"messages[{i}].content: only text parts are supported",
                                       f"messages[{i}].content")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise RequestError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
            role = "system" if m["role"] == "developer" else m["role"]
            clean.append({"role": role, "content": content})
        return list(self.generator.tokenizer.apply_chat_template(clean, add_generation_prompt=True))

    def check_fits(self, prompts: list[list[int]], params: SamplingParams, field: str = "prompt"):
        ctx = self.context
        for i, p in enumerate(prompts):
            if len(p) >= ctx:
                raise RequestError(400, f"prompt {i} has {len(p)} tokens: no room to generate within the context of "
                                        f"{ctx} tokens; shorten it (or start a new conversation)", field,
                                   "context_length_exceeded")
            if len(p) + params.max_new_tokens > ctx:
                raise RequestError(400, f"prompt {i} has {len(p)} tokens; with max_tokens {params.max_new_tokens} "
                                        f"that exceeds the context of {ctx} tokens", "max_tokens",
                                   "context_length_exceeded")

    # -- responses --------------------------------------------------------------------------------------------
    def run(self, kind: str, body: dict, alive: Callable[[], bool] | None = None):
        """Validate and queue, then return ("json", dict) or ("stream", iterator of dicts); raises RequestError.
        ``alive`` says whether the client is still there (asked while waiting; False cancels the request)."""
        chat = kind == "chat"
        params, stream, include_usage = self.parse_common(body, chat)
        prompts = [self.chat_prompt(body)] if chat else self.completion_prompts(body)
        asked = body.get("max_tokens") is not None or (chat and body.get("max_completion_tokens") is not None)
        if self._flag(body, "fit_context") or not asked:
            # no budget asked for: the default, cut to what the longest prompt leaves of the context (a small
            # model's context may be no longer than the default); an explicit max_tokens is shortened only when
            # the request says so ("fit_context": true, an extension the chat page sends)
            room = self.context - max(len(p) for p in prompts)
            if 1 <= room < params.max_new_tokens:
                params.max_new_tokens = room
        self.check_fits(prompts, params, "messages" if chat else "prompt")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            sub = self.scheduler.submit(prompts, params)
        except QueueFull as e:
            raise RequestError(429, str(e), kind="rate_limit_error", headers={"Retry-After": "1"}) from None
        except ShuttingDown as e:
            raise RequestError(503, str(e), kind="server_error", code="shutting_down",
                               headers={"Connection": "close"}) from None
        if stream:
            return "stream", self._stream(chat, rid, prompts, sub, include_usage, alive)
        texts, reasons, drawn = [""] * len(prompts), ["length"] * len(prompts), [0] * len(prompts)
        for ev in sub.events(alive=alive):
            drawn[ev.index] += ev.token_id >= 0
            texts[ev.index] += ev.text
            if ev.finish_reason:
                reasons[ev.index] = ev.finish_reason
        created = int(time.time())
        usage = {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": sum(drawn)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if chat:
            choices = [{"index": 0, "message": {"role": "assistant", "content": texts[0]},
                        "logprobs": None, "finish_reason": reasons[0]}]
            return "json", {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                            "choices": choices, "usage": usage}
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        return "json", {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": choices, "usage": usage}

    def _stream(self, chat: bool, rid: str, prompts, sub, include_usage: bool, alive):
        """The chunks of a streamed response, in lists: each list is what is ready at once (the events of the
        steps run since the handler last wrote), to be written together."""
        created = int(time.time())
        drawn = 0
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index, text, finish, first=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}

        done = False
        try:
            if chat:
                yield [chunk(0, "", None, first=True)]
            for events in sub.batches(alive=alive):
                out = []
                for ev in events:
                    drawn += ev.token_id >= 0
                    if ev.text or ev.finish_reason:
                        if chat and ev.text and ev.finish_reason:
                            out.append(chunk(ev.index, ev.text, None))
                            out.append(chunk(ev.index, "", ev.finish_reason))
                        else:
                            out.append(chunk(ev.index, ev.text, ev.finish_reason))
                if out:
                    yield out
            done = True
        finally:
            if not done:  # the client went away (or the stream was dropped): free the rows
                sub.cancel()
        if include_usage:  # OpenAI's stream_options.include_usage: a last chunk with no choices
            usage = {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": drawn}
            usage["total_tokens"] = usage["prompt_tokens"] + drawn
            yield [{"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                    "usage": usage}]

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "zero2all", "context_length": self.context,
                                            "max_tokens_limit": self.max_tokens_limit}]}

    def health(self) -> tuple[int, dict]:
        if not self.accepting:
            return 503, {"status": "draining"}
        stats = self.scheduler.stats()
        return 200, {"status": "ok", "running": stats["running"], "waiting": stats["waiting"],
                     "cancelled": stats["finished"].get("cancelled", 0)}


# the chat page's files and their content types; served from the package (zero2all/infer/web/)
PAGE_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
              "/app.js": ("app.js", "text/javascript; charset=utf-8"),
              "/style.css": ("style.css", "text/css; charset=utf-8")}
# the page runs only its own script and style and talks only to this server: an injected <script> or inline
# handler would not run even if some text ever reached the document as HTML
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                           "form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed when ``host`` is reachable from other machines and no key protects the API."""
    if api_key or is_loopback(host):
        return None
    return (f"warning: serving on {host or 'every interface'}, reachable from other machines, without an API key: "
            "anyone who can reach it can use the model; pass --api-key KEY (or set Z2ALL_API_KEY)")


def page_file(name: str) -> bytes:
    return resources.files("zero2all.infer").joinpath("web", name).read_bytes()


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: resolve it
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def _sse(chunks: list[dict]) -> bytes:
    """Server-sent events, one ``data:`` line per chunk."""
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)


def make_handler(app: InferenceApp, quiet: bool = False, api_key: str | None = None,
                 cors_origin: str | None = None):
    """The request handler class. ``api_key``: required as ``Authorization: Bearer KEY`` on every /v1 route.
    ``cors_origin``: the one other origin whose pages may call the API (None: no CORS header at all). It runs under
    :class:`_Server`, which gives each connection its deadline-bound reader (:class:`_Connection`)."""
    expected = api_key.encode() if api_key else None

    def key_matches(value: str) -> bool:
        scheme, _, given = value.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)

    class Handler(BaseHTTPRequestHandler):
        server_version = "zero2all"
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            if not quiet:
                sys.stderr.write(f"[serve] {self.address_string()} {fmt % args}\n")

        # -- reading under a deadline, the key checked as soon as its header arrives ------------------------------
        def setup(self):
            super().setup()
            self.conn = self.server.connection(self.request)
            made, self.rfile = self.rfile, _LineReader(self.conn)
            made.close()  # the socket's own file would keep the descriptor open after the close

        def handle_one_request(self):
            self.key_refused = False  # a wrong key was seen among the headers (reading stopped there)
            self.head_only = False
            self.server.start_request(self.conn)
            super().handle_one_request()

        def parse_request(self):
            self.rfile.on_line = self._header_line
            try:
                return super().parse_request()
            finally:
                self.rfile.on_line = None

        def _needs_key(self) -> bool:
            return expected is not None and (self.command == "POST" or self.path.startswith("/v1"))

        def _header_line(self, line: bytes) -> bytes:
            """Sees each header line as it arrives: a wrong key ends the headers there (an empty line), so a client
            without the key costs no more reading; the answer is then 401 and the connection closes."""
            if line[:14].lower() == b"authorization:" and not self.key_refused and self._needs_key():
                if not key_matches(line[14:].decode("latin-1")):
                    self.key_refused = True
                    return b"\r\n"
            return line

        def send_error(self, code, message=None, explain=None):
            """The standard library's own refusals (a malformed request line, a line or headers too long, an
            unknown method) in JSON like every other error, and the connection closed (the rest is unread)."""
            text = message or self.responses.get(code, ("error",))[0]
            err = RequestError(int(code), f"{text}: {explain}" if explain else text)
            if self.request_version not in ("HTTP/1.0", "HTTP/1.1"):  # no version read (or an unknown one): the
                self.request_version = "HTTP/1.1"                     # answer still gets its status line
            self._error(err, {"Connection": "close"})

        def handle_expect_100(self):
            """``Expect: 100-continue`` (curl's way with large bodies): a client without the key gets 401, not an
            invitation to send its body."""
            if self._needs_key() and not self._authorized():
                self._refuse(close=True)
                return False
            return super().handle_expect_100()

        def _answering(self):
            """The request is read: no deadline now, and a write stuck on a client that reads nothing ends after
            the read timeout (the answer's other side); a connection being answered is never evicted."""
            self.server.stop_reading(self.conn)

        def end_headers(self):
            if cors_origin and getattr(self, "path", "").startswith("/v1"):
                self.send_header("Access-Control-Allow-Origin", cors_origin)
                self.send_header("Vary", "Origin")
            super().end_headers()

        def _send_json(self, status: int, obj: dict, headers: dict | None = None):
            self._send_bytes(status, json.dumps(obj).encode(), "application/json", headers)

        def _send_bytes(self, status: int, data: bytes, content_type: str, headers: dict | None = None):
            self._answering()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if not self.head_only:  # HEAD: GET's status and headers, no body
                self.wfile.write(data)

        def _authorized(self) -> bool:
            """True without a key; with one, the request must carry ``Authorization: Bearer KEY`` (compared in
            constant time, so the time taken says nothing of how much of a guess was right)."""
            if expected is None:
                return True
            return not self.key_refused and key_matches(self.headers.get("Authorization") or "")

        def _refuse(self, close: bool = False):
            close = close or self.key_refused  # the headers were not all read: the connection cannot be reused
            self._error(RequestError(401, "a valid API key is required: send the header 'Authorization: Bearer "
                                          "KEY' with the key this server was started with", code="invalid_api_key",
                                     headers={"WWW-Authenticate": "Bearer", **({"Connection": "close"} if close
                                                                               else {})}))

        def _allowed(self) -> str:
            return "GET, HEAD, POST" + (", OPTIONS" if cors_origin else "")

        def _not_allowed(self):
            """405 for a method this server does not answer (PUT, DELETE, ...; OPTIONS outside a CORS preflight).
            Any body is left unread, so the connection closes."""
            why = (" (OPTIONS is answered only as a CORS preflight from the origin set by --cors-origin)"
                   if self.command == "OPTIONS" else "")
            self._error(RequestError(405, f"method {self.command} is not allowed here{why}; use "
                                          f"{self._allowed()}", code="method_not_allowed",
                                     headers={"Allow": self._allowed(), "Connection": "close"}))

        do_PUT = do_DELETE = do_PATCH = do_TRACE = do_CONNECT = _not_allowed

        def do_OPTIONS(self):
            """The CORS preflight, answered only for the allowed origin."""
            if not cors_origin or self.headers.get("Origin") != cors_origin or not self.path.startswith("/v1"):
                return self._not_allowed()
            self._send_bytes(204, b"", "text/plain", {
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type", "Access-Control-Max-Age": "600"})

        def do_HEAD(self):
            self.head_only = True
            self.do_GET()

        def _error(self, err: RequestError, headers=None):
            headers = {**err.headers, **(headers or {})}
            if headers.get("Connection") == "close":
                self.close_connection = True
            self._send_json(err.status, err.body(), headers)

        def _client_alive(self) -> bool:
            """False once the client has closed its end (a readable socket with nothing to read)."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return not readable or bool(self.connection.recv(1, socket.MSG_PEEK))
            except (OSError, ValueError):
                return False

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path in PAGE_FILES:
                name, content_type = PAGE_FILES[path]
                return self._send_bytes(200, page_file(name), content_type, PAGE_HEADERS)
            path = path.rstrip("/")
            if path.startswith("/v1") and not self._authorized():
                self._refuse()
            elif path == "/v1/models":
                self._send_json(200, app.models())
            elif path == "/health":
                self._send_json(*app.health())
            else:
                self._error(RequestError(404, f"no such path {self.path}", kind="not_found_error"))

        def _read_body(self) -> dict:
            ctype = self.headers.get("Content-Type")
            media = (ctype or "").partition(";")[0].strip().lower()
            if ctype is not None and media != "application/json" and not media.endswith("+json"):
                raise RequestError(415, f"Content-Type {_show(ctype)} is not supported: send the body as JSON with "
                                        "'Content-Type: application/json'", "Content-Type", "unsupported_media_type")
            length = self.headers.get("Content-Length")
            if length is None:
                raise RequestError(411, "a Content-Length header is required")
            try:
                n = int(length)
            except ValueError:
                raise RequestError(400, f"bad Content-Length {length!r}") from None
            if n > MAX_BODY_BYTES:
                self.close_connection = True
                raise RequestError(413, f"request body of {n} bytes is over the limit of {MAX_BODY_BYTES}")
            try:
                raw = self.rfile.read(n)
            except TimeoutError:
                raise RequestError(408, f"the request did not arrive within the read timeout of "
                                        f"{self.server.read_timeout:g} s", code="request_timeout") from None
            if len(raw) < n:
                raise RequestError(400, f"the body ended after {len(raw)} of its {n} bytes")
            try:
                body = json.loads(raw)
            # ValueError: an integer too long to convert; RecursionError: nesting too deep
            except (ValueError, UnicodeDecodeError, RecursionError) as e:
                raise RequestError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object")
            return body

        def do_POST(self):
            with app.tracked():
                self._post()

        def _post(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            kind = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}.get(path)
            try:
                if not self._authorized():  # before the body is read: an unauthorised client costs nothing
                    return self._refuse(close=True)  # the body is unread: the connection cannot be reused
                if kind is None:
                    raise RequestError(404, f"no such path {self.path}", kind="not_found_error")
                body = self._read_body()
            except RequestError as e:
                self.close_connection = True  # the body may be unread: do not reuse the connection,
                try:  # and say so, or a client may send on it again
                    return self._error(e, {"Connection": "close"})
                except (*GONE, OSError):  # closed to make room for another connection, or gone
                    return
            self._answering()
            try:
                mode, payload = app.run(kind, body, alive=self._client_alive)
                if mode == "json":
                    self._send_json(200, payload)
                else:
                    self._send_stream(payload)
            except RequestError as e:
                self._error(e)
            except ValueError as e:  # a check inside generation
                self._error(RequestError(400, str(e)))
            except GONE:
                self.close_connection = True  # the client is gone (or reads nothing): its request was cancelled
            except Exception as e:  # noqa: BLE001 - an internal error still answers in JSON
                self._error(RequestError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))

        def _send_stream(self, chunks):
            """Server-sent events: each list of chunks from ``chunks`` goes out in one write."""
            first = next(chunks)  # before the 200 goes out: a model error can still be a 500
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:  # small writes go out at once rather than wait for the client's acknowledgement (Nagle)
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):  # not a TCP socket
                pass
            try:
                self.wfile.write(_sse(first))
                self.wfile.flush()
                try:
                    for batch in chunks:
                        self.wfile.write(_sse(batch))
                        self.wfile.flush()
                except GONE:
                    raise
                except Exception as e:  # noqa: BLE001 - the 200 is out: the error goes into the stream
                    err = RequestError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
                    self.wfile.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
                    return
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            finally:
                chunks.close()  # a client that went away stops the generation

    return Handler


class _Connection(io.RawIOBase):
    """One client connection's bytes, read under a deadline, and its state among the server's connections.

    The deadline covers a whole request: the wait for its first byte (a kept-alive connection idling), the request
    line, the headers and the body. Each read waits only for what is left of it, so a client that trickles one byte
    at a time is cut off as surely as one that stops sending (a timeout per read would let it go on for ever).
    ``reading``: waiting for (part of) a request, as opposed to being answered; ``evicted``: the server closed it to
    make room for a new connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline: float | None = None
        self.reading = True
        self.since = time.monotonic()
        self.evicted = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0 or self.evicted:
                raise TimeoutError("the request did not arrive in time")
            self.sock.settimeout(left)
        n = self.sock.recv_into(buf)
        if self.evicted:  # woken by the server's shutdown of the socket
            raise TimeoutError("the connection was closed to make room for another")
        return n


class _LineReader(io.BufferedReader):
    """The handler's ``rfile``: ``on_line`` (when set) sees each line read, and may replace it; the handler uses it
    to check the API key as soon as its header line arrives, before the other headers and the body."""

    on_line: Callable[[bytes], bytes] | None = None

    def readline(self, size: int | None = -1) -> bytes:
        line = super().readline(-1 if size is None else size)
        return self.on_line(line) if self.on_line is not None else line


class _Server(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with bounded connections: at most ``max_connections`` open at once (one thread
    each), every request read under a deadline of ``read_timeout`` seconds (:class:`_Connection`).

    When a new connection finds the server full, the connection that has waited longest for its request (an idle
    keep-alive or a half-sent request) is closed to make room, so connections that send nothing cannot lock others
    out; if every connection is being answered, the new one gets 503 ``too_many_connections`` with ``Retry-After``
    and is closed, without a thread."""

    daemon_threads = True
    request_queue_size = 256  # the listen backlog: 5 by default, too few for a burst of clients connecting at once

    def __init__(self, address, handler, read_timeout: float = READ_TIMEOUT, max_connections: int = MAX_CONNECTIONS):
        if not read_timeout > 0:
            raise ValueError(f"read_timeout must be > 0 seconds, got {read_timeout}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.read_timeout = float(read_timeout)
        self.max_connections = max_connections
        self._connections: dict[socket.socket, _Connection] = {}
        self._lock = threading.Lock()
        super().__init__(address, handler)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return sum(not c.evicted for c in self._connections.values())

    @property
    def busy_connections(self) -> int:
        """Connections whose request is being answered."""
        with self._lock:
            return sum(not c.evicted and not c.reading for c in self._connections.values())

    def connection(self, request: socket.socket) -> _Connection:
        with self._lock:
            return self._connections[request]

    def start_request(self, conn: _Connection):
        """A (next) request is awaited on ``conn``: the deadline starts."""
        with self._lock:
            conn.reading, conn.since = True, time.monotonic()
            conn.deadline = conn.since + self.read_timeout

    def stop_reading(self, conn: _Connection):
        """``conn``'s request is read and is being answered: writes get the read timeout, a total for each."""
        with self._lock:
            if conn.evicted:
                raise TimeoutError("the connection was closed to make room for another")
            if conn.reading:
                conn.reading, conn.deadline = False, None
                conn.sock.settimeout(self.read_timeout)

    def process_request(self, request, client_address):
        with self._lock:
            live = [c for c in self._connections.values() if not c.evicted]
            if len(live) >= self.max_connections:
                idle = [c for c in live if c.reading]
                if not idle:
                    admitted = False
                else:
                    oldest = min(idle, key=lambda c: c.since)
                    oldest.evicted = True
                    try:  # wakes its thread, blocked in a read
                        oldest.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    admitted = True
            else:
                admitted = True
            if admitted:
                self._connections[request] = _Connection(request)
        if not admitted:
            return self._refuse(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request):
        with self._lock:
            self._connections.pop(request, None)

    def _refuse(self, request: socket.socket):
        """503 straight from the accept loop, never blocking it: what fits in the socket's buffer, then close."""
        err = RequestError(503, f"the server has {self.max_connections} connections being answered, its most; "
                                "try again shortly", kind="server_error", code="too_many_connections")
        body = json.dumps(err.body()).encode()
        head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            request.setblocking(False)
            try:  # what the client has sent already: closing with unread bytes would reset the connection
                request.recv(65536)
            except OSError:
                pass
            request.send(head + body)
        except OSError:
            pass
        self.shutdown_request(request)


class AddressError(Exception):
    """The server cannot listen on ``host:port``: one line naming both, and the exit status (2 for a value that can
    never work: a host that is no address of this machine, a port outside 0-65535; 1 for the operating system's
    refusal: the port is taken, or needs privileges)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def address_error(exc: BaseException, host: str, port: int) -> AddressError:
    """The :class:`AddressError` for an exception raised while binding ``host:port``."""
    where = f"{host}:{port}"
    if isinstance(exc, OverflowError) or not 0 <= int(port) <= 65535:
        return AddressError(f"--port {port}: must be 0-65535 (0 picks a free port)", 2)
    if isinstance(exc, socket.gaierror) or getattr(exc, "errno", None) == errno.EADDRNOTAVAIL:
        reason = getattr(exc, "strerror", None) or str(exc)
        return AddressError(f"--host {host}: cannot listen on {where} ({reason}); use 127.0.0.1, 0.0.0.0 or an IPv4 "
                            f"address of this machine", 2)
    code = getattr(exc, "errno", None)
    if code == errno.EADDRINUSE:
        return AddressError(f"cannot listen on {where}: the port is in use (errno {code}); stop what listens there or "
                            f"choose another --port", 1)
    if code == errno.EACCES:
        return AddressError(f"cannot listen on {where}: permission denied (errno {code}); ports below 1024 need "
                            f"privileges: choose a --port of 1024 or more", 1)
    reason = getattr(exc, "strerror", None) or str(exc)
    return AddressError(f"cannot listen on {where}: {reason}" + (f" (errno {code})" if code else ""), 1)


def check_address(host: str, port: int) -> None:
    """Bind ``host:port`` as the server will (IPv4, address reuse) and let go again, so that a busy port or a bad
    host is said in one line before minutes of model loading; raises :class:`AddressError`."""
    try:
        with socket.socket(_Server.address_family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except (OSError, OverflowError) as e:
        raise address_error(e, host, port) from None


def create_server(ckpt: str | Path, host: str = "127.0.0.1", port: int = 8000, tokenizer=None,
                  model_name: str | None = None, device: str = "auto", dtype: str = "auto",
                  max_tokens_limit: int = 1024, max_queue: int = 64, max_batch: int | None = None,
                  cuda_graph: bool | None = None, compile: bool = False, quiet: bool = False,
                  cache_len: int | None = None, api_key: str | None = None, cors_origin: str | None = None,
                  read_timeout: float = READ_TIMEOUT, max_connections: int = MAX_CONNECTIONS
                  ) -> tuple[ThreadingHTTPServer, InferenceApp]:
    """Load the checkpoint and bind the server (``port=0`` picks a free port: ``server.server_address``).

    ``tokenizer`` None loads ``zero2all.tokenizer.load_tokenizer(ckpt)``; ``api_key`` and ``cors_origin``: see
    :func:`make_handler`; ``read_timeout`` and ``max_connections``: see :class:`_Server`."""
    from zero2all.infer.generate import load_for_inference

    model, tok = load_for_inference(str(ckpt), device=device, dtype=dtype, tokenizer=tokenizer)
    name = model_name or Path(ckpt).resolve().name
    generator = Generator(model, tok, cuda_graph=cuda_graph, compile=compile)
    return bind(InferenceApp(generator, name, max_tokens_limit=max_tokens_limit, max_queue=max_queue,
                             max_batch=max_batch, cache_len=cache_len), host, port, quiet, api_key, cors_origin,
                read_timeout, max_connections)


def bind(app: InferenceApp, host: str = "127.0.0.1", port: int = 8000, quiet: bool = False,
         api_key: str | None = None, cors_origin: str | None = None, read_timeout: float = READ_TIMEOUT,
         max_connections: int = MAX_CONNECTIONS) -> tuple[ThreadingHTTPServer, InferenceApp]:
    """An HTTP server for an app (not yet serving: ``serve_forever`` or :func:`run_server`)."""
    handler = make_handler(app, quiet=quiet, api_key=api_key, cors_origin=cors_origin)
    try:
        return _Server((host, port), handler, read_timeout, max_connections), app
    except (OSError, OverflowError) as e:
        raise address_error(e, host, port) from None


def shutdown(httpd: ThreadingHTTPServer, app: InferenceApp, drain_timeout: float = 30.0,
             hurry: threading.Event | None = None) -> int:
    """Stop accepting, let requests finish for up to ``drain_timeout`` seconds (less once ``hurry`` is set), cancel
    the rest, stop. Call it while ``serve_forever`` runs in another thread (``httpd.shutdown`` waits for that loop
    to end). Returns the exit status: 0, or ``EXIT_CANCELLED`` when requests were cancelled."""
    app.scheduler.stop_accepting()     # from now on a request on an open connection gets 503
    httpd.shutdown()                   # the accept loop ends
    httpd.server_close()               # and the listening socket closes: new connections are refused
    deadline = time.monotonic() + drain_timeout
    while app.scheduler.busy() and time.monotonic() < deadline and not (hurry is not None and hurry.is_set()):
        app.scheduler.wait_idle(min(0.2, max(0.0, deadline - time.monotonic())))
    cancelled = app.scheduler.drain(0.0)
    app.wait_responses(5.0)            # the handler threads write their last chunks
    app.close()
    print(f"stopped: {cancelled} request(s) cancelled after the drain timeout of {drain_timeout:g} s"
          if cancelled else "stopped: every request finished", file=sys.stderr, flush=True)
    return EXIT_CANCELLED if cancelled else 0


def run_server(httpd: ThreadingHTTPServer, app: InferenceApp, drain_timeout: float = 30.0,
               signals=(signal.SIGTERM, signal.SIGINT)) -> int:
    """Serve until one of ``signals`` arrives, then :func:`shutdown` (a second signal cancels at once). Run it in
    the main thread (signal handlers live there). Returns the exit status."""
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum, frame):
        (hurry if stop.is_set() else stop).set()

    previous = {s: signal.signal(s, on_signal) for s in signals}
    thread = threading.Thread(target=httpd.serve_forever, name="z2all-http", daemon=True)
    thread.start()
    try:
        while not stop.wait(0.5):
            if not thread.is_alive():  # the accept loop died: shut down as well
                break
        return shutdown(httpd, app, drain_timeout, hurry)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def serve(ckpt: str | Path, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
          **kwargs) -> int:
    """Load, bind, serve until SIGTERM / Ctrl-C, drain; returns the exit status (see the module docstring)."""
    check_address(host, port)  # a busy port or a bad host: said before the model is loaded
    httpd, app = create_server(ckpt, host, port, **kwargs)
    h, p = httpd.server_address[:2]
    if warning := exposure_warning(host, kwargs.get("api_key")):
        print(warning, file=sys.stderr, flush=True)
    print(f"serving {app.model_name!r} on http://{h}:{p}/v1 (max_tokens <= {app.max_tokens_limit}, context "
          f"{app.context}; {app.max_batch} sequences at once, {app.max_queue} more may wait); SIGTERM or Ctrl-C "
          f"stops after the running requests (at most {drain_timeout:g} s)", flush=True)
    print(f"chat page: http://{h}:{p}/" + ("  (it asks for the API key once per tab)" if kwargs.get("api_key")
                                          else ""), flush=True)
    if app.max_tokens_limit > app.context:
        print(f"note: the max_tokens limit {app.max_tokens_limit} is above the model's context of {app.context} "
              "tokens: a request's prompt + max_tokens must fit the context", flush=True)
    return run_server(httpd, app, drain_timeout)
