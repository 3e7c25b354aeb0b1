"""``z2all serve`` on its ASGI stack (Starlette on uvicorn): slow and half-open clients while others are served, the
API key refused before a body is read, ``/metrics`` after requests, ``/openapi.json`` and the pydantic response
models, and the event loop's bounded threads. Raw sockets on 127.0.0.1; a read timeout of half a second."""

import json
import re
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.infer import api
from zero2all.infer.generate import Generator
from zero2all.infer.server import InferenceApp, bind
from zero2all.model.z2all import build_model

KEY = "sk-asgi-77e"
TIMEOUT = 0.5


@pytest.fixture(scope="module")
def generator():
    return Generator(build_model(tiny_model_config(max_seq_len=64, initializer_range=0.3), seed=0).eval(),
                     ByteTokenizer())


@contextmanager
def running(generator, **kwargs):
    app = InferenceApp(generator, "m", max_tokens_limit=16, max_queue=8, max_batch=2)
    httpd, _ = bind(app, port=0, quiet=True, read_timeout=TIMEOUT, **kwargs)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    host, port = httpd.server_address[:2]
    try:
        yield host, port, httpd, app
    finally:
        httpd.shutdown()
        httpd.server_close()
        app.close()


@pytest.fixture(scope="module")
def server(generator):
    with running(generator, api_key=KEY, max_connections=64) as s:
        normal_request(s)  # the first generation warms the model up
        yield s


def base(server) -> str:
    return f"http://{server[0]}:{server[1]}"


def read_all(sock: socket.socket) -> tuple[bytes, float]:
    start, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


def status_of(data: bytes) -> int:
    return int(data.split(b" ", 2)[1]) if data else 0


def normal_request(server) -> tuple[int, float]:
    start = time.monotonic()
    r = httpx.post(base(server) + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                   json={"model": "m", "prompt": "ab", "max_tokens": 4, "temperature": 0})
    return r.status_code, time.monotonic() - start


def test_half_sent_headers_and_partial_body_end_at_the_deadline_while_others_are_served(server):
    """One client stops half-way through its headers, another half-way through its body; both are dealt with at
    the read timeout (closed; 408), and a normal request sent meanwhile is answered at once."""
    heads = socket.create_connection(server[:2], timeout=10)
    heads.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    body = socket.create_connection(server[:2], timeout=10)
    body.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n".encode() + b'{"model": "m", ')
    status, took = normal_request(server)
    assert status == 200 and took < TIMEOUT  # not held up by the two stalled clients
    data, waited = read_all(heads)
    assert data == b"" and waited < TIMEOUT + 1.0
    data, waited = read_all(body)
    assert status_of(data) == 408 and waited < TIMEOUT + 1.5
    assert b"connection: close" in data.lower() and b"request_timeout" in data


def test_many_half_open_connections_cost_no_thread_each(server):
    before = threading.active_count()
    socks = [socket.create_connection(server[:2], timeout=10) for _ in range(40)]
    for s in socks:
        s.sendall(b"GET /hea")
    time.sleep(0.1)
    assert threading.active_count() <= before + 1
    status, took = normal_request(server)
    assert status == 200 and took < TIMEOUT
    for s in socks:
        assert read_all(s)[1] < TIMEOUT + 1.0  # closed by the deadline
        s.close()


@pytest.mark.parametrize("auth", [b"", b"Authorization: Bearer sk-wrong\r\n"])
def test_a_huge_body_without_the_right_key_is_refused_unread(server, auth):
    """A 200 MB body announced without the key (or with a wrong one): 401 comes while the client has sent only a
    sliver of it, and the connection closes (the rest is never read)."""
    sock = socket.create_connection(server[:2], timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth
                 + b"Content-Type: application/json\r\nContent-Length: 200000000\r\n\r\n" + b"{" + b" " * 65536)
    start = time.monotonic()
    data, _ = read_all(sock)
    assert status_of(data) == 401 and b"invalid_api_key" in data and time.monotonic() - start < TIMEOUT
    assert b"connection: close" in data.lower()


def parse_metrics(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_after_requests(generator):
    """Prometheus text: the request counts by route and status, the tokens, the TTFT / ITL histograms (one first
    token per sequence, one inter-token gap per later token), the queue and the rows."""
    with running(generator) as server:
        with httpx.Client(base_url=base(server), timeout=30) as c:
            empty = parse_metrics(c.get("/metrics").text)
            assert empty["z2all_time_to_first_token_seconds_count"] == 0
            body = {"model": "m", "prompt": "abc", "max_tokens": 7, "temperature": 0, "ignore_eos": True}
            plain = c.post("/v1/completions", json=body).json()
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200 and list(r.iter_lines())[-2] == "data: [DONE]"
            assert c.post("/v1/completions", json={**body, "model": "other"}).status_code == 404
            assert c.get("/health-x1").status_code == 404  # any path a client makes up: one label, "other"
            r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = parse_metrics(r.text)
    assert plain["usage"]["completion_tokens"] == 7
    assert m["z2all_generation_tokens_total"] == 14 and m["z2all_prompt_tokens_total"] == 2 * 4
    assert m["z2all_time_to_first_token_seconds_count"] == 2 and m["z2all_inter_token_latency_seconds_count"] == 12
    assert m['z2all_time_to_first_token_seconds_bucket{le="+Inf"}'] == 2
    assert m["z2all_request_duration_seconds_count"] == 2
    assert m['z2all_http_requests_total{route="/v1/completions",status="200"}'] == 2
    assert m['z2all_http_requests_total{route="/v1/completions",status="404"}'] == 1
    assert m['z2all_http_requests_total{route="other",status="404"}'] == 1
    assert m["z2all_requests_waiting"] == 0 and m["z2all_requests_running"] == 0 and m["z2all_batch_rows"] == 2
    assert m["z2all_generation_tokens_per_second"] > 0 and m['z2all_sequences_finished_total{reason="length"}'] == 2
    # buckets are cumulative: never decreasing, ending at the count
    buckets = [v for k, v in m.items() if k.startswith("z2all_inter_token_latency_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 12
    assert all(re.fullmatch(r"[a-z_][a-z0-9_]*(\{[^}]*\})?", k) for k in m)


def test_openapi_and_the_response_models(server):
    with httpx.Client(base_url=base(server), timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
        spec = c.get("/openapi.json").json()
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(spec["paths"])
        schemas = spec["components"]["schemas"]
        assert {"ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "ErrorResponse"} <= set(schemas)
        assert "messages" in schemas["ChatCompletionRequest"]["required"]
        chat = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 3})
        api.ChatCompletion.model_validate(chat.json())
        done = c.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "max_tokens": 3})
        api.Completion.model_validate(done.json())
        api.ModelList.model_validate(c.get("/v1/models").json())
        with c.stream("POST", "/v1/chat/completions", json={"model": "m", "max_tokens": 3, "stream": True,
                                                            "messages": [{"role": "user", "content": "hi"}],
                                                            "stream_options": {"include_usage": True}}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            api.ChatCompletionChunk.model_validate(json.loads(e))
        err = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": 5}]})
        assert err.status_code == 400 and err.json()["error"]["param"] == "messages[0].content"
        api.ErrorResponse.model_validate(err.json())


def test_serve_without_the_server_packages_is_one_line(tmp_path, capsys, monkeypatch):
    import sys

    from zero2all.cli import main

    monkeypatch.delitem(sys.modules, "zero2all.infer.server", raising=False)
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    assert main(["serve", "--ckpt", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "uvicorn" in err and "zero2all[serve]" in err and "Traceback" not in err


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_from_the_template_are_the_dicts_json(chat):
    """A token's streamed chunk is written from a per-index template (head + the text's JSON string + tail): the
    bytes equal json.dumps of the chunk's dict for texts with quotes, backslashes, control characters, non-ASCII,
    emoji, a lone surrogate and the empty string, in several choices; a marker that also appears in the dict's
    other fields falls back to json.dumps."""
    import json

    from zero2all.infer.server import ChunkTemplate

    def make(index, text, rid="cmpl-7", model="z2all \"m\" \u00e9"):
        choice = ({"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None} if chat
                  else {"index": index, "text": text, "logprobs": None, "finish_reason": None})
        return {"id": rid, "object": "x", "created": 1, "model": model, "choices": [choice]}

    template = ChunkTemplate(make)
    texts = ["a", " the", 'say "hi"', "back\\slash", "line\nbreak\ttab\x01\x1f", "caf\u00e9 \u4e2d\u6587",
             "\U0001f600", "\ud800", "</script>", ""]
    for index in (0, 1, 3):
        for text in texts:
            assert template(index, text) == json.dumps(make(index, text)).encode(), (index, text)
    clash = ChunkTemplate(lambda i, t: make(i, t, rid=ChunkTemplate.MARK))
    assert clash(0, "x") == json.dumps(make(0, "x", rid=ChunkTemplate.MARK)).encode() and not clash.parts
