"""Prompt tuning and prefix tuning: PEFT loads our adapters on the HF export and gives our logits (fp32, 1e-5);
training moves only the virtual tokens; PEFT-trained adapters load into our model."""

import pytest
import torch
from standin_tokenizer import tiny_model_config

from zero2all.model.io import export_hf, save_model
from zero2all.model.prompt_tuning import PromptTuned, load_prompt_adapter, save_prompt_adapter
from zero2all.model.z2all import build_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("pt")
    cfg = tiny_model_config(n_kv_heads=2, tie_word_embeddings=False, max_seq_len=64)
    model = build_model(cfg, seed=0)
    save_model(model, root / "ours")
    hf_dir = export_hf(root / "ours", root / "hf")
    return root, model, hf_dir


@pytest.mark.parametrize("method", ["prompt", "prefix"])
def test_peft_loads_ours_and_gives_our_logits(exported, method):
    root, model, hf_dir = exported
    tuned = PromptTuned(model, 5, method, generator=torch.Generator().manual_seed(1)).eval()
    with torch.no_grad():  # well away from the initial values, so a wrong layout shows
        tuned.prompt_embeddings.mul_(3.0).add_(0.1)
    adapter = save_prompt_adapter(tuned, root / f"adapter-{method}", str(hf_dir))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    theirs_model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    tokens = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, _ = tuned(tokens)
        out = theirs_model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
    theirs = out[:, -tokens.size(1):]  # prompt tuning returns the virtual positions too
    V = model.cfg.vocab_size
    assert torch.allclose(ours[..., :V], theirs[..., :V], atol=1e-5, rtol=0), (ours - theirs)[..., :V].abs().max()
    # and back: the files load into our model with the same result
    back = load_prompt_adapter(model, adapter).eval()
    with torch.no_grad():
        assert torch.equal(back(tokens)[0], ours)


@pytest.mark.parametrize("method", ["prompt", "prefix"])
def test_training_moves_only_the_virtual_tokens(method):
    cfg = tiny_model_config(max_seq_len=32)
    model = build_model(cfg, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tuned = PromptTuned(model, 4, method, generator=torch.Generator().manual_seed(0))
    assert [n for n, p in tuned.named_parameters() if p.requires_grad] == ["prompt_embeddings"]
    opt = torch.optim.AdamW([tuned.prompt_embeddings], lr=3e-2)
    tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(3))
    targets = tokens.roll(-1, dims=1)
    losses = []
    for _ in range(12):
        _, loss = tuned(tokens, targets)
        losses.append(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0] - 0.02, losses
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_peft_trained_adapter_loads(exported, tmp_path):
    """An adapter made by peft itself (prefix tuning, GQA layout) gives PEFT's logits in our model."""
    root, model, hf_dir = exported
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    pm = peft.get_peft_model(base, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    with torch.no_grad():
        pm.prompt_encoder["default"].embedding.weight.normal_()
    pm.save_pretrained(str(tmp_path / "peft"))
    ours = load_prompt_adapter(model, tmp_path / "peft").eval()
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    pm.eval()
    with torch.no_grad():
        want = pm(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
        got, _ = ours(tokens)
    V = model.cfg.vocab_size
    assert torch.allclose(got[..., :V], want[..., :V], atol=1e-5, rtol=0)


def test_bad_adapter_is_refused(exported, tmp_path):
    root, model, hf_dir = exported
    tuned = PromptTuned(model, 2, "prefix")
    d = save_prompt_adapter(tuned, tmp_path / "a")
    other = build_model(tiny_model_config(n_layers=3), seed=0)
    with pytest.raises(ValueError, match="prompt_embeddings of shape"):
        load_prompt_adapter(other, d)


def test_sft_objective_trains_it_on_padded_rows_only():
    from standin_tokenizer import ByteTokenizer

    from zero2all.data.chat import SFTDataset, render_sft_record
    from zero2all.train.objectives import SFTObjective

    tok = ByteTokenizer()
    samples = [render_sft_record(tok, {"instruction": f"{i}+1", "output": str(i + 1)}) for i in range(6)]
    tuned = PromptTuned(build_model(tiny_model_config(max_seq_len=48), seed=0), 3, "prefix")
    padded = next(SFTDataset(samples, 24, tok.pad_id, "pad").iterator(4))
    loss, _ = SFTObjective().loss(tuned, padded)
    loss.backward()
    assert torch.isfinite(loss) and tuned.prompt_embeddings.grad is not None
    packed = next(SFTDataset(samples, 40, tok.pad_id, "pack").iterator(1))
    with pytest.raises(ValueError, match="packing=pad"):
        SFTObjective().loss(tuned, packed)


def test_sft_and_dpo_commands_with_prompt_and_prefix_tuning(tmp_path, capsys):
    """`z2all sft / dpo --prompt-tuning`: final/ keeps the base weights, final/prompt_adapter/ the tokens."""
    import json

    from zero2all.cli import main
    from zero2all.config import ModelConfig, OpsConfig
    from zero2all.model.io import load_model
    from zero2all.tokenizer import train_tokenizer
    from zero2all.train.rl_tasks import make_problems, preference_pairs, sft_records

    problems = make_problems(30, seed=0, max_value=5)
    sft_file, pairs_file = tmp_path / "sft.jsonl", tmp_path / "pairs.jsonl"
    sft_file.write_text("".join(json.dumps(r) + "\n" for r in sft_records(problems)))
    pairs_file.write_text("".join(json.dumps(r) + "\n" for r in preference_pairs(problems)))
    (tmp_path / "corpus.txt").write_text(sft_file.read_text() * 2)
    tok = train_tokenizer([str(tmp_path / "corpus.txt")], 384, tmp_path / "tok", log=lambda *a: None)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_dim=32, intermediate_size=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, max_seq_len=96, ops=OpsConfig.plain())
    init = save_model(build_model(cfg, seed=0), tmp_path / "init", tokenizer_dir=tmp_path / "tok")
    common = ["--init", str(init), "--device", "cpu", "--no-progress", "train.max_steps=2", "train.eval_every=0",
              "train.micro_batch_size=2", "train.tensorboard=false", "train.ckpt_every=0"]
    main(["sft", "--data", str(sft_file), "--out", str(tmp_path / "sft"), "--prompt-tuning", "prefix",
          "--num-virtual-tokens", "3", "--packing", "pad", *common])
    final = tmp_path / "sft" / "final"
    base = load_model(final)
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), load_model(init).state_dict().values()))
    tuned = load_prompt_adapter(base, final / "prompt_adapter")
    assert tuned.method == "prefix" and tuned.n == 3
    main(["dpo", "--data", str(pairs_file), "--out", str(tmp_path / "dpo"), "--prompt-tuning", "prompt", *common])
    assert load_prompt_adapter(load_model(init), tmp_path / "dpo" / "final" / "prompt_adapter").method == "prompt"
    capsys.readouterr()
    assert main(["sft", "--data", str(sft_file), "--out", str(tmp_path / "x"), "--prompt-tuning", "prompt",
                 *common]) == 2
    assert "pass --packing pad" in capsys.readouterr().err
