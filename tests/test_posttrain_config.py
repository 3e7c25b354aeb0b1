"""The run config of `z2all sft` / `z2all dpo` (``posttrain_config``), built without training."""


import pytest

from zero2all.config import ConfigError
from zero2all.train.posttrain import DPO_TRAIN_DEFAULTS, SFT_TRAIN_DEFAULTS, posttrain_config


@pytest.fixture
def init(config_only_init):
    return str(config_only_init)


def test_stage_defaults_file_values_overrides(init, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nlr = 5e-5\nmax_steps = 40\n[post]\nbeta = 0.3\n[model.ops]\nattention = "naive"\n')
    cfg = posttrain_config("dpo", path, ["train.max_steps=50"], {"post.init": init, "post.data": ["p.jsonl"],
                                                               "post.beta": 0.2})
    assert (cfg.train.lr, cfg.train.max_steps, cfg.post.beta) == (5e-5, 50, 0.2)
    assert cfg.train.micro_batch_size == DPO_TRAIN_DEFAULTS["micro_batch_size"]
    assert cfg.model.ops.attention == "naive" and cfg.model.hidden_dim == 64
    assert cfg.data.path == "p.jsonl"
    sft = posttrain_config("sft", None, [f"post.init='{init}'", "post.data=['a.jsonl']"])  # the older call
    assert sft.train.out_dir == SFT_TRAIN_DEFAULTS["out_dir"] and sft.post.data == ["a.jsonl"]


@pytest.mark.parametrize("overrides, error, message", [
    (["model.hidden_dim=128"], ConfigError, "model.hidden_dim: comes from the --init checkpoint"),
    (["post.packing='squeeze'"], ConfigError, "post.packing: 'squeeze' is not one of pack, pad"),
    (["post.lora_alpha=0"], ConfigError, "post.lora_alpha: must be positive"),
    (["post.data=[]"], ConfigError, "post.data: no training data"),
    (["post.init=''"], ConfigError, "post.init: a post-training run starts from a pretrained checkpoint"),
    (["post.init='/no/such/dir'"], FileNotFoundError, "post.init: /no/such/dir is not a checkpoint directory"),
    (["post.init=3"], ConfigError, "post.init: expected a string"),
    (["post=3"], ConfigError, "post: expected a table"),
    (["data.seq_len=64"], ConfigError, "data.seq_len: 64 exceeds model.max_seq_len=32"),
    (["train.lr=inf"], ConfigError, "train.lr: must be a finite number"),
])
def test_errors_name_the_key(init, overrides, error, message):
    with pytest.raises(error) as e:
        posttrain_config("sft", None, [f"post.init='{init}'", "post.data=['a.jsonl']", *overrides])
    assert message in str(e.value)


def test_option_and_override_of_one_key_is_refused(init):
    with pytest.raises(ConfigError, match="post.lora_rank: set twice, by --lora-rank and by the override"):
        posttrain_config("sft", None, ["post.lora_rank=4"], {"post.init": init, "post.data": ["a.jsonl"],
                                                             "post.lora_rank": 8},
                         sources={"post.lora_rank": "--lora-rank"})


def test_legacy_parallel_keys_are_read(init, capsys):
    cfg = posttrain_config("sft", None, [f"post.init='{init}'", "post.data=['a.jsonl']", "train.parallel='none'"])
    assert cfg.parallel.mode == "none" and "train.parallel is now parallel.mode" in capsys.readouterr().err
