"""GGUF export (z2all export-gguf) and load_gguf: weights, the q/k permutation, dtypes, tokenizer metadata."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from standin_tokenizer import tiny_model_config

from zero2all.model.io import save_model
from zero2all.model.z2all import build_model
from zero2all.tokenizer import CHAT_TEMPLATE, load_tokenizer, train_tokenizer

gguf = pytest.importorskip("gguf")

from zero2all.model import gguf as zg  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and they've got 12345 reasons.",
    "def forward(self, x):\n\tif x is None:\n\t\treturn 0\n        y = x ** 2  # comment\n    return y\n",
    "我们今天去北京吃烤鸭，然后参观故宫。机器学习和深度学习是人工智能的重要分支。",
    "emoji 😀👍🏽 mixed: Hello世界 Привет",
]
PROBES = TEXTS + ["   leading spaces, trailing   \n\n\t\t \r\n  runs   ",
                  "specials as text: <|im_start|>user<|im_end|>", "", "a", "\u2581 meta symbol and <0x41> lookalike"]
ASCII_PROBES = [TEXTS[0], TEXTS[1], "print(f'{x}: {y}')\nreturn self.value  # it's done\n"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    f = d / "c.jsonl"
    f.write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in TEXTS * 30) + "\n", encoding="utf-8")
    return [str(f)]


@pytest.fixture(scope="module", params=["hf", "spm"])
def ckpt(request, corpus, tmp_path_factory):
    """A tiny model (tied embeddings, grouped-query attention) saved with a tiny trained tokenizer."""
    d = tmp_path_factory.mktemp(f"gguf_{request.param}")
    tok = train_tokenizer(corpus, 384, d / "tok", backend=request.param, log=lambda *a: None)
    model = build_model(tiny_model_config(vocab_size=tok.vocab_size, tie_word_embeddings=True), seed=0).eval()
    save_model(model, d / "ck", tokenizer_dir=d / "tok")
    return request.param, d, model, tok


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0][0].float()


def _ids(tok):
    return tok.encode(TEXTS[0] + TEXTS[1])[:48]


def _reference_logits(t: dict, cfg, ids) -> torch.Tensor:
    """A forward pass in llama.cpp's convention, straight from the GGUF tensors: rope on ADJACENT pairs (2j, 2j+1),
    separate q/k/v and gate/up, nothing un-permuted. Equal logits prove the q/k permutation."""
    T, H, Hk, d, eps = len(ids), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    pos = torch.arange(T, dtype=torch.float64)
    if cfg.rope_scaling:
        pos = pos / cfg.rope_scaling["factor"]
    ang = pos[:, None] * cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    t = {k: v.double() for k, v in t.items()}

    def lin(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    def rope(v, h):
        v = v.view(T, h, d // 2, 2)
        a, b = v[..., 0], v[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).view(T, h, d)

    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    x = t["token_embd.weight"][torch.tensor(ids)]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        h = rms(x, t[b + "attn_norm.weight"])
        q, k = rope(lin(h, b + "attn_q"), H), rope(lin(h, b + "attn_k"), Hk)
        v = lin(h, b + "attn_v").view(T, Hk, d)
        k, v = k.repeat_interleave(H // Hk, dim=1), v.repeat_interleave(H // Hk, dim=1)
        att = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + lin(torch.einsum("hts,shd->thd", att, v).reshape(T, H * d), b + "attn_output")
        h = rms(x, t[b + "ffn_norm.weight"])
        x = x + lin(F.silu(lin(h, b + "ffn_gate")) * lin(h, b + "ffn_up"), b + "ffn_down")
    x = rms(x, t["output_norm.weight"])
    return (x @ t.get("output.weight", t["token_embd.weight"]).T).float()


def test_permutation_is_its_own_inverse_pair():
    w = torch.arange(4 * 6 * 3, dtype=torch.float32).view(24, 3)
    p = zg.permute_rope_rows(w, 4)
    assert p[:6, 0].tolist() == [w[0, 0], w[3, 0], w[1, 0], w[4, 0], w[2, 0], w[5, 0]]  # head 0: j, j + d/2
    torch.testing.assert_close(zg.unpermute_rope_rows(p, 4), w, rtol=0, atol=0)


def test_f32_export_round_trip_metadata_and_tokenizer(ckpt, tmp_path):
    backend, d, model, tok = ckpt
    out = zg.export_gguf(d / "ck", tmp_path / "m.gguf", dtype="f32", log=lambda m: None)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temporary left beside it
    r = gguf.GGUFReader(str(out))
    f = zg._Fields(r, str(out))
    cfg = model.cfg
    assert f.need("general.architecture") == "llama"
    assert f.need("llama.context_length") == cfg.max_seq_len and f.need("llama.embedding_length") == cfg.hidden_dim
    assert f.need("llama.block_count") == cfg.n_layers and f.need("llama.feed_forward_length") == 96
    assert (f.need("llama.attention.head_count"), f.need("llama.attention.head_count_kv")) == (4, 2)
    assert f.need("llama.rope.freq_base") == cfg.rope_theta
    assert f.need("llama.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.rms_norm_eps)
    assert f.need("llama.vocab_size") == tok.vocab_size and f.need("general.file_type") == 0
    names = {t.name for t in r.tensors}
    assert "output.weight" not in names and {"token_embd.weight", "output_norm.weight", "blk.1.attn_q.weight",
                                             "blk.1.attn_k.weight", "blk.1.attn_v.weight", "blk.1.ffn_gate.weight",
                                             "blk.1.ffn_up.weight", "blk.1.ffn_down.weight", "blk.1.attn_norm.weight",
                                             "blk.1.ffn_norm.weight", "blk.1.attn_output.weight"} <= names

    # weights: our model rebuilt from the file gives the same logits; so does llama.cpp's convention
    back, tok2 = zg.load_gguf(out)
    ids = _ids(tok)
    ref = _logits(model, ids)
    assert (_logits(back, ids) - ref).abs().max().item() <= 1e-6
    tensors = zg.read_gguf_tensors(r, str(out))
    assert (_reference_logits(tensors, cfg, ids) - ref).abs().max().item() <= 1e-5

    # tokenizer: the metadata reproduces the vocabulary, merges / scores, specials and the chat template
    raw = json.loads(tok.tokenizer_json)
    tokens = f.need("tokenizer.ggml.tokens")
    assert len(tokens) == tok.vocab_size and all(tok.token_to_id(s) == i for i, s in enumerate(tokens))
    types = f.need("tokenizer.ggml.token_type")
    assert {i for i, t in enumerate(types) if t == zg.CONTROL} == set(tok.special_ids.values())
    if backend == "hf":
        assert f.need("tokenizer.ggml.model") == "gpt2" and f.need("tokenizer.ggml.pre") == "llama-bpe"
        want = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
        assert f.need("tokenizer.ggml.merges") == want and len(want) > 0
    else:
        assert f.need("tokenizer.ggml.model") == "llama" and f.need("tokenizer.ggml.add_space_prefix") is False
        assert types[0] == zg.UNKNOWN and types[tokens.index("<0x41>")] == zg.BYTE
        assert len(f.need("tokenizer.ggml.scores")) == len(tokens)
    assert f.need("tokenizer.ggml.eos_token_id") == tok.eos_id
    assert f.need("tokenizer.ggml.eot_token_id") == tok.im_end_id
    assert f.need("tokenizer.ggml.padding_token_id") == tok.pad_id
    assert f.need("tokenizer.ggml.add_bos_token") is False
    assert f.need("tokenizer.chat_template") == CHAT_TEMPLATE
    assert tok2.special_ids == tok.special_ids and tok2.eos_id == tok.eos_id and tok2.pad_id == tok.pad_id
    for s in PROBES:
        assert tok2.encode(s) == tok.encode(s), s
        assert tok2.decode(tok2.encode(s)) == s
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <|im_end|>"}]
    assert tok2.apply_chat_template(chat, add_generation_prompt=True) == \
        tok.apply_chat_template(chat, add_generation_prompt=True)
    if backend == "hf":  # what llama.cpp runs (the "llama-bpe" regex) agrees with ours on ASCII text
        plain = zg.tokenizer_from_gguf(r, str(out), pretokenize_regex=zg.LLAMA_BPE_REGEX)
        for s in ASCII_PROBES:
            assert plain.encode(s) == tok.encode(s), s


@pytest.mark.parametrize("dtype,weight_bound,logit_bound", [("f16", 2.0 ** -11, 2e-3), ("bf16", 2.0 ** -8, 1e-2),
                                                             ("q8_0", None, 3e-2)])
def test_lower_precision_exports(ckpt, tmp_path, dtype, weight_bound, logit_bound):
    """f16 / bf16: every matrix entry within its rounding (relative 2^-11 / 2^-8, f16 subnormals 2^-25); q8_0:
    within one quantisation step (block max / 127) per block of 32. Logits: max |diff| <= bound * max |logits|.
    Norms stay float32."""
    backend, d, model, tok = ckpt
    if backend == "spm" and dtype != "q8_0":
        pytest.skip("the weights do not depend on the tokenizer backend")
    out = zg.export_gguf(d / "ck", tmp_path / f"m-{dtype}.gguf", dtype=dtype, log=lambda m: None)
    r = gguf.GGUFReader(str(out))
    code = {"f16": 1, "bf16": 32, "q8_0": 7}[dtype]
    assert zg._Fields(r, str(out)).need("general.file_type") == code
    kinds = {t.name: t.tensor_type.name for t in r.tensors}
    assert kinds["output_norm.weight"] == "F32" and kinds["blk.0.attn_q.weight"] == dtype.upper()
    got = zg.read_gguf_tensors(r, str(out))
    for name, w in zg.gguf_state_dict(model, model.cfg).items():
        if w.dim() == 1:
            assert torch.equal(got[name], w)
        elif weight_bound is not None:
            assert ((got[name] - w).abs() <= w.abs() * weight_bound + 2.0 ** -25).all(), name  # + f16 subnormals
        else:
            blocks, err = w.reshape(-1, 32), (got[name] - w).reshape(-1, 32)
            assert (err.abs() <= blocks.abs().amax(-1, keepdim=True) / 127 + 1e-12).all(), name
    back, _ = zg.load_gguf(out)
    ids = _ids(tok)
    ref = _logits(model, ids)
    assert (_logits(back, ids) - ref).abs().max().item() <= logit_bound * ref.abs().max().item()


def test_untied_bias_linear_rope_round_trip(ckpt, tmp_path):
    """Separate output matrix, attention biases, linear rope scaling, one kv head, head_dim 12."""
    backend, d, _, tok = ckpt
    if backend != "hf":
        pytest.skip("architecture variants do not depend on the tokenizer backend")
    cfg = tiny_model_config(vocab_size=tok.vocab_size, hidden_dim=48, n_heads=4, n_kv_heads=1, intermediate_size=80,
                            attention_bias=True, rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5000.0)
    model = build_model(cfg, seed=1).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.qkv_proj.bias.normal_(0, 0.1)
    save_model(model, tmp_path / "ck", tokenizer_dir=d / "tok")
    out = zg.export_gguf(tmp_path / "ck", tmp_path / "m.gguf", dtype="q8_0", log=lambda m: None)  # rows of 48, 80:
    r = gguf.GGUFReader(str(out))  # not multiples of 32, so the matrices fall back to f16
    f = zg._Fields(r, str(out))
    assert f.need("llama.rope.scaling.type") == "linear" and f.need("llama.rope.scaling.factor") == 2.0
    assert {t.name: t.tensor_type.name for t in r.tensors}["blk.0.ffn_down.weight"] == "F16"
    out = zg.export_gguf(tmp_path / "ck", tmp_path / "m.gguf", dtype="f32", log=lambda m: None)
    r = gguf.GGUFReader(str(out))
    assert "output.weight" in {t.name for t in r.tensors} and "blk.0.attn_q.bias" in {t.name for t in r.tensors}
    back, _ = zg.load_gguf(out)
    assert back.cfg.rope_scaling == cfg.rope_scaling and back.cfg.attention_bias
    ids = _ids(tok)
    ref = _logits(model, ids)
    assert (_logits(back, ids) - ref).abs().max().item() <= 1e-6
    tensors = zg.read_gguf_tensors(r, str(out))
    assert (_reference_logits(tensors, back.cfg, ids) - ref).abs().max().item() <= 1e-5


def test_cli_and_errors(ckpt, tmp_path, capsys):
    from zero2all.cli import main

    backend, d, model, tok = ckpt
    if backend != "hf":
        pytest.skip("once is enough")
    out = tmp_path / "cli.gguf"
    assert main(["export-gguf", "--ckpt", str(d / "ck"), "--out", str(out), "--dtype", "q8_0"]) == 0
    assert "wrote" in capsys.readouterr().out and out.exists()
    (tmp_path / "notok").mkdir()
    assert main(["export-gguf", "--ckpt", str(d / "ck"), "--out", str(out), "--tokenizer", str(tmp_path / "notok"),
                 "--overwrite"]) == 2
    assert str(tmp_path / "notok") in capsys.readouterr().err
    save_model(model, tmp_path / "bare")  # no tokenizer files
    assert main(["export-gguf", "--ckpt", str(tmp_path / "bare"), "--out", str(tmp_path / "x.gguf")]) == 2
    assert "tokenizer.json" in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        zg.load_gguf(tmp_path / "nope.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(Exception, match="bad.gguf"):
        zg.load_gguf(tmp_path / "bad.gguf")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert load_tokenizer(d / "tok").hash == tok.hash


def test_missing_gguf_package_is_one_line(ckpt, tmp_path, capsys, monkeypatch):
    """Without the optional package: exit 2 and one line naming the install, no traceback, no file."""
    import sys

    from zero2all.cli import main

    backend, d, _, _ = ckpt
    if backend != "hf":
        pytest.skip("once is enough")
    monkeypatch.setitem(sys.modules, "gguf", None)    # `import gguf` now raises ImportError
    assert main(["export-gguf", "--ckpt", str(d / "ck"), "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'zero2all[gguf]'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.gguf").exists()
