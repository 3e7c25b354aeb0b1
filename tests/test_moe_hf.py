"""MoE HF interop: Mixtral (no shared expert) and Qwen2-MoE (a gated shared expert, a dense first layer), both
directions, fp32 logits to 1e-5; a PEFT LoRA adapter on attention of an exported MoE model gives our logits."""

import json

import pytest
import torch

from zero2all.config import ConfigError, ModelConfig, MoEConfig, OpsConfig
from zero2all.model.io import export_hf, import_hf, load_model, save_model
from zero2all.model.z2all import build_model

transformers = pytest.importorskip("transformers")

V = 120


def moe_model_config(family: str) -> ModelConfig:
    moe = MoEConfig(n_experts=4, top_k=2, expert_intermediate_size=20)
    if family == "qwen2_moe":
        moe = MoEConfig(n_experts=5, top_k=3, n_shared_experts=2, shared_expert_gate=True, expert_intermediate_size=12,
                        first_dense_layers=1, renormalize=False)
    return ModelConfig(vocab_size=V, hidden_dim=48, intermediate_size=36, n_layers=3, n_heads=4, n_kv_heads=2,
                       max_seq_len=64, ops=OpsConfig.plain(), moe=moe)


def hf_load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             experts_implementation="eager").eval()


def randomize(model, seed):
    """Random norms and routers too, so that a mapping mistake in any of them changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "router" in name or name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
                p.copy_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("family,cls", [("mixtral", "MixtralForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM")])
def test_export_matches_transformers(tmp_path, family, cls):
    model = build_model(moe_model_config(family), seed=3).eval()
    randomize(model, 1)
    save_model(model, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == family
    hf = hf_load(tmp_path / "hf")
    assert type(hf).__name__ == cls
    x = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], hf(x).logits, atol=1e-5, rtol=0)


def hf_config(family):
    common = dict(vocab_size=V, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=20, num_local_experts=4, num_experts_per_tok=2,
                                          **common)
    return transformers.Qwen2MoeConfig(intermediate_size=36, moe_intermediate_size=12,
                                       shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
                                       mlp_only_layers=[0], norm_topk_prob=True, qkv_bias=False, **common)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_import_from_transformers(tmp_path, family):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(family), experts_implementation="eager").eval()
    randomize(hf, 2)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    x = torch.randint(0, V, (3, 17), generator=torch.Generator().manual_seed(1))
    for path in (tmp_path / "ours", tmp_path / "hf"):
        model = load_model(path, ops={"grouped_gemm": "loop"})
        assert model.cfg.moe.n_experts == (4 if family == "mixtral" else 6)
        with torch.no_grad():
            torch.testing.assert_close(model(x)[0], hf(x).logits, atol=1e-5, rtol=0)


def test_export_refuses_what_hf_cannot_express(tmp_path):
    cfg = moe_model_config("mixtral")
    cfg.moe.router = "sigmoid"
    model = build_model(cfg, seed=0)
    save_model(model, tmp_path / "ours")
    with pytest.raises(ConfigError, match="softmax_topk"):
        export_hf(tmp_path / "ours", tmp_path / "hf")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_peft_lora_on_attention_of_a_moe_model(tmp_path, family):
    """The default LoRA targets on a MoE model: attention and the dense MLPs get adapters, MoE blocks (shared
    experts included) keep their weights; PEFT applies the adapter to the exported model with our logits."""
    from peft import PeftModel

    from zero2all.model.lora import LoRAConfig, apply_lora, lora_modules, save_adapter

    model = build_model(moe_model_config(family), seed=4).eval()
    save_model(model, tmp_path / "base")
    export_hf(tmp_path / "base", tmp_path / "hf")
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))
    assert not any(".mlp.shared." in name for name in lora_modules(model))
    assert ("layers.0.mlp.gate_up_proj" in lora_modules(model)) == (family == "qwen2_moe")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.3)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.3)
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    hf = PeftModel.from_pretrained(hf_load(tmp_path / "hf"), tmp_path / "adapter").eval()
    x = torch.randint(0, V, (2, 13), generator=g)
    with torch.no_grad():
        mine = model.eval()(x)[0]
        torch.testing.assert_close(hf(input_ids=x).logits, mine, atol=2e-5, rtol=1e-4)
        assert (mine - load_model(tmp_path / "base")(x)[0]).abs().max() > 1e-2


def test_import_reads_the_fused_expert_layout(tmp_path):
    """transformers 5 keeps the experts fused in memory (mlp.experts.gate_up_proj / down_proj); a checkpoint
    written from that state dict loads as well."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config("qwen2_moe"), experts_implementation="eager").eval()
    randomize(hf, 3)
    hf.save_pretrained(tmp_path / "hf")
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"))
    x = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "hf")(x)[0], hf(x).logits, atol=1e-5, rtol=0)
