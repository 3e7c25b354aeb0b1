"""The race's run-time edits of the peers' training scripts: literal replacements, each anchored on a line that must
occur exactly once (a peer revision that moved it fails here, naming the anchor, rather than running unpatched).

    python benchmarks/race_patch.py nanochat PATH/scripts/base_train.py
    python benchmarks/race_patch.py modded PATH/train_gpt.py

Every edit only reads settings from the environment or adds a print; the recipes are untouched:

nanochat (``scripts/base_train.py``)
  * budget: with ``RACE_BUDGET_S`` set, after update ``RACE_FIX_STEP`` (default 20) the run's length
    ``num_iterations`` is fixed from the rate measured by nanochat's own clock (which leaves out its first 11
    updates: compilation), so that its training time is the budget; its LR warmdown, Muon momentum and weight
    decay schedules read ``num_iterations`` and so end there, as they would have with that length given up front.
    (Our trainer does the same with ``train.time_budget_s``.)

modded-nanogpt (``train_gpt.py`` of the last record before its attention kernel came from the Hugging Face hub)
  * ``num_iterations``, ``val_loss_every``, ``val_tokens`` and ``val_seq_len`` from ``RACE_ITERATIONS``,
    ``RACE_VAL_EVERY``, ``RACE_VAL_TOKENS``, ``RACE_VAL_SEQ_LEN`` (defaults: its own values); the validation
    sequence is shortened so that nearly all of a small validation file is read (``benchmarks/race_data.py``);
  * the training files are cycled (``itertools.cycle``, as its own comment suggests for several epochs): the
    corpus is smaller than what one budget reads;
  * one line ``race-params total=N embedding=M`` after the model is built;
  * budget: as for nanochat, from update ``RACE_FIX_STEP`` on, ``args.num_iterations`` (its LR and
    attention-window schedules read it) and the loop's end follow the rate its own clock measures (validation and
    the compilation warm-up are outside that clock). Its updates slow down as its attention window grows (665 ms
    at the start, 760 ms at the end on an H200), so the length is fixed again after every update from the rate of
    the last 20: fixed once at update 20, a 300 s budget ran 318 s (454 updates). Each correction moves the
    schedules' progress by about one update in 450.
"""

from __future__ import annotations

import sys
from pathlib import Path

_NC_BUDGET = '''
    if os.environ.get("RACE_BUDGET_S") and step == int(os.environ.get("RACE_FIX_STEP", "20")):  # race: budget
        _race_left = float(os.environ["RACE_BUDGET_S"]) - total_training_time
        _race_per_step = total_training_time / (step - 10)
        num_iterations = min(num_iterations, step + 1 + int(_race_left / _race_per_step))
        print0(f"race: time budget {os.environ['RACE_BUDGET_S']} s -> num_iterations {num_iterations}")
'''

_MD_BUDGET = '''
    if os.environ.get("RACE_BUDGET_S") and step + 1 >= int(os.environ.get("RACE_FIX_STEP", "20")):  # race: budget
        _race_clock.append(approx_training_time_ms)
        _race_n = min(20, len(_race_clock) - 1)
        _race_per_step = ((_race_clock[-1] - _race_clock[-1 - _race_n]) / _race_n if _race_n
                          else approx_training_time_ms / (step + 1))
        _race_left = float(os.environ["RACE_BUDGET_S"]) * 1000 - approx_training_time_ms
        _race_steps = min(_race_max_steps, step + 1 + max(0, int(_race_left / _race_per_step)))
        if _race_n == 0:
            print0(f"race: time budget {os.environ['RACE_BUDGET_S']} s -> num_iterations {_race_steps}", console=True)
        train_steps = args.num_iterations = _race_steps
'''

_MD_PARAMS = '''
_race_emb = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
print0(f"race-params total={sum(p.numel() for p in model.parameters())} embedding={_race_emb}", console=True)
_race_clock, _race_max_steps = [], args.num_iterations  # race: budget (below)
'''

_NC_TIME_LINE = "        total_training_time += dt # only count the time after the first 10 steps\n"
_STEP_LINE = ('    print0(f"step:{step+1}/{train_steps} train_time:{approx_training_time_ms:.0f}ms '
              'step_avg:{approx_training_time_ms/(step + 1):.2f}ms", console=True)\n')
_MODEL_LINE = ("model: nn.Module = GPT(vocab_size=50257, num_layers=12, num_heads=6, model_dim=768, "
               "max_seq_len=max(args.train_seq_len, args.val_seq_len)).cuda()\n")

PATCHES = {
    "nanochat": [
        (_NC_TIME_LINE, _NC_TIME_LINE + _NC_BUDGET.lstrip("\n")),
    ],
    "modded": [
        ("    val_tokens = 10485760 #",
         '    val_tokens = int(os.environ.get("RACE_VAL_TOKENS", 10485760)) #'),
        ("    val_seq_len = 4*64*1024 #",
         '    val_seq_len = int(os.environ.get("RACE_VAL_SEQ_LEN", 4*64*1024)) #'),
        ("    num_iterations = 1695 #",
         '    num_iterations = int(os.environ.get("RACE_ITERATIONS", 1695)) #'),
        ("    val_loss_every = 125 #",
         '    val_loss_every = int(os.environ.get("RACE_VAL_EVERY", 125)) #'),
        ("    file_iter = iter(files) #",
         '    file_iter = __import__("itertools").cycle(files) #'),
        (_MODEL_LINE, _MODEL_LINE + _MD_PARAMS.lstrip("\n")),
        (_STEP_LINE, _STEP_LINE + _MD_BUDGET.lstrip("\n")),
    ],
}


def apply(kind: str, text: str) -> str:
    """``text`` with every edit of ``kind`` applied; ValueError naming the anchor that is missing or repeated."""
    for old, new in PATCHES[kind]:
        n = text.count(old)
        if n != 1:
            raise ValueError(f"{kind}: the anchor {old.strip()[:70]!r} occurs {n} times (expected once): "
                             "a different revision of the peer")
        text = text.replace(old, new)
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in PATCHES:
        print(f"usage: race_patch.py {{{'|'.join(PATCHES)}}} FILE", file=sys.stderr)
        return 2
    path = Path(argv[1])
    try:
        text = apply(argv[0], path.read_text())
    except (OSError, ValueError) as e:
        print(f"race_patch: {path}: {e}", file=sys.stderr)
        return 2
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    print(f"race_patch: {path}: {len(PATCHES[argv[0]])} edits applied")
    return 0


if __name__ == "__main__":
    sys.exit(main())
