"""extend-tokenizer (English base + Chinese tokens), resize-vocab (old-token logits unchanged, here and in
transformers) and continued pretraining of the new rows only (train.trainable = new_embeddings)."""

import json
import random

import pytest
import torch

from zero2all.config import ModelConfig, OpsConfig
from zero2all.model.io import export_hf, load_model, save_model
from zero2all.model.z2all import build_model

transformers = pytest.importorskip("transformers")

WORDS = ("the model reads text and predicts the next token of every document it sees while a tokenizer splits "
         "words into pieces learned from a corpus of plain english sentences about weather cities and rivers").split()
HAN = ("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后"
       "多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些"
       "然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公")


def english(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)) + ".\n"


def chinese(rng, n_words):
    return "".join("".join(rng.choice(HAN) for _ in range(rng.randint(2, 4))) for _ in range(n_words)) + "。"


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """An English-only byte-level BPE and its extension by 2,000 tokens learned on Chinese text (CLI)."""
    from zero2all.cli import main
    from zero2all.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("vocab")
    rng = random.Random(0)
    en = write_jsonl(d / "en.jsonl", [english(rng, 80) for _ in range(200)])
    zh = write_jsonl(d / "zh.jsonl", [chinese(rng, 100) for _ in range(110)])
    train_tokenizer([str(en)], 1024, d / "base", log=lambda *a: None)
    assert main(["extend-tokenizer", "--base", str(d / "base"), "--input", str(zh), "--add", "2000",
                 "--out", str(d / "ext"), "--base-text", str(en)]) == 0
    return d, rng


def test_extended_tokenizer_compresses_chinese_and_keeps_english(toks):
    from zero2all.tokenizer import load_tokenizer

    d, _ = toks
    base, ext = load_tokenizer(d / "base"), load_tokenizer(d / "ext")
    report = ext.meta["extended"]
    assert report["added"] == 2000 and ext.vocab_size % 64 == 0
    rng = random.Random(123)  # fresh text, not the training corpus
    zh = [chinese(rng, 60) for _ in range(20)]
    en = [english(rng, 60) for _ in range(20)]
    n_base, n_ext = sum(len(base.encode(t)) for t in zh), sum(len(ext.encode(t)) for t in zh)
    assert n_base >= 1.5 * n_ext, (n_base, n_ext)
    assert report["heldout"]["bytes_per_token_after"] >= 1.5 * report["heldout"]["bytes_per_token_before"]
    # English: the base's encoding changes for at most 1 % of its tokens
    changed = total = 0
    for t in en:
        a, b = base.encode(t), ext.encode(t)
        total += len(a)
        changed += len(a) if len(a) != len(b) else sum(x != y for x, y in zip(a, b))
    assert changed <= 0.01 * total
    # old ids keep their tokens (special ones too), lossless, and AutoTokenizer agrees
    for i in range(base.n_ids):
        assert base.id_to_token(i) == ext.id_to_token(i)
    assert ext.special_ids.items() >= base.special_ids.items()
    auto = transformers.AutoTokenizer.from_pretrained(d / "ext")
    for t in zh[:3] + en[:3] + ["mixed 中文 text <|endoftext|> 😀"]:
        assert ext.decode(ext.encode(t)) == t
    for t in zh[:3] + en[:3]:
        assert auto(t, add_special_tokens=False).input_ids == ext.encode(t)


def tiny(vocab, tie=False):
    return ModelConfig(vocab_size=vocab, hidden_dim=64, intermediate_size=96, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=32, tie_word_embeddings=tie, ops=OpsConfig.plain())


@pytest.mark.parametrize("tie", [False, True])
def test_resize_keeps_old_token_logits(toks, tmp_path, tie):
    from zero2all.cli import main
    from zero2all.tokenizer import load_tokenizer

    d, rng = toks
    base, ext = load_tokenizer(d / "base"), load_tokenizer(d / "ext")
    model = build_model(tiny(base.vocab_size, tie), seed=2).eval()
    save_model(model, tmp_path / "ours", tokenizer_dir=d / "base")
    assert main(["resize-vocab", "--ckpt", str(tmp_path / "ours"), "--tokenizer", str(d / "ext"),
                 "--out", str(tmp_path / "big")]) == 0
    big = load_model(tmp_path / "big")
    assert big.cfg.padded_vocab_size == ext.vocab_size
    assert (tmp_path / "big" / "tokenizer.json").read_text() == (d / "ext" / "tokenizer.json").read_text()
    assert load_tokenizer(tmp_path / "big").hash == ext.hash
    ids = torch.tensor([[base.eos_id] + base.encode(english(rng, 12))[:30]])
    with torch.no_grad():
        ref = model(ids)[0]
        got = big(ids)[0]
    old = base.vocab_size
    torch.testing.assert_close(got[..., :old], ref, atol=1e-6, rtol=0)
    export_hf(tmp_path / "big", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs[..., :old], ref, atol=1e-6, rtol=0)
    # a new token's row is the mean of the rows of the pieces the old tokenizer splits it into
    new_id = old + 5
    pieces = base.model_piece_ids(ext.id_to_token(new_id))
    assert len(pieces) >= 2
    torch.testing.assert_close(big.embed_tokens.weight[new_id], model.embed_tokens.weight[pieces].mean(0))
    torch.testing.assert_close(big.lm_head.weight[new_id], model.lm_head.weight[pieces].mean(0))


def test_resize_refuses_to_drop_used_ids(toks, tmp_path, capsys):
    from zero2all.cli import main

    d, _ = toks
    model = build_model(tiny(2560), seed=2).eval()
    save_model(model, tmp_path / "ext-model", tokenizer_dir=d / "ext")
    assert main(["resize-vocab", "--ckpt", str(tmp_path / "ext-model"), "--tokenizer", str(d / "base"),
                 "--out", str(tmp_path / "small")]) == 2
    assert "drop ids" in capsys.readouterr().err and not (tmp_path / "small").exists()


def test_new_embeddings_trains_only_the_new_rows(toks, tmp_path):
    from zero2all.config import build_config
    from zero2all.model.resize import resize_vocab
    from zero2all.tokenizer import load_tokenizer
    from zero2all.train.trainer import pretrain

    d, _ = toks
    old = load_tokenizer(d / "base").vocab_size
    model = build_model(tiny(old), seed=2).eval()
    save_model(model, tmp_path / "ours", tokenizer_dir=d / "base")
    resize_vocab(tmp_path / "ours", d / "ext", tmp_path / "big", log=lambda *a: None)
    before = load_model(tmp_path / "big").state_dict()
    cfg = build_config("tiny", [f"train.init={tmp_path / 'big'}", "train.trainable=new_embeddings",
                                f"train.out_dir={tmp_path / 'run'}", "train.max_steps=3", "train.micro_batch_size=4",
                                "data.seq_len=32", "train.warmup_steps=1", "train.eval_every=1000",
                                "train.ckpt_every=1000", "train.num_samples=0", "train.tensorboard=false",
                                "train.device=cpu", "train.precision=fp32", "train.lr=0.01",
                                "model.ops.attention=naive"])
    pretrain(cfg, show_progress=False)
    after = load_model(tmp_path / "run" / "final").state_dict()
    for name, t in before.items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(after[name][:old], t[:old]), name
            assert not torch.equal(after[name][old:], t[old:]), name
        else:
            assert torch.equal(after[name], t), name


def test_sentencepiece_extension_compresses_chinese_and_keeps_english(tmp_path, capsys):
    """The SentencePiece (spm) backend: pieces learned on Chinese appended to the base's model proto."""
    import sentencepiece as spm

    from zero2all.cli import main
    from zero2all.tokenizer import load_tokenizer, train_tokenizer

    rng = random.Random(1)
    en = write_jsonl(tmp_path / "en.jsonl", [english(rng, 80) for _ in range(150)])
    zh = write_jsonl(tmp_path / "zh.jsonl", [chinese(rng, 100) for _ in range(110)])
    train_tokenizer([str(en)], 512, tmp_path / "base", backend="spm", log=lambda *a: None)
    assert main(["extend-tokenizer", "--base", str(tmp_path / "base"), "--input", str(zh), "--add", "600",
                 "--out", str(tmp_path / "ext"), "--base-text", str(en)]) == 0
    assert "added 600 tokens" in capsys.readouterr().out
    base, ext = load_tokenizer(tmp_path / "base"), load_tokenizer(tmp_path / "ext")
    assert ext.backend == "spm" and ext.meta["extended"]["added"] == 600 and ext.vocab_size % 64 == 0
    rng = random.Random(321)
    zh_texts = [chinese(rng, 60) for _ in range(20)]
    en_texts = [english(rng, 60) for _ in range(20)]
    n_base, n_ext = sum(len(base.encode(t)) for t in zh_texts), sum(len(ext.encode(t)) for t in zh_texts)
    assert n_base >= 1.5 * n_ext, (n_base, n_ext)
    changed = total = 0
    for t in en_texts:
        a, b = base.encode(t), ext.encode(t)
        total += len(a)
        changed += len(a) if len(a) != len(b) else sum(x != y for x, y in zip(a, b))
    assert changed <= 0.01 * total
    n_old = base.n_ids
    assert all(base.id_to_token(i) == ext.id_to_token(i) for i in range(n_old))
    assert ext.special_ids.items() >= base.special_ids.items()
    # the extended proto: base pieces at their ids, new ones scored below every base piece; SentencePiece itself
    # encodes like the converted pipeline
    sp_base = spm.SentencePieceProcessor(model_file=str(tmp_path / "base" / "tokenizer.model"))
    sp_ext = spm.SentencePieceProcessor(model_file=str(tmp_path / "ext" / "tokenizer.model"))
    assert sp_ext.get_piece_size() == ext.vocab_size
    assert all(sp_base.id_to_piece(i) == sp_ext.id_to_piece(i) for i in range(sp_base.get_piece_size()))
    lowest = min(sp_base.get_score(i) for i in range(sp_base.get_piece_size()) if sp_base.get_score(i) != 0)
    assert all(sp_ext.get_score(i) < lowest for i in range(n_old, n_old + 600))
    for t in zh_texts[:3] + en_texts[:3]:
        line = t.rstrip("\n")
        assert sp_ext.encode(line) == ext.encode(line)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "ext")
    for t in zh_texts[:3] + en_texts[:3] + ["mixed 中文 text <|endoftext|> 😀\n  two  spaces"]:
        assert ext.decode(ext.encode(t)) == t
    for t in zh_texts[:3] + en_texts[:3]:
        assert auto(t, add_special_tokens=False).input_ids == ext.encode(t)


def test_sentencepiece_extension_refuses_a_base_it_cannot_extend(tmp_path):
    """extend_spm needs the base's tokenizer.model, a BPE one, whose pieces are the ids of its tokenizer.json
    (beyond them only special tokens): each missing piece is refused, naming --base and the file."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from zero2all.tokenizer import load_tokenizer, train_tokenizer
    from zero2all.tokenizer.extend import extend_spm
    from zero2all.tokenizer.hf import Tokenizer

    rng = random.Random(2)
    en = write_jsonl(tmp_path / "en.jsonl", [english(rng, 40) for _ in range(40)])
    train_tokenizer([str(en)], 384, tmp_path / "base", backend="spm", log=lambda *a: None)
    base = load_tokenizer(tmp_path / "base")
    proto = pb.ModelProto()
    proto.ParseFromString(base.extra_file("tokenizer.model"))

    def with_proto(edit) -> Tokenizer:
        p = pb.ModelProto()
        p.CopyFrom(proto)
        edit(p)
        return Tokenizer(base.tokenizer_json, meta=base.meta, extra_files={"tokenizer.model": p.SerializeToString()})

    with pytest.raises(ValueError, match="--add: 0 must be at least 1"):
        extend_spm(base, ["text"], 0)
    with pytest.raises(ValueError, match="--base: a SentencePiece tokenizer .* without its tokenizer.model"):
        extend_spm(Tokenizer(base.tokenizer_json, meta=base.meta), ["text"], 8)
    with pytest.raises(ValueError, match="--base: tokenizer.model is not a SentencePiece BPE model"):
        extend_spm(with_proto(lambda p: setattr(p.trainer_spec, "model_type", pb.TrainerSpec.UNIGRAM)), ["text"], 8)
    n_normal = max(i for i, piece in enumerate(proto.pieces) if piece.type == pb.ModelProto.SentencePiece.NORMAL)
    with pytest.raises(ValueError, match=rf"--base: id {n_normal} .* do not belong together"):
        extend_spm(with_proto(lambda p: [p.pieces.pop() for _ in range(len(p.pieces) - n_normal)]), ["text"], 8)
