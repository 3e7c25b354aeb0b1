import json
import os
import sysconfig

import numpy as np
import pytest

from zero2all.cli import main
from zero2all.corpus.readers import iter_records
from zero2all.data.pretokenize import (
    TokenizerMismatchError,
    check_tokenizer,
    copies_of,
    prepare,
    read_meta,
    shard_dtype,
)
from zero2all.tokenizer import load_tokenizer, train_tokenizer

STDLIB = sysconfig.get_paths()["stdlib"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    zh = [{"id": f"zh{i}", "content": f"第{i}篇：今天天气很好，我们去公园散步。" * (1 + i % 7)} for i in range(300)]
    (d / "zh.jsonl").write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in zh) + "\n", encoding="utf-8")
    return {"code": os.path.join(STDLIB, "json", "*.py"), "email": os.path.join(STDLIB, "email", "*.py"),
            "zh": str(d / "zh.jsonl")}


@pytest.fixture(scope="module")
def tok_dir(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tok"
    train_tokenizer(list(sources.values()), 1024, out, log=lambda *a: None)
    return out


def _inputs(sources, names=("code", "email", "zh")):
    return [f"{n}={sources[n]}" for n in names]


def _stream(out, split):
    meta = read_meta(out)
    parts = [np.fromfile(out / s["bin"], dtype=meta["dtype"]) for s in meta["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.empty(0)


def _docs(out, split):
    """Each document's tokens (without its eos) via the index."""
    meta = read_meta(out)
    docs = []
    for s in meta["splits"][split]["shards"]:
        tokens = np.fromfile(out / s["bin"], dtype=meta["dtype"])
        offsets = np.load(out / s["idx"])
        assert offsets[0] == 0 and offsets[-1] == len(tokens) == s["tokens"] and len(offsets) == s["docs"] + 1
        docs += [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return docs


def test_shards_index_and_meta(sources, tok_dir, tmp_path):
    out = tmp_path / "data"
    meta = prepare(_inputs(sources), tok_dir, out, workers=1, valid_fraction=0.1, chunk_bytes=20_000,
                   shard_chunks=4, log=lambda *a: None)
    tok = load_tokenizer(tok_dir)
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["hash"] == tok.hash
    assert meta == read_meta(out) and not (out / "_state.json").exists()
    assert len(meta["splits"]["train"]["shards"]) > 2
    texts = {r["content"] for r in iter_records(_inputs(sources))}
    n_docs = len(texts)
    train, valid = _docs(out, "train"), _docs(out, "valid")
    assert len(train) + len(valid) == n_docs == sum(v["docs_read"] for v in meta["sources"].values())
    assert 0.04 * n_docs < len(valid) < 0.2 * n_docs
    for doc in train[:40] + valid[:10]:
        assert doc[-1] == tok.eos_id and tok.eos_id not in doc[:-1]  # eos ends each document, only there
        assert tok.decode(doc[:-1]) in texts
    stream = _stream(out, "train")
    assert len(stream) == meta["splits"]["train"]["tokens"] == sum(len(d) for d in train)
    assert (stream == tok.eos_id).sum() == len(train)
    for name, src in meta["sources"].items():
        assert src["tokens_train"] + src["tokens_valid"] > 0 and src["weight"] == 1.0
    assert sum(s["train_share"] for s in meta["sources"].values()) == pytest.approx(1.0, abs=1e-4)
    assert meta["throughput"]["tokens_per_s"] > 0 and meta["bytes_per_token"] > 1


def test_same_bytes_for_any_worker_count(sources, tok_dir, tmp_path):
    outs = []
    for w in (1, 2, 3):
        out = tmp_path / f"w{w}"
        prepare(_inputs(sources), tok_dir, out, workers=w, valid_fraction=0.05, chunk_bytes=30_000, shard_chunks=3,
                log=lambda *a: None)
        outs.append(out)
    names = sorted(p.name for p in outs[0].iterdir() if p.suffix in (".bin", ".npy"))
    assert len(names) >= 8
    for out in outs[1:]:
        assert sorted(p.name for p in out.iterdir() if p.suffix in (".bin", ".npy")) == names
        for n in names:
            assert (out / n).read_bytes() == (outs[0] / n).read_bytes(), n
    # the split is a function of each document: the held-out set does not depend on chunking either
    other = tmp_path / "other_chunks"
    prepare(_inputs(sources), tok_dir, other, workers=1, valid_fraction=0.05, chunk_bytes=7_000, log=lambda *a: None)
    assert sorted(map(bytes, _docs(other, "valid"))) == sorted(map(bytes, _docs(outs[0], "valid")))


def test_mixture_weights(sources, tok_dir, tmp_path):
    base = prepare(_inputs(sources), tok_dir, tmp_path / "base", workers=1, valid_fraction=0.0, log=lambda *a: None)
    mixed = prepare(_inputs(sources), tok_dir, tmp_path / "mix", workers=1, valid_fraction=0.0,
                    weights={"code": 2, "email": 0, "zh": 0.5}, log=lambda *a: None)
    b, m = base["sources"], mixed["sources"]
    assert m["code"]["tokens_train"] == 2 * b["code"]["tokens_train"]
    assert m["code"]["docs_train"] == 2 * b["code"]["docs_train"]
    assert m["email"]["tokens_train"] == 0 and m["email"]["docs_read"] == b["email"]["docs_read"]
    n = b["zh"]["docs_train"]
    assert abs(m["zh"]["docs_train"] - n / 2) < 4 * (n * 0.25) ** 0.5  # Binomial(n, 1/2), 4 sigma
    assert mixed["splits"]["train"]["tokens"] == sum(s["tokens_train"] for s in m.values())
    assert [copies_of(2.25, u) for u in (0.1, 0.3)] == [3, 2]
    with pytest.raises(ValueError, match="no input named 'web'"):
        prepare(_inputs(sources), tok_dir, tmp_path / "bad", weights={"web": 1.0}, log=lambda *a: None)
    with pytest.raises(ValueError, match="both named"):
        prepare([sources["zh"], sources["zh"]], tok_dir, tmp_path / "bad", log=lambda *a: None)


def test_resume_skips_finished_shards_and_matches(sources, tok_dir, tmp_path):
    kw = dict(workers=2, valid_fraction=0.05, chunk_bytes=20_000, shard_chunks=2, log=lambda *a: None)
    full = prepare(_inputs(sources), tok_dir, tmp_path / "full", **kw)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        prepare(_inputs(sources), tok_dir, out, _stop_after_groups=2, **kw)
    assert not (out / "meta.json").exists() and (out / "_state.json").exists()
    assert sorted(p.name for p in out.glob("shard_*.json")) == ["shard_00000.json", "shard_00001.json"]
    assert not list(out.glob(".*.tmp"))  # the interrupted group's temporaries are gone
    with pytest.raises(FileNotFoundError, match="interrupted"):
        read_meta(out)
    stamp = (out / "train_00000.bin").stat().st_mtime_ns
    killed = [out / ".train_00002.bin.0123456789ab.tmp", out / ".train_00002.bin.tmp",  # what a SIGKILL leaves
              out / ".shard_00002.json.x7_abc12.tmp"]
    for f in killed:
        f.write_bytes(b"half")
    meta = prepare(_inputs(sources), tok_dir, out, **kw)
    assert not [f for f in killed if f.exists()]
    assert (out / "train_00000.bin").stat().st_mtime_ns == stamp  # finished shards are not redone
    assert meta["throughput"]["tokenized_chunks"] == full["throughput"]["tokenized_chunks"] - 4
    for f in (tmp_path / "full").iterdir():
        if f.suffix in (".bin", ".npy"):
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert meta["splits"] == full["splits"] and meta["sources"] == full["sources"]
    again = prepare(_inputs(sources), tok_dir, out, **kw)  # complete: nothing to do
    assert again["created"] == meta["created"]


def test_tokenizer_hash_mismatch_is_refused(sources, tok_dir, tmp_path):
    out = tmp_path / "data"
    prepare(_inputs(sources, ("zh",)), tok_dir, out, workers=1, log=lambda *a: None)
    other = tmp_path / "other_tok"
    train_tokenizer(sources["zh"], 512, other, log=lambda *a: None)
    with pytest.raises(TokenizerMismatchError, match="made with tokenizer"):
        prepare(_inputs(sources, ("zh",)), other, out, workers=1, log=lambda *a: None)
    with pytest.raises(TokenizerMismatchError, match="tokenized with tokenizer"):
        check_tokenizer(out, other)
    check_tokenizer(out, tok_dir)
    check_tokenizer(out, load_tokenizer(tok_dir))
    with pytest.raises(ValueError, match="other settings.*valid_fraction"):
        prepare(_inputs(sources, ("zh",)), tok_dir, out, workers=1, valid_fraction=0.2, log=lambda *a: None)
    (out / "train_notes.txt").write_text("not ours")
    stale = out / "train_00042.bin"
    stale.write_bytes(b"\0\0")
    meta = prepare(_inputs(sources, ("zh",)), other, out, workers=1, overwrite=True, log=lambda *a: None)
    assert meta["tokenizer"]["hash"] == load_tokenizer(other).hash
    assert (out / "train_notes.txt").exists() and not stale.exists()  # --overwrite removes only our outputs


def test_uint32_shards_for_large_vocabularies(sources, tok_dir, tmp_path):
    assert shard_dtype(65536) == np.uint16 and shard_dtype(65537) == np.uint32
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    n = load_tokenizer(tok_dir).vocab_size
    data["added_tokens"] += [{"id": n + i, "content": f"<|extra_{i}|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True} for i in range(65600 - n)]
    big = tmp_path / "big"
    big.mkdir()
    (big / "tokenizer.json").write_text(json.dumps(data))
    meta = prepare(_inputs(sources, ("zh",)), big, tmp_path / "data", workers=1, log=lambda *a: None)
    assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] == 65600
    prepare(_inputs(sources, ("zh",)), tok_dir, tmp_path / "small", workers=1, log=lambda *a: None)
    assert np.array_equal(_stream(tmp_path / "data", "train"), _stream(tmp_path / "small", "train"))


def test_cli_prepare_and_errors(sources, tok_dir, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"content": "fine"}\n{"content": \n')
    args = ["prepare", "--input", f"zh={sources['zh']}", str(tmp_path / "bad.jsonl"), "--tokenizer", str(tok_dir),
            "--out", str(tmp_path / "d"), "--workers", "2", "--valid-fraction", "0.05", "--seq-len", "64",
            "--source", "zh=1.5", "--no-progress"]
    assert main(args) == 0
    meta = read_meta(tmp_path / "d")
    assert meta["sources"]["zh"]["weight"] == 1.5 and meta["read"]["bad"] == {"malformed_json": 1}
    assert "bad.jsonl:2: malformed_json" in capsys.readouterr().out
    assert main(args[:-3] + ["--strict", "--out", str(tmp_path / "e")]) == 2
    assert "bad.jsonl:2: malformed_json" in capsys.readouterr().err
    assert not (tmp_path / "e" / "meta.json").exists()
    assert main(["prepare", "--input", sources["zh"], "--tokenizer", str(tok_dir), "--out", str(tmp_path / "f"),
                 "--source", "zh=lots"]) == 2
    assert "expected NAME=WEIGHT" in capsys.readouterr().err
    assert main(["prepare", "--input", sources["zh"], "--tokenizer", str(tok_dir), "--out", str(tmp_path / "g"),
                 "--seq-len", "100000000", "--workers", "1"]) == 2
    assert "fewer than seq_len+1" in capsys.readouterr().err


def test_cli_train_tokenizer(sources, tmp_path, capsys):
    out = tmp_path / "tok"
    assert main(["train-tokenizer", "--input", sources["zh"], sources["code"], "--vocab-size", "600", "--out",
                 str(out), "--backend", "spm"]) == 0
    tok = load_tokenizer(out)
    assert tok.backend == "spm" and tok.vocab_size == 640 and (out / "tokenizer.model").exists()
    assert "peak RSS" in capsys.readouterr().out
    assert main(["train-tokenizer", "--input", str(tmp_path / "nope.jsonl"), "--vocab-size", "600", "--out",
                 str(tmp_path / "t2")]) == 2
    assert "no such file" in capsys.readouterr().err
