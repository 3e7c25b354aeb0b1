"""An OpenAI-compatible HTTP server on the standard library (``http.server``), over :class:`Generator`.

Endpoints::

    GET  /v1/models             {"object": "list", "data": [{"id": MODEL, "object": "model", ...}]}
    POST /v1/completions        {"model", "prompt": str | [str, ...], "max_tokens", "temperature", "top_p",
                                 "stop", "stream", "seed", + extensions "top_k", "repetition_penalty"}
                                (a prompt starts a new document: the end-of-text separator goes in front)
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "max_tokens" |
                                 "max_completion_tokens", ... as above}
    GET  /health                {"status": "ok"}

``"stream": true`` answers with server-sent events: one ``data: {chunk}`` line per generated piece and a final
``data: [DONE]`` (with ``"stream_options": {"include_usage": true}`` a usage chunk comes before it). Errors are JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON,
missing or invalid fields, ``max_tokens`` above the server's limit or a prompt that does not fit the context; 404
for an unknown model or path; 413 for a body over 1 MiB; 429 when the server is full.

Concurrency: the model runs one generation at a time (a lock; a prompt list in one completions request is one
batch). Up to ``max_queue`` further requests wait for it in arrival order; a request beyond that is refused at
once with 429 and a ``Retry-After`` header, rather than piling up threads.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from zero2all.infer.generate import Generator, SamplingParams

MAX_BODY_BYTES = 1 << 20


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _FairLock:
    """A FIFO lock: waiting requests are served in arrival order."""

    def __init__(self):
        self._mutex = threading.Lock()
        self._waiters: list[threading.Event] = []
        self._held = False

    def __enter__(self):
        with self._mutex:
            if not self._held and not self._waiters:
                self._held = True
                return self
            ev = threading.Event()
            self._waiters.append(ev)
        ev.wait()
        return self

    def __exit__(self, *exc):
        with self._mutex:
            if self._waiters:
                self._waiters.pop(0).set()  # hand over directly: the lock stays held
            else:
                self._held = False


class InferenceApp:
    """Request validation and the OpenAI response shapes; the HTTP handler only moves bytes."""

    def __init__(self, generator: Generator, model_name: str, max_tokens_limit: int = 1024,
                 default_max_tokens: int = 256, max_queue: int = 8, max_batch: int = 16,
                 document_start: bool = True):
        if generator.tokenizer is None:
            raise ValueError("the server needs a tokenizer")
        self.generator = generator
        self.model_name = model_name
        self.max_tokens_limit = min(max_tokens_limit, generator.max_seq_len)
        self.default_max_tokens = min(default_max_tokens, self.max_tokens_limit)
        self.max_batch = max_batch
        self.document_start = document_start
        self.max_queue = max_queue
        self.admission = threading.BoundedSemaphore(max_queue + 1)  # one running + max_queue waiting
        self.model_lock = _FairLock()
        self.created = int(time.time())

    # -- validation -------------------------------------------------------------------------------------------
    def _number(self, body, key, default, lo=None, hi=None, integer=False, lo_open=False):
        value = body.get(key, default)
        if value is None:
            return default
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if not ok or isinstance(value, bool):
            raise RequestError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}",
                               key)
        if lo is not None and (value <= lo if lo_open else value < lo):
            raise RequestError(400, f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {value}", key)
        if hi is not None and value > hi:
            raise RequestError(400, f"'{key}' must be <= {hi}, got {value}", key)
        return value

    def parse_common(self, body: dict, chat: bool) -> tuple[SamplingParams, bool]:
        if "model" not in body:
            raise RequestError(400, "missing required field 'model'", "model", "missing_field")
        if body["model"] != self.model_name:
            raise RequestError(404, f"model {body['model']!r} does not exist; this server serves "
                                    f"{self.model_name!r}", "model", "model_not_found")
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        max_tokens = self._number(body, key, self.default_max_tokens, lo=1, integer=True)
        if max_tokens > self.max_tokens_limit:
            raise RequestError(400, f"'{key}' is {max_tokens}, above this server's limit of "
                                    f"{self.max_tokens_limit}", key, "max_tokens_exceeded")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > 4 or any(not isinstance(s, str) or not s for s in stop):
            raise RequestError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
        n = body.get("n", 1)
        if n != 1:
            raise RequestError(400, "only n=1 is supported", "n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(400, "'stream' must be true or false", "stream")
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
            raise RequestError(400, "logprobs are not supported by this server", "logprobs")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError(400, f"'seed' must be an integer, got {seed!r}", "seed")
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=float(self._number(body, "temperature", 1.0, lo=0, hi=2)),
            top_p=float(self._number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)),
            top_k=int(self._number(body, "top_k", 0, lo=0, integer=True)),
            repetition_penalty=float(self._number(body, "repetition_penalty", 1.0, lo=0, lo_open=True)),
            stop=tuple(stop), seed=seed)
        return params, stream

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

    def check_fits(self, prompts: list[list[int]], params: SamplingParams):
        ctx = self.generator.max_seq_len
        for i, p in enumerate(prompts):
            if len(p) + params.max_new_tokens > ctx:
                raise RequestError(400, f"prompt {i} has {len(p)} tokens; with max_tokens {params.max_new_tokens} "
                                        f"that exceeds the context of {ctx} tokens", "max_tokens",
                                   "context_length_exceeded")

    # -- responses --------------------------------------------------------------------------------------------
    def run(self, kind: str, body: dict):
        """Validate, then return ("json", dict) or ("stream", iterator of dicts); raises RequestError."""
        chat = kind == "chat"
        params, stream = self.parse_common(body, chat)
        prompts = [self.chat_prompt(body)] if chat else self.completion_prompts(body)
        if "max_tokens" not in body and not (chat and "max_completion_tokens" in body):
            # no budget asked for: the default, cut to what the longest prompt leaves of the context (a small
            # model's context may be no longer than the default); an explicit max_tokens is never shortened
            room = self.generator.max_seq_len - max(len(p) for p in prompts)
            if 1 <= room < params.max_new_tokens:
                params.max_new_tokens = room
        self.check_fits(prompts, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if stream:
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise RequestError(400, "'stream_options' must be an object", "stream_options")
            return "stream", self._stream(chat, rid, prompts, params, bool(options.get("include_usage")))
        with self.model_lock:
            outs = self.generator.generate(prompts, params)
        created = int(time.time())
        usage = {"prompt_tokens": sum(len(p) for p in prompts),
                 "completion_tokens": sum(o.num_generated for o in outs)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if chat:
            choices = [{"index": 0, "message": {"role": "assistant", "content": outs[0].text},
                        "logprobs": None, "finish_reason": outs[0].finish_reason}]
            return "json", {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                            "choices": choices, "usage": usage}
        choices = [{"index": i, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
                   for i, o in enumerate(outs)]
        return "json", {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": choices, "usage": usage}

    def _stream(self, chat: bool, rid: str, prompts, params, include_usage: bool = False):
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

        with self.model_lock:
            if chat:
                yield chunk(0, "", None, first=True)
            events = self.generator.stream(prompts, params)
            try:
                for ev in events:
                    drawn += 1
                    if ev.text or ev.finish_reason:
                        if chat and ev.text and ev.finish_reason:
                            yield chunk(ev.index, ev.text, None)
                            yield chunk(ev.index, "", ev.finish_reason)
                        else:
                            yield chunk(ev.index, ev.text, ev.finish_reason)
            finally:
                events.close()
        if include_usage:  # OpenAI's stream_options.include_usage: a last chunk with no choices
            usage = {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": drawn}
            usage["total_tokens"] = usage["prompt_tokens"] + drawn
            yield {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                   "usage": usage}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "zero2all"}]}


def make_handler(app: InferenceApp, quiet: bool = False):
    class Handler(BaseHTTPRequestHandler):
        server_version = "zero2all"
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            if not quiet:
                sys.stderr.write(f"[serve] {self.address_string()} {fmt % args}\n")

        def _send_json(self, status: int, obj: dict, headers: dict | None = None):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, err: RequestError, headers=None):
            self._send_json(err.status, err.body(), headers)

        def do_GET(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/v1/models":
                self._send_json(200, app.models())
            elif path == "/health":
                self._send_json(200, {"status": "ok"})
            else:
                self._error(RequestError(404, f"no such path {self.path}", kind="not_found_error"))

        def _read_body(self) -> dict:
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
            raw = self.rfile.read(n)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object")
            return body

        def do_POST(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            kind = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}.get(path)
            try:
                body = self._read_body()
                if kind is None:
                    raise RequestError(404, f"no such path {self.path}", kind="not_found_error")
            except RequestError as e:
                self.close_connection = True  # the body may be unread: do not reuse the connection,
                return self._error(e, {"Connection": "close"})  # and say so, or a client may send on it again
            if not app.admission.acquire(blocking=False):
                return self._error(RequestError(429, f"server busy: {app.max_queue + 1} requests in flight; "
                                                     "retry later", kind="rate_limit_error"), {"Retry-After": "1"})
            try:
                mode, payload = app.run(kind, body)
                if mode == "json":
                    self._send_json(200, payload)
                else:
                    self._send_stream(payload)
            except RequestError as e:
                self._error(e)
            except ValueError as e:  # a check inside generation
                self._error(RequestError(400, str(e)))
            except (BrokenPipeError, ConnectionResetError):
                pass
            except Exception as e:  # noqa: BLE001 - an internal error still answers in JSON
                self._error(RequestError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))
            finally:
                app.admission.release()

        def _send_stream(self, chunks):
            first = next(chunks)  # run validation-time errors before the 200 goes out
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:
                self.wfile.write(b"data: " + json.dumps(first).encode() + b"\n\n")
                self.wfile.flush()
                for c in chunks:
                    self.wfile.write(b"data: " + json.dumps(c).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            finally:
                chunks.close()  # a client that went away stops the generation

    return Handler


def create_server(ckpt: str | Path, host: str = "127.0.0.1", port: int = 8000, tokenizer=None,
                  model_name: str | None = None, device: str = "auto", dtype: str = "auto",
                  max_tokens_limit: int = 1024, max_queue: int = 8, cuda_graph: bool | None = None,
                  compile: bool = False, quiet: bool = False) -> tuple[ThreadingHTTPServer, InferenceApp]:
    """Load the checkpoint and bind the server (``port=0`` picks a free port: ``server.server_address``).

    ``tokenizer`` None loads ``zero2all.tokenizer.load_tokenizer(ckpt)``."""
    from zero2all.infer.generate import load_for_inference

    model, tok = load_for_inference(str(ckpt), device=device, dtype=dtype, tokenizer=tokenizer)
    name = model_name or Path(ckpt).resolve().name
    app = InferenceApp(Generator(model, tok, cuda_graph=cuda_graph, compile=compile), name, max_tokens_limit=max_tokens_limit,
                       max_queue=max_queue)
    httpd = ThreadingHTTPServer((host, port), make_handler(app, quiet=quiet))
    httpd.daemon_threads = True
    return httpd, app


def serve(ckpt: str | Path, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    httpd, app = create_server(ckpt, host, port, **kwargs)
    h, p = httpd.server_address[:2]
    print(f"serving {app.model_name!r} on http://{h}:{p}/v1 (max_tokens <= {app.max_tokens_limit}, "
          f"{app.max_queue} queued requests at most); Ctrl-C stops", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
