"""``z2all ladder``: train a family of model sizes at compute-optimal token counts, fit L(N, D), predict a larger run.

**The family.** Rung ``d`` is the base config's model with ``n_layers = d``, ``hidden_dim = aspect * d``,
``head_dim`` fixed (so ``n_heads = hidden / head_dim``, as many KV heads), ``intermediate_size = 8/3 hidden``
rounded up to a multiple of 32; vocabulary, context and everything else come from the base config. Width and
depth grow together (the aspect ratio of nanochat's and OLMo's ladders).

**N and D.** ``N`` is the non-embedding parameter count (the LM head included: the ``N`` of the MFU formula);
``D = ratio * N`` tokens (``--ratio``, 20 by default: Chinchilla's compute-optimal rule), or, with ``--flops C``,
``D = C / (6 N)`` for every rung. A rung runs ``ceil(D / tokens per step)`` updates; the recorded ``D`` is what
it saw. Several ``--ratio`` values train each size at each ratio, which identifies the full L(N, D); one ratio
(or a FLOP budget per rung at one size) identifies only the loss along that line, which the fit says.

**The recipe of each run** (rungs and the check alike, a function of the run's size only), because a scaling law
describes models trained well for their size, and a fixed recipe across a 70x range in N does not: the 2026-11-27
H200 ladder (depths 1-5, hidden 32 x depth, one micro-batch of 64 x 512 tokens, one lr 3e-3, warmup 20) ran its
rungs for 89, 226, 443, 811 and 1,370 updates; depth 1 ended at 6.33 nats (8.32 at the start), and the steps
between rungs were no power law (0.66 nats for 1.97x N, then 0.94 for 1.83x). The fit bent to them, put E at 0 and
predicted depth 9 at 1.668 where it measured 2.056 (-18.9 %). So:

- ``--min-updates U`` (1,000): a rung whose ``D`` gives fewer than ``U`` updates at the base micro-batch trains
  at the largest micro-batch that gives ``U`` (depths 1-4 of that ladder: 5, 14, 28, 51 sequences instead of 64).
  Its tokens stay ``ratio x N``; only the batch shrinks, which costs small models little: the critical batch size
  grows as the loss falls (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"), and these rungs
  sit at high loss. A rung still short at one sequence per update is trained, recorded and left out of the fit; a
  plan with fewer than 3 sizes reaching ``U`` is refused before anything trains.
- ``--warmup-fraction`` (0.02): warmup is that fraction of the run's updates (replacing ``train.warmup_steps``,
  which was 9 % of depth 1's updates and 0.3 % of the check's), so the schedule has one shape at every size.
- ``--lr-width-exponent x`` (0.5): ``lr = train.lr x (hidden of the predicted run / hidden)^x`` and ``min_lr``
  alike, so ``train.lr`` is the predicted run's learning rate and smaller widths train faster. With Adam the best
  lr of the hidden matrices falls as 1 / width (muP, Yang et al. 2022, "Tensor Programs V"), while embeddings, LM
  head and norms keep theirs; the small rungs are mostly LM head, hence a global exponent between 0 and 1. DeepSeek
  LLM (2024) fitted lr_opt ~ C^-0.125 over compute; along this family C ~ N^2, and from depth 1 to depth 9 (N x70,
  C x4,900, hidden x9) that is hidden^-0.48: 0.5. (``train.muon_lr``, when set, is left alone: Muon's update is
  already scaled by shape.)
- the validation tokens are the same for every run: ``train.eval_batches`` grows as the micro-batch shrinks.

The family is unchanged: the check at 20 tokens per parameter costs ~N^2, and depth 9 (10.1M, 280 s on one H200)
is the largest that fits a 5-minute check; a family from a larger minimum (depths 3-7, up to 5.1M) would need a
20M-parameter check (~15 minutes) to extrapolate 4x. Depths 1-5 with the recipe above keep the 4.5x extrapolation.

**Each rung** is a plain ``z2all pretrain`` run, in this process, in ``OUT/rungs/d<depth>-r<ratio>/`` (or
``-c<flops>``): its validation loss at the end (evaluated at step 0 and at the last step) and bits per byte (from
``train.eval_data`` when set, else the validation loss over the data's bytes per token from ``meta.json``).
A rung with ``final/`` is not retrained; an interrupted one resumes from its newest checkpoint.

**The fit** (``zero2all/train/scaling_fit.py``): Hoffmann et al.'s Huber fit in log space over the rungs with at
least ``--min-updates`` updates, bootstrap over rungs, a backtest (the fit without the largest rung predicting it)
whose error, scaled to the prediction's reach, widens the stated spread, and a warning when E lands on its 0
boundary. **The prediction**: the loss (with that spread) and the time of a larger family member (``--predict-depth``,
default the smallest at least 4x the largest rung's N) at ``--predict-tokens`` (default ratio x N), the time from
``z2all estimate``'s machinery (``zero2all.accounting.estimate``) at an MFU extrapolated from the rungs' measured
MFUs against their model FLOPs per update (:func:`predict_mfu`; ``--mfu`` overrides). On the 2026-11-27 numbers that
trend predicts depth 9 in 281 s (measured 280.6 s); the largest rung's MFU, used before, said 763 s.
``--check`` then trains that run (``OUT/check/``) and reports the error of the prediction.

``OUT/ladder.json`` holds the settings, every rung, the fit and the prediction (rewritten atomically after each
rung); ``OUT/ladder.png`` the plot when matplotlib is installed. ``OUT`` is locked while a ladder runs in it.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

from zero2all.config import Config, ConfigError

__all__ = ["family_model", "fit_rungs", "fittable", "predict_mfu", "run_ladder", "rung_lr_factor", "rung_plan"]


def family_model(base, depth: int, aspect: int, head_dim: int):
    """The model config of rung ``depth`` (see the module docstring)."""
    m = copy.deepcopy(base)
    hidden = aspect * depth
    if hidden % head_dim:
        raise ConfigError(f"--aspect {aspect} x depth {depth} = {hidden} is not a multiple of --head-dim {head_dim}")
    m.n_layers, m.hidden_dim = depth, hidden
    m.n_heads = m.n_kv_heads = hidden // head_dim
    m.intermediate_size = 32 * math.ceil(8 * hidden / 3 / 32)
    m.validate()
    return m


def _params(model_cfg) -> int:
    from zero2all.accounting import param_counts

    return param_counts(model_cfg).non_embedding


def rung_plan(cfg: Config, depths, aspect: int, head_dim: int, ratios=(20.0,), flops: float | None = None,
              min_updates: int = 0) -> list:
    """[{name, depth, ratio | flops, params, tokens_target, micro_batch, tokens_per_step, steps, tokens}] in
    training order (small first). A rung whose tokens give fewer than ``min_updates`` updates at the base
    micro-batch trains with the largest smaller micro-batch that reaches them (down to one sequence)."""
    plan = []
    for ratio in ([None] if flops else ratios):
        for depth in depths:
            m = family_model(cfg.model, depth, aspect, head_dim)
            n = _params(m)
            target = flops / (6 * n) if flops else ratio * n
            mb, tokens_per_step, steps = _batch_for(cfg, target, min_updates)
            name = f"d{depth}-" + (f"c{flops:.3g}" if flops else f"r{ratio:g}")
            plan.append({"name": name, "depth": depth, "ratio": ratio, "flops": flops, "params": n,
                         "tokens_target": target, "micro_batch": mb, "tokens_per_step": tokens_per_step,
                         "steps": steps, "tokens": steps * tokens_per_step})
    return sorted(plan, key=lambda r: (r["params"] * r["tokens"], r["name"]))


def _batch_for(cfg: Config, tokens: float, min_updates: int) -> tuple[int, int, int]:
    """(micro-batch, tokens per update, updates) of a run of ``tokens`` tokens: the base micro-batch, or the
    largest smaller one giving at least ``min_updates`` updates (never below one sequence)."""
    seq, accum, mb = _seq_len(cfg), cfg.train.grad_accum_steps, cfg.train.micro_batch_size
    if min_updates and math.ceil(tokens / (mb * accum * seq)) < min_updates:
        mb = max(1, min(mb, int(tokens // (min_updates * accum * seq))))
    return mb, mb * accum * seq, max(1, math.ceil(tokens / (mb * accum * seq)))


def rung_lr_factor(hidden: int, anchor_hidden: int, exponent: float) -> float:
    """The learning-rate multiplier of a rung of width ``hidden``: (anchor_hidden / hidden)^exponent, 1 at the
    predicted run's width (see the module docstring)."""
    return (anchor_hidden / hidden) ** exponent


def fittable(rungs: list, min_updates: int) -> list:
    """The rungs with at least ``min_updates`` updates (the plan's already at their smallest micro-batch); a
    ConfigError when they hold fewer than 3 sizes, too few for a fit."""
    used = [r for r in rungs if r["steps"] >= min_updates]
    if len({r["params"] for r in used}) < 3:
        raise ConfigError(f"--min-updates {min_updates}: only {len(used)} rung(s) reach it even at micro-batch 1, a "
                          f"fit needs 3 sizes; lower --min-updates, raise --ratio or use larger --depths")
    return used


def fit_rungs(rungs: list, predict_at, *, min_updates: int = 0, resamples: int = 200, seed: int = 0,
              reduced: bool | None = None) -> dict:
    """Fit the law to the rungs with at least ``min_updates`` updates and predict ``predict_at`` = (N, D).

    Returns {"law", "prediction" (loss, std = bootstrap and backtest combined, std_bootstrap, std_backtest, p05,
    p95 of the bootstrap), "backtest", "fitted" (rung names), "excluded" ({name: why})}. Raises ConfigError when
    fewer than 3 rungs are left."""
    from zero2all.train.scaling_fit import backtest, bootstrap_fit, prediction_spread

    used = fittable(rungs, min_updates)
    excluded = {r["name"]: f"{r['steps']} updates < --min-updates {min_updates}" for r in rungs
                if r["steps"] < min_updates}
    n, d, loss = ([r[k] for r in used] for k in ("params", "tokens", "val_loss"))
    law, preds = bootstrap_fit(n, d, loss, resamples=resamples, seed=seed, predict_at=[predict_at], reduced=reduced)
    test = backtest(n, d, loss, reduced=law.reduced)
    pred = preds[0] | prediction_spread(preds[0]["loss"], preds[0]["std"], predict_at[0], max(n), test)
    return {"law": law, "prediction": pred, "backtest": test, "fitted": [r["name"] for r in used],
            "excluded": excluded}


MFU_CAP = 0.6  # no run of this trainer has measured more; a trend extrapolated past it is cut there


def predict_mfu(points: list, flops_per_step: float) -> dict | None:
    """The MFU of a run doing ``flops_per_step`` model FLOPs per update, from the rungs' measured MFUs.

    ``points``: [(flops_per_step, mfu)]. Small models leave the GPU mostly idle: the MFU grows with the work per
    update (model FLOPs per token x tokens per update, so rungs trained at a smaller micro-batch fall on the same
    trend), close to a power law. Least squares of log MFU on log work, the slope clamped to [0, 1] (never less
    efficient with more work per update, never more than proportionally), extrapolated from the rung with the most
    work and cut at ``MFU_CAP``. None with fewer than 2 distinct points."""
    pts = [(f, m) for f, m in points if f and m and f > 0 and m > 0]
    if len({f for f, _ in pts}) < 2:
        return None
    x = [math.log(f) for f, _ in pts]
    y = [math.log(m) for _, m in pts]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sum((a - mx) ** 2 for a in x)
    slope = min(1.0, max(0.0, slope))
    f0, m0 = max(pts)
    mfu = min(MFU_CAP, m0 * (flops_per_step / f0) ** slope)
    return {"mfu": mfu, "slope": slope, "from_flops_per_step": f0, "from_mfu": m0, "points": len(pts)}


def _seq_len(cfg: Config) -> int:
    return cfg.data.seq_len or cfg.model.max_seq_len


def _rung_config(cfg: Config, rung: dict, aspect: int, head_dim: int, out_dir: Path,
                 warmup_fraction: float | None = None) -> Config:
    c = copy.deepcopy(cfg)
    c.model = family_model(cfg.model, rung["depth"], aspect, head_dim)
    t = c.train
    t.max_steps = rung["steps"]
    t.micro_batch_size = rung.get("micro_batch", t.micro_batch_size)
    # the same validation tokens for every rung: as many more batches as the micro-batch is smaller
    t.eval_batches = math.ceil(cfg.train.eval_batches * cfg.train.micro_batch_size / t.micro_batch_size)
    factor = rung.get("lr_factor", 1.0)
    t.lr, t.min_lr = t.lr * factor, t.min_lr * factor
    if warmup_fraction is None:
        t.warmup_steps = min(t.warmup_steps, max(0, rung["steps"] // 10))
    else:
        t.warmup_steps = max(1, round(warmup_fraction * rung["steps"]))
    t.eval_every = rung["steps"]  # step 0 and the end
    t.ckpt_every = rung["steps"] if rung["steps"] < 100 else rung["steps"] // 4  # resumable, not slowed
    t.keep_last = 1
    t.sample_every = 0
    t.num_samples = 0
    t.out_dir = str(out_dir)
    t.resume = "auto"
    t.tensorboard = False
    t.trackers = []
    t.time_budget_s = 0.0
    c.validate()
    return c


def _bytes_per_token(cfg: Config) -> float | None:
    if not cfg.data.path:
        return None
    try:
        from zero2all.data.pretokenize import read_meta

        return float(read_meta(cfg.data.path).get("bytes_per_token") or 0) or None
    except (OSError, ValueError, KeyError):
        return None


def _rung_result(out_dir: Path, bytes_per_token: float | None) -> dict | None:
    """The finished rung's numbers from its metrics, or None if it has no final/ or no final evaluation."""
    from zero2all.train.metrics import read_metrics, summarize

    if not (out_dir / "final").is_dir() or not (out_dir / "metrics.jsonl").exists():
        return None
    records = read_metrics(out_dir / "metrics.jsonl")
    s = summarize(records)
    evals = [r for r in records if r.get("kind") == "eval" and "loss" in r]
    if not evals:
        return None
    last = evals[-1]
    bpb = next((r["overall/bits_per_byte"] for r in reversed(records)
                if r.get("kind") == "eval" and "overall/bits_per_byte" in r), None)
    if bpb is None and bytes_per_token:
        bpb = last["loss"] / math.log(2) / bytes_per_token
    train = [r for r in records if r.get("kind") == "train"]
    return {"val_loss": last["loss"], "val_step": last["step"], "bits_per_byte": bpb,
            "train_seconds": sum(r.get("step_time_s", 0.0) for r in train), "median_mfu": s.get("median_mfu"),
            "median_tokens_per_s": s.get("median_tokens_per_s"), "tokens_seen": s.get("tokens_seen")}


def _train(cfg: Config, log) -> None:
    from zero2all.train.trainer import pretrain

    pretrain(cfg, show_progress=False)


def _predict_time(cfg: Config, model_cfg, tokens: float, mfu: float, gpu: str, micro_batch: int) -> dict:
    from zero2all.accounting import Layout, estimate

    layout = Layout(gpus=1, gpu=gpu, tokens=tokens, mfu=mfu, micro_batch_size=micro_batch,
                    seq_len=_seq_len(cfg), grad_accum_steps=cfg.train.grad_accum_steps)
    est = estimate(model_cfg, layout)
    return {"seconds": est["time"]["seconds"], "mfu": mfu, "gpu": gpu, "steps": est["time"]["steps"]}


def _write_plot(path: Path, rungs: list, law, prediction: dict | None, check: dict | None,
                excluded=()) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import numpy as np

    from zero2all.fileio import atomic_write

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ratios = sorted({r["tokens"] / r["params"] for r in rungs})
    ns = np.array([r["params"] for r in rungs], float)
    hi = max(ns.max(), prediction["params"] if prediction else 0) * 1.3
    grid = np.geomspace(ns.min() / 1.3, hi, 100)
    first_out = next((r["name"] for r in rungs if r["name"] in excluded), None)
    for r in rungs:
        out_of_fit = r["name"] in excluded
        ax.scatter(r["params"], r["val_loss"], zorder=3, edgecolors="C0", facecolors="none" if out_of_fit else "C0",
                   label="rung left out of the fit" if r["name"] == first_out else None)
    for i, ratio in enumerate(ratios[:4] if not law.reduced else ratios[:1]):
        ax.plot(grid, [law.predict(n, ratio * n) for n in grid], color=f"C{i + 1}", lw=1,
                label=f"fit, D = {ratio:.3g} N")
    if prediction:
        ax.errorbar(prediction["params"], prediction["loss"], yerr=2 * prediction["std"], fmt="s", color="C3",
                    capsize=3, label="prediction (2 std)")
    if check:
        ax.scatter(check["params"], check["val_loss"], marker="*", s=120, color="k", zorder=4, label="check run")
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters N")
    ax.set_ylabel("validation loss")
    ax.set_title("scaling ladder: " + law.formula().replace("L(N, D) = ", ""), fontsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return str(path)


# a ladder written before these settings existed ran with their neutral values
_SETTING_BEFORE = {"min_updates": 0, "warmup_fraction": None, "lr_width_exponent": 0.0, "lr_anchor_hidden": None}


def run_ladder(cfg: Config, out: str | Path, *, depths, aspect: int, head_dim: int, ratios=(20.0,),
               flops: float | None = None, predict_depth: int | None = None, predict_tokens: float | None = None,
               check: bool = False, gpu: str = "h100", mfu: float | None = None, resamples: int = 200,
               seed: int = 0, min_updates: int = 0, warmup_fraction: float | None = None,
               lr_width_exponent: float = 0.0, log=print) -> dict:
    """Train the rungs not yet finished, fit, predict (and with ``check`` train the predicted run); returns the
    report written to ``OUT/ladder.json``. ``min_updates``, ``warmup_fraction`` and ``lr_width_exponent``: the
    per-rung recipe of the module docstring (0, None, 0: every rung at the base config's batch, warmup and LR)."""
    from zero2all.accounting import mfu_flops_per_token
    from zero2all.fileio import LOCK_FILE, OUTPUT_MARKER, locked_output_dir, save_json

    out = Path(out)
    depths = sorted(set(depths))
    if len(depths) < 5:
        raise ConfigError(f"--depths: a ladder needs at least 5 sizes, got {len(depths)} ({depths})")
    plan = rung_plan(cfg, depths, aspect, head_dim, ratios, flops, min_updates)
    largest_n = max(r["params"] for r in plan)
    if predict_depth is None:
        predict_depth = next(d for d in range(max(depths) + 1, 64 * max(depths))
                             if _params(family_model(cfg.model, d, aspect, head_dim)) >= 4 * largest_n)
    pmodel = family_model(cfg.model, predict_depth, aspect, head_dim)
    for r in plan:
        r["lr_factor"] = rung_lr_factor(aspect * r["depth"], pmodel.hidden_dim, lr_width_exponent)
        r["lr"] = cfg.train.lr * r["lr_factor"]
    short = [r for r in plan if r["steps"] < min_updates]
    fittable(plan, min_updates)  # refused before anything trains
    settings = {"depths": depths, "aspect": aspect, "head_dim": head_dim, "ratios": list(ratios) if not flops else [],
                "flops": flops, "base_model": _model_dict(cfg.model), "data": cfg.data.path,
                "seq_len": _seq_len(cfg), "micro_batch": cfg.train.micro_batch_size,
                "grad_accum": cfg.train.grad_accum_steps, "optimizer": cfg.train.optimizer, "lr": cfg.train.lr,
                "min_updates": min_updates, "warmup_fraction": warmup_fraction,
                "lr_width_exponent": lr_width_exponent,
                "lr_anchor_hidden": pmodel.hidden_dim if lr_width_exponent else None}
    report_path = out / "ladder.json"
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"--out {out}: is a file; name a folder for the ladder")
        if report_path.exists():
            old = json.loads(report_path.read_text()).get("settings", {})
            changed = sorted(k for k in settings if (k in old or k in _SETTING_BEFORE)
                             and old.get(k, _SETTING_BEFORE.get(k)) != settings[k])
            if changed:
                raise ConfigError(f"--out {out}: holds a ladder with other settings ({', '.join(changed)}); "
                                  f"use a new --out or the same settings to resume it")
        else:
            foreign = sorted(p.name for p in out.iterdir() if p.name not in (LOCK_FILE, OUTPUT_MARKER, "rungs"))
            if foreign:
                raise ConfigError(f"--out {out}: holds other files ({', '.join(foreign[:3])}); name a new or empty "
                                  f"folder, or an earlier ladder's")
    bpt = _bytes_per_token(cfg)
    seq = _seq_len(cfg)
    report: dict = {"settings": settings, "rungs": []}
    with locked_output_dir(out):
        for r in short:
            log(f"ladder: rung {r['name']}: {r['steps']} updates even at micro-batch 1 (< --min-updates "
                f"{min_updates}): trained, but left out of the fit")
        for rung in plan:
            rdir = out / "rungs" / rung["name"]
            result = _rung_result(rdir, bpt)
            if result is None:
                rcfg = _rung_config(cfg, rung, aspect, head_dim, rdir, warmup_fraction)
                log(f"ladder: rung {rung['name']}: {rung['params']:,} parameters, {rung['tokens']:,} tokens "
                    f"({rung['steps']} updates of {rung['tokens_per_step']:,} tokens, lr {rcfg.train.lr:.3g}, "
                    f"warmup {rcfg.train.warmup_steps})")
                t0 = time.perf_counter()
                _train(rcfg, log)
                result = _rung_result(rdir, bpt)
                if result is None:
                    raise ConfigError(f"rung {rung['name']}: finished without a validation loss; the data needs a "
                                      f"validation split (z2all prepare --valid-fraction) and train.eval_batches > 0")
                result["wall_seconds"] = time.perf_counter() - t0
            else:
                log(f"ladder: rung {rung['name']}: done before (val loss {result['val_loss']:.4f}), not retrained")
            report["rungs"].append(rung | result)
            save_json(report, report_path)
        rungs = report["rungs"]
        largest = max(rungs, key=lambda r: r["params"])
        pn = _params(pmodel)
        ratio0 = (ratios[0] if not flops else largest["tokens"] / largest["params"])
        pmb, ptokens_per_step, psteps = _batch_for(cfg, predict_tokens if predict_tokens else ratio0 * pn,
                                                   min_updates)
        pd = psteps * ptokens_per_step
        fit = fit_rungs(rungs, (pn, pd), min_updates=min_updates, resamples=resamples, seed=seed,
                        reduced=(not flops and len(ratios) == 1) or None)
        law = fit["law"]
        # the time: the MFU trend of the rungs against their work per update (see predict_mfu)
        pflops = mfu_flops_per_token(pmodel, seq)
        trend = predict_mfu([(mfu_flops_per_token(family_model(cfg.model, r["depth"], aspect, head_dim), seq)
                              * r["tokens_per_step"], r.get("median_mfu")) for r in rungs], pflops * ptokens_per_step)
        if mfu is not None:
            use_mfu, source = mfu, "--mfu"
        elif trend:
            use_mfu, source = trend["mfu"], "the rungs' MFU trend"
        elif largest.get("median_mfu"):
            use_mfu, source = largest["median_mfu"], "the largest rung's MFU"
        else:
            use_mfu, source = 0.4, "the default MFU"
        ptime = _predict_time(cfg, pmodel, pd, use_mfu, gpu, pmb) | {"mfu_source": source, "mfu_trend": trend}
        if largest.get("median_mfu"):
            ptime["seconds_at_largest_rung_mfu"] = _predict_time(cfg, pmodel, pd, largest["median_mfu"], gpu,
                                                                 pmb)["seconds"]
        prediction = {"depth": predict_depth, "params": pn, "tokens": pd, "steps": psteps, "micro_batch": pmb,
                      **fit["prediction"], "time": ptime}
        if law.reduced:
            prediction["note"] = "one token ratio: the reduced law E + A/N^alpha, valid along that ratio"
        report["fit"] = law.to_dict() | {"formula": law.formula(), "fitted": fit["fitted"],
                                         "excluded": fit["excluded"], "backtest": fit["backtest"]}
        report["prediction"] = prediction
        log(f"ladder: fit over {len(fit['fitted'])} rungs: {law.formula()}"
            + ("  (one token ratio: N and D terms are not separable, reduced law)" if law.reduced else "")
            + (f"; left out: {', '.join(f'{k} ({v})' for k, v in fit['excluded'].items())}" if fit["excluded"]
               else ""))
        if law.boundary:
            log("ladder: warning: the fit put the irreducible loss E at 0 (its boundary): the rungs show no floor, "
                "so the law is a pure power law and its extrapolation is optimistic; the small rungs likely sit "
                "above the law (too few updates or a learning rate off for their width)")
        bt = fit["backtest"]
        if bt:
            log(f"ladder: backtest: the fit without the largest rung predicts it at {bt['predicted']:.4f}, measured "
                f"{bt['measured']:.4f} ({100 * bt['relative_error']:+.2f} %)"
                + (": the rungs are not on one power law, trust the prediction only within its widened spread"
                   if abs(bt["relative_error"]) > 0.02 else ""))
        log(f"ladder: prediction for depth {predict_depth} ({pn:,} parameters, {pd:,} tokens): val loss "
            f"{prediction['loss']:.4f} +- {prediction['std']:.4f} (bootstrap {prediction['std_bootstrap']:.4f}, "
            f"backtest {prediction['std_backtest']:.4f}); time {_fmt_s(ptime['seconds'])} on one {gpu} at MFU "
            f"{use_mfu:.3g} ({source})"
            + (f"; {_fmt_s(ptime['seconds_at_largest_rung_mfu'])} at the largest rung's MFU"
               if "seconds_at_largest_rung_mfu" in ptime and source != "the largest rung's MFU" else ""))
        save_json(report, report_path)
        check_result = None
        if check:
            cdir = out / "check"
            crung = {"name": "check", "depth": predict_depth, "steps": psteps, "micro_batch": pmb}
            result = _rung_result(cdir, bpt)
            if result is None:
                log(f"ladder: check run: depth {predict_depth}, {psteps} updates")
                t0 = time.perf_counter()
                _train(_rung_config(cfg, crung, aspect, head_dim, cdir, warmup_fraction), log)
                result = _rung_result(cdir, bpt)
                if result is None:
                    raise ConfigError("check run: finished without a validation loss")
                result["wall_seconds"] = time.perf_counter() - t0
            err = (prediction["loss"] - result["val_loss"]) / result["val_loss"]
            check_result = {"params": pn, "tokens": pd, **result, "predicted_loss": prediction["loss"],
                            "relative_error": err, "within_2_percent": abs(err) <= 0.02,
                            "z_score": (result["val_loss"] - prediction["loss"]) / prediction["std"]
                            if prediction["std"] else None}
            report["check"] = check_result
            log(f"ladder: check: measured val loss {result['val_loss']:.4f}, predicted {prediction['loss']:.4f}: "
                f"error {100 * err:+.2f} % ({'within' if abs(err) <= 0.02 else 'outside'} 2 %); trained in "
                f"{_fmt_s(result['train_seconds'])} (predicted {_fmt_s(ptime['seconds'])})")
        png = _write_plot(out / "ladder.png", rungs, law, prediction, check_result, fit["excluded"])
        report["plot"] = png
        if png is None:
            log("ladder: matplotlib is not installed: no plot (ladder.json has every number)")
        save_json(report, report_path)
        log(f"ladder: wrote {report_path}" + (f", {png}" if png else ""))
    return report


def _model_dict(m) -> dict:
    from dataclasses import asdict

    d = asdict(m)
    d.pop("ops", None)
    return d


def _fmt_s(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"
