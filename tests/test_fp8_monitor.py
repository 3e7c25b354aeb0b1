"""Numerics monitoring per logging window: the rising-trend rule, and FP8 / skip-ratio keys in a real run's
metrics.jsonl."""

import torch
from test_trainer import tiny_cfg

from zero2all.train.metrics import NumericsMonitor, read_metrics
from zero2all.train.trainer import Trainer


def run_windows(monitor, skips_per_window, updates_per_window=4):
    """Feed windows of updates with the given number of skipped ones; return each window's (record, warnings)."""
    out = []
    for skips in skips_per_window:
        for i in range(updates_per_window):
            rec = {"skipped": i < skips}
            monitor.observe(rec)
        out.append((rec, monitor.window(rec)))
    return out


def test_skip_ratio_and_rising_trend_warning_once():
    windows = run_windows(NumericsMonitor(patience=3), [0, 1, 2, 3, 4, 4, 1, 2, 3, 4])
    assert [rec["skip_ratio"] for rec, _ in windows] == [0, 0.25, 0.5, 0.75, 1, 1, 0.25, 0.5, 0.75, 1]
    warned = [i for i, (_, w) in enumerate(windows) if w]
    assert warned == [3, 9]                               # three rises in a row, warned once per rise
    assert "skip_ratio is rising" in windows[3][1][0]
    # a rise that does not double, or stays under the floor, is no warning
    assert not any(w for _, w in run_windows(NumericsMonitor(patience=3), [2, 2, 2, 3, 3, 3, 3, 3], 8))
    quiet = NumericsMonitor(patience=2, floor=0.5)
    assert not any(w for _, w in run_windows(quiet, [0, 1, 2], 8))


def test_fp8_saturation_keys_in_metrics_jsonl(tmp_path):
    cfg = tiny_cfg(tmp_path, "model.ops.linear_precision='fp8_rowwise'", "train.log_every=2")
    Trainer(cfg, show_progress=False).fit()
    windows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("kind") == "train" and
               "skip_ratio" in r]
    assert [r["step"] for r in windows] == [2, 4, 6]
    for rec in windows:
        assert rec["skip_ratio"] == 0.0
        for kind in ("qkv", "o", "gate_up", "down"):
            assert 0 < rec[f"fp8_saturated_{kind}"] < 0.5      # at least each row's amax lands on FMAX
            assert 0 <= rec[f"fp8_underflow_{kind}"] < 0.5
    assert torch.isfinite(torch.tensor([r["loss"] for r in windows])).all()
