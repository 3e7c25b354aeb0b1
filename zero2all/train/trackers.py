"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow (``train.trackers``).

Nothing is imported unless a tracker is asked for (``pip install 'zero2all[trackers]'`` installs both). What each
receives, from rank 0 only:

    at the start   the whole run config (flattened ``section.key`` parameters)
    every record   its numbers as ``<kind>/<key>`` at the record's step (train: loss, lr, grad norm, tokens/s,
                   MFU, step time, memory; eval: loss, perplexity, bits per byte; the objective's own metrics)
    at the end     report.md and loss.png; the tracker's run is then closed (with a failure status when the run
                   stopped on an error)

W&B runs where ``WANDB_MODE`` says (``offline`` writes under ``OUT/wandb`` for a later ``wandb sync``); system
statistics (GPU, CPU, memory) are W&B's own. MLflow logs to ``MLFLOW_TRACKING_URI`` when set, else to a local file
store ``OUT/mlruns`` (``mlflow ui --backend-store-uri OUT/mlruns``). A resumed run continues the same tracker run:
its id is kept in ``OUT/trackers.json``.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path

from zero2all.config import ConfigError

TRACKERS = ("wandb", "mlflow")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def numbers(record: dict) -> dict[str, float]:
    """The finite numbers of a metrics record, keyed ``<kind>/<key>``."""
    kind = record.get("kind", "train")
    return {f"{kind}/{k}": float(v) for k, v in record.items()
            if k not in ("time", "step", "kind") and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


class _Ids:
    """Tracker run ids kept in OUT/trackers.json, so that a resumed run continues the same tracker run."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / "trackers.json"
        self.ids = json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, name: str) -> str | None:
        return self.ids.get(name)

    def put(self, name: str, run_id: str) -> None:
        from zero2all.fileio import write_text

        self.ids[name] = run_id
        write_text(self.path, json.dumps(self.ids, indent=1) + "\n")


def _require(tracker: str, package: str):
    """Import a tracker's package, or say in one line how to install it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ConfigError(f"train.trackers = ['{tracker}']: the {tracker} package is not installed "
                          f"(pip install 'zero2all[trackers]')") from e


class WandbTracker:
    def __init__(self, out_dir: Path, project: str, name: str, ids: _Ids):
        self.wandb = wandb = _require("wandb", "wandb")
        run_id = ids.get("wandb") or uuid.uuid4().hex[:12]
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(out_dir))
        ids.put("wandb", run_id)

    def config(self, cfg: dict) -> None:
        self.run.config.update(flatten(cfg), allow_val_change=True)

    def log(self, record: dict) -> None:
        values = numbers(record)
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def artifacts(self, paths: list[Path]) -> None:
        for p in paths:
            if p.suffix == ".png":
                self.run.log({"loss_plot": self.wandb.Image(str(p))})
            self.run.save(str(p), base_path=str(p.parent), policy="now")

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    def __init__(self, out_dir: Path, project: str, name: str, ids: _Ids):
        self.mlflow = mlflow = _require("mlflow", "mlflow")
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"file:{(out_dir / 'mlruns').resolve()}"
        if uri.startswith("file:"):     # a local store needs no server; MLflow keeps it behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        run_id = ids.get("mlflow")
        if run_id is None:
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(project)
            run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            ids.put("mlflow", run_id)
        self.run_id = run_id
        self.uri = uri

    def config(self, cfg: dict) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in flatten(cfg).items()]
        existing = self.client.get_run(self.run_id).data.params
        new = [p for p in params if p.key not in existing]     # a resumed run: parameters are set once
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i:i + 100])

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        step, ts = int(record.get("step", 0)), int(1000 * record.get("time", 0))
        metrics = [Metric(k.replace("@", "_"), v, ts, step) for k, v in numbers(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def artifacts(self, paths: list[Path]) -> None:
        for p in paths:
            self.client.log_artifact(self.run_id, str(p))

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def open_trackers(names: list[str], out_dir: Path, project: str, name: str) -> list:
    """The trackers asked for, each with its run started (or resumed)."""
    ids = _Ids(out_dir)
    kinds = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    return [kinds[n](out_dir, project, name, ids) for n in names]
