import json

import pytest
import torch
from standin_tokenizer import tiny_model_config

from zero2all.model.io import export_hf, load_model, save_model
from zero2all.model.lora import (
    LoRAConfig,
    LoRALinear,
    apply_lora,
    load_adapter,
    lora_modules,
    merge_lora,
    save_adapter,
    set_merged,
)
from zero2all.model.z2all import build_model

ALL = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def randomize_lora(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.3)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.3)


def tokens(seed=0, B=2, T=11):
    return torch.randint(0, 260, (B, T), generator=torch.Generator().manual_seed(seed))


def test_fresh_lora_is_identity_and_only_lora_trains():
    model = build_model(tiny_model_config(), seed=0)
    x = tokens()
    before, _ = model(x)
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=ALL))
    after, loss = model(x, targets=tokens(1))
    torch.testing.assert_close(before, after)  # B starts at zero
    loss.backward()
    for name, p in model.named_parameters():
        is_lora = name.endswith(("lora_A", "lora_B"))
        assert p.requires_grad == is_lora, name
        assert (p.grad is not None) == is_lora, name
    assert len(lora_modules(model)) == 4 * 2 + 1


def test_merged_equals_unmerged_and_unmerge_restores():
    model = build_model(tiny_model_config(), seed=0).eval()
    w0 = model.layers[1].self_attn.qkv_proj.weight.detach().clone()
    apply_lora(model, LoRAConfig(rank=3, alpha=5, targets=("q_proj", "k_proj", "v_proj", "down_proj")))
    randomize_lora(model)
    x = tokens()
    with torch.no_grad():
        unmerged, _ = model(x)
        set_merged(model, True)
        merged, _ = model(x)
        assert not torch.equal(model.layers[1].self_attn.qkv_proj.weight, w0)
        set_merged(model, False)
        torch.testing.assert_close(model.layers[1].self_attn.qkv_proj.weight, w0, atol=1e-6, rtol=0)
        merge_lora(model)
        plain, _ = model(x)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, unmerged, atol=1e-5, rtol=1e-5)
    assert not lora_modules(model) and set(model.state_dict()) == set(build_model(tiny_model_config()).state_dict())


def test_dropout_only_in_training():
    model = build_model(tiny_model_config(), seed=0)
    apply_lora(model, LoRAConfig(rank=4, dropout=0.5, targets=("o_proj",)))
    randomize_lora(model)
    x = tokens()
    model.train()
    a, _ = model(x)
    b, _ = model(x)
    model.eval()
    c, _ = model(x)
    d, _ = model(x)
    assert not torch.allclose(a, b) and torch.equal(c, d)


def test_bad_targets_are_named():
    model = build_model(tiny_model_config(), seed=0)
    with pytest.raises(ValueError, match="q_proj is part of the fused qkv_proj"):
        apply_lora(model, LoRAConfig(targets=("q_proj", "v_proj")))
    with pytest.raises(ValueError, match="unknown module 'attn'"):
        apply_lora(model, LoRAConfig(targets=("attn",)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = build_model(tiny_model_config(), seed=0)
    save_model(base, d / "base")
    export_hf(d / "base", d / "hf")
    return d


def hf_logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def test_peft_loads_our_adapter_with_equal_logits(exported, tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    ours = load_model(exported / "base")
    apply_lora(ours, LoRAConfig(rank=4, alpha=8, targets=ALL))
    randomize_lora(ours, seed=1)
    save_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(exported / "base"))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj", "lm_head"}
    hf = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(exported / "hf"), tmp_path / "adapter").eval()
    x = tokens(2)
    with torch.no_grad():
        mine, _ = ours.eval()(x)
        base_only, _ = load_model(exported / "base")(x)
    theirs = hf_logits(hf, x)
    torch.testing.assert_close(theirs, mine, atol=2e-5, rtol=1e-4)
    assert (mine - base_only).abs().max() > 1e-2  # the adapter does change the logits
    # and back: our loader reads the same files onto a fresh base
    again = load_adapter(load_model(exported / "base"), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(again(x)[0], mine, atol=1e-6, rtol=1e-6)


def test_we_load_a_peft_trained_partial_adapter_exactly(exported, tmp_path):
    """An adapter made by peft on q_proj and v_proj only (separate A each) loads onto our fused qkv_proj."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(exported / "hf")
    peft_model = get_peft_model(hf, LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj", "up_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(tmp_path / "peft")
    x = tokens(4)
    theirs = hf_logits(PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(exported / "hf"),
                                                 tmp_path / "peft").eval(), x)
    ours = load_adapter(load_model(exported / "base"), tmp_path / "peft").eval()
    assert isinstance(ours.layers[0].self_attn.qkv_proj, LoRALinear)
    assert ours.layers[0].self_attn.qkv_proj.lora_A.shape[0] == 4  # two parts of rank 2, block form
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs, atol=2e-5, rtol=1e-4)


def adapted_base(exported, seed: int, n_tokens: int):
    """The exported base with a rank-2 LoRA of random weights: (model, tokens, its logits on them)."""
    ours = load_model(exported / "base")
    apply_lora(ours, LoRAConfig(rank=2, alpha=4))
    randomize_lora(ours, seed=seed)
    x = tokens(n_tokens)
    with torch.no_grad():
        expected, _ = ours.eval()(x)
    return ours, x, expected


def test_load_model_merges_adapters_and_export(exported, tmp_path):
    from transformers import LlamaForCausalLM

    from zero2all.cli import main

    ours, x, expected = adapted_base(exported, seed=5, n_tokens=6)
    # adapter alone, pointing at its base
    save_adapter(ours, tmp_path / "only_adapter", base_model_name_or_path=str(exported / "base"))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "only_adapter")(x)[0], expected, atol=1e-5,
                                   rtol=1e-5)
    # base checkpoint with the adapter in adapter/, through the command line
    base = load_model(exported / "base")
    save_model(base, tmp_path / "ckpt")
    save_adapter(ours, tmp_path / "ckpt" / "adapter")
    assert main(["export-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "merged_hf"),
                 "--merge-lora"]) == 0
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "merged_hf")
    torch.testing.assert_close(hf_logits(hf, x), expected, atol=2e-5, rtol=1e-4)
    with pytest.raises(FileNotFoundError, match="base_model_name_or_path"):
        save_adapter(ours, tmp_path / "orphan", base_model_name_or_path=str(tmp_path / "nowhere"))
        load_model(tmp_path / "orphan")


def test_public_load_model_merges_an_attached_adapter(exported, tmp_path):
    """zero2all.load_model on a directory with a LoRA adapter returns base + adapter, never the bare base."""
    import zero2all

    ours, x, expected = adapted_base(exported, seed=7, n_tokens=5)
    with torch.no_grad():
        base_out, _ = load_model(exported / "base")(x)
    save_model(load_model(exported / "base"), tmp_path / "ckpt")
    save_adapter(ours, tmp_path / "ckpt" / "adapter")
    loaded = zero2all.load_model(tmp_path / "ckpt", ops={"attention": "naive"})
    assert loaded.cfg.ops.attention == "naive" and not loaded.training
    with torch.no_grad():
        got, _ = loaded(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, base_out, atol=1e-4)
