"""An OpenAI-compatible HTTP server: an ASGI app (Starlette) on uvicorn, over a continuous-batching scheduler.

Endpoints::

    GET  /v1/models             {"object": "list", "data": [{"id": MODEL, "object": "model", ...}]}
    POST /v1/completions        {"model", "prompt": str | [str, ...], "max_tokens", "temperature", "top_p",
                                 "stop", "stream", "seed", + extensions "top_k", "repetition_penalty",
                                 "ignore_eos"}
                                (a prompt starts a new document: the end-of-text separator goes in front)
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "max_tokens" |
                                 "max_completion_tokens", ... as above, "tools", "tool_choice"}
                                (both: "response_format" text | json_object | json_schema)
    GET  /health                {"status": "ok", "running", "waiting", "cancelled"} (sequences decoding,
                                waiting for a row, cancelled so far; 503 {"status": "draining"} while shutting down)
    GET  /metrics               Prometheus text: queue, running rows, tokens/s, TTFT and ITL histograms, ...
    GET  /openapi.json          the OpenAPI description, its schemas from the request and response models
    GET  /                      the chat page (``infer/web/``: index.html, app.js, style.css; no build step)

The request and response bodies are pydantic models (``infer/api.py``), which also give the errors: JSON
``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field at fault: 400 for malformed JSON,
missing or invalid fields (a number must be finite: ``NaN`` and ``Infinity``, which Python's JSON reader accepts,
are refused), ``max_tokens`` above the server's limit or a prompt that does not fit the context; 404 for an unknown
model or path; 405 for a method a path does not answer; 413 for a body over 1 MiB; 415 for a body that is not JSON;
429 when the queue is full; 503 while shutting down. ``/v1/models`` also gives ``context_length`` (the model's
context) and ``max_tokens_limit`` (this server's limit). ``"ignore_eos": true`` (an extension) keeps generating
through stop tokens up to ``max_tokens`` (stop strings still apply): every such request produces the same number of
tokens, for load tests.

Structured output (``infer/structured.py``): a ``response_format`` of ``json_object`` or ``json_schema`` constrains
decoding to that format by a grammar (the ``structured`` extra, xgrammar; a 400 naming the package without it), and
so does a ``tool_choice`` of "required" or a named function, to one call of the offered tools. Tools are offered in
the chat template's system turn and read back from the reply (``data/tools.py``); a reply made of tool-call blocks
is answered as OpenAI's ``message.tool_calls`` (streamed: ``delta.tool_calls``) with ``finish_reason``
"tool_calls".

A field sent as ``null`` is absent (OpenAI's own rule; some clients send ``"max_tokens": null``). Without
``max_tokens`` the budget is ``default_max_tokens`` cut to what the longest prompt leaves of the context, so it never
overflows; an explicit ``max_tokens`` that does not fit is refused, unless the request says ``"fit_context": true``
(an extension, sent by the chat page): then it is an upper bound, cut the same way.

``"stream": true`` answers with server-sent events: one ``data: {chunk}`` line per generated piece and a final
``data: [DONE]`` (with ``"stream_options": {"include_usage": true}`` a usage chunk comes before it); the events
that are ready at once (the steps run since the stream last wrote) go out in one write.

Access: with an API key (``serve --api-key KEY`` or the ``Z2ALL_API_KEY`` environment variable) every ``/v1`` route
needs ``Authorization: Bearer KEY``, as OpenAI clients send it; the key is compared in constant time
(``hmac.compare_digest``) and a missing or wrong one is 401 ``invalid_api_key``. A wrong key is seen as soon as its
header line arrives, before the other headers and the body (:class:`_Protocol`): 401 and the connection closes, so
a client without the key costs no more reading. The page, ``/health``, ``/metrics`` and ``/openapi.json`` stay open
(they hold no secret; the page asks for the key and sends it with its own calls). No CORS header is sent unless
``cors_origin`` names the one origin allowed to call the API from another site's pages (OPTIONS is its preflight).

Concurrency: one event loop (uvicorn's) does all the HTTP work; no thread per connection or request. Continuous
batching (``infer/scheduler.py``): one background thread owns the model and a pool of ``max_batch`` KV-cache rows;
each decode step advances every running sequence by one token, a new sequence joins the batch between two steps and
a finished or cancelled one leaves it. The scheduler's thread hands each request's events to the loop
(``Submission.abatches``: one wake-up per wait). Up to ``max_queue`` sequences wait for a row; a request beyond that
is refused at once with 429 and ``Retry-After``. A client that disconnects cancels its request at once.

Connections are bounded (:class:`_Protocol`, uvicorn's HTTP/1.1 protocol on h11 with the limits added): a whole
request (the wait for it on a kept-alive connection, its request line, headers and body) must arrive within
``read_timeout`` seconds (30), a total, not a limit per read, so a client trickling bytes is cut off too (a half-sent
request is closed, a half-sent body gets 408); a write that a client does not read for as long fails and cancels the
request. At most ``max_connections`` (256) are open: a new connection past that closes the one that has waited
longest for its request, or, when every connection is being answered, gets 503 ``too_many_connections`` with
``Retry-After``. A malformed request (a bad request line, headers over 64 KiB, an unknown HTTP version or method)
gets its error in JSON too, and the connection closes.

Shutdown (``serve``; SIGTERM or Ctrl-C): the server stops listening (new connections are refused; a request on a
kept-alive connection gets 503 ``shutting_down``, ``/health`` 503 ``draining``), lets the running and waiting
requests finish for up to ``drain_timeout`` seconds (a second signal cuts the wait short), then cancels what is
left: those end with ``finish_reason`` ``"cancelled"`` (a stream still ends with ``data: [DONE]``). The exit status
is 0 when every request finished and 143 (128 + SIGTERM) when some had to be cancelled.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hmac
import ipaddress
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
import uuid
from collections import Counter, deque
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import h11
import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn import Config
from uvicorn import Server as Uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from zero2all.data.tools import may_be_tool_call, parse_tool_calls, template_messages
from zero2all.infer import api
from zero2all.infer.api import RequestError, show
from zero2all.infer.generate import Generator, SamplingParams
from zero2all.infer.scheduler import QueueFull, Scheduler, ShuttingDown, Submission, kv_bytes_per_token
from zero2all.infer.structured import GrammarError, Grammars, GrammarUnavailable

MAX_BODY_BYTES = 1 << 20
MAX_HEAD_BYTES = 64 << 10  # request line and headers together
EXIT_CANCELLED = 143  # the exit status when the drain timeout ran out and requests were cancelled
READ_TIMEOUT = 30.0  # seconds a whole request (request line, headers, body) may take to arrive
MAX_CONNECTIONS = 256  # connections open at once


@dataclass
class _Job:
    """A validated, queued request."""
    chat: bool
    rid: str
    prompts: list[list[int]]
    sub: Submission
    stream: bool
    include_usage: bool
    arrived: float
    tools: frozenset = frozenset()  # chat: the names of the functions the reply may call (empty: text only)


def resolve_engine(engine: str, device: torch.device) -> str:
    """``auto``: the column engine on CUDA, where it is the faster one as measured (z2all-1.1b on one H100,
    256 clients: 17,132 tokens/s against the paged engine's 4,075; BENCHMARKS.md, "Serving: the paged engine"),
    the paged one elsewhere (prefix caching and chunked prefill, where a prefill costs most)."""
    if engine == "auto":
        return "column" if device.type == "cuda" else "paged"
    return engine


COLUMN_ROWS = (256, 128, 64, 32)  # the column engine's default rows on CUDA, the first whose cache fits


def default_rows(engine: str, device: torch.device, model=None, free_bytes: int | None = None) -> int:
    """Batch rows when none are asked for: 8 on CPU; on CUDA 256 with the paged engine (its memory is per token
    held) and with the column engine the most of 256, 128, 64, 32 rows whose cache at the model's context takes at
    most half of ``free_bytes`` (default: the GPU's free memory now), else 16. The column engine's step runs over
    the smallest row bucket holding the running rows and a lone stream takes its one-row step, so many rows cost
    a few clients little: z2all-1.1b on one H200, 256 rows against 16, one client 1,033 against 1,080 tokens/s, 64
    clients 16,128 against 7,891 (TTFT p50 196 against 726 ms), 256 clients 30,482 against 9,381 (BENCHMARKS.md,
    "Serving: row buckets"); the price is the set-up (graphs per bucket: 34-45 s against 14-16 s)."""
    if device.type != "cuda":
        return 8
    if engine == "paged" or model is None:
        return 256
    per_row = kv_bytes_per_token(model) * model.cfg.max_seq_len
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    return next((rows for rows in COLUMN_ROWS if rows * per_row <= free_bytes // 2), 16)


class InferenceApp:
    """Request validation and the OpenAI response shapes over a :class:`Scheduler`; the HTTP layer only moves
    bytes. ``max_batch`` None: :func:`default_rows`. ``engine_options``: the :class:`Scheduler`'s engine arguments
    (engine: ``auto`` by default, :func:`resolve_engine`, or paged when speculative decoding is asked for;
    block_size, kv_blocks, kv_cache_gb, prefix_caching, max_num_batched_tokens, speculative_ngram, draft_model,
    speculative_tokens, prefill_graphs). ``max_queue``: sequences that may wait for a row (a waiting request costs
    its prompt, no cache); more get 429."""

    def __init__(self, generator: Generator, model_name: str, max_tokens_limit: int = 1024,
                 default_max_tokens: int = 256, max_queue: int = 64, max_batch: int | None = None,
                 document_start: bool = True, cache_len: int | None = None, engine_options: dict | None = None):
        if generator.tokenizer is None:
            raise ValueError("the server needs a tokenizer")
        if max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {max_tokens_limit}")
        self.generator = generator
        self.model_name = model_name
        engine_options = dict(engine_options or {})
        engine = engine_options.get("engine", "auto")
        if engine == "auto" and (engine_options.get("draft_model") is not None
                                 or engine_options.get("speculative_ngram")):
            engine = "paged"              # speculative decoding is the paged engine's
        engine_options["engine"] = resolve_engine(engine, generator.device)
        if max_batch is None:
            max_batch = default_rows(engine_options["engine"], generator.device, generator.model)
        self.scheduler = Scheduler(generator, max_batch=max_batch, max_queue=max_queue, cache_len=cache_len,
                                   **engine_options)
        self.context = self.scheduler.context
        # the limit is what was asked for, even above the context: a request that does not fit is then told so
        # (400 "context_length_exceeded"), instead of the limit being lowered behind the operator's back
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = min(default_max_tokens, max_tokens_limit)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.document_start = document_start
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        # structured output: the grammar compiler of this vocabulary, made at the first request that needs it
        self.grammars = Grammars(generator.tokenizer, self.scheduler.vocab, self.scheduler.default_stop_ids)
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
    def check_model(self, body: dict):
        """The model is checked first: a request for another model is 404 whatever else it holds."""
        if body.get("model") is None:  # null is absent
            raise RequestError(400, "missing required field 'model'", "model", "missing_field")
        if body["model"] != self.model_name:
            raise RequestError(404, f"model {show(body['model'])} does not exist; this server serves "
                                    f"{self.model_name!r}", "model", "model_not_found")

    def sampling(self, req: api.CompletionRequest | api.ChatCompletionRequest, chat: bool) -> SamplingParams:
        key = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(req, key)
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        elif max_tokens > self.max_tokens_limit:
            raise RequestError(400, f"'{key}' is {show(max_tokens)}, above this server's limit of "
                                    f"{self.max_tokens_limit}", key, "max_tokens_exceeded")
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            stop=tuple(req.stop or ()), seed=req.seed,
            stop_token_ids=[] if req.ignore_eos else None)

    def compile(self, make, param: str):
        """A grammar from ``make(self.grammars)``; a missing package or an unusable schema is a 400 on ``param``."""
        try:
            return make(self.grammars)
        except GrammarUnavailable as e:
            raise RequestError(400, str(e), param, "structured_output_unavailable") from None
        except GrammarError as e:
            err = RequestError(400, f"'{param}': this schema cannot be used for constrained decoding: {e}", param,
                               "invalid_schema")
            err.index = getattr(e, "index", None)
            raise err from None

    def response_grammar(self, fmt: dict | None):
        """The grammar of a ``response_format`` (already checked for shape by ``api``); None for text."""
        if fmt is None or fmt["type"] == "text":
            return None
        if fmt["type"] == "json_object":
            return self.compile(lambda g: g.json_object(), "response_format")
        schema = fmt["json_schema"].get("schema", {})
        return self.compile(lambda g: g.json_schema(schema), "response_format")

    def completion_prompts(self, req: api.CompletionRequest) -> list[list[int]]:
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) > self.max_batch:
            raise RequestError(400, f"at most {self.max_batch} prompts per request", "prompt")
        tok = self.generator.tokenizer
        # a prompt starts a new document: the pretraining data has the end-of-text separator before each one
        head = [tok.eos_id] if self.document_start and tok.eos_id is not None else []
        return [head + list(tok.encode(p)) for p in prompts]

    def chat_prompt(self, req: api.ChatCompletionRequest) -> list[int]:
        """The messages (tool calls and results included) in the chat template, the tools offered in the system
        turn unless ``tool_choice`` is "none" (``data/tools.py``), then the assistant's header."""
        clean = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                  "tool_calls": m.tool_calls} for m in req.messages]
        offered = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.choice() != "none" \
            else None
        messages = template_messages(clean, offered)
        return list(self.generator.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def tool_grammar(self, req: api.ChatCompletionRequest):
        """The grammar that forces a call (``tool_choice`` "required" or a named function), else None; 400s for a
        choice that names no offered tool, and for a tool whose parameters cannot be compiled."""
        choice = req.choice()
        if choice in (None, "none", "auto"):
            return None
        if not req.tools:
            raise RequestError(400, f"'tool_choice' {show(req.tool_choice)} needs 'tools'", "tool_choice")
        names = [t.function.name for t in req.tools]
        if choice != "required" and choice not in names:
            raise RequestError(400, f"'tool_choice' names the function {choice!r}, which is not among the tools "
                                    f"({', '.join(names)})", "tool_choice")
        if req.response_format is not None and req.response_format["type"] != "text":
            raise RequestError(400, "'response_format' cannot constrain a reply that 'tool_choice' forces to be a "
                                    "tool call; send one of the two", "response_format")
        picked = [(i, t) for i, t in enumerate(req.tools) if choice == "required" or t.function.name == choice]
        try:
            return self.compile(lambda g: g.tool_call([(t.function.name, t.function.parameters) for _, t in picked]),
                                "tools")
        except RequestError as e:
            index = getattr(e, "index", None)
            if index is not None:
                e.param = f"tools[{picked[index][0]}].function.parameters"
                e.message = e.message.replace("'tools'", f"'{e.param}'", 1)
            raise

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

    def submit(self, kind: str, body: dict) -> _Job:
        """Validate and queue a request (``kind``: "chat" or "completion"); raises :class:`RequestError`."""
        arrived = time.monotonic()
        chat = kind == "chat"
        self.check_model(body)
        req = api.parse(api.ChatCompletionRequest if chat else api.CompletionRequest, body)
        params = self.sampling(req, chat)
        tools = frozenset()
        if chat and req.tools and req.choice() != "none":
            tools = frozenset(t.function.name for t in req.tools)
        params.grammar = (self.tool_grammar(req) if chat else None) or self.response_grammar(req.response_format)
        prompts = [self.chat_prompt(req)] if chat else self.completion_prompts(req)
        asked = req.max_tokens is not None or (chat and req.max_completion_tokens is not None)
        if req.fit_context or not asked:
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
        except ValueError as e:  # a check inside generation
            raise RequestError(400, str(e)) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _Job(chat, rid, prompts, sub, bool(req.stream), include_usage, arrived, tools)

    # -- responses --------------------------------------------------------------------------------------------
    async def events(self, job: _Job):
        """The job's events in lists, as the loop receives them; timed into the metrics (TTFT, ITL, tokens)."""
        m, last = self.metrics, {}
        async with aclosing(job.sub.abatches()) as batches:
            async for batch in batches:
                now = time.monotonic()
                drawn = 0
                for ev in batch:
                    if ev.token_id < 0:
                        continue
                    drawn += 1
                    before = last.get(ev.index)
                    m.ttft.observe(now - job.arrived) if before is None else m.itl.observe(now - before)
                    last[ev.index] = now
                m.tokens(drawn, now)
                yield batch
        m.latency.observe(time.monotonic() - job.arrived)

    async def complete(self, job: _Job) -> dict:
        """The whole answer of a request that does not stream."""
        n = len(job.prompts)
        texts, reasons, drawn = [""] * n, ["length"] * n, [0] * n
        cached = 0
        async with aclosing(self.events(job)) as batches:
            async for batch in batches:
                for ev in batch:
                    drawn[ev.index] += ev.token_id >= 0
                    texts[ev.index] += ev.text
                    if ev.finish_reason:
                        reasons[ev.index] = ev.finish_reason
                        cached += ev.cached_tokens
        created = int(time.time())
        usage = _usage(job, sum(drawn), cached)
        if job.chat:
            message = {"role": "assistant", "content": texts[0]}
            calls = tool_calls(job, texts[0], reasons[0])
            if calls:
                message, reasons[0] = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
            choices = [{"index": 0, "message": message, "logprobs": None, "finish_reason": reasons[0]}]
            return {"id": job.rid, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": choices, "usage": usage}
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        return {"id": job.rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage}

    async def chunks(self, job: _Job):
        """The chunks of a streamed response, in lists: each list is what is ready at once, written together."""
        created = int(time.time())
        drawn = cached = 0
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        rid, model = job.rid, self.model_name

        def chunk(index, text, finish, first=False):
            if job.chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}

        text_chunk = ChunkTemplate(lambda index, text: chunk(index, text, None))
        if job.chat:
            yield [chunk(0, "", None, first=True)]
        # with tools, a reply that may still be a tool call is held back until it is clearly text (then it streams
        # from its start) or ends (then it goes out as delta.tool_calls)
        held = "" if job.tools else None
        async with aclosing(self.events(job)) as batches:
            async for events in batches:
                out = []
                for ev in events:
                    drawn += ev.token_id >= 0
                    cached += ev.cached_tokens if ev.finish_reason else 0
                    text = ev.text
                    if held is not None:
                        held += text
                        if ev.finish_reason and (calls := tool_calls(job, held, ev.finish_reason)):
                            out.append({**chunk(0, "", None), "choices": [{
                                "index": 0, "delta": {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]},
                                "logprobs": None, "finish_reason": None}]})
                            out.append(chunk(0, "", "tool_calls"))
                            continue
                        if not ev.finish_reason and may_be_tool_call(held):
                            continue
                        text, held = held, None
                    if text and not ev.finish_reason:  # the common chunk: its JSON from a template
                        out.append(text_chunk(ev.index, text))
                    elif text or ev.finish_reason:
                        if job.chat and text and ev.finish_reason:
                            out.append(chunk(ev.index, text, None))
                            out.append(chunk(ev.index, "", ev.finish_reason))
                        else:
                            out.append(chunk(ev.index, text, ev.finish_reason))
                if out:
                    yield out
        if job.include_usage:  # OpenAI's stream_options.include_usage: a last chunk with no choices
            usage = _usage(job, drawn, cached)
            yield [{"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}]

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


def needs_grammar(body: dict) -> bool:
    """Whether a request body asks for constrained decoding (a guess from its raw fields: it is validated later)."""
    fmt, choice = body.get("response_format"), body.get("tool_choice")
    return (fmt is not None and fmt != {"type": "text"}) or (choice is not None and choice not in ("none", "auto"))


def tool_calls(job: _Job, text: str, finish_reason: str | None) -> list[dict] | None:
    """A chat reply read as OpenAI's ``tool_calls`` when tools were offered, it ended by itself ("stop") and it is
    made of tool-call blocks of offered functions only (``data/tools.py``); else None (the reply is text)."""
    if not job.tools or finish_reason != "stop":
        return None
    calls = parse_tool_calls(text)
    if not calls or any(name not in job.tools for name, _ in calls):
        return None
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}} for name, args in calls]


def _usage(job: _Job, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache held."""
    prompt_tokens = sum(len(p) for p in job.prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# -- metrics ----------------------------------------------------------------------------------------------------

class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count), updated from the event loop only."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float):
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for b, c in zip(self.buckets, self.counts):
            total += c
            out.append(f'{self.name}_bucket{{le="{b:g}"}} {total}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum:.6f}",
                f"{self.name}_count {self.count}"]
        return out


class ServerMetrics:
    """What ``/metrics`` reports besides the scheduler's own state: requests by route and status, tokens,
    TTFT / ITL / request-latency histograms (seconds, as the clients see them: timed when the HTTP layer receives
    the events), and the generation rate over the last ``window`` seconds."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self.requests: Counter = Counter()   # (route, status) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._recent: deque = deque()        # (time, tokens) within the window
        ms = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
        self.ttft = Histogram("z2all_time_to_first_token_seconds", "from a request's arrival to its first token", ms
                              + (30.0, 60.0))
        self.itl = Histogram("z2all_inter_token_latency_seconds", "between two tokens of one sequence", ms)
        self.latency = Histogram("z2all_request_duration_seconds", "from a request's arrival to its last token",
                                 ms[4:] + (30.0, 60.0, 120.0, 300.0))

    def tokens(self, n: int, now: float):
        if n:
            self.generated_tokens += n
            self._recent.append((now, n))

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / self.window

    def render(self, app: InferenceApp, connections: tuple[int, int] | None = None) -> str:
        s = app.scheduler.stats()
        lines = []

        def metric(name, kind, help, value, labels=""):
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name}{labels} {value}"])

        metric("z2all_requests_waiting", "gauge", "sequences waiting for a batch row (the queue)", s["waiting"])
        metric("z2all_requests_running", "gauge", "sequences decoding (batch rows in use)", s["running"])
        metric("z2all_batch_rows", "gauge", "batch rows (KV-cache rows) in all", app.max_batch)
        metric("z2all_kv_cache_slots", "gauge", "cache slots per row", app.scheduler.cache_len)
        metric("z2all_kv_cache_column", "gauge", "the cache slot the next decode step writes", s["column"])
        if "kv_blocks_total" in s:  # the paged engine
            metric("z2all_kv_blocks_in_use", "gauge", "KV-cache blocks held by running sequences",
                   s["kv_blocks_in_use"])
            metric("z2all_kv_blocks_total", "gauge", f"KV-cache blocks of {s['kv_block_size']} tokens in the pool",
                   s["kv_blocks_total"])
            metric("z2all_prefix_cache_queried_tokens_total", "counter", "prompt tokens looked up in the prefix cache",
                   s["prefix_cache_lookups"])
            metric("z2all_prefix_cache_hit_tokens_total", "counter", "prompt tokens found in the prefix cache",
                   s["prefix_cache_hits"])
            metric("z2all_prefix_cache_hit_rate", "gauge", "prompt tokens found in the prefix cache / looked up",
                   f"{s['prefix_cache_hit_rate']:.4f}")
            method = f'{{method="{s["spec_method"]}"}}'   # off, ngram (prompt lookup) or draft_model
            metric("z2all_spec_draft_tokens_total", "counter", "speculative draft tokens proposed", s["spec_drafted"],
                   method)
            metric("z2all_spec_accepted_tokens_total", "counter", "draft tokens accepted", s["spec_accepted"], method)
            metric("z2all_spec_acceptance_rate", "gauge", "draft tokens accepted / proposed",
                   f"{s['spec_acceptance_rate']:.4f}", method)
        metric("z2all_queue_limit", "gauge", "sequences that may wait", app.max_queue)
        metric("z2all_decode_steps_total", "counter", "decode steps run", s["steps"])
        metric("z2all_prompt_tokens_total", "counter", "prompt tokens of accepted requests", self.prompt_tokens)
        metric("z2all_generation_tokens_total", "counter", "tokens generated", self.generated_tokens)
        metric("z2all_generation_tokens_per_second", "gauge", f"tokens generated per second over the last "
               f"{self.window:g} s", f"{self.rate():.3f}")
        lines += ["# HELP z2all_sequences_finished_total sequences ended, by finish reason",
                  "# TYPE z2all_sequences_finished_total counter"]
        lines += [f'z2all_sequences_finished_total{{reason="{r}"}} {n}' for r, n in sorted(s["finished"].items())]
        lines += ["# HELP z2all_http_requests_total HTTP requests answered, by route and status",
                  "# TYPE z2all_http_requests_total counter"]
        lines += [f'z2all_http_requests_total{{route="{r}",status="{c}"}} {n}'
                  for (r, c), n in sorted(self.requests.items())]
        if connections is not None:
            metric("z2all_http_connections_open", "gauge", "client connections open", connections[0])
            metric("z2all_http_connections_busy", "gauge", "connections whose request is being answered",
                    connections[1])
        metric("z2all_draining", "gauge", "1 while shutting down", int(not app.accepting))
        for h in (self.ttft, self.itl, self.latency):
            lines += h.lines()
        return "\n".join(lines) + "\n"


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


def key_matches(header: str | bytes, expected: bytes) -> bool:
    """``Authorization: Bearer KEY`` with the right key (compared in constant time, so the time taken says nothing
    of how much of a guess was right)."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    scheme, _, given = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("latin-1", "replace"), expected)


def needs_key(method: str, path: str) -> bool:
    """Which requests the key guards: every /v1 route, and any POST."""
    return method == "POST" or path.startswith("/v1")


def _sse(chunks: list[dict | bytes]) -> bytes:
    """Server-sent events, one ``data:`` line per chunk (a dict, or its JSON already encoded)."""
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


class ChunkTemplate:
    """``json.dumps(make(index, text)).encode()`` for a streamed chunk whose only varying field is ``text``, without
    building and encoding the dict per token: the JSON of one chunk per index, made once with a marker for the
    text, split around the marker; a token's chunk is then head + the text's JSON string + tail (the same bytes:
    ``json.dumps`` encodes a string with the same function, and the dict's other fields do not change)."""

    MARK = "\x00z2all\x01"

    def __init__(self, make):
        self.make, self.parts = make, {}

    def __call__(self, index: int, text: str) -> bytes:
        parts = self.parts.get(index)
        if parts is None:
            whole, quoted = json.dumps(self.make(index, self.MARK)), json.dumps(self.MARK)
            if whole.count(quoted) != 1:  # the marker elsewhere too (it cannot be in generated text): no template
                return json.dumps(self.make(index, text)).encode()
            head, tail = whole.split(quoted)
            parts = self.parts[index] = (head.encode(), tail.encode())
        return parts[0] + _json_string(text).encode() + parts[1]


_json_string = json.encoder.encode_basestring_ascii  # what json.dumps (ensure_ascii) writes for a str


def _json(err: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers={**err.headers, **(headers or {})})


def raw_error(err: RequestError, headers: dict | None = None) -> bytes:
    """A whole HTTP/1.1 error response, for the protocol layer (before or outside any request) and closing."""
    body = json.dumps(err.body()).encode()
    head = [f"HTTP/1.1 {err.status} {_phrase(err.status)}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in {**err.headers, **(headers or {})}.items()),
            "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def _phrase(status: int) -> str:
    from http import HTTPStatus
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


KEY_REFUSED = ("a valid API key is required: send the header 'Authorization: Bearer KEY' with the key this server "
               "was started with")
KNOWN_METHODS = {"GET", "HEAD", "POST", "OPTIONS", "PUT", "DELETE", "PATCH", "TRACE", "CONNECT"}
LABELLED = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json", "/"}


class _Deadline(Exception):
    """The request's body did not arrive in time."""


class _Gone(Exception):
    """The client went away."""


def make_app(app: InferenceApp, api_key: str | None = None, cors_origin: str | None = None,
             read_timeout: float = READ_TIMEOUT, quiet: bool = False, connections=None):
    """The ASGI app serving ``app``: Starlette routes behind a guard for what every request shares (HTTP version,
    method, API key, CORS, the access log, the request counts of ``/metrics``). ``api_key``: required as
    ``Authorization: Bearer KEY`` on every /v1 route. ``cors_origin``: the one other origin whose pages may call the
    API (None: no CORS header at all). ``connections`` (a callable giving (open, busy)) feeds ``/metrics``."""
    expected = api_key.encode() if api_key else None
    metrics = app.metrics
    schema = api.openapi("zero2all", _version())

    def deadline_of(request: Request) -> float:
        return request.scope.get("extensions", {}).get("zero2all.deadline") or (time.monotonic() + read_timeout)

    async def read_body(request: Request) -> dict:
        """The JSON body, read under the request's deadline (the protocol's, from the request's first byte)."""
        ctype = request.headers.get("content-type")
        media = (ctype or "").partition(";")[0].strip().lower()
        if ctype is not None and media != "application/json" and not media.endswith("+json"):
            raise RequestError(415, f"Content-Type {show(ctype)} is not supported: send the body as JSON with "
                                    "'Content-Type: application/json'", "Content-Type", "unsupported_media_type")
        length = request.headers.get("content-length")
        if length is None and "chunked" not in request.headers.get("transfer-encoding", "").lower():
            raise RequestError(411, "a Content-Length header is required")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                raise RequestError(400, f"bad Content-Length {length!r}") from None
            if n > MAX_BODY_BYTES:
                raise RequestError(413, f"request body of {n} bytes is over the limit of {MAX_BODY_BYTES}")
        deadline = deadline_of(request)
        raw = bytearray()
        receive = request.receive
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except (TimeoutError, asyncio.TimeoutError):
                raise RequestError(408, f"the request did not arrive within the read timeout of {read_timeout:g} s",
                                   code="request_timeout") from None
            if message["type"] == "http.disconnect":
                raise _Gone
            raw += message.get("body", b"")
            if len(raw) > MAX_BODY_BYTES:
                raise RequestError(413, f"request body over the limit of {MAX_BODY_BYTES} bytes")
            if not message.get("more_body"):
                break
        try:
            body = json.loads(raw)
        # ValueError: an integer too long to convert; RecursionError: nesting too deep
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise RequestError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        return body

    async def generate(request: Request):
        kind = "chat" if request.url.path == "/v1/chat/completions" else "completion"
        with app.tracked():
            try:
                body = await read_body(request)
            except RequestError as e:  # the body may be unread: the connection cannot be reused; say so
                return _json(e, {"Connection": "close"})
            except _Gone:
                return Response(status_code=499)  # nobody reads it
            try:
                if needs_grammar(body):  # compiling a new schema can take a while: not on the event loop
                    job = await asyncio.to_thread(app.submit, kind, body)
                else:
                    job = app.submit(kind, body)
            except RequestError as e:
                return _json(e)
            app.metrics.prompt_tokens += sum(len(p) for p in job.prompts)  # metrics change on the event loop only
            if job.stream:
                return await EventStream.start(app, job, request, read_timeout)
            watch = asyncio.ensure_future(_on_disconnect(request.receive, job.sub.cancel))
            try:
                return JSONResponse(await app.complete(job))
            except Exception as e:  # noqa: BLE001 - an error in generation still answers in JSON
                return _json(RequestError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))
            finally:
                watch.cancel()

    async def models(request: Request):
        return JSONResponse(app.models())

    async def health(request: Request):
        status, body = app.health()
        return JSONResponse(body, status)

    async def prometheus(request: Request):
        return Response(metrics.render(app, connections() if connections else None),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(request: Request):
        return JSONResponse(schema)

    def page(name: str, content_type: str):
        async def serve_file(request: Request):
            return Response(page_file(name), headers={**PAGE_HEADERS, "Content-Type": content_type})
        return serve_file

    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code == 405:
            allowed = exc.headers.get("Allow", "") if exc.headers else ""
            return _json(RequestError(405, f"method {request.method} is not allowed on {request.url.path}; use "
                                           f"{allowed}", code="method_not_allowed"), {"Allow": allowed})
        if exc.status_code == 404:
            return _json(RequestError(404, f"no such path {request.url.path}", kind="not_found_error"),
                         {"Connection": "close"} if request.method == "POST" else None)
        return _json(RequestError(exc.status_code, str(exc.detail)))

    routes = [Route(path, page(name, ctype), methods=["GET"]) for path, (name, ctype) in PAGE_FILES.items()]
    routes += [Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
               Route("/metrics", prometheus, methods=["GET"]), Route("/openapi.json", openapi, methods=["GET"]),
               Route("/v1/completions", generate, methods=["POST"]),
               Route("/v1/chat/completions", generate, methods=["POST"])]
    inner = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    inner.router.redirect_slashes = False
    allowed = "GET, HEAD, POST" + (", OPTIONS" if cors_origin else "")
    log = None if quiet else _access_log

    async def guard(scope, receive, send):
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        method, path = scope["method"], scope["path"]
        if path != "/" and path.endswith("/"):  # /v1/models/ is /v1/models
            scope = {**scope, "path": path.rstrip("/") or "/"}
            path = scope["path"]
        route = path if path in LABELLED else "other"  # a fixed set of labels, whatever paths clients send
        status = []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                if cors_origin and path.startswith("/v1"):
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"access-control-allow-origin", cors_origin.encode()),
                                                      (b"vary", b"Origin")]}
            await send(message)

        try:
            err = None
            if scope.get("http_version") not in ("1.0", "1.1"):
                err = RequestError(505, f"HTTP version {scope.get('http_version')} is not supported: use HTTP/1.1",
                                   headers={"Connection": "close"})
            elif method not in KNOWN_METHODS:
                err = RequestError(501, f"unsupported method {show(method)}", headers={"Connection": "close"})
            elif method == "OPTIONS" and cors_origin and path.startswith("/v1") and \
                    _header(scope, b"origin") == cors_origin.encode():
                return await Response(status_code=204, headers={
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": "Authorization, Content-Type",
                    "Access-Control-Max-Age": "600"})(scope, receive, sending)
            elif method not in ("GET", "HEAD", "POST"):
                why = (" (OPTIONS is answered only as a CORS preflight from the origin set by --cors-origin)"
                       if method == "OPTIONS" else "")
                err = RequestError(405, f"method {method} is not allowed here{why}; use {allowed}",
                                   code="method_not_allowed", headers={"Allow": allowed, "Connection": "close"})
            elif expected is not None and needs_key(method, path) and \
                    not key_matches(_header(scope, b"authorization") or b"", expected):
                close = {"Connection": "close"} if method == "POST" else {}  # the body stays unread
                err = RequestError(401, KEY_REFUSED, code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer", **close})
            if err is not None:
                return await _json(err)(scope, receive, sending)
            await inner(scope, receive, sending)
        finally:
            code = status[0] if status else 499
            metrics.requests[(route, code)] += 1
            if log is not None:
                log(scope, code)

    return guard


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def _access_log(scope, status: int):
    client = scope.get("client") or ("-", 0)
    sys.stderr.write(f'[serve] {client[0]} "{scope["method"]} {scope["path"]} HTTP/{scope["http_version"]}" '
                     f"{status}\n")


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("zero2all")
    except Exception:  # noqa: BLE001 - not installed (a source tree on the path)
        return "0"


async def _on_disconnect(receive, callback):
    """Calls ``callback`` when the client goes away (the request's body is read by then)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            callback()
            return


class EventStream:
    """A streamed answer (server-sent events) as an ASGI response: each list of chunks in one write, a write that
    the client does not take within ``write_timeout`` seconds ends the stream (and cancels the request), and a
    client that goes away cancels it at once."""

    def __init__(self, app: InferenceApp, job: _Job, chunks, first: list[dict], write_timeout: float):
        self.app, self.job, self.chunks, self.first, self.write_timeout = app, job, chunks, first, write_timeout

    @classmethod
    async def start(cls, app: InferenceApp, job: _Job, request: Request, write_timeout: float):
        """The first chunks are drawn before the 200 goes out, so that a model error can still be a 500."""
        chunks = app.chunks(job)
        watch = asyncio.ensure_future(_on_disconnect(request.receive, job.sub.cancel))
        try:
            first = await chunks.__anext__()
        except Exception as e:  # noqa: BLE001
            watch.cancel()
            await chunks.aclose()
            return _json(RequestError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))
        stream = cls(app, job, chunks, first, write_timeout)
        stream.watch = watch
        return stream

    async def __call__(self, scope, receive, send):
        async def write(data: bytes, more: bool = True):
            message = {"type": "http.response.body", "body": data, "more_body": more}
            try:
                if hasattr(asyncio, "timeout"):  # Python 3.11+: a timer, no task per write
                    async with asyncio.timeout(self.write_timeout):
                        await send(message)
                else:
                    await asyncio.wait_for(send(message), self.write_timeout)
            except (TimeoutError, asyncio.TimeoutError):
                self.job.sub.cancel()
                raise _Gone("the client does not read") from None

        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            await write(_sse(self.first))
            try:
                async for batch in self.chunks:
                    await write(_sse(batch))
            except Exception as e:  # noqa: BLE001 - the 200 is out: the error goes into the stream
                if isinstance(e, _Gone):
                    raise
                err = RequestError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
                await write(b"data: " + json.dumps(err.body()).encode() + b"\n\n", more=False)
                return
            await write(b"data: [DONE]\n\n", more=False)
        finally:
            self.watch.cancel()
            await self.chunks.aclose()  # a client that went away stops the generation


# -- the HTTP/1.1 protocol with limits ----------------------------------------------------------------------------

class _Connections:
    """The server's open connections: the cap, the eviction of the longest-waiting idle one, the counts."""

    def __init__(self, max_connections: int, read_timeout: float, api_key: str | None, cors_origin: str | None):
        if not read_timeout > 0:
            raise ValueError(f"read_timeout must be > 0 seconds, got {read_timeout}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections, self.read_timeout = max_connections, float(read_timeout)
        self.expected = api_key.encode() if api_key else None
        self.cors_origin = cors_origin
        self.open: dict = {}  # protocol -> None, in the order they came

    def admit(self, conn: "_Protocol") -> bool:
        if len(self.open) >= self.max_connections:
            idle = [c for c in self.open if c.reading]
            if not idle:
                return False
            min(idle, key=lambda c: c.since).evict()
        self.open[conn] = None
        return True

    def counts(self) -> tuple[int, int]:
        return len(self.open), sum(not c.reading for c in self.open)


LINGER_S = 2.0   # how long a closing connection waits for the client to stop sending (and close) first


class _LingeringTransport:
    """The protocol's transport, whose ``close`` lets a client that is still sending finish first (a lingering
    close): closing a socket with unread bytes makes the kernel answer them with a reset, and a client that is still
    writing its body may then lose the response just sent (a 401 refused before the body was read, say). So, while a
    request is only partly read, ``close`` sends what is queued and ends the writing side only, the bytes that still
    come are discarded, and the socket closes when the client closes its side or after ``LINGER_S``."""

    def __init__(self, transport, protocol: "_Protocol"):
        self._transport, self._protocol, self.lingering = transport, protocol, False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self):
        t, proto = self._transport, self._protocol
        if self.lingering or t.is_closing():
            return
        if not proto.partly_read() or not t.can_write_eof():
            t.close()
            return
        self.lingering = proto.refused = True   # the protocol discards whatever still arrives
        t.write_eof()
        t.resume_reading()
        proto._stop_timer()
        proto._timer = proto.loop.call_later(LINGER_S, t.close)


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11) with what a server facing the open network needs and uvicorn leaves out:

    * a deadline for each whole request: the wait for it (a kept-alive connection idling), its request line, its
      headers and its body must arrive within ``read_timeout`` seconds of the wait's start; a client that stops
      half-way, or trickles one byte at a time, is closed at the deadline (the app answers a half-sent body with
      408, reading it under the same deadline: ``scope["extensions"]["zero2all.deadline"]``);
    * at most ``max_connections`` open (:class:`_Connections`): a new one past that closes the one that has waited
      longest for its request, or gets 503 when every connection is being answered;
    * the API key checked as soon as its header line arrives: a wrong one is refused with 401 before the other
      headers and the body are read;
    * malformed requests answered in JSON, with the status h11 suggests (431 for headers too long).
    """

    def __init__(self, config, server_state, app_state, _loop=None, *, pool: _Connections):
        super().__init__(config, server_state, app_state, _loop)
        self.pool = pool
        self.since = time.monotonic()
        self.deadline = self.since + pool.read_timeout
        self.evicted = self.refused = False
        self._timer: asyncio.TimerHandle | None = None
        self._head = b""       # the current request's head so far, while it has not ended
        self._head_done = self._key_checked = False
        inner = self.app

        async def with_deadline(scope, receive, send):
            scope.setdefault("extensions", {})["zero2all.deadline"] = self.deadline
            await inner(scope, receive, send)

        self.app = with_deadline

    @property
    def reading(self) -> bool:
        """Waiting for (part of) a request, as opposed to being answered."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or (cycle.more_body and not cycle.response_started)

    def connection_made(self, transport):
        super().connection_made(transport)
        self.raw = transport                                    # closed at once: a deadline, an eviction
        self.transport = _LingeringTransport(transport, self)   # uvicorn's code and its request cycles close this one
        if not self.pool.admit(self):
            self.refused = True
            err = RequestError(503, f"the server has {self.pool.max_connections} connections being answered, its "
                                    "most; try again shortly", kind="server_error", code="too_many_connections",
                               headers={"Retry-After": "1"})
            transport.write(raw_error(err))
            transport.close()
            return
        self._await_request()

    def connection_lost(self, exc):
        self.pool.open.pop(self, None)
        self._stop_timer()
        super().connection_lost(exc)

    def evict(self):
        self.evicted = True
        self.pool.open.pop(self, None)
        self.raw.close()

    def _await_request(self):
        """A (next) request is awaited: its deadline starts now."""
        self.since = time.monotonic()
        self.deadline = self.since + self.pool.read_timeout
        self._head, self._head_done, self._key_checked = b"", False, False
        self._stop_timer()
        self._timer = self.loop.call_later(self.pool.read_timeout, self._late)

    def partly_read(self) -> bool:
        """Whether the client may still be sending this request: its head began and did not end, or its body is
        not all read."""
        return bool(self._head) or self.conn.their_state is h11.SEND_BODY

    def _stop_timer(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self):
        """The deadline passed: a connection still waiting for its request's head is closed; one whose body is
        half-sent is the app's to answer (408), closed here a second later if it has not been."""
        self._timer = None
        if self.transport.is_closing() or not self.reading:
            return
        if self.conn.their_state is h11.IDLE or self.cycle is None or self.cycle.response_complete:
            self.raw.close()
        else:
            self._timer = self.loop.call_later(1.0, self.raw.close)

    def data_received(self, data: bytes):
        if self.refused or self.evicted:
            return
        if self.conn.their_state is h11.IDLE and not self._head_done and not self._check_head(data):
            return
        super().data_received(data)
        if self.cycle is not None and not self.cycle.more_body and not self.reading:
            self._stop_timer()  # the whole request is in: the deadline no longer applies

    def _check_head(self, data: bytes) -> bool:
        """Looks at the request's head (request line and headers) as it arrives; False, with the error sent and the
        connection closing, when it grows past ``MAX_HEAD_BYTES`` (431) or as soon as a wrong ``Authorization``
        line is complete on a request that needs the key (401)."""
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        head = self._head if end < 0 else self._head[:end + 2]
        if len(head) > MAX_HEAD_BYTES:
            return self._refuse(RequestError(431, f"the request's line and headers are over {MAX_HEAD_BYTES} bytes",
                                             code="headers_too_large"))
        if self.pool.expected is not None and not self._key_checked:
            lines = head.lstrip(b"\r\n").split(b"\n")
            if len(lines) >= 2:
                parts = lines[0].split()
                method, target = (parts[0].decode("latin-1"), parts[1].decode("latin-1")) if len(parts) >= 2 \
                    else ("", "")
                if not needs_key(method, target):
                    self._key_checked = True
                for line in lines[1:-1]:  # the complete header lines
                    if self._key_checked:
                        break
                    if line[:14].lower() == b"authorization:":
                        self._key_checked = True
                        if not key_matches(line[14:], self.pool.expected):
                            cors = self.pool.cors_origin
                            extra = {"Access-Control-Allow-Origin": cors, "Vary": "Origin"} if cors and \
                                target.startswith("/v1") else {}
                            return self._refuse(RequestError(401, KEY_REFUSED, code="invalid_api_key",
                                                             headers={"WWW-Authenticate": "Bearer", **extra}))
        if end >= 0:
            self._head_done, self._head = True, b""
        return True

    def _refuse(self, err: RequestError) -> bool:
        """Answer with ``err`` outside any request (the head was not all read) and close."""
        self.transport.write(raw_error(err))
        self.refused = True
        self._stop_timer()
        self.transport.close()
        return False

    def send_400_response(self, msg: str):
        """What h11 refuses (called while its error is being handled), in JSON with the status it suggests."""
        exc = sys.exc_info()[1]
        status = getattr(exc, "error_status_hint", 400) or 400
        what = {431: "the request's headers are too long"}.get(status, "malformed request")
        self._refuse(RequestError(status, f"{what}: {exc or msg}"))

    def on_response_complete(self):
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_request()


class HTTPServer:
    """uvicorn serving an ASGI app on a socket bound at construction (``port=0`` picks a free port:
    ``server_address``). ``serve_forever`` runs the event loop in the calling thread; ``shutdown`` (from another
    thread) ends it after the connections close; ``stop_listening`` closes the listening socket only."""

    def __init__(self, address: tuple[str, int], asgi, pool: _Connections, quiet: bool = False):
        self.pool = pool
        self.read_timeout, self.max_connections = pool.read_timeout, pool.max_connections
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(2048)
        except BaseException:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        self.config = Config(asgi, http=functools.partial(_Protocol, pool=pool), lifespan="off", log_config=None,
                             log_level=logging.CRITICAL if quiet else logging.ERROR, access_log=False,
                             timeout_keep_alive=int(math.ceil(pool.read_timeout)) + 1,
                             h11_max_incomplete_event_size=MAX_HEAD_BYTES, server_header=False,
                             timeout_graceful_shutdown=5)
        self.uvicorn = Uvicorn(self.config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started, self._done = threading.Event(), threading.Event()

    @property
    def open_connections(self) -> int:
        return self.pool.counts()[0]

    @property
    def busy_connections(self) -> int:
        """Connections whose request is being answered."""
        return self.pool.counts()[1]

    def serve_forever(self):
        try:
            asyncio.run(self._serve())
        finally:
            self._done.set()

    async def _serve(self):
        self.loop = asyncio.get_running_loop()
        self._started.set()
        await self.uvicorn.serve(sockets=[self.socket])

    def stop_listening(self):
        """New connections are refused from now on; the open ones go on."""
        if self._started.wait(5) and self.loop is not None and not self._done.is_set():
            done = threading.Event()

            def close():
                for s in getattr(self.uvicorn, "servers", []):
                    s.close()
                done.set()

            try:
                self.loop.call_soon_threadsafe(close)
                done.wait(5)
            except RuntimeError:  # the loop already ended
                pass
        try:
            self.socket.close()
        except OSError:
            pass

    def shutdown(self):
        """End ``serve_forever`` (the open connections are closed once their responses are out)."""
        self.uvicorn.should_exit = True
        if self._started.is_set():
            self._done.wait(30)

    def server_close(self):
        self.stop_listening()


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
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except (OSError, OverflowError) as e:
        raise address_error(e, host, port) from None


def create_server(ckpt: str | Path, host: str = "127.0.0.1", port: int = 8000, tokenizer=None,
                  model_name: str | None = None, device: str = "auto", dtype: str = "auto",
                  max_tokens_limit: int = 1024, max_queue: int = 64, max_batch: int | None = None,
                  cuda_graph: bool | None = None, compile: bool = False, quiet: bool = False,
                  cache_len: int | None = None, api_key: str | None = None, cors_origin: str | None = None,
                  read_timeout: float = READ_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                  engine_options: dict | None = None, draft_model: str | Path | None = None
                  ) -> tuple[HTTPServer, InferenceApp]:
    """Load the checkpoint and bind the server (``port=0`` picks a free port: ``server.server_address``).

    ``tokenizer`` None loads ``zero2all.tokenizer.load_tokenizer(ckpt)``; ``api_key``, ``cors_origin``: see
    :func:`make_app`; ``read_timeout`` and ``max_connections``: see :class:`_Protocol`. ``draft_model``: a
    checkpoint directory of a smaller model sharing the tokenizer, for speculative decoding (checked, then loaded
    on the same device in the same dtype; ``engine_options["speculative_tokens"]`` draft tokens a step, default 4)."""
    from zero2all.infer.generate import load_for_inference

    if draft_model is not None:
        from zero2all.infer.speculative import check_draft_checkpoint

        check_draft_checkpoint(draft_model, ckpt, tokenizer)
    model, tok = load_for_inference(str(ckpt), device=device, dtype=dtype, tokenizer=tokenizer)
    if draft_model is not None:
        engine_options = dict(engine_options or {})
        engine_options.setdefault("speculative_tokens", 4)
        engine_options["draft_model"], _ = load_for_inference(str(draft_model), device=device, dtype=dtype,
                                                              tokenizer=tok)
    name = model_name or Path(ckpt).resolve().name
    generator = Generator(model, tok, cuda_graph=cuda_graph, compile=compile)
    return bind(InferenceApp(generator, name, max_tokens_limit=max_tokens_limit, max_queue=max_queue,
                             max_batch=max_batch, cache_len=cache_len, engine_options=engine_options), host, port,
                quiet, api_key, cors_origin,
                read_timeout, max_connections)


def bind(app: InferenceApp, host: str = "127.0.0.1", port: int = 8000, quiet: bool = False,
         api_key: str | None = None, cors_origin: str | None = None, read_timeout: float = READ_TIMEOUT,
         max_connections: int = MAX_CONNECTIONS) -> tuple[HTTPServer, InferenceApp]:
    """An HTTP server for an app (not yet serving: ``serve_forever`` or :func:`run_server`)."""
    pool = _Connections(max_connections, read_timeout, api_key, cors_origin)
    asgi = make_app(app, api_key=api_key, cors_origin=cors_origin, read_timeout=read_timeout, quiet=quiet,
                    connections=pool.counts)
    try:
        return HTTPServer((host, port), asgi, pool, quiet), app
    except (OSError, OverflowError) as e:
        raise address_error(e, host, port) from None


def shutdown(httpd: HTTPServer, app: InferenceApp, drain_timeout: float = 30.0,
             hurry: threading.Event | None = None) -> int:
    """Stop accepting, let requests finish for up to ``drain_timeout`` seconds (less once ``hurry`` is set), cancel
    the rest, stop. Call it while ``serve_forever`` runs in another thread. Returns the exit status: 0, or
    ``EXIT_CANCELLED`` when requests were cancelled."""
    app.scheduler.stop_accepting()     # from now on a request on an open connection gets 503
    httpd.stop_listening()             # and new connections are refused
    deadline = time.monotonic() + drain_timeout
    while app.scheduler.busy() and time.monotonic() < deadline and not (hurry is not None and hurry.is_set()):
        app.scheduler.wait_idle(min(0.2, max(0.0, deadline - time.monotonic())))
    cancelled = app.scheduler.drain(0.0)
    app.wait_responses(5.0)            # the streams write their last chunks
    httpd.shutdown()                   # the event loop ends once the connections are closed
    app.close()
    print(f"stopped: {cancelled} request(s) cancelled after the drain timeout of {drain_timeout:g} s"
          if cancelled else "stopped: every request finished", file=sys.stderr, flush=True)
    return EXIT_CANCELLED if cancelled else 0


def run_server(httpd: HTTPServer, app: InferenceApp, drain_timeout: float = 30.0,
               signals=(signal.SIGTERM, signal.SIGINT)) -> int:
    """Serve until one of ``signals`` arrives, then :func:`shutdown` (a second signal cancels at once). Run it in
    the main thread (signal handlers live there); the event loop runs in a thread of its own. Returns the exit
    status."""
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum, frame):
        (hurry if stop.is_set() else stop).set()

    previous = {s: signal.signal(s, on_signal) for s in signals}
    thread = threading.Thread(target=httpd.serve_forever, name="z2all-http", daemon=True)
    thread.start()
    try:
        while not stop.wait(0.5):
            if not thread.is_alive():  # the event loop died: shut down as well
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
    print(f"metrics: http://{h}:{p}/metrics   API description: http://{h}:{p}/openapi.json", flush=True)
    if app.max_tokens_limit > app.context:
        print(f"note: the max_tokens limit {app.max_tokens_limit} is above the model's context of {app.context} "
              "tokens: a request's prompt + max_tokens must fit the context", flush=True)
    return run_server(httpd, app, drain_timeout)
