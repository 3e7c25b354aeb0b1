"""The serving load benchmark's CPU smoke run: the tiny preset, random weights, two concurrency levels."""

import importlib.util
import json
from pathlib import Path


def load_benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_serve_load_runs_on_cpu(tmp_path, capsys):
    bench = load_benchmark()
    out = tmp_path / "serve.json"
    assert bench.main(["--config", "tiny", "--device", "cpu", "--clients", "1,4", "--requests", "2",
                       "--prompt-len", "16", "--max-tokens", "8", "--warmup", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["clients"], r["requests"], r["ok"]) for r in rows] == [(1, 2, 2), (4, 8, 8)]
    for r in rows:
        assert r["errors"] == {} and r["generated_tokens"] == 8 * r["requests"]  # ignore_eos: every token
        assert r["prompt_tokens_mean"] == 16
        assert r["tok_per_s"] > 0 and r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p99"] >= r["itl_ms"]["p50"]
        # a request's first token comes from its prefill, the others from decode steps shared by the rows
        assert 1 <= r["rows_per_step"] <= r["clients"] * 8 / 7 + 1e-9
        # the server's own TTFT lies inside each request's TTFT as the client timed it
        assert 0 < r["server_ttft_ms_mean"] <= r["ttft_ms"]["p99"]
        # and the engine's parts (waiting for a row, prefill, first draw) inside the server's
        assert 0 < sum(r["engine_ttft_ms_mean"].values()) <= r["server_ttft_ms_mean"]
    assert "| 4 | 8/8 |" in capsys.readouterr().out


def test_percentiles_and_summary():
    bench = load_benchmark()
    assert bench.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and bench.percentile([5.0], 99) == 5.0
    level = {"wall": 2.0, "requests": [
        {"status": 200, "sent": 0.0, "times": [0.1, 0.2, 0.4], "usage": {"completion_tokens": 3, "prompt_tokens": 5}},
        {"status": 429}, {"status": "conn"}]}
    r = bench.summarise(2, level, steps=3)
    assert r["ok"] == 1 and r["errors"] == {"429": 1, "conn": 1} and r["tok_per_s"] == 1.5
    assert abs(r["ttft_ms"]["p50"] - 100) < 1e-9 and abs(r["itl_ms"]["p99"] - 200) < 1e-9


def test_a_shared_prefix_is_served_from_the_prefix_cache(tmp_path):
    """--shared-prefix: every prompt starts with the same text, which the paged engine computes once; its usage
    reports the cached tokens (whole blocks of the prefix), and without prefix caching none are cached."""
    bench = load_benchmark()
    common = ["--config", "tiny", "--device", "cpu", "--engine", "paged", "--block-size", "16", "--clients", "2",
              "--requests", "2", "--prompt-len", "16", "--max-tokens", "4", "--warmup", "1", "--shared-prefix", "80"]
    for extra, name in (([], "on.json"), (["--no-prefix-caching"], "off.json")):
        assert bench.main(common + extra + ["--json", str(tmp_path / name)]) == 0
    on = json.loads((tmp_path / "on.json").read_text())["results"][0]
    off = json.loads((tmp_path / "off.json").read_text())["results"][0]
    assert on["prompt_tokens_mean"] == off["prompt_tokens_mean"] == 80 + 16
    assert off["cached_tokens_mean"] == 0
    # the warm-up request computed the prefix; each measured request finds at least its 5 whole blocks
    assert 80 <= on["cached_tokens_mean"] <= 96


def test_a_minimal_request_leaves_out_the_fields_a_strict_server_refuses():
    """transformers serve answers 422 to any field it does not know (ignore_eos) and ignores stream_options:
    --minimal-request sends neither; the default request keeps both."""
    bench = load_benchmark()
    plain = json.loads(bench.request_body("m", "hello", 8, minimal=True))
    assert plain == {"model": "m", "prompt": "hello", "max_tokens": 8, "temperature": 0, "stream": True}
    full = json.loads(bench.request_body("m", "hello", 8))
    assert full == {**plain, "ignore_eos": True, "stream_options": {"include_usage": True}}


def _canned_server(responses: list[bytes]):
    """A loopback server answering each connection with the next canned HTTP response; (host, port, close)."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve():
        for raw in responses:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(raw)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return srv.getsockname()[0], srv.getsockname()[1], srv.close


def _sse(*events: dict | str) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
    return head + b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def test_tokens_are_counted_from_text_chunks_when_no_usage_comes():
    """A server that sends no usage (transformers serve without stream_options): a stream that finishes counts as
    completed, its generated tokens are its text chunks (an empty chunk is no token), and a stream cut before it
    finishes is an error; a request with usage still counts its usage, and a refusal its status."""
    import asyncio

    bench = load_benchmark()
    text = [{"choices": [{"index": 0, "text": piece}]} for piece in ("a", "b", "", "cd")]
    last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 5, "prompt_tokens": 7}}
    responses = [_sse(*text, last),                      # finish_reason, no [DONE], no usage: 3 tokens
                 _sse(*text[:2], "[DONE]"),               # [DONE], no usage: 2 tokens
                 _sse(*text),                             # cut off: neither finish_reason nor [DONE]
                 _sse(*text, last, usage, "[DONE]"),      # usage: its 5 tokens, whatever the chunks
                 b"HTTP/1.1 422 Unprocessable Entity\r\nContent-Length: 2\r\n\r\n{}"]
    host, port, close = _canned_server(responses)
    try:
        level = asyncio.run(bench._level(host, port, [[b"{}"] * len(responses)]))
    finally:
        close()
    seen = [(r["status"], r.get("finished"), r.get("usage") is not None) for r in level["requests"]]
    assert seen == [(200, True, False), (200, True, False), (200, False, False), (200, True, True), (422, None, False)]
    r = bench.summarise(1, level, steps=None)
    assert r["ok"] == 3 and r["errors"] == {"stream": 1, "422": 1}
    assert r["generated_tokens"] == 3 + 2 + 5 and r["tokens_per_request"] == {"min": 2, "max": 5, "mean": 10 / 3}
    assert r["tokens_counted_from"] == "usage and text chunks" and r["prompt_tokens_mean"] == 7
    assert "| 1 | 3/5 |" in bench.table([r]) and "2 / 3.3 / 5* |" in bench.table([r])


def test_minimal_requests_against_our_server(tmp_path, capsys):
    """--minimal-request on our own server: without stream_options it sends no usage, so every request's tokens are
    its text chunks (the byte stand-in tokenizer prints every token); all complete and none stops early here."""
    bench = load_benchmark()
    out = tmp_path / "serve.json"
    assert bench.main(["--config", "tiny", "--device", "cpu", "--clients", "1,4", "--requests", "2", "--prompt-len",
                       "16", "--max-tokens", "8", "--warmup", "1", "--minimal-request", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["minimal_request"] is True
    for r in payload["results"]:
        assert r["ok"] == r["requests"] == 2 * r["clients"] and r["errors"] == {}
        assert r["tokens_counted_from"] == "text chunks" and r["prompt_tokens_mean"] is None
        assert r["tokens_per_request"] == {"min": 8, "max": 8, "mean": 8} and r["generated_tokens"] == 8 * r["requests"]
    printed = capsys.readouterr().out
    assert "no ignore_eos" in printed and "| 4 | 8/8 |" in printed and "8 / 8.0 / 8* |" in printed


def test_the_peer_export_has_an_end_of_text_id_no_token_can_hit(tmp_path):
    """serve_peers.py: transformers serve takes no ignore_eos, so its HF directory's generation_config.json names as
    end-of-text the id one past the last logit; the rest of that file stays, and a second call changes nothing."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_peers.py"
    spec = importlib.util.spec_from_file_location("serve_peers_benchmark", path)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 320, "eos_token_id": 0}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"_from_model_config": True, "eos_token_id": 0}))
    assert peers.unreachable_eos(tmp_path) == 320 == peers.unreachable_eos(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"_from_model_config": True,
                                                                             "eos_token_id": 320}
    (tmp_path / "generation_config.json").unlink()
    assert peers.unreachable_eos(tmp_path) == 320
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": 320}
