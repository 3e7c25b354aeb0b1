"""Planted bugs: does each numerical test fail on the bug it exists to catch?

Each entry of ``MUTATIONS`` is plain data: the bug as text substitutions in the package's source (``file``,
``find``, ``replace`` and optionally ``count``, the number of times ``find`` must occur, default 1; or ``edits``, a
list of such dicts, for a bug that lives in several places) and the tests meant to catch it. The distributed bugs
act only in a multi-process run (``torch.distributed`` initialised with more than one rank), so the single-process
reference those tests compare with stays right. For each entry the script copies the tree into a
temporary folder, applies the substitution there (the checkout is never modified), runs the tests with pytest
(``-x``: the first failure is enough) and prints one table row: caught (a test failed), MISSED (every test passed)
or ERROR (pytest could not run them, or ``find`` no longer matches the source).

By default the tests of each entry are first run on the unmodified copy (a test that fails without the bug proves
nothing); ``--no-baseline`` skips that. Not part of the test suite: it runs minutes on a 2-core CPU.

    python tests/mutations.py                 # every entry
    python tests/mutations.py --list          # the entries' names
    python tests/mutations.py -k hook -k fp8  # the entries whose name contains any of these words
    python tests/mutations.py -t pp_dp        # every entry, with only its tests whose node id contains pp_dp

Adding a bug: append a dict with ``bug``, ``tests`` (pytest node ids, relative to the repository root) and either
``file``, ``find``, ``replace`` (optionally ``count``) or ``edits``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONVERGENCE = "tests/test_convergence.py::test_convergence_fused_vs_plain_cpu"
FP8_MODEL = "tests/test_fp8_numerics.py::test_model_fp8_kernels_match_reference_path_and_stay_near_full_precision"
DP_MODES = "tests/test_distributed.py::test_parallel_modes_match_single_process"
CLIP_ENTRY = '''    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
'''


# the distributed bugs: Python expressions true only in a multi-process run (and on its rank 1)
DIST = ("__import__('torch').distributed.is_available() and __import__('torch').distributed.is_initialized() "
        "and __import__('torch').distributed.get_world_size() > 1")
RANK1 = f"({DIST} and __import__('torch').distributed.get_rank() == 1)"
TWICE = "{0} + ({0} - {0}.detach())"   # the same value, twice the gradient
MESH = "tests/test_parallel_mesh.py::test_mesh_runs_match_single_process_and_resume_across_meshes"
PP = "tests/test_parallel_pp.py::test_pp2_every_schedule_matches_one_process_and_resumes_on_one"
PP_MOE = "tests/test_parallel_pp.py::test_moe_pp2_every_schedule_matches_one_process_with_its_auxiliary_losses"
PP_DP = "tests/test_parallel_pp_dp.py::test_pp2_with_dp2_and_with_tp2_match_one_process"
EP = "tests/test_moe_ep.py::test_ep2_and_ep2_dp2_match_single_process_and_resume"
SPEC = "tests/test_speculative.py::"
SPEC_GREEDY = SPEC + "test_any_draft_gives_the_plain_greedy_tokens"
SPEC_OWN = SPEC + "test_the_target_as_its_own_draft_accepts_every_draft"
SPEC_CACHE = SPEC + "test_the_draft_cache_follows_the_target"
SPEC_SAMPLING = SPEC + "test_speculative_sampling_emits_the_targets_distribution"
SPEC_SAMPLED_ROWS = SPEC + "test_sampled_rows_through_the_scheduler_follow_the_models_distribution"
TRAINER_UPDATE = "        self.scaler.unscale_(params)\n"  # Trainer.train_step: after backward, before the norm


def _scale_distributed_grads(select: str, factor: float) -> str:
    """Source that scales, on more than one process only, the gradients of the parameters whose name satisfies
    ``select`` (a Python expression in ``name``) just before the clipping every training loop calls."""
    return CLIP_ENTRY + f'''    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        for name, p in model.named_parameters():
            if p.grad is not None and ({select}):
                p.grad.mul_({factor})
'''


MUTATIONS: list[dict] = [
    dict(bug="every gradient of the fused path x16 (fused cross-entropy backward)",
         file="zero2all/kernels/cross_entropy.py",
         find="    g = grad_loss.to(torch.float32)\n",
         replace="    g = grad_loss.to(torch.float32) * 16\n",
         tests=[CONVERGENCE]),
    dict(bug="down_proj weight gradient halved (fused SwiGLU + down backward)",
         file="zero2all/kernels/fused_linear.py",
         find="return dgu.view(gate_up.shape), dw, db, bwd.counts\n\n\n@_swiglu_linear_bwd.register_fake",
         replace="return dgu.view(gate_up.shape), dw * 0.5, db, bwd.counts\n\n\n@_swiglu_linear_bwd.register_fake",
         tests=[CONVERGENCE]),
    dict(bug="FP8 rowwise: output gradient not quantised in the kernels' backward",
         file="zero2all/kernels/fused_linear.py",
         find='self.fp8 = None if precision == "bf16" else',
         replace='self.fp8 = None if precision in ("bf16", "fp8_rowwise") else',
         tests=[FP8_MODEL]),
    dict(bug="residual stream not kept in float32",
         file="zero2all/model/ops.py",
         find="x.float() if residual_in_fp32 else x",
         replace="x",
         count=2,
         tests=["tests/test_model.py::test_residual_fp32_under_bf16_autocast"]),
    dict(bug="DDP fp16 compression hook ignored",
         file="zero2all/distributed/ddp.py",
         find="        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)\n",
         replace="        pass\n",
         tests=[DP_MODES]),
    dict(bug="DDP PowerSGD hook ignored",
         file="zero2all/distributed/ddp.py",
         find="        ddp.register_comm_hook(state, hook.powersgd_hook)\n",
         replace="",
         tests=[DP_MODES]),
    dict(bug="data parallel: every gradient x2",
         file="zero2all/distributed/__init__.py",
         find=CLIP_ENTRY,
         replace=_scale_distributed_grads("True", 2),
         tests=[DP_MODES]),
    dict(bug="data parallel: the last block's gradients x0.5",
         file="zero2all/distributed/__init__.py",
         find=CLIP_ENTRY,
         replace=_scale_distributed_grads('"layers.2." in name', 0.5),
         tests=[DP_MODES]),
    dict(bug="tp x dp mesh: the norm weights' gradients x0.5",
         file="zero2all/distributed/mesh.py",
         find="    groups: dict = {}\n",
         replace="    for p in params:\n        if p.grad is not None and p.dim() == 1:   # the norm weights\n"
                 "            p.grad = p.grad * 0.5\n    groups: dict = {}\n",
         tests=[MESH]),
    # the trainer's loop on every mesh (tests/equivalence.py: loss, gradient norm and parameters in float64)
    dict(bug="one rank's loss back-propagated twice (rank 1: its gradients x2 before the data-parallel mean)",
         file="zero2all/model/z2all.py", find="        return logits, loss\n",
         replace=f"        loss = {TWICE.format('loss')} if {RANK1} else loss\n        return logits, loss\n",
         tests=[DP_MODES, MESH, PP, EP]),
    # the loss seam the last pipeline stage calls (Z2all.head_loss, reduction="sum"): its MoE terms
    dict(bug="the summed loss leaves out the MoE terms (the last pipeline stage's blocks' auxiliary losses)",
         file="zero2all/model/z2all.py",
         find="            loss = loss + (aux * (targets != -100).sum() if reduction == \"sum\" else aux)",
         replace="            loss = loss + (0.0 * aux if reduction == \"sum\" else aux)",
         tests=[PP_MOE]),
    dict(bug="the summed loss weighs the MoE terms by 1, not by the microbatch's valid-token count",
         file="zero2all/model/z2all.py",
         find="            loss = loss + (aux * (targets != -100).sum() if reduction == \"sum\" else aux)",
         replace="            loss = loss + aux",
         tests=[PP_MOE]),
    dict(bug="a stage other than the last weighs its MoE terms by 1 / 2 (as if every microbatch held as many "
             "valid tokens), not by the microbatch's share of them",
         file="zero2all/distributed/pp.py",
         find="        return attach_loss(x, aux, share * self.multiplier)",
         replace="        return attach_loss(x, aux, 0.5 * self.multiplier)",
         tests=["tests/test_parallel_pp.py::"
                "test_every_stage_weighs_its_moe_terms_by_the_microbatchs_share_of_the_valid_tokens"]),
    dict(bug="gradients x2 on one rank (rank 1, after backward, before the norm and the update)",
         file="zero2all/train/trainer.py", find=TRAINER_UPDATE,
         replace=TRAINER_UPDATE + f"        if {RANK1}:\n"
                                  "            for p in params:\n"
                                  "                if p.grad is not None:\n"
                                  "                    p.grad.mul_(2)\n",
         tests=[PP_DP, MESH, PP, EP]),
    dict(bug="the first block passes half its gradient (one block's gradients x0.5)",
         edits=[dict(file="zero2all/model/z2all.py",
                     find="            x, residual = layer(x, residual, cos, sin, kv_cache, start_pos, doc_ids, "
                          "attn_mask)",
                     replace="            x, residual = layer(x, residual, cos, sin, kv_cache, start_pos, doc_ids, "
                             f"attn_mask)\n            if layer is self.layers[0] and {DIST}:\n"
                             "                x = 0.5 * x + 0.5 * x.detach()"),
                dict(file="zero2all/distributed/pp.py",
                     find="        for layer in self.layers.values():\n            x, residual = layer(x, residual, "
                          "cos, sin, None, 0, doc_ids, None)",
                     replace="        for key, layer in self.layers.items():\n            x, residual = layer(x, "
                             f"residual, cos, sin, None, 0, doc_ids, None)\n            if key == '0' and {DIST}:\n"
                             "                x = 0.5 * x + 0.5 * x.detach()")],
         tests=[DP_MODES, MESH, PP, PP_DP, EP]),
    dict(bug="every RMSNorm weight receives half its gradient (multi-process runs)",
         file="zero2all/model/ops.py", find="    weight = local_weight(weight)\n",
         replace=f"    weight = local_weight(weight)\n    if {DIST}:\n"
                 "        weight = 0.5 * weight + 0.5 * weight.detach()\n",
         tests=[DP_MODES, MESH, PP, PP_DP, EP]),
    dict(bug="speculative decoding: the target's cache rolled back one token too far (the drawn token dropped)",
         file="zero2all/infer/paged.py", find="        s.computed = self._verify_start[row] + 1 + accepted\n",
         replace="        s.computed = self._verify_start[row] + accepted\n",
         tests=[SPEC_GREEDY, SPEC_OWN]),
    dict(bug="speculative decoding: the draft model's cache keeps one rejected draft token",
         file="zero2all/infer/scheduler.py", find="self.drafter.rollback(row, S.rows[row].computed)",
         replace="self.drafter.rollback(row, S.rows[row].computed + 1)", tests=[SPEC_CACHE]),
    dict(bug="speculative decoding: the draft is fed only the drawn token (an accepted last draft never fed)",
         file="zero2all/infer/speculative.py",
         find="fed = {r: list(history[r][S.rows[r].computed:]) + [drawn[r]] for r in rows}",
         replace="fed = {r: [drawn[r]] for r in rows}", tests=[SPEC_CACHE, SPEC_OWN]),
    dict(bug="speculative sampling keeps every draft token (no min(1, p/q) test)",
         file="zero2all/infer/speculative.py", find="        if rng.random() < min(1.0, ratio[i]):\n",
         replace="        if rng.random() < 2.0:\n", tests=[SPEC_SAMPLING, SPEC_SAMPLED_ROWS]),
    dict(bug="speculative sampling draws a rejected draft's replacement from p instead of max(0, p - q)",
         file="zero2all/infer/speculative.py", find="        residual = (p64[i] - q64[i]).clamp_(min=0)\n",
         replace="        residual = p64[i].clone()\n", tests=[SPEC_SAMPLING, SPEC_SAMPLED_ROWS]),
]


def copy_tree(dest: Path) -> None:
    shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "site", "__pycache__", ".pytest_cache", "*.egg-info", ".whl", ".gl"))


def run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """('pass' | 'fail' | 'error (...)', seconds, the output's last lines) of pytest on ``tests`` in ``tree``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("TRITON_INTERPRET", "1")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"error (over {timeout:.0f} s)", time.perf_counter() - start, ""
    seconds = time.perf_counter() - start
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    if proc.returncode == 0:
        return "pass", seconds, tail
    if proc.returncode == 1:
        return "fail", seconds, tail
    return f"error (pytest exit {proc.returncode})", seconds, tail


def edits(mutation: dict) -> list[dict]:
    """The substitutions of an entry: its ``edits``, or its own ``file`` / ``find`` / ``replace`` / ``count``."""
    return mutation.get("edits") or [mutation]


def apply(tree: Path, mutation: dict) -> dict[str, str] | None:
    """Apply ``mutation`` in ``tree``; return {file: its original text}, or None (nothing changed) if a ``find``
    does not occur ``count`` times (the source moved on: update the entry)."""
    texts: dict[str, str] = {}
    for edit in edits(mutation):
        text = texts.get(edit["file"], (tree / edit["file"]).read_text())
        if text.count(edit["find"]) != edit.get("count", 1):
            return None
        texts[edit["file"]] = text.replace(edit["find"], edit["replace"])
    originals = {}
    for name, text in texts.items():
        originals[name] = (tree / name).read_text()
        (tree / name).write_text(text)
    return originals


def failed_tests(tail: str) -> list[str]:
    """The node ids pytest's summary lists as FAILED or ERROR."""
    found = []
    for line in tail.splitlines():
        for word in ("FAILED ", "ERROR "):
            if line.startswith(word):
                found.append(line[len(word):].split(" - ")[0].strip().removeprefix("tests/"))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="only entries whose bug contains this word")
    parser.add_argument("-t", action="append", default=[],
                        help="run only the tests of each entry whose node id contains this text (e.g. pp_dp)")
    parser.add_argument("--list", action="store_true", help="print the entries and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of each test set without the bug")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    parser.add_argument("-v", action="store_true", help="print pytest's last lines for every run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.k or any(k.lower() in m["bug"].lower() for k in args.k)]
    if args.t:
        chosen = [dict(m, tests=[t for t in m["tests"] if any(part in t for part in args.t)]) for m in chosen]
        chosen = [m for m in chosen if m["tests"]]
    if args.list or not chosen:
        for m in chosen or MUTATIONS:
            files = sorted({e["file"] for e in edits(m)})
            print(f"{m['bug']}: {', '.join(files)} -> {' '.join(m['tests'])}")
        return 0 if chosen else 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="z2all-mutations-") as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        check = subprocess.run([sys.executable, "-c", "import zero2all; print(zero2all.__file__)"], cwd=tree,
                               env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True)
        if not check.stdout.strip().startswith(str(tree)):
            print(f"mutations: the copy's zero2all is not the one imported ({check.stdout.strip()}{check.stderr})",
                  file=sys.stderr)
            return 1
        baseline: dict[tuple, str] = {}
        for m in chosen:
            key = tuple(m["tests"])
            if not args.no_baseline and key not in baseline:
                baseline[key], seconds, tail = run_tests(tree, m["tests"], args.timeout)
                print(f"[baseline {baseline[key]} in {seconds:.0f} s] {' '.join(m['tests'])}", flush=True)
                if args.v or baseline[key] != "pass":
                    print(tail, flush=True)
            originals = apply(tree, m)
            caught_by = ""
            if originals is None:
                result, seconds, tail = "ERROR (find text not in the source)", 0.0, ""
            else:
                try:
                    status, seconds, tail = run_tests(tree, m["tests"], args.timeout)
                finally:
                    for name, text in originals.items():
                        (tree / name).write_text(text)
                if baseline.get(key, "pass") != "pass":
                    result = f"ERROR (fails without the bug: {baseline[key]})"
                else:
                    result = {"fail": "caught", "pass": "MISSED"}.get(status, status.upper())
                    caught_by = ", ".join(failed_tests(tail)) if status == "fail" else ""
            rows.append((m["bug"], caught_by or "-", result, seconds))
            print(f"[{result} in {seconds:.0f} s] {m['bug']}", flush=True)
            if args.v and tail:
                print(tail, flush=True)
    # the table: each bug, the test that failed on it (pytest -x stops at the first), the verdict, seconds
    widths = [max(len(r[i]) for r in rows + [("bug", "caught by", "result")]) for i in range(3)]
    line = "| " + " | ".join("{:<%d}" % w for w in widths) + " | {:>5} |"
    print()
    print(line.format("bug", "caught by", "result", "s"))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|------:|")
    for bug, tests, result, seconds in rows:
        print(line.format(bug, tests, result, f"{seconds:.0f}"))
    return 0 if all(r[2] == "caught" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
