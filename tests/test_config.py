import pytest

from zero2all.config import ConfigError, ModelConfig, OpsConfig, list_presets, load_config


def test_presets_load_and_validate():
    names = list_presets()
    for name in ("tiny", "z2all-1.1b", "z2all-1.7b", "llama2-7b", "llama2-70b"):
        assert name in names
        load_config(name)


def test_reference_config_values():
    m = load_config("z2all-1.1b").model
    assert (m.vocab_size, m.hidden_dim, m.intermediate_size, m.n_layers, m.n_heads, m.n_kv_heads) == \
        (64320, 2048, 5632, 22, 32, 8)
    assert (m.max_seq_len, m.rms_norm_eps, m.rope_theta, m.initializer_range) == (2048, 1e-5, 10000.0, 0.02)
    assert not m.tie_word_embeddings and m.residual_in_fp32 and not m.attention_bias
    assert (m.attention_dropout, m.dropout1, m.dropout2) == (0.0, 0.0, 0.0)


def test_dotted_overrides_types():
    cfg = load_config("tiny", ["model.n_layers=3", "train.lr=1e-3", "model.ops.rmsnorm=torch",
                               "model.rope_scaling={type='linear', factor=2.0}", "train.out_dir=runs/x",
                               "model.ops.fused_linear=triton"])
    assert cfg.model.n_layers == 3 and cfg.train.lr == 1e-3 and cfg.model.ops.rmsnorm == "torch"
    assert cfg.model.ops.fused_linear == "triton" and OpsConfig().fused_linear == "auto"
    assert OpsConfig.plain().fused_linear == "torch"
    assert cfg.model.rope_scaling == {"type": "linear", "factor": 2.0}
    assert cfg.train.out_dir == "runs/x"


@pytest.mark.parametrize("override, message", [
    ("model.n_layer=3", "model.n_layer: unknown key (did you mean 'n_layers'?)"),
    ("model.n_layers=three", "model.n_layers: expected an integer"),
    ("model.tie_word_embeddings=1", "model.tie_word_embeddings: expected true/false"),
    ("trian.lr=1", "trian: unknown key"),
    ("model.n_kv_heads=3", "not divisible by model.n_kv_heads=3"),
    ("model.hidden_dim=250", "hidden_dim: 250 is not divisible by model.n_heads=8"),
    ("model.ops.attention=fast", "model.ops.attention: 'fast' is not one of"),
    ("model.ops.fused_linear=fused", "model.ops.fused_linear: 'fused' is not one of torch, triton, auto"),
    ("model.rope_scaling={type='yarn', factor=2.0}", "rope_scaling.type"),
])
def test_bad_configs_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    assert message in str(e.value)


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="presets: .*tiny"):
        load_config("no-such-preset")


def test_vocab_padding():
    assert ModelConfig(vocab_size=64321, pad_vocab_to_multiple_of=64).padded_vocab_size == 64384
    assert ModelConfig(vocab_size=200).padded_vocab_size == 200


# ------------------------------------------------------------------------------------------ per-section checks

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from zero2all.config import (  # noqa: E402
    Config,
    DataConfig,
    ParallelConfig,
    PostTrainConfig,
    TrainConfig,
    build_config,
    build_config_dict,
    deep_merge,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("override, message", [
    ("train.lr=nan", "train.lr: must be a finite number, got nan"),
    ("train.lr=inf", "train.lr: must be a finite number, got inf"),
    ("train.lr=0", "train.lr: must be positive"),
    ("train.min_lr=-1e-5", "train.min_lr: must be in [0, train.lr"),
    ("train.min_lr=1.0", "train.min_lr: must be in [0, train.lr"),
    ("train.beta1=1.0", "train.beta1: must be in [0, 1)"),
    ("train.beta2=-0.1", "train.beta2: must be in [0, 1)"),
    ("train.beta2=nan", "train.beta2: must be a finite number"),
    ("train.eps=0", "train.eps: must be positive"),
    ("train.eps=-inf", "train.eps: must be a finite number"),
    ("train.weight_decay=-0.1", "train.weight_decay: must be >= 0"),
    ("train.warmup_steps=-1", "train.warmup_steps: must be >= 0"),
    ("train.decay_fraction=0", "train.decay_fraction: must be in (0, 1]"),
    ("train.decay_fraction=1.5", "train.decay_fraction: must be in (0, 1]"),
    ("train.keep_last=-1", "train.keep_last: must be >= 0"),
    ("train.precision='fp8'", "train.precision: 'fp8' is not one of auto, bf16, fp16, fp32"),
    ("train.schedule='linear'", "train.schedule: 'linear' is not one of cosine, wsd, constant"),
    ("train.fused_adamw='yes'", "train.fused_adamw: 'yes' is not one of auto, true, false"),
    ("train.gpu_peak_flops=-1", "train.gpu_peak_flops: must be >= 0"),
    ("train.gpu_peak_flops=nan", "train.gpu_peak_flops: must be a finite number"),
    ("train.sample_temperature=-0.5", "train.sample_temperature: must be >= 0"),
    ("train.sample_top_k=-1", "train.sample_top_k: must be >= 0"),
    ("train.grad_clip=-1", "train.grad_clip: must be >= 0 (0 = off)"),
    ("train.z_loss=nan", "train.z_loss: must be a finite number"),
    ("train.micro_batch_size=0", "train.micro_batch_size: must be positive"),
    ("train.grad_accum_steps=0", "train.grad_accum_steps: must be positive"),
    ("train.max_steps=0", "train.max_steps: must be positive"),
    ("train.eval_every=-1", "train.eval_every: must be >= 0"),
    ("train.sample_prompts=['a', 1]", "train.sample_prompts[1]: expected a string"),
    ("train.sample_prompts='abc'", "train.sample_prompts: expected a list"),
    ("data.seq_len=-1", "data.seq_len: must be >= 0"),
    ("data.seq_len=100000", "data.seq_len: 100000 exceeds model.max_seq_len=256"),
    ("data.num_workers=4", "data.num_workers: was removed: it was never read"),
    ("post.packing='squeeze'", "post.packing: 'squeeze' is not one of pack, pad"),
    ("post.on_error='ignore'", "post.on_error: 'ignore' is not one of raise, skip"),
    ("post.valid_fraction=1.0", "post.valid_fraction: must be in [0, 1)"),
    ("post.lora_rank=-1", "post.lora_rank: must be >= 0"),
    ("post.beta=0", "post.beta: must be positive"),
    ("post.beta=nan", "post.beta: must be a finite number"),
    ("post.beta=inf", "post.beta: must be a finite number"),
    ("post.lora_alpha=0", "post.lora_alpha: must be positive"),
    ("post.lora_dropout=1.0", "post.lora_dropout: must be in [0, 1)"),
    ("post.lora_dropout=-0.1", "post.lora_dropout: must be in [0, 1)"),
    ("post.data='one.jsonl'", "post.data: expected a list"),
    ("parallel.timeout_s=nan", "parallel.timeout_s: must be a finite number"),
    ("model.rms_norm_eps=nan", "model.rms_norm_eps: must be a finite number"),
    ("model.rope_theta=0", "model.rope_theta: must be positive"),
    ("model.rope_scaling={type='linear', factor=nan}", "model.rope_scaling.factor"),
])
def test_every_section_checks_its_fields(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    assert message in str(e.value)


def test_sections_validate_on_their_own_and_config_calls_each():
    TrainConfig().validate()
    DataConfig().validate()
    PostTrainConfig().validate()
    ParallelConfig().validate()
    Config().validate()
    with pytest.raises(ConfigError, match="stage.lr: must be a finite number"):
        TrainConfig(lr=math.nan).validate("stage")
    for cfg, key in ((Config(train=TrainConfig(lr=-1.0)), "train.lr"),
                     (Config(data=DataConfig(seq_len=-2)), "data.seq_len"),
                     (Config(post=PostTrainConfig(beta=-1.0)), "post.beta"),
                     (Config(parallel=ParallelConfig(ac_every=0)), "parallel.ac_every"),
                     (Config(data=DataConfig(seq_len=4096)), "data.seq_len: 4096 exceeds model.max_seq_len=2048")):
        with pytest.raises(ConfigError, match=key):
            cfg.validate()
    assert not hasattr(DataConfig(), "num_workers")


def test_schedule_rules_match_the_lr_schedule():
    """The schedule fields are checked again by LRSchedule when a run starts; both accept and refuse alike where
    their rules overlap (the config is stricter only on decay_fraction = 0)."""
    from zero2all import config as C
    from zero2all.train.optim import SCHEDULES, LRSchedule

    assert C.SCHEDULES == SCHEDULES
    for fields in ({"min_lr": 1.0, "lr": 0.5}, {"warmup_steps": -1}, {"max_steps": 0}, {"schedule": "linear"},
                   {"decay_fraction": 1.5}):
        t = TrainConfig(**fields)
        with pytest.raises(ConfigError):
            t.validate()
        with pytest.raises(ConfigError):
            LRSchedule.from_config(t)
    LRSchedule.from_config(TrainConfig(schedule="wsd", warmup_steps=5000, max_steps=10))  # a short trial is fine
    TrainConfig(schedule="wsd", warmup_steps=5000, max_steps=10).validate()


# ------------------------------------------------------------------------------------------ build_config


def _toml(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_build_config_precedence(tmp_path):
    path = _toml(tmp_path, '[train]\nout_dir = "from-file"\nlr = 1e-3\nmax_steps = 7\n[data]\npath = "file-data"\n')
    cfg = build_config(path, ["train.max_steps=9", "train.max_steps=11"],
                       {"train.out_dir": "from-flag", "data.path": "flag-data", "post.data": ("a.jsonl", "b.jsonl")})
    assert cfg.train.out_dir == "from-flag" and cfg.data.path == "flag-data"    # values win over the file
    assert cfg.train.max_steps == 11                                            # the last override wins
    assert cfg.train.lr == 1e-3                                                 # the file over the defaults
    assert cfg.post.data == ["a.jsonl", "b.jsonl"]                              # a tuple becomes a list
    assert cfg.train.micro_batch_size == TrainConfig().micro_batch_size
    # a table override that does not touch a value's key merges with it
    cfg = build_config(None, ["train={lr=2e-3}"], {"train.out_dir": "x"})
    assert (cfg.train.lr, cfg.train.out_dir) == (2e-3, "x")


@pytest.mark.parametrize("override", ["train.out_dir='y'", "train={out_dir='y'}", "train.out_dir.deeper=1"])
def test_a_key_set_by_a_value_and_an_override_is_refused(override):
    with pytest.raises(ConfigError) as e:
        build_config("tiny", [override], {"train.out_dir": "x"}, sources={"train.out_dir": "--out"})
    assert str(e.value).startswith("train.out_dir: set twice, by --out and by the override")
    with pytest.raises(ConfigError, match="train.out_dir: set twice, by the value of train.out_dir"):
        build_config("tiny", [override], {"train.out_dir": "x"})


def test_values_are_type_checked_and_named():
    with pytest.raises(ConfigError, match="post.lora_rank: expected an integer, got '8'"):
        build_config(None, [], {"post.lora_rank": "8"})
    with pytest.raises(ConfigError, match="train.lrr: unknown key \\(did you mean 'lr'\\?\\)"):
        build_config(None, [], {"train.lrr": 1.0})
    with pytest.raises(ConfigError, match="bad key"):
        build_config(None, [], {"train..lr": 1.0})
    with pytest.raises(ConfigError, match="train.lr: must be a finite number"):
        build_config(None, [], {"train.lr": float("nan")})


def test_rope_scaling_is_replaced_whole():
    path_cfg = build_config("tiny", ["model.rope_scaling={type='dynamic', factor=2.0, "
                                     "original_max_position_embeddings=128}",
                                     "model.rope_scaling={type='linear', factor=4.0}"])
    assert path_cfg.model.rope_scaling == {"type": "linear", "factor": 4.0}
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}}) == {"a": {"b": 3, "c": 2}}


def test_legacy_keys_are_moved_per_layer(tmp_path):
    notes = []
    path = _toml(tmp_path, '[train]\nparallel = "ddp"\ndist_timeout_s = 30.0\n')
    data = build_config_dict(path, ["parallel.mode='fsdp'"], warn=notes.append)
    assert data["parallel"] == {"mode": "fsdp", "timeout_s": 30.0}     # the new name overrides the file's old one
    assert "note: train.parallel is now parallel.mode" in notes[0]
    cfg = build_config(None, ["train.activation_checkpointing='full'"], warn=notes.append)
    assert cfg.parallel.activation_checkpointing == "full"
    # in one layer, the old and the new name disagreeing is refused; across layers the later one wins
    both = _toml(tmp_path, '[train]\nparallel = "ddp"\n[parallel]\nmode = "fsdp"\n')
    with pytest.raises(ConfigError, match="set parallel.mode only"):
        build_config(both, warn=notes.append)
    assert build_config(None, ["train.parallel='ddp'", "parallel.mode='none'"], warn=notes.append).parallel.mode \
        == "none"
    with pytest.raises(ConfigError, match="parallel.mode: set twice"):
        build_config(None, ["train.parallel='ddp'"], {"parallel.mode": "fsdp"}, warn=notes.append)


def test_config_module_imports_neither_torch_nor_the_training_code():
    code = ("import sys, zero2all.config; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('zero2all.train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_fsdp_accum_no_sync_auto_is_on_under_expert_parallelism_only():
    from zero2all.config import ConfigError, ParallelConfig

    assert ParallelConfig().accum_no_sync() is False
    assert ParallelConfig(ep=2).accum_no_sync() is True
    assert ParallelConfig(ep=2, fsdp_accum_no_sync=False).accum_no_sync() is False
    assert ParallelConfig(fsdp_accum_no_sync=True).accum_no_sync() is True
    with pytest.raises(ConfigError, match="fsdp_accum_no_sync: expected true, false or \"auto\""):
        ParallelConfig(fsdp_accum_no_sync="yes").validate()


def test_async_tp_is_refused_outside_compiled_dtensor_sequence_parallel():
    from zero2all.config import ConfigError, ParallelConfig
    from zero2all.distributed.plan import resolve, sections

    resolve(sections(None, ParallelConfig(tp=2, tp_impl="dtensor", sequence_parallel=True, async_tp=True)), None)
    for bad in (dict(tp=1), dict(tp=2, tp_impl="local", sequence_parallel=True), dict(tp=2, tp_impl="dtensor")):
        with pytest.raises(ConfigError, match="async_tp .*needs parallel.tp > 1, tp_impl = 'dtensor'"):
            resolve(sections(None, ParallelConfig(async_tp=True, **bad)), None)
