import json
import threading

import httpx
import pytest

from standin_tokenizer import ByteTokenizer, tiny_model_config
from zero2all.infer.server import create_server
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
    ("/v1/completions", {"model": "tiny-chat"}, 400, "'prompt'"),
    ("/v1/chat/completions", {"model": "tiny-chat"}, 400, "'messages'"),
    ("/v1/chat/completions", {"model": "tiny-chat", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "max_tokens": 33}, 400, "limit of 32"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x" * 80, "max_tokens": 32}, 400, "context"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/nothing", {"model": "tiny-chat"}, 404, "no such path"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
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


def wait_until_idle(app):
    """A handler thread releases its admission slot just after its response is sent, so the client may already be
    on its next request: wait (up to 10 s) until every slot is free again, so that the counts below are exact."""
    slots = app.max_queue + 1
    for _ in range(slots):
        assert app.admission.acquire(timeout=10)
    for _ in range(slots):
        app.admission.release()


def test_busy_server_answers_429(server):
    client, app = server
    wait_until_idle(app)
    held = [app.admission.acquire(blocking=False) for _ in range(app.max_queue + 1)]
    try:
        assert all(held)
        r = client.post("/v1/completions", json={"model": "tiny-chat", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for _ in held:
            app.admission.release()
    assert client.post("/v1/completions", json={"model": "tiny-chat", "prompt": "x", "max_tokens": 2}).status_code \
        == 200


def test_concurrent_requests_queue_and_all_succeed(server):
    client, app = server
    wait_until_idle(app)
    results = []

    def call(seed):
        r = client.post("/v1/completions", json={"model": "tiny-chat", "prompt": "q", "max_tokens": 6,
                                                 "seed": seed})
        results.append(r.status_code)

    threads = [threading.Thread(target=call, args=(s,)) for s in range(2)]  # 1 running + 1 queued fits
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200, 200]
