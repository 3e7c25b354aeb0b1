"""Running the data commands' work units on a Ray cluster (``--ray``, or ``RAY_ADDRESS`` set).

Ray is an optional extra (``pip install 'zero2all[ray]'``), imported only here and only when asked for. Nothing of
the pipeline is rewritten for it: the driver cuts the same work units as the local path and Ray runs the same pure
functions on them (``clean_chunk`` as Ray tasks; ``tokenize_chunk`` on Ray actors that load the tokenizer once),
and, for ``clean``'s near-duplicate stage, one Ray task per LSH band (:func:`band_candidates` and
:func:`verify_pairs` of :mod:`zero2all.corpus.clean.minhash` over the memory-mapped signatures) whose pairs the
driver merges in band order exactly as the local loop does (union-find, ~8 bytes per document), so the outputs are
those of the local path, byte for byte, with the same duplicate clusters and counts. Results are consumed in
work-unit order with a bounded number in flight (two per worker), so the driver's memory does not grow with the
corpus (besides ``clean``'s per-document arrays of stage 2, ~60 bytes per document).

Fault tolerance is Ray's: a task whose worker dies, or that raises, is retried (``max_retries``; exceptions too),
and an actor that dies is restarted. A killed driver loses nothing finished: every work unit's output is written
atomically with a done marker by the command's own resume logic, and the rerun skips finished units. On a cluster
of several machines the output folder must be on a file system every node sees (NFS, a cluster file system), and
the ``zero2all`` package installed on every node.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Callable, Iterable

from zero2all.config import ConfigError


def local_pool_context():
    """The start method of the local (non-Ray) worker pools: fork, which is cheap and works from any ``__main__``
    (spawn re-imports it), except once Ray is loaded in this process: its gRPC threads stay alive even after
    ``ray.shutdown()`` and may hold a lock at the moment of a fork, which the child then inherits locked and waits on
    forever; spawn then."""
    import multiprocessing as mp
    import sys

    fork = "fork" in mp.get_all_start_methods() and "ray" not in sys.modules
    return mp.get_context("fork" if fork else "spawn")

__all__ = ["RETRIES", "connect", "ordered_map", "ray_requested", "ray_workers"]

RETRIES = 3
_EXTRA = "pip install 'zero2all[ray]'"


def ray_requested(flag: bool | None) -> bool:
    """``--ray`` given, or (when the flag was not given at all) ``RAY_ADDRESS`` set in the environment."""
    return bool(flag) if flag is not None else bool(os.environ.get("RAY_ADDRESS"))


def connect():
    """The ``ray`` module, connected: to the running session of this process if there is one, else to
    ``RAY_ADDRESS`` (a cluster), else to a new local cluster on this machine."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--ray: Ray is not installed; {_EXTRA} (the ray extra)") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    return ray


def ray_workers(ray, workers: int | None) -> int:
    """Work units in flight: ``workers`` when given, else the cluster's CPUs."""
    if workers:
        return workers
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def ordered_map(submit: Callable[[Any, int], Any], items: Iterable, in_flight: int, consume: Callable[[Any, Any], None],
                get: Callable[[Any], Any]) -> None:
    """``submit(item, slot)`` -> an object ref for each item, at most ``in_flight`` pending; ``consume(item,
    result)`` in item order. ``slot`` counts 0, 1, 2, ... (round robin over actors)."""
    pending: collections.deque = collections.deque()
    for n, item in enumerate(items):
        pending.append((item, submit(item, n)))
        while len(pending) >= in_flight:
            item0, ref = pending.popleft()
            consume(item0, get(ref))
    while pending:
        item0, ref = pending.popleft()
        consume(item0, get(ref))
