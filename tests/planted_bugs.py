"""Plant the bugs the distributed equivalence tests exist to catch, one at a time, and report which tests catch them.

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python tests/planted_bugs.py [--bugs NAME,...] [TEST_FILE_OR_NODE ...]

Each bug is an edit of the package's source in a scratch copy of the repository (the checkout itself is never
touched; the copy is removed afterwards) that acts only in a multi-process run (``torch.distributed`` initialised
with more than one rank), so the single-process reference stays right and a test that compares the two must fail:

- ``grads_x2_one_rank``: rank 1 back-propagates twice its loss (the value logged is unchanged): its gradients x2;
- ``block_grad_half``: the output of the first block passes half its gradient (one block's gradient x0.5);
- ``norm_grad_half``: every RMSNorm weight receives half its gradient (norm weights' gradient x0.5).

Every test run under a bug must fail; a test that passes under a bug cannot see that kind of bug. Run it after any
change of a tolerance of these tests (it takes several minutes per test file on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DIST = ("__import__('torch').distributed.is_available() and __import__('torch').distributed.is_initialized() "
        "and __import__('torch').distributed.get_world_size() > 1")
RANK1 = f"({DIST} and __import__('torch').distributed.get_rank() == 1)"
TWICE = "{0} + ({0} - {0}.detach())"   # the same value, twice the gradient

BUGS = {
    "grads_x2_one_rank": [
        ("zero2all/model/z2all.py", "        return logits, loss if aux is None else loss + aux",
         "        loss = loss if aux is None else loss + aux\n"
         f"        loss = {TWICE.format('loss')} if {RANK1} else loss\n"
         "        return logits, loss"),
        ("zero2all/model/z2all.py", "                return None, loss if aux is None else loss + aux",
         "                loss = loss if aux is None else loss + aux\n"
         f"                loss = {TWICE.format('loss')} if {RANK1} else loss\n"
         "                return None, loss"),
        ("zero2all/distributed/pp.py", "    return ops.upcast(mean).reshape(1) * n_valid",
         f"    out = ops.upcast(mean).reshape(1) * n_valid\n    return {TWICE.format('out')} if {RANK1} else out"),
        ("zero2all/distributed/pp.py", "        return ops.upcast(mean).reshape(1) * (labels != -100).sum()",
         "        out = ops.upcast(mean).reshape(1) * (labels != -100).sum()\n"
         f"        return {TWICE.format('out')} if {RANK1} else out"),
    ],
    "block_grad_half": [
        ("zero2all/model/z2all.py",
         "            x, residual = layer(x, residual, cos, sin, kv_cache, start_pos, doc_ids, attn_mask)",
         "            x, residual = layer(x, residual, cos, sin, kv_cache, start_pos, doc_ids, attn_mask)\n"
         f"            if layer is self.layers[0] and {DIST}:\n"
         "                x = 0.5 * x + 0.5 * x.detach()"),
        ("zero2all/distributed/pp.py",
         "        for layer in self.layers.values():\n            x, residual = layer(x, residual, cos, sin, None, 0, "
         "doc_ids, None)",
         "        for key, layer in self.layers.items():\n            x, residual = layer(x, residual, cos, sin, None, "
         f"0, doc_ids, None)\n            if key == '0' and {DIST}:\n                x = 0.5 * x + 0.5 * x.detach()"),
    ],
    "norm_grad_half": [
        ("zero2all/model/ops.py", "    weight = local_weight(weight)\n",
         f"    weight = local_weight(weight)\n    if {DIST}:\n        weight = 0.5 * weight + 0.5 * weight.detach()\n"),
    ],
}

DEFAULT_TESTS = ["tests/test_distributed.py::test_parallel_modes_match_single_process",
                 "tests/test_parallel_mesh.py::test_mesh_runs_match_single_process_and_resume_across_meshes",
                 "tests/test_parallel_pp.py::test_pp2_every_schedule_matches_one_process_and_resumes_on_one",
                 "tests/test_parallel_pp_dp.py", "tests/test_moe_ep.py::test_ep2_and_ep2_dp2_match_single_process_"
                 "and_resume"]


def copy_with(bug: str, scratch: Path) -> Path:
    """A copy of the package and the tests under ``scratch`` with ``bug`` planted; returns its root."""
    root = scratch / bug
    for name in ("zero2all", "tests"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    for rel, old, new in BUGS[bug]:
        path = root / rel
        text = path.read_text()
        assert text.count(old) == 1, f"{bug}: {rel} no longer holds the line to mutate: {old!r}"
        path.write_text(text.replace(old, new))
    return root


def run(root: Path, test: str) -> tuple[bool, str]:
    """(passed, the first assertion line) of one pytest run in the copy ``root``."""
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "--tb=short", "-p", "no:cacheprovider",
                           "-m", "slow or not slow", test], cwd=root, env=env, capture_output=True, text=True)
    lines = [ln.strip() for ln in proc.stdout.splitlines() if re.match(r"^E\s+(AssertionError|assert|.*Error)", ln)]
    return proc.returncode == 0, lines[0][:200] if lines else proc.stdout.strip().splitlines()[-1][:200]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bugs", default=",".join(BUGS))
    ap.add_argument("tests", nargs="*", default=DEFAULT_TESTS)
    args = ap.parse_args()
    missed = 0
    with tempfile.TemporaryDirectory(prefix="planted-bugs-") as scratch:
        for bug in args.bugs.split(","):
            root = copy_with(bug, Path(scratch))
            for test in args.tests:
                passed, line = run(root, test)
                missed += passed
                print(f"{bug:20s} {'MISSED' if passed else 'caught'}  {test}\n{'':22s}{line}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
