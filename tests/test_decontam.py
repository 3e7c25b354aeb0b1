"""Benchmark decontamination (zero2all.corpus.decontam) through `z2all clean`: planted overlaps with evaluation sets
(exact, with case / spacing / punctuation changes, a 12-word near miss that must stay), counts per set, report-only
mode, bad evaluation-set paths, and the warning of `z2all eval`."""

from __future__ import annotations

import json
import random

import pytest
from test_clean import _word, english_doc, read_out, write_jsonl

from zero2all.cli import main
from zero2all.corpus.clean import CleanConfig, clean
from zero2all.corpus.decontam import build_index, ngram_hashes

# two evaluation sets, their words drawn from outside the training vocabulary (no chance overlaps)
QUESTIONS = ["Which ancient harbour city exported purple dye woven cloth and cedar timber to every kingdom "
             "around the inland sea?",
             "How many kilograms of copper ore must a smelter roast before the first bright ingot forms "
             "inside the clay crucible?"]
STORY = ("The lighthouse keeper counted seventeen gulls circling above the broken pier while the northern "
         "fog rolled slowly toward the silent fishing village")


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalsets")
    qa = d / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": q, "choices": ["a", "b"], "answer": "a"}) + "\n"
                          for q in QUESTIONS))
    (d / "story").mkdir()
    (d / "story" / "part1.txt").write_text(STORY + ".\n")
    (d / "story" / "part2.txt").write_text("Tiny.\n")  # shorter than 13 words: counted, not indexed
    return {"qa": str(qa), "story": str(d / "story")}


def test_ngrams_ignore_case_spacing_and_punctuation():
    base = ngram_hashes(QUESTIONS[0])
    assert len(base) == len(QUESTIONS[0].split()) - 12
    changed = "WHICH ancient  harbour\ncity, exported \u201cpurple\u201d DYE woven cloth and cedar timber to every " \
              "kingdom around the inland sea"
    assert list(ngram_hashes(changed)) == list(base)
    assert len(ngram_hashes(" ".join(QUESTIONS[0].split()[:12]))) == 0
    # Chinese: one word per ideograph
    assert len(ngram_hashes("\u4e00\u4e01\u4e02\u4e03" * 4, n=13)) == 16 - 12
    # one changed word: only the n-grams around it differ
    words = QUESTIONS[0].split()
    words[15] = "zebra"
    assert len(set(ngram_hashes(" ".join(words))) & set(base.tolist())) == 15 - 12  # those ending before word 15


def _corpus(tmp_path):
    rng = random.Random(5)
    vocab = [_word(rng) for _ in range(800)]
    docs = {f"d{i}": english_doc(rng, vocab, 12) for i in range(12)}

    def plant(doc: str, sentence: str) -> str:
        paras = doc.split("\n\n")
        paras[1] = paras[1] + " " + sentence
        return "\n\n".join(paras)

    twelve = " ".join(QUESTIONS[0].rstrip("?").split()[:12])
    docs["exact_qa"] = plant(english_doc(rng, vocab, 12), QUESTIONS[1])
    docs["changed_qa"] = plant(english_doc(rng, vocab, 12),
                               QUESTIONS[0].upper().replace(" ", "   ").replace("timber", "timber,\n"))
    docs["near_miss"] = plant(english_doc(rng, vocab, 12), f"Indeed {twelve} wrapped in old sailcloth today.")
    docs["story_copy"] = plant(english_doc(rng, vocab, 12), STORY + ".")
    docs["both"] = plant(plant(english_doc(rng, vocab, 12), STORY + "."), QUESTIONS[1])
    path = write_jsonl(tmp_path / "train.jsonl", [{"id": k, "text": v} for k, v in docs.items()])
    return path, docs


def test_clean_removes_planted_overlaps_counted_per_set(tmp_path, sets):
    path, docs = _corpus(tmp_path)
    cfg = CleanConfig(workers=1, chunk_docs=5, examples=5)
    cfg.decontam.sets = [sets["qa"], f"tale={sets['story']}"]
    rep = clean([path], tmp_path / "out", cfg, verbose=False)
    kept = {r["id"] for r in read_out(tmp_path / "out")}
    contaminated = {"exact_qa", "changed_qa", "story_copy", "both"}
    assert kept == set(docs) - contaminated  # the 12-word near miss stays
    assert rep["removed"]["contaminated"] == 4
    dc = rep["decontamination"]
    assert dc["mode"] == "remove" and dc["ngram"] == 13 and dc["documents"] == 4
    by = {s["name"]: s for s in dc["sets"]}
    assert by["qa"]["docs"] == 3 and by["tale"]["docs"] == 2  # "both" counts in each set
    assert {e["id"] for e in by["qa"]["examples"]} == {"exact_qa", "changed_qa", "both"}
    assert by["tale"]["texts"] == 2 and by["tale"]["too_short"] == 1
    assert len(by["tale"]["files"]) == 2 and all(len(f["sha256"]) == 64 for f in by["tale"]["files"])
    ex = next(e for e in by["qa"]["examples"] if e["id"] == "changed_qa")
    assert ex["ngram"].split()[:2] == ["which", "ancient"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| qa | 2 |" in md and "Decontamination: 4 documents" in md and "changed_qa" in md
    assert json.loads((tmp_path / "out" / "report.json").read_text())["decontamination"]["sets"][0]["docs"] == 3


def test_report_only_keeps_documents(tmp_path, sets):
    path, docs = _corpus(tmp_path)
    cfg = CleanConfig(workers=1, chunk_docs=5)
    cfg.decontam.sets = [sets["qa"]]
    cfg.decontam.report_only = True
    rep = clean([path], tmp_path / "out", cfg, verbose=False)
    assert {r["id"] for r in read_out(tmp_path / "out")} == set(docs)
    assert "contaminated" not in rep["removed"]
    assert rep["sources"]["train"]["flagged"] == {"contaminated": 3}
    assert rep["decontamination"]["mode"] == "report" and rep["decontamination"]["sets"][0]["docs"] == 3


def test_cli_flags_and_bad_set(tmp_path, sets, capsys):
    path, _ = _corpus(tmp_path)
    assert main(["clean", "--input", path, "--out", str(tmp_path / "o"), "--workers", "1", "--decontaminate",
                 sets["qa"], sets["story"], "--decontam-report-only"]) == 0
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert [s["docs"] for s in rep["decontamination"]["sets"]] == [3, 2] and rep["decontamination"]["mode"] == "report"
    capsys.readouterr()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("user file")
    assert main(["clean", "--input", path, "--out", str(mine), "--decontaminate", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--decontaminate" in err[0] and "nope.jsonl" in err[0]
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt"]


def test_index_digest_and_resume_fingerprint(tmp_path, sets):
    a = build_index([sets["qa"]])
    b = build_index([sets["qa"]])
    assert a.digest == b.digest
    assert build_index([sets["qa"]], n=12).digest != a.digest
