import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.infer.generate import Generator
from zero2all.infer.server import InferenceApp, bind, create_server
from zero2all.model.io import save_model
from zero2all.model.z2all import build_model

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("srv") / "tiny-chat"
    save_model(build_model(tiny_model_config(max_seq_len=96, initializer_range=0.3), seed=0), ckpt)
    httpd, app = create_server(ckpt, port=0, tokenizer=TOK, device="cpu", max_tokens_limit=32, max_queue=1,
                               quiet=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    host, port = httpd.server_address[:2]
    with httpx.Client(base_url=f"http://{host}:{port}", timeout=60) as client:
        yield client, app
    httpd.shutdown()
    httpd.server_close()
    app.close()


def sse_events(response):
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_models(server):
    client, app = server
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert r.json()["data"][0]["id"] == "tiny-chat" == app.model_name


def test_chat_completion_happy_path(server):
    client, app = server
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
            "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    prompt = TOK.apply_chat_template(body["messages"], add_generation_prompt=True)
    expected = app.generator.generate([prompt], max_new_tokens=12, temperature=0)[0]
    assert out["choices"][0]["message"]["content"] == expected.text
    assert out["choices"][0]["finish_reason"] == expected.finish_reason
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["usage"]["completion_tokens"] == expected.num_generated


def test_completion_batch_and_streaming_agree(server):
    client, _ = server
    body = {"model": "tiny-chat", "prompt": ["def f(x):", "import"], "max_tokens": 10, "temperature": 0.8,
            "seed": 7, "top_k": 20}
    plain = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    assert plain["usage"]["prompt_tokens"] == len("def f(x):") + len("import") + 2  # each after a separator
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(r)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == plain["choices"][i]["text"]
        assert mine[-1]["finish_reason"] == plain["choices"][i]["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])


def test_chat_streaming(server):
    client, _ = server
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = sse_events(r)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    plain = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert text == plain["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
        last = sse_events(r)[-1]
    assert last["choices"] == [] and last["usage"] == plain["usage"]


def test_stop_string(server):
    client, _ = server
    base = {"model": "tiny-chat", "prompt": "abc", "max_tokens": 20, "temperature": 0}
    free = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    windows = [free[i:i + 2] for i in range(1, len(free) - 2) if "\ufffd" not in free[i:i + 2]]
    assert windows, f"no clean two-character window in {free!r}"
    stop = windows[0]
    out = client.post("/v1/completions", json={**base, "stop": stop}).json()["choices"][0]
    assert out["text"] == free[:free.find(stop)] and out["finish_reason"] == "stop"


def test_omitted_max_tokens_fits_the_context(server):
    """Without max_tokens the default budget is cut to what the prompt leaves of the context (here 96 tokens, a
    limit of 32): a 80-token prompt still gets an answer; an explicit max_tokens that does not fit is refused."""
    client, _ = server
    body = {"model": "tiny-chat", "prompt": "x" * 79, "temperature": 0}   # + the end-of-text separator = 80
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 96 - 80
    r = client.post("/v1/completions", json={**body, "max_tokens": 32})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, payload, status, needle", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": "x"}, 400, "'model'"),
    ("/v1/completions", {"model": None, "prompt": "x"}, 400, "missing required field 'model'"),
    ("/v1/chat/completions", {"model": "tiny-chat", "messages": None}, 400, "missing required field 'messages'"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": None}, 400, "missing required field 'prompt'"),
    ("/v1/completions", {"model": "tiny-chat"}, 400, "'prompt'"),
    ("/v1/chat/completions", {"model": "tiny-chat"}, 400, "'messages'"),
    ("/v1/chat/completions", {"model": "tiny-chat", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "max_tokens": 33}, 400, "limit of 32"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x" * 80, "max_tokens": 32}, 400, "context"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/nothing", {"model": "tiny-chat"}, 404, "no such path"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}],
                              "functions": [{"name": "f"}]}, 400, "send 'tools'"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "tools": [{"type": "function"}]}, 400, "chat"),
    ("/v1/chat/completions", {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "'type' is one of"),
])
def test_request_errors(server, path, payload, status, needle):
    client, _ = server
    if isinstance(payload, bytes):
        r = client.post(path, content=payload, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    if isinstance(payload, bytes) or path == "/v1/nothing":  # the server closes the connection: say so
        assert r.headers.get("connection") == "close"


# -- the scheduler behind the server: concurrency, queueing, cancellation, validation --------------------------


@contextmanager
def serving(app):
    """Serve ``app`` on a free loopback port for the block; yields the base URL."""
    httpd, _ = bind(app, port=0, quiet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    host, port = httpd.server_address[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        app.close()


def wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def completion_reference(generator, prompt: str, max_tokens: int, **kw):
    """What one prompt gives alone (greedy unless told), as the server builds it: end-of-text, then the text."""
    return generator.generate([[TOK.eos_id] + TOK.encode(prompt)], max_new_tokens=max_tokens,
                              **{"temperature": 0, **kw})[0]


def stream_completion(base: str, body: dict, path: str = "/v1/completions") -> dict:
    """One streamed request on its own connection: status, text, finish reasons, usage and chunk ids."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=base, timeout=120) as c:
        with c.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                return {"status": r.status_code, "error": r.json()["error"], "headers": dict(r.headers)}
            chunks = sse_events(r)
    choices = [ch["choices"][0] for ch in chunks if ch["choices"]]
    text = "".join(c.get("text", c.get("delta", {}).get("content", "")) or "" for c in choices)
    return {"status": 200, "text": text, "finish": [c["finish_reason"] for c in choices if c["finish_reason"]],
            "usage": chunks[-1]["usage"], "ids": {ch["id"] for ch in chunks}}


def run_threads(fn, args_list):
    results = [None] * len(args_list)

    def call(i):
        results[i] = fn(*args_list[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(args_list))]
    for t in threads:
        t.start()
    return threads, results


def test_busy_server_answers_429(server):
    """The queue is full when max_batch sequences run and max_queue wait: the next request gets 429 at once."""
    client, app = server
    assert app.scheduler.wait_idle(10)
    capacity = app.max_batch + app.max_queue
    body = {"model": "tiny-chat", "prompt": "x", "max_tokens": 2}
    with app.scheduler.paused():
        threads, results = run_threads(lambda: client.post("/v1/completions", json=body).status_code,
                                       [()] * capacity)
        wait_for(lambda: app.scheduler.stats()["waiting"] == capacity)
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    for t in threads:
        t.join()
    assert results == [200] * capacity
    assert client.post("/v1/completions", json=body).status_code == 200


def test_concurrent_requests_queue_and_all_succeed(server):
    client, app = server
    assert app.scheduler.wait_idle(10)
    threads, results = run_threads(
        lambda seed: client.post("/v1/completions", json={"model": "tiny-chat", "prompt": "q", "max_tokens": 6,
                                                          "seed": seed}).status_code, [(0,), (1,)])
    for t in threads:
        t.join()
    assert results == [200, 200]


def test_64_concurrent_streams_each_get_their_own_text(server):
    """64 streaming clients at once, 8 batch rows: no error, and every client gets exactly its own stream (its own
    prompt's usage and the greedy text of its prompt alone), whatever else shared the batch."""
    _, base_app = server
    gen = base_app.generator
    app = InferenceApp(gen, "tiny-chat", max_tokens_limit=32, max_queue=64, max_batch=8)
    text = "the quick brown fox jumps over the lazy dog " * 3
    prompts = [(f"client {i:02d}: " + text)[:4 + i] for i in range(64)]   # distinct lengths, distinct usage
    refs = [completion_reference(gen, p, 8) for p in prompts]
    with serving(app) as base:
        with app.scheduler.paused():  # every request is queued before the first step: the batches are full
            threads, results = run_threads(stream_completion, [
                (base, {"model": "tiny-chat", "prompt": p, "max_tokens": 8, "temperature": 0}) for p in prompts])
            wait_for(lambda: app.scheduler.stats()["waiting"] == 64)
        for t in threads:
            t.join()
        stats = app.scheduler.stats()
    for p, ref, r in zip(prompts, refs, results):
        assert r["status"] == 200, r
        assert r["text"] == ref.text and r["finish"] == [ref.finish_reason]
        assert r["usage"]["prompt_tokens"] == len(p) + 1 and r["usage"]["completion_tokens"] == ref.num_generated
        assert len(r["ids"]) == 1
    assert len(set.union(*(r["ids"] for r in results))) == 64
    assert stats["steps"] < sum(ref.num_generated for ref in refs) / 2  # rows really shared the steps
    assert stats["finished"].get("cancelled", 0) == 0


def test_overflow_gets_429_and_the_rest_succeed(server):
    """2 rows + 2 waiting: of 7 simultaneous requests 3 get 429 with Retry-After, 4 complete correctly."""
    _, base_app = server
    gen = base_app.generator
    app = InferenceApp(gen, "tiny-chat", max_tokens_limit=32, max_queue=2, max_batch=2)
    prompts = [f"request number {i}" for i in range(7)]
    with serving(app) as base:
        with app.scheduler.paused():
            threads, results = run_threads(stream_completion, [
                (base, {"model": "tiny-chat", "prompt": p, "max_tokens": 6, "temperature": 0}) for p in prompts])
            wait_for(lambda: sum(r is not None for r in results) == 3 and app.scheduler.stats()["waiting"] == 4)
        for t in threads:
            t.join()
    refused = [r for r in results if r["status"] == 429]
    assert len(refused) == 3
    assert all(r["headers"]["retry-after"] == "1" and r["error"]["type"] == "rate_limit_error" for r in refused)
    served = [(p, r) for p, r in zip(prompts, results) if r["status"] == 200]
    assert len(served) == 4
    for p, r in served:
        assert r["text"] == completion_reference(gen, p, 6).text


@pytest.fixture(scope="module")
def long_generator():
    """A tiny model with a 512-token context, for requests that run long."""
    return Generator(build_model(tiny_model_config(max_seq_len=512, initializer_range=0.3), seed=1).eval(), TOK)


def test_disconnect_cancels_and_later_requests_join_and_leave(long_generator, monkeypatch):
    """A client that drops its stream cancels it (its row is freed: it never reaches its 400 tokens); then
    requests of different lengths and budgets, streamed or not, share 2 rows and each matches its prompt alone."""
    gen = long_generator
    app = InferenceApp(gen, "long", max_tokens_limit=400, max_queue=16, max_batch=2)
    decode = app.scheduler.session.decode

    def slow_decode(tokens, slot):  # the long request cannot finish before the client leaves
        time.sleep(0.002)
        return decode(tokens, slot)

    monkeypatch.setattr(app.scheduler.session, "decode", slow_decode)
    with serving(app) as base:
        with httpx.Client(base_url=base, timeout=60) as c:
            body = {"model": "long", "prompt": "never ending", "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                assert next(line for line in r.iter_lines() if line).startswith("data: ")
        wait_for(lambda: app.scheduler.stats()["finished"].get("cancelled") == 1)
        stats = app.scheduler.stats()
        assert stats["running"] == 0 and stats["steps"] < 400
        monkeypatch.setattr(app.scheduler.session, "decode", decode)

        jobs = [("a short one", 20, False), ("x", 3, True), ("a much longer prompt than the others " * 4, 40, True),
                ("mid", 11, False), ("the fifth request", 25, True)]

        def call(prompt, max_tokens, stream):
            body = {"model": "long", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            if stream:
                return stream_completion(base, body)
            with httpx.Client(base_url=base, timeout=60) as c:
                out = c.post("/v1/completions", json=body).json()
            return {"status": 200, "text": out["choices"][0]["text"], "finish": [out["choices"][0]["finish_reason"]]}

        threads, results = run_threads(call, jobs)
        for t in threads:
            t.join()
    for (prompt, max_tokens, _), r in zip(jobs, results):
        ref = completion_reference(gen, prompt, max_tokens)
        assert r["status"] == 200 and r["text"] == ref.text and r["finish"] == [ref.finish_reason]


def test_seeded_request_is_the_same_alone_and_in_a_busy_batch(server):
    _, base_app = server
    app = InferenceApp(base_app.generator, "tiny-chat", max_tokens_limit=32, max_queue=16, max_batch=4)
    seeded = {"model": "tiny-chat", "prompt": "roll the dice", "max_tokens": 24, "temperature": 1.0, "top_p": 0.9,
              "top_k": 100, "seed": 1234, "ignore_eos": True}
    with serving(app) as base:
        alone = stream_completion(base, seeded)["text"]
        others = [{"model": "tiny-chat", "prompt": f"other {i}", "max_tokens": 10 + 3 * i,
                   "temperature": 0.8 * (i % 2), "seed": i, "repetition_penalty": 1.0 + 0.2 * (i % 3)}
                  for i in range(6)]
        with app.scheduler.paused():
            threads, results = run_threads(stream_completion, [(base, b) for b in others[:3] + [seeded]
                                                               + others[3:] + [seeded]])
            wait_for(lambda: app.scheduler.stats()["waiting"] == 8)
        for t in threads:
            t.join()
    assert all(r["status"] == 200 for r in results)
    assert len(alone) > 0 and results[3]["text"] == alone and results[7]["text"] == alone
    assert results[3]["usage"]["completion_tokens"] == 24


def test_stop_strings_per_request_inside_a_batch(server):
    """Each request's own stop string cuts its own text only, in one batch with requests that have none."""
    _, base_app = server
    gen = base_app.generator
    app = InferenceApp(gen, "tiny-chat", max_tokens_limit=32, max_queue=16, max_batch=8)
    prompts = ["abc", "def f(x):", "import os", "hello there"]
    jobs = []
    for p in prompts:
        free = completion_reference(gen, p, 20, stop_token_ids=[]).text
        windows = [free[i:i + 2] for i in range(1, len(free) - 2) if "\ufffd" not in free[i:i + 2]]
        assert windows, f"no clean two-character window in {free!r}"
        jobs.append((p, windows[len(jobs) % len(windows)], free))
    bodies = [{"model": "tiny-chat", "prompt": p, "max_tokens": 20, "temperature": 0, "stop": stop,
               "ignore_eos": True} for p, stop, _ in jobs]
    bodies += [{"model": "tiny-chat", "prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
               for p, _, _ in jobs]
    with serving(app) as base:
        with app.scheduler.paused():
            threads, results = run_threads(stream_completion, [(base, b) for b in bodies])
            wait_for(lambda: app.scheduler.stats()["waiting"] == len(bodies))
        for t in threads:
            t.join()
    for (p, stop, free), r, plain in zip(jobs, results, results[len(jobs):]):
        assert r["text"] == free[:free.find(stop)] and r["finish"] == ["stop"]
        assert plain["text"] == free and plain["finish"] == ["length"]


@pytest.mark.parametrize("raw, param", [
    (b'"temperature": NaN', "temperature"),
    (b'"temperature": -Infinity', "temperature"),
    (b'"temperature": 1e999', "temperature"),
    (b'"repetition_penalty": NaN', "repetition_penalty"),
    (b'"repetition_penalty": Infinity', "repetition_penalty"),
    (b'"repetition_penalty": 1' + b"0" * 400, "repetition_penalty"),
    (b'"top_p": Infinity', "top_p"),
    (b'"top_p": NaN', "top_p"),
    (b'"top_k": NaN', "top_k"),
    (b'"max_tokens": NaN', "max_tokens"),
    (b'"max_tokens": 1e999', "max_tokens"),
    (b'"max_tokens": 1' + b"0" * 40, "max_tokens"),
    (b'"seed": 1' + b"0" * 40, "seed"),
    (b'"seed": NaN', "seed"),
    (b'"ignore_eos": "yes"', "ignore_eos"),
])
def test_non_finite_and_huge_values_are_400_with_the_field(server, raw, param):
    client, _ = server
    for path, head in (("/v1/completions", b'{"model": "tiny-chat", "prompt": "x", '),
                       ("/v1/chat/completions", b'{"model": "tiny-chat", "messages": [{"role": "user", '
                                                b'"content": "x"}], ')):
        r = client.post(path, content=head + raw + b"}", headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"] and len(err["message"]) < 200


def test_unparsable_numbers_are_400_not_500(server):
    client, _ = server
    r = client.post("/v1/completions", content=b'{"model": "tiny-chat", "prompt": "x", "max_tokens": 1'
                    + b"0" * 5000 + b"}", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/completions", content=b"[" * 100000 + b"]" * 100000,
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_max_tokens_limit_is_kept_as_given():
    """--max-tokens-limit above the context is kept (not lowered to the context behind the operator's back): a
    request may ask up to the limit, and one that does not fit the context is told so; without max_tokens the
    default of 256 applies, cut to the room the prompt leaves."""
    gen = Generator(build_model(tiny_model_config(max_seq_len=320, initializer_range=0.3), seed=2).eval(), TOK)
    app = InferenceApp(gen, "m", max_tokens_limit=1024, max_queue=4, max_batch=2)
    assert app.max_tokens_limit == 1024 and app.default_max_tokens == 256 and app.context == 320
    with serving(app) as base, httpx.Client(base_url=base, timeout=60) as c:
        ok = c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 300, "ignore_eos": True,
                                             "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 300
        default = c.post("/v1/completions", json={"model": "m", "prompt": "x", "ignore_eos": True})
        assert default.json()["usage"]["completion_tokens"] == 256
        cut = c.post("/v1/completions", json={"model": "m", "prompt": "y" * 99, "ignore_eos": True})
        assert cut.json()["usage"]["completion_tokens"] == 320 - 100
        r = c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1000})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
        r = c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1025})
        assert r.status_code == 400 and "limit of 1024" in r.json()["error"]["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop",
                                   "n", "stream", "seed", "logprobs", "top_logprobs", "stream_options", "user",
                                   "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                                   "tools", "functions", "tool_choice", "response_format", "fit_context"])
def test_null_means_absent(server, field):
    """``null`` is what some OpenAI clients send for a field they leave unset: it means the default, as if absent
    (a null max_tokens must not become a fixed budget that overflows a long prompt)."""
    client, _ = server
    for path, head in (("/v1/completions", {"model": "tiny-chat", "prompt": "x" * 79}),
                       ("/v1/chat/completions", {"model": "tiny-chat",
                                                 "messages": [{"role": "user", "content": "x" * 64}]})):
        absent = client.post(path, json={**head, "seed": 5, "temperature": 0})
        null = client.post(path, json={**head, "seed": 5, "temperature": 0, field: None})
        assert absent.status_code == 200 and null.status_code == 200, (field, null.text)
        a, b = absent.json(), null.json()
        a["usage"].pop("prompt_tokens_details"), b["usage"].pop("prompt_tokens_details")  # the 2nd hits the cache
        assert a["usage"] == b["usage"] and a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]
        assert a["usage"]["total_tokens"] <= 96


def test_null_max_completion_tokens_falls_back_to_max_tokens(server):
    client, _ = server
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
            "max_completion_tokens": None, "max_tokens": 5}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_default_budget_fits_a_context_no_longer_than_it():
    """A model whose context equals the default budget (the demo's: 256): the first chat message has room."""
    gen = Generator(build_model(tiny_model_config(max_seq_len=64, initializer_range=0.3), seed=2).eval(), TOK)
    app = InferenceApp(gen, "m", max_tokens_limit=1024, default_max_tokens=64, max_queue=4, max_batch=2)
    with serving(app) as base, httpx.Client(base_url=base, timeout=60) as c:
        msgs = [{"role": "user", "content": "hello there"}]
        prompt = len(TOK.apply_chat_template(msgs, add_generation_prompt=True))
        for extra in ({}, {"max_tokens": None}):
            r = c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "ignore_eos": True, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 64 - prompt
        # an explicit budget that does not fit is refused, unless the request asks to fit it to the context
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 64})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 64,
                                                 "fit_context": True, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64 - prompt
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 3,
                                                 "fit_context": True, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 3  # never longer than asked
        # a prompt that fills the context leaves no room at all: refused with what to do
        long = [{"role": "user", "content": "y" * 64}]
        for extra in ({}, {"fit_context": True, "max_tokens": 8}):
            r = c.post("/v1/chat/completions", json={"model": "m", "messages": long, **extra})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
            assert "no room" in err["message"] and "context of 64" in err["message"]
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "fit_context": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "fit_context"


def test_empty_tools_and_a_text_response_format_are_accepted(server):
    client, _ = server
    r = client.post("/v1/chat/completions", json={"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 2, "tools": [], "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


def test_a_repeated_prompt_reports_cached_tokens_and_metrics_show_the_pool(server):
    """The paged engine's prefix cache: the second request with the same long prompt reports the prompt tokens
    of its full cached blocks in usage.prompt_tokens_details.cached_tokens (OpenAI's field), with the same text;
    /metrics shows the KV blocks and the prefix cache's hits."""
    client, app = server
    body = {"model": "tiny-chat", "prompt": "a shared preamble of some length, " * 2, "max_tokens": 4,
            "temperature": 0}
    n = app.scheduler.session.block_size
    first = client.post("/v1/completions", json=body).json()
    second = client.post("/v1/completions", json=body).json()
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // n * n > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as r:
        last = sse_events(r)[-1]
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // n * n
    metrics = client.get("/metrics").text
    total = app.scheduler.session.pool.total
    assert f"z2all_kv_blocks_total {total}" in metrics and "z2all_kv_blocks_in_use 0" in metrics
    assert 'z2all_spec_acceptance_rate{method="off"} 0.0000' in metrics   # speculation off
    hits = [line for line in metrics.splitlines() if line.startswith("z2all_prefix_cache_hit_tokens_total")]
    assert hits and int(hits[0].split()[1]) >= 2 * ((prompt_tokens - 1) // n * n)
