"""Fitting a scaling law L(N, D) = E + A / N^alpha + B / D^beta to (parameters, tokens, loss) points.

The method of Hoffmann et al. (2022, "Training Compute-Optimal Large Language Models", approach 3): with
``a = log A``, ``b = log B``, ``e = log E`` the model is ``log L = LSE(a - alpha log N, b - beta log D, e)``, and
the parameters minimise the Huber loss (delta = 1e-3) of the residuals in log space, found by L-BFGS from a grid of
starting points (the objective has local minima) keeping the best. The Huber loss keeps one bad run from dragging
the fit.

When every point has the same tokens-per-parameter ratio (a ladder at one ratio: D = r N), the N and D terms are
indistinguishable: the data fix only ``L = E + A' / N^alpha'``, and that reduced law is fitted (``B = 0``; its
predictions hold along that ratio). A ladder over several ratios identifies the full law.

Uncertainty: the fit is repeated on bootstrap resamples of the points (rungs drawn with replacement); each
parameter's standard deviation and 5-95 % interval over the resamples, and the same for a prediction, are reported.
The bootstrap only measures how the points scatter around *some* power law: when the points bend away from any one
law (small models stopped by too few updates rather than by their size), it stays narrow while the extrapolation is
wrong. Two checks cover that:

- :func:`backtest`: the law fitted without the largest size predicts that size; its relative error, scaled by how
  much further the real prediction reaches (in log N), is a second spread term (:func:`prediction_spread`).
  On the 2026-11-27 GPU ladder (depths 1-5) the backtest missed depth 5 by +4.9 % over 1.7x in N; scaled to the
  4.5x prediction that is ~14 %, where the bootstrap alone said 9.7 % and the prediction missed by 18.9 %.
- ``LossLaw.boundary``: the irreducible loss E fell to its lower bound (E < 0.1 % of the smallest loss). The points
  then show no floor at all: the law is a pure power law, whose extrapolation is too optimistic as soon as the data
  have an irreducible loss (every real corpus has one); it usually means the small points sit too high.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["LossLaw", "backtest", "bootstrap_fit", "fit_loss_law", "huber", "prediction_spread"]

HUBER_DELTA = 1e-3
E_BOUNDARY = 1e-3  # E below this fraction of the smallest loss: the fit sits on its E = 0 boundary


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


@dataclass
class LossLaw:
    E: float
    A: float
    alpha: float
    B: float = 0.0
    beta: float = 0.0
    reduced: bool = False        # True: one token ratio, L = E + A / N^alpha (B = 0)
    objective: float = 0.0
    spread: dict = field(default_factory=dict)  # bootstrap: name -> {"std", "p05", "p95"}
    boundary: str = ""           # "E": E collapsed to ~0 (see the module docstring); "" inside the parameter space

    def predict(self, n: float, d: float) -> float:
        return self.E + self.A / n ** self.alpha + (0.0 if self.reduced else self.B / d ** self.beta)

    def params(self) -> dict:
        return {"E": self.E, "A": self.A, "alpha": self.alpha, "B": self.B, "beta": self.beta}

    def to_dict(self) -> dict:
        return self.params() | {"reduced": self.reduced, "huber_objective": self.objective,
                                "uncertainty": self.spread, "boundary": self.boundary}

    def formula(self) -> str:
        def pm(k):
            s = self.spread.get(k)
            return f" +- {s['std']:.3g}" if s else ""

        text = f"L(N, D) = {self.E:.4g}{pm('E')} + {self.A:.4g}{pm('A')} / N^({self.alpha:.4g}{pm('alpha')})"
        if not self.reduced:
            text += f" + {self.B:.4g}{pm('B')} / D^({self.beta:.4g}{pm('beta')})"
        return text


def _objective_and_grad(theta: np.ndarray, logn, logd, logl, reduced: bool, delta: float):
    if reduced:
        a, alpha, e = theta
        terms = np.stack([a - alpha * logn, np.full_like(logn, e)])
    else:
        a, b, alpha, beta, e = theta
        terms = np.stack([a - alpha * logn, b - beta * logd, np.full_like(logn, e)])
    m = terms.max(axis=0)
    w = np.exp(terms - m)
    s = w.sum(axis=0)
    pred = m + np.log(s)
    r = pred - logl
    obj = float(huber(r, delta).sum())
    dr = np.clip(r, -delta, delta)  # d huber / d r
    p = w / s  # softmax weights: d pred / d term
    if reduced:
        g = np.array([(dr * p[0]).sum(), (dr * p[0] * -logn).sum(), (dr * p[1]).sum()])
    else:
        g = np.array([(dr * p[0]).sum(), (dr * p[1]).sum(), (dr * p[0] * -logn).sum(),
                      (dr * p[1] * -logd).sum(), (dr * p[2]).sum()])
    return obj, g


def _minimise(fun, x0):
    try:
        from scipy.optimize import minimize
    except ImportError:  # a small gradient descent with backtracking: slower, same optimum on these problems
        return _descend(fun, x0)
    res = minimize(fun, x0, jac=True, method="L-BFGS-B", options={"maxiter": 300, "gtol": 1e-10, "ftol": 1e-14})
    return res.x, float(res.fun)


def _descend(fun, x0, iters: int = 3000):
    x = np.asarray(x0, float)
    f, g = fun(x)
    step = 1.0
    for _ in range(iters):
        while step > 1e-12:
            xn = x - step * g
            fn, gn = fun(xn)
            if fn < f:
                x, f, g = xn, fn, gn
                step *= 2
                break
            step /= 2
        else:
            break
    return x, f


def _starts(reduced: bool, logl_min: float):
    e0 = [math.log(max(math.exp(logl_min) * k, 1e-6)) for k in (0.4, 0.8)]
    alphas = [0.15, 0.5]
    amps = [2.0, 8.0]
    if reduced:
        return [np.array([a, al, e]) for a, al, e in itertools.product(amps, alphas + [1.0], e0)]
    return [np.array([a, a, al, al, e]) for a, al, e in itertools.product(amps, alphas, e0)] + \
        [np.array([2.0, 8.0, 0.5, 0.15, e0[0]]), np.array([8.0, 2.0, 0.15, 0.5, e0[0]])]


def fit_loss_law(n, d, loss, delta: float = HUBER_DELTA, starts=None, reduced: bool | None = None) -> LossLaw:
    """Fit ``L = E + A/N^alpha + B/D^beta`` to points (``n`` parameters, ``d`` tokens, ``loss``); the reduced law
    when ``reduced`` or (None) when every point has nearly the same D / N (within 10 %: rounding tokens to whole
    updates moves it a little; see the module docstring). ``starts``: initial points to use instead of the grid
    (the bootstrap starts from the full fit)."""
    n, d, loss = (np.asarray(x, dtype=np.float64) for x in (n, d, loss))
    if not (len(n) == len(d) == len(loss)) or len(n) < 3:
        raise ValueError(f"a scaling fit needs at least 3 points (parameters, tokens, loss), got {len(n)}")
    if (n <= 0).any() or (d <= 0).any() or (loss <= 0).any() or not np.isfinite(loss).all():
        raise ValueError("a scaling fit needs positive parameters, tokens and finite positive losses")
    ratio = np.log(d / n)
    if reduced is None:
        reduced = bool(np.ptp(ratio) < 0.1)
    logn, logd, logl = np.log(n), np.log(d), np.log(loss)

    def fun(theta):
        return _objective_and_grad(theta, logn, logd, logl, reduced, delta)

    best = None
    for x0 in (starts if starts is not None else _starts(reduced, float(logl.min()))):
        x, f = _minimise(fun, x0)
        if np.all(np.isfinite(x)) and (best is None or f < best[1]):
            best = (x, f)
    x, f = best
    if reduced:
        a, alpha, e = x
        law = LossLaw(E=math.exp(e), A=math.exp(a), alpha=float(alpha), reduced=True, objective=f)
    else:
        a, b, alpha, beta, e = x
        law = LossLaw(E=math.exp(e), A=math.exp(a), alpha=float(alpha), B=math.exp(b), beta=float(beta), objective=f)
    law.boundary = "E" if law.E < E_BOUNDARY * float(loss.min()) else ""
    return law


def _theta(law: LossLaw) -> np.ndarray:
    if law.reduced:
        return np.array([math.log(law.A), law.alpha, math.log(law.E)])
    return np.array([math.log(law.A), math.log(law.B), law.alpha, law.beta, math.log(law.E)])


def bootstrap_fit(n, d, loss, resamples: int = 200, seed: int = 0, predict_at=(),
                  reduced: bool | None = None) -> tuple[LossLaw, dict]:
    """The fit on all points, with ``spread`` filled from ``resamples`` bootstrap fits (points drawn with
    replacement; a resample with fewer than 3 distinct points is drawn again). Returns (law, predictions):
    ``predictions[i]`` = {"loss", "std", "p05", "p95"} for each (N, D) in ``predict_at``."""
    n, d, loss = (np.asarray(x, dtype=np.float64) for x in (n, d, loss))
    law = fit_loss_law(n, d, loss, reduced=reduced)
    rng = np.random.default_rng(seed)
    samples, preds = [], []
    start = _theta(law)
    for _ in range(resamples):
        while True:
            idx = rng.integers(0, len(n), size=len(n))
            if len(set(idx.tolist())) >= 3:
                break
        try:
            b = fit_loss_law(n[idx], d[idx], loss[idx], starts=[start], reduced=law.reduced)
        except ValueError:
            continue
        if b.reduced != law.reduced:
            continue
        samples.append(b.params())
        preds.append([b.predict(pn, pd) for pn, pd in predict_at])
    for key in law.params():
        vals = np.array([s[key] for s in samples])
        if len(vals):
            law.spread[key] = {"std": float(vals.std(ddof=1)) if len(vals) > 1 else 0.0,
                               "p05": float(np.percentile(vals, 5)), "p95": float(np.percentile(vals, 95))}
    out = {}
    arr = np.array(preds) if preds else np.empty((0, len(predict_at)))
    for i, (pn, pd) in enumerate(predict_at):
        col = arr[:, i] if len(arr) else np.array([])
        out[i] = {"loss": law.predict(pn, pd), "std": float(col.std(ddof=1)) if len(col) > 1 else 0.0,
                  "p05": float(np.percentile(col, 5)) if len(col) else None,
                  "p95": float(np.percentile(col, 95)) if len(col) else None}
    law.spread = {k: v for k, v in law.spread.items() if not (law.reduced and k in ("B", "beta"))}
    return law, out


def backtest(n, d, loss, reduced: bool | None = None) -> dict | None:
    """Fit without the points at the largest N and predict them: {"params", "next_params", "predicted",
    "measured", "relative_error"} (the mean over the held-out points), or None with fewer than 3 points left."""
    n, d, loss = (np.asarray(x, dtype=np.float64) for x in (n, d, loss))
    top = n.max()
    keep = n < top
    if keep.sum() < 3 or len(set(n[keep].tolist())) < 2:
        return None
    law = fit_loss_law(n[keep], d[keep], loss[keep], reduced=reduced)
    held = ~keep
    predicted = float(np.mean([law.predict(pn, pd) for pn, pd in zip(n[held], d[held], strict=True)]))
    measured = float(loss[held].mean())
    return {"params": float(top), "next_params": float(n[keep].max()), "predicted": predicted, "measured": measured,
            "relative_error": (predicted - measured) / measured}


def prediction_spread(loss: float, bootstrap_std: float, params: float, largest_params: float,
                      test: dict | None) -> dict:
    """The prediction's standard deviation from the bootstrap and the backtest together.

    The backtest's relative error was made extrapolating from ``next_params`` to ``params`` (the largest point);
    a slope error grows with the distance in log N, so it is scaled by log(N_pred / N_largest) / log(N_largest /
    N_next) and taken as a second, independent standard deviation: ``std = sqrt(bootstrap^2 + backtest^2)``.
    """
    out = {"std_bootstrap": bootstrap_std, "std_backtest": 0.0, "std": bootstrap_std}
    if test and test["params"] > test["next_params"] and params > largest_params:
        reach = math.log(params / largest_params) / math.log(test["params"] / test["next_params"])
        out["std_backtest"] = abs(test["relative_error"]) * reach * loss
        out["std"] = math.hypot(bootstrap_std, out["std_backtest"])
    return out
