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


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from zero2all.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    path, _ = _corpus(d)
    train_tokenizer([path], 384, d / "tok", log=lambda *a: None)
    return d / "tok"


def test_prepare_decontaminates_raw_text(tmp_path, sets, tok_dir):
    from zero2all.data.pretokenize import prepare

    path, docs = _corpus(tmp_path)
    meta = prepare([path], tok_dir, tmp_path / "data", workers=1, valid_fraction=0.0, log=lambda *a: None,
                   decontaminate=[sets["qa"], sets["story"]])
    assert meta["splits"]["train"]["docs"] == len(docs) - 4
    dc = meta["decontamination"]
    assert [s["docs"] for s in dc["sets"]] == [3, 2] and dc["documents_matched"] == 5 and dc["mode"] == "remove"
    assert [(r["name"], r["mode"], r["by"]) for r in meta["decontaminated_against"]] == \
        [("qa", "remove", "prepare"), ("story", "remove", "prepare")]
    kept = prepare([path], tok_dir, tmp_path / "kept", workers=1, valid_fraction=0.0, log=lambda *a: None,
                   decontaminate=[sets["qa"]], decontam_report_only=True)
    assert kept["splits"]["train"]["docs"] == len(docs) and kept["decontamination"]["sets"][0]["docs"] == 3


def test_prepare_records_the_clean_inputs_sets_and_eval_warns(tmp_path, sets, tok_dir, capsys):
    from zero2all.data.pretokenize import prepare

    path, _ = _corpus(tmp_path)
    cfg = CleanConfig(workers=1)
    cfg.decontam.sets = [sets["qa"]]
    clean([path], tmp_path / "clean", cfg, verbose=False)
    meta = prepare([str(tmp_path / "clean")], tok_dir, tmp_path / "data", workers=1, log=lambda *a: None)
    assert [r["name"] for r in meta["decontaminated_against"]] == ["qa"]
    assert meta["decontaminated_against"][0]["by"].endswith("report.json")
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"data": {"path": str(tmp_path / "data")}}))

    from zero2all.corpus.decontam import contamination_warning

    assert contamination_warning(run / "final", [sets["qa"]]) is None
    line = contamination_warning(run / "final", [sets["qa"], f"s={sets['story']}"], ["hellaswag"])
    assert line.startswith("warning: hellaswag, s=") and "hellaswag" in line and "(sets removed from it: qa)" in line
    assert sets["qa"] not in line
    assert contamination_warning(tmp_path, [sets["story"]]) is None  # no known training data: nothing to say
    # the command prints it (one line) before evaluating; this folder holds no model, so the evaluation fails
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(run / "final"), "--data", sets["story"]]) != 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"warning: {sets['story']} not decontaminated") and len(err) == 2


def test_lm_eval_task_documents_offline(monkeypatch):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'zero2all[eval]')")
    from pathlib import Path

    fixtures = Path(__file__).parent / "fixtures" / "harness"
    monkeypatch.chdir(fixtures)  # the task YAML's data_files are relative to the working directory
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    index = build_index([f"lm-eval:z2all_tiny_mc@{fixtures}"], n=5)
    assert index.sets[0]["task"] == "z2all_tiny_mc"
    assert index.sets[0]["texts"] == len((fixtures / "tiny_mc.jsonl").read_text().splitlines())
    # question + rendered choices: "... predicts the" then the choice "next token"
    assert index.match("We know THE MODEL reads text, and predicts the next token.") == \
        {"z2all_tiny_mc": "the model reads text, and"}
    assert index.match("the model writes text and predicts") == {}
