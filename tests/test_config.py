import pytest

from zero2all.config import ConfigError, ModelConfig, OpsConfig, load_config, list_presets


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
