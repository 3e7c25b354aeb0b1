"""Draft-model speculative decoding for the scheduler's paged engine: a smaller model sharing the target's tokenizer
proposes the next K tokens of each row, the target checks all of them in one forward.

The draft keeps its own paged KV cache (its own block pool and block tables, with prefix caching) over the same
batch rows as the target's (:class:`ModelDrafter`): a row's prompt is computed into the draft's cache alongside the
target's chunked prefill, then each step

1. the draft is fed the tokens the target holds that it has not computed yet (the token just drawn, and after a
   step whose drafts were all accepted the last draft token too, which the draft proposed but never fed), all rows
   in one forward, and takes its argmax (a sampled row: a token drawn from its distribution q under the row's
   temperature, top-k and top-p) as the first draft token; then it feeds each draft token to get the next, K
   forwards in all (rows whose K is smaller, near their budget or span, stop earlier);
2. the target feeds the drawn token and the K drafts in one forward (``PagedSession.verify``: the path prompt-lookup
   drafting uses). A greedy row keeps the draft tokens equal to its own argmax at each position, up to the first
   that is not; a sampled row keeps each with probability min(1, p/q), p the target's distribution, up to the
   first rejected, whose place takes a token drawn from max(0, p - q) normalised (:func:`accept_sampled`). The
   next token (the "bonus" after all-kept drafts) is drawn from the target's logits after the last kept one as
   usual, or is that replacement;
3. both caches are rolled back to the kept length: the target's by ``PagedSession.accept``, the draft's by
   :meth:`ModelDrafter.rollback` (its keys for rejected tokens are overwritten by the next ones fed).

A greedy row's text is exactly that of plain greedy decoding whatever the draft proposes, and a sampled row's
tokens are distributed exactly as plain sampling's (speculative sampling: Leviathan et al. 2023, Chen et al. 2023):
the draft only decides how many tokens a step yields (1 + the accepted drafts). A seeded sampled row draws its
drafts, acceptances and replacements from its own random stream, so it is reproducible, but its tokens are not
those it draws without speculation. With the target itself as its draft every greedy draft is accepted.

Rows with a repetition penalty do not speculate. The draft's forwards run eagerly (no CUDA graph), over the
drafting rows only.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from zero2all.infer.generate import argmax_rows, sampling_probs
from zero2all.infer.paged import PagedSession


class ModelDrafter:
    """A draft model's paged session over the target's batch rows (the same row ids). ``vocab``: the target's
    logits width (draft tokens are chosen among the ids the target can be fed). ``max_len``: the target's context;
    the draft holds sequences of up to its own context (``max_len`` here): longer ones are not drafted for."""

    def __init__(self, draft_model, rows: int, max_len: int, n_blocks: int, block_size: int, prefix_caching: bool,
                 vocab: int):
        self.model = draft_model
        self.max_len = min(max_len, draft_model.cfg.max_seq_len)
        self.session = PagedSession(draft_model, rows, self.max_len, n_blocks=n_blocks, block_size=block_size,
                                    prefix_caching=prefix_caching)
        self.vocab = min(vocab, draft_model.cfg.padded_vocab_size)

    # -- rows (mirroring the target's) -----------------------------------------------------------------------
    def can_admit(self, span: int) -> bool:
        return self.session.can_admit(span)

    def fits_ever(self, span: int) -> bool:
        return self.session.fits_ever(span)

    def reserve(self, row: int, span: int):
        self.session.reserve(row, span)

    def start(self, row: int, prompt: Sequence[int], span: int):
        self.session.start(row, prompt, span)

    def has(self, row: int) -> bool:
        return self.session.rows[row] is not None

    def release(self, row: int):
        self.session.release(row)

    def reset(self):
        self.session.reset()

    def prefill(self, rows: Sequence[int], target_remaining: Sequence[int]):
        """After a target prefill chunk: compute the draft's prompt tokens of ``rows`` so that each is left with no
        more than the target (``target_remaining``): the draft finishes a prompt in the chunk the target does. (It
        computes more than the target's chunk where its prefix cache found less.)"""
        S = self.session
        todo = [(r, S.remaining(r) - left) for r, left in zip(rows, target_remaining)
                if S.rows[r] is not None and S.remaining(r) > left]
        if todo:
            S.prefill_step([r for r, _ in todo], [n for _, n in todo])

    # -- drafting -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, lengths: dict[int, int], history: dict[int, Sequence[int]], drawn: Sequence[int],
                samplers: dict[int, Sampler] | None = None) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """``lengths[row]`` draft tokens for each row, given the tokens the target has computed (``history[row]``)
        and the token just drawn, which it is about to be fed (``drawn[row]``). A row in ``samplers`` (its
        temperature, top-k, top-p and random stream) samples its drafts with the target's rules from the draft's
        distribution q; the others take the draft's argmax. Returns (drafts, q): q[row] (k, V) the distributions
        the sampled rows' drafts were drawn from (:func:`accept_sampled` needs them)."""
        S = self.session
        samplers = samplers or {}
        rows = [r for r, k in lengths.items() if k > 0]
        if not rows:
            return {}, {}
        fed = {r: list(history[r][S.rows[r].computed:]) + [drawn[r]] for r in rows}  # what the draft lacks
        drafts: dict[int, list[int]] = {r: [] for r in rows}
        qs: dict[int, list[torch.Tensor]] = {r: [] for r in rows if r in samplers}
        logits = S.feed(fed)
        while True:
            logits = logits[:, :self.vocab]
            picks = argmax_rows(logits).tolist()
            at = [i for i, r in enumerate(rows) if r in samplers]
            if at:
                q = draft_probs(logits[at], [samplers[rows[i]] for i in at])
                sampled = draw(q, [samplers[rows[i]].rng.random() for i in at]).tolist()
                for j, i in enumerate(at):
                    picks[i] = sampled[j]
                    qs[rows[i]].append(q[j])
            for r, t in zip(rows, picks):
                drafts[r].append(t)
            rows = [r for r in rows if len(drafts[r]) < lengths[r]]
            if not rows:
                return drafts, {r: torch.stack(q) for r, q in qs.items()}
            logits = S.feed({r: drafts[r][-1:] for r in rows})

    def rollback(self, row: int, length: int):
        """The target kept ``length`` tokens of the row: the draft keeps at most those (the rejected draft tokens
        it fed are dropped; an accepted last draft token it never fed is fed at the next :meth:`propose`)."""
        if self.session.rows[row] is not None:
            self.session.truncate(row, length)


class Sampler(NamedTuple):
    """A sampled row's parameters and its own random stream (``random.Random``)."""
    temperature: float
    top_k: int
    top_p: float
    rng: random.Random


def draft_probs(logits: torch.Tensor, samplers: Sequence[Sampler]) -> torch.Tensor:
    """Each row's sampling distribution (``generate.sampling_probs``: the rules ``sample_rows`` draws with)."""
    dev, V = logits.device, logits.size(-1)
    return sampling_probs(logits.float(), torch.tensor([s.temperature for s in samplers], device=dev),
                          torch.tensor([min(s.top_k, V) for s in samplers], dtype=torch.long, device=dev),
                          torch.tensor([s.top_p for s in samplers], device=dev))


def draw(probs: torch.Tensor, uniforms: Sequence[float]) -> torch.Tensor:
    """One token per row of ``probs`` (R, V) by inverse CDF with the given uniform numbers in [0, 1): the first
    token whose cumulative mass exceeds u x total, never one of zero mass."""
    cdf = probs.cumsum(dim=-1)
    u = torch.tensor(uniforms, dtype=cdf.dtype, device=cdf.device)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return pick.clamp_(max=probs.size(-1) - 1)[:, 0]


def accept_sampled(p: torch.Tensor, q: torch.Tensor, draft: Sequence[int], rng: random.Random
                   ) -> tuple[int, int | None]:
    """Speculative sampling of one row (Leviathan et al. 2023, Chen et al. 2023): ``p`` (k, V) the target's
    sampling distributions at the k draft positions, ``q`` (k, V) the draft's, from which ``draft`` was drawn.
    Draft token x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), in order, up to the first one rejected;
    in its place a token is drawn from max(0, p_i - q_i), normalised. Each token so emitted is distributed as
    p_i exactly, whatever q. Computed in float64. Returns (kept drafts, the replacement token or None when every
    draft was kept: then the next token is drawn from the target's distribution after them, as usual)."""
    k = len(draft)
    p64, q64 = p[:k].double().cpu(), q[:k].double().cpu()
    if q64.size(-1) < p64.size(-1):  # a draft with fewer logits: its q is 0 beyond them
        q64 = torch.nn.functional.pad(q64, (0, p64.size(-1) - q64.size(-1)))
    pos = torch.arange(k)
    tok = torch.tensor([int(t) for t in draft])
    ratio = (p64[pos, tok] / q64[pos, tok]).tolist()
    for i in range(k):
        if rng.random() < min(1.0, ratio[i]):
            continue
        residual = (p64[i] - q64[i]).clamp_(min=0)
        if not residual.sum() > 0:  # p == q up to rounding: a rejection is then a rounding accident
            residual = p64[i]
        return i, int(draw(residual[None], [rng.random()])[0])
    return k, None


def check_draft_checkpoint(draft: str | Path, ckpt: str | Path, tokenizer=None) -> None:
    """Refuse a draft model that cannot serve as ``ckpt``'s, before any weights are loaded (ConfigError, one line):
    a missing directory, a vocabulary of another size, or a checkpoint trained with another tokenizer (compared by
    the tokenizer hashes the checkpoints store, or that of ``tokenizer``, the target's tokenizer in use)."""
    from zero2all.config import ConfigError
    from zero2all.model.io import read_model_config, stored_tokenizer_hash, weights_dir

    draft = Path(draft)
    if not draft.is_dir():
        raise ConfigError(f"--draft-model {draft}: no such checkpoint directory; give a smaller model's directory "
                          "(ours or HF Llama) that shares the target's tokenizer")
    try:
        d_cfg = read_model_config(weights_dir(draft))
    except FileNotFoundError as e:
        raise ConfigError(f"--draft-model {draft}: not a model directory ({e})") from None
    t_cfg = read_model_config(weights_dir(Path(ckpt)))
    if d_cfg.vocab_size != t_cfg.vocab_size:
        raise ConfigError(f"--draft-model {draft}: its vocabulary has {d_cfg.vocab_size} ids, the target {ckpt}'s "
                          f"{t_cfg.vocab_size}; the draft must share the target's tokenizer")
    d_hash, d_where = stored_tokenizer_hash(draft)
    t_hash = getattr(tokenizer, "hash", None)
    t_where = "the tokenizer in use"
    if t_hash is None:
        t_hash, t_where = stored_tokenizer_hash(Path(ckpt))
    if d_hash is not None and t_hash is not None and d_hash != t_hash:
        raise ConfigError(f"--draft-model {draft}: trained with tokenizer {d_hash[:16]} ({d_where}), the target with "
                          f"{t_hash[:16]} ({t_where}); the draft must share the target's tokenizer")


def generate_with_draft(generator, draft_model, speculative_tokens: int, prompts: Sequence[Sequence[int]], params,
                        on_event=None) -> tuple[list, dict]:
    """``Generator.generate`` with a draft model (``z2all generate --draft-model``): the prompts run as one batch
    through a paged :class:`~zero2all.infer.scheduler.Scheduler` with speculative decoding. ``on_event`` gets every
    event as it comes. Returns (one ``Completion`` per prompt, the scheduler's stats). Greedy tokens equal
    ``Generator.generate``'s; sampled ones have the same distribution (not the same tokens for a seed)."""
    from zero2all.infer.generate import Completion
    from zero2all.infer.scheduler import Scheduler

    sched = Scheduler(generator, max_batch=len(prompts), max_queue=0, draft_model=draft_model,
                      speculative_tokens=speculative_tokens, prefill_graphs=False)  # one batch: nothing to replay
    try:
        sub = sched.submit(prompts, params)
        tokens = [[] for _ in prompts]
        texts = [[] for _ in prompts]
        drawn = [0] * len(prompts)
        reasons = [""] * len(prompts)
        for ev in sub.events():
            if on_event is not None:
                on_event(ev)
            if ev.token_id >= 0:
                drawn[ev.index] += 1
                if not ev.stop_token:
                    tokens[ev.index].append(ev.token_id)
            texts[ev.index].append(ev.text)
            if ev.finish_reason:
                reasons[ev.index] = ev.finish_reason
        stats = sched.stats()
    finally:
        sched.stop()
    outs = [Completion([int(t) for t in p], t, "".join(x), r, n)
            for p, t, x, r, n in zip(prompts, tokens, texts, reasons, drawn)]
    return outs, stats
