"""lm-evaluation-harness adapter: our checkpoints as the harness model ``z2all``.

Importing this module registers :class:`Z2allLM` with the harness's model registry under ``z2all``. The harness
(0.4.x) has no plugin hook for models, so its own ``lm_eval`` command cannot see the name; run it through

    python -m zero2all.eval.harness --model z2all --model_args pretrained=DIR --tasks NAMES --include_path TASKS \
        --device cpu

(the same arguments as ``lm_eval``; ``--device`` goes to the harness, not into ``--model_args``: its default is
cuda:0, which falls back to the CPU where CUDA is missing; this module registers the model, then hands over to the
harness's CLI), or ``z2all eval --ckpt DIR --tasks NAMES [--include-path TASKS]``, or in Python
``simple_evaluate(model=Z2allLM(...))``.

The three request types:

* ``loglikelihood`` (context, continuation): trailing whitespace of the context moves to the continuation, the pair
  is encoded as ``encode(context + continuation)`` split after ``len(encode(context))`` ids (an empty context is
  the end-of-text id alone); the last ``max_length + 1`` ids are kept (the context is truncated on the left) and
  the continuation's ids are scored in one forward pass, requests batched longest first. Returns the summed
  log-probability and whether every continuation id is the argmax (greedy).
* ``loglikelihood_rolling`` (text): the rules of ``z2all eval`` (``perplexity.py``: ``[<|endoftext|>] +
  encode(text)``, sliding windows of the model's context moving ``stride`` ids, each token scored once): the
  result is minus the document's NLL there.
* ``generate_until`` (context, gen_kwargs): our :class:`~zero2all.infer.generate.Generator` with the stop strings
  ``until``, ``max_gen_toks`` new tokens (default 256), greedy unless ``do_sample``; the prompt keeps its last
  ``max_length - max_gen_toks`` ids.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

import torch

INSTALL_HINT = "the lm-evaluation-harness is not installed: pip install 'zero2all[eval]' (or pip install lm-eval)"

try:
    import lm_eval.models  # noqa: F401  (the harness fills its registry with its own models only while empty)
    from lm_eval.api.model import LM
    from lm_eval.api.registry import model_registry, register_model
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(INSTALL_HINT) from e

from zero2all.eval.perplexity import score_documents, start_id  # noqa: E402

MODEL_NAME = "z2all"


def _as_bool(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class Z2allLM(LM):
    """A Zero2all model for the harness. ``pretrained``: any directory ``load_model`` reads (ours, HF Llama, a
    training checkpoint, with a LoRA adapter); or pass a loaded ``model`` and ``tokenizer``. ``max_length``: the
    context (default the model's ``max_seq_len``); ``stride``: of ``loglikelihood_rolling``'s windows."""

    def __init__(self, pretrained: str | None = None, model=None, tokenizer=None, device: str = "auto",
                 dtype: str = "auto", batch_size: int | str = 8, max_batch_size: int | None = None,
                 max_length: int | None = None, stride: int | None = None, seed: int = 1234, **unused):
        super().__init__()
        if model is None:
            if not pretrained:
                raise ValueError("model_args: pretrained=DIR (a checkpoint directory) is required")
            from zero2all.infer.generate import load_for_inference
            from zero2all.tokenizer import load_tokenizer

            device = str(device or "auto")
            if device.startswith("cuda") and not torch.cuda.is_available():  # the harness CLI's default: cuda:0
                print(f"warning: device {device} asked for but CUDA is not available: running on the CPU",
                      file=sys.stderr)
                device = "cpu"
            model, tok = load_for_inference(str(pretrained), device=device, dtype=str(dtype),
                                            tokenizer=load_tokenizer(tokenizer) if isinstance(tokenizer, str)
                                            else tokenizer)
            tokenizer = tok
        elif tokenizer is None:
            raise ValueError("Z2allLM: a model object needs its tokenizer (tokenizer=...)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._device = model.embed_tokens.weight.device
        # "auto" (the harness's automatic batch size) and "auto:N" fall back to a fixed batch
        bs = str(batch_size)
        self.batch_size = int(bs) if bs.isdigit() else int(max_batch_size or 8)
        if self.batch_size < 1:
            raise ValueError(f"batch_size: {batch_size} must be at least 1")
        self.max_length = int(max_length or model.cfg.max_seq_len)
        if not 2 <= self.max_length <= model.cfg.max_seq_len:
            raise ValueError(f"max_length: {max_length} must be between 2 and the model's max_seq_len "
                             f"{model.cfg.max_seq_len}")
        self.stride = int(stride) if stride else None
        self.seed = int(seed)
        self.start = start_id(tokenizer, model)
        self._generator = None

    # -- harness plumbing ---------------------------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return f"z2all-{getattr(self.tokenizer, 'hash', 'unknown')[:16]}"

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) of a loglikelihood request (see the module docstring)."""
        if not context:
            return [self.start], self.encode(continuation)
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        return ctx, whole[len(ctx):]

    # -- loglikelihood ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def score_pairs(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation, greedy) of each (context ids, continuation ids)."""
        C = self.max_length
        jobs = []  # (index, fed ids, number of continuation ids scored, their ids)
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                raise ValueError(f"loglikelihood request {i}: the continuation encodes to no token")
            ids = (list(ctx) + list(cont))[-(C + 1):]
            n = min(len(cont), len(ids) - 1)
            jobs.append((i, ids[:-1], n, ids[-n:]))
        jobs.sort(key=lambda j: -len(j[1]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for b in range(0, len(jobs), self.batch_size):
            batch = jobs[b:b + self.batch_size]
            width = max(len(j[1]) for j in batch)
            tokens = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (_, fed, _, _) in enumerate(batch):
                tokens[r, :len(fed)] = torch.as_tensor(fed, dtype=torch.long)  # right padding: causal, unseen
            logits, _ = self.model(tokens.to(self._device))
            for r, (i, fed, n, target) in enumerate(batch):
                rows = logits[r, len(fed) - n:len(fed)].float()
                logp = torch.log_softmax(rows, dim=-1)
                want = torch.as_tensor(target, dtype=torch.long, device=logp.device)
                total = float(logp.gather(1, want[:, None]).double().sum())
                greedy = bool((rows.argmax(dim=-1) == want).all())
                out[i] = (total, greedy)
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*req.args[:2]) for req in requests]
        results = self.score_pairs(pairs)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        docs = [[self.start] + self.encode(req.args[0]) for req in requests]
        scored = score_documents(self.model, docs, context=self.max_length, stride=self.stride,
                                 batch_size=self.batch_size, progress=False)
        results = [-nll for nll, _ in scored]
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return results

    # -- generation ---------------------------------------------------------------------------------------------
    def generator(self):
        if self._generator is None:
            from zero2all.infer.generate import Generator

            self._generator = Generator(self.model, self.tokenizer)
        return self._generator

    def sampling(self, gen_kwargs: dict[str, Any]):
        """(SamplingParams, max new tokens) of a request's ``gen_kwargs``."""
        from zero2all.infer.generate import SamplingParams

        kw = dict(gen_kwargs or {})
        until = kw.pop("until", None) or []
        if isinstance(until, str):
            until = [until]
        max_new = int(kw.pop("max_gen_toks", 256))
        max_new = max(1, min(max_new, self.max_length - 1))
        sample = _as_bool(kw.pop("do_sample", False))
        temperature = float(kw.pop("temperature", 1.0 if sample else 0.0))
        params = SamplingParams(max_new_tokens=max_new, temperature=temperature if sample else 0.0,
                                top_k=int(kw.pop("top_k", 0) or 0), top_p=float(kw.pop("top_p", 1.0) or 1.0),
                                stop=tuple(s for s in until if isinstance(s, str) and s), seed=self.seed)
        return params.validate(), max_new

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        gen = self.generator()
        for idx in groups.values():
            params, max_new = self.sampling(requests[idx[0]].args[1])
            keep = self.max_length - max_new
            prompts = [(self.encode(requests[i].args[0]) or [self.start])[-keep:] for i in idx]
            for b in range(0, len(idx), self.batch_size):
                done = gen.generate(prompts[b:b + self.batch_size], params)
                for i, c in zip(idx[b:b + self.batch_size], done):
                    out[i] = c.text
                    self.cache_hook.add_partial("generate_until", requests[i].args, c.text)
        return out


if MODEL_NAME not in model_registry:  # once per process, also when this file runs as __main__
    register_model(MODEL_NAME)(Z2allLM)


# ---------------------------------------------------------------------------------------------------- running


def evaluate_tasks(ckpt: str | None, tasks: Sequence[str], include_path: Sequence[str] | None = None,
                   limit: float | None = None, num_fewshot: int | None = None, batch_size: int = 8,
                   device: str = "auto", dtype: str = "auto", tokenizer=None, log_samples: bool = False,
                   lm: Z2allLM | None = None, seed: int = 1234, bootstrap_iters: int = 100000) -> dict:
    """The harness's ``simple_evaluate`` on ``tasks`` (names, or task YAML found under ``include_path``) with
    checkpoint ``ckpt`` (or an already built ``lm``); returns the harness's results dict."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if lm is None:
        lm = Z2allLM(pretrained=str(ckpt), device=device, dtype=dtype, batch_size=batch_size, tokenizer=tokenizer,
                     seed=seed)
    paths = [str(p) for p in include_path] if include_path else None
    manager = None
    if paths:  # indexing the harness's own thousands of task files takes a while: only when needed
        manager = TaskManager(include_path=paths, include_defaults=False)
        if any(t not in manager.all_tasks for t in tasks):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=paths)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        where = f" (nor under --include-path {' '.join(map(str, include_path))})" if include_path else ""
        raise ValueError(f"--tasks: unknown task {missing[0]!r}: not a harness task{where}")
    return simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                           task_manager=manager, log_samples=log_samples, random_seed=seed,
                           bootstrap_iters=bootstrap_iters,
                           numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)


def results_table(results: dict) -> str:
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def write_results(results: dict, path) -> None:
    """The numbers of a harness run (results, versions, n-shot, configs; not the per-sample logs) as JSON."""
    from pathlib import Path

    from zero2all.fileio import save_json

    keep = {k: results[k] for k in ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples",
                                     "configs", "config") if k in results}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_json(json.loads(json.dumps(keep, default=str)), Path(path))


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m zero2all.eval.harness ARGS``: the harness's CLI with the ``z2all`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
