"""Reward models, ``z2all reward``: our model with a scalar head, trained on preference pairs (Bradley-Terry).

The model reads the final hidden state h_last of the last real token of prompt + answer and maps it to a score
``r(x, y) = w . h_last`` (``score``: a bias-free linear layer hidden -> 1, as HF's
``LlamaForSequenceClassification`` with ``num_labels = 1``). The LM head is not used.

Bradley-Terry (1952), as in InstructGPT (Ouyang et al. 2022): the probability that y_w is preferred to y_l is
sigmoid(r(x, y_w) - r(x, y_l)); the loss is its negative log-likelihood over the preference pairs,

    loss = -mean log sigmoid(r(x, y_w) - r(x, y_l))

and the pairwise accuracy is the share of pairs with r(x, y_w) > r(x, y_l) (reported on held-out pairs at every
evaluation). The data are the DPO pairs (``zero2all/data/chat.py``): the same files train either.

Files: ``final/`` is the backbone in our format (``model.safetensors``, ``z2all.json``) plus ``score.safetensors``
(the head); :func:`load_reward_model` reads it back and :func:`export_reward_hf` writes an HF
``LlamaForSequenceClassification`` directory whose scores equal ours.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero2all.fileio import atomic_dir, claim_output_dir, save_json, save_safetensors, write_bytes
from zero2all.model.hidden import hidden_states, last_token_index
from zero2all.train.metrics import read_metrics
from zero2all.train.objectives import Objective
from zero2all.train.posttrain import PostTrainer

SCORE_WEIGHTS = "score.safetensors"
IGNORE_INDEX = -100


class RewardModel(nn.Module):
    """``model`` (a Z2all) + ``score`` (hidden -> 1, no bias). ``forward(tokens, lengths)`` -> scores (B,) at each
    row's last real token (rows right-padded; ``lengths`` (B,) counts the real tokens)."""

    def __init__(self, model: nn.Module, score: nn.Linear | None = None):
        super().__init__()
        self.model = model
        self.cfg = model.cfg
        w = model.embed_tokens.weight
        if score is None:
            score = nn.Linear(model.cfg.hidden_dim, 1, bias=False, device=w.device, dtype=w.dtype)
            nn.init.normal_(score.weight, std=model.cfg.initializer_range)
        self.score = score
        if not model.cfg.tie_word_embeddings:  # unused: no gradient, so DDP must not wait for one
            model.lm_head.weight.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = hidden_states(self.model, tokens)                                  # (B, T, hidden)
        last = h[torch.arange(h.size(0), device=h.device), last_token_index(lengths)]
        return self.score(last).squeeze(-1).float()

    def num_params(self, non_embedding: bool = False) -> int:
        return self.model.num_params(non_embedding) + self.score.weight.numel()


def answer_tokens(ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a ``dpo_collate`` batch (input ids and their shifted labels, prompt labels -100) -> the whole
    sequences prompt + answer (B, T + 1), right-padded, and their lengths (B,). The input ids lack the last
    answer token (it is only a label); it is put back here."""
    B, T = ids.shape
    valid = labels != IGNORE_INDEX
    if not bool(valid.any(dim=1).all()):
        raise ValueError("reward model: a pair has an empty answer")
    pos = torch.arange(T, device=ids.device).expand(B, T)
    last = torch.where(valid, pos, -1).max(dim=1).values                       # last supervised label
    tokens = torch.cat([ids, ids[:, -1:]], dim=1).clone()
    rows = torch.arange(B, device=ids.device)
    tokens[rows, last + 1] = labels[rows, last]
    return tokens, last + 2


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """-mean log sigmoid(r_w - r_l) and the metrics: accuracy, margin, mean scores."""
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()
    return loss, {"accuracy": (margin.detach() > 0).float().mean(), "margin": margin.detach().mean(),
                  "reward/chosen": chosen.detach().mean(), "reward/rejected": rejected.detach().mean()}


class RewardObjective(Objective):
    """Bradley-Terry on preference pairs (module docstring); chosen and rejected run as one forward of 2B rows."""

    name = "reward"
    loss_is_token_nll = False
    eval_printed = ("accuracy", "margin")

    def loss(self, model, batch):
        c_tok, c_len = answer_tokens(batch["chosen_ids"], batch["chosen_labels"])
        r_tok, r_len = answer_tokens(batch["rejected_ids"], batch["rejected_labels"])
        width = max(c_tok.size(1), r_tok.size(1))
        tokens = torch.cat([F.pad(c_tok, (0, width - c_tok.size(1))), F.pad(r_tok, (0, width - r_tok.size(1)))])
        scores = model(tokens, torch.cat([c_len, r_len]))
        half = c_tok.size(0)
        return bradley_terry_loss(scores[:half], scores[half:])

    def num_tokens(self, batch) -> int:
        return batch["chosen_ids"].numel() + batch["rejected_ids"].numel()


@torch.no_grad()
def score_texts(reward_model: RewardModel, sequences: list[list[int]], pad_id: int = 0) -> torch.Tensor:
    """Scores (N,) float32 of whole token sequences (prompt + answer), one right-padded batch."""
    device = reward_model.score.weight.device
    width = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long, device=device)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)] = torch.as_tensor(s, device=device)
    lengths = torch.tensor([len(s) for s in sequences], device=device)
    return reward_model(tokens, lengths)


# --------------------------------------------------------------------------------------------------------------
# files


def save_reward_model(rm: RewardModel, path: str | Path, tokenizer_dir: str | Path | None = None,
                      extra: dict | None = None) -> Path:
    """The backbone in our format plus ``score.safetensors`` (the whole directory replaced at once)."""
    from safetensors.torch import save

    from zero2all.model.io import save_model

    path = Path(path)
    with atomic_dir(path) as tmp:
        save_model(rm.model, tmp, extra={"reward_model": True, **(extra or {})}, tokenizer_dir=tokenizer_dir,
                   atomic=False)
        write_bytes(tmp / SCORE_WEIGHTS, save({"score.weight": rm.score.weight.detach().cpu().contiguous()},
                                              metadata={"format": "pt"}))
    return path


def load_reward_model(path: str | Path, device="cpu", dtype: torch.dtype | None = None) -> RewardModel:
    """A reward model directory (``z2all reward``'s ``final/``) -> :class:`RewardModel` in eval mode."""
    from safetensors.torch import load_file

    from zero2all.model.io import load_model

    head = Path(path) / SCORE_WEIGHTS
    if not head.exists():
        raise FileNotFoundError(f"{path}: no {SCORE_WEIGHTS} (not a reward model written by `z2all reward`)")
    backbone = load_model(path, device=device, dtype=dtype)
    w = load_file(str(head), device=str(device))["score.weight"]
    if w.shape != (1, backbone.cfg.hidden_dim):
        raise ValueError(f"{head}: score.weight of shape {tuple(w.shape)}, expected (1, {backbone.cfg.hidden_dim})")
    score = nn.Linear(backbone.cfg.hidden_dim, 1, bias=False, device=device, dtype=w.dtype if dtype is None else dtype)
    with torch.no_grad():
        score.weight.copy_(w)
    return RewardModel(backbone, score).eval()


def export_reward_hf(rm: RewardModel, out: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """An HF ``LlamaForSequenceClassification`` directory (num_labels 1, fp32) with our scores. HF picks the last
    token that is not ``pad_token_id``: pad with that id (and only there) when scoring batches."""
    from zero2all.model import hf as hfmap
    from zero2all.model.io import WEIGHTS, copy_tokenizer_files

    cfg = rm.cfg
    sd = {k: v.detach().cpu().float() for k, v in rm.model.state_dict().items() if k != "lm_head.weight"}
    sd = hfmap.state_dict_to_hf(sd, cfg)
    sd["score.weight"] = rm.score.weight.detach().cpu().float().contiguous()
    config = hfmap.model_config_to_hf(cfg, "float32")
    config.update({"architectures": ["LlamaForSequenceClassification"], "num_labels": 1,
                   "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "problem_type": "regression"})
    claim_output_dir(out, "export-reward-hf", inputs=[tokenizer_dir])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out, kind="export-reward-hf") as tmp:
        save_safetensors(sd, tmp / WEIGHTS, metadata={"format": "pt"})
        save_json(config, tmp / hfmap.HF_CONFIG)
        if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
            copy_tokenizer_files(tokenizer_dir, tmp, for_transformers=True)
    return out


def is_reward_dir(path: str | Path) -> bool:
    return (Path(path) / SCORE_WEIGHTS).exists()


# --------------------------------------------------------------------------------------------------------------
# the run


class RewardTrainer(PostTrainer):
    """The shared trainer on a :class:`RewardModel`; ``final/`` is the backbone plus ``score.safetensors``."""

    def final_model(self):
        return self.raw_model.model if self.is_main else None

    def finish(self) -> dict:
        summary = super().finish()
        if self.is_main:
            from safetensors.torch import save

            final = Path(summary["final"])
            write_bytes(final / SCORE_WEIGHTS, save({"score.weight": self.raw_model.score.weight.detach().cpu()
                                                     .float().contiguous()}, metadata={"format": "pt"}))
            accs = [r["accuracy"] for r in read_metrics(self.logger.path) if r.get("kind") == "eval"
                    and "accuracy" in r]
            if accs:
                summary["heldout_accuracy"] = accs[-1]
                self._print(f"held-out pairwise accuracy: {accs[-1]:.4f}")
            self._print(f"wrote the reward model to {final} (score head: {SCORE_WEIGHTS})")
        return summary


def reward(cfg, show_progress: bool = True, export_hf: str | Path | None = None) -> dict:
    """``z2all reward``: a reward model from ``post.init`` on the preference pairs of ``post.data`` (the DPO
    format), held-out pairwise accuracy at every evaluation; ``export_hf``: also an HF
    ``LlamaForSequenceClassification`` directory."""
    from zero2all import distributed as zd
    from zero2all.config import ConfigError
    from zero2all.train.posttrain import _prepare, build_dpo_data

    if cfg.post.lora_rank:
        raise ConfigError("post.lora_rank: reward models train all weights here (leave --lora-rank out)")
    if export_hf:  # checked before the training, not after it
        run_dir, hf_dir = Path(cfg.train.out_dir).resolve(), Path(export_hf).resolve()
        if hf_dir == run_dir or run_dir in hf_dir.parents or hf_dir in run_dir.parents:
            raise ConfigError(f"--export-hf {export_hf}: must lie outside the run's --out {cfg.train.out_dir} "
                              f"(and not contain it)")
        claim_output_dir(export_hf, "export-reward-hf", inputs=[cfg.post.init], option="--export-hf")
    env, out_dir, precision, tok, tok_dir, model = _prepare(cfg, "reward")
    train, valid = build_dpo_data(cfg, tok, env.rank, env.world_size)
    torch.manual_seed(cfg.train.seed)
    rm = RewardModel(model)
    trainer = RewardTrainer(cfg, RewardObjective(), init_dir=cfg.post.init, model=rm, train_data=train,
                            eval_data=valid, tokenizer=tok, tokenizer_dir=tok_dir, show_progress=show_progress,
                            env=env)
    summary = trainer.fit()
    if export_hf and env.is_main:
        summary["hf"] = str(export_reward_hf(rm, export_hf, tok_dir))
        print(f"wrote {export_hf} (LlamaForSequenceClassification, num_labels 1)")
    zd.destroy_distributed()
    return summary
