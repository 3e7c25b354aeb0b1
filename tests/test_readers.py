import gzip
import json
import os
import sysconfig

import pytest

from zero2all.corpus.readers import (
    RECORD_FIELDS,
    BadInputError,
    ReadStats,
    iter_records,
    iter_texts,
    stdlib_files,
    write_jsonl,
)

DOCS = [{"id": "a", "content": "第一篇文章：你好，世界。", "title": "t1", "lang": "zh"},
        {"id": "b", "content": "def f(x):\n\treturn x  # tab\n", "category": "code"},
        {"content": "emoji 😀 and ünïcödé", "desc": "d", "others": {"k": 1}}]


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    if str(path).endswith(".gz"):
        data = gzip.compress(data)
    elif str(path).endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def _jsonl(docs) -> bytes:
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.jsonl.zst", "d.json", "d.json.gz", "d.json.zst"])
def test_json_formats_yield_the_schema(tmp_path, name):
    data = _jsonl(DOCS) if ".jsonl" in name else json.dumps(DOCS, ensure_ascii=False).encode()
    f = _write(tmp_path / name, data)
    stats = ReadStats()
    recs = list(iter_records(str(f), stats=stats))
    assert [r["content"] for r in recs] == [d["content"] for d in DOCS]
    assert all(tuple(r) == RECORD_FIELDS for r in recs)
    assert [r["gid"] for r in recs] == [0, 1, 2]
    assert recs[0]["id"] == "a" and recs[0]["title"] == "t1" and recs[0]["others"] == {"lang": "zh"}
    assert recs[1]["category"] == "code" and recs[2]["desc"] == "d" and recs[2]["others"] == {"k": 1}
    assert recs[2]["id"].startswith("d.json")  # no id field: file and position
    assert recs[0]["data_src"] == "d"
    assert stats.records == 3 and not stats.bad


def test_json_array_is_streamed_not_loaded(tmp_path, monkeypatch):
    # a 2000-item array: items arrive before the file is read to its end
    f = tmp_path / "big.json"
    f.write_text(json.dumps([{"text": f"doc {i}"} for i in range(2000)]))
    reads = []
    import zero2all.corpus.readers as readers

    real_open = readers.open_binary

    def counting_open(path):
        fh = real_open(path)
        orig = fh.read

        def read(n=-1):
            out = orig(n)
            reads.append(len(out))
            return out

        fh.read = read
        return fh

    monkeypatch.setattr(readers, "open_binary", counting_open)
    it = iter_records(str(f), text_field="text")
    first = next(it)
    assert first["content"] == "doc 0"
    assert sum(reads) < os.path.getsize(f)
    assert sum(1 for _ in it) == 1999


def test_parquet_reads_selected_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": [f"row {i} 中文" for i in range(2500)], "title": ["t"] * 2500,
                      "junk": [b"x" * 10] * 2500})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=700)
    recs = list(iter_records(str(tmp_path / "p.parquet"), text_field="text"))
    assert len(recs) == 2500 and recs[2499]["content"] == "row 2499 中文" and recs[0]["title"] == "t"
    assert recs[0]["others"] == {}  # "junk" is not a schema column: never read
    assert recs[1234]["id"] == "p.parquet:#1234"


def test_txt_modes_and_compression(tmp_path):
    text = "first block\nline two\n\n\n  second block\n\nthird 中文\n"
    for name in ("a.txt", "b.txt.gz", "c.txt.zst"):
        _write(tmp_path / name, text.encode())
    whole = list(iter_records(str(tmp_path / "a.txt")))
    assert len(whole) == 1 and whole[0]["content"] == text
    for name in ("a.txt", "b.txt.gz", "c.txt.zst"):
        paras = list(iter_records(str(tmp_path / name), txt_mode="paragraph"))
        assert [r["content"] for r in paras] == ["first block\nline two", "  second block", "third 中文"]
        assert paras[1]["id"] == f"{name}:5"


def test_directories_and_globs_recurse_sorted(tmp_path):
    _write(tmp_path / "d" / "b" / "x.jsonl", _jsonl([{"text": "b/x"}]))
    _write(tmp_path / "d" / "a.jsonl.gz", _jsonl([{"text": "a"}]))
    _write(tmp_path / "d" / "b" / "c" / "y.txt", b"b/c/y")
    _write(tmp_path / "d" / "notes.md", b"not data")
    assert list(iter_texts(str(tmp_path / "d"))) == ["a", "b/c/y", "b/x"]
    assert list(iter_texts(str(tmp_path / "d" / "**" / "*.jsonl"))) == ["b/x"]
    # several sources, named: gids continue, data_src is the name
    recs = list(iter_records([f"one={tmp_path / 'd' / 'a.jsonl.gz'}", str(tmp_path / "d" / "b" / "x.jsonl")]))
    assert [(r["gid"], r["data_src"]) for r in recs] == [(0, "one"), (1, "x")]
    with pytest.raises(FileNotFoundError, match="no such file"):
        list(iter_records(str(tmp_path / "missing.jsonl")))
    with pytest.raises(FileNotFoundError, match="matches no files"):
        list(iter_records(str(tmp_path / "*.parquet")))


def test_stdlib_source_excludes_tests_and_site_packages():
    files = stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    rel = [os.path.relpath(f, root) for f in files]
    assert any(r == "json/decoder.py" or r == os.path.join("json", "decoder.py") for r in rel)
    assert not any("site-packages" in r or "/test/" in f"/{r}" or os.path.basename(r).startswith("test_")
                   for r in rel)
    stats = ReadStats()
    n = sum(1 for r in iter_records("stdlib", stats=stats) if r["data_src"] == "stdlib" and r["category"] == "code")
    assert n == stats.records > 300 and stats.bytes > 5e6 and not stats.bad


def test_bad_inputs_are_counted_with_locations(tmp_path):
    lines = [b'{"content": "ok 1"}', b'{"content": "broken', b'{"content": "bad \xff utf8"}',
             b'{"title": "no text"}', b'{"content": 42}', b'[1, 2]', b'', b'{"content": "ok 2"}']
    _write(tmp_path / "bad.jsonl", b"\n".join(lines) + b"\n")
    _write(tmp_path / "empty.jsonl", b"")
    _write(tmp_path / "empty.txt", b"  \n")
    _write(tmp_path / "latin1.txt", "caf\xe9 au lait\nline 2 \xff".encode("latin-1"))
    (tmp_path / "trunc.jsonl.gz").write_bytes(gzip.compress(_jsonl([{"content": "x" * 5000}]))[:40])
    _write(tmp_path / "broken.json", b'[{"content": "a"}, {"content": ')
    _write(tmp_path / "utf.json", b'[{"content": "b"}, {"content": "bad \xff"}, {"content": "never"}]')
    stats = ReadStats(max_examples=20)
    recs = list(iter_records(str(tmp_path), stats=stats))
    assert sorted(r["content"] for r in recs) == ["a", "b", "ok 1", "ok 2"]
    assert stats.bad == {"malformed_json": 3, "invalid_utf8": 3, "missing_field": 1, "non_string": 1,
                         "empty_file": 2, "unreadable": 1}
    text = "\n".join(stats.examples)
    assert f"{tmp_path / 'bad.jsonl'}:2: malformed_json" in text
    assert f"{tmp_path / 'bad.jsonl'}:3: invalid_utf8" in text
    assert f"{tmp_path / 'bad.jsonl'}:4: missing_field" in text
    assert f"{tmp_path / 'bad.jsonl'}:5: non_string: field 'content' is int" in text
    assert f"{tmp_path / 'latin1.txt'}:1: invalid_utf8" in text
    assert f"{tmp_path / 'broken.json'}:#1: malformed_json" in text
    assert f"{tmp_path / 'trunc.jsonl.gz'}:0: unreadable: EOFError" in text
    assert f"{tmp_path / 'utf.json'}:#1: invalid_utf8: lexical error: invalid bytes in UTF8 string." in text
    assert "skipped 11 bad inputs" in stats.report()


def test_strict_mode_names_file_and_line(tmp_path):
    f = _write(tmp_path / "bad.jsonl", b'{"content": "ok"}\n{"content": "x"}\n{oops\n')
    with pytest.raises(BadInputError, match=r"bad\.jsonl:3: malformed_json"):
        list(iter_records(str(f), strict=True))
    g = _write(tmp_path / "t.jsonl", b'{"text": "ok"}\n')
    with pytest.raises(BadInputError, match=r"t\.jsonl:1: missing_field: no text field 'body'"):
        list(iter_records(str(g), text_field="body", strict=True))


def test_write_jsonl_is_atomic_and_keeps_non_ascii(tmp_path):
    out = tmp_path / "out.jsonl"
    assert write_jsonl(iter_records(str(_write(tmp_path / "in.jsonl", _jsonl(DOCS)))), out) == 3
    raw = out.read_bytes()
    assert "你好".encode() in raw and b"\\u" not in raw
    assert [r["content"] for r in iter_records(str(out))] == [d["content"] for d in DOCS]

    def dies():
        yield {"content": "one"}
        raise RuntimeError("killed half-way")

    with pytest.raises(RuntimeError):
        write_jsonl(dies(), out)
    assert out.read_bytes() == raw  # the old complete file, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]  # no temporary left
    write_jsonl(({"content": "z"} for _ in range(3)), tmp_path / "c.jsonl.zst")
    assert list(iter_texts(str(tmp_path / "c.jsonl.zst"))) == ["z"] * 3
