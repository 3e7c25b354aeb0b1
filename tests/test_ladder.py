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
