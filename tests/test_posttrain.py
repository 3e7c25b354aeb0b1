"""Post-training on the shared trainer: SFT (full and LoRA, packed and padded, pretokenized shards), exact resume,
DPO with a frozen reference or precomputed reference log-probs, and the commands."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from zero2all.cli import main
from zero2all.config import ConfigError, ModelConfig, OpsConfig
from zero2all.data.chat import SFTDataset, load_dpo_samples
from zero2all.data.instructions import docstring_records, write_jsonl
from zero2all.data.sft_shards import SFTShardDataset, SFTShardError, prepare_sft
from zero2all.model.io import load_model, save_model
from zero2all.model.z2all import build_model
from zero2all.tokenizer import load_tokenizer, train_tokenizer
from zero2all.train.posttrain import dpo, posttrain_config, sft

SOURCE = '''
def read_config(path, strict=False):
    """Read a configuration file and return its sections as a dictionary."""

def write_config(path, sections):
    """Write the sections back to a configuration file, replacing it."""

def parse_size(text):
    """Parse a size such as 10k or 3M into a number of bytes."""

def format_size(n):
    """Format a number of bytes as a short human-readable string."""

class Cache:
    """A small least-recently-used cache with a fixed capacity."""

    def get(self, key, default=None):
        """Return the cached value of key, or default when it is missing."""

    def put(self, key, value):
        """Store value under key, evicting the oldest entry when full."""

def split_words(line):
    """Split a line into words, ignoring repeated whitespace."""

def join_words(words, sep=' '):
    """Join words into one line with the given separator."""

def count_lines(path):
    """Count the lines of a text file without reading it whole."""
'''


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tokenizer, an instruction set, preference pairs and two small 'pretrained' checkpoints."""
    root = tmp_path_factory.mktemp("post")
    records = docstring_records(SOURCE, "toolbox", min_chars=10)
    assert len(records) == 10
    sft_file = write_jsonl(records, root / "sft.jsonl")
    (root / "corpus.txt").write_text(SOURCE * 3 + "\n".join(r["instruction"] + " " + r["output"] for r in records))
    tok = train_tokenizer([str(root / "corpus.txt")], 384, root / "tok", log=lambda *a: None)
    pairs = [{"prompt": r["instruction"], "chosen": r["output"], "rejected": records[(i + 3) % len(records)]["output"]}
             for i, r in enumerate(records[:8])]
    pairs.append({"conversations": [{"role": "system", "content": "Answer briefly."},
                                    {"role": "user", "content": "What does split_words do?"}],
                  "chosen": "It splits a line into words.", "rejected": "It counts lines."})
    dpo_file = root / "pairs.jsonl"
    dpo_file.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_dim=32, intermediate_size=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, max_seq_len=96, ops=OpsConfig.plain())
    inits = []
    for seed in (0, 1):
        model = build_model(cfg, seed=seed)
        inits.append(save_model(model, root / f"init{seed}", tokenizer_dir=root / "tok"))
    return {"root": root, "tok": tok, "sft": sft_file, "dpo": dpo_file, "init": inits[0], "other": inits[1],
            "records": records}


def run_overrides(out, *extra):
    return [f"train.out_dir='{out}'", "train.device='cpu'", "train.precision='fp32'", "train.tensorboard=false",
            "train.log_every=0", "train.eval_every=0", "train.ckpt_every=0", "train.num_samples=0",
            "train.warmup_steps=2", "train.lr=3e-3", "train.min_lr=3e-4", "train.micro_batch_size=4",
            *extra]


def sft_cfg(world, out, *extra):
    return posttrain_config("sft", None, [f"post.init='{world['init']}'", f"post.data=['{world['sft']}']",
                                          *run_overrides(out, *extra)])


def train_losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


# ------------------------------------------------------------------------------------------------------ SFT


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_sft_loss_falls_and_final_model_loads(world, tmp_path, packing):
    out = tmp_path / "run"
    ask = "Write the docstring of the function `parse_size(text)` in module `toolbox`."
    summary = sft(sft_cfg(world, out, "train.max_steps=30", "train.lr=1e-2", f"post.packing='{packing}'",
                          "train.num_samples=1", f"train.sample_prompts=['{ask}']", "train.sample_new_tokens=6"),
                  show_progress=False)
    samples = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "sample"]
    assert [s["prompt"] for s in samples] == [ask]
    from types import SimpleNamespace

    from zero2all.train.posttrain import PostTrainer

    cfg = sft_cfg(world, out, "train.num_samples=1", f"train.sample_prompts=['{ask}']")
    [(text, ids)] = PostTrainer._sample_prompts(SimpleNamespace(tcfg=cfg.train, tokenizer=world["tok"]))
    assert ids == world["tok"].apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)
    losses = [r["loss"] for r in train_losses(out)]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert all("train_label_tokens" in r for r in train_losses(out))
    model = load_model(out / "final")
    assert load_tokenizer(out / "final").hash == world["tok"].hash
    # the final model scores the training answers better than the initial one
    init = load_model(world["init"])
    ds = SFTDataset.from_files([world["sft"]], world["tok"], 95, mode="pad")
    batch = ds.batch(range(len(ds)))
    with torch.no_grad():
        before = init(batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])[1]
        after = model(batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])[1]
    assert float(after) < 0.8 * float(before)
    assert summary["final"] == str(out / "final")


def test_sft_labels_are_assistant_tokens_only(world):
    """The loss counts exactly the rendered assistant answers (+ <|im_end|>), nothing of the prompts."""
    tok = world["tok"]
    ds = SFTDataset.from_files([world["sft"]], tok, 95, mode="pad")
    for i, rec in enumerate(world["records"]):
        row = ds[i]
        learned = row["labels"][row["labels"] != -100].tolist()
        assert learned == tok.encode(rec["output"]) + [tok.im_end_id]


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_sft_resume_is_bit_exact(world, tmp_path, monkeypatch, lora_rank):
    """6 updates straight == 3 updates, an interrupted process, then --resume auto for the rest (dropout on, so
    the RNG states must be restored too)."""
    from zero2all.train.posttrain import PostTrainer

    extra = ["train.max_steps=6", "train.ckpt_every=3", "train.resume='auto'", "model.dropout1=0.1",
             "train.grad_accum_steps=2", "train.micro_batch_size=2", "train.eval_every=3", "post.valid_fraction=0.2",
             f"post.lora_rank={lora_rank}", "post.lora_dropout=0.1"]
    straight = tmp_path / "straight"
    sft(sft_cfg(world, straight, *extra), show_progress=False)

    resumed = tmp_path / "resumed"
    original = PostTrainer.train_step

    def dies_after_3(self):
        if self.step == 4:
            raise KeyboardInterrupt("simulated kill")
        return original(self)

    monkeypatch.setattr(PostTrainer, "train_step", dies_after_3)
    with pytest.raises(KeyboardInterrupt):
        sft(sft_cfg(world, resumed, *extra), show_progress=False)
    monkeypatch.setattr(PostTrainer, "train_step", original)
    assert (resumed / "ckpt-000003").is_dir() and not (resumed / "final").exists()
    sft(sft_cfg(world, resumed, *extra), show_progress=False)

    a, b = train_losses(straight), train_losses(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    wa, wb = load_file(str(straight / "final" / "model.safetensors")), load_file(str(resumed / "final" /
                                                                                        "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    if lora_rank:
        aa = load_file(str(straight / "final" / "adapter" / "adapter_model.safetensors"))
        ab = load_file(str(resumed / "final" / "adapter" / "adapter_model.safetensors"))
        assert aa.keys() == ab.keys() and all(torch.equal(aa[k], ab[k]) for k in aa)


def test_lora_sft_trains_only_the_adapters(world, tmp_path):
    from zero2all import checkpoint as ckpt_io
    from zero2all.infer.generate import load_for_inference

    out = tmp_path / "lora"
    sft(sft_cfg(world, out, "train.max_steps=8", "train.ckpt_every=4", "post.lora_rank=4", "post.lora_alpha=8",
                "post.lora_targets=['qkv_proj', 'down_proj']"), show_progress=False)
    base = load_file(str(world["init"] / "model.safetensors"))
    final = load_file(str(out / "final" / "model.safetensors"))
    assert base.keys() == final.keys() and all(torch.equal(base[k], final[k]) for k in base)  # base untouched
    # the training checkpoint: full state with exactly the adapters in the optimizer, and a PEFT adapter dir
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(out / "ckpt-000008", tmp_path / "ckpt8.pt")
    state = torch.load(tmp_path / "ckpt8.pt", weights_only=False)
    lora_keys = [k for k in state["model"] if k.endswith(("lora_A", "lora_B"))]
    assert len(lora_keys) == 2 * 2 * 2  # 2 layers x 2 targets x (A, B)
    assert sorted(state["optim"]["state"]) == sorted(lora_keys)  # exactly the adapters in the optimizer
    assert ckpt_io.verify(out / "ckpt-000008") == []
    assert (out / "ckpt-000008" / "adapter" / "adapter_config.json").exists()
    cfg = json.loads((out / "final" / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj",
                                                                                       "down_proj"}
    adapter = load_file(str(out / "final" / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())  # B left zero: trained
    # merged on load: differs from the base, and equals what the adapter directory alone gives (its base: init)
    merged = load_model(out / "final")
    alone, tok = load_for_inference(str(out / "ckpt-000008" / "adapter"))
    x = torch.tensor([world["tok"].encode("def read_config(path):")])
    with torch.no_grad():
        assert not torch.allclose(merged(x)[0], load_model(world["init"])(x)[0])
        torch.testing.assert_close(merged(x)[0], alone(x)[0], rtol=0, atol=0)
    assert tok.hash == world["tok"].hash
    # the training checkpoint itself (base + adapter tensors, and adapter/): merged on load, the same model
    import zero2all

    from_ckpt = zero2all.load_model(str(out / "ckpt-000008"))
    with torch.no_grad():
        torch.testing.assert_close(from_ckpt(x)[0], merged(x)[0], rtol=0, atol=0)
    # without merging, the base weights alone (what export-hf writes without --merge-lora)
    base_only = load_model(out / "ckpt-000008", merge_lora=False)
    with torch.no_grad():
        torch.testing.assert_close(base_only(x)[0], load_model(world["init"])(x)[0], rtol=0, atol=0)
    # a LoRA run's final/ as the starting point of the next stage: base + adapter, merged
    from zero2all.train.posttrain import load_pretrained

    start = load_pretrained(out / "final", merged.cfg, "cpu").state_dict()
    assert all(torch.equal(start[k], v) for k, v in merged.state_dict().items())


def test_init_from_an_hf_directory(world, tmp_path):
    from zero2all.model.io import export_hf, read_model_config
    from zero2all.train.posttrain import load_pretrained

    hf = export_hf(world["init"], tmp_path / "hf")
    ours = load_file(str(world["init"] / "model.safetensors"))
    theirs = load_pretrained(hf, read_model_config(hf), "cpu").state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    out = tmp_path / "run"
    cfg = posttrain_config("sft", None, [f"post.init='{hf}'", f"post.data=['{world['sft']}']",
                                         *run_overrides(out, "train.max_steps=2")])
    sft(cfg, show_progress=False)
    assert load_tokenizer(out / "final").hash == world["tok"].hash  # the tokenizer came along from the HF dir


# ------------------------------------------------------------------------------------------ pretokenized SFT


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_prepared_shards_give_the_same_rows_as_in_memory(world, tmp_path, mode):
    tok = world["tok"]
    meta = prepare_sft([world["sft"]], world["root"] / "tok", tmp_path / "shards", log=lambda *a: None)
    assert meta["splits"]["train"]["samples"] == len(world["records"])
    seq_len = 40  # shorter than several samples: truncation and dropping must match too
    mem = SFTDataset.from_files([world["sft"]], tok, seq_len, mode=mode)
    disk = SFTShardDataset(tmp_path / "shards", seq_len, tok.pad_id, mode, tokenizer=tok)
    assert len(mem) == len(disk) > 0
    assert disk.stats.truncated == mem.stats.truncated and disk.stats.dropped_no_labels == mem.stats.dropped_no_labels
    a, b = mem.batch(range(len(mem))), disk.batch(range(len(disk)))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # rank split as in memory
    r1 = SFTShardDataset(tmp_path / "shards", seq_len, tok.pad_id, mode, rank=1, world_size=2)
    assert torch.equal(r1.batch([0])["input_ids"], SFTDataset.from_files([world["sft"]], tok, seq_len, mode=mode,
                                                                        rank=1, world_size=2).batch([0])["input_ids"])


def test_prepare_sft_checks_tokenizer_and_input(world, tmp_path):
    out = tmp_path / "shards"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(world["records"][0]) + "\n" + '{"instruction": "x"}\n' + "not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: instruction record needs a string 'output'"):
        prepare_sft([bad], world["root"] / "tok", out, log=lambda *a: None)
    assert not out.exists() and not list(tmp_path.glob(".shards*"))  # nothing half-written is left
    meta = prepare_sft([bad], world["root"] / "tok", out, on_error="skip", log=lambda *a: None)
    assert meta["read"]["skipped"] == 2 and meta["splits"]["train"]["samples"] == 1
    with pytest.raises(ValueError, match="holds a previous output of `z2all prepare-sft`: pass --overwrite"):
        prepare_sft([bad], world["root"] / "tok", out, log=lambda *a: None)
    other = train_tokenizer([str(world["root"] / "corpus.txt")], 448, None, log=lambda *a: None)
    with pytest.raises(SFTShardError, match="re-run `z2all prepare-sft`"):
        SFTShardDataset(out, 64, 0, tokenizer=other)


def test_sft_from_prepared_shards_via_cli(world, tmp_path, capsys):
    shards = tmp_path / "shards"
    assert main(["prepare-sft", "--input", str(world["sft"]), "--tokenizer", str(world["root"] / "tok"),
                 "--out", str(shards), "--valid-fraction", "0.3", "--workers", "2"]) == 0
    meta = json.loads((shards / "meta.json").read_text())
    assert meta["splits"]["valid"]["samples"] > 0
    assert meta["splits"]["train"]["samples"] + meta["splits"]["valid"]["samples"] == 10
    one = prepare_sft([world["sft"]], world["root"] / "tok", tmp_path / "one", valid_fraction=0.3, log=lambda *a: None)
    assert one["splits"] == meta["splits"]
    for name in ("train.tokens.bin", "train.labels.bin", "valid.tokens.bin", "valid.labels.bin"):
        assert (shards / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name  # any worker count
    out = tmp_path / "run"
    args = ["sft", "--init", str(world["init"]), "--data", str(shards), "--out", str(out), "--device", "cpu",
            "--no-progress", *run_overrides(out, "train.max_steps=3", "train.eval_every=3", "train.eval_batches=2")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "packed rows" in printed and "val loss" in printed
    assert (out / "final" / "model.safetensors").exists()


def test_sft_errors_name_the_problem(world, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(world["records"][0]) + "\n" + '{"conversations": [{"role": "bot", "content": "x"}]}\n')
    args = ["sft", "--init", str(world["init"]), "--data", str(bad), "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(args) == 2
    assert "bad.jsonl:2: conversations[0].role 'bot'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="model.hidden_dim: comes from the --init checkpoint"):
        sft_cfg(world, tmp_path / "o", "model.hidden_dim=64")
    with pytest.raises(ConfigError, match="post.packing"):
        sft_cfg(world, tmp_path / "o", "post.packing='squeeze'")
    # resuming with other post-training settings is refused, naming the field
    out = tmp_path / "r"
    sft(sft_cfg(world, out, "train.max_steps=2", "train.ckpt_every=2"), show_progress=False)
    with pytest.raises(ConfigError, match="post.packing: 'pack' in the checkpoint, 'pad' now"):
        sft(sft_cfg(world, out, "train.max_steps=4", "train.resume='auto'", "post.packing='pad'"),
            show_progress=False)


# ------------------------------------------------------------------------------------------------------ DPO


def answer_logprob(model, ids, labels):
    """Sum of log p(token) over labelled positions, one sequence at a time (the reference computation)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0][0].double()
    logp = torch.log_softmax(logits, -1)
    return sum(float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if labels[t] != -100)


def dpo_cfg(world, out, *extra):
    return posttrain_config("dpo", None, [f"post.init='{world['init']}'", f"post.data=['{world['dpo']}']",
                                          *run_overrides(out, *extra)])


def test_dpo_reference_modes_agree_and_match_the_formula(world, tmp_path):
    """A reference other than the initial policy (so the step-0 loss is not log 2): the frozen-model and the
    precomputed modes give the same step-0 loss, and it equals the DPO formula computed pair by pair."""
    beta = 0.5
    extra = ["train.max_steps=3", "train.micro_batch_size=9", f"post.beta={beta}", f"post.ref='{world['other']}'",
             "train.lr=1e-3"]
    frozen, pre = tmp_path / "frozen", tmp_path / "pre"
    dpo(dpo_cfg(world, frozen, *extra), show_progress=False)
    dpo(dpo_cfg(world, pre, *extra, "post.precompute_ref=true"), show_progress=False)
    a, b = train_losses(frozen), train_losses(pre)
    assert len(a) == len(b) == 3
    torch.testing.assert_close(torch.tensor([r["loss"] for r in a]), torch.tensor([r["loss"] for r in b]),
                               rtol=1e-5, atol=1e-6)
    policy, ref = load_model(world["init"]), load_model(world["other"])
    pairs, _ = load_dpo_samples([world["dpo"]], world["tok"], max_len=97)
    losses = []
    for p in pairs:
        margin = beta * ((answer_logprob(policy, p.chosen.input_ids, p.chosen.labels)
                          - answer_logprob(ref, p.chosen.input_ids, p.chosen.labels))
                         - (answer_logprob(policy, p.rejected.input_ids, p.rejected.labels)
                            - answer_logprob(ref, p.rejected.input_ids, p.rejected.labels)))
        losses.append(-math.log(1 / (1 + math.exp(-margin))))
    expected = sum(losses) / len(losses)
    assert abs(expected - math.log(2)) > 1e-3
    assert a[0]["loss"] == pytest.approx(expected, rel=1e-4)
    for key in ("train_rewards/margin", "train_rewards/accuracy", "train_rewards/chosen", "train_rewards/rejected"):
        assert key in a[0] and key in b[0]
    assert (pre / "reference_logprobs.pt").exists()


def test_eval_report_follows_the_objective(world, tmp_path, capsys):
    """DPO's loss is no per-token cross-entropy: its eval line and record carry the loss and the reward accuracy
    and margin, no perplexity; SFT's keep the perplexity (exp of the mean loss)."""
    run = ["train.max_steps=2", "train.eval_every=2", "train.eval_batches=1", "post.valid_fraction=0.3",
           "train.micro_batch_size=3"]
    dpo(dpo_cfg(world, tmp_path / "dpo", *run, f"post.ref='{world['other']}'"), show_progress=False)
    sft(sft_cfg(world, tmp_path / "sft", *run), show_progress=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    assert len(lines) == 4  # before training and at step 2, for each run
    dpo_lines, sft_lines = lines[:2], lines[2:]
    for line in dpo_lines:
        assert "perplexity" not in line and "| rewards/accuracy " in line and "| rewards/margin " in line, line
    assert all("| perplexity " in line and "rewards" not in line for line in sft_lines), sft_lines
    dpo_eval = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()
                if json.loads(x)["kind"] == "eval"]
    for rec in dpo_eval:
        assert "ppl" not in rec and 0.0 <= rec["rewards/accuracy"] <= 1.0
        assert rec["rewards/margin"] == pytest.approx(rec["rewards/chosen"] - rec["rewards/rejected"], abs=1e-5)
    assert "perplexity" not in (tmp_path / "dpo" / "report.md").read_text()
    sft_eval = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
                if json.loads(x)["kind"] == "eval"]
    assert sft_eval[-1]["ppl"] == pytest.approx(math.exp(sft_eval[-1]["loss"]))
    assert "perplexity" in (tmp_path / "sft" / "report.md").read_text()


def test_prepared_dpo_pairs_equal_in_memory_and_train_the_same(world, tmp_path, capsys):
    """`z2all prepare-dpo` shards give the same batches as the jsonl path (truncation, dropping and the rank split
    included), the DPO run from the directory logs the same losses as from the jsonl, and the kinds are checked."""
    from zero2all.data.chat import DPODataset
    from zero2all.data.sft_shards import DPOShardDataset

    tok, shards = world["tok"], tmp_path / "dpo-shards"
    assert main(["prepare-dpo", "--input", str(world["dpo"]), "--tokenizer", str(world["root"] / "tok"),
                 "--out", str(shards)]) == 0
    meta = json.loads((shards / "meta.json").read_text())
    assert meta["kind"] == "dpo" and meta["splits"]["train"]["pairs"] * 2 == meta["splits"]["train"]["samples"]
    for seq_len, rank, world_size in ((96, 0, 1), (50, 0, 1), (96, 1, 2)):  # 50: pairs truncated or dropped
        mem = DPODataset.from_files([world["dpo"]], tok, seq_len, rank=rank, world_size=world_size)
        disk = DPOShardDataset(shards, seq_len, mem.pad_id, rank=rank, world_size=world_size, tokenizer=tok)
        assert len(disk) == len(mem) > 0, seq_len
        if world_size == 1:
            assert (disk.stats.truncated, disk.stats.dropped_no_labels) == (mem.stats.truncated,
                                                                           mem.stats.dropped_no_labels)
            assert seq_len == 96 or (mem.stats.truncated and mem.stats.dropped_no_labels)  # the edge is covered
        a, b = mem.batch(range(len(mem))), disk.batch(range(len(disk)))
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert [p.chosen.input_ids for p in disk.pairs[1:3]] == [p.chosen.input_ids for p in mem.pairs[1:3]]
    extra = ["train.max_steps=2", "train.micro_batch_size=3", "post.precompute_ref=true"]
    dpo(dpo_cfg(world, tmp_path / "jsonl", *extra), show_progress=False)
    dpo(posttrain_config("dpo", None, [f"post.init='{world['init']}'", f"post.data=['{shards}']",
                                       *run_overrides(tmp_path / "shards", *extra)]), show_progress=False)
    a, b = train_losses(tmp_path / "jsonl"), train_losses(tmp_path / "shards")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    # an SFT directory is not DPO data, and the other way round
    sft_dir = tmp_path / "sft-shards"
    prepare_sft([world["sft"]], world["root"] / "tok", sft_dir, log=lambda *x: None)
    with pytest.raises(SFTShardError, match="needs DPO data"):
        DPOShardDataset(sft_dir, 64, 0)
    with pytest.raises(SFTShardError, match="needs SFT data"):
        SFTShardDataset(shards, 64, 0)
    with pytest.raises(ConfigError, match="not a `z2all prepare-dpo` output"):
        dpo(posttrain_config("dpo", None, [f"post.init='{world['init']}'", f"post.data=['{sft_dir}']",
                                           *run_overrides(tmp_path / "x", *extra)]), show_progress=False)


def test_dpo_learns_the_preference_with_lora_and_cli(world, tmp_path, capsys):
    out = tmp_path / "dpo"
    args = ["dpo", "--init", str(world["init"]), "--data", str(world["dpo"]), "--out", str(out), "--beta", "0.5",
            "--precompute-ref", "--lora-rank", "4", "--no-progress",
            *run_overrides(out, "train.max_steps=12", "train.lr=1e-2", "train.micro_batch_size=3",
                           "train.log_every=6")]
    assert main(args) == 0
    recs = train_losses(out)
    assert recs[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # LoRA starts at the reference exactly
    assert recs[0]["train_rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    late = recs[-4:]
    assert sum(r["train_rewards/margin"] for r in late) > 0 and sum(r["loss"] for r in late) / 4 < math.log(2)
    step_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert step_lines and all("rewards/margin" in line and "rewards/accuracy" in line for line in step_lines)
    assert (out / "final" / "adapter" / "adapter_model.safetensors").exists()
