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
