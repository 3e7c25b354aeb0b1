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

**Each rung** is a plain ``z2all pretrain`` run, in this process, in ``OUT/rungs/d<depth>-r<ratio>/`` (or
``-c<flops>``): its validation loss at the end (evaluated at step 0 and at the last step) and bits per byte (from
``train.eval_data`` when set, else the validation loss over the data's bytes per token from ``meta.json``).
A rung with ``final/`` is not retrained; an interrupted one resumes from its newest checkpoint.

**The fit** (``zero2all/train/scaling_fit.py``): Hoffmann et al.'s Huber fit in log space, bootstrap over rungs.
**The prediction**: the loss (with its bootstrap spread) and the time of a larger family member (``--predict-depth``,
default the smallest at least 4x the largest rung's N) at ``--predict-tokens`` (default ratio x N), the time from
``z2all estimate``'s machinery (``zero2all.accounting.estimate``) at the MFU the largest rung measured (else
``--mfu``). ``--check`` then trains that run (``OUT/check/``) and reports the error of the prediction.

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

__all__ = ["family_model", "run_ladder", "rung_plan"]


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


def rung_plan(cfg: Config, depths, aspect: int, head_dim: int, ratios=(20.0,), flops: float | None = None) -> list:
    """[{name, depth, ratio | flops, params, tokens_target, steps, tokens}] in training order (small first)."""
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * _seq_len(cfg)
    plan = []
    for ratio in ([None] if flops else ratios):
        for depth in depths:
            m = family_model(cfg.model, depth, aspect, head_dim)
            n = _params(m)
            target = flops / (6 * n) if flops else ratio * n
            steps = max(1, math.ceil(target / tokens_per_step))
            name = f"d{depth}-" + (f"c{flops:.3g}" if flops else f"r{ratio:g}")
            plan.append({"name": name, "depth": depth, "ratio": ratio, "flops": flops, "params": n,
                         "tokens_target": target, "steps": steps, "tokens": steps * tokens_per_step})
    return sorted(plan, key=lambda r: (r["params"] * r["tokens"], r["name"]))


def _seq_len(cfg: Config) -> int:
    return cfg.data.seq_len or cfg.model.max_seq_len


def _rung_config(cfg: Config, rung: dict, aspect: int, head_dim: int, out_dir: Path) -> Config:
    c = copy.deepcopy(cfg)
    c.model = family_model(cfg.model, rung["depth"], aspect, head_dim)
    t = c.train
    t.max_steps = rung["steps"]
    t.warmup_steps = min(t.warmup_steps, max(0, rung["steps"] // 10))
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


def _predict_time(cfg: Config, model_cfg, tokens: float, mfu: float, gpu: str) -> dict:
    from zero2all.accounting import Layout, estimate

    layout = Layout(gpus=1, gpu=gpu, tokens=tokens, mfu=mfu, micro_batch_size=cfg.train.micro_batch_size,
                    seq_len=_seq_len(cfg), grad_accum_steps=cfg.train.grad_accum_steps)
    est = estimate(model_cfg, layout)
    return {"seconds": est["time"]["seconds"], "mfu": mfu, "gpu": gpu, "steps": est["time"]["steps"]}


def _write_plot(path: Path, rungs: list, law, prediction: dict | None, check: dict | None) -> str | None:
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
    for r in rungs:
        ax.scatter(r["params"], r["val_loss"], color="C0", zorder=3)
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


def run_ladder(cfg: Config, out: str | Path, *, depths, aspect: int, head_dim: int, ratios=(20.0,),
               flops: float | None = None, predict_depth: int | None = None, predict_tokens: float | None = None,
               check: bool = False, gpu: str = "h100", mfu: float | None = None, resamples: int = 200,
               seed: int = 0, log=print) -> dict:
    """Train the rungs not yet finished, fit, predict (and with ``check`` train the predicted run); returns the
    report written to ``OUT/ladder.json``."""
    from zero2all.fileio import LOCK_FILE, OUTPUT_MARKER, locked_output_dir, save_json
    from zero2all.train.scaling_fit import bootstrap_fit

    out = Path(out)
    depths = sorted(set(depths))
    if len(depths) < 5:
        raise ConfigError(f"--depths: a ladder needs at least 5 sizes, got {len(depths)} ({depths})")
    plan = rung_plan(cfg, depths, aspect, head_dim, ratios, flops)
    settings = {"depths": depths, "aspect": aspect, "head_dim": head_dim, "ratios": list(ratios) if not flops else [],
                "flops": flops, "base_model": _model_dict(cfg.model), "data": cfg.data.path,
                "seq_len": _seq_len(cfg), "micro_batch": cfg.train.micro_batch_size,
                "grad_accum": cfg.train.grad_accum_steps, "optimizer": cfg.train.optimizer, "lr": cfg.train.lr}
    report_path = out / "ladder.json"
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"--out {out}: is a file; name a folder for the ladder")
        if report_path.exists():
            old = json.loads(report_path.read_text()).get("settings", {})
            changed = sorted(k for k in settings if k in old and old[k] != settings[k])
            if changed:
                raise ConfigError(f"--out {out}: holds a ladder with other settings ({', '.join(changed)}); "
                                  f"use a new --out or the same settings to resume it")
        else:
            foreign = sorted(p.name for p in out.iterdir() if p.name not in (LOCK_FILE, OUTPUT_MARKER, "rungs"))
            if foreign:
                raise ConfigError(f"--out {out}: holds other files ({', '.join(foreign[:3])}); name a new or empty "
                                  f"folder, or an earlier ladder's")
    bpt = _bytes_per_token(cfg)
    report: dict = {"settings": settings, "rungs": []}
    with locked_output_dir(out):
        for rung in plan:
            rdir = out / "rungs" / rung["name"]
            result = _rung_result(rdir, bpt)
            if result is None:
                log(f"ladder: rung {rung['name']}: {rung['params']:,} parameters, {rung['tokens']:,} tokens "
                    f"({rung['steps']} updates)")
                t0 = time.perf_counter()
                _train(_rung_config(cfg, rung, aspect, head_dim, rdir), log)
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
        if predict_depth is None:
            predict_depth = next(d for d in range(max(depths) + 1, 64 * max(depths))
                                 if _params(family_model(cfg.model, d, aspect, head_dim)) >= 4 * largest["params"])
        pmodel = family_model(cfg.model, predict_depth, aspect, head_dim)
        pn = _params(pmodel)
        ratio0 = (ratios[0] if not flops else largest["tokens"] / largest["params"])
        tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * _seq_len(cfg)
        pd = predict_tokens if predict_tokens else ratio0 * pn
        psteps = max(1, math.ceil(pd / tokens_per_step))
        pd = psteps * tokens_per_step
        law, preds = bootstrap_fit([r["params"] for r in rungs], [r["tokens"] for r in rungs],
                                   [r["val_loss"] for r in rungs], resamples=resamples, seed=seed,
                                   predict_at=[(pn, pd)], reduced=(not flops and len(ratios) == 1) or None)
        measured_mfu = largest.get("median_mfu")
        use_mfu = mfu if mfu is not None else (measured_mfu or 0.4)
        prediction = {"depth": predict_depth, "params": pn, "tokens": pd, "steps": psteps, **preds[0],
                      "time": _predict_time(cfg, pmodel, pd, use_mfu, gpu)}
        if largest.get("median_tokens_per_s"):  # the largest rung's measured throughput, scaled by FLOPs per token
            from zero2all.accounting import mfu_flops_per_token

            rate = largest["median_tokens_per_s"] * mfu_flops_per_token(
                family_model(cfg.model, largest["depth"], aspect, head_dim), _seq_len(cfg)) / \
                mfu_flops_per_token(pmodel, _seq_len(cfg))
            prediction["time"]["seconds_from_largest_rung"] = pd / rate
        if law.reduced:
            prediction["note"] = "one token ratio: the reduced law E + A/N^alpha, valid along that ratio"
        report["fit"] = law.to_dict() | {"formula": law.formula()}
        report["prediction"] = prediction
        log(f"ladder: fit over {len(rungs)} rungs: {law.formula()}"
            + ("  (one token ratio: N and D terms are not separable, reduced law)" if law.reduced else ""))
        log(f"ladder: prediction for depth {predict_depth} ({pn:,} parameters, {pd:,} tokens): val loss "
            f"{prediction['loss']:.4f} +- {prediction['std']:.4f}; time {_fmt_s(prediction['time']['seconds'])} "
            f"on one {gpu} at MFU {use_mfu:.3g}"
            + (f", {_fmt_s(prediction['time']['seconds_from_largest_rung'])} at the largest rung's measured "
               f"throughput" if "seconds_from_largest_rung" in prediction["time"] else ""))
        save_json(report, report_path)
        check_result = None
        if check:
            cdir = out / "check"
            crung = {"name": "check", "depth": predict_depth, "steps": psteps}
            result = _rung_result(cdir, bpt)
            if result is None:
                log(f"ladder: check run: depth {predict_depth}, {psteps} updates")
                t0 = time.perf_counter()
                _train(_rung_config(cfg, crung, aspect, head_dim, cdir), log)
                result = _rung_result(cdir, bpt)
                if result is None:
                    raise ConfigError("check run: finished without a validation loss")
                result["wall_seconds"] = time.perf_counter() - t0
            err = (prediction["loss"] - result["val_loss"]) / result["val_loss"]
            check_result = {"params": pn, "tokens": pd, **result, "predicted_loss": prediction["loss"],
                            "relative_error": err, "within_2_percent": abs(err) <= 0.02}
            report["check"] = check_result
            log(f"ladder: check: measured val loss {result['val_loss']:.4f}, predicted {prediction['loss']:.4f}: "
                f"error {100 * err:+.2f} % ({'within' if abs(err) <= 0.02 else 'outside'} 2 %); trained in "
                f"{_fmt_s(result['train_seconds'])} (predicted {_fmt_s(prediction['time']['seconds'])})")
        png = _write_plot(out / "ladder.png", rungs, law, prediction, check_result)
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
