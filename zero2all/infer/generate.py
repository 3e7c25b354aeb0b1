"""Batched generation: a preallocated KV cache, sampling, stop conditions, streaming, CUDA-graph decode steps.

How a batch of prompts of different lengths is laid out (``P`` = longest prompt, ``L`` = cache length)::

    cache slot   0    1    2    3    4    5 ...
    row 0        pad  pad  a    b    c  | generated tokens at slots P, P+1, ...
    row 1        d    e    f    g    h  |

Prompts are left-padded so every row's next token goes to the same cache slot (one ``index_copy_`` per layer),
while each row keeps its own RoPE positions (``position = slot - pad_len``, so a row's positions start at 0 as if
it were alone) and an attention mask hides its padding: key slot j is visible to a query at slot i iff
``pad_len <= j <= i``. Because the cache has a fixed shape and the step's inputs live in fixed buffers (the token,
the slot index), the decode step is the same sequence of kernels every time; on CUDA it is captured once as a CUDA
graph and replayed, which removes the per-kernel launch cost that dominates small-batch decoding (optionally the
step is compiled with ``torch.compile`` first so that the elementwise ops fuse). On CPU the same step runs eagerly.

Sampling, applied to float32 logits in this order (each step, per row):

    repetition penalty p (CTRL, Keskar et al. 2019): for every token already in the row (prompt or output),
                         logit / p if logit > 0 else logit * p
    temperature T:       logits / T          (T = 0 means greedy: argmax)
    top-k:               keep the k largest logits
    top-p (nucleus):     keep the smallest set of most likely tokens whose probability sums to >= p
    draw:                one sample from softmax(logits) with a seedable ``torch.Generator``

A row stops at a stop token (default: the tokenizer's end-of-text and ``<|im_end|>``), at a stop string (the text
is cut before it), or after ``max_new_tokens``. Text is streamed in pieces that are safe to show: a piece is held
back while it could still be the start of a stop string or ends inside a multi-byte character.

The server's continuous batching (``infer/scheduler.py``) keeps one session of this layout and lets requests come
and go between steps: a request joins with its prompt right-aligned to the current slot (``DecodeSession.prefill_rows``
writes only the joining rows, several in one forward, so a row's padding is simply the slots before its prompt), and
the occupied span of every row is moved left now and then (``DecodeSession.move_columns``) so that the slot does
not run off the cache. Each row there has its own sampling parameters (``sample_rows``).
"""

from __future__ import annotations

import codecs
import functools
import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from zero2all.model.z2all import Z2all

# --------------------------------------------------------------------------------------------------------------
# parameters and results


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    repetition_penalty: float = 1.0   # 1 = off
    stop: Sequence[str] = ()          # stop strings (not included in the output)
    stop_token_ids: Sequence[int] | None = None  # None = the tokenizer's eos and <|im_end|>
    seed: int | None = None           # None = drawn from torch's global generator
    grammar: object = None            # a compiled grammar (infer/structured.py): the scheduler constrains each row

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be a positive integer, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p", "repetition_penalty"):  # NaN passes every comparison below
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: must be an integer >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop: must be non-empty strings, got {list(self.stop)!r}")
        return self


@dataclass
class GenerationEvent:
    """One streamed step of one row: the token drawn, the newly showable text, and why the row ended (or None)."""

    index: int
    token_id: int
    text: str
    finish_reason: str | None = None  # "stop" (stop token or string) | "length"
    stop_token: bool = False          # token_id is the stop token that ended the row (not part of the output)
    cached_tokens: int = 0            # on the final event: prompt tokens taken from the prefix cache


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]              # generated tokens, the stop token excluded
    text: str
    finish_reason: str
    num_generated: int                # tokens drawn, the stop token included


# --------------------------------------------------------------------------------------------------------------
# logits processing


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor
                             ) -> torch.Tensor:
    """logits (B, V), seen (B, V) bool: divide positive / multiply negative logits of seen tokens by ``penalty``
    (a number, or one per row as a (B, 1) tensor; a row's penalty of 1 leaves it exactly as it was)."""
    if not isinstance(penalty, torch.Tensor) and penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and outside the nucleus of mass ``top_p`` to -inf (at least one survives)."""
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens strictly more likely than it already reach top_p
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@functools.lru_cache(maxsize=None)  # called every greedy step: computed once per vocabulary size
def _slices(V: int) -> int:
    """The divisor of V nearest sqrt(V) (slices of equal length for the two-pass argmax), 1 when there is none."""
    best = 1
    for d in range(1, int(V ** 0.5) + 1):
        if V % d == 0:
            best = d
    other = V // best
    return other if abs(other - V ** 0.5) < abs(best - V ** 0.5) else best


def argmax_rows(logits: torch.Tensor, blocks: int | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` for (B, V), in two passes when V is large: the max of each of ``blocks`` equal slices
    (default: about sqrt(V) slices of about sqrt(V) entries), then the best slice. A one-row argmax over 64k
    entries is a single-block reduction (~16 us on an H200, over a tenth of a decode step); two passes keep the
    GPU busy. Ties resolve to the first index, as in ``argmax``."""
    B, V = logits.shape
    blocks = blocks or _slices(V)
    if V < 8192 or V % blocks or blocks < 16 or V // blocks < 16:
        return logits.argmax(dim=-1)
    vals, idx = logits.view(B, blocks, V // blocks).max(dim=-1)      # (B, blocks): first max within each slice
    best = vals.argmax(dim=-1)                                       # first slice holding the overall max
    return best * (V // blocks) + idx.gather(1, best[:, None])[:, 0]


def sample_next_token(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,) by the rules in the module docstring."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.temperature == 0:
        return argmax_rows(logits)
    logits = filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _sorted_sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                           top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' sampling distributions, most likely token first, not renormalised after top-p (probs (R, V)),
    and the sort order (R, V): temperature, then top-k (the logits >= the k-th largest), then top-p."""
    V = logits.size(-1)
    scaled = logits / temperature[:, None]
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)                            # (R,): 0 means all
    kth = ordered.gather(1, (k - 1)[:, None])                                    # (R, 1)
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    # a token is dropped when the tokens strictly more likely than it already reach top_p (the first one stays)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    return probs.masked_fill(drop, 0.0), order


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """The distribution :func:`sample_rows` draws each row's token from, in vocabulary order: (R, V), rows summing
    to 1 (speculative sampling compares the target's with the draft's)."""
    probs, order = _sorted_sampling_probs(logits, temperature, top_k, top_p)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row, each row with its own parameters: logits (R, V) float32; temperature (R,) > 0, top_k (R,)
    long (0 = off), top_p (R,), uniforms (R,) in [0, 1). The same rules as :func:`sample_next_token` (top-k keeps
    the logits >= the k-th largest, top-p the smallest most likely set reaching p), worked out on the sorted row.

    The draw is by inverse CDF: the token where the cumulative probability (most likely first) reaches
    ``u * total``, with ``u`` the row's own uniform number. The caller draws ``u`` from the row's own random
    stream, so a seeded row's tokens depend on nothing else in the batch (a shared ``torch.Generator`` would hand
    each row whatever numbers the rows before it left over).
    """
    V = logits.size(-1)
    probs, order = _sorted_sampling_probs(logits, temperature, top_k, top_p)
    cdf = probs.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    # the first entry whose cumulative mass reaches the target: never a dropped (zero-mass) one
    pick = torch.searchsorted(cdf, target).clamp_(max=V - 1)
    return order.gather(1, pick)[:, 0]


# --------------------------------------------------------------------------------------------------------------
# static KV cache and the decode session


class StaticKVCache:
    """Per layer (batch, n_kv_heads, max_len, head_dim) keys and values, written at the slots in ``self.slots``.

    Duck-types the model's ``KVCache.update(layer, start_pos, k, v)``: ``start_pos`` is ignored; the caller sets
    ``slots`` (a 1-D long tensor, one slot per new token, the same for every row) and ``visible_len`` (how many
    slots attention reads; the attention mask hides the ones that are not valid for a row).
    """

    def __init__(self, model: Z2all, batch_size: int, max_len: int, dtype: torch.dtype):
        cfg = model.cfg
        device = model.embed_tokens.weight.device
        shape = (batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_len = max_len
        self.visible_len = max_len
        self.slots = torch.zeros(1, dtype=torch.long, device=device)

    @classmethod
    def over(cls, k: list[torch.Tensor], v: list[torch.Tensor]) -> "StaticKVCache":
        """A cache over existing per-layer tensors (views write through: a row's span of a larger cache)."""
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        cache.max_len = cache.visible_len = k[0].size(2)
        cache.slots = torch.zeros(1, dtype=torch.long, device=k[0].device)
        return cache

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor):
        self.k[layer].index_copy_(2, self.slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, self.slots, v.to(self.v[layer].dtype))
        n = self.visible_len
        if n == self.max_len:
            return self.k[layer], self.v[layer]
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``. To CUDA through pinned memory without waiting: a plain copy from
    pageable memory would first wait for everything queued on the stream (a decode step in flight)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)  # the pinned block is not reused before the copy is done


# The SDPA backends a prefill's attention may use: not cuDNN, which builds an execution plan for every new input
# shape (the rows prefilled together times the prompt length: nearly every prefill of a server is a new one). On an
# H100 (torch 2.11, z2all-1.1b) a prefill of a shape not seen before took 0.9-1.4 s with cuDNN, against 30-105 ms
# without it (the memory-efficient kernel takes the mask with no such setup); a repeated shape costs about the same
# either way.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Prompt lengths a one-prompt prefill is padded up to when its prefill is graphed (`z2all serve --prefill-graphs`):
# doubling, so that at most half of a bucket's tokens are padding; longer prompts prefill eagerly.
PREFILL_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048)
# Row counts a generic decode step may run over (its first rows only) when the rest of the session's rows are free
# (`DecodeSession(row_buckets=True)`, the scheduler's column engine beyond the fused step's 16 rows)
ROW_BUCKETS = (8, 16, 32, 64, 128)


def prefill_buckets_for(buckets: Sequence[int], model: Z2all, max_len: int) -> list[int]:
    """The prefill buckets a session of ``max_len`` slots can use (no longer than it or the model's context)."""
    limit = min(max_len, model.cfg.max_seq_len)
    return sorted({int(b) for b in buckets if 0 < int(b) <= limit})


def smallest_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest of the sorted ``buckets`` holding ``n`` tokens (None: none does, the eager prefill)."""
    return next((b for b in buckets if n <= b), None)


def capture_graphs(keys: Sequence, run: Callable, warmups: int = 2,
                   fallback: tuple[str, str] | None = None) -> tuple[dict, dict]:
    """CUDA graphs of ``run(key)`` for each key: ``warmups`` eager runs of each on a side stream first (kernels
    compiled and tuned outside any capture), then the captures in the order given, sharing one memory pool (give
    the largest first: the others fit in its memory). Returns ({key: graph}, {key: what ``run`` returned in its
    capture: the tensors a replay refills}). ``fallback`` (what was captured, what runs instead): a capture that
    fails is said in a warning and gives two empty dicts (the caller runs eagerly); None: the error is raised."""
    if fallback is not None:
        try:
            return capture_graphs(keys, run, warmups)
        except Exception as e:  # a kernel that cannot be captured: keep going without graphs, say so
            warnings.warn(f"{fallback[0]}: CUDA graph capture failed ({type(e).__name__}: {e}); {fallback[1]}")
            return {}, {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for key in keys:
            for _ in range(warmups):
                run(key)
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs, pool = {}, {}, None
    for key in keys:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
            outs[key] = run(key)
        pool = graph.pool()
        graphs[key] = graph
    return graphs, outs


def prefill_chunk_len(batch: int, vocab: int, budget_elements: int = 1 << 27) -> int:
    """Prompt tokens per prefill chunk so that a (batch, chunk, vocab)-sized intermediate stays under the budget
    (the vocabulary stands in for the widest one: the attention scores of a long prompt are about as wide)."""
    return max(16, budget_elements // max(1, batch * vocab))


class DecodeSession:
    """A static KV cache of shape (batch, max_len) plus fixed input buffers and the decode step (graphs) over them.

    Attention windows: a step at cache slot s only needs the keys of slots < s + 1, so instead of reading the whole
    cache every step, the step for window W reads slots [0, W) and is used while s < W; W runs over multiples of
    ``window`` up to max_len, and on CUDA each window has its own captured graph (they share the cache and the
    input buffers). With ``compile`` a single window (max_len) is used, to compile one shape only.

    Reused across calls with the same (batch, max_len): the cache is simply overwritten from slot 0.
    """

    def __init__(self, model: Z2all, batch_size: int, max_len: int, cuda_graph: bool,
                 compile: bool | str = False, window: int = 256, fused: bool = False,
                 prefill_buckets: Sequence[int] = (), lone_rows: bool = False, row_buckets: bool = False):
        self.model = model
        self.batch_size, self.max_len = batch_size, max_len
        w = model.embed_tokens.weight
        self.device = w.device
        self.cache = StaticKVCache(model, batch_size, max_len, dtype=w.dtype)
        self.tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)   # the step's input
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)                 # the step's cache slot
        self.pad_len = torch.zeros(batch_size, dtype=torch.long, device=self.device)     # left padding per row
        self.key_slots = torch.arange(max_len, device=self.device)
        # the fused step reads the slot on the device and attends only to the keys it needs: one window
        step = max_len if (compile or fused) else max(1, window)
        self.windows = sorted({min(max_len, w) for w in range(step, max_len + step, step)})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits_out: dict[int, torch.Tensor] = {}
        self.step_fn = self._step
        self.fused = None
        self._lone_steps: dict = {}                            # row -> FusedDecodeStep over that row alone
        self._lone_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._lone_out: torch.Tensor | None = None            # (B, V) float32: a lone row's logits land in its row
        # decode(lone_row=r) runs row r alone with the fused one-row step (``lone_rows``: the caller says the
        # fused kernels run here); the session's own step may be fused or not (any number of rows)
        self.lone_rows = lone_rows and batch_size > 1
        # the generic step over the first b rows only (decode(rows=n), b the smallest bucket >= n): the rows past b
        # are free, neither computed nor written; their logits rows in the shared output keep what they had
        self.row_buckets = [b for b in ROW_BUCKETS if b < batch_size] if row_buckets and not fused else []
        self._row_caches = {b: StaticKVCache.over([k[:b] for k in self.cache.k], [v[:b] for v in self.cache.v])
                            for b in self.row_buckets}
        self._row_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._rows_out = (torch.zeros(batch_size, model.lm_head.weight.size(0), dtype=torch.float32,
                                      device=self.device) if self.row_buckets else None)
        if fused:
            from zero2all.infer.fused_decode import FusedDecodeStep

            self.fused = FusedDecodeStep(model, self.cache.k, self.cache.v, batch_size, max_len)
            self.step_fn = self._fused_step
        elif compile:
            mode = compile if isinstance(compile, str) else None  # e.g. "max-autotune-no-cudagraphs"
            self.step_fn = torch.compile(self._step, dynamic=False, mode=mode)
        if cuda_graph:
            try:
                self._capture()
            except Exception as e:  # a kernel that cannot be captured: keep going eagerly, say so
                warnings.warn(f"decode: CUDA graph capture failed ({type(e).__name__}: {e}); running eagerly")
                self.graphs, self.logits_out = {}, {}
        self._setup_prefill_buckets(prefill_buckets, cuda_graph)

    # -- one prompt's prefill at a bucketed length (CUDA graphs of the prefill) ---------------------------------
    def _setup_prefill_buckets(self, buckets: Sequence[int], cuda_graph: bool):
        """Buffers (and on CUDA, graphs) for prefilling one prompt at a fixed length L per bucket: the prompt is
        right-padded to L and run from slot 0 of a one-row scratch cache with plain causal attention, so that no
        real token sees the padding; the logits are read at the prompt's last token and its keys and values copied
        into the row. One shape per bucket is what a CUDA graph needs: an eager prefill launches every operation
        of every layer from the host, a fixed cost that dominates a short prompt's time to first token."""
        self.prefill_buckets = prefill_buckets_for(buckets, self.model, self.max_len)
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if not self.prefill_buckets:
            return
        cfg, L = self.model.cfg, self.prefill_buckets[-1]
        dtype = self.cache.k[0].dtype
        shape = (1, cfg.n_kv_heads, L, cfg.head_dim)
        self._pf_k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.n_layers)]
        self._pf_v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.n_layers)]
        self._pf_tokens = torch.zeros(1, L, dtype=torch.long, device=self.device)
        self._pf_last = torch.zeros(1, dtype=torch.long, device=self.device)   # the prompt's last token's index
        self._pf_slots = torch.arange(L, device=self.device)
        self._pf_out: dict[int, torch.Tensor] = {}
        if not cuda_graph:
            return
        self.prefill_graphs, self._pf_out = capture_graphs(self.prefill_buckets[::-1], self._bucket_forward,
                                                           fallback=("decode: prefill", "prefilling eagerly"))

    def _bucket_forward(self, L: int) -> torch.Tensor:
        """The first L tokens of the bucket's input through the model from slot 0 of the scratch cache (causal, no
        mask); the logits (1, V) at index ``_pf_last``, float32."""
        m = self.model
        cache = StaticKVCache.over([k[:, :, :L] for k in self._pf_k], [v[:, :, :L] for v in self._pf_v])
        cache.slots, cache.visible_len = self._pf_slots[:L], L
        cos, sin = m.rope_tables(0, L, self.device)
        with sdpa_kernel(PREFILL_ATTENTION):
            x, residual = m.blocks(m.embed(self._pf_tokens[:, :L]), None, cos, sin, cache)
        h = m.final_norm(x, residual).index_select(1, self._pf_last)                         # (1, 1, hidden)
        return m.lm_head(h)[:, 0].float()

    def _prefill_bucketed(self, row: int, prompt: Sequence[int], end: int, L: int) -> torch.Tensor:
        P = len(prompt)
        tokens = list(prompt) + [0] * (L - P)
        self._pf_tokens[:, :L].copy_(to_device([tokens], torch.long, self.device))
        self._pf_last.fill_(P - 1)
        graph = self.prefill_graphs.get(L)
        if graph is not None:
            graph.replay()
            logits = self._pf_out[L].clone()
        else:
            logits = self._bucket_forward(L)
        for dst, src in zip((*self.cache.k, *self.cache.v), (*self._pf_k, *self._pf_v)):
            dst[row, :, end - P:end] = src[0, :, :P]
        self.pad_len[row] = end - P
        return logits

    @property
    def graph(self):
        """The graph of the largest window (None when running eagerly)."""
        return self.graphs.get(self.windows[-1])

    # the decode step: one token per row at cache slot self.slot, attending to slots [0, window)
    def _step(self, window: int) -> torch.Tensor:
        return self._generic_step(window, self.cache, self.batch_size)                      # (B, V)

    def _generic_step(self, window: int, cache: StaticKVCache, b: int) -> torch.Tensor:
        """The plain step over the first ``b`` rows (``cache``: theirs); their logits (b, V)."""
        cache.slots, cache.visible_len = self.slot, window
        pad = self.pad_len[:b]
        positions = (self.slot - pad).clamp_min(0)[:, None]                                 # (b, 1)
        j = self.key_slots[None, :window]
        visible = (j >= pad[:, None]) & (j <= self.slot)                                    # (b, W)
        logits, _ = self.model(self.tokens[:b], kv_cache=cache, position_ids=positions,
                               attn_mask=visible[:, None, None, :])
        return logits[:, -1]

    def _rows_step(self, key: tuple[int, int]) -> torch.Tensor:
        """The step over the first b rows at ``window`` (key (window, b)), written into the shared (B, V) output."""
        window, b = key
        self._rows_out[:b] = self._generic_step(window, self._row_caches[b], b)
        return self._rows_out

    def _fused_step(self, window: int) -> torch.Tensor:
        return self.fused(self.tokens, self.slot, self.pad_len)                            # (B, V)

    def window_for(self, slot: int) -> int:
        for w in self.windows:
            if slot < w:
                return w
        raise ValueError(f"decode session: slot {slot} is past the cache length {self.max_len}")

    def _capture(self):
        self.slot.fill_(0)  # warm-up writes land in slot 0, which every prefill overwrites
        if self.fused is not None:
            self.fused.tune(self.tokens, self.slot, self.pad_len)  # once per shape and device
        self.graphs, self.logits_out = capture_graphs(self.windows[::-1], self.step_fn)  # largest window first
        if self.row_buckets:
            keys = [(w, b) for w in self.windows[::-1] for b in self.row_buckets[::-1]]
            self._row_graphs, _ = capture_graphs(keys, self._rows_step, fallback=(
                "decode: row buckets", f"every step runs all {self.batch_size} rows"))
            if not self._row_graphs:  # the full step serves any rows, only slower
                self.row_buckets = []
        if self.lone_rows:
            try:
                self._capture_lone_rows()
            except Exception as e:  # the full step serves a lone row too, only slower
                warnings.warn(f"decode: one-row CUDA graphs failed ({type(e).__name__}: {e}); a lone stream runs "
                              f"the {self.batch_size}-row step")
                self._lone_graphs = {}

    # -- a lone running row: the fused step over that row only ------------------------------------------------
    def _lone_step(self, row: int):
        """The fused one-row step over ``row``'s cache (views of it), made on first use."""
        step = self._lone_steps.get(row)
        if step is None:
            from zero2all.infer.fused_decode import FusedDecodeStep

            first = next(iter(self._lone_steps.values()), None)   # every row's step shares one RoPE table
            step = FusedDecodeStep(self.model, [k[row:row + 1] for k in self.cache.k],
                                   [v[row:row + 1] for v in self.cache.v], 1, self.max_len,
                                   rope=(first.cos, first.sin) if first is not None else None)
            self._lone_steps[row] = step
            if self._lone_out is None:
                self._lone_out = torch.zeros(self.batch_size, self.model.lm_head.weight.size(0),
                                             dtype=torch.float32, device=self.device)
        return step

    def _run_lone(self, row: int):
        self._lone_out[row:row + 1] = self._lone_step(row)(self.tokens[row:row + 1], self.slot,
                                                           self.pad_len[row:row + 1])

    def _capture_lone_rows(self):
        """One graph per row of the fused step over that row alone (slot 0 at capture, as above): a lone stream
        then costs a one-row step, not a step over every row of the session."""
        self.slot.fill_(0)
        self._lone_step(0).tune(self.tokens[:1], self.slot, self.pad_len[:1])  # the tiles of the one-row shapes
        self._lone_graphs, _ = capture_graphs(range(self.batch_size), self._run_lone)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], pad_id: int) -> torch.Tensor:
        """Left-pad, run the prompts through the model in chunks, return the last position's logits (B, V)."""
        B, P = len(prompts), max(len(p) for p in prompts)
        if B != self.batch_size or P > self.max_len:
            raise ValueError(f"decode session: {B} prompts of up to {P} tokens do not fit ({self.batch_size}, "
                             f"{self.max_len})")
        pad = [P - len(p) for p in prompts]
        tokens = torch.tensor([[pad_id] * n + list(p) for n, p in zip(pad, prompts)], dtype=torch.long)
        self.pad_len.copy_(torch.tensor(pad, dtype=torch.long))
        return self._prefill(self.cache, tokens.to(self.device), self.pad_len, padded=any(pad))

    def _prefill(self, cache: StaticKVCache, tokens: torch.Tensor, pad_len: torch.Tensor, padded: bool = True
                 ) -> torch.Tensor:
        """Run tokens (B, P), left-padded by ``pad_len`` (B,), into ``cache`` from slot 0 in chunks; the last
        position's logits (B, V), float32. ``padded`` False says that no row has padding: a chunk from slot 0 is
        then plain causal attention, with no mask and positions 0.. shared by the rows (fewer ops than the masked
        form, whose every layer expands the mask). Attention runs on any SDPA backend but cuDNN
        (``PREFILL_ATTENTION``)."""
        B, P = tokens.shape
        chunk = prefill_chunk_len(B, self.model.cfg.padded_vocab_size)
        plain_ok = not padded and self.model.cfg.ops.attention != "flex"  # flex compiles per shape: masked SDPA
        logits = None
        for start in range(0, P, chunk):
            end = min(P, start + chunk)
            slots = torch.arange(start, end, device=self.device)
            cache.slots, cache.visible_len = slots, end
            if plain_ok and start == 0:
                positions = mask = None                                  # causal over slots [0, end)
            else:
                q = slots[None, :, None]                                 # (1, T, 1) query slots
                k = torch.arange(end, device=self.device)[None, None, :]  # (1, 1, end) key slots
                pad = pad_len[:, None, None]
                # a padding query sees only itself, so no row of the mask is empty (an empty row gives NaN)
                mask = ((k <= q) & ((k >= pad) | (k == q)))[:, None]     # (B, 1, T, end)
                positions = (slots[None, :] - pad_len[:, None]).clamp_min(0)
            with sdpa_kernel(PREFILL_ATTENTION):
                out, _ = self.model(tokens[:, start:end], kv_cache=cache, position_ids=positions, attn_mask=mask,
                                    logits_to_keep=1)
            logits = out[:, -1]
        return logits.float()

    @torch.inference_mode()
    def prefill_row(self, row: int, prompt: Sequence[int], end: int) -> torch.Tensor:
        """Prefill one row with its prompt ending just before slot ``end`` (slots ``end - len(prompt)`` .. ``end -
        1``), the other rows untouched; sets the row's padding to ``end - len(prompt)``. Returns the next-token
        logits (V,), float32.

        The prompt runs alone over a view of the row's span, so it computes exactly what a one-row session does
        from slot 0, whatever the other rows hold; the decode step at slot ``end`` then carries on from it.
        """
        return self.prefill_rows([row], [prompt], end)[0]

    @torch.inference_mode()
    def prefill_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], end: int) -> torch.Tensor:
        """Prefill several rows in one forward, each prompt ending just before slot ``end``: the prompts are
        left-padded to the longest, P tokens, and run as one batch over slots [end - P, end) of their rows (a
        shorter prompt's row gets its padding in the slots before its prompt, which its mask hides); the rows not
        named are untouched. Sets each row's padding to ``end - len(prompt)``. Returns the next-token logits
        (len(rows), V), float32.

        Each prompt computes what it computes alone from slot 0 (its own positions from 0, its padding masked),
        up to rounding where a product's reduction order depends on the batch. Rows that are consecutive
        (r, r + 1, ...) are written through a view of the cache; others run over a scratch cache of P slots that
        is then copied into their rows (one copy per layer).
        """
        R = len(rows)
        lengths = [len(p) for p in prompts]
        P = max(lengths, default=0)
        if (R == 0 or R != len(prompts) or min(lengths) < 1 or end - P < 0 or end > self.max_len
                or len(set(rows)) != R or not all(0 <= r < self.batch_size for r in rows)):
            raise ValueError(f"decode session: a prefill of prompts of {lengths} tokens ending at slot {end} in rows "
                             f"{list(rows)} does not fit ({self.batch_size}, {self.max_len})")
        if R == 1 and (L := smallest_bucket(self.prefill_buckets, P)) is not None:
            return self._prefill_bucketed(rows[0], prompts[0], end, L)
        start = end - P
        rows = list(rows)
        pad = [P - n for n in lengths]
        tokens = to_device([[0] * k + list(p) for k, p in zip(pad, prompts)], torch.long, self.device)
        pad_len = (to_device(pad, torch.long, self.device) if any(pad)
                   else torch.zeros(R, dtype=torch.long, device=self.device))
        consecutive = rows == list(range(rows[0], rows[0] + R))
        if consecutive:
            r0 = rows[0]
            view = StaticKVCache.over([k[r0:r0 + R, :, start:end] for k in self.cache.k],
                                      [v[r0:r0 + R, :, start:end] for v in self.cache.v])
        else:
            shape = (R, *self.cache.k[0].shape[1:2], P, self.cache.k[0].size(3))
            view = StaticKVCache.over([torch.empty(shape, dtype=k.dtype, device=k.device) for k in self.cache.k],
                                      [torch.empty(shape, dtype=v.dtype, device=v.device) for v in self.cache.v])
        logits = self._prefill(view, tokens, pad_len, padded=any(pad))
        if not consecutive:
            index = to_device(rows, torch.long, self.device)
            for dst, src in zip((*self.cache.k, *self.cache.v), (*view.k, *view.v)):
                dst[index, :, start:end] = src
        if R == 1:
            self.pad_len[rows[0]] = end - lengths[0]
        else:
            self.pad_len[to_device(rows, torch.long, self.device)] = to_device([end - n for n in lengths],
                                                                              torch.long, self.device)
        return logits

    @torch.inference_mode()
    def move_columns(self, lo: int, hi: int, shift: int):
        """Move the cached keys and values at slots [lo, hi) of every row by ``shift`` slots (negative: left).
        Positions are rotated into the keys before they are cached, so a moved span stays valid when the caller
        moves the slot and the rows' padding by the same amount."""
        if shift == 0 or hi <= lo:
            return
        if lo + shift < 0 or hi + shift > self.max_len:
            raise ValueError(f"decode session: slots [{lo}, {hi}) moved by {shift} leave the cache of "
                             f"{self.max_len}")
        for t in (*self.cache.k, *self.cache.v):
            t[:, :, lo + shift:hi + shift] = t[:, :, lo:hi].clone()  # the spans may overlap

    def set_pad_lens(self, pad: Sequence[int]):
        """Every row's padding (its first visible slot), as the next decode steps read it."""
        self.pad_len.copy_(to_device(list(pad), torch.long, self.device))

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, slot: int, lone_row: int | None = None,
               rows: int | None = None) -> torch.Tensor:
        """Feed tokens (B,) at cache slot ``slot``; return the next logits (B, V), float32.

        ``lone_row``: the only row whose result matters (one stream running). In a session made with
        ``lone_rows`` (more than one row; the session's own step fused or generic), only that row is computed (the
        fused one-row step over its cache, graphed where the session is): its logits are right and its cache is
        written, the other rows' logits and caches are left as they were. Elsewhere it is ignored.

        ``rows``: only rows [0, rows) are in use (the others free). In a session made with ``row_buckets`` (the
        generic step), the step runs over the smallest row bucket holding them; rows past it are not computed and
        their logits are whatever the returned buffer held."""
        self.tokens.copy_(tokens[:, None])
        self.slot.fill_(slot)
        if lone_row is not None and self.lone_rows:
            graph = self._lone_graphs.get(lone_row)
            if graph is not None:
                graph.replay()
                return self._lone_out
            if not self.graphs:  # an eager session; a graphed one without this graph takes the full graph
                self._run_lone(lone_row)
                return self._lone_out
        window = self.window_for(slot)
        if rows is not None and (b := next((x for x in self.row_buckets if rows <= x), None)) is not None:
            graph = self._row_graphs.get((window, b))
            if graph is not None:
                graph.replay()
                return self._rows_out
            if not self.graphs:
                return self._rows_step((window, b))
        if window in self.graphs:
            self.graphs[window].replay()
            return self.logits_out[window].float()
        return self.step_fn(window).float()


# --------------------------------------------------------------------------------------------------------------
# the generator


class _RowText:
    """Incremental detokenisation of one row with stop strings: decides which text is safe to show.

    Each step decodes only the last tokens (between ``WINDOW`` and twice that many): the text of the tokens before
    them is final and kept. Decoding the whole row every step costs O(length) per token, which for a batch of long
    replies would take longer than the GPU's decode step. The cut moves only where decoding the two sides apart
    gives exactly the text of decoding them together (not inside a multi-byte character, not where a tokenizer
    would drop the leading space of the token after the cut), so the text is always the full decode's.

    A tokenizer whose decoding only concatenates its tokens' bytes (``byte_decoding()``: a byte-level BPE such as
    the ones ``z2all train-tokenizer`` makes) is decoded a token at a time instead: each token's bytes go through an
    incremental UTF-8 decoder, which holds back a character's first bytes until the rest arrive (2-3 us of host
    time per token against 8-10 us for a window of 8 and 17-19 us for one of 32, BENCHMARKS.md, "Streaming: host
    time per token").
    """

    WINDOW = 8

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.ids: list[int] = []
        self.shown = 0
        self.text = ""
        self.cut = 0       # self.ids[:cut] decode to self.base, whatever follows them
        self.base = ""
        table = getattr(tokenizer, "byte_decoding", None)
        self._bytes = table() if callable(table) else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._bytes is not None else None
        self.hit = False   # a stop string was found: the text ends before it

    def _decoded(self) -> str:
        if self._bytes is not None:  # the text so far, but for a character still missing bytes
            i = self.ids[-1]
            self.base += self._utf8.decode(self._bytes[i] if 0 <= i < len(self._bytes) else b"")
            return self.base
        decode = self.tokenizer.decode
        tail = decode(self.ids[self.cut:], skip_special=True)
        if len(self.ids) - self.cut >= 2 * self.WINDOW:
            at = len(self.ids) - self.WINDOW
            head, rest = decode(self.ids[self.cut:at], skip_special=True), decode(self.ids[at:], skip_special=True)
            if head and not head.endswith("\ufffd") and head + rest == tail:
                self.base, self.cut = self.base + head, at
                return self.base + rest
        return self.base + tail

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token; return (new showable text, hit a stop string)."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return "", False
        text = self._decoded()
        hits = [at for at in (text.find(s) for s in self.stop) if at != -1]
        if hits:
            self.text, self.hit = text[:min(hits)], True
            return self._emit(len(self.text)), True
        self.text = text
        end = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character waits for its other bytes
        safe = end
        for s in self.stop:  # hold back a tail that may still grow into a stop string
            for n in range(min(len(s) - 1, end), 0, -1):
                if text[end - n:end] == s[:n]:
                    safe = min(safe, end - n)
                    break
        return self._emit(safe), False

    def finish(self) -> str:
        if self._bytes is not None and not self.hit:  # a character's first bytes left over: replaced
            self.text = self.base = self.base + self._utf8.decode(b"", final=True)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        piece = self.text[self.shown:upto]
        self.shown = max(self.shown, upto)
        return piece


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, context: int, vocab: int) -> None:
    """Raise ValueError naming the first prompt that can never run: empty, longer than the context with its new
    tokens, or holding an id outside the vocabulary."""
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > context:
            raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} exceed the model's "
                             f"context of {context}")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} outside the vocabulary (0..{vocab - 1})")


class Generator:
    """Generates from a model (and optionally a tokenizer, for text prompts, stop strings and text output).

    ``cuda_graph``: None = on for CUDA models. ``fused``: decode with the fused kernels of
    ``infer/fused_decode.py`` (None = on CUDA when the model and batch allow it, see ``fused_decode.supported``).
    ``compile``: compile the generic decode step with torch.compile before capturing it (a string is passed as
    torch.compile's ``mode``, e.g. ``"max-autotune-no-cudagraphs"``); it replaces the automatic fused step. Cache
    lengths are rounded up to ``length_bucket`` (so sessions are reused across calls) and generic decode steps
    read the cache in windows of ``attention_window`` slots. Not thread-safe: one call at a time (the server does
    not call it: its scheduler keeps a session of its own, see ``infer/scheduler.py``).
    """

    def __init__(self, model: Z2all, tokenizer=None, cuda_graph: bool | None = None, compile: bool | str = False,
                 max_sessions: int = 4, length_bucket: int = 128, attention_window: int = 256,
                 fused: bool | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = model.embed_tokens.weight.device
        graph_ok = self.device.type == "cuda"
        scaling = model.cfg.rope_scaling
        if scaling and scaling.get("type", scaling.get("rope_type")) == "dynamic":
            graph_ok = False  # dynamic NTK reads the sequence length on the host every step
        self.cuda_graph = graph_ok if cuda_graph is None else (cuda_graph and graph_ok)
        self.compile = compile
        self.fused = fused
        self.max_sessions = max_sessions
        self.length_bucket = length_bucket
        self.attention_window = attention_window
        self._sessions: OrderedDict[tuple[int, int], DecodeSession] = OrderedDict()

    # -- helpers ----------------------------------------------------------------------------------------------
    @property
    def max_seq_len(self) -> int:
        return self.model.cfg.max_seq_len

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or load one")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def default_stop_ids(self) -> list[int]:
        tok = self.tokenizer
        ids = [getattr(tok, name, None) for name in ("eos_id", "im_end_id")] if tok is not None else []
        if not ids and self.model.cfg.eos_token_id is not None:
            ids = [self.model.cfg.eos_token_id]
        return [i for i in ids if i is not None]

    def use_fused(self, batch_size: int) -> bool:
        """Whether sessions of this batch size decode with the fused kernels (``fused_decode``)."""
        from zero2all.infer.fused_decode import supported

        reason = supported(self.model, batch_size)
        if self.fused and reason:
            raise ValueError(f"fused decoding was asked for but cannot run: {reason}")
        if self.fused is None:  # auto: on CUDA, unless the step is compiled instead
            if reason and self.model.cfg.moe.enabled and self.device.type == "cuda":
                warnings.warn(f"decode: fused decoding cannot run this model ({reason}); using the plain path")
            return reason is None and self.device.type == "cuda" and not self.compile
        return bool(self.fused)

    def session(self, batch_size: int, needed_len: int) -> DecodeSession:
        """A cached decode session whose cache length is ``needed_len`` rounded up to the length bucket."""
        b = self.length_bucket
        length = min(self.max_seq_len, -(-needed_len // b) * b)
        key = (batch_size, length)
        if key in self._sessions:
            self._sessions.move_to_end(key)
            return self._sessions[key]
        while len(self._sessions) >= self.max_sessions:
            self._sessions.popitem(last=False)
        s = DecodeSession(self.model, batch_size, length, cuda_graph=self.cuda_graph, compile=self.compile,
                          window=self.attention_window, fused=self.use_fused(batch_size))
        self._sessions[key] = s
        return s

    # -- generation -------------------------------------------------------------------------------------------
    def stream(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None,
               **overrides) -> Iterator[GenerationEvent]:
        """Yield one :class:`GenerationEvent` per row per step until every row has finished.

        Each row ends with exactly one event whose ``finish_reason`` is set.
        """
        params = params or SamplingParams()
        if overrides:
            params = SamplingParams(**{**params.__dict__, **overrides})
        params.validate()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if params.grammar is not None:  # not silently ignored: a caller would trust the output's format
            raise ValueError("a grammar (structured output) is applied by the scheduler (z2all serve), not by "
                             "Generator.stream")
        ids = [self.encode(p) for p in prompts]
        if not ids:
            return
        vocab = self.model.cfg.padded_vocab_size
        check_prompts(ids, params.max_new_tokens, self.max_seq_len, vocab)
        stop_ids = set(self.default_stop_ids() if params.stop_token_ids is None else params.stop_token_ids)
        B, P = len(ids), max(len(p) for p in ids)
        pad_id = getattr(self.tokenizer, "pad_id", None) if self.tokenizer is not None else None
        pad_id = 0 if pad_id is None else pad_id

        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(B, vocab, dtype=torch.bool, device=self.device)
            for r, p in enumerate(ids):
                seen[r, torch.tensor(p, device=self.device)] = True

        session = self.session(B, P + params.max_new_tokens)
        logits = session.prefill(ids, pad_id)
        rows = [_RowText(self.tokenizer, params.stop) for _ in range(B)]
        finished = [False] * B
        on_cuda = self.device.type == "cuda"
        host_tokens = torch.empty(B, dtype=torch.long, pin_memory=on_cuda)
        copied = torch.cuda.Event() if on_cuda else None
        for step in range(params.max_new_tokens):
            next_tokens = sample_next_token(logits, params, seen, gen)                      # (B,) on device
            if seen is not None:
                seen.scatter_(1, next_tokens[:, None], True)
            last = step == params.max_new_tokens - 1
            host_tokens.copy_(next_tokens, non_blocking=on_cuda)
            if on_cuda:
                copied.record()
            if not last:
                # queue the next step before the host looks at the tokens (the GPU keeps busy meanwhile);
                # rows that have finished just run along and are ignored
                logits = session.decode(next_tokens, P + step)
            if on_cuda:
                copied.synchronize()
            for r, tok in enumerate(host_tokens.tolist()):
                if finished[r]:
                    continue
                if tok in stop_ids:
                    finished[r] = True
                    yield GenerationEvent(r, tok, rows[r].finish(), "stop", stop_token=True)
                    continue
                piece, hit_stop = rows[r].add(tok)
                if hit_stop:
                    finished[r] = True
                    yield GenerationEvent(r, tok, piece, "stop")
                elif last:
                    finished[r] = True
                    yield GenerationEvent(r, tok, piece + rows[r].finish(), "length")
                else:
                    yield GenerationEvent(r, tok, piece)
            if all(finished):
                break

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None,
                 on_event: Callable[[GenerationEvent], None] | None = None, **overrides) -> list[Completion]:
        """Run :meth:`stream` to the end; ``on_event`` sees every event (a streaming callback)."""
        ids = [self.encode(p) for p in prompts]
        tokens: list[list[int]] = [[] for _ in ids]
        texts = [""] * len(ids)
        reasons = ["length"] * len(ids)
        drawn = [0] * len(ids)
        for ev in self.stream(ids, params, **overrides):
            if on_event is not None:
                on_event(ev)
            drawn[ev.index] += 1
            texts[ev.index] += ev.text
            if not ev.stop_token:
                tokens[ev.index].append(ev.token_id)
            if ev.finish_reason:
                reasons[ev.index] = ev.finish_reason
        return [Completion(p, t, s, r, n) for p, t, s, r, n in zip(ids, tokens, texts, reasons, drawn)]


# --------------------------------------------------------------------------------------------------------------
# loading


def load_for_inference(ckpt: str, device: str = "auto", dtype: str = "auto", tokenizer=None):
    """(model, tokenizer) from a checkpoint directory (ours, HF, or one with LoRA adapters, merged on load).

    ``dtype`` auto: bfloat16 on CUDA, float32 on CPU. ``tokenizer`` None: ``load_tokenizer(ckpt)``.
    """
    from pathlib import Path

    from zero2all import load_model
    from zero2all.distributed.env import resolve_device

    device = str(resolve_device(str(device), option="--device"))  # no GPU for `cuda`: one line, not an assertion
    torch_dtype = {"auto": torch.bfloat16 if str(device).startswith("cuda") else torch.float32,
                   "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = load_model(ckpt, device=device, dtype=torch_dtype)
    if tokenizer is None:
        from zero2all.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(Path(ckpt))
    return model, tokenizer
