"""The API key, the chat page's files and CORS of ``z2all serve``, with the official ``openai`` client."""

import threading

import httpx
import pytest
from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.infer.server import PAGE_FILES, create_server, exposure_warning, is_loopback
from zero2all.model.io import save_model
from zero2all.model.z2all import build_model

openai = pytest.importorskip("openai")   # an optional test dependency: without it these tests skip, the run goes on

KEY = "sk-test-4f9c2a"
ORIGIN = "https://tools.example.org"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tiny"
    save_model(build_model(tiny_model_config(max_seq_len=64), seed=0), path)
    return path


def start(ckpt, **kwargs):
    httpd, app = create_server(ckpt, port=0, tokenizer=ByteTokenizer(), device="cpu", max_tokens_limit=16,
                               quiet=True, **kwargs)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    host, port = httpd.server_address[:2]
    return httpd, app, f"http://{host}:{port}"


@pytest.fixture(scope="module")
def keyed(ckpt):
    httpd, app, base = start(ckpt, api_key=KEY, cors_origin=ORIGIN)
    yield base
    httpd.shutdown()
    httpd.server_close()
    app.close()


@pytest.fixture(scope="module")
def open_server(ckpt):
    httpd, app, base = start(ckpt)
    yield base
    httpd.shutdown()
    httpd.server_close()
    app.close()


def client(base, key):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


def test_right_key_works_for_every_route(keyed):
    c = client(keyed, KEY)
    model = c.models.list().data[0]
    assert model.id == "tiny" and model.context_length == 64 and model.max_tokens_limit == 16
    out = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                    temperature=0)
    assert out.usage.completion_tokens >= 1
    pieces = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="ab", max_tokens=5,
                                                                 temperature=0, stream=True) if ch.choices]
    assert "".join(pieces) == c.completions.create(model="tiny", prompt="ab", max_tokens=5,
                                                   temperature=0).choices[0].text


@pytest.mark.parametrize("key", ["sk-wrong", KEY + "x", KEY[:-1], None])
def test_wrong_or_missing_key_is_401(keyed, key):
    """None: the client sends no Authorization header at all."""
    c = client(keyed, key or "unused")
    extra = {"extra_headers": {"Authorization": openai.Omit()}} if key is None else {}
    with pytest.raises(openai.AuthenticationError) as err:
        c.models.list(**extra)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra)
    with pytest.raises(openai.AuthenticationError):
        c.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True, **extra)


def test_no_key_is_401_and_the_body_is_not_read(keyed):
    with httpx.Client(base_url=keyed, timeout=30) as c:
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.headers["connection"] == "close"
        r = c.get("/v1/models", headers={"Authorization": f"Basic {KEY}"})  # the scheme must be Bearer
        assert r.status_code == 401
        assert c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_page_and_health_are_open_and_the_page_is_locked_down(keyed):
    with httpx.Client(base_url=keyed, timeout=30) as c:
        assert c.get("/health").json()["status"] == "ok"
        for path, (name, content_type) in PAGE_FILES.items():
            r = c.get(path)
            assert r.status_code == 200 and r.headers["content-type"] == content_type and r.content
            assert "script-src 'self'" in r.headers["content-security-policy"]
            assert r.headers["x-content-type-options"] == "nosniff"
        page = c.get("/").text
        assert 'src="app.js"' in page and "http" not in page.replace('http-equiv', '')  # nothing from elsewhere
        assert c.get("/index.html").status_code == 404 and c.get("/../pyproject.toml").status_code == 404


def test_cors_only_for_the_named_origin(keyed, open_server):
    with httpx.Client(timeout=30) as c:
        assert "access-control-allow-origin" not in c.get(open_server + "/v1/models",
                                                          headers={"Origin": ORIGIN}).headers
        no_cors = c.options(open_server + "/v1/models", headers={"Origin": ORIGIN})
        assert no_cors.status_code == 405 and "OPTIONS" not in no_cors.headers["allow"]
        pre = c.options(keyed + "/v1/chat/completions", headers={"Origin": ORIGIN,
                                                                 "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == ORIGIN
        assert "Authorization" in pre.headers["access-control-allow-headers"]
        assert c.options(keyed + "/v1/models", headers={"Origin": "https://evil.example"}).status_code == 405
        r = c.get(keyed + "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
        assert r.headers["access-control-allow-origin"] == ORIGIN


def test_open_server_needs_no_key(open_server):
    c = client(open_server, "anything")
    assert c.models.list().data[0].id == "tiny"


@pytest.mark.parametrize("host,exposed", [("127.0.0.1", False), ("::1", False), ("localhost", False),
                                          ("127.0.0.2", False), ("0.0.0.0", True), ("", True), ("::", True),
                                          ("192.168.1.20", True)])
def test_warning_when_reachable_from_elsewhere_without_a_key(host, exposed):
    assert is_loopback(host) is not exposed
    warning = exposure_warning(host, None)
    assert (warning is not None) is exposed
    if exposed:
        assert "--api-key" in warning and "Z2ALL_API_KEY" in warning
    assert exposure_warning(host, KEY) is None


@pytest.mark.parametrize("auth", [b"", b"Authorization: Bearer sk-wrong\r\n"])
def test_a_refused_post_still_gets_its_401_while_its_body_is_being_sent(keyed, auth):
    """The server refuses before reading the body; closing at once with the body's bytes still unread would reset
    the connection (the kernel answers unread data with RST) and the client could lose the 401. The server stops
    sending, discards what still comes and closes once the client does: the client reads its 401 whole."""
    import socket

    host, port = keyed.removeprefix("http://").rsplit(":", 1)
    body = b"x" * (4 << 20)                  # far more than the socket buffers hold
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + auth
                  + b"Content-Length: %d\r\n\r\n" % len(body))
        s.sendall(body)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in got
