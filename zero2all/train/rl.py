"""Online RL, ``z2all rl --algo grpo|ppo``: an objective on the shared trainer that makes its own batches.

One micro-batch of the trainer is a batch of B prompts (``PromptDataset``). The objective turns it into a loss:

1. **rollout** (no gradient): the policy samples G responses per prompt with the batched KV-cache generator
   (``zero2all/infer/generate.py``; fused decode kernels where they apply). The generator runs on the very module
   being trained (its parameters are updated in place by the optimiser, so no weights are copied per step);
2. **reward**: a Python function ``fn(completion_text, record) -> float`` (``rl.reward_fn = module:function``,
   e.g. exact match of a final answer) or a reward model (``rl.reward_model``, ``zero2all/train/reward.py``);
3. **old and reference log-probs** (no gradient): the policy's own per-token log-probs at rollout time, and
   the reference's: the base model with the LoRA adapters switched off when training LoRA (no second copy), else
   a frozen copy of the initial model (none when ``rl.kl_coef = 0``);
4. **advantages**: GRPO normalises the rewards within each prompt's group; PPO runs GAE over per-token rewards
   (``-kl_coef * k1`` per token plus the score on the last one) with the value head's estimates;
5. **loss** (with gradient): the clipped surrogate, + ``kl_coef * k3`` (GRPO) or + ``vf_coef *`` the clipped value
   loss (PPO). Formulas: ``zero2all/train/rl_losses.py``.

``rl.epochs`` > 1 reuses each rollout for that many optimiser updates (the data iterator yields each prompt batch
that many times; the rollout is cached by the batch's serial number), which is when PPO's ratio clipping acts.
Logged per update (``metrics.jsonl``, as ``train_<name>``): reward, reward_std, kl (k1 and k3), entropy,
clip_fraction, response_length, and value_loss for PPO. Evaluation (``train.eval_every``) is the mean reward of
greedy answers to the held-out prompts.

Resuming restores the prompt order exactly; a rollout cut off by the checkpoint is sampled again (the sampling
seed is a function of the run's seed, the batch's serial number and the rank, so it comes out the same).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from zero2all.model.hidden import hidden_states
from zero2all.train.objectives import Objective
from zero2all.train.rl_losses import (
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    group_advantages,
    kl_estimate,
    masked_mean,
    token_logprobs_and_entropy,
    whiten,
)

RewardFn = Callable[[str, dict], float]


def _reward_number(value, text: str, spec) -> float:
    """A reward function's answer as a float: an int, a float, or a numpy / torch scalar. A string (even "0.5"),
    None or anything else is the function's bug: a ConfigError (one line, exit code 2) naming it."""
    from zero2all.config import ConfigError

    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0 and not isinstance(value, (str, bytes)):
        value = item()  # numpy / torch 0-d values
    if isinstance(value, (int, float)):  # bool is an int: a pass / fail reward
        return float(value)
    raise ConfigError(f"rl.reward_fn {spec or ''}: returned {value!r:.60} ({type(value).__name__}) for the response "
                      f"{text!r:.60}; it must return a number (int or float): fix the function")


def load_reward_function(spec: str) -> RewardFn:
    """``package.module:function`` -> the function (ValueError naming what is missing)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"rl.reward_fn: expected module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rl.reward_fn: cannot import {module_name} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"rl.reward_fn: {module_name} has no function {attr}")
    return fn


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Inside: every LoRA layer computes its base linear only (scaling 0), so the model is the frozen base,
    exactly (x W^T + 0). The reference of a LoRA run, without a second copy of the weights."""
    from zero2all.model.lora import lora_modules

    mods = list(lora_modules(model).values())
    saved = [m.scaling for m in mods]
    try:
        for m in mods:
            m.scaling = 0.0
        yield model
    finally:
        for m, s in zip(mods, saved):
            m.scaling = s


class PolicyWithValue(nn.Module):
    """PPO's trainable module: the policy ``model`` and a value head (hidden -> 1) on the same hidden states.
    ``forward(tokens)`` -> (logits (B, T, V), values (B, T) float32)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.cfg = model.cfg
        w = model.embed_tokens.weight
        self.value_head = nn.Linear(model.cfg.hidden_dim, 1, device=w.device, dtype=w.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, tokens: torch.Tensor):
        h = hidden_states(self.model, tokens)
        return self.model.lm_head(h), self.value_head(h).squeeze(-1).float()

    def num_params(self, non_embedding: bool = False) -> int:
        return self.model.num_params(non_embedding) + sum(p.numel() for p in self.value_head.parameters())


# --------------------------------------------------------------------------------------------------------------
# prompts


class PromptDataset:
    """Prompt records ``{"prompt": str, ...}`` (any other fields, e.g. ``answer``, go to the reward function),
    rendered as a user turn with the chat template and the assistant header. ``batch`` gives ``prompt_ids``
    (B, P) right-padded, ``prompt_lens`` (B,) and ``index`` (B,) into ``records``."""

    def __init__(self, records: list[dict], tokenizer, max_prompt_len: int, rank: int = 0, world_size: int = 1,
                 repeats: int = 1, where: str = "prompts"):
        from zero2all.data.chat import _shard

        rendered = []
        for i, rec in enumerate(records):
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not rec["prompt"]:
                raise ValueError(f"{where}: record {i + 1} has no non-empty string field 'prompt'")
            ids = list(tokenizer.apply_chat_template([{"role": "user", "content": rec["prompt"]}],
                                                     add_generation_prompt=True))
            if len(ids) > max_prompt_len:
                raise ValueError(f"{where}: record {i + 1}'s prompt is {len(ids)} tokens, over the {max_prompt_len} "
                                 f"that leave room for the response")
            rendered.append((ids, rec))
        self.items = _shard(rendered, rank, world_size)
        self.rank, self.world_size, self.repeats = rank, world_size, repeats
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        self.tokenizer_hash = getattr(tokenizer, "hash", None)

    def __len__(self) -> int:
        return len(self.items)

    def record(self, i: int) -> dict:
        return self.items[i][1]

    def batch(self, indices) -> dict[str, torch.Tensor]:
        ids = [self.items[i][0] for i in indices]
        width = max(len(x) for x in ids)
        out = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        for r, x in enumerate(ids):
            out[r, :len(x)] = torch.tensor(x)
        return {"prompt_ids": out, "prompt_lens": torch.tensor([len(x) for x in ids]),
                "index": torch.tensor(list(indices))}

    def iterator(self, batch_size: int, seed: int = 0, shuffle: bool = True):
        from zero2all.data.chat import ItemIterator

        inner = ItemIterator(self, batch_size, seed, shuffle)
        return inner if self.repeats == 1 else RepeatedBatches(inner, self.repeats)


class RepeatedBatches:
    """Each batch of ``inner`` ``times`` in a row, tagged ``rollout_key`` (its serial number): the objective
    samples a rollout once per key and reuses it (``rl.epochs`` updates per rollout). Resumable: the state is the
    inner iterator's state before the current batch plus how often that batch was given."""

    def __init__(self, inner, times: int):
        self.inner, self.times = inner, times
        self.current, self.given, self.serial = None, times, -1
        self.before = inner.state_dict()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.current is None or self.given == self.times:
            self.before = self.inner.state_dict()
            self.current, self.given, self.serial = next(self.inner), 0, self.serial + 1
        self.given += 1
        return dict(self.current, rollout_key=torch.tensor(self.serial))

    def state_dict(self) -> dict:
        return {"kind": "repeated", "inner": self.before, "given": self.given if self.current is not None else 0,
                "serial": self.serial if self.current is not None else self.serial + 1, "times": self.times,
                "world_size": self.inner.world_size}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "repeated" or sd.get("times") != self.times:
            raise ValueError(f"the checkpoint's prompt iterator repeats batches {sd.get('times')} times, this run "
                             f"{self.times} (rl.epochs)")
        self.inner.load_state_dict(sd["inner"])
        self.current, self.serial = None, sd["serial"] - 1
        if sd["given"]:
            self.current, self.serial = next(self.inner), sd["serial"]
            self.given = sd["given"]

    def rescaled_state(self, states: list[dict]) -> dict:
        if len(states) != self.inner.world_size:
            raise ValueError(f"an rl run resumes on the number of processes that wrote it ({len(states)})")
        return states[self.inner.rank]


# --------------------------------------------------------------------------------------------------------------
# rollouts


@dataclass
class Rollout:
    """Sampled responses with everything the loss needs; per-token tensors are (N, L - 1), aligned with the
    targets ``tokens[:, 1:]``; ``mask`` = 1 on response tokens."""

    tokens: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor | None
    old_values: torch.Tensor | None
    scores: torch.Tensor
    lengths: torch.Tensor


class RLObjective(Objective):
    """GRPO or PPO (``rl.algo``) on prompt batches; see the module docstring.

    ``policy``: the trainable module as built (a Z2all for GRPO, a :class:`PolicyWithValue` for PPO), the same
    object the trainer wraps. ``reference``: a frozen model for the KL term, or None (LoRA: adapters disabled;
    ``kl_coef = 0``: no KL). ``reward_fn`` or ``reward_model`` scores the responses. ``datasets``: the prompt
    datasets whose ``index`` the batches carry, train first (eval batches are looked up in the second).
    """

    loss_is_token_nll = False
    eval_printed = ("reward", "response_length")

    def __init__(self, policy: nn.Module, tokenizer, rl, *, reward_fn: RewardFn | None = None,
                 reward_model: nn.Module | None = None, reference: nn.Module | None = None,
                 datasets: tuple = (), seed: int = 0, rank: int = 0, cache_size: int = 1):
        from zero2all.infer.generate import Generator

        if (reward_fn is None) == (reward_model is None):
            raise ValueError("rl: give one reward source (rl.reward_fn or rl.reward_model)")
        self.name = rl.algo
        self.rl, self.tok, self.policy = rl, tokenizer, policy
        self.ppo = rl.algo == "ppo"
        if self.ppo != isinstance(policy, PolicyWithValue):
            raise ValueError("rl: ppo trains a PolicyWithValue, grpo a plain model")
        self.actor = policy.model if self.ppo else policy
        self.reward_fn, self.reward_model, self.reference = reward_fn, reward_model, reference
        from zero2all.model.lora import lora_modules

        self.lora = bool(lora_modules(self.actor))
        if reference is not None:
            reference.eval().requires_grad_(False)
        self.datasets, self.seed, self.rank = datasets, seed, rank
        fused = {"auto": None, "on": True, "off": False}[rl.fused_decode]
        self.generator = Generator(self.actor, tokenizer, fused=fused)
        self.actor.train()
        self.stop_ids = self.generator.default_stop_ids()
        self.vocab = None  # log-probs over every row of the LM head: the distribution the generator samples from
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        self.cache: OrderedDict[int, Rollout] = OrderedDict()
        self.cache_size = cache_size
        self.last_tokens = 0

    # -- sampling ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompts: list[list[int]], n: int, seed: int, greedy: bool = False):
        """n responses per prompt -> (responses: token lists, each ending with its stop token when one was drawn;
        texts without the stop token)."""
        from zero2all.infer.generate import SamplingParams

        rep = [p for p in prompts for _ in range(n)]
        stops: dict[int, int] = {}
        params = SamplingParams(max_new_tokens=self.rl.max_new_tokens, temperature=0.0 if greedy else
                                self.rl.temperature, top_k=self.rl.top_k, stop_token_ids=self.stop_ids, seed=seed)
        was_training = self.actor.training
        self.actor.eval()
        device_type = self.actor.embed_tokens.weight.device.type
        try:  # the generator's own precision (its graphs must not capture autocast's cached weight copies)
            with torch.autocast(device_type, enabled=False):
                comps = self.generator.generate(
                    rep, params, on_event=lambda ev: stops.__setitem__(ev.index, ev.token_id) if ev.stop_token
                    else None)
        finally:
            self.actor.train(was_training)
        responses = [c.token_ids + ([stops[i]] if i in stops else []) for i, c in enumerate(comps)]
        texts = [self.tok.decode(c.token_ids) for c in comps]
        return responses, texts

    def scores(self, prompts: list[list[int]], responses: list[list[int]], texts: list[str], records: list[dict],
               device) -> torch.Tensor:
        if self.reward_fn is not None:
            values = []
            for text, rec in zip(texts, records):
                v = self.reward_fn(text, rec)
                values.append(_reward_number(v, text, self.rl.reward_fn))
            return torch.tensor(values, device=device, dtype=torch.float32)
        from zero2all.train.reward import score_texts

        return score_texts(self.reward_model, [p + r for p, r in zip(prompts, responses)], self.pad_id).float()

    def _prompts_and_records(self, batch: dict, which: int):
        lens = batch["prompt_lens"].tolist()
        prompts = [row[:n] for row, n in zip(batch["prompt_ids"].tolist(), lens)]
        ds = self.datasets[which] if len(self.datasets) > which else None
        records = [ds.record(i) if ds is not None else {} for i in batch["index"].tolist()]
        return prompts, records

    def _forward(self, model, tokens: torch.Tensor):
        """(logits, values or None) of the trainable module (wrapped or not)."""
        out = model(tokens)
        return (out[0], out[1]) if self.ppo else (out[0], None)

    @torch.no_grad()
    def rollout(self, batch: dict) -> tuple[Rollout, dict]:
        rl = self.rl
        device = batch["prompt_ids"].device
        prompts, records = self._prompts_and_records(batch, 0)
        key = int(batch.get("rollout_key", torch.tensor(0)))
        seed = (self.seed * 1_000_003 + key * 7919 + self.rank) % (2 ** 62)
        responses, texts = self.sample(prompts, rl.group_size, seed)
        G = rl.group_size
        rep_prompts = [p for p in prompts for _ in range(G)]
        rep_records = [r for r in records for _ in range(G)]
        scores = self.scores(rep_prompts, responses, texts, rep_records, device)

        seqs = [p + r for p, r in zip(rep_prompts, responses)]
        N, L = len(seqs), max(len(s) for s in seqs)
        tokens = torch.full((N, L), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros(N, L - 1, device=device)
        for i, (p, s) in enumerate(zip(rep_prompts, seqs)):
            tokens[i, :len(s)] = torch.tensor(s, device=device)
            mask[i, len(p) - 1:len(s) - 1] = 1.0
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits, values = self._forward(self.policy, inputs)
        old_logp, _ = token_logprobs_and_entropy(logits, targets, self.vocab)
        del logits
        ref_logp = None
        if rl.kl_coef > 0:
            if self.reference is not None:
                ref_logits = self.reference(inputs)[0]
            elif self.lora:
                with adapters_disabled(self.actor):
                    ref_logits = self.actor(inputs)[0]
            else:
                raise ValueError("rl.kl_coef > 0 needs a reference model (or LoRA adapters to switch off)")
            ref_logp, _ = token_logprobs_and_entropy(ref_logits, targets, self.vocab)
            del ref_logits
        returns = old_values = None
        if self.ppo:
            rewards = torch.zeros_like(old_logp)
            if ref_logp is not None:
                rewards = -rl.kl_coef * kl_estimate(old_logp, ref_logp, "k1") * mask
            last = (mask * torch.arange(L - 1, device=device)).argmax(dim=1)
            rewards[torch.arange(N, device=device), last] += scores
            old_values = values * mask
            adv, returns = gae(rewards, old_values, mask, rl.gamma, rl.lam)
            advantages = whiten(adv, mask)
        else:
            advantages = group_advantages(scores, G, rl.scale_rewards)[:, None] * mask
        lengths = mask.sum(dim=1)
        ro = Rollout(tokens, mask, old_logp, ref_logp, advantages, returns, old_values, scores, lengths)
        grouped = scores.view(-1, G)
        info = {"reward": scores.mean(), "reward_std": grouped.std(dim=1).mean() if G > 1 else torch.zeros(()),
                "response_length": lengths.mean()}
        return ro, info

    # -- the objective ----------------------------------------------------------------------------------------
    def loss(self, model, batch):
        key = int(batch.get("rollout_key", torch.tensor(-1)))
        cached = self.cache.get(key) if key >= 0 else None
        if cached is None:
            ro, info = self.rollout(batch)
            if key >= 0:
                self.cache[key] = (ro, info)
                while len(self.cache) > self.cache_size:
                    self.cache.popitem(last=False)
        else:
            ro, info = cached
        rl = self.rl
        inputs, targets = ro.tokens[:, :-1], ro.tokens[:, 1:]
        logits, values = self._forward(model, inputs)
        logp, entropy = token_logprobs_and_entropy(logits, targets, self.vocab)
        loss, clip_frac = clipped_policy_loss(logp, ro.old_logp, ro.advantages, ro.mask, rl.clip_eps)
        metrics = dict(info)
        metrics.update({"entropy": masked_mean(entropy.detach(), ro.mask), "clip_fraction": clip_frac})
        if ro.ref_logp is not None:
            k3 = kl_estimate(logp, ro.ref_logp, "k3")
            metrics["kl_k1"] = masked_mean(kl_estimate(logp.detach(), ro.ref_logp, "k1"), ro.mask)
            metrics["kl_k3"] = masked_mean(k3.detach(), ro.mask)
            if not self.ppo:  # GRPO: the KL is a loss term; PPO has it in the rewards
                kl = k3 if rl.kl_estimator == "k3" else kl_estimate(logp, ro.ref_logp, "k1")
                loss = loss + rl.kl_coef * masked_mean(kl, ro.mask)
        if self.ppo:
            vloss = clipped_value_loss(values, ro.old_values, ro.returns, ro.mask, rl.value_clip)
            loss = loss + rl.vf_coef * vloss
            metrics["value_loss"] = vloss.detach()
        self.last_tokens = ro.tokens.numel()
        return loss, metrics

    @torch.no_grad()
    def eval_loss(self, model, batch):
        """Greedy answers to held-out prompts: the loss is minus their mean reward."""
        prompts, records = self._prompts_and_records(batch, 1)
        responses, texts = self.sample(prompts, 1, seed=0, greedy=True)
        scores = self.scores(prompts, responses, texts, records, batch["prompt_ids"].device)
        lengths = torch.tensor([float(len(r)) for r in responses])
        return -scores.mean(), {"reward": scores.mean(), "response_length": lengths.mean()}

    def num_tokens(self, batch) -> int:
        return self.last_tokens


def frozen_reference(model: nn.Module) -> nn.Module:
    """A frozen copy of the initial policy (full fine-tuning with a KL term)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


@torch.no_grad()
def mean_reward(objective: RLObjective, dataset: PromptDataset, batch_size: int = 16, greedy: bool = True,
                seed: int = 0) -> float:
    """Mean reward of the policy's answers (greedy by default) to every prompt of ``dataset``."""
    total, n = 0.0, 0
    device = objective.actor.embed_tokens.weight.device
    for start in range(0, len(dataset), batch_size):
        idx = list(range(start, min(len(dataset), start + batch_size)))
        b = dataset.batch(idx)
        prompts = [row[:k] for row, k in zip(b["prompt_ids"].tolist(), b["prompt_lens"].tolist())]
        records = [dataset.record(i) for i in idx]
        responses, texts = objective.sample(prompts, 1, seed=seed, greedy=greedy)
        total += float(objective.scores(prompts, responses, texts, records, device).sum())
        n += len(idx)
    return total / max(n, 1)
