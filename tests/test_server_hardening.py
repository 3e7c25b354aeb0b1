"""``z2all serve`` against clients that misbehave at the socket level: half-sent requests, floods of connections,
slow trickles, wrong keys before the headers end, bodies that are not JSON, and the methods besides GET and POST.

Raw sockets on 127.0.0.1; the server runs in this process with a read timeout of half a second, so every test takes
about a second.
"""

import asyncio
import json
import select
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.infer.generate import Generator
from zero2all.infer.server import InferenceApp, bind
from zero2all.model.z2all import build_model

KEY = "sk-hardening-1c2"
TIMEOUT = 0.5
CAP = 4
AUTH = f"Authorization: Bearer {KEY}\r\n"


@pytest.fixture(scope="module")
def generator():
    return Generator(build_model(tiny_model_config(max_seq_len=64, initializer_range=0.3), seed=0).eval(),
                     ByteTokenizer())


@contextmanager
def hardened(generator, **kwargs):
    """A keyed server with a short read timeout and a cap of CAP connections; yields (host, port, httpd, app)."""
    app = InferenceApp(generator, "m", max_tokens_limit=8, max_queue=8, max_batch=2)
    httpd, _ = bind(app, port=0, quiet=True, api_key=KEY, read_timeout=TIMEOUT, max_connections=CAP, **kwargs)
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
    with hardened(generator) as s:
        yield s


def connect(server) -> socket.socket:
    sock = socket.create_connection(server[:2], timeout=10)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    start, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


def response(data: bytes) -> tuple[int, dict, bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_partial_request_line_is_closed_at_the_timeout(server):
    sock = connect(server)
    sock.sendall(b"GET /v1/mod")
    data, took = read_until_closed(sock)
    assert data == b"" and TIMEOUT * 0.8 <= took < TIMEOUT + 1.0


def test_a_slow_trickle_is_cut_at_the_deadline_not_per_read(server):
    """One byte every 0.1 s: each read comes well within the timeout, the whole request does not."""
    sock = connect(server)
    start, closed_after = time.monotonic(), None
    for byte in b"GET /health HTTP/1.1\r\nHost: example\r\nUser-Agent: slow\r\nAccept: */*\r\n\r\n":
        if select.select([sock], [], [], 0.1)[0] or not send_quietly(sock, bytes([byte])):
            closed_after = time.monotonic() - start
            break
    assert closed_after is not None and TIMEOUT * 0.8 <= closed_after < TIMEOUT + 1.0
    assert read_until_closed(sock)[0] == b""


def send_quietly(sock, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except (BrokenPipeError, ConnectionResetError):
        return False


def test_partial_body_gets_408_and_is_closed(server):
    sock = connect(server)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Type: application/json\r\n"
                 f"Content-Length: 100\r\n\r\n".encode() + b'{"model": "m", ')
    data, took = read_until_closed(sock)
    status, headers, body = response(data)
    assert status == 408 and headers["connection"] == "close" and took < TIMEOUT + 1.0
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_wrong_key_is_refused_before_the_headers_end(server):
    """The headers never end: a server that read them all before checking the key would time out silently."""
    sock = connect(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-guess\r\n")
    data, took = read_until_closed(sock)
    status, headers, body = response(data)
    assert status == 401 and headers["connection"] == "close" and took < TIMEOUT * 0.8
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    # the right key with unfinished headers is no shortcut: it waits for the rest and times out
    sock = connect(server)
    sock.sendall(f"GET /v1/models HTTP/1.1\r\n{AUTH}".encode())
    data, took = read_until_closed(sock)
    assert data == b"" and took >= TIMEOUT * 0.8


def test_a_flood_of_idle_connections_cannot_hold_the_server(server):
    """Far more half-sent requests than the cap: the threads stay bounded, the oldest idle connection makes room
    for a new one, and a normal request is answered at once."""
    before = threading.active_count()
    start = time.monotonic()
    flood = [connect(server) for _ in range(5 * CAP)]
    for sock in flood:
        sock.sendall(b"GET /hea")
    # the closed ones' threads end at once (well before the read timeout would end them all)
    while threading.active_count() > before + CAP + 1 and time.monotonic() - start < TIMEOUT * 0.8:
        time.sleep(0.01)
    assert threading.active_count() <= before + CAP + 1 and server[2].open_connections <= CAP
    start = time.monotonic()
    status, _, body = raw_exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200 and json.loads(body)["status"] == "ok" and time.monotonic() - start < TIMEOUT * 0.8
    for sock in flood:  # every one of them is closed, by the cap or by the timeout
        assert read_until_closed(sock)[1] < TIMEOUT + 1.0


def test_busy_connections_beyond_the_cap_get_503(generator):
    """CAP requests in progress: one more connection is refused at once with 503 in JSON; then all is well."""
    release = threading.Event()
    with hardened(generator) as server:
        app = server[3]
        real_complete = app.complete

        async def blocked_complete(job):  # the request stays in progress until released
            await asyncio.to_thread(release.wait, 20)
            return await real_complete(job)

        app.complete = blocked_complete
        body = json.dumps({"model": "m", "prompt": "ab", "max_tokens": 2, "temperature": 0}).encode()
        request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Type: application/json\r\n"
                   f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        results = []

        def post():
            results.append(raw_exchange(server, request)[0])

        threads = [threading.Thread(target=post) for _ in range(CAP)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while server[2].busy_connections < CAP and time.monotonic() < deadline:
            time.sleep(0.01)
        sock = connect(server)
        data, took = read_until_closed(sock)
        status, headers, raw = response(data)
        assert status == 503 and headers["retry-after"] == "1" and took < TIMEOUT
        assert json.loads(raw)["error"]["code"] == "too_many_connections"
        release.set()
        for t in threads:
            t.join(30)
        assert results == [200] * CAP
        assert raw_exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")[0] == 200


@pytest.mark.parametrize("content_type, status", [("text/plain", 415), ("application/x-www-form-urlencoded", 415),
                                                  ("application/json; charset=utf-8", 200), (None, 200)])
def test_post_needs_a_json_body(server, content_type, status):
    headers = {"Authorization": f"Bearer {KEY}"}
    if content_type:
        headers["Content-Type"] = content_type
    r = httpx.post(f"http://{server[0]}:{server[1]}/v1/completions", headers=headers, timeout=30,
                   content=json.dumps({"model": "m", "prompt": "ab", "max_tokens": 2}).encode())
    assert r.status_code == status, r.text
    if status == 415:
        err = r.json()["error"]
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]


def raw_exchange(server, request: bytes) -> tuple[int, dict, bytes]:
    sock = connect(server)
    sock.sendall(request)
    return response(read_until_closed(sock)[0])


def test_expect_100_continue_without_the_key_is_401(server):
    status, headers, _ = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                              b"Content-Type: application/json\r\nContent-Length: 5000\r\n"
                                              b"Expect: 100-continue\r\n\r\n")
    assert status == 401 and headers["connection"] == "close"


def test_head_options_and_other_methods(server):
    status, headers, body = raw_exchange(server, b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    get = httpx.get(f"http://{server[0]}:{server[1]}/health", timeout=10)
    assert status == 200 and body == b"" and int(headers["content-length"]) == len(get.content) > 0
    status, headers, body = raw_exchange(server, b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 401 and body == b""
    status, headers, body = raw_exchange(server, f"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n{AUTH}"
                                                 "Connection: close\r\n\r\n".encode())
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0
    # no CORS origin set: OPTIONS is not answered as a preflight
    status, headers, body = raw_exchange(server, b"OPTIONS /v1/models HTTP/1.1\r\nHost: x\r\nOrigin: https://a.example\r\n"
                                                 b"Connection: close\r\n\r\n")
    assert status == 405 and "GET" in headers["allow"] and json.loads(body)["error"]["code"] == "method_not_allowed"
    for method in (b"PUT", b"DELETE", b"PATCH"):
        status, headers, body = raw_exchange(server, method + b" /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                             + AUTH.encode() + b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed", method


@pytest.mark.parametrize("flag, value", [("--read-timeout", "0"), ("--read-timeout", "nan"),
                                         ("--max-connections", "0")])
def test_bad_limits_are_one_line_and_exit_2(tmp_path, capsys, flag, value):
    from zero2all.cli import main

    assert main(["serve", "--ckpt", str(tmp_path / "nothing-here"), flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and flag in err and "Traceback" not in err


@pytest.mark.parametrize("request_bytes, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 505),
    (b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n", 431),
    (b"BREW /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 501),
])
def test_malformed_requests_get_json_errors(server, request_bytes, status):
    got, headers, body = raw_exchange(server, request_bytes)
    assert got == status and headers["connection"] == "close" and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["message"]
