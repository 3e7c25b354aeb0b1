"""``z2all demo`` (what ``make demo`` runs): the whole pipeline, offline, on the Python standard library's source.

    1. corpus     the running Python's stdlib ``.py`` files (embedded, always present)
    2. tokenizer  an 8k byte-level BPE trained on it               -> OUT/tokenizer/
    3. shards     the corpus tokenized into uint16 shards           -> OUT/data/
    4. pretrain   the ``tiny`` preset (~7M parameters) for a wall-clock budget (4 minutes) on the CPU (a GPU when
                  there is one): ``train.time_budget_s``, the length fixed from the rate of the first updates
                                                                    -> OUT/ckpt-*/, OUT/final/, metrics, report
    5. samples    Python code generated from a few prompts
    6. sft        a short supervised fine-tuning of that model on "write the docstring of X" instructions built
                  from the same stdlib (``zero2all/data/instructions.py``)   -> OUT/sft/ (final/, metrics, report)
    7. chat       the fine-tuned model answers instructions it did not train on

Each step is also a command of its own (docs/index.md, "The demo"). Re-running the demo reuses finished steps
(the tokenizer, the shards) and continues an interrupted training run from its last checkpoint; ``--overwrite``
starts over instead (earlier checkpoints are moved aside, not deleted).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from zero2all.fileio import claim_output_dir, read_output_marker, write_output_marker

# upper bounds on the number of updates of a time-budgeted stage (a GPU reaches them well inside the budget)
MAX_PRETRAIN_STEPS = 3000
MAX_SFT_STEPS = 300

DEMO_PROMPTS = ["def ", "class ", "import ", "    def __init__(self", "for i in range("]

# the tiny preset, with a batch suited to a few CPU minutes: more, smaller updates learn faster early on
DEMO_TRAIN = ["train.micro_batch_size=8", "train.warmup_steps=20", "train.eval_every=50", "train.eval_batches=8",
              "train.ckpt_every=50", "train.keep_last=2", "train.num_samples=3", "train.sample_new_tokens=48",
              "train.log_every=10"]


# the SFT stage: the same batch shape as pretraining, a smaller peak learning rate, no weight decay
DEMO_SFT_RECORDS = 2000          # instructions built from the stdlib; the last 50 are held out (48 valid, 2 chat)
DEMO_SFT_TRAIN = ["train.micro_batch_size=8", "train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=5",
                  "train.weight_decay=0.0", "train.eval_batches=2", "train.keep_last=1", "train.log_every=5",
                  "train.num_samples=0"]


def _say(msg: str) -> None:
    print(f"\n=== {msg}", flush=True)


def _is_legacy_demo_dir(path: Path) -> bool:
    """A demo folder written before outputs carried a marker: its tokenizer, or a run's config and metrics."""
    return (path / "tokenizer" / "tokenizer.json").is_file() or (
        (path / "config.json").is_file() and (path / "metrics.jsonl").is_file())


def run_sft_stage(out: Path, pretrained: Path, minutes: float, steps: int | None = None,
                  overwrite: bool = False) -> dict:
    """Steps 6 and 7: SFT of ``pretrained`` on stdlib docstring instructions for ``steps`` updates, or for
    ``minutes`` of wall-clock time (``train.time_budget_s``: the length is fixed from the measured rate, at most
    :data:`MAX_SFT_STEPS`), then replies to two held-out instructions."""
    from zero2all import checkpoint as ckpt_io
    from zero2all.data.instructions import build_docstring_instructions, write_jsonl
    from zero2all.infer.generate import Generator, SamplingParams, load_for_inference
    from zero2all.train.posttrain import posttrain_config, sft

    data_dir, sft_dir = out / "sft-data", out / "sft"
    files = {name: data_dir / f"{name}.jsonl" for name in ("train", "valid", "chat")}
    if not all(f.exists() for f in files.values()):
        records, stats = build_docstring_instructions(max_records=DEMO_SFT_RECORDS, max_chars=400)
        for name, part in (("train", records[:-50]), ("valid", records[-50:-2]), ("chat", records[-2:])):
            write_jsonl(part, files[name])
        print(f"{stats.records:,} instructions from {stats.files:,} stdlib files -> {data_dir}")
    if overwrite:
        _set_aside_checkpoints(sft_dir)
    previous = ckpt_io.newest_verified(sft_dir)[0]
    if steps is None and previous is not None:  # continue an interrupted run with the length it was given
        steps = ckpt_io.read_run_config(previous)["train"]["max_steps"]
    if steps is not None:
        length = [f"train.max_steps={steps}", f"train.eval_every={steps}", f"train.ckpt_every={max(1, steps // 2)}"]
        what = f"{steps} steps"
    else:
        length = [f"train.max_steps={MAX_SFT_STEPS}", f"train.time_budget_s={60 * minutes:g}",
                  f"train.eval_every={MAX_SFT_STEPS}", "train.ckpt_every=50"]
        what = f"{minutes:g} minutes"
    _say(f"6/7 SFT: {what} on stdlib docstring instructions  (z2all sft --init {pretrained} --data "
         f"{files['train']} --valid {files['valid']} --out {sft_dir} {' '.join(length[:2])} train.lr=1e-3 ...)")
    cfg = posttrain_config("sft", None, [f"post.init={json.dumps(str(pretrained))}",
                                         f"post.data=[{json.dumps(str(files['train']))}]",
                                         f"post.valid=[{json.dumps(str(files['valid']))}]",
                                         f"train.out_dir={json.dumps(str(sft_dir))}", "train.resume='auto'"]
                           + length + DEMO_SFT_TRAIN)
    summary = sft(cfg)

    _say("7/7 chat: the fine-tuned model answers instructions it was not trained on (temperature 0.7, top-k 50)")
    model, tok = load_for_inference(summary["final"])
    generator = Generator(model, tok)
    params = SamplingParams(max_new_tokens=80, temperature=0.7, top_k=50, seed=0)
    for line in files["chat"].read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        prompt = tok.apply_chat_template([{"role": "user", "content": record["instruction"]}],
                                         add_generation_prompt=True)
        reply = generator.generate([prompt], params)[0]
        print(f"--- user: {record['instruction']}\n--- assistant: {reply.text.strip()}\n"
              f"    ({reply.finish_reason}; the stdlib's docstring: {record['output'].splitlines()[0]!r})\n")
    return summary


def _set_aside_checkpoints(run_dir: Path) -> None:
    """``--overwrite``: the run in ``run_dir`` starts over; its checkpoints are moved aside (kept, not deleted)."""
    from zero2all import checkpoint as ckpt_io

    if run_dir.is_dir() and ckpt_io.list_checkpoints(run_dir):
        aside, moved = ckpt_io.move_aside_after(run_dir, -1)
        print(f"--overwrite: moved {len(moved)} earlier checkpoint(s) of {run_dir} aside to {aside}")


def run_demo(out: str | Path = "runs/demo", minutes: float | None = None, steps: int | None = None,
             vocab_size: int = 8192, threads: int = 2, overrides: list[str] | None = None,
             sft_minutes: float = 1.5, sft_steps: int | None = None, overwrite: bool = False) -> dict:
    """The demo (module docstring). ``minutes``: the pretraining wall-clock budget (default 4; ``steps`` fixes the
    length instead); ``overwrite``: start over (a new tokenizer and shards, earlier checkpoints moved aside)
    instead of reusing and continuing what ``out`` holds."""
    from zero2all import checkpoint as ckpt_io
    from zero2all.config import ConfigError, load_config
    from zero2all.corpus.readers import stdlib_files
    from zero2all.data.pretokenize import prepare
    from zero2all.tokenizer import load_tokenizer, train_tokenizer
    from zero2all.train.trainer import Trainer, pick_device, sample_continuation

    if minutes is not None and not minutes > 0:
        raise ConfigError(f"--minutes {minutes}: must be > 0")
    if sft_steps is None and not sft_minutes >= 0:
        raise ConfigError(f"--sft-minutes {sft_minutes}: must be > 0 (or 0 to skip the SFT stage)")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps}: must be >= 1")
    if sft_steps is not None and sft_steps < 0:
        raise ConfigError(f"--sft-steps {sft_steps}: must be >= 0 (0 skips the SFT stage)")
    with_sft = sft_steps > 0 if sft_steps is not None else sft_minutes > 0  # 0 steps or 0 minutes: no SFT stage
    out = Path(out)
    # the demo's folder holds a pretraining run plus its tokenizer/, data/ and sft/: a folder of other files (or a
    # run of another command) is refused before anything is written
    claim_output_dir(out, "demo", legacy=_is_legacy_demo_dir)
    out.mkdir(parents=True, exist_ok=True)
    if read_output_marker(out) is None:
        write_output_marker(out, "demo")
    t_start = time.time()
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        torch.set_num_threads(threads)

    files = stdlib_files()
    size = sum(f.stat().st_size for f in files)
    _say(f"1/7 corpus: the Python standard library, {len(files):,} .py files, {size / 1e6:.1f} MB "
         f"({Path(files[0]).parent if files else '?'})")

    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").exists() and not overwrite:
        _say(f"2/7 tokenizer: reusing {tok_dir}")
        tok = load_tokenizer(tok_dir)
    else:
        _say(f"2/7 tokenizer: training a {vocab_size}-token byte-level BPE  "
             f"(z2all train-tokenizer --input stdlib --vocab-size {vocab_size} --out {tok_dir})")
        tok = train_tokenizer("stdlib", vocab_size, out_dir=tok_dir)
    print(f"vocabulary {tok.vocab_size}, hash {tok.hash[:16]}")

    data_dir = out / "data"
    _say(f"3/7 shards: tokenizing the corpus  (z2all prepare --input stdlib --tokenizer {tok_dir} --out {data_dir})")
    meta = prepare("stdlib", tok_dir, data_dir, seq_len=256, overwrite=overwrite)
    train_tokens = meta["splits"]["train"]["tokens"]
    print(f"{train_tokens:,} training tokens, {meta['splits']['valid']['tokens']:,} validation tokens, "
          f"{meta.get('bytes_per_token', 0):.2f} bytes per token")

    base = [f"data.path={json.dumps(str(data_dir))}", f"train.out_dir={json.dumps(str(out))}",
            "train.resume='auto'", f"model.vocab_size={tok.vocab_size}",
            f"train.sample_prompts={json.dumps(DEMO_PROMPTS[:3])}"] + DEMO_TRAIN + list(overrides or [])
    if overwrite:
        _set_aside_checkpoints(out)
    previous = ckpt_io.newest_verified(out)[0]
    if steps is None and previous is not None:  # continue the interrupted run with the length it was given
        steps = ckpt_io.read_run_config(previous)["train"]["max_steps"]
    if steps is not None:
        length, what = [f"train.max_steps={steps}"], f"{steps} steps"
    else:  # a wall-clock budget: the length is fixed from the rate measured over the first updates
        budget_s = 60 * (minutes if minutes is not None else 4.0)
        length = [f"train.max_steps={MAX_PRETRAIN_STEPS}", f"train.time_budget_s={budget_s:g}"]
        what = f"{budget_s / 60:g} minutes"
    cfg = load_config("tiny", base + length)
    what += f" on {pick_device(cfg.train.device)}"
    _say(f"4/7 pretraining the tiny preset for {what}  (z2all pretrain --config tiny --data {data_dir} "
         f"--out {out} {' '.join(length)} ...)")
    trainer = Trainer(cfg, output_kind="demo")
    summary = trainer.fit()
    steps = trainer.step

    _say("5/7 samples: Python code generated by the trained model (temperature 0.8, top-k 50)")
    model = trainer.raw_model.eval()
    gen = torch.Generator().manual_seed(0)
    for prompt in DEMO_PROMPTS:
        new = sample_continuation(model, tok.encode(prompt), 80, 0.8, 50, gen, tok.eos_id, trainer.autocast)
        print(f"--- prompt {prompt!r}\n{prompt}{tok.decode(new)}\n")

    k = summary.get("mean_window", 1)
    print(f"train loss {summary['first_loss_mean']:.3f} (mean of the first {k} steps) -> "
          f"{summary['last_loss_mean']:.3f} (last {k} steps)")
    if "last_eval_loss" in summary:
        print(f"validation loss {summary['first_eval_loss']:.3f} (before training) -> "
              f"{summary['last_eval_loss']:.3f} (perplexity {summary['last_eval_ppl']:.1f}) at step {steps}")
    if with_sft:
        sft_summary = run_sft_stage(out, out / "final", sft_minutes, sft_steps, overwrite=overwrite)
        if "last_eval_loss" in sft_summary:
            print(f"SFT validation loss (assistant tokens of held-out instructions) "
                  f"{sft_summary['first_eval_loss']:.3f} -> {sft_summary['last_eval_loss']:.3f}")
    print(f"demo finished in {(time.time() - t_start) / 60:.1f} minutes. Outputs in {out}/: report.md, loss.png, "
          f"metrics.jsonl, tensorboard/, final/ (model + tokenizer), ckpt-*/ (resumable), tokenizer/, data/"
          + (", sft/ (the fine-tuned model: z2all chat --ckpt " + str(out / "sft" / "final") + "), sft-data/"
             if with_sft else ""))
    return summary
