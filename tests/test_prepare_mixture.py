"""Source sampling in `z2all prepare`: --temperature, --target-mb, --max-epochs, --seed."""

import json
import random

import numpy as np
import pytest

from zero2all.cli import main
from zero2all.data.pretokenize import measure_sources, plan_mixture, prepare, read_meta
from zero2all.tokenizer import train_tokenizer

SIZES = {"big": 1200, "mid": 120, "small": 12}  # documents per source, ~equal length: 100x apart


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "cloud", "paper", "green", "seven"]
    paths = {}
    for name, n in SIZES.items():
        rng = random.Random(name)
        docs = [{"content": f"{name} {i}: " + " ".join(rng.choice(words) for _ in range(30))} for i in range(n)]
        paths[name] = d / f"{name}.jsonl"
        paths[name].write_text("\n".join(json.dumps(x) for x in docs) + "\n", encoding="utf-8")
    tok = d / "tok"
    train_tokenizer([str(p) for p in paths.values()], 384, tok, log=lambda *a: None)
    return {"inputs": [f"{k}={p}" for k, p in paths.items()], "tok": tok}


def _run(corpus, out, **kw):
    kw.setdefault("valid_fraction", 0.0)
    return prepare(corpus["inputs"], corpus["tok"], out, workers=1, progress=False, log=lambda *a: None, **kw)


def test_plan_mixture_formula():
    sizes = {"a": 1000.0, "b": 100.0, "c": 10.0}
    w, _ = plan_mixture(sizes, {}, temperature=1.0)
    assert w == pytest.approx({"a": 1.0, "b": 1.0, "c": 1.0})
    w, _ = plan_mixture(sizes, {}, temperature=1e6)
    out = {k: w[k] * sizes[k] for k in sizes}
    assert all(v / sum(out.values()) == pytest.approx(1 / 3, abs=1e-3) for v in out.values())
    assert sum(out.values()) == pytest.approx(sum(sizes.values()))  # the budget is the corpus size
    w, _ = plan_mixture(sizes, {}, temperature=1.0, target_bytes=2220.0)
    assert w == pytest.approx({"a": 2.0, "b": 2.0, "c": 2.0})
    # a cap clips the small source and gives its excess to the others (same budget)
    w, notes = plan_mixture(sizes, {}, temperature=1e6, max_epochs=5)
    assert w["c"] == 5 and w["b"] <= 5 and sum(w[k] * sizes[k] for k in sizes) == pytest.approx(1110.0)
    assert any("--max-epochs 5: c capped" in n for n in notes)
    # explicit wins; the rest of the budget is shared by temperature
    w, _ = plan_mixture(sizes, {"c": 3.0}, temperature=1e6)
    assert w["c"] == 3.0 and w["a"] * 1000 == pytest.approx(w["b"] * 100, rel=1e-3)
    assert sum(w[k] * sizes[k] for k in sizes) == pytest.approx(1110.0)


@pytest.mark.parametrize("kw, option", [({"temperature": 0.0}, "--temperature"),
                                        ({"temperature": -1.0}, "--temperature"), ({"max_epochs": 0.5}, "--max-epochs"),
                                        ({"target_bytes": 0.0}, "--target-mb")])
def test_plan_mixture_refuses_bad_values(kw, option):
    with pytest.raises(ValueError, match=option):
        plan_mixture({"a": 1.0}, {}, **kw)


def test_explicit_weight_above_cap_is_refused():
    with pytest.raises(ValueError, match="--source c=4.*--max-epochs 2"):
        plan_mixture({"a": 1.0, "c": 1.0}, {"c": 4.0}, temperature=2.0, max_epochs=2)


def test_measure_sources_counts_and_extrapolates(corpus, tmp_path):
    from zero2all.corpus.readers import SourceSpec

    exact = measure_sources([SourceSpec.parse(x) for x in corpus["inputs"]])
    assert {k: v["docs"] for k, v in exact.items()} == SIZES and not any(v["estimated"] for v in exact.values())
    # a source of 4 equal files, bounded to the first: the rest is extrapolated from the file sizes
    big = corpus["inputs"][0].split("=", 1)[1]
    parts = tmp_path / "parts"
    parts.mkdir()
    for i in range(4):
        (parts / f"p{i}.jsonl").write_bytes(open(big, "rb").read())
    est = measure_sources([SourceSpec.parse(f"p={parts}")], sample_bytes=1)["p"]
    assert est["estimated"] and est["docs"] == 4 * SIZES["big"] and est["bytes"] == 4 * exact["big"]["bytes"]


def test_temperature_one_is_the_natural_mixture(corpus, tmp_path):
    m = _run(corpus, tmp_path / "t1", temperature=1.0)
    natural = _run(corpus, tmp_path / "nat")
    for name, v in m["sources"].items():
        assert v["weight"] == pytest.approx(1.0) and v["weight_from"] == "temperature"
        assert v["effective_epochs"] == pytest.approx(1.0, abs=0.02)
        assert v["train_share"] == pytest.approx(natural["sources"][name]["train_share"], abs=0.01)
    assert m["mixture"]["sizes"]["small"]["docs"] == SIZES["small"]


def test_high_temperature_flattens_and_caps(corpus, tmp_path):
    lines = []
    m = prepare(corpus["inputs"], corpus["tok"], tmp_path / "flat", workers=1, progress=False, log=lines.append,
                valid_fraction=0.0, temperature=100.0)
    shares = {k: v["train_share"] for k, v in m["sources"].items()}
    assert all(s == pytest.approx(1 / 3, abs=0.06) for s in shares.values()), shares
    assert m["sources"]["small"]["effective_epochs"] > 20 and m["sources"]["big"]["effective_epochs"] < 0.5
    assert m["sources"]["small"]["share_in"] < 0.01
    assert any(line.startswith("  small: 12 docs") and "epochs" in line for line in lines)
    # --max-epochs: the small source is clipped at 3 copies per document, with a printed line
    lines = []
    m = prepare(corpus["inputs"], corpus["tok"], tmp_path / "cap", workers=1, progress=False, log=lines.append,
                valid_fraction=0.0, temperature=100.0, max_epochs=3)
    assert m["sources"]["small"]["weight"] == 3 and m["sources"]["small"]["effective_epochs"] == pytest.approx(3)
    assert all(v["effective_epochs"] <= 3 for v in m["sources"].values())
    assert any("--max-epochs 3: small capped" in line for line in lines)
    assert m["mixture"]["notes"]


def test_explicit_weight_wins_and_target(corpus, tmp_path):
    m = _run(corpus, tmp_path / "ex", temperature=100.0, weights={"small": 2.0})
    assert m["sources"]["small"]["weight"] == 2.0 and m["sources"]["small"]["weight_from"] == "explicit"
    assert m["sources"]["small"]["effective_epochs"] == pytest.approx(2.0)
    total = sum(v["bytes"] for v in m["sources"].values())
    m2 = _run(corpus, tmp_path / "tg", temperature=1.0, target_mb=2 * total / 1e6)
    assert all(v["weight"] == pytest.approx(2.0, rel=1e-6) for v in m2["sources"].values())
    assert m2["splits"]["train"]["tokens"] == pytest.approx(2 * m["splits"]["train"]["tokens"], rel=0.3)


def test_seed_deterministic_and_resume(corpus, tmp_path):
    kw = {"temperature": 3.0, "seed": 7, "chunk_bytes": 8000, "shard_chunks": 2, "valid_fraction": 0.05}
    a = _run(corpus, tmp_path / "a", **kw)
    b = _run(corpus, tmp_path / "b", **kw)
    c = _run(corpus, tmp_path / "c", **{**kw, "seed": 8})
    stream = {k: np.concatenate([np.fromfile(tmp_path / k / s["bin"], dtype=read_meta(tmp_path / k)["dtype"])
                                 for s in read_meta(tmp_path / k)["splits"]["train"]["shards"]]) for k in "abc"}
    assert np.array_equal(stream["a"], stream["b"]) and not np.array_equal(stream["a"], stream["c"])
    assert a["sources"] == b["sources"]
    assert a["sources"]["small"]["docs_valid"] == c["sources"]["small"]["docs_valid"]  # the split ignores the seed
    with pytest.raises(KeyboardInterrupt):
        _run(corpus, tmp_path / "r", _stop_after_groups=1, **kw)
    state = json.loads((tmp_path / "r" / "_state.json").read_text())
    assert state["sizes"]["small"]["docs"] == SIZES["small"] and state["fingerprint"]["mixture"]["temperature"] == 3
    r = _run(corpus, tmp_path / "r", **kw)
    assert r["splits"]["train"]["shards"] == a["splits"]["train"]["shards"]
    assert np.array_equal(stream["a"], np.concatenate([np.fromfile(tmp_path / "r" / s["bin"], dtype=r["dtype"])
                                                       for s in r["splits"]["train"]["shards"]]))
    # another temperature is other settings: the finished output is refused
    with pytest.raises(ValueError, match="mixture"):
        _run(corpus, tmp_path / "r", **{**kw, "temperature": 2.0})


@pytest.mark.parametrize("flag, value", [("--temperature", "0"), ("--temperature", "-2"), ("--max-epochs", "0.5")])
def test_cli_refuses_bad_values(corpus, tmp_path, capsys, flag, value):
    args = ["prepare", "--input", *corpus["inputs"], "--tokenizer", str(corpus["tok"]), "--out", str(tmp_path / "o"),
            "--no-progress", flag, value]
    assert main(args) == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
