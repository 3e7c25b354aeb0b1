"""The hang watchdog (zero2all/train/watchdog.py): a stalled update is diagnosed (stacks of every thread, where each
rank's main thread is, the rank behind) and the run exits with code 4 instead of waiting forever."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from zero2all.train.watchdog import HANG_EXIT_CODE, Watchdog, is_waiting


def test_a_stalled_process_dumps_its_stacks_and_exits_4(tmp_path):
    codes = []
    dog = Watchdog(tmp_path, 0, 1, factor=1.0, min_s=0.3, poll_s=0.05, exit=codes.append,
                   print_fn=lambda *a, **k: None).start()
    dog.beat(1, 0.01)
    deadline = time.monotonic() + 10
    while not codes and time.monotonic() < deadline:
        time.sleep(0.05)      # the "stalled" main thread
    assert codes == [HANG_EXIT_CODE]
    stacks = (tmp_path / "hang" / "rank0.txt").read_text()
    assert "no update completed" in stacks and "test_a_stalled_process_dumps_its_stacks_and_exits_4" in stacks
    assert "rank 0: after update 1, NOT waiting" in (tmp_path / "hang" / "summary.txt").read_text()


def test_no_alarm_while_updates_complete_or_while_paused(tmp_path):
    codes = []
    dog = Watchdog(tmp_path, 0, 1, factor=1.0, min_s=0.3, poll_s=0.05, exit=codes.append).start()
    for step in range(1, 12):     # updates keep completing: 1.1 s in all, each 0.1 s apart
        time.sleep(0.1)
        dog.beat(step, 0.1)
    with dog.pause():             # an evaluation longer than the limit
        time.sleep(0.8)
    time.sleep(0.1)
    dog.close()
    assert codes == [] and not (tmp_path / "hang").exists()
    assert dog.limit_s() == pytest.approx(0.3)


def test_the_first_rank_to_fire_makes_the_others_report_with_it(tmp_path):
    """Each rank's limit follows its own update times; a rank whose limit is far off still reports as soon as
    another rank's watchdog fires, so the summary has every rank (the store is torch's own, in this process)."""
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    codes: list = []
    patient = Watchdog(tmp_path, 0, 2, factor=1.0, min_s=0.3, store=store, poll_s=0.05, exit=codes.append,
                       print_fn=lambda *a, **k: None).start()
    eager = Watchdog(tmp_path, 1, 2, factor=1.0, min_s=0.3, store=store, poll_s=0.05, exit=codes.append,
                     print_fn=lambda *a, **k: None).start()
    patient.beat(1, 60.0)         # its updates took 60 s: its own limit is 60 s
    eager.beat(1, 0.01)           # 0.3 s
    deadline = time.monotonic() + 20
    while len(codes) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert codes == [HANG_EXIT_CODE] * 2
    summary = (tmp_path / "hang" / "summary.txt").read_text()
    assert "2 of 2 ranks reported" in summary, summary


def test_where_a_rank_waits():
    assert is_waiting("/x/site-packages/torch/distributed/distributed_c10d.py")
    assert is_waiting("/x/site-packages/torch/autograd/graph.py")
    assert not is_waiting("/x/zero2all/train/trainer.py")


def _stalling_worker(rank: int, world: int, port: int, out: str):
    from equivalence import train
    from test_distributed import gloo_worker

    from zero2all.train.trainer import Trainer

    original = Trainer.train_step

    def train_step(self):
        if rank == 1 and self.step == 2:   # rank 1 stalls before update 3; rank 0 waits for it in the backward
            time.sleep(120)
        return original(self)

    Trainer.train_step = train_step

    def work(env):
        train(Path(out) / "run", "parallel.mode='ddp'", "train.micro_batch_size=2", "train.max_steps=6",
              "train.watchdog_factor=1", "train.watchdog_min_s=2")

    gloo_worker(rank, world, port, out, work, timeout_s=120.0)


@pytest.mark.slow
def test_a_rank_that_stalls_is_named_and_every_rank_exits(tmp_path):
    from test_distributed import free_port

    t0 = time.monotonic()
    with pytest.raises(mp.ProcessExitedException) as failed:
        mp.spawn(_stalling_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    assert failed.value.exit_code == HANG_EXIT_CODE
    assert time.monotonic() - t0 < 90          # not the 120 s sleep, nor the 600 s collective timeout
    hang = tmp_path / "run" / "hang"
    summary = (hang / "summary.txt").read_text()
    assert "behind: rank 1" in summary, summary
    assert "rank 0: after update 2, waiting for the other ranks" in summary, summary
    assert "in train_step" in (hang / "rank1.txt").read_text()


def _slow_data_worker(rank: int, world: int, port: int, out: str):
    from equivalence import train
    from test_distributed import gloo_worker

    from zero2all.train.trainer import Trainer

    original = Trainer._to_device

    def slow(self, batch):
        if rank == 1:
            time.sleep(0.05)   # rank 1's data loading is slow: every micro-batch 50 ms late
        return original(self, batch)

    Trainer._to_device = slow

    def work(env):
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            train(Path(out) / "run", "parallel.mode='ddp'", "train.micro_batch_size=2", "train.max_steps=15",
                  "train.straggler_window=3")
        (Path(out) / f"stdout{rank}.txt").write_text(buf.getvalue())

    gloo_worker(rank, world, port, out, work, timeout_s=120.0)


@pytest.mark.slow
def test_a_rank_with_slow_data_is_named_as_the_straggler(tmp_path):
    import json

    from test_distributed import free_port

    mp.spawn(_slow_data_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    said = (tmp_path / "stdout0.txt").read_text()
    assert "straggler: rank 1 is the one the others wait for" in said, said[-2000:]
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r.get("kind") == "train"]
    assert all("data_wait_s" in r and "arrival_wait_s" in r for r in train)
    judged = [r for r in train if "straggler/slowest_rank" in r]
    assert judged and all(r["straggler/slowest_rank"] == 1 for r in judged)
    # rank 1 waits ~100 ms per update (2 micro-batches x 50 ms) longer than rank 0 for its data
    assert all(r["straggler/data_wait_gap_s"] > 0.05 for r in judged)
