"""`z2all clean` / `z2all prepare` on Ray (zero2all.corpus.on_ray): a local 2-CPU Ray cluster started here, shared
by the module; the outputs equal the local path's (kept documents, duplicate clusters, report counts; token shards
byte for byte), after a task that fails once and after a driver stopped part-way; decontamination through Ray."""

from __future__ import annotations

import json
import random

import pytest
from test_clean import _word, english_doc, perturb, read_out, write_jsonl

from zero2all.cli import main
from zero2all.corpus.clean import CleanConfig, clean


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'zero2all[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("raycorpus")
    rng = random.Random(3)
    vocab = [_word(rng) for _ in range(900)]
    docs = [english_doc(rng, vocab, 12) for _ in range(70)]
    recs = [{"id": f"d{i}", "text": t} for i, t in enumerate(docs)]
    recs += [{"id": f"exact{i}", "text": docs[i]} for i in range(0, 70, 9)]
    recs += [{"id": f"near{i}", "text": perturb(docs[i], 2, rng, vocab)} for i in range(3, 70, 11)]
    recs.append({"id": "short", "text": "Too short."})
    rng.shuffle(recs)
    return write_jsonl(d / "web.jsonl", recs)


def _same(rep, ref):
    for key in ("totals", "removed", "sources", "examples"):
        assert rep[key] == ref[key], key
    for key in ("exact_clusters", "near_clusters", "verified_pairs"):
        assert rep["dedup"][key] == ref["dedup"][key], key


def test_clean_on_ray_equals_local(cluster, corpus, tmp_path):
    cfg = CleanConfig(workers=1, chunk_docs=9, shard_chunks=3)
    ref = clean([corpus], tmp_path / "local", cfg, verbose=False, ray=False)
    assert ref["removed"]["exact_duplicate"] == 8 and ref["removed"]["near_duplicate"] >= 5
    cfg.workers = 2
    rep = clean([corpus], tmp_path / "ray", cfg, verbose=False, ray=True)
    assert rep["engine"] == "ray"
    _same(rep, ref)
    assert rep["shards"] == ref["shards"]
    for name in ref["shards"]:
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()


class FlakyRecord(dict):
    """A record whose text cannot be read the first time (a marker file says whether it already failed): the Ray
    task holding it raises once, as a worker hit by a transient fault would."""

    def __getitem__(self, key):
        if key == "content":
            import os

            if not os.path.exists(self.marker):
                open(self.marker, "w").close()
                raise RuntimeError("transient fault (planted)")
        return dict.__getitem__(self, key)


def test_clean_on_ray_survives_a_failing_task_and_a_stopped_driver(cluster, corpus, tmp_path, monkeypatch):
    import sys

    from zero2all.corpus.clean import pipeline

    cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    cfg = CleanConfig(workers=1, chunk_docs=9, shard_chunks=3)
    ref = clean([corpus], tmp_path / "local", cfg, verbose=False, ray=False)
    real_chunks = pipeline._chunks
    marker = tmp_path / "failed-once"

    def flaky_chunks(records, c):
        for index, batch in real_chunks(records, c):
            if index == 2:
                flaky = FlakyRecord(batch[0])
                flaky.marker = str(marker)
                batch = [flaky] + batch[1:]
            yield index, batch

    monkeypatch.setattr(pipeline, "_chunks", flaky_chunks)

    class Stop(Exception):
        pass

    def stop_after_four(i):
        if i == 3:
            raise Stop

    cfg.workers = 2
    with pytest.raises(Stop):
        clean([corpus], tmp_path / "ray", cfg, verbose=False, ray=True, on_chunk_done=stop_after_four)
    assert marker.exists()  # unit 2's task failed once and was retried by Ray
    seen = []
    rep = clean([corpus], tmp_path / "ray", cfg, verbose=False, ray=True, on_chunk_done=seen.append)
    assert seen and min(seen) >= 4  # the finished units were not redone (units still in flight may be)
    _same(rep, ref)
    for name in ref["shards"]:
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()


def test_decontamination_through_ray(cluster, corpus, tmp_path):
    records = [json.loads(line) for line in open(corpus)]
    ev = tmp_path / "ev.jsonl"
    picked = [r for r in records if r["id"] in ("d5", "d40")]
    ev.write_text("".join(json.dumps({"q": " ".join(r["text"].split()[30:50])}) + "\n" for r in picked))
    cfg = CleanConfig(workers=1, chunk_docs=9)
    cfg.decontam.sets = [str(ev)]
    ref = clean([corpus], tmp_path / "local", cfg, verbose=False, ray=False)
    cfg.workers = 2
    rep = clean([corpus], tmp_path / "ray", cfg, verbose=False, ray=True)
    assert rep["decontamination"] == ref["decontamination"]
    assert rep["decontamination"]["sets"][0]["docs"] >= 2 and rep["removed"]["contaminated"] >= 2
    assert {"d5", "d40"}.isdisjoint(r["id"] for r in read_out(tmp_path / "ray"))


def test_prepare_on_ray_byte_identical_and_resumable(cluster, corpus, tmp_path):
    from zero2all.data.pretokenize import prepare
    from zero2all.tokenizer import train_tokenizer

    train_tokenizer([corpus], 384, tmp_path / "tok", log=lambda *a: None)
    kw = dict(valid_fraction=0.1, chunk_bytes=4096, shard_chunks=4, log=lambda *a: None)
    ref = prepare([corpus], tmp_path / "tok", tmp_path / "local", workers=1, ray=False, **kw)
    assert len(ref["splits"]["train"]["shards"]) >= 3
    with pytest.raises(KeyboardInterrupt):
        prepare([corpus], tmp_path / "tok", tmp_path / "ray", workers=2, ray=True, _stop_after_groups=1, **kw)
    meta = prepare([corpus], tmp_path / "tok", tmp_path / "ray", workers=2, ray=True, **kw)
    assert meta["throughput"]["tokenized_chunks"] < ref["throughput"]["tokenized_chunks"]  # resumed
    assert meta["splits"] == ref["splits"] and meta["sources"] == ref["sources"]
    for f in sorted((tmp_path / "local").glob("*_0000*")):
        assert (tmp_path / "ray" / f.name).read_bytes() == f.read_bytes(), f.name


def test_missing_extra_is_one_line(corpus, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, as without the extra
    assert main(["clean", "--input", corpus, "--out", str(tmp_path / "o"), "--ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'zero2all[ray]'" in err[0]
    assert not (tmp_path / "o").exists()
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # RAY_ADDRESS alone asks for Ray too
    assert main(["prepare", "--input", corpus, "--tokenizer", str(tmp_path), "--out", str(tmp_path / "p")]) == 2
    assert "zero2all[ray]" in capsys.readouterr().err and not (tmp_path / "p").exists()
    # --no-ray: here, whatever RAY_ADDRESS says
    assert main(["clean", "--input", corpus, "--out", str(tmp_path / "here"), "--workers", "1", "--no-ray"]) == 0


def test_tokenizer_sample_on_ray_equals_local(cluster, corpus, tmp_path):
    from zero2all.tokenizer import train_tokenizer

    lines = open(corpus).read().splitlines(keepends=True)
    files = []
    for i in range(3):  # three shards, one Ray task each
        files.append(tmp_path / f"part{i}.jsonl")
        files[-1].write_text("".join(lines[i::3]))
    budget = sum(len(json.loads(x)["text"].encode()) for x in lines) // 4
    local = train_tokenizer([str(f) for f in files], 384, None, sample_bytes=budget, log=lambda *a: None, ray=False)
    on_ray = train_tokenizer([str(f) for f in files], 384, None, sample_bytes=budget, log=lambda *a: None, ray=True)
    assert on_ray.hash == local.hash and on_ray.meta["training"]["fed_bytes"] <= budget
    assert on_ray.meta["training"]["read"]["records"] == len(lines)


def test_prepare_sft_on_ray_equals_local(cluster, tmp_path):
    from pathlib import Path

    from zero2all.data.sft_shards import prepare_sft
    from zero2all.tokenizer import train_tokenizer

    data = Path(__file__).resolve().parents[1] / "examples" / "sft" / "train.jsonl"
    text = tmp_path / "text.jsonl"  # the tokenizer learns from the raw lines
    text.write_text("".join(json.dumps({"text": line}) + "\n" for line in data.read_text().splitlines()))
    train_tokenizer([str(text)], 384, tmp_path / "tok", log=lambda *a: None)
    kw = dict(valid_fraction=0.2, chunk_records=8, log=lambda *a: None, command="x")
    ref = prepare_sft([data], tmp_path / "tok", tmp_path / "local", ray=False, **kw)
    got = prepare_sft([data], tmp_path / "tok", tmp_path / "ray", workers=2, ray=True, **kw)
    assert got["splits"] == ref["splits"] and got["splits"]["train"]["samples"] > 0
    for f in sorted((tmp_path / "local").iterdir()):
        if f.name != "meta.json":
            assert (tmp_path / "ray" / f.name).read_bytes() == f.read_bytes(), f.name


def test_local_pools_stop_forking_once_ray_is_loaded(monkeypatch):
    """Ray's gRPC threads outlive ray.shutdown(); a child forked while one holds a lock waits on it forever (a later
    local `prepare` in the same process hung so). Local pools fork only while Ray is not loaded, else spawn."""
    import multiprocessing as mp
    import sys

    from zero2all.corpus.on_ray import local_pool_context

    monkeypatch.setitem(sys.modules, "ray", object())
    assert local_pool_context().get_start_method() == "spawn"
    monkeypatch.delitem(sys.modules, "ray")
    want = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    assert local_pool_context().get_start_method() == want
