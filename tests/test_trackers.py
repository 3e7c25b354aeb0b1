"""Experiment trackers (zero2all/train/trackers.py) in their offline modes: a run's config, every metric at its
step, the final report and loss plot reach W&B (offline files) and MLflow (a local file store); a resumed run
continues the same tracker run; nothing is imported when no tracker is asked for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

RUN = ["model.n_layers=2", "data.seq_len=32", "train.micro_batch_size=2", "train.max_steps=4", "train.eval_every=2",
       "train.eval_batches=1", "train.num_samples=0", "train.tensorboard=false", "train.ckpt_every=2",
       "train.device='cpu'", "train.log_every=0", "train.warmup_steps=1"]


def _train(out, *overrides):
    from zero2all.config import load_config
    from zero2all.train.trainer import Trainer

    Trainer(load_config("tiny", [*RUN, f"train.out_dir='{out}'", *overrides]), show_progress=False).fit()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_mlflow_gets_config_metrics_and_report_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    recs = _train(out, "train.trackers=['mlflow']", "train.max_steps=2")
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    client = mlflow.tracking.MlflowClient(tracking_uri=f"file:{(out / 'mlruns').resolve()}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "2" and run.data.params["model.n_layers"] == "2"
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert losses == {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}
    assert {a.path for a in client.list_artifacts(run_id)} >= {"report.md", "loss.png"}
    # resumed to 4 steps: the same tracker run, steps 3 and 4 added
    ckpt = sorted(out.glob("ckpt-*"))[-1]
    _train(out, "train.trackers=['mlflow']", f"train.resume='{ckpt}'")
    assert json.loads((out / "trackers.json").read_text())["mlflow"] == run_id
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps[-2:] == [3, 4]


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    _train(out, "train.trackers=['wandb']", "train.max_steps=2")
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]
    runs = list((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    data = (runs[0] / f"run-{run_id}.wandb").read_bytes()
    assert b"train/loss" in data and b"eval/loss" in data and b"model.n_layers" in data
    assert (runs[0] / "files" / "report.md").exists()


@pytest.mark.slow
def test_no_tracker_is_imported_unless_asked_for(tmp_path):
    code = ("import sys; from zero2all.config import load_config; from zero2all.train.trainer import Trainer; "
            f"Trainer(load_config('tiny', {RUN + ['train.max_steps=1', f'train.out_dir={str(tmp_path)!r}']!r}), "
            "show_progress=False).fit(); "
            "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_an_unknown_tracker_is_refused():
    from zero2all.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.trackers: 'neptune' is not one of wandb, mlflow"):
        load_config("tiny", ["train.trackers=['neptune']"]).validate()
