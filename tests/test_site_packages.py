"""The site-packages corpus on a small fake site-packages tree: split by package, dedup of vendored copies,
determinism and the byte cap."""

import json

import pytest

from zero2all.corpus.site_packages import build_site_packages_corpus, find_packages, split_packages


def _tree(root, n_packages=12):
    """``n_packages`` packages of three files each, a single-module package, a namespace folder, metadata and a
    vendored copy of ``pkg00/core.py`` inside ``vendorer`` (its import rewritten as vendoring does)."""
    for i in range(n_packages):
        pkg = root / f"pkg{i:02d}"
        (pkg / "sub").mkdir(parents=True)
        (pkg / "__init__.py").write_text(f'"""Package {i}."""\n')
        (pkg / "core.py").write_text(f"import os\n\ndef f{i}(x):\n    '''Double {i}.'''\n    return {i} * x\n")
        (pkg / "sub" / "util.py").write_text(f"VALUE_{i} = {i * 7}\n" * (i + 1))
        (pkg / "__pycache__").mkdir()
        (pkg / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"\0\1")
    (root / "pkg00-1.0.dist-info").mkdir()
    (root / "pkg00-1.0.dist-info" / "METADATA").write_text("Name: pkg00\n")
    (root / "single.py").write_text("def single():\n    return 1\n")
    (root / "ns" / "inner").mkdir(parents=True)
    (root / "ns" / "inner" / "__init__.py").write_text("INNER = 1\n")
    vend = root / "vendorer" / "_vendor" / "pkg00"
    vend.mkdir(parents=True)
    (root / "vendorer" / "__init__.py").write_text("VENDORER = True\n")
    (vend / "core.py").write_text("from vendorer._vendor import os\n\ndef f0(x):\n    '''Double 0.'''\n"
                                  "    return 0 * x\n")
    return root


def test_packages_found(tmp_path):
    names = [p.name for p in find_packages([_tree(tmp_path)])]
    assert names == sorted([f"pkg{i:02d}" for i in range(12)] + ["single", "ns.inner", "vendorer"])
    pkg = find_packages([tmp_path])[1]
    assert [pkg.relpath(f) for f in pkg.files] == ["pkg00/__init__.py", "pkg00/core.py", "pkg00/sub/util.py"]


def test_split_by_package_no_overlap_and_deterministic(tmp_path):
    _tree(tmp_path)
    a = build_site_packages_corpus([tmp_path], valid_fraction=0.3, seed=3)
    b = build_site_packages_corpus([tmp_path], valid_fraction=0.3, seed=3)
    assert a.files == b.files and a.manifest == b.manifest
    train_pk = {f[0] for f in a.files["train"]}
    valid_pk = {f[0] for f in a.files["valid"]}
    assert train_pk and valid_pk and not train_pk & valid_pk
    assert valid_pk == set(a.manifest["packages"]["valid"])
    # each package is whole on its side (its three files, minus a copy dropped as a duplicate)
    for pk in valid_pk - {"vendorer", "single", "ns.inner"}:
        assert sum(f[0] == pk for f in a.files["valid"]) == 3
    recs = list(a.records())
    assert {r["others"]["split"] for r in recs if r["others"]["package"] in valid_pk} == {"valid"}
    c = build_site_packages_corpus([tmp_path], valid_fraction=0.3, seed=4)
    assert set(c.manifest["packages"]["valid"]) != valid_pk  # the seed chooses
    listed = build_site_packages_corpus([tmp_path], valid_packages=["pkg03", "single"])
    assert listed.manifest["packages"]["valid"] == ["pkg03", "single"]
    with pytest.raises(ValueError, match="nosuch"):
        split_packages(["a", "b"], valid_packages=["nosuch"])


def test_vendored_copy_dropped_and_kept_in_train(tmp_path):
    _tree(tmp_path)
    c = build_site_packages_corpus([tmp_path], valid_packages=["vendorer"])
    rels = {f[1] for s in ("train", "valid") for f in c.files[s]}
    assert "pkg00/core.py" in rels and "vendorer/_vendor/pkg00/core.py" not in rels
    assert c.manifest["dropped"]["duplicate"] == 1
    assert c.manifest["duplicate_examples"] == [{"dropped": "vendorer/_vendor/pkg00/core.py",
                                                 "copy_of": "pkg00/core.py"}]
    # the other way round: the original held out, the vendored copy read first in train; text still in one split
    d = build_site_packages_corpus([tmp_path], valid_packages=["pkg00"])
    valid_rels = {f[1] for f in d.files["valid"]}
    assert "pkg00/core.py" not in valid_rels and "vendorer/_vendor/pkg00/core.py" in {f[1] for f in d.files["train"]}
    json.dumps(d.manifest)


def test_byte_cap(tmp_path):
    _tree(tmp_path)
    full = build_site_packages_corpus([tmp_path], valid_fraction=0.3, seed=1)
    total = sum(full.manifest["bytes"].values())
    cap = total // 2
    c = build_site_packages_corpus([tmp_path], valid_fraction=0.3, seed=1, max_bytes=cap)
    got = sum(c.manifest["bytes"].values())
    assert cap * 0.8 <= got <= cap
    assert c.manifest["bytes"]["valid"] <= int(cap * 0.3)
    assert c.manifest["dropped"]["over_cap_bytes"] == total - got
    assert c.files == build_site_packages_corpus([tmp_path], valid_fraction=0.3, seed=1, max_bytes=cap).files


def test_cli_corpus_then_prepare_keeps_the_package_split(tmp_path, capsys):
    """`z2all corpus` writes train/valid jsonl; `prepare` pins every record to its package's split (with a valid
    fraction that would otherwise hold out documents of train packages too)."""
    from zero2all.cli import main
    from zero2all.data.pretokenize import prepare, read_meta
    from zero2all.tokenizer import train_tokenizer

    _tree(tmp_path / "sp")
    out = tmp_path / "corpus"
    assert main(["corpus", "--site-packages", str(tmp_path / "sp"), "--out", str(out),
                 "--valid-package", "pkg03", "--valid-package", "single"]) == 0
    assert "valid 2 packages, 4 files" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["packages"]["valid"] == ["pkg03", "single"]
    valid_recs = [json.loads(x) for x in (out / "valid.jsonl").read_text().splitlines()]
    assert {r["package"] for r in valid_recs} == {"pkg03", "single"} and {r["split"] for r in valid_recs} == {"valid"}
    tok = tmp_path / "tok"
    train_tokenizer([str(out)], 336, tok, log=lambda *a: None)
    meta = prepare([str(out)], tok, tmp_path / "data", workers=1, valid_fraction=0.5, log=lambda *a: None)
    assert meta["splits"]["valid"]["docs"] == len(valid_recs) == 4
    assert meta["splits"]["train"]["docs"] == manifest["files"]["train"]
    assert read_meta(tmp_path / "data")["splits"]["valid"]["docs"] == 4


@pytest.mark.parametrize("argv, message", [
    (["--max-mb", "0"], "--max-mb: 0.0 must be > 0"),
    (["--valid-fraction", "1.5"], "--valid-fraction: 1.5 must be in [0, 1)"),
    (["--valid-package", "nosuch"], "valid packages nosuch: not installed"),
])
def test_cli_corpus_bad_input(tmp_path, capsys, argv, message):
    from zero2all.cli import main

    _tree(tmp_path / "sp")
    out = tmp_path / "corpus"
    assert main(["corpus", "--site-packages", str(tmp_path / "sp"), "--out", str(out)] + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not out.exists()
    assert main(["corpus", "--site-packages", str(tmp_path / "nodir"), "--out", str(out)]) == 2
    assert "--site-packages" in capsys.readouterr().err


def test_source_name_reads_both_splits(tmp_path, monkeypatch):
    """`--input site-packages` (and :train / :valid) wherever `stdlib` is accepted: here on the fake tree."""
    from zero2all.corpus import readers

    _tree(tmp_path)
    monkeypatch.setattr(readers, "_site_packages_corpus",
                        lambda: build_site_packages_corpus([tmp_path], valid_packages=["pkg01"]))
    both = list(readers.iter_records("site-packages"))
    valid = list(readers.iter_records("site-packages:valid"))
    assert {r["others"]["split"] for r in valid} == {"valid"} and [r["id"] for r in valid] == [
        "pkg01/__init__.py", "pkg01/core.py", "pkg01/sub/util.py"]
    assert len(both) == len(list(readers.iter_records("site-packages:train"))) + 3
    assert both[0]["data_src"] == "site-packages" and len(readers.expand_paths("site-packages")) == len(both)
