"""Stopping ``z2all serve``: SIGTERM drains the running requests (a real process), the drain timeout cancels what
is left, a second signal cancels at once, and nothing new is accepted meanwhile."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.infer.generate import Generator
from zero2all.infer.server import EXIT_CANCELLED, InferenceApp, bind, shutdown
from zero2all.model.io import save_model
from zero2all.model.z2all import build_model

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("shutdown") / "tiny"
    save_model(build_model(tiny_model_config(max_seq_len=1024, initializer_range=0.3), seed=0), path)
    return path


def start_server(ckpt, tmp_path, drain_timeout: float, step_delay: float = 0.005):
    """``serve`` in a child process; every decode step is slowed by ``step_delay`` seconds so that a request is
    surely still running when the signal arrives. Returns (process, base URL)."""
    script = tmp_path / "serve_child.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(ROOT)!r}, {str(TESTS)!r}]
        from standin_tokenizer import ByteTokenizer
        from zero2all.infer import generate
        from zero2all.infer.server import serve

        decode = generate.DecodeSession.decode
        def slow(self, tokens, slot):
            time.sleep({step_delay})
            return decode(self, tokens, slot)
        generate.DecodeSession.decode = slow
        sys.exit(serve({str(ckpt)!r}, port=0, tokenizer=ByteTokenizer(), device="cpu", max_tokens_limit=1000,
                       drain_timeout={drain_timeout}, quiet=True))
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise AssertionError(f"the server did not start: {line!r} {proc.stderr.read()}")
    return proc, line.split("http://", 1)[1].split("/v1", 1)[0]


def read_stream(base: str, proc, max_tokens: int, signals: int = 1) -> list[dict]:
    """Stream a request; after its first chunk send SIGTERM ``signals`` times; return every chunk."""
    body = {"model": "tiny", "prompt": "keep going", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    lines = []
    with httpx.Client(base_url=f"http://{base}", timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 1:
                    for _ in range(signals):
                        proc.send_signal(signal.SIGTERM)
                        time.sleep(0.2)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def refused(base: str) -> bool:
    try:
        httpx.get(f"http://{base}/health", timeout=2)
    except httpx.TransportError:
        return True
    return False


def test_sigterm_lets_the_running_request_finish_and_exits_0(ckpt, tmp_path):
    proc, base = start_server(ckpt, tmp_path, drain_timeout=60)
    try:
        chunks = read_stream(base, proc, max_tokens=200)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert refused(base)
    assert "every request finished" in proc.stderr.read()


def test_drain_timeout_cancels_and_exits_143(ckpt, tmp_path):
    """The request would need 1000 slowed steps; the drain waits 0.5 s, then it ends with "cancelled"."""
    proc, base = start_server(ckpt, tmp_path, drain_timeout=0.5)
    try:
        chunks = read_stream(base, proc, max_tokens=1000)
        assert proc.wait(timeout=60) == EXIT_CANCELLED == 143
    finally:
        proc.kill()
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["cancelled"]
    assert 0 < chunks[-1]["usage"]["completion_tokens"] < 1000
    assert "1 request(s) cancelled" in proc.stderr.read()


def test_second_signal_cancels_at_once(ckpt, tmp_path):
    proc, base = start_server(ckpt, tmp_path, drain_timeout=600)
    try:
        t0 = time.monotonic()
        chunks = read_stream(base, proc, max_tokens=1000, signals=2)
        assert proc.wait(timeout=60) == 143 and time.monotonic() - t0 < 60
    finally:
        proc.kill()
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "cancelled"


def test_shutdown_in_process_refuses_new_work_while_draining(monkeypatch):
    """While draining: /health says 503 draining and a new request on a kept-alive connection gets 503; the
    running stream still ends properly."""
    gen = Generator(build_model(tiny_model_config(max_seq_len=512, initializer_range=0.3), seed=0).eval(),
                    ByteTokenizer())
    app = InferenceApp(gen, "m", max_tokens_limit=400, max_queue=4, max_batch=2)
    decode = app.scheduler.session.decode
    monkeypatch.setattr(app.scheduler.session, "decode", lambda t, s: (time.sleep(0.005), decode(t, s))[1])
    httpd, _ = bind(app, port=0, quiet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = "http://%s:%d" % httpd.server_address[:2]
    status = {}
    with httpx.Client(base_url=base, timeout=60) as keep, httpx.Client(base_url=base, timeout=60) as c:
        assert keep.get("/health").json()["status"] == "ok"  # opens the kept-alive connection
        body = {"model": "m", "prompt": "x", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line)
            stopper = threading.Thread(target=lambda: status.setdefault("exit", shutdown(httpd, app, 60.0)))
            stopper.start()
            deadline = time.monotonic() + 10
            while app.accepting and time.monotonic() < deadline:
                time.sleep(0.01)
            health = keep.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            late = keep.post("/v1/completions", json={"model": "m", "prompt": "y", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            rest = [line for line in lines if line]
        stopper.join(60)
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert status["exit"] == 0


def test_sigterm_drains_a_real_process_new_work_gets_503(ckpt, tmp_path):
    """``z2all serve``'s process on SIGTERM: a request on a kept-alive connection gets 503 shutting_down and
    /health says draining, a new connection is refused, the running stream still ends with every token; exit 0."""
    proc, base = start_server(ckpt, tmp_path, drain_timeout=60)
    try:
        body = {"model": "tiny", "prompt": "go", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=f"http://{base}", timeout=60) as keep, \
                httpx.Client(base_url=f"http://{base}", timeout=60) as c:
            assert keep.get("/health").json()["status"] == "ok"  # opens the kept-alive connection
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line).startswith("data: ")
                proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                while (health := keep.get("/health")).status_code == 200 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert health.status_code == 503 and health.json() == {"status": "draining"}
                late = keep.post("/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 2})
                assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
                assert refused(base)
                rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
