"""Draft-model speculative decoding for the scheduler's paged engine: a smaller model sharing the target's tokenizer
proposes the next K tokens of each greedy row, the target checks all of them in one forward.

The draft keeps its own paged KV cache (its own block pool and block tables, with prefix caching) over the same
batch rows as the target's (:class:`ModelDrafter`): a row's prompt is computed into the draft's cache alongside the
target's chunked prefill, then each step

1. the draft is fed the tokens the target holds that it has not computed yet (the token just drawn, and after a
   step whose drafts were all accepted the last draft token too, which the draft proposed but never fed), all rows
   in one forward, and takes its argmax as the first draft token; then it feeds each draft token to get the next,
   K forwards in all (rows whose K is smaller, near their budget or span, stop earlier);
2. the target feeds the drawn token and the K drafts in one forward (``PagedSession.verify``: the path prompt-lookup
   drafting uses) and keeps the draft tokens equal to its own argmax at each position, up to the first that is
   not, plus the logits after the last kept one (the next token, the "bonus", is drawn from them as usual);
3. both caches are rolled back to the kept length: the target's by ``PagedSession.accept``, the draft's by
   :meth:`ModelDrafter.rollback` (its keys for rejected tokens are overwritten by the next ones fed).

The text is exactly that of plain greedy decoding whatever the draft proposes: the draft only decides how many
tokens a step yields (1 + the accepted drafts). With the target itself as its draft every draft is accepted.

Only greedy rows without a repetition penalty speculate; sampled rows decode one token a step beside them (a
sampled row would need rejection sampling, min(1, p/q) with a resample from max(0, p - q), to keep its
distribution: not done). The draft's forwards run eagerly (no CUDA graph), over the drafting rows only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from zero2all.infer.generate import argmax_rows
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
    def propose(self, lengths: dict[int, int], history: dict[int, Sequence[int]], drawn: Sequence[int]
                ) -> dict[int, list[int]]:
        """``lengths[row]`` greedy draft tokens for each row, given the tokens the target has computed
        (``history[row]``) and the token just drawn, which it is about to be fed (``drawn[row]``)."""
        S = self.session
        rows = [r for r, k in lengths.items() if k > 0]
        if not rows:
            return {}
        fed = {r: list(history[r][S.rows[r].computed:]) + [drawn[r]] for r in rows}  # what the draft lacks
        drafts: dict[int, list[int]] = {r: [] for r in rows}
        logits = S.feed(fed)
        while True:
            picks = argmax_rows(logits[:, :self.vocab]).tolist()
            for r, t in zip(rows, picks):
                drafts[r].append(t)
            rows = [r for r in rows if len(drafts[r]) < lengths[r]]
            if not rows:
                return drafts
            logits = S.feed({r: drafts[r][-1:] for r in rows})

    def rollback(self, row: int, length: int):
        """The target kept ``length`` tokens of the row: the draft keeps at most those (the rejected draft tokens
        it fed are dropped; an accepted last draft token it never fed is fed at the next :meth:`propose`)."""
        if self.session.rows[row] is not None:
            self.session.truncate(row, length)


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
