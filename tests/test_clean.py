"""Corpus cleaning (zero2all.corpus.clean): generated corpora with planted duplicates, each quality rule at its
published threshold, PII look-alikes, resume after a kill, bad input, the command line."""

from __future__ import annotations

import json
import random
import re
import unicodedata

import numpy as np
import pytest

from zero2all.cli import main
from zero2all.config import ConfigError
from zero2all.corpus.clean import (
    CleanConfig,
    MinHasher,
    choose_bands,
    clean,
    filter_document,
    load_clean_config,
    mask_pii,
    normalize_text,
    s_curve,
)
from zero2all.corpus.clean.filters import c4_filter, code_filter, gopher_quality, gopher_repetition, zh_filter
from zero2all.corpus.clean.normalize import detect_language

STOP = ["the", "be", "to", "of", "and", "that", "have", "with"]
CJK = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 600))  # 600 common-block ideographs


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))


def english_doc(rng: random.Random, vocab: list[str], n_sentences: int = 24) -> str:
    paras, sent = [], []
    for i in range(n_sentences):
        words = [rng.choice(vocab) for _ in range(rng.randint(8, 14))]
        words[1] = rng.choice(STOP)
        words[5] = rng.choice(STOP)
        sent.append(" ".join(words).capitalize() + ".")
        if len(sent) == 4:
            paras.append(" ".join(sent))
            sent = []
    if sent:
        paras.append(" ".join(sent))
    return "\n\n".join(paras)


def chinese_doc(rng: random.Random, n_sentences: int = 12) -> str:
    return "".join("".join(rng.choice(CJK) for _ in range(rng.randint(12, 25))) + "。"
                   for _ in range(n_sentences))


def perturb(text: str, k: int, rng: random.Random, vocab: list[str]) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), k):
        words[i] = rng.choice(vocab) + ("." if words[i].endswith(".") else "")
    return " ".join(words)


def perturb_zh(text: str, k: int, rng: random.Random) -> str:
    chars = list(text)
    for i in rng.sample([i for i, c in enumerate(chars) if c != "。"], k):
        chars[i] = rng.choice(CJK)
    return "".join(chars)


def jaccard(a: str, b: str, mode: str = "word", n: int = 5) -> float:
    def shingles(t):
        if mode == "char":
            t = t.replace(" ", "")
            return {t[i:i + n] for i in range(len(t) - n + 1)}
        w = re.findall(r"[a-z0-9]+", t.lower())
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return str(path)


def read_out(out) -> list[dict]:
    recs = []
    for shard in sorted(out.glob("clean-*.jsonl")):
        recs += [json.loads(line) for line in shard.read_text().splitlines()]
    return recs


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """200 English and 60 Chinese documents, exact copies (some differing only in Unicode form or spacing), near
    duplicates at Jaccard >= 0.8 and dissimilar variants at Jaccard <= 0.5; the cleaned output with 2 workers."""
    rng = random.Random(7)
    vocab = [_word(rng) for _ in range(3000)]
    base = [english_doc(rng, vocab) for _ in range(200)]
    zh = [chinese_doc(rng) for _ in range(60)]
    records, high, low, exact = [], [], [], []

    def add(text, kind, of=None, lang="en"):
        records.append({"id": f"{kind}-{len(records)}", "text": text, "lang": lang})
        if of is not None:
            {"high": high, "low": low, "exact": exact}[kind].append((of, records[-1]["id"], lang))
        return records[-1]["id"]

    ids = [add(t, "base") for t in base] + [add(t, "base", lang="zh") for t in zh]
    for i in range(0, 120):  # near duplicates: 1-4 replaced words
        var = perturb(base[i], rng.randint(1, 4), rng, vocab)
        j = jaccard(base[i], var)
        add(var, "high" if j >= 0.8 else "mid", of=ids[i] if j >= 0.8 else None)
    for i in range(120, 200):  # dissimilar variants: 30-45 replaced words
        var = perturb(base[i], rng.randint(30, 45), rng, vocab)
        j = jaccard(base[i], var)
        add(var, "low" if j <= 0.5 else "mid", of=ids[i] if j <= 0.5 else None)
    for i in range(30):
        var = perturb_zh(zh[i], rng.randint(1, 4), rng)
        if jaccard(zh[i], var, "char") >= 0.8:
            add(var, "high", of=ids[200 + i], lang="zh")
    for i in range(0, 200, 10):  # exact duplicates, also after normalisation
        add(base[i], "exact", of=ids[i])
        add(base[i].replace(" ", "  ", 3), "exact", of=ids[i])
    e_acute = english_doc(rng, vocab).replace("a", "é", 2)
    add(unicodedata.normalize("NFC", e_acute), "base")
    add(unicodedata.normalize("NFD", e_acute), "exact", of=records[-1]["id"])
    tmp = tmp_path_factory.mktemp("planted")
    path = write_jsonl(tmp / "web.jsonl", records)
    out = tmp / "out"
    report = clean([path], out, CleanConfig(workers=2, chunk_docs=64), verbose=False)
    kept = {r["id"] for r in read_out(out)}
    return {"records": records, "high": high, "low": low, "exact": exact, "kept": kept, "report": report,
            "out": out, "path": path}


def test_exact_duplicates_all_removed(planted):
    assert len(planted["exact"]) == 41
    for first, dup, _ in planted["exact"]:
        assert first in planted["kept"] and dup not in planted["kept"]
    assert planted["report"]["removed"]["exact_duplicate"] == 41


def test_near_duplicates_recall_and_false_removals(planted):
    high, low, kept = planted["high"], planted["low"], planted["kept"]
    assert len(high) >= 100 and len(low) >= 50
    assert {lang for *_, lang in high} == {"en", "zh"}
    recall = sum(dup not in kept for _, dup, _ in high) / len(high)
    false = sum(var not in kept for _, var, _ in low) / len(low)
    assert recall >= 0.95, recall
    assert false <= 0.01, false
    assert all(first in kept for first, _, _ in high)  # the first in input order is the one kept


def test_kept_records_unchanged_ids_and_report(planted):
    out = planted["out"]
    recs = read_out(out)
    src = {r["id"]: r for r in planted["records"]}
    assert all(r["data_src"] == "web" and r["id"] in src for r in recs)
    assert [r["id"] for r in recs] == [r["id"] for r in planted["records"] if r["id"] in planted["kept"]]
    rep = json.loads((out / "report.json").read_text())
    s = rep["sources"]["web"]
    assert s["docs_in"] == len(planted["records"]) and s["docs_out"] == len(recs)
    assert s["duplicate_clusters"] > 0 and s["bytes_out"] < s["bytes_in"]
    assert rep["examples"]["near_duplicate"][0]["kept_id"]
    assert (out / "report.md").read_text().startswith("# Cleaning report")
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / ".work").exists()


def test_lsh_parameters_from_the_s_curve():
    b, r = choose_bands(0.8, 128)
    assert b * r <= 128 and s_curve(0.8, b, r) >= 0.95 and s_curve(0.5, b, r) < 0.15
    assert choose_bands(0.9, 128) != (b, r)


def test_minhash_estimates_jaccard():
    rng = random.Random(1)
    vocab = [_word(rng) for _ in range(3000)]
    m = MinHasher(num_perm=256)
    errs = []
    for _ in range(20):
        a = english_doc(rng, vocab)
        b = perturb(a, rng.randint(1, 40), rng, vocab)
        errs.append(np.mean(m.signature(a) == m.signature(b)) - jaccard(a, b))
    assert abs(np.mean(errs)) < 0.03 and np.std(errs) < 0.06
    assert m.signature("...") is None and m.signature("中文", "char") is not None


def test_long_documents_are_hashed_in_segments(monkeypatch):
    from zero2all.corpus.clean import minhash

    m = MinHasher()
    text = " ".join(f"w{i}" for i in range(3000))
    whole = m.shingles(text)
    monkeypatch.setattr(minhash, "_SEGMENT", 1000)
    assert np.array_equal(m.shingles(text), whole)


# ---------------------------------------------------------------------------------------------------- rules

CFG = CleanConfig()
RNG = random.Random(3)
VOCAB = [_word(RNG) for _ in range(2000)]
GOOD = english_doc(RNG, VOCAB)


def test_good_english_document_passes_every_rule():
    out, rule, dropped = filter_document(GOOD, "en", CFG)
    assert rule is None and dropped == 0 and out == GOOD


@pytest.mark.parametrize("text,rule", [
    # Rae et al. 2021 (Gopher), App. A.1.1: 50 to 100,000 words
    ("the cat and the dog sat with me. " * 5, "gopher_word_count"),
    # mean word length 3-10 characters
    ("a b c d e f g h i j the and of to " * 10, "gopher_mean_word_length"),
    ("supercalifragilisticexpialidocious the and " * 30, "gopher_mean_word_length"),
    # symbol-to-word ratio < 0.1 for "#" and the ellipsis
    ("the quick brown fox and the lazy dog # # " * 10, "gopher_symbol_ratio"),
    # at most 90 % of lines start with a bullet
    ("\n".join(f"- the item {w} of {w} list" for w in VOCAB[:30]), "gopher_bullet_lines"),
    # at most 30 % of lines end with an ellipsis
    ("\n".join(f"the story of {w} and more words to read here..." if i % 2 else f"the story of {w} goes on here."
               for i, w in enumerate(VOCAB[:30])), "gopher_ellipsis_lines"),
    # at least 80 % of words with an alphabetic character
    ("the and " + " ".join(str(i) for i in range(1000, 1100)), "gopher_alpha_words"),
    # at least 2 stop words
    (" ".join(VOCAB[:80]), "gopher_stop_words"),
])
def test_gopher_quality_rules(text, rule):
    assert gopher_quality(text, text.split(), CFG.gopher) == rule


def test_gopher_word_count_boundary():
    """Rae et al. 2021, App. A.1.1: 50 words pass, 49 do not."""
    words = ("the cat and dog of that house " * 10).split()
    assert gopher_quality(" ".join(words[:50]), words[:50], CFG.gopher) is None
    assert gopher_quality(" ".join(words[:49]), words[:49], CFG.gopher) == "gopher_word_count"


@pytest.mark.parametrize("text,rule", [
    # Rae et al. 2021, Table A1: duplicate lines <= 30 % of lines
    ("\n".join(["same line"] * 5 + [f"the line {w} of a long text with many words" for w in VOCAB[:6]]),
     "rep_dup_lines"),
    # duplicate paragraphs <= 30 %
    ("\n\n".join(["same para"] * 5 + ["\n".join(f"line {w} of text" for w in VOCAB[i:i + 5]) for i in range(0, 30, 5)]),
     "rep_dup_paragraphs"),
    # characters in duplicate lines <= 20 %
    ("\n".join(["the long repeated line " + " ".join(VOCAB[:30])] * 2 + [f"line {w}" for w in VOCAB[30:40]]),
     "rep_dup_line_chars"),
    # the most frequent 2-gram covers <= 20 % of word characters
    (" ".join(f"quantum physics {w}" for w in VOCAB[:60]), "rep_top_2gram"),
    # duplicated 5-grams cover <= 15 %
    (" ".join(VOCAB[:200]) + " " + " ".join(VOCAB[:40]), "rep_dup_5gram"),
])
def test_gopher_repetition_rules(text, rule):
    assert gopher_repetition(text, text.split(), CFG.repetition) == rule


def _reference_ngram_rule(words, cfg):
    """Table A1's n-gram rules written plainly (Counter of tuples), to check the numpy version against."""
    from collections import Counter

    lens = [len(w) for w in words]
    total = sum(lens)
    for n in range(2, 11):
        grams = list(zip(*(words[i:] for i in range(n))))
        if not grams:
            return None
        counts = Counter(grams)
        if n <= 4:
            c, chars = max((c, sum(map(len, g))) for g, c in counts.items())  # ties: the most characters
            if c > 1 and c * chars / total > cfg.max_top_ngram_fractions[n - 2]:
                return f"rep_top_{n}gram"
            continue
        covered = [False] * len(words)
        for i, g in enumerate(grams):
            if counts[g] > 1:
                covered[i:i + n] = [True] * n
        if sum(l for l, c in zip(lens, covered) if c) / total > cfg.max_dup_ngram_fractions[n - 5]:
            return f"rep_dup_{n}gram"
    return None


def test_ngram_rules_match_a_plain_implementation():
    from zero2all.corpus.clean.filters import _ngram_repetition

    rng = random.Random(9)
    outcomes = set()
    for trial in range(120):
        words = [rng.choice(VOCAB[:rng.choice([5, 30, 300, 2000])]) for _ in range(rng.randint(20, 300))]
        if trial % 3 == 0:  # plant a repeated span
            a = rng.randrange(len(words) - 10)
            span = words[a:a + rng.randint(5, 10)]
            words += span * rng.randint(1, 4)
        got, want = _ngram_repetition(words, CFG.repetition), _reference_ngram_rule(words, CFG.repetition)
        assert got == want, (trial, got, want)
        outcomes.add(got)
    assert len(outcomes) >= 4  # several different rules fired


def test_repetition_passes_varied_text():
    assert gopher_repetition(GOOD, GOOD.split(), CFG.repetition) is None


def test_c4_rules():
    """Raffel et al. 2020, Section 2.2: lines need terminal punctuation and >= 5 words; pages need >= 3 sentences,
    no "lorem ipsum" and no curly bracket; lines with "javascript" are dropped."""
    c4 = CFG.c4
    text = ("The first line has enough words here.\nno terminal punctuation in this line\nToo short.\n"
            "Please enable javascript to view this page.\nThe second good line is right here!\n"
            "Is the third good line here too?")
    out, rule, dropped = c4_filter(text, c4)
    assert rule is None and dropped == 3
    assert out.splitlines() == ["The first line has enough words here.", "The second good line is right here!",
                                "Is the third good line here too?"]
    assert c4_filter("One good sentence is here now.\nAnother good sentence is here.", c4)[1] == \
        "c4_too_few_sentences"
    assert c4_filter(GOOD + "\nLorem ipsum dolor sit amet.", c4)[1] == "c4_lorem_ipsum"
    assert c4_filter(GOOD + "\nfunction f() { return 1; }", c4)[1] == "c4_curly_bracket"


def test_code_rules():
    """Chen et al. 2021 (Codex) / Li et al. 2023 (StarCoder): max line length 1000, mean line length 100,
    alphanumeric fraction 0.25, auto-generated markers."""
    good = "def f(x):\n    return x + 1\n" * 20
    cc = CFG.code
    assert code_filter(good, cc) is None
    assert code_filter(good + "x = '" + "a" * 1001 + "'\n", cc) == "code_max_line_length"
    assert code_filter(("y = " + "b" * 120 + "\n") * 5, cc) == "code_mean_line_length"
    assert code_filter("#### ---- ==== ;;;; ((((\n" * 10, cc) == "code_alnum_fraction"
    assert code_filter("# This file is automatically generated. Do not edit.\n" + good, cc) == "code_autogenerated"


def test_chinese_rules_and_language():
    """Chinese: >= 50 CJK characters, CJK >= 30 % of non-space characters (project thresholds), duplicate lines
    <= 30 % (Rae et al. 2021, Table A1)."""
    zh = chinese_doc(random.Random(5))
    assert detect_language({}, zh) == "zh" and detect_language({"category": "code"}, zh) == "code"
    assert zh_filter(zh, CFG.zh) is None
    assert zh_filter("中文太短了。", CFG.zh) == "zh_min_chars"
    assert zh_filter(zh[:60] + " " + " ".join(VOCAB[:100]), CFG.zh) == "zh_cjk_ratio"
    assert zh_filter("\n".join([zh[:40]] * 5 + [zh[40:60], zh[60:80]]), CFG.zh) == "zh_dup_lines"
    # word rules would wrongly remove Chinese (no spaces -> one "word")
    assert filter_document(zh, "zh", CFG)[1] is None and gopher_quality(zh, zh.split(), CFG.gopher) is not None


def test_normalisation():
    assert normalize_text("Cafe\u0301  au\u00a0lait\r\nx\x00y\u200b\n\n\n\n\nz") == "Café au lait\nxy\n\n\nz"
    assert normalize_text("ｆｕｌｌ１", form="NFKC") == "full1" and normalize_text("ｆｕｌｌ１") == "ｆｕｌｌ１"
    assert normalize_text("def f():\n    x  = 1   \n", code=True) == "def f():\n    x  = 1\n"
    assert normalize_text("中文 文本") == "中文 文本"


# ---------------------------------------------------------------------------------------------------- PII


def test_pii_masked():
    text, counts = mask_pii("Mail jane.doe+x@mail.example.org or call +1 415-555-0132, +44 20 7946 0958 or "
                            "13812345678; hosts 192.168.0.1 and 2001:db8::8a2e:370:7334.")
    assert text == "Mail <EMAIL> or call <PHONE>, <PHONE> or <PHONE>; hosts <IP> and <IP>."
    assert counts == {"email": 1, "phone": 3, "ip": 2}


@pytest.mark.parametrize("text", [
    "version 1.2.3.4", "v1.2.3.4", "release 10.0.0.1", "Python 3.11.7.1",  # versions are not addresses
    "999.1.2.3", "1.2.3.4.5", "01.2.3.4",                                 # octets > 255, longer, leading zeros
    "on 2024-01-15 at 12:30:45", "price $1,234.56", "ISBN 978-3-16-148410-0", "ISBN 9783161484100",
    "order 12345678901234", "std::vector<int> a::b", "@decorator", "user@localhost", "10 + 20 = 30",
    "id 2138123456789",                                                   # a mobile number inside longer digits
])
def test_pii_lookalikes_untouched(text):
    assert mask_pii(text) == (text, {})


# ---------------------------------------------------------------------------------------------------- runs


def _small_corpus(tmp_path, n=60):
    rng = random.Random(11)
    vocab = [_word(rng) for _ in range(1000)]
    docs = [english_doc(rng, vocab, 12) for _ in range(n)]
    recs = [{"id": f"d{i}", "text": t} for i, t in enumerate(docs)] + [{"id": "dup", "text": docs[0]}]
    recs.append({"id": "near", "text": perturb(docs[1], 1, rng, vocab)})
    recs.append({"id": "short", "text": "Too short."})
    return write_jsonl(tmp_path / "small.jsonl", recs)


def test_resume_after_kill_gives_the_same_output(tmp_path):
    path = _small_corpus(tmp_path)
    cfg = CleanConfig(workers=1, chunk_docs=8, shard_chunks=3)
    ref = clean([path], tmp_path / "ref", cfg, verbose=False)

    class Killed(Exception):
        pass

    def kill_after_three(i):
        if i == 2:
            raise Killed

    with pytest.raises(Killed):
        clean([path], tmp_path / "run", cfg, on_chunk_done=kill_after_three, verbose=False)
    assert len(list((tmp_path / "run" / ".work").glob("chunk-*.json"))) == 3
    seen = []
    cfg.workers = 2  # the number of processes is no part of the result: the finished units are kept
    rep = clean([path], tmp_path / "run", cfg, on_chunk_done=seen.append, verbose=False)
    assert seen == list(range(3, 8))  # the three finished units were not redone
    for name in ref["shards"]:
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    assert rep["sources"] == ref["sources"] and rep["removed"] == ref["removed"]
    assert {"exact_duplicate", "near_duplicate", "gopher_word_count"} <= set(rep["removed"])


def test_resume_after_sigkill_of_the_command(tmp_path):
    """A real kill (SIGKILL, so no cleanup runs) part-way through stage 1; the rerun gives the reference output."""
    import os
    import signal
    import subprocess
    import sys
    import time

    path = _small_corpus(tmp_path, n=200)
    args = ["--input", path, "--workers", "1", "chunk_docs=4"]
    assert main(["clean", *args, "--out", str(tmp_path / "ref")]) == 0
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "zero2all.cli", "clean", *args, "--out", str(tmp_path / "run")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work = tmp_path / "run" / ".work"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(work.glob("chunk-*.json"))) < 5:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(work.glob("chunk-*.json")))
    assert 5 <= done < 51, done  # killed part-way
    assert main(["clean", *args, "--out", str(tmp_path / "run")]) == 0
    ref = sorted(p.name for p in (tmp_path / "ref").glob("clean-*.jsonl"))
    assert ref == sorted(p.name for p in (tmp_path / "run").glob("clean-*.jsonl"))
    for name in ref:
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    assert not work.exists()


def test_bad_input_counted_not_fatal(tmp_path):
    good = _small_corpus(tmp_path, n=10)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine but short."}\n{broken\n{"title": "no text"}\n{"text": 5}\n\xff\xfe\n')
    rep = clean([good, str(bad)], tmp_path / "out", CleanConfig(workers=1), verbose=False)
    assert rep["read"]["bad"] == {"malformed_json": 1, "missing_field": 1, "non_string": 1, "invalid_utf8": 1}
    assert any("bad.jsonl:2" in e for e in rep["read"]["examples"])
    assert rep["sources"]["bad"]["docs_in"] == 1 and rep["totals"]["docs_out"] > 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "malformed_json=1" in md and "- T = 5.0: `--source small=" in md and " --source bad=0`" in md


def test_temperature_weights():
    """Arivazhagan et al. 2019: p_i ~ q_i^(1/T); weights w_i = p_i / q_i keep the total size."""
    from zero2all.corpus.clean import temperature_weights

    sizes = {"en": 900.0, "zh": 90.0, "code": 10.0, "empty": 0.0}
    assert temperature_weights(sizes, 1.0) == pytest.approx({"en": 1.0, "zh": 1.0, "code": 1.0, "empty": 0.0})
    w = temperature_weights(sizes, 5.0)
    assert sum(w[k] * sizes[k] for k in sizes) == pytest.approx(1000.0)
    assert w["en"] < 1 < w["zh"] < w["code"] and w["empty"] == 0.0
    p = {k: w[k] * sizes[k] / 1000 for k in sizes}
    assert p["zh"] / p["code"] == pytest.approx((90 / 10) ** (1 / 5))


def test_config_file_overrides_and_errors(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[clean]\nworkers = 3\n[clean.dedup]\nthreshold = 0.7\n[clean.gopher]\nenabled = false\n")
    cfg = load_clean_config(f, ["dedup.num_perm=64", "clean.c4.min_sentences=2"])
    assert (cfg.workers, cfg.dedup.threshold, cfg.dedup.num_perm, cfg.gopher.enabled, cfg.c4.min_sentences) == \
        (3, 0.7, 64, False, 2)
    with pytest.raises(ConfigError, match=r"clean\.dedup\.threshold"):
        load_clean_config(None, ["dedup.threshold=1.5"])
    with pytest.raises(ConfigError, match=r"clean\.dedup\.treshold: unknown key \(did you mean 'threshold'"):
        load_clean_config(None, ["dedup.treshold=0.5"])
    with pytest.raises(ConfigError, match="no \\[clean\\] table"):
        (tmp_path / "d.toml").write_text("[train]\nlr = 1\n")
        load_clean_config(tmp_path / "d.toml")


def test_cli_clean_and_dry_run(tmp_path, capsys):
    path = _small_corpus(tmp_path, n=20)
    assert main(["clean", "--input", f"web={path}", "--out", str(tmp_path / "dry"), "--dry-run", "--workers", "1",
                 "gopher.enabled=false"]) == 0
    text = capsys.readouterr().out
    assert "bands x" in text and "at s=0.5" in text and "| exact_duplicate | 1 | 1 |" in text and "| web |" in text
    assert not (tmp_path / "dry").exists()
    assert main(["clean", "--input", path, "--out", str(tmp_path / "out"), "--workers", "1"]) == 0
    assert (tmp_path / "out" / "clean-00000.jsonl").exists() and (tmp_path / "out" / "report.md").exists()
    assert main(["clean", "--input", path, "--out", str(tmp_path / "x"), "dedup.num_perm=1"]) == 2
    assert "clean.dedup.num_perm" in capsys.readouterr().err
