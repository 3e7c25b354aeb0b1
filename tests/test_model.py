"""The model against transformers' LlamaForCausalLM, the KV cache against the full forward, SDPA against naive."""

import copy
import subprocess
import sys

import pytest
import torch

from zero2all.config import ModelConfig, OpsConfig
from zero2all.model.io import export_hf, import_hf, load_model, save_model
from zero2all.model.z2all import build_model

transformers = pytest.importorskip("transformers")


def odd_config(**kw):
    base = dict(vocab_size=200, hidden_dim=96, intermediate_size=100, n_layers=2, n_heads=6, n_kv_heads=2,
                max_seq_len=32, ops=OpsConfig.plain())
    base.update(kw)
    return ModelConfig(**base)


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("rope_scaling", [None, {"type": "linear", "factor": 2.0},
                                          {"type": "dynamic", "factor": 3.0}])
def test_export_matches_transformers(tmp_path, tie, rope_scaling):
    torch.manual_seed(0)
    model = build_model(odd_config(tie_word_embeddings=tie, rope_scaling=rope_scaling), seed=1).eval()
    save_model(model, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf")
    hf = hf_model(tmp_path / "hf")
    assert type(hf).__name__ == "LlamaForCausalLM"
    # 48 tokens > max_seq_len 32, so dynamic NTK scaling is active
    tokens = torch.randint(0, 200, (2, 48))
    with torch.no_grad():
        ours, _ = model(tokens)
        theirs = hf(tokens).logits
    assert ours.shape == (2, 48, 200)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_import_from_transformers(tmp_path, tie):
    cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=96, intermediate_size=100, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms to 1; randomise them so a mapping mistake shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    for path in (tmp_path / "ours", tmp_path / "hf"):  # both our format and the HF dir load directly
        model = load_model(path, ops={"attention": "sdpa"})
        tokens = torch.randint(0, 200, (3, 17))
        with torch.no_grad():
            torch.testing.assert_close(model(tokens)[0], hf(tokens).logits, atol=1e-5, rtol=0)
    assert model.cfg.tie_word_embeddings == tie


def test_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    model = build_model(odd_config(), seed=2).eval()
    tokens = torch.randint(0, 200, (2, 20))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_kv_cache(batch_size=2, max_len=32)
        prefix, _ = model(tokens[:, :7], kv_cache=cache, start_pos=0)  # a prompt, then one token at a time
        steps = [prefix]
        for t in range(7, 20):
            steps.append(model(tokens[:, t:t + 1], kv_cache=cache, start_pos=t)[0])
        chunk = model(tokens[:, :5], kv_cache=model.new_kv_cache(2, 32), start_pos=0)  # chunked prefill too
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunk[0], full[:, :5], atol=1e-5, rtol=0)


def test_kv_cache_chunked_prefill():
    model = build_model(odd_config(), seed=3).eval()
    tokens = torch.randint(0, 200, (1, 24))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_kv_cache(1, 32)
        a, _ = model(tokens[:, :10], kv_cache=cache, start_pos=0)
        b, _ = model(tokens[:, 10:24], kv_cache=cache, start_pos=10)  # several new tokens on top of a cache
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 6])
def test_sdpa_equals_naive(n_kv_heads):
    sdpa = build_model(odd_config(n_kv_heads=n_kv_heads), seed=4)
    naive_cfg = odd_config(n_kv_heads=n_kv_heads)
    naive_cfg.ops.attention = "naive"
    naive = build_model(naive_cfg, device="cpu")
    naive.load_state_dict(sdpa.state_dict())
    tokens = torch.randint(0, 200, (2, 19))
    targets = torch.randint(0, 200, (2, 19))
    targets[0, :5] = -100
    la, lossa = sdpa(tokens, targets)
    lb, lossb = naive(tokens, targets)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)
    lossa.backward()
    lossb.backward()
    for (n, pa), pb in zip(sdpa.named_parameters(), naive.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_loss_ignores_minus_100():
    model = build_model(odd_config(), seed=5)
    tokens = torch.randint(0, 200, (2, 10))
    targets = torch.randint(0, 200, (2, 10))
    logits, loss = model(tokens, targets)
    mask = torch.zeros_like(targets, dtype=torch.bool)
    mask[:, ::3] = True
    masked = targets.masked_fill(mask, -100)
    _, loss_masked = model(tokens, masked)
    ref = torch.nn.functional.cross_entropy(logits[~mask].float(), targets[~mask])
    torch.testing.assert_close(loss_masked, ref)
    assert not torch.isclose(loss_masked, loss)


def test_logits_under_bf16_autocast():
    model = build_model(odd_config(), seed=6)
    tokens = torch.randint(0, 200, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(tokens)
    assert logits.dtype == torch.bfloat16
    ref, _ = model(tokens)
    assert (logits.float() - ref).abs().max() < 0.1


@pytest.mark.parametrize("residual_in_fp32", [True, False])
def test_residual_fp32_under_bf16_autocast(residual_in_fp32):
    """A model whose weights are bf16 (float32 weights make the stream float32 from the embedding on, whatever
    the flag): with ``residual_in_fp32`` every block hands on a float32 residual and the logits stay nearer the
    float32 run of the same weights (8 layers: relative L2 3.3e-3 to 3.5e-3 over seeds; a bf16 stream 7.2e-3)."""
    model = build_model(odd_config(n_layers=8, residual_in_fp32=residual_in_fp32), seed=6).to(torch.bfloat16)
    ref = copy.deepcopy(model).float()
    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    dtypes = []
    for layer in model.layers:
        layer.register_forward_hook(lambda module, args, out: dtypes.append(out[1].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(tokens)
    want, _ = ref(tokens)
    error = ((logits.float() - want).norm() / want.norm()).item()
    if residual_in_fp32:
        assert dtypes == [torch.float32] * 8
        assert error < 5e-3, error
    else:
        assert dtypes == [torch.bfloat16] * 8
        assert error > 5e-3, error


def test_scaled_init_std():
    cfg = odd_config(n_layers=8, hidden_dim=192, intermediate_size=512)
    model = build_model(cfg, seed=0)
    std = cfg.initializer_range
    assert abs(model.layers[0].mlp.gate_up_proj.weight.std().item() - std) < 0.1 * std
    assert abs(model.layers[0].mlp.down_proj.weight.std().item() - std / 4) < 0.1 * std / 4  # 1/sqrt(2*8)
    assert torch.all(model.layers[0].input_layernorm.weight == 1)


def test_vocab_padding_in_model():
    model = build_model(odd_config(vocab_size=199, pad_vocab_to_multiple_of=64), device="meta")
    assert model.embed_tokens.weight.shape[0] == 256 and model.lm_head.weight.shape[0] == 256


def test_param_count_closed_form_on_meta():
    from zero2all.config import load_config

    cfg = load_config("z2all-1.1b").model
    model = build_model(cfg, device="meta")
    assert model.embed_tokens.weight.is_meta
    v, h, i, l, kv = cfg.vocab_size, cfg.hidden_dim, cfg.intermediate_size, cfg.n_layers, cfg.n_kv_heads
    closed = 2 * v * h + l * (2 * h * h + 2 * h * kv * cfg.head_dim + 3 * h * i + 2 * h) + h
    assert model.num_params() == closed == 1_255_499_776


def test_cli_info_prints_param_count():
    out = subprocess.run([sys.executable, "-m", "zero2all.cli", "info", "--config", "z2all-1.1b"],
                         capture_output=True, text=True, check=True).stdout
    assert "1,255,499,776" in out


def test_load_rejects_mismatched_weights(tmp_path):
    model = build_model(odd_config(), seed=0)
    save_model(model, tmp_path / "ck")
    import json

    meta = json.loads((tmp_path / "ck" / "z2all.json").read_text())
    meta["model"]["n_layers"] = 3
    (tmp_path / "ck" / "z2all.json").write_text(json.dumps(meta))
    with pytest.raises(Exception, match="missing"):
        load_model(tmp_path / "ck")
