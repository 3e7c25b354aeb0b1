"""Continuous batching: one thread owns the model and a fixed pool of KV-cache rows that requests come and go from.

Two engines. The default, ``engine="paged"`` (``infer/paged.py``), keeps keys and values in a pool of fixed-size
blocks with a block table per row: a sequence is admitted when the pool holds its prompt and budget next to the
running rows' (nothing moves and nothing is preempted), the longest cached prefix of its prompt is taken from the
prefix cache, and the rest of its prompt is computed a chunk per iteration under the token budget
``max_num_batched_tokens`` (one token per decoding row, the rest for prompts in arrival order) while the other rows
keep decoding; a row draws tokens once its prompt is complete. Rows may speculate: greedy ones with draft tokens
by prompt lookup (``speculative_ngram``), greedy and sampled ones with draft tokens from a smaller draft model
(``draft_model``, ``infer/speculative.py``), checked by the target in one forward (``_speculative_step``); not rows
with a grammar, whose drafts the matcher would have to check. The rest of this docstring describes the column engine
(``engine="column"``), whose per-row logic (sampling, stop checks, seeds, cancellation) both engines share.

The column engine's pool is one :class:`~zero2all.infer.generate.DecodeSession` of ``max_batch`` rows by
``cache_len`` slots, in the session's usual layout: every row writes its next token at the same cache slot (the
*column*), and a row's padding (the slots before its first token) is hidden by the attention mask, while its RoPE
positions start at 0 as if it were alone. So the decode step is unchanged (the same CUDA graph, the fused kernels on
CUDA); what is new is that rows change between steps::

    column ->        0    1    2    3    4    5    6    7
    row 0 (old)      p    p    p    g    g    g    g  | next token at the column
    row 1 (joined)   .    .    .    .    q    q    q  |   (its prompt ends just before it)
    row 2 (free)     .    .    .    .    .    .    .  |   (computes garbage that nobody reads)

Each scheduler iteration:

1. drops the rows of cancelled requests (a client that went away, a shutdown);
2. admits waiting sequences, in arrival order, into free rows: each prompt goes into its row right-aligned to end
   just before the column, and its first token is drawn from that prefill. The sequences admitted together are
   prefilled together, in one forward per group of similar prompt lengths (``DecodeSession.prefill_rows``, which
   touches no other row; ``Scheduler.prefill_groups``): a prefill stalls every running row, so sixteen prompts
   arriving at once cost one stall, not sixteen;
3. draws the next token of every running row, each with its own parameters (temperature, top-k, top-p,
   repetition penalty; a row with a grammar, ``infer/structured.py``, first has the tokens its grammar forbids
   masked, and its matcher advances by the drawn token) and its own random stream
   (``random.Random(seed + prompt index)``, so a seeded sequence's tokens do not depend on its neighbours:
   ``generate.sample_rows``);
4. runs one decode step for all rows at the column (on CUDA it is queued before the host looks at the tokens, as
   in ``Generator.stream``), then hands each row's token to its stop checks and streams the text; a finished row
   is free for the next iteration.

Fitting rows into the cache. Every row's span ends at the column, so a sequence with a prompt of n tokens and a
budget of m new tokens can join at column c when c >= n (room for its prompt) and c + m <= cache_len (room for its
tokens), and the rows already running must keep room for theirs. When that fails, the whole occupied span moves
left or right (``DecodeSession.move_columns``: one copy per layer; positions are rotated into the cached keys, so
a moved key stays valid); when even that cannot make room, the sequence waits for rows to finish (the first
waiting sequence blocks the ones behind it, so that a long one is not overtaken forever). With a cache of twice
the context (``default_cache_len``, when the memory allows) that never happens: the rows' current spans and their
remaining budgets are each at most one context, so every sequence joins as soon as a row is free. With a cache of
one context, sequences that each use up to half of it always fit together; longer ones may wait. The span is also
moved left when the rows' common padding grows past a quarter of the column, so that the decode step reads only
about as many slots as the longest row holds, whatever the cache's length.

Numerics: a row computes the same thing as a one-row ``Generator`` (the same prompt prefill, the same masked
decode step); rounding may still differ in the last bits where a kernel's reduction order depends on the batch
(matrix products on a GPU), which can flip a greedy choice between two nearly equal logits. One exception to the
rows' independence: a model with dynamic-NTK RoPE scaling rescales its frequencies by the longest position in the
step, so there a row's numbers depend on the longest row beside it (as in a left-padded ``Generator`` batch).
"""

from __future__ import annotations

import os
import queue
import random
import sys
import threading
import time
import traceback
from collections import Counter, deque
from contextlib import contextmanager
from typing import AsyncIterator, Callable, Iterator, Sequence

import torch

from zero2all.infer.generate import (
    PREFILL_BUCKETS,
    DecodeSession,
    GenerationEvent,
    Generator,
    SamplingParams,
    _RowText,
    apply_repetition_penalty,
    argmax_rows,
    check_prompts,
    sample_rows,
    to_device,
)
from zero2all.infer.structured import apply_masks

CANCELLED = "cancelled"  # the finish_reason of a sequence stopped before it ended (disconnect, shutdown)


class QueueFull(Exception):
    """More sequences wait than the queue holds: try again later."""


class ShuttingDown(Exception):
    """The scheduler no longer accepts requests."""


class Submission:
    """A request's handle: :meth:`events` yields its sequences' events in order; :meth:`cancel` frees its rows."""

    def __init__(self, scheduler: "Scheduler", n: int):
        self._scheduler = scheduler
        self.n = n                    # sequences (prompts) in the request
        self.cancelled = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiter = None           # (event loop, future) of an asyncio consumer waiting for the next event

    def _put(self, ev):
        """(The scheduler's thread.) Queue an event and wake an asyncio consumer that waits for one."""
        self._queue.put(ev)
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, fut = waiter
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def cancel(self):
        """Stop the request: its rows are freed at the scheduler's next iteration (each sequence then ends with
        finish_reason "cancelled")."""
        if not self.cancelled:
            self.cancelled = True
            self._scheduler._wake()

    def events(self, poll: float = 0.5, alive: Callable[[], bool] | None = None) -> Iterator[GenerationEvent]:
        """Events until each sequence has had its final one (``finish_reason`` set). Raises the error the model
        ran into, if any. ``alive`` is asked every ``poll`` seconds while nothing arrives: when it says False the
        request is cancelled and ``ConnectionAbortedError`` raised. Leaving the loop early cancels the request."""
        batches = self.batches(poll, alive)
        try:
            for batch in batches:
                yield from batch
        finally:
            batches.close()

    def batches(self, poll: float = 0.5, alive: Callable[[], bool] | None = None
                ) -> Iterator[list[GenerationEvent]]:
        """:meth:`events` in lists: waits for the next event, then takes every event already queued behind it, so
        that a consumer that fell behind by a few steps catches up with one write instead of one per event."""
        left = self.n
        error = None
        try:
            while left:
                try:
                    ev = self._queue.get(timeout=poll)
                except queue.Empty:
                    if alive is not None and not alive():
                        raise ConnectionAbortedError("the client went away") from None
                    continue
                batch = []
                while True:
                    if isinstance(ev, BaseException):
                        left, error = 0, ev
                        break
                    batch.append(ev)
                    if ev.finish_reason:
                        left -= 1
                    if not left:
                        break
                    try:
                        ev = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if batch:
                    yield batch
                if error is not None:
                    raise error
        finally:
            if left:
                self.cancel()

    async def abatches(self) -> AsyncIterator[list[GenerationEvent]]:
        """:meth:`batches` for asyncio: the scheduler's thread wakes the event loop when an event arrives (one wake-up
        per wait, not per event), so no thread waits per request. Leaving the loop early (close the generator) or
        cancelling the task that runs it cancels the request."""
        import asyncio

        loop = asyncio.get_running_loop()
        left, error = self.n, None
        try:
            while left:
                batch = []
                while left:
                    try:
                        ev = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(ev, BaseException):
                        left, error = 0, ev
                        break
                    batch.append(ev)
                    left -= bool(ev.finish_reason)
                if batch:
                    yield batch
                if error is not None:
                    raise error
                if batch or not left:
                    continue
                fut = loop.create_future()
                self._waiter = (loop, fut)
                if self._queue.empty():  # an event put before the waiter was set is seen here
                    await fut
                self._waiter = None
        finally:
            self._waiter = None
            if left:
                self.cancel()


def _resolve(fut):
    if not fut.done():
        fut.set_result(None)


class _Seq:
    """One prompt of a request, waiting or in a row."""

    def __init__(self, sub: Submission, index: int, prompt: list[int], params: SamplingParams, stop_ids, rng,
                 tokenizer):
        self.sub, self.index, self.prompt, self.params = sub, index, prompt, params
        self.stop_ids = stop_ids
        self.rng = rng                # random.Random for a sampled sequence, None for a greedy one
        self.text = _RowText(tokenizer, params.stop)
        self.row = -1
        self.pad = 0                  # its first cache slot
        self.drawn = 0                # tokens drawn so far (a stop token included)
        self.cached = 0               # prompt tokens found in the prefix cache (paged engine)
        self.ready = False            # its prompt is computed: it draws a token every step
        # host clock (perf_counter) when it was queued, given a row, and had its prompt computed: a time to first
        # token split into waiting, prefill and the first draw (Scheduler.ttft_parts)
        self.t_queued = time.perf_counter()
        self.t_row = self.t_ready = 0.0
        # structured output: its grammar's matcher (infer/structured.py), None for a free row
        self.constraint = params.grammar.start() if params.grammar is not None else None

    @property
    def end(self) -> int:
        """One past the last slot this sequence may need."""
        return self.pad + len(self.prompt) + self.params.max_new_tokens

    def emit(self, ev: GenerationEvent | BaseException):
        self.sub._put(ev)


def kv_bytes_per_token(model) -> int:
    """The bytes one token's keys and values take in a cache of the model's dtype, over every layer."""
    cfg = model.cfg
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * model.embed_tokens.weight.element_size()


def default_cache_len(model, max_batch: int, cpu_budget: int = 2 << 30) -> int:
    """Twice the model's context when a cache that long takes at most half of the free GPU memory (``cpu_budget``
    bytes on CPU), else the context (see the module docstring for what the second length costs)."""
    cfg, w = model.cfg, model.embed_tokens.weight
    per_slot = max_batch * kv_bytes_per_token(model)
    budget = torch.cuda.mem_get_info(w.device)[0] // 2 if w.device.type == "cuda" else cpu_budget
    return 2 * cfg.max_seq_len if per_slot * 2 * cfg.max_seq_len <= budget else cfg.max_seq_len


def kv_blocks_for_bytes(model, block_size: int, budget: int) -> int:
    """How many blocks of ``block_size`` tokens (keys and values of every layer) fit in ``budget`` bytes, the null
    block included."""
    per_block = block_size * kv_bytes_per_token(model)
    blocks = budget // per_block
    if blocks < 2:
        raise ValueError(f"kv_cache_gb: {budget / (1 << 30):g} GiB holds {blocks} blocks of {block_size} tokens "
                         f"({per_block} bytes each); give more")
    return int(blocks)


class Scheduler:
    """Continuous batching over ``generator``'s model (see the module docstring); a background thread runs it.

    ``max_batch`` rows; up to ``max_queue`` sequences may wait for a row beyond those that a free row takes at
    once, more are refused (:class:`QueueFull`). ``pipelined`` (None: on CUDA): queue each decode step before the
    host reads the tokens drawn for it.

    ``engine``: "paged" (the default: a pool of ``kv_blocks`` blocks of ``block_size`` tokens with prefix caching,
    ``infer/paged.py``; a sequence joins when the pool holds its prompt and budget next to the running rows'; the
    default pool holds every row at the full context) or "column" (the layout of the module docstring: rows of
    ``cache_len`` slots, default ``default_cache_len``; with the fused decode step and CUDA graphs).

    ``prefill_graphs`` (None: on when the decode step is graphed, i.e. on CUDA): a prompt computed alone of at most
    2,048 new tokens is padded to its length bucket and computed by replaying a CUDA graph of that bucket.
    """

    def __init__(self, generator: Generator, max_batch: int = 8, max_queue: int = 64, cache_len: int | None = None,
                 compact_min: int = 16, pipelined: bool | None = None, start: bool = True, engine: str = "paged",
                 block_size: int = 16, kv_blocks: int | None = None, kv_cache_gb: float | None = None,
                 prefix_caching: bool = True, max_num_batched_tokens: int = 2048, speculative_ngram: int = 0,
                 draft_model=None, speculative_tokens: int = 0, prefill_graphs: bool | None = None):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"scheduler: max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"scheduler: max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if engine not in ("paged", "column"):
            raise ValueError(f"scheduler: engine must be 'paged' or 'column', got {engine!r}")
        if speculative_ngram < 0 or (speculative_ngram and engine != "paged"):
            raise ValueError(f"scheduler: speculative_ngram must be >= 0 and needs the paged engine, got "
                             f"{speculative_ngram} with {engine!r}")
        model = generator.model
        if prefill_graphs is None:
            prefill_graphs = generator.device.type == "cuda" and bool(generator.cuda_graph)
        if draft_model is not None:
            if speculative_ngram:
                raise ValueError("scheduler: speculative_ngram and draft_model are exclusive: draft by prompt lookup "
                                 "or by a draft model, not both")
            if engine != "paged" or speculative_tokens < 1:
                raise ValueError(f"scheduler: a draft model needs the paged engine and speculative_tokens >= 1, got "
                                 f"{speculative_tokens} with {engine!r}")
            if draft_model.cfg.vocab_size != model.cfg.vocab_size:
                raise ValueError(f"scheduler: the draft model's vocabulary has {draft_model.cfg.vocab_size} ids, the "
                                 f"model's {model.cfg.vocab_size}; the draft must share the model's tokenizer")
            if draft_model.embed_tokens.weight.device != generator.device:
                raise ValueError(f"scheduler: the draft model is on {draft_model.embed_tokens.weight.device}, the "
                                 f"model on {generator.device}")
        elif speculative_tokens:
            raise ValueError("scheduler: speculative_tokens needs a draft_model (prompt lookup: speculative_ngram)")
        self.generator = generator
        self.tokenizer = generator.tokenizer
        if callable(getattr(self.tokenizer, "byte_decoding", None)):
            self.tokenizer.byte_decoding()  # checked once now (every id decoded), not at the first request
        self.max_batch, self.max_queue = max_batch, max_queue
        self.paged = engine == "paged"
        self.engine = engine
        self.drafter = None           # paged: the draft model's cache and drafting (infer/speculative.py)
        if self.paged:
            from zero2all.infer.paged import PagedSession

            self.cache_len = cache_len or model.cfg.max_seq_len
            self.context = min(self.cache_len, model.cfg.max_seq_len)
            if kv_blocks is None and kv_cache_gb is not None:
                kv_blocks = kv_blocks_for_bytes(model, block_size, int(kv_cache_gb * (1 << 30)))
            elif kv_blocks is None and generator.device.type == "cuda":
                # every row at the full context, when that takes at most half of the free GPU memory; else that half
                full = max_batch * -(-self.context // block_size) + 1
                half = torch.cuda.mem_get_info(generator.device)[0] // 2
                kv_blocks = min(full, kv_blocks_for_bytes(model, block_size, half))
            self.session = PagedSession(model, max_batch, self.context, n_blocks=kv_blocks, block_size=block_size,
                                        prefix_caching=prefix_caching, cuda_graph=bool(generator.cuda_graph),
                                        prefill_buckets=PREFILL_BUCKETS if prefill_graphs else ())
            if draft_model is not None:  # its own pool of as many blocks (fewer bytes for a smaller model)
                from zero2all.infer.speculative import ModelDrafter

                self.drafter = ModelDrafter(draft_model, max_batch, self.context, self.session.pool.n_blocks,
                                            block_size, prefix_caching, model.cfg.padded_vocab_size)
        else:
            self.cache_len = cache_len or default_cache_len(model, max_batch)
            self.context = min(self.cache_len, model.cfg.max_seq_len)  # the most one sequence may span
            self.session = DecodeSession(model, max_batch, self.cache_len, cuda_graph=generator.cuda_graph,
                                         compile=generator.compile, window=generator.attention_window,
                                         fused=generator.use_fused(max_batch),
                                         prefill_buckets=PREFILL_BUCKETS if prefill_graphs else (),
                                         lone_rows=generator.use_fused(1), row_buckets=True)
        self.compact_min = compact_min
        self.max_num_batched_tokens = max_num_batched_tokens
        self._prefilling: list[_Seq] = []  # paged: started sequences whose prompt is still being computed
        self.prefill_chunks = 0       # paged: prefill forwards run (one per step that computes prompt tokens)
        # paged: draft tokens per speculating row and step (prompt lookup or the draft model); 0 = off
        self.spec_k = speculative_tokens if draft_model is not None else speculative_ngram
        self.spec_method = "draft_model" if draft_model is not None else "ngram" if speculative_ngram else "off"
        self.spec_drafted = self.spec_accepted = 0
        self.vocab = model.cfg.padded_vocab_size
        self.device = generator.device
        self.default_stop_ids = frozenset(generator.default_stop_ids())
        self._cond = threading.Condition()
        self._waiting: deque[_Seq] = deque()
        self._rows: list[_Seq | None] = [None] * max_batch
        self._col = 0                 # the cache slot the next decode step writes
        self._logits: torch.Tensor | None = None  # (B, V) float32: every running row's next-token logits
        self._changed = True          # rows joined, left or moved: the per-row tensors are rebuilt
        self._seen: torch.Tensor | None = None    # (B, V) bool, for repetition penalties
        self._forced: dict[int, int] = {}  # row -> its next token, drawn already (a speculative sampling rejection)
        self._penalty = self._sampled = None
        self._constrained: tuple | None = None   # (rows, constraints) of the running rows with a grammar
        self._accepting, self._paused, self._stopping = True, False, False
        self.steps = 0                # decode steps run
        self.moves = 0                # times the occupied span was moved
        self.finished: Counter = Counter()  # sequences ended, by finish_reason ("error" for a failed step)
        # summed over sequences, seconds from queued to a row / from a row to the prompt computed (the host's view:
        # chunked prefills span steps) / from there to the first token drawn (the GPU finished the prefill and the
        # host read the token); "n" sequences
        self.ttft_parts = {"queue": 0.0, "prefill": 0.0, "first_draw": 0.0, "n": 0}
        on_cuda = self.device.type == "cuda"
        self.pipelined = on_cuda if pipelined is None else pipelined
        self._host = torch.empty(max_batch, dtype=torch.long, pin_memory=on_cuda)
        self._copied = torch.cuda.Event() if on_cuda else None
        self._thread = threading.Thread(target=self._run, name="z2all-scheduler", daemon=True)
        if start:
            self._thread.start()

    # -- the requests' side ------------------------------------------------------------------------------------
    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Submission:
        """Queue one sequence per prompt (token ids); raises ValueError for what can never run, QueueFull,
        ShuttingDown. Prompt i of a seeded request draws from ``random.Random(seed + i)``."""
        params.validate()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts:
            raise ValueError("no prompt")
        check_prompts(prompts, params.max_new_tokens, self.context, self.vocab)
        if len(prompts) > self.max_batch:
            raise ValueError(f"{len(prompts)} prompts in one request; at most {self.max_batch} (the batch rows)")
        if self.paged and not all(self.session.fits_ever(len(p) + params.max_new_tokens) and
                                  (not self._drafts_with_model(params, len(p) + params.max_new_tokens)
                                   or self.drafter.fits_ever(len(p) + params.max_new_tokens)) for p in prompts):
            raise ValueError(f"a prompt with {params.max_new_tokens} new tokens needs more than the KV cache's "
                             f"{self.session.pool.total} blocks of {self.session.block_size} tokens")
        stop_ids = self.default_stop_ids if params.stop_token_ids is None else frozenset(params.stop_token_ids)
        sub = Submission(self, len(prompts))
        seqs = []
        for i, p in enumerate(prompts):
            rng = None
            if params.temperature > 0:
                rng = random.Random(params.seed + i if params.seed is not None else os.urandom(16))
            seqs.append(_Seq(sub, i, p, params, stop_ids, rng, self.tokenizer))
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            free = self._rows.count(None)
            if len(self._waiting) + len(seqs) - free > self.max_queue:
                raise QueueFull(f"server busy: {self.max_batch} running and {self.max_queue} waiting sequences at "
                                "most; retry later")
            self._waiting.extend(seqs)
            self._cond.notify_all()
        return sub

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationEvent]:
        """Submit and wait: every event, in order (a convenience for tests and scripts)."""
        return list(self.submit(prompts, params).events())

    # -- control -----------------------------------------------------------------------------------------------
    def busy(self) -> bool:
        with self._cond:
            return bool(self._waiting) or any(s is not None for s in self._rows)

    def stats(self) -> dict:
        with self._cond:
            out = {"running": sum(s is not None for s in self._rows), "waiting": len(self._waiting),
                   "column": self._col, "steps": self.steps, "moves": self.moves, "finished": dict(self.finished),
                   "ttft_parts": dict(self.ttft_parts)}
            if self.paged:
                pool = self.session.pool
                out.update(kv_blocks_in_use=pool.in_use(), kv_blocks_total=pool.total,
                           kv_block_size=pool.block_size, prefix_cache_lookups=pool.lookups,
                           prefix_cache_hits=pool.hits, prefix_cache_hit_rate=pool.hit_rate(),
                           spec_method=self.spec_method, spec_drafted=self.spec_drafted,
                           spec_accepted=self.spec_accepted,
                           spec_acceptance_rate=self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0)
                if self.drafter is not None:
                    dpool = self.drafter.session.pool
                    out.update(draft_kv_blocks_in_use=dpool.in_use(), draft_kv_blocks_total=dpool.total,
                               draft_prefix_cache_hits=dpool.hits)
            return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing runs or waits; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._waiting or any(s is not None for s in self._rows):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def pause(self):
        """No scheduler iteration starts until :meth:`resume` (requests queue up; cancellations are still
        handled): for tests and maintenance."""
        with self._cond:
            self._paused = True

    def resume(self):
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @contextmanager
    def paused(self):
        """:meth:`pause` for the duration of a ``with`` block."""
        self.pause()
        try:
            yield self
        finally:
            self.resume()

    def stop_accepting(self):
        with self._cond:
            self._accepting = False

    def drain(self, timeout: float) -> int:
        """Stop accepting; let running and waiting sequences finish for up to ``timeout`` seconds, then cancel what
        is left (finish_reason "cancelled"). Returns the number of requests cancelled."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy_locked() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            subs = {id(s.sub): s.sub for s in (*self._rows, *self._waiting) if s is not None}
            for sub in subs.values():
                sub.cancelled = True
            self._cond.notify_all()
            end = time.monotonic() + 10.0  # the loop hands out the final events at its next iteration
            while self._busy_locked() and time.monotonic() < end and self._thread.is_alive():
                self._cond.wait(0.1)
        return len(subs)

    def stop(self, timeout: float = 10.0):
        """Cancel everything and end the thread."""
        with self._cond:
            self._accepting, self._stopping = False, True
            for s in (*self._rows, *self._waiting):
                if s is not None:
                    s.sub.cancelled = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _wake(self):
        with self._cond:
            self._cond.notify_all()

    def _busy_locked(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._rows)

    # -- the loop ----------------------------------------------------------------------------------------------
    def _run(self):
        with torch.inference_mode():
            while True:
                with self._cond:
                    while True:
                        self._reap()
                        if self._stopping and not self._busy_locked():
                            return
                        if not self._paused and self._busy_locked():
                            break
                        self._cond.wait()
                    ops = self._admit()
                try:
                    self._step(ops)
                except Exception as e:  # noqa: BLE001 - the requests in the batch fail, the server goes on
                    traceback.print_exc(file=sys.stderr)
                    self._fail(e)

    def _reap(self):
        """(Lock held.) End the sequences of cancelled requests, running or waiting."""
        for seq in self._rows:
            if seq is not None and seq.sub.cancelled:
                self._finish(seq, GenerationEvent(seq.index, -1, seq.text.finish(), CANCELLED))
        if any(s.sub.cancelled for s in self._waiting):
            for seq in [s for s in self._waiting if s.sub.cancelled]:
                seq.emit(GenerationEvent(seq.index, -1, "", CANCELLED))
                self.finished[CANCELLED] += 1
            self._waiting = deque(s for s in self._waiting if not s.sub.cancelled)
            self._cond.notify_all()

    def _finish(self, seq: _Seq, ev: GenerationEvent):
        ev.cached_tokens = seq.cached
        seq.emit(ev)
        self.finished[ev.finish_reason] += 1
        self._rows[seq.row] = None
        self._forced.pop(seq.row, None)
        if self.paged:
            self.session.release(seq.row)
            if self.drafter is not None:
                self.drafter.release(seq.row)
        self._changed = True
        self._cond.notify_all()

    def _fail(self, cause: Exception):
        """The step failed: every running sequence gets the error, its request is cancelled; the cache restarts.
        The error is a RuntimeError whatever the cause (a ValueError from inside would read as the client's)."""
        error = RuntimeError(f"generation failed: {type(cause).__name__}: {cause}")
        error.__cause__ = cause
        with self._cond:
            for seq in self._rows:
                if seq is not None:
                    seq.sub.cancelled = True
                    seq.emit(error)
                    self.finished["error"] += 1
                    self._rows[seq.row] = None
            if self.paged:
                self.session.reset()
                if self.drafter is not None:
                    self.drafter.reset()
            self._logits, self._changed = None, True
            self._prefilling = []
            self._forced.clear()
            self._cond.notify_all()

    def _speculates(self, params: SamplingParams) -> bool:
        """Whether a sequence's rows draft tokens: speculation on, no repetition penalty, and greedy (prompt
        lookup) or greedy or sampled (a draft model: sampled rows by speculative sampling); never a row with a
        grammar (its matcher would have to check the drafts)."""
        return bool(self.spec_k) and params.repetition_penalty == 1.0 and params.grammar is None and (
            params.temperature == 0 or self.drafter is not None)

    def _drafts_with_model(self, params: SamplingParams, span: int) -> bool:
        """Whether a sequence that may hold ``span`` tokens takes rows in the draft model's cache: it speculates,
        and fits the draft model's context (a longer one decodes without speculation)."""
        return self.drafter is not None and self._speculates(params) and span <= self.drafter.max_len

    def _placement(self, n: int, m: int, drafts: bool = False) -> int | None:
        """(Lock held.) How far to move the occupied span so that a prompt of n tokens with m new tokens fits
        right-aligned at the column (0: it fits as is), or None when it cannot join now. ``drafts``: the sequence
        also needs room in the draft model's cache."""
        if self.paged:
            fits = self.session.can_admit(n + m) and (not drafts or self.drafter.can_admit(n + m))
            return 0 if fits else None
        running = [s for s in self._rows if s is not None]
        if not running:
            return n - self._col  # an empty cache: start over
        c, L = self._col, self.cache_len
        lo = max(n - c, -min(s.pad for s in running))              # room for its prompt; no row's start below 0
        hi = min(L - m - c, L - max(s.end for s in running))      # room for its tokens and the others' tokens
        if lo > hi:
            return None
        return 0 if lo <= 0 <= hi else (lo if lo > 0 else hi)

    def _move(self, shift: int) -> tuple:
        """(Lock held.) Move the occupied span (host bookkeeping now; the copy is an op for the step)."""
        running = [s for s in self._rows if s is not None]
        lo = min((s.pad for s in running), default=self._col)
        op = ("move", lo, self._col, shift)
        self.moves += bool(running)
        for s in running:
            s.pad += shift
        self._col += shift
        self._changed = True
        return op

    def _admit(self) -> list[tuple]:
        """(Lock held.) Give free rows to waiting sequences in arrival order; returns the device ops to run."""
        ops = []
        while self._waiting and None in self._rows:
            seq = self._waiting[0]
            drafts = self._drafts_with_model(seq.params, len(seq.prompt) + seq.params.max_new_tokens)
            shift = self._placement(len(seq.prompt), seq.params.max_new_tokens, drafts)
            if shift is None:
                break
            self._waiting.popleft()
            if shift:
                ops.append(self._move(shift))
            seq.row = self._rows.index(None)
            seq.t_row = time.perf_counter()
            seq.pad = self._col - len(seq.prompt)
            self._rows[seq.row] = seq
            self._changed = True
            if self.paged:  # its blocks are taken now, so that the next sequence's room counts them
                self.session.reserve(seq.row, len(seq.prompt) + seq.params.max_new_tokens)
                if drafts:
                    self.drafter.reserve(seq.row, len(seq.prompt) + seq.params.max_new_tokens)
            ops.append(("prefill", seq, self._col))
        running = [s for s in self._rows if s is not None]
        if running and not self.paged:
            common = min(s.pad for s in running)
            if common >= max(self.compact_min, self._col // 4):  # slots that no row reads: drop them
                ops.append(self._move(-common))
        return ops

    def _rebuild(self):
        """The per-row tensors after rows joined, left or moved: padding, sampling parameters."""
        rows, dev = self._rows, self.device
        self.session.set_pad_lens([s.pad if s is not None else self._col for s in rows])  # free: see itself
        sampled = [r for r, s in enumerate(rows) if s is not None and s.ready and s.params.temperature > 0]
        self._sampled = None
        if sampled:
            p = [rows[r].params for r in sampled]
            self._sampled = (sampled, to_device(sampled, torch.long, dev),
                             to_device([x.temperature for x in p], torch.float32, dev),
                             to_device([min(x.top_k, self.vocab) for x in p], torch.long, dev),
                             to_device([x.top_p for x in p], torch.float32, dev))
        constrained = [(r, s.constraint) for r, s in enumerate(rows)
                       if s is not None and s.ready and s.constraint is not None]
        self._constrained = tuple(zip(*constrained)) if constrained else None
        penalties = [s.params.repetition_penalty if s is not None else 1.0 for s in rows]
        self._penalty = None
        if any(p != 1.0 for p in penalties):
            self._penalty = to_device(penalties, torch.float32, dev)[:, None]
        self._changed = False

    @staticmethod
    def prefill_groups(seqs: list[_Seq], short: int = 64) -> list[list[_Seq]]:
        """Sequences joining at the same column, in groups prefilled together (one forward each): longest prompt
        first, a group takes prompts of at least half its longest one's length (or any, while that one is at most
        ``short`` tokens), so that padding is at most about half of a group's computed tokens."""
        groups: list[list[_Seq]] = []
        for seq in sorted(seqs, key=lambda s: -len(s.prompt)):
            if groups and (2 * len(seq.prompt) >= len(groups[-1][0].prompt) or len(groups[-1][0].prompt) <= short):
                groups[-1].append(seq)
            else:
                groups.append([seq])
        for g in groups:
            g.sort(key=lambda s: s.row)  # consecutive rows are prefilled through a view of the cache
        return groups

    def _prefill(self, seqs: list[_Seq], end: int):
        """The joining sequences' prompts into their rows (ending just before ``end``); their next-token logits."""
        S, B, dev = self.session, self.max_batch, self.device
        for group in self.prefill_groups(seqs):
            logits = S.prefill_rows([s.row for s in group], [s.prompt for s in group], end)
            if self.paged:
                for s in group:
                    s.cached = S.cached_tokens.get(s.row, 0)
            if self._logits is None:
                self._logits = torch.zeros(B, logits.size(-1), dtype=torch.float32, device=dev)
            if len(group) == 1:
                self._logits[group[0].row] = logits[0]
            else:
                self._logits[to_device([s.row for s in group], torch.long, dev)] = logits
        self._ready(seqs)

    def _ready(self, seqs: list[_Seq]):
        """Sequences whose prompt is computed (their first logits in place): they draw tokens from now on."""
        B, dev = self.max_batch, self.device
        now = time.perf_counter()
        for seq in seqs:
            seq.ready = True
            seq.t_ready = now
            self._changed = True
            if seq.params.repetition_penalty != 1.0:
                if self._seen is None:
                    self._seen = torch.zeros(B, self._logits.size(-1), dtype=torch.bool, device=dev)
                self._seen[seq.row] = False
                self._seen[seq.row, to_device(seq.prompt, torch.long, dev)] = True

    def _prefill_chunk(self):
        """(Paged.) One forward of prompt tokens under the step's token budget: the budget less one token per
        decoding row, given to the started prompts in arrival order; the prompts that complete join the decode."""
        S = self.session
        self._prefilling = [s for s in self._prefilling if self._rows[s.row] is s]  # cancelled ones are gone
        decoding = sum(s is not None and s.ready for s in self._rows)
        left = max(1, self.max_num_batched_tokens - decoding)
        rows, takes = [], []
        for seq in self._prefilling:
            if left <= 0:
                break
            take = min(S.remaining(seq.row), left)
            rows.append(seq.row)
            takes.append(take)
            left -= take
        if not rows:
            return
        logits = S.prefill_step(rows, takes)
        if self.drafter is not None:
            self.drafter.prefill(rows, [S.remaining(r) for r in rows])
        self.prefill_chunks += 1
        done = [i for i, r in enumerate(rows) if S.remaining(r) == 0]
        if not done:
            return
        if self._logits is None:
            self._logits = torch.zeros(self.max_batch, logits.size(-1), dtype=torch.float32, device=self.device)
        idx = [rows[i] for i in done]
        self._logits[to_device(idx, torch.long, self.device)] = logits[to_device(done, torch.long, self.device)]
        finished = [s for s in self._prefilling if s.row in idx]
        self._prefilling = [s for s in self._prefilling if s.row not in idx]
        self._ready(finished)

    def _step(self, ops: list[tuple]):
        S = self.session
        joining: list[_Seq] = []  # the prefills between two moves (all at the same column) run together
        end = self._col
        for op in ops:
            if op[0] == "move":
                if joining:
                    self._prefill(joining, end)
                    joining = []
                S.move_columns(*op[1:])
                continue
            _, seq, end = op
            if self.paged:  # its cached prefix is taken now; its prompt is computed a chunk per step
                seq.cached = S.start(seq.row, seq.prompt, len(seq.prompt) + seq.params.max_new_tokens)
                if self.drafter is not None and self.drafter.has(seq.row):
                    self.drafter.start(seq.row, seq.prompt, len(seq.prompt) + seq.params.max_new_tokens)
                self._prefilling.append(seq)
                continue
            joining.append(seq)
        if joining:
            self._prefill(joining, end)
        if self._prefilling:
            self._prefill_chunk()
        if self._changed:
            self._rebuild()
        running = [s for s in self._rows if s is not None and s.ready]
        if not running:
            return

        logits = self._logits
        if self._penalty is not None:
            logits = apply_repetition_penalty(logits, self._seen, self._penalty)
        if self._constrained is not None:  # structured output: what the grammar forbids is -inf (greedy or not)
            apply_masks(logits, *self._constrained)
        tokens = argmax_rows(logits)                                                  # (B,): greedy rows
        if self._sampled is not None:
            rows, idx, temperature, top_k, top_p = self._sampled
            u = to_device([self._rows[r].rng.random() for r in rows], torch.float32, self.device)
            tokens[idx] = sample_rows(logits[idx], temperature, top_k, top_p, u)
        if self._forced:
            for row, tok in self._forced.items():
                tokens[row] = tok
            self._forced.clear()
        if self._penalty is not None:
            self._seen.scatter_(1, tokens[:, None], True)

        if self.spec_k and any(self._speculates(s.params) for s in running):
            return self._speculative_step(running, tokens)
        on_cuda = self.device.type == "cuda"
        launched = False
        if self.pipelined:
            # queue the next step before the host looks at the tokens (the GPU keeps busy meanwhile); rows that
            # turn out to have finished just run along and are ignored
            if on_cuda:
                self._host.copy_(tokens, non_blocking=True)
                self._copied.record()
            if any(s.drawn + 1 < s.params.max_new_tokens for s in running):
                self._logits, launched = self._decode(tokens, running), True
            if on_cuda:
                self._copied.synchronize()
            host = self._host.tolist() if on_cuda else tokens.tolist()
            if launched and self.paged:
                S.note_tokens(host)
        else:
            host = tokens.tolist()
        with self._cond:
            for seq in running:
                if not seq.sub.cancelled:
                    self._advance(seq, host[seq.row])
            still = any(s is not None for s in self._rows)
        if not self.pipelined and still:  # nothing runs ahead: step only for the rows that go on
            self._logits, launched = self._decode(tokens, running), True
            if self.paged:
                S.note_tokens(host)
        self.steps += launched
        if launched:
            self._col += 1
        else:
            self._logits = None

    def _decode(self, tokens: torch.Tensor, running: list[_Seq]) -> torch.Tensor:
        """The next decode step; in the column engine, over a lone stream's row alone, else over the smallest row
        bucket holding the running rows (rows are handed out lowest first)."""
        if self.paged:
            return self.session.decode(tokens, self._col)
        if len(running) == 1:
            return self.session.decode(tokens, self._col, lone_row=running[0].row)
        return self.session.decode(tokens, self._col, rows=1 + max(s.row for s in running))

    def _speculative_step(self, running: list[_Seq], tokens: torch.Tensor):
        """(Paged, speculating rows present.) Speculative decoding: after the drawn tokens are handed out, each
        speculating row still running proposes up to ``spec_k`` draft tokens: by prompt lookup (greedy rows), the
        tokens that followed the latest earlier occurrence of its last few tokens (``paged.ngram_draft``), or the
        draft model's continuation (``speculative.ModelDrafter``: greedy, or sampled for a sampled row). One
        forward feeds every row its drawn token and its draft, and a greedy row keeps the draft tokens that equal
        its own argmax at each position, up to the first that does not, plus the logits after the last kept one
        (so it draws the next token from them as usual); a sampled row keeps or rejects them by speculative
        sampling (``speculative.accept_sampled``), a rejected one's replacement being its next token
        (``_forced``). The draft model's cache is rolled back to the kept length too. Greedy tokens are exactly
        those of plain greedy decoding, sampled ones have plain sampling's distribution; a step yields
        1 + (accepted) tokens for such a row. Not pipelined: the drafts need the host to know the drawn tokens
        first."""
        from zero2all.infer.paged import ngram_draft

        S = self.session
        host = tokens.tolist()
        with self._cond:
            for seq in running:
                if not seq.sub.cancelled:
                    self._advance(seq, host[seq.row])
            live = [s for s in running if self._rows[s.row] is s]
        if not live:
            self._logits = None
            return
        lengths = {}
        for seq in live:
            if self._speculates(seq.params) and (self.drafter is None or self.drafter.has(seq.row)):
                k = min(self.spec_k, seq.params.max_new_tokens - seq.drawn - 1, S.room(seq.row) - 1)
                if k > 0:
                    lengths[seq.row] = k
        samplers, q = {}, {}
        if self.drafter is not None:
            from zero2all.infer.speculative import Sampler

            for r in lengths:
                p = self._rows[r].params
                if p.temperature > 0:
                    samplers[r] = Sampler(p.temperature, p.top_k, p.top_p, self._rows[r].rng)
            drafts, q = self.drafter.propose(lengths, {r: S.history(r) for r in lengths}, host, samplers)
        else:
            drafts = {r: d for r, k in lengths.items() if (d := ngram_draft(S.history(r) + [host[r]], k))}
        if not drafts:
            self._logits = S.decode(tokens, self._col)
            S.note_tokens(host)
            self.steps += 1
            return
        logits, T = S.verify(host, drafts)
        nxt = logits[:, -1].clone()
        accepted = {}
        for row, draft in drafts.items():
            n = 1 + len(draft)
            if row in samplers:  # kept with probability min(1, p/q); a rejected one is replaced
                from zero2all.infer.speculative import accept_sampled, draft_probs

                p = draft_probs(logits[row, T - n:T - 1], [samplers[row]] * len(draft))
                a, replacement = accept_sampled(p, q[row], draft, samplers[row].rng)
                if replacement is not None:
                    self._forced[row] = replacement
            else:
                predicted = argmax_rows(logits[row, T - n:T - 1]).tolist()   # after the token, d1, ..., d(k-1)
                a = 0
                while a < len(draft) and predicted[a] == draft[a]:
                    a += 1
            accepted[row] = a
            nxt[row] = logits[row, T - n + a]
            self.spec_drafted += len(draft)
            self.spec_accepted += a
        S.finish_verify(accepted)
        if self.drafter is not None:
            for row in drafts:
                self.drafter.rollback(row, S.rows[row].computed)
        self._logits = nxt
        self.steps += 1
        with self._cond:
            for row, a in accepted.items():
                seq = self._rows[row]
                for tok in drafts[row][:a]:
                    if seq is None or self._rows[row] is not seq or seq.sub.cancelled:
                        break
                    self._advance(seq, tok)

    def _advance(self, seq: _Seq, tok: int):
        """(Lock held.) One drawn token of a running sequence: stop checks and its streamed text."""
        if not seq.drawn:
            parts = self.ttft_parts
            parts["queue"] += seq.t_row - seq.t_queued
            parts["prefill"] += seq.t_ready - seq.t_row
            parts["first_draw"] += time.perf_counter() - seq.t_ready
            parts["n"] += 1
        seq.drawn += 1
        if seq.constraint is not None and seq.constraint.accept(tok) and seq.constraint.done:
            # the grammar is complete and this is its stop token (also when ignore_eos left no stop ids)
            return self._finish(seq, GenerationEvent(seq.index, tok, seq.text.finish(), "stop", stop_token=True))
        if tok in seq.stop_ids:
            return self._finish(seq, GenerationEvent(seq.index, tok, seq.text.finish(), "stop", stop_token=True))
        piece, hit_stop = seq.text.add(tok)
        if hit_stop:
            self._finish(seq, GenerationEvent(seq.index, tok, piece, "stop"))
        elif seq.drawn >= seq.params.max_new_tokens:
            self._finish(seq, GenerationEvent(seq.index, tok, piece + seq.text.finish(), "length"))
        else:
            seq.emit(GenerationEvent(seq.index, tok, piece))
