"""The hang watchdog: a run whose updates stop completing is diagnosed and stopped instead of waiting forever.

Every rank starts a daemon thread. The training loop calls :meth:`Watchdog.beat` after each optimiser update
(and :meth:`Watchdog.pause` around evaluations and checkpoints, which have their own collective timeout). When no
update has completed for ``limit`` seconds,

    limit = max(train.watchdog_min_s, train.watchdog_factor x the median time of the recent updates)

(armed after the first update, whose time includes compilation and warm-up), or as soon as another rank's has
fired (each rank's limit follows its own update times, so the ranks' limits differ; the first to fire tells the
others through the process group's store, and all of them report together), the thread of each rank:

1. writes every thread's Python stack to ``OUT/hang/rank<r>.txt`` (``faulthandler``) and, under NCCL, torch's
   flight recorder of the recent collectives to ``OUT/hang/rank<r>-nccl.pkl`` (when this torch records them:
   ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0);
2. publishes, through the process group's store, where its main thread is: the innermost frames, and whether they
   are where a rank waits for the others (``torch.distributed``, or autograd's backward, inside which DDP's and
   FSDP's reductions run);
3. on the lowest rank that reports, writes ``OUT/hang/summary.txt``: per rank its last completed update and
   where its main thread is, and which ranks are *behind*: fewer updates completed than the others, or not
   waiting while the others wait (the rank the others are waiting for);
4. prints one line naming the ranks behind and exits with code 4 (``os._exit``: the main thread is blocked).

A single process gets steps 1 and 4 (a stuck data loader or device shows in its stack).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

HANG_EXIT_CODE = 4
_KEY = "z2all/hang/"


# where a blocked rank's main thread waits for the others: a collective (torch.distributed) or a backward pass,
# inside which DDP's and FSDP's gradient reductions run
WAIT_PLACES = ("torch/distributed/", "torch/autograd/")


def main_thread_where(depth: int = 6) -> tuple[list[str], str]:
    """The innermost ``depth`` frames of the main thread (``file:line in function``, innermost last) and the
    innermost frame's full file path."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return [], ""
    stack = traceback.extract_stack(frame)[-depth:]
    return [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in stack], stack[-1].filename if stack else ""


def is_waiting(innermost_file: str) -> bool:
    """Whether a main thread blocked there is waiting for other ranks (see ``WAIT_PLACES``)."""
    path = innermost_file.replace("\\", "/")
    return any(place in path for place in WAIT_PLACES)


class Watchdog:
    """See the module docstring. ``store``: the process group's store (None: one process)."""

    def __init__(self, out_dir: Path, rank: int, world_size: int, factor: float, min_s: float, store=None,
                 poll_s: float = 0.5, report_wait_s: float = 10.0, exit=os._exit, print_fn=print):
        self.out_dir, self.rank, self.world_size = Path(out_dir), rank, world_size
        self.factor, self.min_s, self.store = factor, min_s, store
        self.poll_s, self.report_wait_s, self._exit, self._print = poll_s, report_wait_s, exit, print_fn
        self.times: deque[float] = deque(maxlen=50)
        self.step = 0
        self.last = time.monotonic()
        self.paused = 0
        self.armed = False
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="z2all-watchdog", daemon=True)

    # -- the training loop's side -----------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        if self.factor > 0:
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def beat(self, step: int, step_time_s: float) -> None:
        """An update completed."""
        self.step = step
        self.times.append(step_time_s)
        self.last = time.monotonic()
        self.armed = True

    @contextlib.contextmanager
    def pause(self):
        """Evaluations and checkpoints do not count (they have their own collective timeout)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1
            self.last = time.monotonic()

    def limit_s(self) -> float:
        median = statistics.median(self.times) if self.times else 0.0
        return max(self.min_s, self.factor * median)

    # -- the thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.armed and not self.paused and (time.monotonic() - self.last > self.limit_s()
                                                   or self._another_fired()):
                self.fire()
                return

    def _another_fired(self) -> bool:
        """Whether another rank's watchdog has fired. Asked of the store only once ``min_s`` has passed without an
        update here (no rank fires sooner: every rank's limit is at least ``min_s`` and the ranks' updates end
        together), so a run whose updates keep completing sends the store nothing."""
        if self.store is None or self.world_size == 1 or time.monotonic() - self.last <= self.min_s:
            return False
        try:
            return bool(self.store.check([f"{_KEY}fired"]))
        except Exception:
            return False

    def fire(self) -> None:
        """Dump, report, exit (see the module docstring)."""
        self.fired = True
        self._store_set(f"{_KEY}fired", str(self.rank))   # the other ranks report now, not at their own limits
        waited = time.monotonic() - self.last
        hang = self.out_dir / "hang"
        hang.mkdir(parents=True, exist_ok=True)
        stacks = hang / f"rank{self.rank}.txt"
        with open(stacks, "w") as f:
            f.write(f"rank {self.rank}: no update completed for {waited:.0f} s after update {self.step} "
                    f"(limit {self.limit_s():.0f} s)\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self._dump_flight_recorder(hang)
        frames, innermost = main_thread_where()
        mine = {"rank": self.rank, "step": self.step, "frames": frames, "waiting": is_waiting(innermost)}
        reports = self._exchange(mine)
        # behind: fewer updates completed than the others, or not waiting while others wait
        latest = max(r["step"] for r in reports)
        behind = [r for r in reports if r["step"] < latest]
        if not behind and any(r["waiting"] for r in reports):
            behind = [r for r in reports if not r["waiting"]]
        lines = [f"no update completed for {waited:.0f} s (limit {self.limit_s():.0f} s = max(train.watchdog_min_s, "
                 f"train.watchdog_factor x median update time)); {len(reports)} of {self.world_size} ranks reported"]
        for r in sorted(reports, key=lambda r: r["rank"]):
            state = "waiting for the other ranks" if r["waiting"] else "NOT waiting for another rank"
            lines.append(f"rank {r['rank']}: after update {r['step']}, {state}, main thread at "
                         f"{' <- '.join(reversed(r['frames'][-3:]))}")
        if behind:
            lines.append(f"behind: rank {', '.join(str(r['rank']) for r in behind)} (the others wait for it)")
        if self.rank == min(r["rank"] for r in reports):
            (hang / "summary.txt").write_text("\n".join(lines) + "\n")
            who = f"rank {', '.join(str(r['rank']) for r in behind)} is behind" if behind else \
                "no rank stands out"
            self._print(f"hang: {lines[0]}; {who}; stacks and summary in {hang}", flush=True)
            self._store_set(f"{_KEY}done", "1")
        else:  # let the reporting rank finish writing before this process (and so the launcher) goes
            self._wait_for([f"{_KEY}done"])
        self._exit(HANG_EXIT_CODE)

    def _store_set(self, key: str, value: str) -> None:
        if self.store is not None:
            try:
                self.store.set(key, value)
            except Exception:
                pass

    def _wait_for(self, keys: list[str]) -> None:
        deadline = time.monotonic() + self.report_wait_s
        while self.store is not None and time.monotonic() < deadline:
            try:
                if self.store.check(keys):
                    return
            except Exception:
                return
            time.sleep(0.2)

    def _dump_flight_recorder(self, hang: Path) -> None:
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"):
                return
            from torch._C._distributed_c10d import _dump_nccl_trace

            (hang / f"rank{self.rank}-nccl.pkl").write_bytes(_dump_nccl_trace())
        except Exception as e:  # the recorder is optional (off unless TORCH_NCCL_TRACE_BUFFER_SIZE > 0)
            (hang / f"rank{self.rank}-nccl.txt").write_text(f"no flight recorder dump: {e}\n")

    def _exchange(self, mine: dict) -> list[dict]:
        """Publish this rank's report and collect the others' (those that arrive within ``report_wait_s``)."""
        if self.store is None or self.world_size == 1:
            return [mine]
        try:
            self.store.set(f"{_KEY}{self.rank}", json.dumps(mine))
        except Exception:
            return [mine]
        reports = {self.rank: mine}
        deadline = time.monotonic() + self.report_wait_s
        while len(reports) < self.world_size and time.monotonic() < deadline:
            for r in range(self.world_size):
                if r not in reports:
                    try:
                        if self.store.check([f"{_KEY}{r}"]):
                            reports[r] = json.loads(self.store.get(f"{_KEY}{r}"))
                    except Exception:
                        pass
            time.sleep(0.2)
        return list(reports.values())


def default_store():
    """The default process group's store, or None (one process)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store

            return _get_default_store()
    except Exception:
        return None
    return None


class StragglerMonitor:
    """Which rank the others wait for, from two per-rank times of every update (``train.straggler_window``):

    * ``data_wait_s``: the time this rank spent getting its micro-batches (reading, collating, copying);
    * ``arrival_wait_s``: the time it spent in the update's last collective (the all-reduce of the logged loss, after
      the host has waited for the device): every rank leaves it together, so a rank that arrives early waits long
      and the rank the others wait for waits about nothing.

    Every ``window`` updates each rank publishes its window means through the process group's store; rank 0 reads
    the previous window's. The suspect is the rank with the lowest arrival wait (gap: the others' median minus
    its own) or the rank with the highest data wait (gap: its own minus the others' median), whichever gap is
    larger; when that gap exceeds ``threshold`` of the median update time for the same rank in ``patience``
    windows in a row, the rank is named. Under DDP the gradient all-reduce runs inside the backward pass, so the
    others' wait for a rank whose compute is slow lands there, not in the arrival wait: such a rank shows in the
    update time of all ranks but is not attributed (its data wait still is). Returns the metrics to log."""

    def __init__(self, rank: int, world_size: int, window: int, store=None, threshold: float = 0.05,
                 patience: int = 3):
        self.rank, self.world_size, self.window, self.store = rank, world_size, window, store
        self.threshold, self.patience = threshold, patience
        self.rows: list[tuple[float, float, float]] = []
        self.suspect, self.count = None, 0

    @property
    def enabled(self) -> bool:
        return self.window > 0 and self.world_size > 1 and self.store is not None

    def observe(self, step: int, step_time_s: float, data_wait_s: float, arrival_wait_s: float):
        """Record an update; at a window's end publish it, and on rank 0 judge the previous window. Returns
        (metrics to log, a warning line or None)."""
        if not self.enabled:
            return {}, None
        self.rows.append((step_time_s, data_wait_s, arrival_wait_s))
        if step % self.window:
            return {}, None
        n = len(self.rows)
        means = [sum(r[i] for r in self.rows) / n for i in range(3)]
        self.rows = []
        window_id = step // self.window
        try:
            self.store.set(f"z2all/strag/{window_id}/{self.rank}", json.dumps(means))
        except Exception:
            return {}, None
        if self.rank != 0 or window_id < 2:
            return {}, None
        return self._judge(window_id - 1)

    def _judge(self, window_id: int):
        per_rank = {}
        for r in range(self.world_size):
            key = f"z2all/strag/{window_id}/{r}"
            try:
                if self.store.check([key]):
                    per_rank[r] = json.loads(self.store.get(key))
            except Exception:
                pass
        if len(per_rank) < self.world_size:
            return {}, None
        step_med = statistics.median(v[0] for v in per_rank.values())

        def others(r, i):
            return statistics.median(v[i] for q, v in per_rank.items() if q != r)

        late = min(per_rank, key=lambda r: per_rank[r][2])       # the others waited for it at the end
        late_gap = others(late, 2) - per_rank[late][2]
        hungry = max(per_rank, key=lambda r: per_rank[r][1])     # waited longest for its own data
        data_gap = per_rank[hungry][1] - others(hungry, 1)
        slow, gap = (late, late_gap) if late_gap >= data_gap else (hungry, data_gap)
        metrics = {"straggler/slowest_rank": slow, "straggler/gap_s": gap, "straggler/arrival_wait_gap_s": late_gap,
                   "straggler/data_wait_gap_s": data_gap}
        if gap > self.threshold * step_med:
            self.count = self.count + 1 if slow == self.suspect else 1
            self.suspect = slow
        else:
            self.suspect, self.count = None, 0
        if self.count != self.patience:
            return metrics, None
        why = (f"the others waited {1000 * late_gap:.0f} ms per update for it at the end of each update"
               if late_gap >= data_gap else
               f"it waited {1000 * data_gap:.0f} ms per update longer than the others for its data")
        line = (f"straggler: rank {slow} is the one the others wait for: in {self.patience} windows of "
                f"{self.window} updates in a row {why} ({100 * gap / step_med:.0f} % of the "
                f"{1000 * step_med:.0f} ms update; data wait {1000 * per_rank[slow][1]:.0f} ms against the "
                f"others' {1000 * others(slow, 1):.0f} ms)")
        return metrics, line
