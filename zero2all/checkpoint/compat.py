"""Whether a checkpoint fits the run that resumes from it: the architecture, everything that decides which tokens
the next batch holds, and the tokenizer must agree; other training settings may change (they are printed)."""

from __future__ import annotations

from pathlib import Path

from zero2all.config import Config, ConfigError, to_dict

# Fields that must agree between a checkpoint and the run resuming from it: the architecture (weights would not
# fit, or mean something else) and everything that decides which tokens the next batch holds.
MUST_MATCH_TRAIN = ("micro_batch_size", "grad_accum_steps", "seed")
MUST_MATCH_DATA = ("seq_len",)


class CheckpointMismatch(ConfigError):
    """A checkpoint does not fit the run that tries to load it; the message names every mismatched field."""


def check_compatible(ckpt: str | Path, saved: dict, current: Config, seq_len: int, world_size: int,
                     saved_world_size: int, saved_tokenizer_hash: str | None,
                     tokenizer_hash: str | None) -> list[str]:
    """Raise :class:`CheckpointMismatch` naming every field that must match and does not.

    Returns the list of other train-section fields that changed (allowed, e.g. a longer ``max_steps`` or a new
    learning rate), for the trainer to print.
    """
    problems = []
    cur = to_dict(current)
    for key, old in saved.get("model", {}).items():
        if key == "ops":  # kernel choices change speed, not the function
            continue
        new = cur["model"].get(key)
        if old != new:
            problems.append(f"model.{key}: {old!r} in the checkpoint, {new!r} now")
    resized = saved_world_size != world_size
    for key in MUST_MATCH_TRAIN:
        if resized and key in ("micro_batch_size", "grad_accum_steps"):
            continue  # another number of processes: the global batch must match instead (below)
        old, new = saved.get("train", {}).get(key), cur["train"][key]
        if old != new:
            problems.append(f"train.{key}: {old!r} in the checkpoint, {new!r} now")
    saved_seq = saved.get("data", {}).get("seq_len") or saved.get("model", {}).get("max_seq_len")
    if saved_seq != seq_len:
        problems.append(f"data.seq_len: {saved_seq!r} in the checkpoint, {seq_len!r} now")
    if resized:
        old_t, new_t = saved.get("train", {}), cur["train"]
        old_batch = old_t.get("micro_batch_size", 0) * old_t.get("grad_accum_steps", 0) * saved_world_size
        new_batch = new_t["micro_batch_size"] * new_t["grad_accum_steps"] * world_size
        if old_batch != new_batch:
            problems.append(f"global batch: {old_batch} sequences per update in the checkpoint ({saved_world_size} "
                            f"processes), {new_batch} now ({world_size}); keep micro_batch_size x grad_accum_steps "
                            f"x processes the same")
    if saved_tokenizer_hash != tokenizer_hash:
        problems.append(f"tokenizer: hash {saved_tokenizer_hash!r} in the checkpoint, {tokenizer_hash!r} for this "
                        f"run's data ({current.data.path or 'synthetic'})")
    if problems:
        raise CheckpointMismatch(f"checkpoint {ckpt} does not match this run:\n  " + "\n  ".join(problems))
    changed = []
    for section in ("train", "parallel"):
        for key, new in cur[section].items():
            old = saved.get(section, {}).get(key)
            if key not in ("resume", "out_dir") and old != new:
                changed.append(f"{section}.{key}: {old!r} -> {new!r}")
    return changed
