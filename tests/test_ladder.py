"""The scaling ladder: the L(N, D) fit on synthetic points, and `z2all ladder` end to end on CPU."""

import numpy as np
import pytest

from zero2all.train.scaling_fit import bootstrap_fit, fit_loss_law

TRUE = dict(E=1.7, A=400.0, alpha=0.34, B=410.0, beta=0.28)  # the published Chinchilla fit, as a known answer


def _points():
    n = np.repeat(np.geomspace(1e5, 1e7, 5), 3)
    d = n * np.tile([5.0, 20.0, 80.0], 5)
    return n, d, TRUE["E"] + TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / d ** TRUE["beta"]


def test_fit_recovers_known_law_exactly_without_noise():
    n, d, loss = _points()
    law = fit_loss_law(n, d, loss)
    assert not law.reduced
    for k, v in TRUE.items():
        assert law.params()[k] == pytest.approx(v, rel=1e-6)


def test_fit_with_noise_within_its_bootstrap_uncertainty():
    """0.3 % multiplicative noise: each parameter lands within 4 bootstrap standard deviations of the truth (the
    measured errors were 0.03-0.8 std), and the prediction of a 4x larger run within 4 std of the true loss."""
    n, d, loss = _points()
    noisy = loss * np.exp(np.random.default_rng(1).normal(0, 0.003, len(loss)))
    law, pred = bootstrap_fit(n, d, noisy, resamples=10, seed=0, predict_at=[(4e7, 8e8)])
    for k, v in TRUE.items():
        assert abs(law.params()[k] - v) <= 4 * law.spread[k]["std"], (k, law.params()[k], law.spread[k])
    truth = TRUE["E"] + TRUE["A"] / 4e7 ** TRUE["alpha"] + TRUE["B"] / 8e8 ** TRUE["beta"]
    assert abs(pred[0]["loss"] - truth) <= 4 * pred[0]["std"] and pred[0]["std"] < 0.02 * truth


def test_one_ratio_fits_the_reduced_law():
    """D = 20 N everywhere: only E + A'/N^alpha' is identifiable; its predictions along the ratio are right."""
    n, d, loss = (x[1::3] for x in _points())
    law = fit_loss_law(n, d, loss)
    assert law.reduced and law.B == 0.0
    truth = TRUE["E"] + TRUE["A"] / 2e7 ** TRUE["alpha"] + TRUE["B"] / 4e8 ** TRUE["beta"]
    assert law.predict(2e7, 4e8) == pytest.approx(truth, rel=0.01)
    with pytest.raises(ValueError, match="at least 3 points"):
        fit_loss_law(n[:2], d[:2], loss[:2])


TINY = ["--config", "tiny", "--depths", "1,2,3,4,5", "--aspect", "8", "--head-dim", "8", "--ratio", "0.002",
        "--resamples", "5", "--device", "cpu", "model.vocab_size=64", "model.max_seq_len=16",
        "train.micro_batch_size=2", "train.eval_batches=1", "train.log_every=0"]


def test_cli_ladder_end_to_end_resume_and_check(tmp_path, capsys):
    """Five tiny rungs on synthetic tokens: ladder.json with every rung, the fit and the prediction; a second run
    trains nothing again (the rungs' metrics untouched) and --check adds the predicted run with its error."""
    import json

    from zero2all.cli import main

    out = tmp_path / "ladder"
    assert main(["ladder", "--out", str(out)] + TINY) == 0
    text = capsys.readouterr().out
    report = json.loads((out / "ladder.json").read_text())
    assert [r["depth"] for r in report["rungs"]] == [1, 2, 3, 4, 5]
    assert all(r["val_loss"] > 0 and r["steps"] >= 1 for r in report["rungs"])
    params = [r["params"] for r in report["rungs"]]
    assert params == sorted(params) and report["fit"]["reduced"]
    pred = report["prediction"]
    assert pred["params"] >= 4 * params[-1] and pred["loss"] > 0 and pred["time"]["seconds"] > 0
    assert "ladder: fit over 5 rungs" in text and "ladder: prediction for depth" in text
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("rungs/*/metrics.jsonl")}
    assert len(stamps) == 5
    assert main(["ladder", "--out", str(out), "--check"] + TINY) == 0
    text = capsys.readouterr().out
    assert text.count("not retrained") == 5 and "updates)" not in text.split("ladder: check run")[0]
    assert {p: p.stat().st_mtime_ns for p in out.glob("rungs/*/metrics.jsonl")} == stamps
    report = json.loads((out / "ladder.json").read_text())
    check = report["check"]
    assert check["val_loss"] > 0 and check["relative_error"] == pytest.approx(
        (pred["loss"] - check["val_loss"]) / check["val_loss"])
    assert "ladder: check: measured val loss" in text


@pytest.mark.parametrize("argv, message", [
    (["--depths", "1,2,3"], "--depths: a ladder needs at least 5 sizes"),
    (["--depths", "1,x"], "--depths '1,x': expected comma-separated integers"),
    (["--ratio", "-1"], "--ratio: -1.0 must be > 0"),
    (["--aspect", "6"], "is not a multiple of --head-dim 8"),
    (["--gpu", "nosuch"], "--gpu 'nosuch': unknown GPU"),
    (["--predict-depth", "3"], "--predict-depth 3: must be larger than the largest rung (5)"),
])
def test_cli_ladder_bad_input(tmp_path, capsys, argv, message):
    from zero2all.cli import main

    out = tmp_path / "ladder"
    assert main(["ladder", "--out", str(out)] + TINY + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not out.exists()


def test_cli_ladder_refuses_a_foreign_folder(tmp_path, capsys):
    from zero2all.cli import main

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert main(["ladder", "--out", str(out)] + TINY) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds other files (notes.txt)" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
