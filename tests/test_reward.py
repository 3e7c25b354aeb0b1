"""Reward models: sequence assembly, Bradley-Terry training to >= 0.9 held-out pairwise accuracy on arithmetic
preference pairs (correct vs wrong answer), saving / loading, and score parity with HF's
LlamaForSequenceClassification."""


import pytest
import torch
from rl_helpers import run_cfg, sft_model, sums
from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.data.chat import DPODataset, dpo_collate, render_dpo_record
from zero2all.model.z2all import build_model
from zero2all.train.metrics import read_metrics
from zero2all.train.reward import (
    RewardModel,
    RewardObjective,
    answer_tokens,
    bradley_terry_loss,
    export_reward_hf,
    load_reward_model,
    save_reward_model,
    score_texts,
)
from zero2all.train.rl_tasks import preference_pairs
from zero2all.train.trainer import Trainer


def sum_pairs(n: int, seed: int) -> list[dict]:
    """'a+b' prompts, the right sum preferred to a wrong one (bare numbers: short rows keep the test fast)."""
    problems = [dict(p, completion=str(p["answer"])) for p in sums(n, seed)]
    pairs = preference_pairs(problems, seed)
    for p in pairs:
        p["rejected"] = p["rejected"].split()[-1].rstrip(".")
    return pairs


def test_answer_tokens_puts_back_the_last_token():
    tok = ByteTokenizer()
    pairs = [render_dpo_record(tok, {"prompt": "1+2", "chosen": "3", "rejected": "45"}),
             render_dpo_record(tok, {"prompt": "10+20", "chosen": "30", "rejected": "4"})]
    batch = dpo_collate(pairs, tok.pad_id)
    for side in ("chosen", "rejected"):
        tokens, lengths = answer_tokens(batch[f"{side}_ids"], batch[f"{side}_labels"])
        for row, pair in enumerate(pairs):
            sample = getattr(pair, side)
            last = max(i for i, lab in enumerate(sample.labels) if lab != -100)  # labels are aligned with ids
            want = sample.input_ids[:last + 1]
            assert lengths[row] == len(want)
            assert tokens[row, :len(want)].tolist() == want


def test_bradley_terry_loss_and_accuracy():
    chosen, rejected = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 1.0])
    loss, m = bradley_terry_loss(chosen, rejected)
    want = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
    assert torch.allclose(loss, want)
    assert float(m["accuracy"]) == pytest.approx(1 / 3)


@pytest.mark.slow
def test_reward_model_learns_correct_arithmetic(tmp_path):
    """Held-out pairwise accuracy >= 0.9 after 150 CPU steps, the reward model starting from the short-SFT model
    (InstructGPT's recipe; from a random model the Bradley-Terry loss sits at log 2 for hundreds of steps)."""
    tok = ByteTokenizer()
    pairs = [render_dpo_record(tok, r) for r in sum_pairs(1200, seed=0)]
    train, valid = pairs[:1072], pairs[1072:]
    base = sft_model()
    torch.manual_seed(0)  # the score head's initialisation
    rm = RewardModel(base)
    cfg = run_cfg(tmp_path / "rm", 150, 32, 2e-3, eval_every=150, eval_batches=4)
    cfg.train.warmup_steps, cfg.train.min_lr = 10, 2e-4
    Trainer(cfg, RewardObjective(), model=rm,
            train_data=DPODataset(train, 32, tok.pad_id), eval_data=DPODataset(valid, 32, tok.pad_id),
            show_progress=False).fit()
    evals = [r for r in read_metrics(tmp_path / "rm" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert evals[0]["step"] == 0 and evals[0]["accuracy"] < 0.75  # the untrained head is near chance
    assert evals[-1]["step"] == 150 and evals[-1]["batches"] == 4  # all 128 held-out pairs
    assert evals[-1]["accuracy"] >= 0.9, evals[-1]
    # saved and loaded, the scores are the same
    rm.eval()
    seqs = [pairs[i].chosen.input_ids for i in range(510, 520)]
    d = save_reward_model(rm, tmp_path / "final")
    back = load_reward_model(d)
    assert torch.equal(score_texts(rm, seqs, tok.pad_id), score_texts(back, seqs, tok.pad_id))


def test_hf_sequence_classification_parity(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = ByteTokenizer()
    mcfg = tiny_model_config(pad_token_id=tok.pad_id, tie_word_embeddings=False, max_seq_len=64)
    torch.manual_seed(0)
    rm = RewardModel(build_model(mcfg, seed=3)).eval()
    with torch.no_grad():
        rm.score.weight.normal_()
    out = export_reward_hf(rm, tmp_path / "hf")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    g = torch.Generator().manual_seed(1)
    lengths = [5, 17, 33, 1, 40]
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    ours = score_texts(rm, seqs, tok.pad_id)
    width = max(lengths)
    ids = torch.full((len(seqs), width), tok.pad_id)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=(ids != tok.pad_id).long()).logits.squeeze(-1)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
