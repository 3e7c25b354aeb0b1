"""Shared by the reward and RL tests: 'a+b' problems and a tiny model taught their answer format by a short SFT
(the starting point of reward models and RL, as in InstructGPT)."""

import functools
import random
import tempfile
from pathlib import Path

from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.config import Config, RLConfig, TrainConfig


def sums(n: int, seed: int, top: int = 4) -> list[dict]:
    """Problems {"prompt": "a+b", "answer": a + b} with a, b in [0, top]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, top), rng.randint(0, top)
        out.append({"prompt": f"{a}+{b}", "answer": a + b})
    return out


def run_cfg(out: Path, steps: int, mbs: int, lr: float, rl: RLConfig | None = None, eval_every: int = 0,
            eval_batches: int = 0) -> Config:
    """A CPU run of the tiny model: constant lr, no checkpoints or samples."""
    return Config(model=tiny_model_config(max_seq_len=32), rl=rl or RLConfig(), train=TrainConfig(
        out_dir=str(out), max_steps=steps, micro_batch_size=mbs, lr=lr, min_lr=lr, warmup_steps=0,
        eval_every=eval_every, eval_batches=eval_batches, ckpt_every=0, num_samples=0, device="cpu",
        tensorboard=False, log_every=0, weight_decay=0.0))


@functools.lru_cache(maxsize=1)
def sft_state() -> dict:
    """State dict of the tiny model after 60 SFT steps on 'a+b' -> digits: right some of the time."""
    from zero2all.data.chat import SFTDataset, render_sft_record
    from zero2all.model.z2all import build_model
    from zero2all.train.objectives import SFTObjective
    from zero2all.train.trainer import Trainer

    tok = ByteTokenizer()
    samples = [render_sft_record(tok, {"instruction": p["prompt"], "output": str(p["answer"])})
               for p in sums(400, 0)]
    model = build_model(tiny_model_config(max_seq_len=32), seed=0)
    with tempfile.TemporaryDirectory() as d:
        Trainer(run_cfg(Path(d) / "sft", 60, 32, 3e-3), SFTObjective(), model=model,
                train_data=SFTDataset(samples, 24, tok.pad_id, "pad"), show_progress=False).fit()
    return {k: v.clone() for k, v in model.state_dict().items()}


def sft_model():
    from zero2all.model.z2all import build_model

    model = build_model(tiny_model_config(max_seq_len=32))
    model.load_state_dict(sft_state())
    return model
