"""``z2all <command>``: argument parsing only; each command calls one function of the package.

Each command registers itself with ``@command(name, help, examples)`` on a function that adds its arguments and
returns the function to run. Heavy imports (torch, tokenizers) happen inside the runner, so building the parser
(``z2all --help``) imports neither.

Commands that take dotted ``key=value`` config overrides accept them anywhere on the line
(``z2all pretrain --config tiny train.max_steps=1 --out X train.lr=1e-3``). The options that set a config key are
generated from the config's fields (``zero2all/cli_flags.py``: ``--train.lr`` for every setting, a short name such
as ``--out`` / ``--tp`` for a few) and are passed to ``zero2all.config.build_config`` as typed values: they win
over the ``--config`` file, and naming the same key with an option and an override is an error.

Exit codes: 0 success; 2 bad usage, config or input (a missing file included), one ``error:`` line; 1 an operating
system failure while reading or writing (read-only or full disk, permissions), one line naming the path, what failed
and what to do (``zero2all.fileio.os_error_message``); 3 a training run stopped because its updates were skipped for
non-finite gradients (``train.max_skipped_updates``; no ``final/`` written); 130 / 143 a training run stopped by
SIGINT / SIGTERM after saving a checkpoint.

Every command that writes a directory writes only into a new or empty folder or into a previous output of the same
command (``zero2all.fileio.claim_output_dir``); anything else in the way is named in one line, exit code 2.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
from pathlib import Path
from typing import Callable

from zero2all import __version__

_COMMANDS: list[tuple[str, str, str, Callable]] = []

# a dotted config override: `train.lr=1e-3`, `model.ops.attention=sdpa` (a typo such as `trian.lr=1` too, so that
# the config reports it with a suggestion instead of argparse calling it an unrecognised argument)
OVERRIDE_TOKEN = re.compile(r"^[A-Za-z_][\w.]*=")


def command(name: str, help: str, examples: str = ""):
    def register(fn):
        _COMMANDS.append((name, help, examples, fn))
        return fn

    return register


def _overrides(p: argparse.ArgumentParser):
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides anywhere on the line, e.g. model.n_layers=4 train.lr=1e-3")


def split_overrides(tokens: list[str], options: dict[str, argparse.Action]) -> tuple[list[str], list[str]]:
    """(the other tokens, the ``key=value`` override tokens), each in command-line order.

    A token is an override when it looks like ``dotted.key=...``, is not the value of an option that takes a fixed
    number of values (``--out a=b`` stays ``--out``'s) and is not an existing path (``--data x=1.jsonl``). Tokens
    after ``--`` are left alone."""
    kept, found = [], []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            kept += tokens[i:]
            break
        action = options.get(tok)
        if action is not None and (action.nargs is None or (isinstance(action.nargs, int) and action.nargs > 0)):
            n = 1 if action.nargs is None else action.nargs
            kept += tokens[i:i + 1 + n]
            i += 1 + n
            continue
        if OVERRIDE_TOKEN.match(tok) and not Path(tok).exists():
            found.append(tok)
        else:
            kept.append(tok)
        i += 1
    return kept, found


class CommandParser(argparse.ArgumentParser):
    """A command's parser: its ``key=value`` overrides (a positional named ``overrides``) may stand anywhere.

    argparse fills a ``nargs="*"`` positional from one contiguous run of tokens only, and an option with
    ``nargs="+"`` (``--data a.jsonl``) takes the tokens after it, so the overrides are taken out first
    (:func:`split_overrides`) and the rest is parsed as usual."""

    def parse_known_args(self, args=None, namespace=None):
        if not any(a.dest == "overrides" and not a.option_strings for a in self._actions):
            return super().parse_known_args(args, namespace)
        kept, found = split_overrides(list(sys.argv[1:] if args is None else args), self._option_string_actions)
        namespace, rest = super().parse_known_args(kept, namespace)
        namespace.overrides = found + list(namespace.overrides or [])
        return namespace, rest


# the sections whose settings a training command offers as flags (zero2all/cli_flags.py), and its short flags
TRAIN_SECTIONS = ("model", "train", "data", "parallel")
TRAIN_SHORT = ("--out", "--resume", "--device", "--lr", "--max-steps", "--micro-batch-size", "--grad-accum-steps",
               "--tp", "--pp", "--cp", "--ep")
# post-training reads the architecture from --init: only these model settings may be given
# (zero2all.train.posttrain.MODEL_OVERRIDABLE; tests/test_cli_flags.py keeps the two equal)
POST_MODEL_KEYS = ("model.ops", "model.dropout1", "model.dropout2", "model.attention_dropout")
POST_SHORT = ("--init", "--data", "--valid", "--valid-fraction", "--tokenizer", "--lora-rank", "--lora-alpha",
              "--lora-dropout", "--lora-targets", "--prompt-tuning", "--num-virtual-tokens", "--skip-bad")


def _config_flags(p: argparse.ArgumentParser, sections, short, **kwargs):
    from zero2all.cli_flags import add_config_flags

    return add_config_flags(p, sections, short, **kwargs)


# ---------------------------------------------------------------------------------------------------- model


@command("info", "print a config's architecture and parameter counts (no weights are allocated)",
         "  z2all info --config z2all-1.1b\n  z2all info --config tiny model.n_layers=8")
def _info(p):
    p.add_argument("--config", default="z2all-1.1b", help="preset name or .toml path")
    _overrides(p)

    def run(args):
        from zero2all.config import load_config, to_dict
        from zero2all.model.z2all import build_model

        cfg = load_config(args.config, args.overrides).model
        model = build_model(cfg, device="meta")
        for k, v in to_dict(cfg).items():
            print(f"{k:26s} {v}")
        print(f"{'parameters':26s} {model.num_params():,}")
        print(f"{'non-embedding parameters':26s} {model.num_params(non_embedding=True):,}")

    return run


@command("export-hf", "write a checkpoint as an HF LlamaForCausalLM directory (config.json + safetensors)",
         "  z2all export-hf --ckpt runs/demo/final --out runs/demo/hf\n"
         "  z2all export-hf --ckpt runs/demo/final --out hf-bf16 --dtype bfloat16\n"
         "  z2all export-hf --ckpt runs/1b/ckpt-002000 --out hf   # a sharded multi-GPU checkpoint too")
def _export_hf(p):
    p.add_argument("--ckpt", required=True, help="our checkpoint directory")
    p.add_argument("--out", required=True, help="output directory: new, empty or an earlier export (replaced "
                                                "atomically)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokenizer", default=None, help="tokenizer directory to include (default: the checkpoint's)")
    p.add_argument("--merge-lora", action="store_true", help="merge LoRA adapters into the weights first")

    def run(args):
        from zero2all.fileio import claim_output_dir
        from zero2all.model.io import export_hf, load_model

        claim_output_dir(args.out, "export-hf", inputs=[args.ckpt, args.tokenizer])  # before the slow load
        # any checkpoint directory (a multi-process training checkpoint too); a LoRA adapter only when asked to
        model = load_model(args.ckpt, merge_lora=args.merge_lora)
        out = export_hf(args.ckpt, args.out, dtype=args.dtype, tokenizer_dir=args.tokenizer, model=model)
        print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained('{out}'))")

    return run


@command("export-gguf", "write a checkpoint as one GGUF file (llama.cpp, Ollama, LM Studio) with its tokenizer",
         "  z2all export-gguf --ckpt runs/demo/final --out demo.gguf                # float32\n"
         "  z2all export-gguf --ckpt runs/demo/final --out demo-q8.gguf --dtype q8_0\n"
         "  llama-cli -m demo.gguf -p 'def main():'                                  # then any GGUF runtime")
def _export_gguf(p):
    p.add_argument("--ckpt", required=True, help="checkpoint directory (ours, a training checkpoint, or HF Llama)")
    p.add_argument("--out", required=True, help="output .gguf file (written beside it, then renamed onto it)")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"],
                   help="matrix type; norms stay f32 (default: f32)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    p.add_argument("--merge-lora", action="store_true", help="merge LoRA adapters into the weights first")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file (refused otherwise)")

    def run(args):
        from zero2all.fileio import claim_output_file
        from zero2all.model.gguf import export_gguf
        from zero2all.model.io import load_model

        claim_output_file(args.out, args.overwrite, inputs=[args.ckpt, args.tokenizer])  # before the slow load

        model = load_model(args.ckpt, merge_lora=args.merge_lora)
        out = export_gguf(args.ckpt, args.out, dtype=args.dtype, tokenizer_dir=args.tokenizer, model=model,
                          log=lambda m: print(m, file=sys.stderr))
        size = os.path.getsize(out) / 1e6
        print(f"wrote {out} ({size:.1f} MB, {args.dtype}; run it with llama.cpp: llama-cli -m {out})")

    return run


@command("convert-checkpoint", "rewrite a training checkpoint of an earlier zero2all version in the current format",
         "  z2all convert-checkpoint runs/old/ckpt-000400            # writes runs/old/ckpt-000400-v2\n"
         "  z2all convert-checkpoint runs/old/ckpt-000400 --out runs/new/ckpt-000400\n"
         "  z2all pretrain ... --out runs/new --resume auto           # then continue the run")
def _convert_checkpoint(p):
    p.add_argument("ckpt", help="the earlier-format checkpoint directory")
    p.add_argument("--out", default=None, help="where to write the converted checkpoint (default: CKPT-v2)")

    def run(args):
        from zero2all.train.convert import convert_checkpoint

        convert_checkpoint(args.ckpt, args.out)

    return run


@command("import-hf", "convert an HF Llama-architecture directory into our checkpoint format",
         "  z2all import-hf --hf path/to/llama --out runs/imported")
def _import_hf(p):
    p.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors or *.bin)")
    p.add_argument("--out", required=True)

    def run(args):
        from zero2all.model.io import import_hf

        print(f"wrote {import_hf(args.hf, args.out)}")

    return run


@command("resize-vocab", "give a checkpoint the embedding / LM-head rows of an extended tokenizer (new rows: the "
         "mean of their old pieces)",
         "  z2all resize-vocab --ckpt runs/imported --tokenizer runs/tok-zh --out runs/imported-zh")
def _resize_vocab(p):
    p.add_argument("--ckpt", required=True, help="checkpoint directory with its tokenizer files")
    p.add_argument("--tokenizer", required=True, help="the new tokenizer (it must keep every id of the old one)")
    p.add_argument("--out", required=True, help="output directory: our model format with the new tokenizer files")

    def run(args):
        from zero2all.model.resize import resize_vocab

        resize_vocab(args.ckpt, args.tokenizer, args.out)

    return _data_errors("resize-vocab", run)


# ---------------------------------------------------------------------------------------------------- data
# (train-tokenizer, prepare)


def _data_errors(name: str, fn):
    """Run ``fn``; report bad input / mismatches as one clear line instead of a traceback."""
    def run(args):
        from zero2all.corpus.readers import BadInputError

        try:
            return fn(args)
        except (BadInputError, ValueError) as e:  # OS errors go to main: one line naming the path, exit code 1
            print(f"z2all {name}: error: {e}", file=sys.stderr)
            return 2

    return run


def _reader_args(p: argparse.ArgumentParser):
    p.add_argument("--text-field", default=None,
                   help="record field holding the text (default: 'content', else 'text')")
    p.add_argument("--txt-mode", default="file", choices=["file", "paragraph"],
                   help=".txt files: one document per file, or per blank-line separated block")
    p.add_argument("--strict", action="store_true",
                   help="stop at the first bad input (malformed JSON, invalid UTF-8, ...) naming file:line, "
                        "instead of skipping and counting it")


@command("train-tokenizer", "train a byte-level BPE (hf) or SentencePiece BPE (spm) tokenizer; writes HF files",
         "  z2all train-tokenizer --input stdlib --vocab-size 8192 --out runs/tok\n"
         "  z2all train-tokenizer --input 'data/**/*.jsonl.zst' --vocab-size 64000 --out tok --backend spm\n"
         "  z2all train-tokenizer --input corpus.parquet --text-field text --vocab-size 32000 --out tok "
         "--max-memory-gb 4")
def _train_tokenizer(p):
    p.add_argument("--input", nargs="+", action="extend", default=None, metavar="PATH",
                   help="files, directories, globs, or 'stdlib' (the default); NAME=PATH also accepted")
    p.add_argument("--vocab-size", type=int, required=True,
                   help="total size incl. the 16 special tokens, at least 336 (337 with spm); rounded up to a "
                        "multiple of 64 (said when it changes the number). A corpus too small for that many merges "
                        "gives a smaller vocabulary, with a warning line naming the size obtained")
    p.add_argument("--out", required=True, help="output directory: new, empty or an earlier train-tokenizer output "
                                                "(replaced atomically; checked before training starts)")
    p.add_argument("--backend", default="hf", choices=["hf", "spm"])
    p.add_argument("--max-memory-gb", type=float, default=8.0,
                   help="memory cap: larger corpora are sampled to fit (0 = feed everything)")
    p.add_argument("--seed", type=int, default=0, help="document sampling seed (when the cap applies)")
    p.add_argument("--min-frequency", type=int, default=2, help="hf backend: least count of a merged pair")
    p.add_argument("--sample-bytes", default=None, metavar="N[K|M|G]",
                   help="train on a bounded sample: the documents of least seeded priority (a hash of the text) that "
                        "fit N bytes, drawn in one pass (e.g. 500M); the same sample for a seed however the corpus "
                        "is sharded")
    _ray_arg(p)
    _reader_args(p)

    def run(args):
        from zero2all.tokenizer.train import train_tokenizer

        sample = None
        if args.sample_bytes is not None:
            text = args.sample_bytes.strip().upper().removesuffix("B")
            scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:], 1)
            try:
                sample = float(text[:-1] if scale != 1 else text) * scale
            except ValueError:
                sample = -1
            if not sample > 0:
                raise ValueError(f"--sample-bytes {args.sample_bytes}: expected a positive size, e.g. 500M or 2G")

        if not args.max_memory_gb >= 0:
            raise ValueError(f"--max-memory-gb: {args.max_memory_gb} must be >= 0 (0 = no cap)")
        tok = train_tokenizer(args.input or ["stdlib"], args.vocab_size, args.out, backend=args.backend,
                              text_field=args.text_field, txt_mode=args.txt_mode, strict=args.strict,
                              max_memory_gb=args.max_memory_gb or None, seed=args.seed,
                              min_frequency=args.min_frequency, sample_bytes=sample, ray=args.ray)
        print(f"{tok!r}; load with zero2all.load_tokenizer('{args.out}') or "
              f"transformers.AutoTokenizer.from_pretrained('{args.out}')")

    return _data_errors("train-tokenizer", run)


@command("extend-tokenizer", "add up to N tokens learned on a new corpus to a tokenizer, byte-level BPE or "
         "SentencePiece (old ids kept)",
         "  z2all extend-tokenizer --base runs/tok --input zh.jsonl --add 2000 --out runs/tok-zh --base-text en.jsonl")
def _extend_tokenizer(p):
    p.add_argument("--base", required=True,
                   help="tokenizer directory, byte-level BPE or SentencePiece BPE (spm backend, with its "
                        "tokenizer.model), or a checkpoint carrying one")
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="PATH",
                   help="corpus to learn the new tokens on (every 10th document is held out for the report)")
    p.add_argument("--add", type=int, required=True, help="tokens to add (at most)")
    p.add_argument("--out", required=True, help="output directory: new, empty or an earlier extend-tokenizer "
                                                "output (replaced atomically)")
    p.add_argument("--base-text", nargs="+", action="extend", default=[], metavar="PATH",
                   help="text of the base's own domain: bytes/token before/after is reported on it")
    p.add_argument("--min-frequency", type=int, default=2, help="byte-level BPE: least count of a learned pair")
    _reader_args(p)

    def run(args):
        from zero2all.tokenizer.extend import extend_tokenizer

        extend_tokenizer(args.base, args.input, args.add, args.out, base_text=args.base_text,
                         min_frequency=args.min_frequency, text_field=args.text_field, txt_mode=args.txt_mode)

    return _data_errors("extend-tokenizer", run)


def _ray_arg(p):
    p.add_argument("--ray", action=argparse.BooleanOptionalAction, default=None,
                   help="run the work units on Ray (pip install 'zero2all[ray]'): the cluster at RAY_ADDRESS, else a "
                        "local one; on by default when RAY_ADDRESS is set (--no-ray: here). Same output either way")


def _decontam_args(p):
    p.add_argument("--decontaminate", nargs="+", action="extend", default=None, metavar="[NAME=]PATH",
                   help="evaluation sets (jsonl / json / parquet / txt files, folders, globs, or lm-eval:TASK): "
                        "remove training documents sharing a word n-gram (decontam.ngram, 13) with any of them")
    p.add_argument("--decontam-report-only", action="store_true",
                   help="with --decontaminate: count and show the matching documents in the report, keep them")


@command("prepare", "tokenize corpora in parallel into memmap shards (+ index, meta.json, train/valid split)",
         "  z2all prepare --input stdlib --tokenizer runs/tok --out runs/data\n"
         "  z2all prepare --input zh=data/zh --input code=data/code.jsonl.zst --source zh=0.4 --source code=2 \\\n"
         "      --tokenizer tok --out data/mix --valid-fraction 0.005 --workers 16\n"
         "  z2all prepare --input web=data/web --input zh=data/zh --input code=data/code --temperature 5 "
         "--max-epochs 4 --tokenizer tok --out data/mix")
def _prepare(p):
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="[NAME=]PATH",
                   help="sources: files, directories, globs or 'stdlib'; NAME=PATH names a source "
                        "(default name: the file stem)")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (z2all train-tokenizer)")
    p.add_argument("--out", required=True, help="output directory; re-running resumes an interrupted run")
    p.add_argument("--source", action="append", default=[], metavar="NAME=WEIGHT",
                   help="mixture weight of a source: expected copies of each of its documents (0.4 keeps a 40%% "
                        "sample, 2 repeats it twice)")
    p.add_argument("--temperature", type=float, default=None,
                   help="source sampling: shares proportional to size^(1/T) (1 = natural, larger = flatter); weights "
                        "from a counting pass; explicit --source weights win for their sources")
    p.add_argument("--target-mb", type=float, default=None,
                   help="expected MB of text in the output (default: the corpus size)")
    p.add_argument("--max-epochs", type=float, default=None,
                   help="cap on the copies of any document (temperature weights above it are clipped)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-document sampling draw (0 = content hash)")
    p.add_argument("--valid-fraction", type=float, default=0.01, help="share of documents held out")
    p.add_argument("--seq-len", type=int, default=None, help="check the train split has at least one window")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="text per work unit")
    p.add_argument("--shard-chunks", type=int, default=256, help="work units per shard (and per resume step)")
    p.add_argument("--overwrite", action="store_true", help="delete existing shards in --out first")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--decontam-ngram", type=int, default=13, help="with --decontaminate: words per n-gram (13)")
    _decontam_args(p)
    _ray_arg(p)
    _reader_args(p)

    def run(args):
        from zero2all.data.pretokenize import prepare

        weights = {}
        for item in args.source:
            name, sep, value = item.partition("=")
            try:
                weights[name] = float(value)
            except ValueError:
                raise ValueError(f"--source {item!r}: expected NAME=WEIGHT, e.g. zh=0.4") from None
        prepare(args.input, args.tokenizer, args.out, valid_fraction=args.valid_fraction, workers=args.workers,
                weights=weights, text_field=args.text_field, txt_mode=args.txt_mode, strict=args.strict,
                chunk_bytes=int(args.chunk_mb * (1 << 20)), shard_chunks=args.shard_chunks, seq_len=args.seq_len,
                overwrite=args.overwrite, progress=False if args.no_progress else None,
                command="z2all " + " ".join(sys.argv[1:]), temperature=args.temperature, target_mb=args.target_mb,
                max_epochs=args.max_epochs, seed=args.seed, decontaminate=args.decontaminate,
                decontam_ngram=args.decontam_ngram, decontam_report_only=args.decontam_report_only, ray=args.ray)

    return _data_errors("prepare", run)

@command("corpus", "build the site-packages corpus: installed packages' sources, split train / valid by package",
         "  z2all corpus --out runs/sitepkg --max-mb 300\n"
         "  z2all corpus --out runs/sitepkg --valid-package numpy --valid-package requests --seed 1\n"
         "  z2all prepare --input runs/sitepkg --tokenizer runs/tok --out runs/data   # keeps the package split")
def _corpus(p):
    p.add_argument("--name", default="site-packages", choices=["site-packages"], help="the corpus to build")
    p.add_argument("--out", required=True,
                   help="output directory: train.jsonl, valid.jsonl and manifest.json (new, empty or an earlier "
                        "corpus output, replaced atomically)")
    p.add_argument("--site-packages", nargs="+", action="extend", default=None, metavar="DIR",
                   help="site-packages directories to read (default: the running Python's)")
    p.add_argument("--valid-fraction", type=float, default=0.05, help="share of packages held out (by name hash)")
    p.add_argument("--valid-package", action="append", default=None, metavar="NAME",
                   help="hold out exactly these packages instead (repeat the option)")
    p.add_argument("--seed", type=int, default=0, help="seed of the package split and of the order the cap takes")
    p.add_argument("--max-mb", type=float, default=None, help="cap on the corpus text, in MB (1e6 bytes)")

    def run(args):
        import time

        from zero2all.corpus.readers import write_jsonl
        from zero2all.corpus.site_packages import build_site_packages_corpus
        from zero2all.fileio import atomic_dir, claim_output_dir, save_json

        if args.max_mb is not None and not args.max_mb > 0:
            raise ValueError(f"--max-mb: {args.max_mb} must be > 0")
        if not 0.0 <= args.valid_fraction < 1.0:
            raise ValueError(f"--valid-fraction: {args.valid_fraction} must be in [0, 1)")
        for d in args.site_packages or []:
            if not os.path.isdir(d):
                raise ValueError(f"--site-packages {d}: no such directory; name a site-packages folder")
        claim_output_dir(args.out, "corpus", inputs=args.site_packages or [])
        t0 = time.perf_counter()
        corpus = build_site_packages_corpus(args.site_packages, valid_fraction=args.valid_fraction, seed=args.seed,
                                            max_bytes=None if args.max_mb is None else int(args.max_mb * 1e6),
                                            valid_packages=args.valid_package)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)

        def flat(split):
            for rec in corpus.records(split):
                yield {"id": rec["id"], "title": rec["title"], "category": "code", "content": rec["content"],
                       **rec["others"]}

        with atomic_dir(args.out, kind="corpus") as tmp:
            for split in ("train", "valid"):
                write_jsonl(flat(split), Path(tmp) / f"{split}.jsonl")
            save_json(corpus.manifest, Path(tmp) / "manifest.json")
        m = corpus.manifest
        print(f"site-packages corpus -> {args.out}: train {len(m['packages']['train'])} packages, "
              f"{m['files']['train']:,} files, {m['bytes']['train'] / 1e6:.1f} MB; valid "
              f"{len(m['packages']['valid'])} packages, {m['files']['valid']:,} files, "
              f"{m['bytes']['valid'] / 1e6:.1f} MB; {m['dropped']['duplicate']:,} duplicate files dropped "
              f"({m['dropped']['duplicate_bytes'] / 1e6:.1f} MB); {time.perf_counter() - t0:.1f} s")

    return _data_errors("corpus", run)


@command("clean", "clean corpora: normalise, drop exact and near duplicates, apply quality rules, mask PII",
         "  z2all clean --input stdlib --out runs/clean\n"
         "  z2all clean --input web=data/web --input zh=data/zh.jsonl.zst --out clean --workers 8 "
         "dedup.threshold=0.7\n"
         "  z2all clean --input data --out clean --config clean.toml --dry-run   # sample decisions, write nothing")
def _clean(p):
    # nargs="*": a NAME=PATH source looks like a key=value override and is taken out before parsing (see run)
    p.add_argument("--input", nargs="*", action="extend", required=True, metavar="[NAME=]PATH",
                   help="sources: files, directories, globs or 'stdlib'; NAME=PATH names a source")
    p.add_argument("--out", required=True, help="output directory: clean-NNNNN.jsonl shards and report.{json,md,png}; "
                                                "re-running resumes an interrupted run")
    p.add_argument("--config", default=None, help=".toml file with a [clean] table (default: the published "
                                                  "thresholds)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: clean.workers, 0 = all cores)")
    p.add_argument("--dry-run", action="store_true",
                   help="run on the first clean.dry_run_docs records and print the decisions; write nothing")
    p.add_argument("--max-docs", type=int, default=None, help="stop after this many input records")
    _decontam_args(p)
    _ray_arg(p)
    _reader_args(p)
    _overrides(p)

    def run(args):
        import dataclasses

        from zero2all.corpus.clean import CleanConfig, clean, load_clean_config
        from zero2all.corpus.clean.report import render_markdown

        # a token NAME=PATH whose NAME is no [clean] key is a named source, not an override; so is one whose NAME
        # is a whole sub-table (`code=data/code`: a table is never set by one value)
        fields = dataclasses.fields(CleanConfig)
        keys = {f.name for f in fields} | {"clean"}
        tables = {f.name for f in fields if dataclasses.is_dataclass(f.default_factory)}

        def is_override(token: str) -> bool:
            key = token.split("=", 1)[0]
            return key.split(".")[0] in keys and key not in tables

        overrides = [o for o in args.overrides if is_override(o)]
        inputs = list(args.input) + [o for o in args.overrides if o not in overrides]
        if not inputs:
            raise ValueError("--input: no source given")
        cfg = load_clean_config(args.config, overrides)
        if args.workers is not None:
            cfg.workers = args.workers
        cfg.decontam.sets += args.decontaminate or []
        cfg.decontam.report_only |= args.decontam_report_only
        cfg.validate()
        report = clean(inputs, args.out, cfg, text_field=args.text_field, txt_mode=args.txt_mode,
                       strict=args.strict, dry_run=args.dry_run, max_docs=args.max_docs, ray=args.ray)
        if args.dry_run:
            print(render_markdown(report), end="")
        else:
            print(f"wrote {len(report['shards'])} shard(s), report.md, report.json and report.png to {args.out}")

    return _data_errors("clean", run)

# ---------------------------------------------------------------------------------------------------- training
# (pretrain, sft, dpo, demo)


@command("pretrain", "pretrain a model on token shards (or synthetic tokens) with the shared trainer",
         "  z2all pretrain --config tiny --data runs/demo/data --out runs/tiny\n"
         "  z2all pretrain --config tiny --data runs/demo/data --out runs/tiny --resume auto train.max_steps=900\n"
         "  z2all pretrain --config z2all-1.1b --out runs/1b-synthetic train.max_steps=50   # synthetic data")
def _pretrain(p):
    p.add_argument("--config", default="tiny", help="preset name or .toml path")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--dry-run", action="store_true",
                   help="train nothing: build the plan and every rank's shards of a --world-rank mesh in this "
                        "process (fake process group, meta tensors) and print each rank's parameters and memory "
                        "against --gpu, and the communication per step")
    p.add_argument("--world", type=int, default=1, help="--dry-run: the number of ranks (processes) to try")
    p.add_argument("--gpu", default="h100", help="--dry-run: the GPU whose memory each rank is checked against "
                                                 "(a name of `z2all estimate --gpu`)")
    _overrides(p)
    flags = _config_flags(p, TRAIN_SECTIONS, ("--data",) + TRAIN_SHORT, extra=PRETRAIN_DATA)

    def run(args):
        from zero2all.config import build_config

        values, sources = flags.given(args)
        cfg = build_config(args.config, args.overrides, values, sources=sources)
        if args.dry_run:
            from zero2all.distributed.dryrun import dry_run, format_dry_run

            print(format_dry_run(dry_run(cfg, args.world, args.gpu), args.config))
            return
        from zero2all.train.trainer import pretrain  # after the config is checked: a bad one fails at once

        pretrain(cfg, show_progress=not args.no_progress)

    return run


@command("ladder", "a scaling ladder: >= 5 sizes at compute-optimal tokens, fit L(N, D), predict a larger run",
         "  z2all ladder --config tiny --data runs/data --out runs/ladder\n"
         "  z2all ladder --config tiny --data runs/data --out runs/ladder --depths 2,3,4,5,6 --ratio 10 --ratio 40 "
         "--check\n"
         "  z2all ladder --config tiny --data runs/data --out runs/ladder --flops 1e15 --predict-depth 12")
def _ladder(p):
    p.add_argument("--config", default="tiny", help="base preset or .toml: vocabulary, context, training settings")
    p.add_argument("--out", required=True, help="ladder folder: rungs/, ladder.json, ladder.png (resumable)")
    p.add_argument("--depths", default="2,3,4,5,6", help="the rungs' depths, comma-separated (at least 5)")
    p.add_argument("--aspect", type=int, default=64, help="hidden_dim = aspect x depth")
    p.add_argument("--head-dim", type=int, default=64, help="attention head size (n_heads = hidden / head_dim)")
    p.add_argument("--ratio", type=float, action="append", default=None,
                   help="tokens per parameter (default 20; repeat for several ratios, which identifies L(N, D))")
    p.add_argument("--flops", type=float, default=None, help="a FLOP budget per rung instead: D = C / (6 N)")
    p.add_argument("--predict-depth", type=int, default=None,
                   help="the larger run to predict (default: the smallest depth with >= 4x the largest rung's N)")
    p.add_argument("--predict-tokens", type=float, default=None, help="its tokens (default: ratio x its N)")
    p.add_argument("--check", action="store_true", help="then train the predicted run and report the error")
    p.add_argument("--gpu", default="h100", help="GPU of the time prediction (a name of `z2all estimate --gpu`)")
    p.add_argument("--mfu", type=float, default=None,
                   help="MFU of the time prediction (default: the largest rung's measured MFU, else 0.4)")
    p.add_argument("--resamples", type=int, default=200, help="bootstrap resamples of the fit's uncertainty")
    p.add_argument("--min-updates", type=int, default=1000,
                   help="updates every rung needs: a smaller micro-batch where the base one gives fewer; a rung "
                        "still short at micro-batch 1 is left out of the fit (0: off)")
    p.add_argument("--warmup-fraction", type=float, default=0.02,
                   help="each run's warmup as a fraction of its updates (replaces train.warmup_steps)")
    p.add_argument("--lr-width-exponent", type=float, default=0.5,
                   help="rung lr = train.lr x (predicted run's hidden / rung's hidden)^x (0: one lr for all)")
    _overrides(p)
    flags = _config_flags(p, TRAIN_SECTIONS, ("--data", "--device"), extra=PRETRAIN_DATA)  # --out: the ladder's

    def run(args):
        from zero2all.accounting import get_gpu
        from zero2all.config import ConfigError, build_config
        from zero2all.train.ladder import run_ladder

        try:
            depths = [int(x) for x in args.depths.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--depths {args.depths!r}: expected comma-separated integers, e.g. 2,3,4,5,6") from None
        if any(d < 1 for d in depths):
            raise ConfigError(f"--depths {args.depths!r}: each depth must be >= 1")
        ratios = args.ratio or [20.0]
        for name, value in (("--ratio", min(ratios)), ("--flops", args.flops), ("--aspect", args.aspect),
                            ("--head-dim", args.head_dim), ("--predict-tokens", args.predict_tokens),
                            ("--predict-depth", args.predict_depth), ("--resamples", args.resamples)):
            if value is not None and not value > 0:
                raise ConfigError(f"{name}: {value} must be > 0")
        if args.min_updates < 0:
            raise ConfigError(f"--min-updates: {args.min_updates} must be >= 0")
        if not 0 <= args.warmup_fraction < 1:
            raise ConfigError(f"--warmup-fraction: {args.warmup_fraction} must be in [0, 1)")
        if not 0 <= args.lr_width_exponent <= 2:
            raise ConfigError(f"--lr-width-exponent: {args.lr_width_exponent} must be in [0, 2] (1: lr ~ 1 / width)")
        if args.flops and args.ratio:
            raise ConfigError("--flops and --ratio: give one (a FLOP budget per rung, or tokens per parameter)")
        if args.mfu is not None and not 0 < args.mfu <= 1:
            raise ConfigError(f"--mfu {args.mfu}: must be in (0, 1]")
        get_gpu(args.gpu)
        values, sources = flags.given(args)
        cfg = build_config(args.config, args.overrides, values, sources=sources)
        if args.predict_depth is not None and args.predict_depth <= max(depths):
            raise ConfigError(f"--predict-depth {args.predict_depth}: must be larger than the largest rung "
                              f"({max(depths)})")
        run_ladder(cfg, args.out, depths=depths, aspect=args.aspect, head_dim=args.head_dim, ratios=ratios,
                   flops=args.flops, predict_depth=args.predict_depth, predict_tokens=args.predict_tokens,
                   check=args.check, gpu=args.gpu, mfu=args.mfu, resamples=args.resamples,
                   min_updates=args.min_updates, warmup_fraction=args.warmup_fraction,
                   lr_width_exponent=args.lr_width_exponent)

    return _data_errors("ladder", run)


# pretraining's --data is the token-shard directory (post-training's is post.data)
PRETRAIN_DATA = {"--data": "data.path"}


def _prepare_chat_data(p, kind: str, records: str):
    """The arguments and the run of ``prepare-sft`` / ``prepare-dpo`` (one writer, ``sft_shards.prepare_sft``)."""
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="FILE",
                   help=f"jsonl / jsonl.gz / json files of {records}")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (with the chat template tokens)")
    p.add_argument("--out", required=True, help="output directory (written whole, then renamed into place)")
    p.add_argument("--valid-fraction", type=float, default=0.0, help="share of records held out (by content)")
    p.add_argument("--workers", type=int, default=1, help="rendering processes")
    p.add_argument("--skip-bad", action="store_true", help="skip and count malformed records instead of stopping")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a previous output of this command in --out (never a folder of other files)")
    _ray_arg(p)

    def run(args):
        from zero2all.data.sft_shards import prepare_sft

        prepare_sft(args.input, args.tokenizer, args.out, valid_fraction=args.valid_fraction,
                    on_error="skip" if args.skip_bad else "raise", workers=args.workers, overwrite=args.overwrite,
                    command="z2all " + " ".join(sys.argv[1:]), kind=kind, ray=args.ray)

    return _data_errors(f"prepare-{kind}", run)


@command("prepare-sft", "render chat / instruction jsonl once into SFT token files + index (for large sets)",
         "  z2all prepare-sft --input chats.jsonl --tokenizer runs/demo/tokenizer --out runs/sft-data\n"
         "  z2all prepare-sft --input a.jsonl b.jsonl.gz --tokenizer tok --out sft-data --valid-fraction 0.01 "
         "--workers 8")
def _prepare_sft(p):
    return _prepare_chat_data(p, "sft", "instruction or conversation records")


@command("prepare-dpo", "render preference-pair jsonl once into DPO token files + index (for large sets)",
         "  z2all prepare-dpo --input pairs.jsonl --tokenizer runs/demo/tokenizer --out runs/dpo-data\n"
         "  z2all dpo --init runs/sft/final --data runs/dpo-data          # then train from the directory")
def _prepare_dpo(p):
    return _prepare_chat_data(p, "dpo", '{"prompt" | "conversations", "chosen", "rejected"} records')


def _posttrain_args(p, stage: str, out_default: str, data_help: str, short: tuple[str, ...] = ()):
    """The options shared by sft / dpo / reward / rl (``short``: the stage's own short flags), and the config flags;
    ``out_default``: the stage's train.out_dir default (``posttrain.STAGE_TRAIN_DEFAULTS``, not imported here to
    keep --help fast)."""
    p.add_argument("--config", default=None, help=".toml file with train / post sections (model: ops only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    sections = ("train", "data", "parallel", "post") + (("rl",) if stage == "rl" else ()) + POST_MODEL_KEYS
    return _config_flags(p, sections, POST_SHORT + TRAIN_SHORT + short, exclude=("data.path",),
                         extra={"--data": "post.data"},
                         notes={"--out": f"default {out_default}", "--data": data_help},
                         options={"--init": {"required": True, "metavar": "DIR"},
                                  "--data": {"required": True, "metavar": "FILE"},
                                  "--valid": {"metavar": "FILE"}, "--lora-targets": {"metavar": "MODULE"}})


def _posttrain_run(stage: str, flags):
    def run(args):
        from zero2all.data.chat import ChatDataError
        from zero2all.data.sft_shards import SFTShardError
        from zero2all.train import posttrain

        values, sources = flags.given(args)
        try:
            cfg = posttrain.posttrain_config(stage, args.config, args.overrides, values, sources=sources)
            getattr(posttrain, stage)(cfg, show_progress=not args.no_progress)
        except (ChatDataError, SFTShardError) as e:
            print(f"z2all {stage}: error: {e}", file=sys.stderr)
            return 2

    return run


@command("sft", "supervised fine-tuning on chat data (loss on assistant tokens only), full or LoRA",
         "  z2all sft --init runs/demo/final --data instructions.jsonl --out runs/sft train.lr=1e-4\n"
         "  z2all sft --init runs/demo/final --data runs/sft-data --out runs/sft --packing pad\n"
         "  z2all sft --init hf/llama --data chats.jsonl --out runs/lora --lora-rank 16 --lora-alpha 32 "
         "train.lr=2e-4\n"
         "  z2all sft --init runs/demo/final --data chats.jsonl --out runs/sft --resume auto train.max_steps=2000")
def _sft(p):
    flags = _posttrain_args(p, "sft", "runs/sft", "chat / instruction records, or one `z2all prepare-sft` "
                            "directory", ("--packing",))
    _overrides(p)
    return _posttrain_run("sft", flags)


@command("dpo", "direct preference optimisation on {prompt|conversations, chosen, rejected} pairs",
         "  z2all dpo --init runs/sft/final --data pairs.jsonl --out runs/dpo --beta 0.1\n"
         "  z2all dpo --init runs/sft/final --data pairs.jsonl --out runs/dpo --precompute-ref   # one model in "
         "memory\n"
         "  z2all dpo --init runs/sft/final --ref runs/sft/final --data pairs.jsonl --out runs/dpo-lora \\\n"
         "      --lora-rank 8 train.lr=5e-5")
def _dpo(p):
    flags = _posttrain_args(p, "dpo", "runs/dpo", "preference pairs, or one `z2all prepare-dpo` directory",
                            ("--beta", "--ref", "--precompute-ref"))
    _overrides(p)
    return _posttrain_run("dpo", flags)


@command("reward", "train a reward model (scalar head, Bradley-Terry) on {prompt, chosen, rejected} pairs",
         "  z2all reward --init runs/sft/final --data pairs.jsonl --out runs/rm --valid-fraction 0.1\n"
         "  z2all reward --init runs/sft/final --data pairs.jsonl --out runs/rm --export-hf runs/rm-hf")
def _reward(p):
    flags = _posttrain_args(p, "reward", "runs/reward", "preference pairs, or one `z2all prepare-dpo` directory")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="also write an HF LlamaForSequenceClassification directory (num_labels 1)")
    _overrides(p)

    def run(args):
        from zero2all.train import posttrain
        from zero2all.train.reward import reward

        values, sources = flags.given(args)
        cfg = posttrain.posttrain_config("reward", args.config, args.overrides, values, sources=sources)
        reward(cfg, show_progress=not args.no_progress, export_hf=args.export_hf)

    return run


@command("export-reward-hf", "write a `z2all reward` model as an HF LlamaForSequenceClassification directory",
         "  z2all export-reward-hf --ckpt runs/rm/final --out runs/rm-hf")
def _export_reward_hf(p):
    p.add_argument("--ckpt", required=True, help="a `z2all reward` final/ directory")
    p.add_argument("--out", required=True)

    def run(args):
        from zero2all.fileio import claim_output_dir
        from zero2all.train.reward import export_reward_hf, load_reward_model

        claim_output_dir(args.out, "export-reward-hf", inputs=[args.ckpt])
        print(f"wrote {export_reward_hf(load_reward_model(args.ckpt), args.out, args.ckpt)}")

    return run


@command("rl", "online RL (PPO with a value head, or GRPO) with rollouts from the model itself",
         "  z2all rl --algo grpo --init runs/sft/final --data prompts.jsonl --out runs/grpo \\\n"
         "      --reward-fn zero2all.train.rl_tasks:exact_match --group-size 8 train.lr=1e-5\n"
         "  z2all rl --algo ppo --init runs/sft/final --data prompts.jsonl --out runs/ppo --reward-model runs/rm/final"
         "\n  z2all rl --algo grpo --init runs/sft/final --data prompts.jsonl --lora-rank 16 --reward-fn m:f")
def _rl(p):
    flags = _posttrain_args(p, "rl", "runs/rl", "jsonl / json files of prompt records {\"prompt\": ...}; "
                            "the other fields reach the reward function",
                            ("--algo", "--reward-fn", "--reward-model", "--group-size", "--max-new-tokens",
                             "--kl-coef", "--kl-estimator", "--epochs", "--ref"))
    _overrides(p)

    def run(args):
        from zero2all.train import posttrain
        from zero2all.train.rl_run import rl

        values, sources = flags.given(args)
        cfg = posttrain.posttrain_config("rl", args.config, args.overrides, values, sources=sources)
        rl(cfg, show_progress=not args.no_progress)

    return run


@command("demo", "the whole pipeline offline on the embedded stdlib corpus: tokenizer, shards, a tiny model, samples",
         "  z2all demo --out runs/demo\n  z2all demo --out runs/demo --minutes 1")
def _demo(p):
    p.add_argument("--out", default="runs/demo", help="output folder")
    p.add_argument("--minutes", type=float, default=None,
                   help="pretraining wall-clock budget (default 4): training stops when it is spent; the LR "
                        "schedule's length is fixed from the rate of the first updates (at most 3,000 updates)")
    p.add_argument("--steps", type=int, default=None, help="training steps (overrides --minutes)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2, help="CPU threads for training (default 2)")
    p.add_argument("--sft-minutes", type=float, default=1.5,
                   help="time budget of the SFT stage on docstring instructions (0 = skip it)")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT steps (overrides --sft-minutes; 0 = skip it)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over: retrain the tokenizer, rewrite the shards, move earlier checkpoints aside "
                        "(default: reuse what --out holds and continue an interrupted run)")
    _overrides(p)

    def run(args):
        from zero2all.demo import run_demo

        run_demo(args.out, minutes=args.minutes, steps=args.steps, vocab_size=args.vocab_size,
                 threads=args.threads, overrides=list(args.overrides), sft_minutes=args.sft_minutes,
                 sft_steps=args.sft_steps, overwrite=args.overwrite)

    return run

# ---------------------------------------------------------------------------------------------------- inference
# (generate, chat, serve)


def _sampling_args(p, max_new_tokens: int, temperature: float):
    p.add_argument("--ckpt", required=True, help="checkpoint directory (ours, HF Llama, or with a LoRA adapter)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    p.add_argument("--compile", action="store_true",
                   help="CUDA: compile the decode step with torch.compile before capturing it (slow first call)")


def _tokenizer_override(args):
    """The tokenizer named by ``--tokenizer``, or None (then the checkpoint's own is used). Checked against the
    checkpoint first: an error when its ids exceed the model's vocabulary, a warning when it is not the tokenizer
    the model was trained with."""
    if not args.tokenizer:
        return None
    from zero2all.model.io import check_inference_tokenizer
    from zero2all.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    for line in check_inference_tokenizer(args.ckpt, tok, args.tokenizer):
        print(line, file=sys.stderr)
    return tok


def _load_generator(args):
    from zero2all.config import ConfigError
    from zero2all.infer.generate import Generator, SamplingParams, load_for_inference

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                            stop=tuple(getattr(args, "stop", None) or ()))
    try:  # before loading the model, and before a prompt is echoed: `--top-p: must be in (0, 1], got 2.0`
        params.validate()
    except ValueError as e:
        field, sep, rest = str(e).partition(":")
        raise ConfigError(f"--{field.replace('_', '-')}{sep}{rest}" if sep else str(e)) from None
    model, tokenizer = load_for_inference(args.ckpt, device=args.device, dtype=args.dtype,
                                          tokenizer=_tokenizer_override(args))
    return Generator(model, tokenizer, compile=args.compile), params


def _require_chat_tokens(tok, args, what: str) -> None:
    """A chat needs the ChatML role tokens; say so before any generation (a ConfigError: one line, exit 2)."""
    if getattr(tok, "im_start_id", None) is None or getattr(tok, "im_end_id", None) is None:
        from zero2all.config import ConfigError

        source = f"--tokenizer {args.tokenizer}" if args.tokenizer else f"the tokenizer of {args.ckpt}"
        raise ConfigError(f"{what}: {source} has no <|im_start|>/<|im_end|> chat tokens, so it cannot render a chat; "
                          f"use a tokenizer trained with `z2all train-tokenizer` (it has them)"
                          + (" or drop --chat" if what == "--chat" else ", or `z2all generate` for plain text"))


@command("generate", "continue a prompt (streamed to the terminal); several --prompt run as one batch",
         "  z2all generate --ckpt runs/demo/final --prompt 'def parse_args(' --max-new-tokens 64\n"
         "  z2all generate --ckpt runs/demo/sft/final --chat --prompt 'Write the docstring of os.path.join'\n"
         "  z2all generate --ckpt runs/demo/final --prompt 'import ' --temperature 0.8 --top-p 0.95 --seed 1")
def _generate(p):
    _sampling_args(p, max_new_tokens=128, temperature=0.8)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system prompt (with --chat)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-document-start", action="store_true",
                   help="do not put the end-of-text separator in front of a text prompt (by default the prompt "
                        "starts a new document, as every document does in the pretraining data)")
    p.add_argument("--draft-model", default=None, metavar="CKPT",
                   help="speculative decoding with this smaller model sharing the tokenizer as the draft (greedy: "
                        "the same tokens as without; sampled: the same distribution, not the same tokens per seed)")
    p.add_argument("--speculative-tokens", type=int, default=None, metavar="K",
                   help="with --draft-model: draft tokens the draft model proposes a step (default 4)")

    def run(args):
        import time

        from zero2all.config import ConfigError

        if args.speculative_tokens is not None and args.draft_model is None:
            raise ConfigError("--speculative-tokens needs --draft-model CKPT")
        if args.draft_model is not None:
            from zero2all.infer.speculative import check_draft_checkpoint

            if args.speculative_tokens is None:
                args.speculative_tokens = 4
            if args.speculative_tokens < 1:
                raise ConfigError(f"--speculative-tokens {args.speculative_tokens}: must be >= 1 (e.g. 4)")
            check_draft_checkpoint(args.draft_model, args.ckpt)
        generator, params = _load_generator(args)
        params.stop = tuple(args.stop)
        tok = generator.tokenizer
        if args.chat:
            _require_chat_tokens(tok, args, "--chat")
            head = [{"role": "system", "content": args.system}] if args.system else []
            prompts = [tok.apply_chat_template(head + [{"role": "user", "content": t}], add_generation_prompt=True)
                       for t in args.prompt]
        else:
            start = [] if args.no_document_start or tok.eos_id is None else [tok.eos_id]
            prompts = [start + tok.encode(t) for t in args.prompt]
        spec = None
        if args.draft_model is not None:
            from zero2all.infer.generate import load_for_inference
            from zero2all.infer.speculative import generate_with_draft

            draft, _ = load_for_inference(args.draft_model, device=args.device, dtype=args.dtype, tokenizer=tok)

            def run_batch(on_event=None):
                nonlocal spec
                outs, spec = generate_with_draft(generator, draft, args.speculative_tokens, prompts, params, on_event)
                return outs
        else:
            def run_batch(on_event=None):
                return generator.generate(prompts, params, on_event=on_event)
        t0 = time.perf_counter()
        try:
            if len(prompts) == 1:
                if not args.chat:
                    print(args.prompt[0], end="", flush=True)
                outs = run_batch(lambda ev: print(ev.text, end="", flush=True))
                print()
            else:
                outs = run_batch()
        except ValueError as e:
            print(f"z2all generate: error: {e}", file=sys.stderr)
            return 2
        if len(prompts) > 1:
            for i, (text, out) in enumerate(zip(args.prompt, outs)):
                print(f"--- [{i}] {text}{out.text}")
        seconds = time.perf_counter() - t0
        n = sum(o.num_generated for o in outs)
        accepted = ("" if spec is None else f"; draft tokens accepted {spec['spec_accepted']} of "
                    f"{spec['spec_drafted']} ({spec['spec_acceptance_rate']:.0%})")
        print(f"({n} tokens in {seconds:.2f} s, {n / max(seconds, 1e-9):.1f} tokens/s; finish: "
              f"{', '.join(o.finish_reason for o in outs)}{accepted})", file=sys.stderr)

    return run


@command("chat", "chat with a model in the terminal (history, system prompt, streamed replies)",
         "  z2all chat --ckpt runs/demo/sft/final\n"
         "  z2all chat --ckpt runs/demo/sft/final --system 'You answer with Python code.' --temperature 0.3\n"
         "  (at the prompt: /reset clears the history, /system TEXT sets a system prompt, /exit leaves)")
def _chat(p):
    _sampling_args(p, max_new_tokens=256, temperature=0.7)
    p.add_argument("--system", default=None, help="system prompt")

    def run(args):
        from zero2all.infer.chat import ChatSession, chat_loop

        generator, params = _load_generator(args)
        _require_chat_tokens(generator.tokenizer, args, "chat")
        chat_loop(ChatSession(generator, system=args.system, params=params))

    return run


@command("serve", "serve a model over HTTP with OpenAI-compatible /v1/chat/completions, /v1/completions and a "
         "chat page at /",
         "  z2all serve --ckpt runs/demo/sft/final --port 8000 --model-name sft   (then open http://127.0.0.1:8000/)\n"
         "  Z2ALL_API_KEY=$(openssl rand -hex 16) z2all serve --ckpt runs/demo/sft/final --host 0.0.0.0\n"
         "  curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
         "       -d '{\"model\": \"sft\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'")
def _serve(p):
    p.add_argument("--ckpt", required=True, help="checkpoint directory (ours, HF Llama, or with a LoRA adapter)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the directory name)")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="largest max_tokens a request may ask for")
    p.add_argument("--max-queue", type=int, default=64,
                   help="sequences that may wait for a batch row while all rows are busy; more get HTTP 429")
    p.add_argument("--max-batch", type=int, default=None,
                   help="sequences decoded together (default: 8 on CPU; on CUDA 256, with the column engine fewer "
                        "(128, 64, 32, at least 16) when 256 rows' cache would take over half the free GPU memory)")
    p.add_argument("--engine", default="auto", choices=["auto", "paged", "column"],
                   help="paged: a pool of KV blocks with prefix caching and chunked prefill; column: one cache row "
                        "per sequence, with the fused decode step and CUDA graphs; auto (default): column on CUDA "
                        "(the faster there, as measured), paged elsewhere")
    p.add_argument("--block-size", type=int, default=16,
                   help="paged engine: tokens per KV block (a power of two >= 16 for the GPU kernel)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="paged engine: GiB for the KV block pool (default: every batch row at the full context)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="paged engine: tokens one step computes (a decoding sequence's 1 each, the rest for prompts, "
                        "so a long prompt is computed in chunks while running streams keep going)")
    p.add_argument("--speculative-ngram", type=int, default=0, metavar="K",
                   help="paged engine: prompt-lookup speculative decoding for greedy requests, up to K draft tokens "
                        "a step taken from earlier text (the same tokens as without; 0 = off)")
    p.add_argument("--draft-model", default=None, metavar="CKPT",
                   help="paged engine: speculative decoding with this smaller model sharing the tokenizer as the "
                        "draft (greedy requests: the same tokens as without; sampled ones: the same distribution; "
                        "exclusive with --speculative-ngram)")
    p.add_argument("--speculative-tokens", type=int, default=None, metavar="K",
                   help="with --draft-model: draft tokens the draft model proposes a step (default 4)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="paged engine: compute every prompt in full instead of reusing cached blocks of earlier ones")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill a prompt that is computed alone (up to 2,048 new tokens) by replaying a CUDA graph of "
                        "its length bucket (32, 64, ..., 2048) instead of launching every operation from the host "
                        "(default: on where the decode step is graphed, i.e. on CUDA; captured at start-up)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C: seconds to let running and queued requests finish before cancelling "
                        "them (exit status 143 if any was cancelled; a second signal cancels at once)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    p.add_argument("--compile", action="store_true", help="CUDA: compile the decode step before capturing it")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: the Z2ALL_API_KEY "
                        "environment variable; none: open, which is fine on 127.0.0.1 only)")
    p.add_argument("--cors-origin", default=None,
                   help="let pages of this one origin (e.g. https://tools.example.org) call the API from a browser; "
                        "default: no CORS header (only the page served here can)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a whole request (request line, headers, body) may take to arrive, and a stalled "
                        "write may wait for a client that reads nothing; then the connection is closed")
    p.add_argument("--max-connections", type=int, default=256,
                   help="connections open at once; when full, the one that has waited longest for its request is "
                        "closed to make room, or the new one gets 503 if all are being answered")

    def run(args):
        import math
        import os

        from zero2all.config import ConfigError

        try:
            from zero2all.infer.server import AddressError, serve
        except ImportError as e:  # starlette / uvicorn / pydantic: the serve extra
            print(f"z2all serve: error: {e.name or e} is not installed; install the server's packages with "
                  "pip install 'zero2all[serve]'", file=sys.stderr)
            return 2

        # values that can never work are refused before the model is loaded
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port {args.port}: must be 0-65535 (0 picks a free port)")
        for flag, value, least in (("--max-tokens-limit", args.max_tokens_limit, 1), ("--max-queue", args.max_queue, 0),
                                   ("--max-batch", args.max_batch, 1)):
            if value is not None and value < least:
                raise ConfigError(f"{flag} {value}: must be at least {least}")
        if args.block_size < 1 or (args.engine != "column" and args.block_size & (args.block_size - 1)):
            raise ConfigError(f"--block-size {args.block_size}: must be a power of two (e.g. 16)")
        if args.speculative_ngram < 0 or (args.speculative_ngram and args.engine == "column"):
            raise ConfigError(f"--speculative-ngram {args.speculative_ngram}: must be >= 0, with --engine paged")
        if args.speculative_tokens is not None and args.draft_model is None:
            raise ConfigError("--speculative-tokens needs --draft-model CKPT (prompt lookup: --speculative-ngram K)")
        if args.draft_model is not None:
            if args.speculative_ngram:
                raise ConfigError("--draft-model and --speculative-ngram are exclusive: draft tokens from a draft "
                                  "model or by prompt lookup, not both")
            if args.engine == "column":
                raise ConfigError("--draft-model: speculative decoding needs --engine paged (or auto)")
            if args.speculative_tokens is None:
                args.speculative_tokens = 4
            if args.speculative_tokens < 1:
                raise ConfigError(f"--speculative-tokens {args.speculative_tokens}: must be >= 1 (e.g. 4)")
        if (args.speculative_ngram or args.draft_model) and args.engine == "auto":
            args.engine = "paged"           # asking for a paged engine's feature picks that engine
        if args.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens {args.max_num_batched_tokens}: must be at least 1 (e.g. 2048)")
        if args.kv_cache_gb is not None and not (math.isfinite(args.kv_cache_gb) and args.kv_cache_gb > 0):
            raise ConfigError(f"--kv-cache-gb {args.kv_cache_gb}: must be a number of GiB > 0 (e.g. 8)")
        if not args.read_timeout > 0:
            raise ConfigError(f"--read-timeout must be a number of seconds > 0 (e.g. 30), got {args.read_timeout:g}")
        if args.max_connections < 1:
            raise ConfigError(f"--max-connections must be >= 1 (e.g. 256), got {args.max_connections}")
        if not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
            raise ConfigError(f"--drain-timeout {args.drain_timeout}: must be a number of seconds >= 0")
        try:  # a busy port or a bad host: one line naming both (exit 1, or 2 for a host that can never work)
            return serve(args.ckpt, host=args.host, port=args.port, tokenizer=_tokenizer_override(args),
                         model_name=args.model_name, device=args.device, dtype=args.dtype,
                         max_tokens_limit=args.max_tokens_limit, max_queue=args.max_queue, max_batch=args.max_batch,
                         drain_timeout=args.drain_timeout, compile=args.compile,
                         api_key=args.api_key or os.environ.get("Z2ALL_API_KEY") or None,
                         cors_origin=args.cors_origin, read_timeout=args.read_timeout,
                         max_connections=args.max_connections,
                         engine_options=dict(engine=args.engine, block_size=args.block_size,
                                             kv_cache_gb=args.kv_cache_gb,
                                             max_num_batched_tokens=args.max_num_batched_tokens,
                                             speculative_ngram=args.speculative_ngram,
                                             speculative_tokens=args.speculative_tokens or 0,
                                             prefix_caching=not args.no_prefix_caching,
                                             prefill_graphs=args.prefill_graphs),
                         draft_model=args.draft_model)
        except AddressError as e:
            print(f"z2all serve: error: {e}", file=sys.stderr)
            return e.exit_code

    return run

# ---------------------------------------------------------------------------------------------------- evaluation
# (eval)


@command("eval", "token loss, perplexity and bits per byte of a model on text files, overall and per source; "
         "or lm-evaluation-harness tasks (--tasks)",
         "  z2all eval --ckpt runs/demo/final --data valid.jsonl\n"
         "  z2all eval --ckpt runs/demo/final --data en=en.jsonl zh=zh.jsonl --json eval.json --max-docs 500\n"
         "  z2all eval --ckpt hf/llama --data docs/*.txt --device cuda --dtype bfloat16 --stride 512\n"
         "  z2all eval --ckpt runs/demo/final --tasks my_task --include-path tasks/ --limit 100   # pip install "
         "'zero2all[eval]'")
def _eval(p):
    p.add_argument("--ckpt", required=True, help="checkpoint directory (ours, HF Llama, or with a LoRA adapter)")
    p.add_argument("--data", nargs="+", action="extend", default=None, metavar="[NAME=]PATH",
                   help="json / jsonl / parquet / txt files, directories or globs; NAME=PATH names a source "
                        "(default: a record's data_src field, else the file stem)")
    p.add_argument("--tasks", nargs="+", action="extend", default=None, metavar="NAME",
                   help="lm-evaluation-harness tasks (names or comma lists) instead of --data: the harness's "
                        "simple_evaluate with this model (needs pip install 'zero2all[eval]')")
    p.add_argument("--include-path", nargs="+", action="extend", default=None, metavar="DIR",
                   help="--tasks: directories of task YAML files (local tasks, e.g. over a local jsonl)")
    p.add_argument("--limit", type=float, default=None,
                   help="--tasks: at most this many examples per task (a fraction if below 1)")
    p.add_argument("--num-fewshot", type=int, default=None, help="--tasks: few-shot examples per prompt")
    p.add_argument("--seed", type=int, default=1234, help="--tasks: seed of few-shot sampling and generation")
    p.add_argument("--bootstrap-iters", type=int, default=100000,
                   help="--tasks: bootstrap resamples for the standard errors (0: none)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the numbers to this JSON file (a new "
                                                               "file, or an existing one with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file (refused otherwise)")
    p.add_argument("--max-docs", type=int, default=None, help="score at most this many documents")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--context", type=int, default=None, help="window length (default: the model's max_seq_len)")
    p.add_argument("--stride", type=int, default=None,
                   help="ids a window moves over a long document (default context // 2): every token is scored "
                        "once with at least context - stride ids of left context")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _reader_args(p)

    def run(args):
        if (args.data is None) == (args.tasks is None):
            raise ValueError("give either --data (bits per byte on text files) or --tasks (harness tasks)")
        if args.json:
            from zero2all.fileio import claim_output_file

            claim_output_file(args.json, args.overwrite, inputs=[args.ckpt, *(args.data or [])], option="--json")
        from zero2all.corpus.decontam import contamination_warning

        warning = contamination_warning(args.ckpt, args.data or [],
                                        [t for item in args.tasks or [] for t in item.split(",") if t])
        if warning:
            print(warning, file=sys.stderr)
        if args.tasks is not None:
            return _eval_tasks(args)
        from zero2all.eval.perplexity import evaluate_files, write_json

        if args.max_docs is not None and args.max_docs < 1:
            raise ValueError(f"--max-docs: {args.max_docs} must be at least 1")
        for flag, value, least in (("--context", args.context, 2), ("--stride", args.stride, 1),
                                   ("--batch-size", args.batch_size, 1)):
            if value is not None and value < least:  # 0 would silently mean "the default"
                raise ValueError(f"{flag}: {value} must be at least {least}")
        result = evaluate_files(args.ckpt, args.data, max_docs=args.max_docs, device=args.device,
                                dtype=args.dtype, context=args.context, stride=args.stride,
                                batch_size=args.batch_size, tokenizer=_tokenizer_override(args),
                                progress=False if args.no_progress else None, text_field=args.text_field,
                                txt_mode=args.txt_mode)
        if result.overall.docs == 0:
            raise ValueError(f"--data {' '.join(args.data)}: no document with text to score")
        s = result.settings
        print(f"{args.ckpt}: context {s['context']}, stride {s['stride']}, {s['dtype']} on {s['device']}")
        print(result.table())
        if args.json:
            write_json(result, args.json)
            print(f"wrote {args.json}")

    return _data_errors("eval", run)


def _eval_tasks(args):
    """``z2all eval --tasks``: lm-evaluation-harness tasks through ``zero2all.eval.harness``."""
    try:
        from zero2all.eval import harness
    except ImportError as e:
        raise ValueError(f"--tasks: {e}") from None
    tasks = [t for item in args.tasks for t in item.split(",") if t]
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit: {args.limit} must be positive")
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = harness.evaluate_tasks(args.ckpt, tasks, include_path=args.include_path, limit=limit,
                                     num_fewshot=args.num_fewshot, batch_size=args.batch_size, device=args.device,
                                     dtype=args.dtype, tokenizer=_tokenizer_override(args), seed=args.seed,
                                     bootstrap_iters=args.bootstrap_iters)
    print(harness.results_table(results))
    if args.json:
        harness.write_results(results, args.json)
        print(f"wrote {args.json}")


# ---------------------------------------------------------------------------------------------------- accounting
# (estimate)


@command("estimate", "parameters, FLOPs, memory per GPU, communication, MFU and training time of a config",
         "  z2all estimate --config z2all-1.1b\n"
         "  z2all estimate --config llama2-70b --gpus 1024 --tokens 15e12 --mfu 0.4 --zero 1 --tp 8 --pp 4 \\\n"
         "      --micro-batch-size 1 --grad-accum-steps 32 --recompute selective\n"
         "  z2all estimate --config llama2-7b --gpus 8 --gpu a100 --zero 3 --json")
def _estimate(p):
    p.add_argument("--config", default="z2all-1.1b", help="preset name or .toml path")
    p.add_argument("--gpus", type=int, default=None, help="number of GPUs (default 1, or the --dp mesh)")
    p.add_argument("--gpu", default="h100", help="GPU type: h100, h200, a100, a10, l4, 4090, ... (default h100)")
    p.add_argument("--tokens", type=float, default=None,
                   help="training tokens, e.g. 15e12 (default: 20 per parameter, Chinchilla-optimal)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the time estimate (0.4)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over data parallel")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel size (sets --gpus to dp x tp x pp x cp when --gpus is not given)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: data.seq_len or max_seq_len)")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="activation recomputation")
    p.add_argument("--precision", default="bf16-amp", choices=["bf16-amp", "bf16-mixed", "fp32"],
                   help="bf16-amp: fp32 weights + bf16 autocast (our trainer); bf16-mixed: bf16 weights, fp32 "
                        "master in the optimizer; fp32")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _overrides(p)
    # the layout's settings are the config's (--tp is parallel.tp, ...); --seq, --zero, --recompute, --precision
    # and --gpus are what-ifs of this command only
    flags = _config_flags(p, TRAIN_SECTIONS, ("--tp", "--pp", "--cp", "--ep", "--micro-batch-size",
                                              "--micro-batch", "--grad-accum-steps", "--grad-accum"))

    def run(args):
        import json

        from zero2all.accounting import Layout, estimate, format_estimate
        from zero2all.config import ConfigError, build_config

        values, sources = flags.given(args)
        for key in ("train.micro_batch_size", "train.grad_accum_steps"):  # named by the option used
            if isinstance(values.get(key), int) and values[key] < 1:
                raise ConfigError(f"{sources[key]}: must be >= 1, got {values[key]}")
        cfg = build_config(args.config, args.overrides, values, sources=sources)
        pc = cfg.parallel
        tp, pp, cp = pc.tp, pc.pp, pc.cp
        gpus = args.gpus
        for flag in ("gpus", "dp", "seq"):  # 0 is refused, not taken for "default"
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise ConfigError(f"--{flag}: must be >= 1, got {value}")
        if args.dp is not None:
            mesh = args.dp * tp * pp * cp
            if gpus not in (None, mesh):
                raise ConfigError(f"--gpus {gpus} but --dp {args.dp} x --tp {tp} x --pp {pp} x --cp {cp} = {mesh}")
            gpus = mesh
        def given(value, default):
            return default if value is None else value

        # the parallel settings go through the plan (distributed/plan.py), as a run's would: its Layout is the
        # plan's, with what-if flags (ZeRO stage, precision, recompute, batch) on top
        from zero2all.distributed.plan import resolve, sections

        world = given(gpus, 1)
        pc.dp_replicate, pc.dp_shard = 1, -1
        pc.sequence_parallel = tp > 1 and (given(args.seq, cfg.data.seq_len or cfg.model.max_seq_len)
                                           // cp) % tp == 0
        cfg.data.seq_len = min(given(args.seq, cfg.data.seq_len or cfg.model.max_seq_len), cfg.model.max_seq_len)
        if world % (tp * pp * cp):   # the Layout's own sentence (--flags, not config keys)
            Layout(gpus=world, tp=tp, pp=pp, cp=cp).validate()
        parts = sections(cfg.model, pc)   # the layout's rules; the batch's are a run's (the flags are what-ifs)
        parts.data = cfg.data
        plan = resolve(parts, world)
        layout = plan.layout(cfg, args.gpu, tokens=args.tokens, mfu=args.mfu, zero=args.zero,
                             seq_len=given(args.seq, cfg.data.seq_len or cfg.model.max_seq_len),
                             grad_accum_steps=cfg.train.grad_accum_steps,
                             recompute=args.recompute, precision=args.precision, sequence_parallel=None)
        if layout.seq_len > cfg.model.max_seq_len:
            print(f"warning: --seq {layout.seq_len} is longer than the model's context (model.max_seq_len = "
                  f"{cfg.model.max_seq_len}); the estimate assumes model.max_seq_len={layout.seq_len}",
                  file=sys.stderr)
        moe = None
        if cfg.model.moe.enabled:  # zero2all/accounting/moe.py; the dense table then shows the active path
            from zero2all.accounting.moe import active_dense_config, format_moe_estimate, moe_estimate

            moe = moe_estimate(cfg.model, args.gpus, pc.ep, layout.micro_batch_size,
                               layout.seq_len, layout.grad_accum_steps, mfu=args.mfu)
            est = estimate(active_dense_config(cfg.model), layout) | {"moe": moe}
        else:
            est = estimate(cfg.model, layout)
        if args.json:
            print(json.dumps(est, indent=2))
        else:
            if moe is not None:
                print(format_moe_estimate(moe) + "\n-- the dense estimate below counts each MoE layer as a "
                      "dense MLP of the active width (k + shared) x expert_intermediate_size: its FLOPs and "
                      "activations hold for MoE, its parameter and memory lines do not (see above)")
            print(format_estimate(est, str(args.config)))

    return run

# ---------------------------------------------------------------------------------------------------- benchmarks
# (bench)


@command("bench", "benchmarks; `bench train`: training throughput of our kernel ablations vs the HF peer (GPU); "
         "each step runs what a `z2all pretrain` step runs, gradient clipping at train.grad_clip (default 1.0) "
         "included",
         "  z2all bench train                                  # every row: ablations, HF peers, extras\n"
         "  z2all bench train --rows use_all,use_all_compile,hf_liger --iters 10 --out bench.json\n"
         "  z2all bench train --config tiny --rows use_all,hf --micro-batch-size 4 --seq 256")
def _bench(p):
    # zero2all.bench imports torch, so its options are added when the command runs, not when the parser is built
    # (`z2all bench train --help` lists them)
    p.add_argument("what", choices=["train"], help="which benchmark (train: benchmarks/train_throughput.py)")
    p.add_argument("options", nargs=argparse.REMAINDER, metavar="...",
                   help="the benchmark's options and key=value overrides (see `z2all bench train --help`)")

    def run(args):
        from zero2all.bench import add_arguments, main_from_args

        bench = CommandParser(prog=f"z2all bench {args.what}", description=p.description, epilog=p.epilog,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(bench)
        return main_from_args(bench.parse_args(args.options))

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="z2all", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Zero2all: data, tokenizer, Llama-2 model, training, post-training and inference.",
        epilog="Run `z2all COMMAND --help` for a command's options and examples.")
    parser.add_argument("--version", action="version", version=f"z2all {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for name, help_text, examples, fn in _COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text,
                           epilog=("examples:\n" + examples) if examples else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(_run=fn(p))
    return parser


# errors that can only come from writing: without a file name they are blamed on the command's --out
_WRITE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _final_name(path: str) -> str:
    """``path`` with temporaries named as the file or directory they were to become: ``.config.json.<hex>.tmp``
    (``zero2all.fileio``) -> ``config.json``, ``.tmp-ckpt-000200`` (a checkpoint being written) ->
    ``ckpt-000200``."""
    from zero2all.fileio import temporary_target

    parts = list(Path(path).parts)
    for i, part in enumerate(parts):
        target = temporary_target(part)
        parts[i] = target if target is not None else part[len(".tmp-"):] if part.startswith(".tmp-") else part
    return str(Path(*parts)) if parts else path


def _option_naming(path: str, args) -> str | None:
    """The command-line option whose value ``path`` is or lies under (``--out``, ``--ckpt``, ...)."""
    best = None
    for dest, value in vars(args).items():
        if dest.startswith("_") or dest in ("command", "overrides"):
            continue
        for v in (value if isinstance(value, list) else [value]):
            if not isinstance(v, str) or not v or not (dest == "out" or os.path.exists(v)):
                continue
            try:
                inside = os.path.commonpath([os.path.abspath(path), os.path.abspath(v)]) == os.path.abspath(v)
            except ValueError:
                continue
            if inside and (best is None or dest == "out"):
                best = dest
    if best is None:
        return None
    return "--" + (best if "." in best else best.replace("_", "-"))  # a config flag's dest is its key


def os_error_line(exc: OSError, args) -> str:
    """One line for an OSError that reached the command: the path (the option's value when the error names none),
    what failed and what to do."""
    from zero2all.fileio import os_error_message

    path = exc.filename if exc.filename is not None else exc.filename2
    if path is None and exc.errno in _WRITE_ERRNOS and getattr(args, "out", None):
        path = args.out
    if path is None:
        return f"{exc.strerror or exc}" + (f" (errno {exc.errno})" if exc.errno is not None else "")
    path = _final_name(os.fsdecode(path))
    option = _option_naming(path, args)
    writing = exc.errno in _WRITE_ERRNOS or option == "--out" or (option is None and hasattr(args, "out"))
    return os_error_message(exc, path, "write" if writing else "read", option or "--out")


def _wrapped_os_error(exc: BaseException, args=None) -> OSError | None:
    """The OSError that ``exc`` stands for: a full disk said by a library in its own words (safetensors, torch's
    writer: ``zero2all.fileio.as_disk_full``), or the OSError inside an exception that collects per-rank failures
    (torch.distributed.checkpoint's CheckpointException: ``failures`` = {rank: (exception, traceback)})."""
    from zero2all.fileio import as_disk_full

    out = getattr(args, "out", None) if args is not None else None
    full = as_disk_full(exc, out if isinstance(out, str) else None)
    if full is not None:
        return full
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(inner, OSError):
                return as_disk_full(inner) or inner
            if isinstance(inner, BaseException) and (full := _wrapped_os_error(inner, args)) is not None:
                return full
    return None


# commands whose --out is a directory written whole and put in place by a rename (zero2all.fileio.atomic_dir)
_WHOLE_DIRECTORY_OUTPUTS = {"export-hf", "import-hf", "resize-vocab", "train-tokenizer", "extend-tokenizer",
                            "prepare-sft", "prepare-dpo", "export-reward-hf", "convert-checkpoint", "corpus"}


def _check_directory_out(args) -> None:
    """An ``--out`` that is the working directory or a folder above it cannot be replaced by a rename: a
    ConfigError naming it, before any work."""
    from zero2all.config import ConfigError

    out = getattr(args, "out", None)
    if args.command not in _WHOLE_DIRECTORY_OUTPUTS or not isinstance(out, str) or not out:
        return
    target, cwd = os.path.realpath(out), os.path.realpath(os.getcwd())
    if target == cwd or cwd.startswith(target.rstrip(os.sep) + os.sep):
        where = "the working directory" if target == cwd else f"a folder above the working directory ({cwd})"
        raise ConfigError(f"--out {out}: is {where}, which this command would replace whole; name a folder of its "
                          f"own, e.g. --out {os.path.join(out, args.command.split('-')[-1])}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    from zero2all.config import ConfigError, TrainingDiverged, TrainingInterrupted, TrainingOutOfMemory
    from zero2all.fileio import OutputDirError, OutputLockedError

    try:
        _check_directory_out(args)
        result = args._run(args)
    except TrainingInterrupted as e:  # a checkpoint was saved; one line, the shell's code for that signal
        print(f"z2all {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except (TrainingDiverged, TrainingOutOfMemory) as e:
        print(f"z2all {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except (ConfigError, OutputDirError, OutputLockedError) as e:
        print(f"z2all {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"z2all {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a read-only or full disk, permissions: the writes are atomic, so nothing was damaged
        print(f"z2all {args.command}: error: {os_error_line(_wrapped_os_error(e, args) or e, args)}",
              file=sys.stderr)
        return 1
    except BaseException as e:
        inner = _wrapped_os_error(e, args)
        if inner is None:
            raise
        print(f"z2all {args.command}: error: {os_error_line(inner, args)}", file=sys.stderr)
        return 1
    code = int(result or 0)
    dist_module = sys.modules.get("zero2all.distributed.env")
    if dist_module is not None:  # a torchrun worker leaves without gloo's teardown (see finish_process)
        code = dist_module.finish_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
