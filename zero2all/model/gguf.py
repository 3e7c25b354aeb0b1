"""GGUF (llama.cpp, Ollama, LM Studio): export a checkpoint as one ``.gguf`` file, and read one back.

    export_gguf("runs/demo/final", "demo.gguf", dtype="q8_0")   # z2all export-gguf --ckpt ... --out ...
    model, tok = load_gguf("demo.gguf")                          # our model and tokenizer, rebuilt from the file

The file uses llama.cpp's ``llama`` architecture. Names and layout, against ours::

    ours                                   GGUF (llama)
    embed_tokens.weight                    token_embd.weight
    layers.i.input_layernorm.weight        blk.i.attn_norm.weight
    layers.i.self_attn.qkv_proj.weight     blk.i.attn_q.weight, blk.i.attn_k.weight (rows permuted, below),
                                           blk.i.attn_v.weight
    layers.i.self_attn.o_proj.weight       blk.i.attn_output.weight
    layers.i.post_attention_layernorm      blk.i.ffn_norm.weight
    layers.i.mlp.gate_up_proj.weight       blk.i.ffn_gate.weight, blk.i.ffn_up.weight   (rows [gate | up])
    layers.i.mlp.down_proj.weight          blk.i.ffn_down.weight
    norm.weight                            output_norm.weight
    lm_head.weight                         output.weight (absent when tied: llama.cpp then reuses token_embd)

**The q/k permutation.** We rotate the pairs (j, j + d/2) of each head ("rotate half", as HF's Llama); llama.cpp's
``llama`` rope rotates adjacent pairs (2j, 2j + 1). Reordering the rows of q and k inside every head so that new row
2j is old row j and new row 2j + 1 is old row j + d/2 turns one into the other; attention scores (q . k) are
unchanged because q and k are permuted alike. Per head of d rows: ``w.view(heads, 2, d/2, in).transpose(1, 2)``
(:func:`permute_rope_rows`; :func:`unpermute_rope_rows` undoes it). k uses its own head count (grouped-query).
tests/test_gguf.py checks it with an independent forward pass written in llama.cpp's convention (adjacent pairs,
separate q/k/v and gate/up, no un-permuting) against our model's logits.

**Tokenizer.** Byte-level BPE goes in as ``tokenizer.ggml.model = "gpt2"`` (tokens in GPT-2's byte alphabet, the
merges, token types) with ``tokenizer.ggml.pre = "llama-bpe"``: llama.cpp picks its pre-tokenization regex by that
name, and Llama-3's is the one closest to ours (contractions, an optional non-letter glued to a word, 1-3 digit
groups, punctuation runs with their newlines). It differs from ours in that ours keeps CJK runs apart from Latin
letters, counts combining marks as letters, reads contractions case-sensitively and keeps a newline out of a
trailing run of spaces; on text without those cases both give the same ids. Our exact regex is stored too, under
``zero2all.tokenizer.pretokenize_regex`` (llama.cpp ignores unknown keys), so :func:`load_gguf` rebuilds the
tokenizer exactly. SentencePiece-style BPE goes in as ``"llama"`` (pieces, scores, types; no space prefix).
Special tokens are ``CONTROL`` tokens; ``<|endoftext|>`` is eos, ``<|im_end|>`` end-of-turn, ``<|pad|>`` padding,
no BOS is added; ``tokenizer.chat_template`` is our ChatML template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from zero2all.config import ConfigError, MissingPackageError, ModelConfig, OpsConfig

ARCH = "llama"
DTYPES = ("f32", "f16", "bf16", "q8_0")
PRETOKENIZE_KEY = "zero2all.tokenizer.pretokenize_regex"
BACKEND_KEY = "zero2all.tokenizer.backend"
# llama.cpp's pre-tokenization for tokenizer.ggml.pre = "llama-bpe" (Llama 3), used to rebuild a gpt2-type tokenizer
# from a file that does not carry our regex
LLAMA_BPE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
Q8_BLOCK = 32


def _gguf():
    try:
        import gguf
    except ImportError:
        raise MissingPackageError("GGUF export and loading need the `gguf` package: pip install 'zero2all[gguf]' "
                          "(or pip install gguf)") from None
    return gguf


# ---------------------------------------------------------------------------------------------------------------
# weights


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (weight (heads * d, in) or bias (heads * d,)) from "rotate half" order to
    llama.cpp's adjacent-pair order: within each head, new row 2j = old row j, new row 2j + 1 = old row j + d/2."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`permute_rope_rows`."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_state_dict(model_or_sd, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> GGUF tensor names (q/k permuted, q/k/v and gate/up split, no output when tied)."""
    sd = model_or_sd.state_dict() if isinstance(model_or_sd, torch.nn.Module) else model_or_sd
    sd = {k: v.detach().cpu() for k, v in sd.items()}
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"token_embd.weight": sd["embed_tokens.weight"], "output_norm.weight": sd["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            wq, wk, wv = sd[f"{p}self_attn.qkv_proj.{kind}"].split([q, kv, kv], dim=0)
            out[f"{b}attn_q.{kind}"] = permute_rope_rows(wq, cfg.n_heads)
            out[f"{b}attn_k.{kind}"] = permute_rope_rows(wk, cfg.n_kv_heads)
            out[f"{b}attn_v.{kind}"] = wv
            out[f"{b}attn_output.{kind}"] = sd[f"{p}self_attn.o_proj.{kind}"]
        gate, up = sd[f"{p}mlp.gate_up_proj.weight"].chunk(2, dim=0)
        out[f"{b}ffn_gate.weight"], out[f"{b}ffn_up.weight"] = gate, up
        out[f"{b}ffn_down.weight"] = sd[f"{p}mlp.down_proj.weight"]
        out[f"{b}attn_norm.weight"] = sd[f"{p}input_layernorm.weight"]
        out[f"{b}ffn_norm.weight"] = sd[f"{p}post_attention_layernorm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def state_dict_from_gguf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """GGUF tensors (float) -> our state dict: un-permute q/k, fuse q/k/v and gate/up."""
    tensors = dict(tensors)
    missing: list[str] = []

    def take(name):
        if name not in tensors:
            missing.append(name)
            return None
        return tensors.pop(name)

    out = {"embed_tokens.weight": take("token_embd.weight"), "norm.weight": take("output_norm.weight")}
    for i in range(cfg.n_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            wq, wk, wv = take(f"{b}attn_q.{kind}"), take(f"{b}attn_k.{kind}"), take(f"{b}attn_v.{kind}")
            if wq is not None and wk is not None and wv is not None:
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(
                    [unpermute_rope_rows(wq, cfg.n_heads), unpermute_rope_rows(wk, cfg.n_kv_heads), wv], dim=0)
            out[f"{p}self_attn.o_proj.{kind}"] = take(f"{b}attn_output.{kind}")
        gate, up = take(f"{b}ffn_gate.weight"), take(f"{b}ffn_up.weight")
        if gate is not None and up is not None:
            out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
        out[f"{p}mlp.down_proj.weight"] = take(f"{b}ffn_down.weight")
        out[f"{p}input_layernorm.weight"] = take(f"{b}attn_norm.weight")
        out[f"{p}post_attention_layernorm.weight"] = take(f"{b}ffn_norm.weight")
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    else:
        out["lm_head.weight"] = take("output.weight")
    if missing:
        raise ConfigError(f"{source}: missing tensors: {', '.join(missing[:8])}"
                          + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    if tensors:
        raise ConfigError(f"{source}: unexpected tensors: {', '.join(sorted(tensors)[:8])}")
    return out


def _encode_tensor(t: torch.Tensor, dtype: str, gguf):
    """(array, raw_dtype or None) for GGUFWriter.add_tensor. 1-D tensors (norms, biases) stay float32; a q8_0 matrix
    whose rows are not a multiple of 32 long falls back to f16."""
    Q = gguf.GGMLQuantizationType
    a = t.detach().float().cpu().numpy()
    if a.ndim == 1 or dtype == "f32":
        return a, None
    if dtype == "f16" or (dtype == "q8_0" and a.shape[-1] % Q8_BLOCK):
        return a.astype(np.float16), None
    qtype = Q.BF16 if dtype == "bf16" else Q.Q8_0
    return gguf.quants.quantize(a, qtype), qtype


# ---------------------------------------------------------------------------------------------------------------
# tokenizer metadata


def _tokenizer_dir_chat_template(tok_dir: Path | None) -> str | None:
    if tok_dir is None:
        return None
    f = tok_dir / "tokenizer_config.json"
    if not f.exists():
        return None
    try:
        tmpl = json.loads(f.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        where = f"{f}:{e.lineno}" if isinstance(e, json.JSONDecodeError) else str(f)
        raise ConfigError(f"{where}: not a valid tokenizer_config.json ({getattr(e, 'msg', type(e).__name__)}); the "
                          f"file is damaged: copy the tokenizer folder again from where it came from") from None
    return tmpl if isinstance(tmpl, str) else None


def _spm_scores(tok, n: int) -> list[float] | None:
    """Piece scores from the SentencePiece model kept beside an spm tokenizer, else None."""
    proto_bytes = tok.extra_file("tokenizer.model")
    if not proto_bytes:
        return None
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(proto_bytes)
    scores = [float(p.score) for p in proto.pieces]
    return scores + [0.0] * (n - len(scores))


def tokenizer_metadata(tok, n_vocab: int, cfg: ModelConfig, tok_dir: Path | None = None) -> dict:
    """Everything ``tokenizer.ggml.*`` for ``tok`` (our Tokenizer), padded with unused tokens to the model's
    ``n_vocab`` embedding rows (llama.cpp wants one token per row). Returns a dict of field -> value."""
    raw = json.loads(tok.tokenizer_json)
    model = raw.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(f"tokenizer: model type {model.get('type')!r} cannot be written as GGUF (BPE only)")
    vocab = dict(model["vocab"])
    for t in raw.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    n_tok = max(vocab.values()) + 1
    if n_tok > n_vocab:
        raise ConfigError(f"tokenizer: {n_tok} tokens but the model has only {n_vocab} embedding rows")
    tokens: list[str | None] = [None] * n_vocab
    for s, i in vocab.items():
        tokens[i] = s
    types = [NORMAL] * n_vocab
    for i in range(n_vocab):
        if tokens[i] is None:
            tokens[i], types[i] = f"<|unused_{i}|>", UNUSED
    for i in tok.special_ids.values():
        types[i] = CONTROL
    spm = tok.backend == "spm" or model.get("byte_fallback", False)
    meta: dict = {"tokens": tokens, "types": types}
    if spm:
        unk = model.get("unk_token")
        for i, s in enumerate(tokens):
            if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
                types[i] = BYTE
        if unk in vocab:
            types[vocab[unk]] = UNKNOWN
            meta["unk"] = vocab[unk]
        scores = _spm_scores(tok, n_vocab)
        if scores is None:  # no SentencePiece model: the merge rank orders the pieces the same way
            scores = [0.0] * n_vocab
            for r, m in enumerate(model.get("merges", [])):
                a, b = m.split(" ", 1) if isinstance(m, str) else m
                i = vocab.get(a + b)
                if i is not None and scores[i] == 0.0:
                    scores[i] = -float(r + 1)
        meta.update(model="llama", scores=scores, pre="default")
    else:
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        meta.update(model="gpt2", merges=merges, pre="llama-bpe", regex=_pretokenize_regex(raw))
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tok.eos_id
    meta["eos"] = eos
    meta["bos"] = cfg.bos_token_id if cfg.bos_token_id is not None else eos  # never added (add_bos_token false)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else tok.pad_id
    if pad is not None:
        meta["pad"] = pad
    if tok.im_end_id is not None:
        meta["eot"] = tok.im_end_id
    from zero2all.tokenizer.hf import CHAT_TEMPLATE, HF_CHAT_TEMPLATE

    template = _tokenizer_dir_chat_template(tok_dir)
    if template == HF_CHAT_TEMPLATE:  # files from an HF export: its guard needs a tokenizer.json step GGUF lacks
        template = CHAT_TEMPLATE
    if template is None and tok.im_start_id is not None and tok.im_end_id is not None:
        template = CHAT_TEMPLATE
    if template:
        meta["chat_template"] = template
    meta["backend"] = tok.backend
    return meta


def _pretokenize_regex(raw: dict) -> str | None:
    """The Split regex of a byte-level pipeline's pre-tokenizer (ours), or None."""
    def walk(p):
        if not isinstance(p, dict):
            return None
        if p.get("type") == "Split" and isinstance(p.get("pattern"), dict) and "Regex" in p["pattern"]:
            return p["pattern"]["Regex"]
        for q in p.get("pretokenizers", []) or []:
            r = walk(q)
            if r:
                return r
        return None
    return walk(raw.get("pre_tokenizer"))


# ---------------------------------------------------------------------------------------------------------------
# export


def export_gguf(ckpt: str | Path | None, out: str | Path, dtype: str = "f32", tokenizer_dir: str | Path | None = None,
                model=None, log=print) -> Path:
    """Write checkpoint ``ckpt`` (any directory :func:`zero2all.model.io.load_model` reads, or ``model``) as one
    GGUF file ``out`` with its tokenizer (``tokenizer_dir``, default the checkpoint's). The file is written beside
    ``out`` under a temporary name and renamed onto it, so a kill leaves the previous file or none."""
    from zero2all.fileio import fsync_dir, temporary_path
    from zero2all.model.io import load_model
    from zero2all.tokenizer import load_tokenizer

    gguf = _gguf()
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    model = model if model is not None else load_model(ckpt)
    cfg = model.cfg
    if cfg.moe.enabled:
        raise ConfigError(f"{ckpt or 'model'}: GGUF export of mixture-of-experts models is not supported "
                          f"(export to HF with `z2all export-hf` instead)")
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else (Path(ckpt) if ckpt is not None else None)
    if tok_dir is None or not (tok_dir / "tokenizer.json").exists():
        raise FileNotFoundError(f"{tok_dir}: no tokenizer.json; a GGUF file needs the tokenizer (pass --tokenizer)")
    tok = load_tokenizer(tok_dir)
    n_vocab = cfg.padded_vocab_size
    tmeta = tokenizer_metadata(tok, n_vocab, cfg, tok_dir)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out)
    w = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        name = Path(ckpt).resolve().name if ckpt is not None else "z2all"
        w.add_name(name)
        ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
        w.add_file_type(int(ftype))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_vocab_size(n_vocab)
        context = cfg.max_seq_len
        scaling = cfg.rope_scaling or {}
        kind = scaling.get("type", scaling.get("rope_type"))
        if kind == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(scaling["factor"]))
        elif kind == "dynamic":
            # llama.cpp has no dynamic NTK; it is the identity up to the original context, which is what we declare
            context = int(scaling.get("original_max_position_embeddings") or cfg.max_seq_len)
            log(f"warning: rope_scaling type 'dynamic' has no GGUF equivalent; written without scaling and "
                f"context_length {context} (the original context, where dynamic NTK changes nothing)")
        w.add_context_length(context)
        w.add_embedding_length(cfg.hidden_dim)
        w.add_block_count(cfg.n_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.n_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(float(cfg.rope_theta))
        w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))

        w.add_tokenizer_model(tmeta["model"])
        w.add_tokenizer_pre(tmeta["pre"])
        w.add_token_list(tmeta["tokens"])
        w.add_token_types(tmeta["types"])
        if "scores" in tmeta:
            w.add_token_scores(tmeta["scores"])
            w.add_add_space_prefix(False)  # trained without a dummy prefix
        if "merges" in tmeta:
            w.add_token_merges(tmeta["merges"])
        if tmeta.get("regex"):
            w.add_string(PRETOKENIZE_KEY, tmeta["regex"])
        w.add_string(BACKEND_KEY, tmeta["backend"])
        w.add_bos_token_id(int(tmeta["bos"]))
        w.add_eos_token_id(int(tmeta["eos"]))
        for key, add in (("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id), ("eot", w.add_eot_token_id)):
            if key in tmeta:
                add(int(tmeta[key]))
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        if "chat_template" in tmeta:
            w.add_chat_template(tmeta["chat_template"])

        for tname, t in gguf_state_dict(model, cfg).items():
            arr, raw_dtype = _encode_tensor(t, dtype, gguf)
            w.add_tensor(tname, arr, raw_dtype=raw_dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        try:
            w.close()
        except Exception:
            pass
        tmp.unlink(missing_ok=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------------------------
# reading back


class _Fields:
    """Typed access to a GGUFReader's key-value fields; errors name the file and the key."""

    def __init__(self, reader, path: str):
        self.reader, self.path = reader, path

    def get(self, key: str, default=None):
        f = self.reader.get_field(key)
        return default if f is None else f.contents()

    def need(self, key: str):
        f = self.reader.get_field(key)
        if f is None:
            raise ConfigError(f"{self.path}: metadata field {key!r} is missing")
        return f.contents()


def read_gguf_config(reader, path: str) -> ModelConfig:
    """ModelConfig from a llama-architecture GGUF file's metadata (and its embedding's row count)."""
    f = _Fields(reader, path)
    arch = f.need("general.architecture")
    if arch != ARCH:
        raise ConfigError(f"{path}: general.architecture {arch!r} is not {ARCH!r}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"{path}: tensor 'token_embd.weight' is missing")
    n_vocab = int(tensors["token_embd.weight"].shape[-1])
    hidden, heads = int(f.need(f"{ARCH}.embedding_length")), int(f.need(f"{ARCH}.attention.head_count"))
    head_dim = int(f.get(f"{ARCH}.attention.key_length", hidden // heads))
    if head_dim * heads != hidden:
        raise ConfigError(f"{path}: {ARCH}.attention.key_length {head_dim} * {ARCH}.attention.head_count {heads} "
                          f"!= {ARCH}.embedding_length {hidden} (our model needs head_dim = hidden / heads)")
    rope_dims = int(f.get(f"{ARCH}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ConfigError(f"{path}: {ARCH}.rope.dimension_count {rope_dims} != head dim {head_dim} "
                          f"(partial rotary is not supported)")
    scaling = None
    kind = f.get(f"{ARCH}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ConfigError(f"{path}: {ARCH}.rope.scaling.type {kind!r} is not supported (linear)")
        scaling = {"type": "linear", "factor": float(f.need(f"{ARCH}.rope.scaling.factor"))}
    eos = f.get("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        vocab_size=n_vocab,
        hidden_dim=hidden,
        intermediate_size=int(f.need(f"{ARCH}.feed_forward_length")),
        n_layers=int(f.need(f"{ARCH}.block_count")),
        n_heads=heads,
        n_kv_heads=int(f.get(f"{ARCH}.attention.head_count_kv", heads)),
        max_seq_len=int(f.need(f"{ARCH}.context_length")),
        rms_norm_eps=float(f.get(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(f.get(f"{ARCH}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        eos_token_id=None if eos is None else int(eos),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        ops=OpsConfig(),
    )
    cfg.validate()
    return cfg


def read_gguf_tensors(reader, path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the file as float32 torch tensors in our (out, in) orientation, dequantized."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    out = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists the fastest-varying dimension first
        if t.tensor_type in (Q.F32, Q.F16):
            a = np.asarray(t.data, dtype=np.float32)
        else:
            try:
                a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            except NotImplementedError:
                raise ConfigError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which cannot be "
                                  f"dequantized here") from None
        out[t.name] = torch.from_numpy(np.array(a, dtype=np.float32, copy=True).reshape(shape))
    return out


def tokenizer_from_gguf(reader, path: str, pretokenize_regex: str | None = None):
    """Our Tokenizer rebuilt from ``tokenizer.ggml.*`` metadata through HF `tokenizers`' BPE (gpt2: vocab +
    merges + byte-level pre-tokenization by ``pretokenize_regex``, default the file's own regex, else llama.cpp's
    "llama-bpe" one; llama: pieces ranked by score, byte fallback). None when the file has no tokenizer."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as _HFTokenizer

    from zero2all.tokenizer.hf import SPM_ESCAPE, Tokenizer

    f = _Fields(reader, path)
    kind = f.get("tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = list(f.need("tokenizer.ggml.tokens"))
    types = list(f.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    if len(types) != len(tokens):
        raise ConfigError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries, "
                          f"tokenizer.ggml.tokens {len(tokens)}")
    used = [i for i, t in enumerate(types) if t != UNUSED]
    vocab = {tokens[i]: i for i in used}
    specials = [tokens[i] for i in used if types[i] == CONTROL]
    meta: dict = {}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in f.need("tokenizer.ggml.merges")]
        regex = pretokenize_regex or f.get(PRETOKENIZE_KEY) or LLAMA_BPE_REGEX
        bpe = models.BPE(vocab=vocab, merges=merges)
        tok = _HFTokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        meta["backend"] = "hf"
    elif kind == "llama":
        scores = list(f.need("tokenizer.ggml.scores"))
        normal = {tokens[i] for i in used if types[i] == NORMAL}
        merges = []
        for i in used:
            p = tokens[i]
            if types[i] != NORMAL or len(p) < 2:
                continue
            for k in range(1, len(p)):
                a, b = p[:k], p[k:]
                if a in normal and b in normal:
                    merges.append((-scores[i], i, vocab[a], vocab[b], a, b))
        merges.sort()
        unk_id = f.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[int(unk_id)] if unk_id is not None else None
        bpe = models.BPE(vocab=vocab, merges=[(m[4], m[5]) for m in merges], unk_token=unk, byte_fallback=True,
                         fuse_unk=True)
        tok = _HFTokenizer(bpe)
        if f.get("tokenizer.ggml.add_space_prefix", True):
            raise ConfigError(f"{path}: tokenizer.ggml.add_space_prefix is true; only tokenizers without a space "
                              f"prefix are rebuilt")
        norms = [normalizers.Replace(" ", "\u2581")]
        decs = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if f.get(BACKEND_KEY) == "spm":  # our pipeline keeps a literal U+2581 (zero2all/tokenizer/hf.py)
            norms.insert(0, normalizers.Replace("\u2581", SPM_ESCAPE))
            decs.append(decoders.Replace(SPM_ESCAPE, "\u2581"))
        tok.normalizer = normalizers.Sequence(norms)
        tok.decoder = decoders.Sequence(decs)
        meta.update(backend="spm", unk_token=unk)
    else:
        raise ConfigError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for key, name in (("tokenizer.ggml.eos_token_id", "eos_token"), ("tokenizer.ggml.padding_token_id", "pad_token")):
        i = f.get(key)
        if i is not None and 0 <= int(i) < len(tokens):
            meta[name] = tokens[int(i)]
    template = f.get("tokenizer.chat_template")
    if template:
        meta["chat_template"] = template
    return Tokenizer(tok.to_str(), meta=meta)


def load_gguf(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Read a llama-architecture GGUF file into our model (q/k un-permuted, q/k/v and gate/up fused, quantized
    tensors dequantized to float32) and our tokenizer. Returns ``(model, tokenizer or None)``, model in eval mode."""
    from zero2all.model.io import load_state
    from zero2all.model.z2all import build_model

    gguf = _gguf()
    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path}: not a readable GGUF file ({e})") from None
    cfg = read_gguf_config(reader, path)
    sd = state_dict_from_gguf(read_gguf_tensors(reader, path), cfg, path)
    model = build_model(cfg, device="meta").to_empty(device=device)
    model.tie_weights()
    load_state(model, {k: v.to(device) for k, v in sd.items()}, path)
    model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    return model.eval(), tokenizer_from_gguf(reader, path)
