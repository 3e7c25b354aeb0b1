"""``z2all rl``: the run around :class:`~zero2all.train.rl.RLObjective` (starting point, prompts, reward, reference).

Like ``z2all sft`` / ``dpo`` (``posttrain.py``): the model comes from ``post.init`` (with LoRA adapters when
``post.lora_rank`` > 0), the tokenizer from the checkpoint, checkpoints and exact resume from the shared trainer.
What is particular to RL:

- the data are prompt records ``{"prompt": str, ...}`` (``post.data``; held out: ``post.valid`` or
  ``post.valid_fraction``); their other fields reach the reward function;
- the reward: ``rl.reward_fn = module:function`` or ``rl.reward_model = DIR`` (a ``z2all reward`` output);
- the reference for the KL term (``rl.kl_coef`` > 0): with LoRA, the same model with its adapters switched off;
  otherwise ``post.ref`` or a frozen copy of the initial model;
- PPO trains a value head next to the policy (in the checkpoints; ``final/`` holds the policy alone).
"""

from __future__ import annotations

from pathlib import Path

from zero2all import distributed as zd
from zero2all.config import Config, ConfigError
from zero2all.train.posttrain import PostTrainer, _prepare, _split_holdout, base_weights_model, load_pretrained
from zero2all.train.rl import PolicyWithValue, PromptDataset, RLObjective, frozen_reference, load_reward_function


def read_prompt_records(paths: list[str], key: str = "post.data") -> list[dict]:
    """Every record of the jsonl files (ValueError naming file:line for a malformed one). A folder is refused:
    the reward sees each record's own fields (the expected answer, ...), which a ``prepare-sft`` output (tokens
    only) no longer holds."""
    from zero2all.data.chat import iter_jsonl

    for path in paths:
        if Path(path).is_dir():
            raise ConfigError(f"{key}: {path} is a directory; z2all rl reads prompt records ({{\"prompt\": ...}} per "
                              f"line) from .jsonl / .json files, not a `prepare-sft` output")
    records = []
    for path in paths:
        for where, rec in iter_jsonl(path):
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not rec["prompt"]:
                raise ConfigError(f"{where}: a prompt record needs a non-empty string field 'prompt'")
            records.append(rec)
    if not records:
        raise ConfigError(f"post.data: no prompt records in {', '.join(paths)}")
    return records


class RLTrainer(PostTrainer):
    """The shared trainer; ``final/`` (and the LoRA adapter) hold the policy without PPO's value head."""

    def __init__(self, cfg: Config, objective: RLObjective, **kwargs):
        self.actor = objective.actor
        super().__init__(cfg, objective, **kwargs)

    def final_model(self):
        if not self.is_main:
            return None
        return base_weights_model(self.actor) if self.uses_lora else self.actor

    def write_adapter(self, path: Path) -> Path:
        from zero2all.model.io import copy_tokenizer_files
        from zero2all.model.lora import save_adapter

        save_adapter(self.actor, path, base_model_name_or_path=str(self.init_dir.resolve()))
        if self.tokenizer_dir is not None:
            copy_tokenizer_files(self.tokenizer_dir, path)
        return path


def rl(cfg: Config, show_progress: bool = True) -> dict:
    """``z2all rl``: PPO or GRPO (``rl.algo``) from ``post.init`` on the prompts of ``post.data``."""
    from zero2all.train.reward import load_reward_model

    r = cfg.rl
    if not r.reward_fn and not r.reward_model:
        raise ConfigError("rl: no reward; pass --reward-fn module:function or --reward-model DIR")
    reward_fn = None
    if r.reward_fn:
        try:
            reward_fn = load_reward_function(r.reward_fn)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    records = read_prompt_records(cfg.post.data)  # before _prepare writes anything into the output folder
    valid_records = read_prompt_records(cfg.post.valid, "post.valid") if cfg.post.valid else None
    env, out_dir, precision, tok, tok_dir, model = _prepare(cfg, "rl")
    device = env.device
    if not cfg.post.valid:
        records, valid_records = _split_holdout(records, cfg.post.valid_fraction, cfg.train.seed)
    max_prompt = cfg.model.max_seq_len - r.max_new_tokens
    if max_prompt < 2:
        raise ConfigError(f"rl.max_new_tokens: {r.max_new_tokens} leaves no room for a prompt in the model's "
                          f"{cfg.model.max_seq_len} positions")
    try:
        train = PromptDataset(records, tok, max_prompt, env.rank, env.world_size, repeats=r.epochs,
                              where=", ".join(cfg.post.data))
        valid = PromptDataset(valid_records, tok, max_prompt, env.rank, env.world_size,
                              where=", ".join(cfg.post.valid) or "held-out prompts") if valid_records else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if valid is not None and len(valid) == 0:
        valid = None
    reference = None
    if r.kl_coef > 0 and cfg.post.lora_rank == 0:
        reference = load_pretrained(cfg.post.ref, cfg.model, device).eval() if cfg.post.ref else \
            frozen_reference(model)
    reward_model = load_reward_model(r.reward_model, device=device) if r.reward_model else None
    policy = PolicyWithValue(model) if r.algo == "ppo" else model
    objective = RLObjective(policy, tok, r, reward_fn=reward_fn, reward_model=reward_model, reference=reference,
                            datasets=(train, valid), seed=cfg.train.seed, rank=env.rank,
                            cache_size=cfg.train.grad_accum_steps)
    if env.is_main:
        ref = "adapters off" if cfg.post.lora_rank else "frozen copy" if reference is not None else "none"
        print(f"rl: {r.algo}, {len(train):,} prompts ({len(valid) if valid else 0} held out), {r.group_size} "
              f"responses each of up to {r.max_new_tokens} tokens, reward {r.reward_fn or r.reward_model}, KL "
              f"{r.kl_coef:g} (reference: {ref})")
    trainer = RLTrainer(cfg, objective, init_dir=cfg.post.init, model=policy, train_data=train, eval_data=valid,
                        tokenizer=tok, tokenizer_dir=tok_dir, show_progress=show_progress, env=env)
    summary = trainer.fit()
    zd.destroy_distributed()
    return summary
