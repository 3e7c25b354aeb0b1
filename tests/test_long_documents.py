"""Long documents: `prepare` and `train-tokenizer` cut them into bounded pieces (zero2all/corpus/pieces.py), so peak
memory does not grow with ~150 bytes per character of the longest document; documents below the piece size give
the same bytes as before, and the cuts fall where the tokens of the pieces equal those of the whole."""

import functools
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from zero2all.corpus.pieces import MAX_PIECE_CHARS, text_pieces
from zero2all.data.pretokenize import prepare
from zero2all.tokenizer import load_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=None)
def _stdlib_source(newlines: bool) -> str:
    parts, n = [], 0
    for f in sorted((STDLIB / "email").rglob("*.py")) + sorted(STDLIB.glob("*.py")):
        t = f.read_text(encoding="utf-8", errors="replace")
        parts.append(t if newlines else t.replace("\n", " "))
        n += len(t)
        if n > LONG_DOC_CHARS:
            break
    return ("\n" if newlines else " ").join(parts)


def stdlib_text(n_chars: int, newlines: bool = True) -> str:
    """The first ``n_chars`` characters of stdlib source (one line when not ``newlines``)."""
    return _stdlib_source(newlines)[:n_chars]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("longdoc")
    train_tokenizer([str(STDLIB / "json" / "*.py"), str(STDLIB / "email" / "*.py")], 512, root / "tok",
                    log=lambda *a: None)
    return root / "tok"


def test_pieces_join_back_and_are_bounded():
    text = stdlib_text(300_000)
    for max_chars in (2, 100, 4096):
        pieces = list(text_pieces(text[:20_000] if max_chars < 100 else text, max_chars))
        assert "".join(pieces) == (text[:20_000] if max_chars < 100 else text)
        assert all(0 < len(p) <= max_chars for p in pieces)
    assert list(text_pieces("short", 10)) == ["short"]
    blob = "x" * 10_000  # no whitespace at all: hard cuts at the window's end
    assert [len(p) for p in text_pieces(blob, 4096)] == [4096, 4096, 1808]


@pytest.mark.parametrize("newlines", [True, False])
def test_pieces_encode_to_the_tokens_of_the_whole(tok_dir, newlines):
    """The cuts fall where the pre-tokenizer cuts anyway: the pieces' tokens are the whole text's, code with its
    newlines or one long line alike."""
    tok = load_tokenizer(tok_dir)
    text = stdlib_text(200_000, newlines) + " 日本語のテキスト 1234 ünïcödé"
    pieces = list(text_pieces(text, 4096))
    assert len(pieces) > 40
    assert [i for p in pieces for i in tok.encode(p)] == tok.encode(text)


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name.endswith((".bin", ".npy"))}


def test_prepare_bytes_below_and_above_the_piece_size(tok_dir, tmp_path):
    """Documents below the piece size: the same shard bytes as without any cutting. A document above it: the same
    tokens as encoding it whole."""
    docs = [{"text": stdlib_text(3000 + 500 * i)} for i in range(8)] + [{"text": stdlib_text(150_000, False)}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    quiet = dict(workers=1, valid_fraction=0.0, log=lambda *a: None)
    prepare([str(tmp_path / "c.jsonl")], tok_dir, tmp_path / "whole", piece_chars=1 << 30, **quiet)
    prepare([str(tmp_path / "c.jsonl")], tok_dir, tmp_path / "default", **quiet)
    prepare([str(tmp_path / "c.jsonl")], tok_dir, tmp_path / "small", piece_chars=4096, **quiet)
    assert _shards(tmp_path / "whole") == _shards(tmp_path / "default") == _shards(tmp_path / "small")
    assert len(docs[-1]["text"]) > 2 * 4096 and max(len(d["text"]) for d in docs[:-1]) < MAX_PIECE_CHARS
    tokens = np.fromfile(tmp_path / "small" / "train_00000.bin", dtype=np.uint16)
    assert len(tokens) > 30_000


def _peak_rss_mb(argv: list[str]) -> tuple[float, str]:
    """Run ``python -m zero2all.cli ARGV`` in a fresh interpreter that reports the peak RSS of its children (the
    command and its worker processes: RUSAGE_CHILDREN takes the largest)."""
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stderr.write(r.stderr); sys.exit(r.returncode) if r.returncode else "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "zero2all.cli", *argv],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.strip().splitlines()[-1]), r.stderr


# A 2 MB single-line document (50 MB would take minutes to tokenize on 2 cores). The bound is on the growth of the
# peak RSS over the same command on a 1 kB document (the interpreter and its imports, ~100 MB, vary by machine):
# without pieces the growth was ~150 bytes per character in `prepare` and ~75 in `train-tokenizer` (8 MB line:
# 1,346 MB and 713 MB peak); cut into pieces it is a few copies of the text (8 MB line: 119 MB and 104 MB).
LONG_DOC_CHARS = 2_000_000
GROWTH_BOUND_MB = 60  # 30 bytes per character of the document


@pytest.mark.parametrize("command", ["prepare", "train-tokenizer"])
def test_a_long_single_line_document_stays_within_the_memory_bound(command, tok_dir, tmp_path):
    text = stdlib_text(LONG_DOC_CHARS, newlines=False)
    assert len(text) == LONG_DOC_CHARS and "\n" not in text
    peaks = {}
    for name, doc in (("small", text[:1000]), ("long", text)):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"text": doc}) + "\n")
        if command == "prepare":
            argv = ["prepare", "--input", str(tmp_path / f"{name}.jsonl"), "--tokenizer", str(tok_dir),
                    "--out", str(tmp_path / f"data-{name}"), "--workers", "1", "--valid-fraction", "0"]
        else:
            argv = ["train-tokenizer", "--input", str(tmp_path / f"{name}.jsonl"), "--vocab-size", "512",
                    "--min-frequency", "1", "--out", str(tmp_path / f"tok-{name}")]
        peaks[name], _ = _peak_rss_mb(argv)
    growth = peaks["long"] - peaks["small"]
    assert growth < GROWTH_BOUND_MB, f"{command}: peak RSS {peaks['small']:.0f} MB -> {peaks['long']:.0f} MB"
    if command == "prepare":
        meta = json.loads((tmp_path / "data-long" / "meta.json").read_text())
        assert meta["splits"]["train"]["docs"] == 1 and meta["splits"]["train"]["tokens"] > LONG_DOC_CHARS // 4
