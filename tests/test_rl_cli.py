"""`z2all reward`, `z2all export-reward-hf` and `z2all rl` (GRPO with LoRA and the adapters-off reference, PPO on a
reward model) end to end on CPU, bad reward settings, and `z2all rl` under torchrun with 2 gloo processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero2all.cli import main
from zero2all.config import ModelConfig, OpsConfig
from zero2all.model.io import save_model
from zero2all.model.z2all import build_model
from zero2all.tokenizer import train_tokenizer
from zero2all.train.rl_tasks import make_problems, preference_pairs, sft_records

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--device", "cpu", "--no-progress", "train.micro_batch_size=2", "train.eval_batches=1",
          "train.tensorboard=false", "train.ckpt_every=0"]


def write_jsonl(rows, path: Path) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("rlcli")
    problems = make_problems(40, seed=0, max_value=5)
    text = "\n".join(f"{r['instruction']} {r['output']}" for r in sft_records(problems))
    (root / "corpus.txt").write_text(text * 3)
    tok = train_tokenizer([str(root / "corpus.txt")], 384, root / "tok", log=lambda *a: None)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_dim=32, intermediate_size=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, max_seq_len=96, ops=OpsConfig.plain())
    init = save_model(build_model(cfg, seed=0), root / "init", tokenizer_dir=root / "tok")
    return {"root": root, "init": str(init), "prompts": write_jsonl(problems, root / "prompts.jsonl"),
            "pairs": write_jsonl(preference_pairs(problems), root / "pairs.jsonl")}


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def reward_model(world):
    """``z2all reward`` trained once (3 steps, with --export-hf): (its output folder, the HF export)."""
    out, hf = world["root"] / "rm", world["root"] / "rm-hf"
    assert main(["reward", "--init", world["init"], "--data", world["pairs"], "--out", str(out),
                 "--valid-fraction", "0.2", "--export-hf", str(hf), "train.max_steps=3", "train.eval_every=3",
                 *COMMON]) == 0
    return out, hf


def test_reward_command_and_hf_export(world, reward_model):
    transformers = pytest.importorskip("transformers")
    out, hf = reward_model
    evals = [r for r in records(out) if r.get("kind") == "eval"]
    assert evals and "accuracy" in evals[-1]
    assert (out / "final" / "score.safetensors").exists()
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    assert transformers.AutoModelForSequenceClassification.from_pretrained(str(hf)).config.num_labels == 1
    main(["export-reward-hf", "--ckpt", str(out / "final"), "--out", str(world["root"] / "rm-hf2")])
    assert (world["root"] / "rm-hf2" / "model.safetensors").exists()


def test_rl_grpo_lora_command(world):
    out = world["root"] / "grpo"
    main(["rl", "--algo", "grpo", "--init", world["init"], "--data", world["prompts"], "--out", str(out),
          "--valid-fraction", "0.2", "--reward-fn", "zero2all.train.rl_tasks:exact_match", "--group-size", "2",
          "--max-new-tokens", "4", "--lora-rank", "2", "--kl-coef", "0.1", "train.max_steps=2",
          "train.eval_every=2", *COMMON])
    train = [r for r in records(out) if r.get("kind") == "train"]
    assert len(train) == 2
    for key in ("reward", "kl_k1", "kl_k3", "entropy", "clip_fraction", "response_length"):
        assert f"train_{key}" in train[-1], key
    assert abs(train[0]["train_kl_k3"]) < 1e-6  # LoRA B starts at 0: the policy is the reference at first
    assert any(r.get("kind") == "eval" and "reward" in r for r in records(out))
    assert (out / "final" / "adapter" / "adapter_config.json").exists()


def test_rl_ppo_reward_model_command(world, reward_model):
    rm = reward_model[0] / "final"
    out = world["root"] / "ppo"
    main(["rl", "--algo", "ppo", "--init", world["init"], "--data", world["prompts"], "--out", str(out),
          "--reward-model", str(rm), "--group-size", "1", "--max-new-tokens", "4", "--epochs", "2",
          "train.max_steps=2", "train.eval_every=0", *COMMON])
    train = [r for r in records(out) if r.get("kind") == "train"]
    assert len(train) == 2 and "train_value_loss" in train[-1] and "train_kl_k1" in train[-1]
    assert (out / "final" / "model.safetensors").exists()


def test_rl_bad_reward_settings(world, capsys):
    base = ["rl", "--init", world["init"], "--data", world["prompts"], "--out", str(world["root"] / "bad"), *COMMON]
    for extra, message in [([], "rl: no reward"), (["--reward-fn", "no_such_module_zz:f"], "cannot import"),
                           (["--reward-fn", "m:f", "--reward-model", "d"], "give one reward source"),
                           (["--reward-fn", "zero2all.train.rl_tasks:exact_match", "--group-size", "1"],
                            "rl.group_size: grpo compares")]:
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_rl_two_processes(world, tmp_path):
    """GRPO under torchrun: 2 gloo processes, DDP, each sampling for its share of the prompts."""
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "zero2all.cli", "rl", "--init", world["init"], "--data", world["prompts"], "--out", str(out),
           "--reward-fn", "zero2all.train.rl_tasks:exact_match", "--group-size", "2", "--max-new-tokens", "3",
           "--kl-coef", "0.05", "train.max_steps=2", "train.eval_every=0", *COMMON]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [r for r in records(out) if r.get("kind") == "train"]
    assert len(train) == 2 and all("train_reward" in r for r in train)
    assert "ddp on 2 processes" in proc.stdout


@pytest.mark.parametrize("stage", ["sft", "dpo", "reward", "rl"])
def test_posttrain_help_states_the_real_defaults(stage, capsys):
    """--help names the folder the run really writes to, and the data a stage really reads."""
    from zero2all.train.posttrain import STAGE_TRAIN_DEFAULTS

    with pytest.raises(SystemExit):
        main([stage, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default {STAGE_TRAIN_DEFAULTS[stage]['out_dir']})" in text
    data_help = {"sft": "or one `z2all prepare-sft` directory", "dpo": "or one `z2all prepare-dpo` directory",
                 "reward": "or one `z2all prepare-dpo` directory", "rl": "jsonl / json files of prompt records"}
    assert data_help[stage] in text


def test_rl_refuses_a_directory_as_data(world, tmp_path, capsys):
    """A folder (a `prepare-sft` output holds tokens, not the prompt records a reward reads) is one line, exit 2."""
    folder = tmp_path / "sft-data"
    folder.mkdir()
    (folder / "meta.json").write_text("{}")
    rc = main(["rl", "--init", world["init"], "--data", str(folder), "--out", str(tmp_path / "out"),
               "--reward-fn", "zero2all.train.rl_tasks:exact_match", "train.max_steps=1", *COMMON])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"post.data: {folder} is a directory" in err and ".jsonl" in err
    assert not (tmp_path / "out").exists()
