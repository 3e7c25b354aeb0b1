"""A paged KV cache with automatic prefix caching, and the decode session of the scheduler's paged engine.

The cache is a pool of fixed-size blocks of ``block_size`` tokens (16 by default): per layer, keys and values of
shape (n_blocks, block_size, n_kv_heads, head_dim). Each running sequence owns a *block table*, the list of the
blocks that hold its tokens in order (token t lives at slot t % block_size of block table[t // block_size]), so
sequences of any length share one pool, a sequence grows one block at a time, and nothing ever moves. Block 0 is
never handed out: it is the *null block*, where the tokens of free batch rows and of padding write their keys
and values (nobody reads them), so that every step has the same shapes.

Prefix caching: when a block is full its contents are determined by the tokens it holds and by everything before
them, so it is named by a chained hash, ``hash(parent block's hash, its block_size tokens)``. Full blocks are
entered in a table hash -> block. A new sequence looks up its prompt's full blocks in order and takes every block
of its longest cached prefix (incrementing its reference count) instead of computing it; only the rest of the
prompt is prefilled (at least its last token, whose logits give the first new token). A block whose reference
count drops to 0 stays in the table as *evictable*, in least-recently-released order; a new block comes from the
free list first, then from the least recently used evictable block, whose table entry is then dropped. So a
shared system prompt is computed once and kept while the memory allows.

Room: a sequence is admitted only when the pool can hold its whole span (prompt plus its budget of new tokens)
next to what the running sequences may still grow to (``PagedSession.can_admit``): no sequence ever needs to be
preempted. The check counts a prefix hit as needing its blocks, so it is conservative by the hits.

The decode step reads the cache through the block tables (``kernels/paged_attention.py``: Triton on CUDA, the
PyTorch path on CPU). A prefill of new tokens on top of cached ones gathers the row's blocks and runs masked SDPA.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict, deque
from typing import Sequence

import numpy as np
import torch
from torch.nn.attention import sdpa_kernel

from zero2all.infer.generate import (
    PREFILL_ATTENTION,
    capture_graphs,
    prefill_buckets_for,
    prefill_chunk_len,
    smallest_bucket,
    to_device,
)
from zero2all.kernels import paged_attention
from zero2all.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_torch,
    uses_triton,
    visible_keys,
)
from zero2all.model import ops

NULL_BLOCK = 0
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode steps run (and are captured) at these row counts


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The name of a full block: a digest of its parent block's name and its tokens (128 bits: no collisions in
    practice, unlike Python's 64-bit ``hash``)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


class BlockPool:
    """Block ids 1 .. n_blocks - 1 (0 is the null block), reference counts, and the prefix cache's table."""

    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = True):
        if n_blocks < 2 or block_size < 1:
            raise ValueError(f"paged cache: needs at least 2 blocks of at least 1 token, got {n_blocks} x {block_size}")
        self.n_blocks, self.block_size, self.prefix_caching = n_blocks, block_size, prefix_caching
        self.free: deque[int] = deque(range(1, n_blocks))
        self.refs = [0] * n_blocks
        self.hash_of: dict[int, bytes] = {}          # cached block -> its name
        self.by_hash: dict[bytes, int] = {}          # name -> cached block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody references, oldest first
        self.lookups = 0                              # prompt tokens looked up in the prefix cache
        self.hits = 0                                 # of which found cached
        self.evictions = 0

    @property
    def total(self) -> int:
        return self.n_blocks - 1

    def available(self) -> int:
        """Blocks that an allocation can take: free ones and unreferenced cached ones."""
        return len(self.free) + len(self.evictable)

    def in_use(self) -> int:
        return self.total - self.available()

    def allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)   # least recently released
            del self.by_hash[self.hash_of.pop(block)]
            self.evictions += 1
        else:
            raise RuntimeError("paged cache: out of blocks")
        self.refs[block] = 1
        return block

    def take(self, block: int):
        """One more reference to a cached block (a prefix hit)."""
        if self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1

    def release(self, block: int):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def register(self, block: int, name: bytes):
        """A full block's name; a block with the same contents already cached keeps its entry."""
        if self.prefix_caching and name not in self.by_hash and block not in self.hash_of:
            self.by_hash[name] = block
            self.hash_of[block] = name

    def match(self, tokens: Sequence[int], limit: int) -> tuple[list[int], list[bytes]]:
        """The cached blocks of the longest prefix of ``tokens``, at most ``limit`` blocks, each with one more
        reference; and their names."""
        blocks, names, parent = [], [], None
        if self.prefix_caching:
            bs = self.block_size
            for i in range(min(limit, len(tokens) // bs)):
                name = block_hash(parent, tokens[i * bs:(i + 1) * bs])
                block = self.by_hash.get(name)
                if block is None:
                    break
                self.take(block)
                blocks.append(block)
                names.append(name)
                parent = name
        return blocks, names

    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class _RowState:
    """A row's sequence in the paged session: its tokens so far, block table, and the names of its full blocks."""

    def __init__(self, tokens: list[int], blocks: list[int], names: list[bytes], span: int, row: int):
        self.row = row
        self.tokens = tokens          # every token fed or to be fed (prompt, then each decoded token)
        self.blocks = blocks
        self.names = names            # names of the first len(names) (full) blocks
        self.computed = 0             # tokens whose keys and values are in the cache
        self.span = span              # the most tokens this sequence may hold (prompt + budget)
        self.ready = False            # its prompt is computed: it decodes


SHORT_CHUNK = 64  # prompt chunks of at most this many tokens attend through the decode kernel (on CUDA)


class PagedKVCache:
    """The layers' block pools plus the current forward's addressing, set by the session before each forward.

    The model's attention calls :meth:`attend` (any cache with that method is used this way): it writes the new
    keys and values at ``slots`` (flat indices block * block_size + offset, one per new token, row-major) and
    attends over each row's first ``lengths[b]`` tokens through ``tables``; a new token at position p sees the
    tokens at positions <= p (``q_pos``)."""

    def __init__(self, model, n_blocks: int, block_size: int, dtype: torch.dtype, impl: str = "auto"):
        cfg = model.cfg
        device = model.embed_tokens.weight.device
        shape = (n_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.block_size, self.impl = block_size, impl
        self.slots = self.tables = self.lengths = self.q_pos = None
        self._visible = self._visible_for = None     # the PyTorch decode path's key mask, once per forward

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, T, D = q.shape
        Hkv = k.size(1)
        kc, vc = self.k[layer], self.v[layer]
        kc.view(-1, Hkv, D).index_copy_(0, self.slots, k.transpose(1, 2).reshape(B * T, Hkv, D).to(kc.dtype))
        vc.view(-1, Hkv, D).index_copy_(0, self.slots, v.transpose(1, 2).reshape(B * T, Hkv, D).to(vc.dtype))
        if T == 1:
            if uses_triton(q, self.impl):
                return paged_decode_attention(q[:, :, 0], kc, vc, self.tables, self.lengths, impl="triton")[:, :, None]
            if self._visible_for is not self.lengths:   # a new forward: the layers share one mask
                self._visible = visible_keys(self.lengths, self.tables.size(1) * self.block_size)
                self._visible_for = self.lengths
            return paged_decode_attention_torch(q[:, :, 0], kc, vc, self.tables, self.lengths,
                                                visible=self._visible)[:, :, None]
        if T <= SHORT_CHUNK and uses_triton(q, self.impl):
            # a few new tokens after a long cached prefix (a chat turn after a prefix-cache hit): each new token is
            # a decode query of its own over its row's table, seeing its positions <= q_pos (its own key is written
            # above), so the kernel's split walk replaces gathering the table's whole width for a masked attention
            lens = torch.minimum(self.q_pos + 1, self.lengths[:, None].long()).reshape(B * T)
            out = paged_decode_attention(q.transpose(1, 2).reshape(B * T, H, D), kc, vc,
                                         self.tables.repeat_interleave(T, 0), lens, impl="triton")
            return out.view(B, T, H, D).transpose(1, 2)
        nb = self.tables.size(1)
        S = nb * self.block_size
        keys = kc[self.tables].reshape(B, S, Hkv, D).transpose(1, 2).to(q.dtype)          # (B, Hkv, S, D)
        values = vc[self.tables].reshape(B, S, Hkv, D).transpose(1, 2).to(q.dtype)
        j = torch.arange(S, device=q.device)[None, None, :]
        mask = (j <= self.q_pos[:, :, None]) & (j < self.lengths[:, None, None])          # (B, T, S)
        return ops.attention(q, keys, values, mask=mask[:, None])


class PagedSession:
    """The scheduler's device side for the paged engine: ``rows`` batch rows over one block pool.

    The interface the scheduler uses: :meth:`can_admit`, :meth:`prefill_rows` (a joining sequence's prompt; returns
    its first logits and records its prefix hit), :meth:`decode` (one token for every occupied row),
    :meth:`release` (a row's blocks back to the pool)."""

    def __init__(self, model, rows: int, max_len: int, n_blocks: int | None = None, block_size: int = 16,
                 prefix_caching: bool = True, impl: str = "auto", cuda_graph: bool = False,
                 prefill_buckets: Sequence[int] = ()):
        self.model = model
        w = model.embed_tokens.weight
        self.device = w.device
        self.batch_size, self.max_len, self.block_size = rows, max_len, block_size
        self.max_blocks = -(-max_len // block_size)                 # a row's block table length
        if n_blocks is None:                                        # every row at full length, plus the null block
            n_blocks = rows * self.max_blocks + 1
        self.pool = BlockPool(n_blocks, block_size, prefix_caching)
        self.cache = PagedKVCache(model, n_blocks, block_size, w.dtype, impl)
        if uses_triton(w, impl) and w.is_cuda:
            paged_attention.warm_up(self.cache.k[0], self.cache.v[0], model.cfg.n_heads, w.dtype)
        self.rows: list[_RowState | None] = [None] * rows
        self.cached_tokens: dict[int, int] = {}                     # row -> prompt tokens found in the cache
        self._verify_start: dict[int, int] = {}                     # row -> its length before a verify forward
        # the decode step's static inputs, for every row; a step reads the first `bucket` of them. The host keeps
        # them up to date (block tables when a row gains a block or changes hands; position, cache slot and length
        # per decoding row, written through numpy views: no tensor is built per step) and uploads them in one copy
        # each: the step's (position, slot, length) every step, the tables only when one of them changed.
        dev = self.device
        self._table_host = torch.zeros(rows, self.max_blocks, dtype=torch.int32)
        self._meta_host = torch.zeros(rows, 3, dtype=torch.long)                 # position, slot, length
        self._table_np, self._meta_np = self._table_host.numpy(), self._meta_host.numpy()
        self._tables_buf = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=dev)
        self._tokens_buf = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self._meta_buf = torch.zeros(rows, 3, dtype=torch.long, device=dev)
        self._pos_buf, self._slots_buf = self._meta_buf[:, 0:1], self._meta_buf[:, 1]
        self._lengths_buf = self._meta_buf[:, 2]
        self._tables_dirty = True
        self._decoding: list[int] | None = None     # the rows that decode (prompt computed), lowest first
        self._stages: dict[int, list] = {}           # CUDA: per host buffer, two pinned copies used in turn
        self._width = 1
        self.buckets = [b for b in BATCH_BUCKETS if b < rows] + [rows]
        self.cuda_graph = cuda_graph and dev.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self._graph_out: dict[int, torch.Tensor] = {}
        self._logits_buf: torch.Tensor | None = None   # with graphs: the one (rows, V) float32 output they share
        self._graph_pool = None
        self._setup_prefill_buckets(prefill_buckets)

    # -- one row's prefill chunk at a bucketed length (CUDA graphs of the prefill) --------------------------------
    def _setup_prefill_buckets(self, buckets: Sequence[int]):
        """Static buffers (and on CUDA, graphs) for computing one row's next prompt tokens at a fixed count L per
        bucket: the tokens are right-padded to L (the padding writes to the null block and reads only the row's
        real keys), the row's block table is padded to its full width with the null block (masked by its length),
        and the logits are read at the last real token. One shape per bucket is what a CUDA graph needs; an eager
        prefill launches every operation of every layer from the host, a fixed cost per forward."""
        self.prefill_buckets = prefill_buckets_for(buckets, self.model, self.max_len)
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if not self.prefill_buckets:
            return
        L, dev = self.prefill_buckets[-1], self.device
        # tokens, positions, slots (each L), then the table (max_blocks), the length and the last token's index
        self._pf_buf = torch.zeros(3 * L + self.max_blocks + 2, dtype=torch.long, device=dev)
        self._pf_host = torch.zeros(self._pf_buf.numel(), dtype=torch.long)   # written through a numpy view
        self._pf_np = self._pf_host.numpy()
        self._pf_tables = torch.zeros(1, self.max_blocks, dtype=torch.int32, device=dev)
        self._pf_lengths = torch.zeros(1, dtype=torch.int32, device=dev)
        self._pf_out: dict[int, torch.Tensor] = {}
        if not self.cuda_graph:
            return
        self._pf_buf[2 * L:3 * L].fill_(NULL_BLOCK * self.block_size)   # warm-up writes land in the null block
        self._pf_lengths.fill_(1)
        self.prefill_graphs, self._pf_out = capture_graphs(self.prefill_buckets[::-1], self._bucket_forward,
                                                           fallback=("paged session: prefill", "prefilling eagerly"))

    def _bucket_forward(self, L: int) -> torch.Tensor:
        """The bucket's first L tokens of one row through the model (the static buffers only); the logits (1, V)
        at the last real token, float32."""
        m, c, Lmax = self.model, self.cache, self.prefill_buckets[-1]
        buf = self._pf_buf
        c.slots, c.tables, c.lengths = buf[2 * Lmax:2 * Lmax + L], self._pf_tables, self._pf_lengths
        c.q_pos = buf[Lmax:Lmax + L][None]
        cos, sin = m.rope_tables(0, L, self.device, c.q_pos)
        with sdpa_kernel(PREFILL_ATTENTION):
            x, residual = m.blocks(m.embed(buf[:L][None]), None, cos, sin, c)
        last = buf[-1:]
        return m.lm_head(m.final_norm(x, residual).index_select(1, last))[:, 0].float()

    def _forward_bucketed(self, s: _RowState, n: int, L: int) -> torch.Tensor:
        """``_forward_new`` for one row whose ``n`` new tokens fit bucket ``L``: one upload, then the graph."""
        Lmax, first, bs, nb = self.prefill_buckets[-1], s.computed, self.block_size, len(s.blocks)
        host = self._pf_np   # the step's inputs written in place (numpy), then uploaded in one copy
        pos = np.arange(first, first + n)
        blocks = np.asarray(s.blocks, dtype=np.int64)
        host[:n], host[n:L] = s.tokens[first:first + n], 0
        host[Lmax:Lmax + n], host[Lmax + n:Lmax + L] = pos, first + n - 1            # padding: the last position
        host[2 * Lmax:2 * Lmax + n] = blocks[pos // bs] * bs + pos % bs
        host[2 * Lmax + n:2 * Lmax + L] = NULL_BLOCK * bs                             # padding: the null block
        host[3 * Lmax:3 * Lmax + nb], host[3 * Lmax + nb:3 * Lmax + self.max_blocks] = blocks, NULL_BLOCK
        s.computed += n
        host[-2], host[-1] = s.computed, n - 1
        self._upload(self._pf_buf, self._pf_host, self._pf_buf.numel())
        tail = self._pf_buf[3 * Lmax:]
        self._pf_tables.copy_(tail[:self.max_blocks][None])
        self._pf_lengths.copy_(tail[self.max_blocks:self.max_blocks + 1])
        graph = self.prefill_graphs.get(L)
        if graph is not None:
            graph.replay()
            return self._pf_out[L].clone()
        return self._bucket_forward(L)

    # -- room ----------------------------------------------------------------------------------------------------
    def _blocks_for(self, n: int) -> int:
        return -(-n // self.block_size)

    def reserved(self) -> int:
        """Blocks the running rows may still allocate before they reach their span."""
        return sum(self._blocks_for(r.span) - len(r.blocks) for r in self.rows if r is not None)

    def can_admit(self, span: int) -> bool:
        """Whether a sequence that may hold ``span`` tokens fits next to the running ones' growth."""
        return self._blocks_for(span) <= self.pool.available() - self.reserved()

    def fits_ever(self, span: int) -> bool:
        return self._blocks_for(span) <= self.pool.total

    # -- rows ----------------------------------------------------------------------------------------------------
    def reserve(self, row: int, span: int):
        """Hold room for a sequence that will be prefilled into ``row`` (free) and may reach ``span`` tokens, so
        that :meth:`can_admit` counts it before its blocks are taken."""
        if self.rows[row] is not None:
            raise ValueError(f"paged session: row {row} is busy")
        self.rows[row] = _RowState([], [], [], span, row)
        self._decoding = None

    def release(self, row: int):
        state, self.rows[row] = self.rows[row], None
        self._decoding = None
        if state is not None:
            for b in state.blocks:
                self.pool.release(b)

    def reset(self):
        for r in range(self.batch_size):
            self.release(r)

    def _register_full(self, state: _RowState):
        """Name the row's newly full blocks (whose tokens are all computed) in the prefix cache."""
        bs = self.block_size
        while len(state.names) < state.computed // bs:
            i = len(state.names)
            name = block_hash(state.names[-1] if state.names else None, state.tokens[i * bs:(i + 1) * bs])
            self.pool.register(state.blocks[i], name)
            state.names.append(name)

    def _grow(self, state: _RowState, n: int):
        while len(state.blocks) < self._blocks_for(n):
            block = self.pool.allocate()
            self._table_np[state.row, len(state.blocks)] = block
            self._tables_dirty = True
            state.blocks.append(block)

    def _slot(self, state: _RowState, pos: int) -> int:
        return state.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _tables(self, states: Sequence[_RowState | None], width: int | None = None) -> torch.Tensor:
        width = width or max((len(s.blocks) for s in states if s is not None), default=1) or 1
        return to_device([(s.blocks if s is not None else []) + [NULL_BLOCK] * (width - (len(s.blocks) if s else 0))
                          for s in states], torch.int32, self.device)

    # -- prefill -------------------------------------------------------------------------------------------------
    def start(self, row: int, prompt: Sequence[int], span: int | None = None) -> int:
        """Start a sequence in ``row`` (free or reserved) with its prompt: take the cached blocks of its longest
        cached prefix and allocate the rest; nothing is computed yet (:meth:`prefill_step`). Returns the number of
        prompt tokens found in the cache."""
        held = self.rows[row]
        if (held is not None and held.tokens) or not prompt or len(prompt) > self.max_len:
            raise ValueError(f"paged session: row {row} is busy or its prompt of {len(prompt)} tokens does not fit")
        prompt = [int(t) for t in prompt]
        # leave at least the last token to compute: its logits are the first new token's
        blocks, names = self.pool.match(prompt, (len(prompt) - 1) // self.block_size)
        span = span if span is not None else held.span if held is not None else self.max_len
        state = _RowState(prompt, blocks, names, max(span, len(prompt)), row)
        if blocks:
            self._table_np[row, :len(blocks)] = blocks
            self._tables_dirty = True
        state.computed = len(blocks) * self.block_size
        self.pool.lookups += len(prompt)
        self.pool.hits += state.computed
        self.cached_tokens[row] = state.computed
        self.rows[row] = state
        self._decoding = None
        try:
            self._grow(state, len(prompt))
        except RuntimeError:
            self.release(row)
            raise
        return state.computed

    def remaining(self, row: int) -> int:
        """Prompt tokens of the row still to compute."""
        s = self.rows[row]
        return len(s.tokens) - s.computed if s is not None and not s.ready else 0

    @torch.inference_mode()
    def prefill_step(self, rows: Sequence[int], limits: Sequence[int]) -> torch.Tensor:
        """Compute the next up to ``limits[i]`` prompt tokens of each started row, in one forward; returns the
        logits (len(rows), V), float32, of each row's last computed token: the first new token's for the rows
        whose prompt is now complete (:meth:`remaining` 0; they decode from the next step on)."""
        states = [self.rows[r] for r in rows]
        logits = self._forward_new(states, [max(1, min(n, len(s.tokens) - s.computed))
                                            for s, n in zip(states, limits)])
        for s in states:
            self._register_full(s)
            s.ready = s.computed >= len(s.tokens)
        self._decoding = None
        return logits.float()

    @torch.inference_mode()
    def prefill_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], end: int | None = None,
                     spans: Sequence[int] | None = None) -> torch.Tensor:
        """:meth:`start` a sequence in each of ``rows`` and compute its prompt (all rows in one forward per chunk,
        left-padded); the next-token logits (len(rows), V), float32. ``spans``: the most tokens each may hold
        (default: up to ``max_len``); ``end`` is the column engine's argument and is ignored."""
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            self.start(row, prompt, spans[i] if spans is not None else None)
        chunk = prefill_chunk_len(len(rows), self.model.cfg.padded_vocab_size)
        logits = torch.empty(len(rows), self.model.cfg.padded_vocab_size, device=self.device)
        while (left := [i for i, r in enumerate(rows) if self.remaining(r)]):
            out = self.prefill_step([rows[i] for i in left], [chunk] * len(left))
            logits[left] = out
        return logits

    def _forward_new(self, states: list[_RowState], counts: Sequence[int], keep: int = 1) -> torch.Tensor:
        """The next ``counts[i]`` uncomputed tokens of each row in one forward (rows with fewer than the most are
        left-padded: their padding writes to the null block); logits of each row's last ``keep`` positions
        (keep 1: (B, V); else (B, keep, V))."""
        if len(states) == 1 and keep == 1 and (L := smallest_bucket(self.prefill_buckets, counts[0])) is not None:
            return self._forward_bucketed(states[0], counts[0], L)
        toks, pos, slots, lengths = [], [], [], []
        T = max(counts)
        for s, n in zip(states, counts):
            pad = T - n
            first = s.computed
            toks.append([0] * pad + s.tokens[first:first + n])
            # padding queries take the first new token's position (they see real keys only: no empty softmax row)
            pos.append([first] * pad + list(range(first, first + n)))
            slots.extend([NULL_BLOCK * self.block_size] * pad + [self._slot(s, p) for p in range(first, first + n)])
            s.computed += n
            lengths.append(s.computed)
        c = self.cache
        c.slots = to_device(slots, torch.long, self.device)
        c.tables = self._tables(states)
        c.lengths = to_device(lengths, torch.int32, self.device)
        c.q_pos = to_device(pos, torch.long, self.device)
        with sdpa_kernel(PREFILL_ATTENTION):
            out, _ = self.model(to_device(toks, torch.long, self.device), kv_cache=c, position_ids=c.q_pos,
                                logits_to_keep=keep)
        return out[:, -1] if keep == 1 else out

    # -- decode --------------------------------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int:
        """The smallest batch bucket (1, 2, 4, ..., 256, then the row count) holding rows [0, n)."""
        for b in self.buckets:
            if n <= b:
                return b
        return self.batch_size

    def _decode_step(self, bucket: int) -> torch.Tensor:
        """The decode step over the first ``bucket`` rows, reading only the static buffers (so it can be captured
        as a CUDA graph and replayed); logits (batch_size, V), float32, zeros past ``bucket``: a new tensor, or,
        once graphs are in use, ``_logits_buf`` (one buffer for every bucket's graph, not one per bucket)."""
        c = self.cache
        c.slots, c.lengths = self._slots_buf[:bucket], self._lengths_buf[:bucket]
        c.tables, c.q_pos = self._tables_buf[:bucket, :self._width], self._pos_buf[:bucket]
        out, _ = self.model(self._tokens_buf[:bucket], kv_cache=c, position_ids=c.q_pos)
        buf = self._logits_buf
        if buf is None:
            return torch.nn.functional.pad(out[:, -1].float(), (0, 0, 0, self.batch_size - bucket))
        buf[:bucket].copy_(out[:, -1])
        if bucket < self.batch_size:
            buf[bucket:].zero_()       # rows a larger bucket wrote before
        return buf

    def _capture(self, bucket: int):
        """Capture the decode step of ``bucket`` rows (the buffers hold a valid step: free rows only, which write
        to the null block and read nothing). On failure: a warning, and that bucket runs eagerly from then on."""
        if self._logits_buf is None:
            self._logits_buf = torch.zeros(self.batch_size, self.model.cfg.padded_vocab_size, device=self.device)
        saved = [t[:bucket].clone() for t in (self._tokens_buf, self._meta_buf)]
        for t in (self._tokens_buf, self._meta_buf):
            t[:bucket].zero_()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._decode_step(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                self._graph_out[bucket] = self._decode_step(bucket)
            self._graph_pool = graph.pool()
            self.graphs[bucket] = graph
        except Exception as e:  # a kernel that cannot be captured: keep going eagerly, say so
            warnings.warn(f"paged decode: CUDA graph capture of {bucket} rows failed ({type(e).__name__}: {e}); "
                          "running that bucket eagerly")
            self.graphs[bucket] = None
        for t, v in zip((self._tokens_buf, self._meta_buf), saved):
            t[:bucket].copy_(v)

    def decoding_rows(self) -> list[int]:
        """The rows whose prompt is computed (they take part in decode steps), lowest first."""
        if self._decoding is None:
            self._decoding = [r for r, s in enumerate(self.rows) if s is not None and s.ready]
            busy = set(self._decoding)
            idle = [r for r in range(self.batch_size) if r not in busy]
            self._meta_np[idle] = 0   # free rows (and prefilling ones) write to the null block and read nothing
        return self._decoding

    def _upload(self, dst: torch.Tensor, host: torch.Tensor, n: int):
        """``dst[:n] = host[:n]`` without waiting for the device. On CUDA through one of two pinned copies of
        ``host`` in turn; a copy is reused only after its previous upload has run (an upload two steps old: in
        practice done), so the host never writes memory that a queued copy is still to read."""
        if self.device.type != "cuda":
            dst[:n].copy_(host[:n])
            return
        stages = self._stages.get(id(host))
        if stages is None:
            stages = self._stages[id(host)] = [[torch.empty_like(host).pin_memory(), None] for _ in range(2)] + [0]
        i = stages[2]
        stages[2] = 1 - i
        stage, done = stages[i]
        if done is not None:
            done.synchronize()
        stage[:n].copy_(host[:n])
        dst[:n].copy_(stage[:n], non_blocking=True)
        if done is None:
            done = stages[i][1] = torch.cuda.Event()
        done.record()

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, slot: int | None = None) -> torch.Tensor:
        """Feed tokens (B,) (one per batch row; free rows' are ignored); the next logits (B, V), float32. Each
        occupied row's token goes at its next position; a row that reaches a block boundary gets a new block.

        The step runs over the smallest batch bucket holding every occupied row (rows are handed out lowest
        first), from static buffers; on CUDA each bucket's step is captured as a CUDA graph the first time it is
        used (``cuda_graph``) and replayed after; the host's part of a step is then the per-row bookkeeping, the
        upload of the rows' (position, slot, length), of the block tables when they changed, and of the tokens.
        On CPU the same step runs eagerly."""
        host = tokens.tolist() if self.device.type == "cpu" else None
        occupied = self.decoding_rows()
        bucket = self.bucket_for(occupied[-1] + 1 if occupied else 1)
        bs, rows = self.block_size, self.rows
        width, step = 1, []
        for r in occupied:
            s = rows[r]
            p = s.computed
            if p >= self.max_len:
                raise ValueError(f"paged session: row {r} is past the length {self.max_len}")
            i = p // bs
            if i >= len(s.blocks):
                self._grow(s, p + 1)
            s.tokens.append(host[r] if host is not None else -1)  # on a GPU the token is filled in by note_tokens
            s.computed = p + 1
            step.append((p, s.blocks[i] * bs + p % bs, p + 1))
            if len(s.blocks) > width:
                width = len(s.blocks)
            if host is not None and (p + 1) % bs == 0:
                self._register_full(s)
        if occupied:
            self._meta_np[occupied] = step      # one numpy assignment for every row's (position, slot, length)
        # the table's width: the longest row's on CPU (the PyTorch path reads every entry), all of it on CUDA
        # (the kernel reads only each row's length, and a captured graph needs one shape)
        self._width = self.max_blocks if self.device.type == "cuda" else width
        if self._tables_dirty:
            self._upload(self._tables_buf, self._table_host, self.batch_size)
            self._tables_dirty = False
        self._upload(self._meta_buf, self._meta_host, bucket)
        self._tokens_buf[:bucket, 0].copy_(tokens[:bucket])
        if self.cuda_graph and bucket not in self.graphs:
            self._capture(bucket)
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
            return self._graph_out[bucket]
        return self._decode_step(bucket)

    # -- speculative decoding -----------------------------------------------------------------------------------
    def room(self, row: int) -> int:
        """Tokens the row may still feed before it reaches its span."""
        s = self.rows[row]
        return s.span - s.computed

    def history(self, row: int) -> list[int]:
        """The row's tokens so far (prompt, then every fed token)."""
        return self.rows[row].tokens

    @torch.inference_mode()
    def verify(self, tokens: Sequence[int], drafts: dict[int, list[int]]) -> tuple[torch.Tensor, int]:
        """Feed every decoding row's token (``tokens[row]``) followed by its draft tokens (``drafts``, may be
        absent) in one forward. Returns (logits (B, T, V) float32, T): row r's i-th fed token's next-token logits
        are at position T - n_r + i, n_r = 1 + len(its draft). Call :meth:`accept` for each row afterwards."""
        states, counts, rows = [], [], []
        for r, s in enumerate(self.rows):
            if s is None or not s.ready:
                continue
            fed = [int(tokens[r])] + list(drafts.get(r, ()))
            self._verify_start[r] = s.computed
            self._grow(s, s.computed + len(fed))
            s.tokens[s.computed:] = fed
            states.append(s)
            counts.append(len(fed))
            rows.append(r)
        T = max(counts)
        out = self._forward_new(states, counts, keep=T).float()
        full = torch.zeros(self.batch_size, T, out.size(-1), dtype=out.dtype, device=out.device)
        full[to_device(rows, torch.long, self.device)] = out
        return full, T

    def finish_verify(self, accepted: dict[int, int]):
        """:meth:`accept` every row fed by the last :meth:`verify` (rows not named accepted no draft token)."""
        for row in list(self._verify_start):
            if self.rows[row] is not None:
                self.accept(row, accepted.get(row, 0))
        self._verify_start.clear()

    def accept(self, row: int, accepted: int):
        """After :meth:`verify`: the row keeps its token and its first ``accepted`` draft tokens; the keys written
        for the rejected ones are overwritten by the next tokens (the row keeps its blocks: they are within its
        span)."""
        s = self.rows[row]
        s.computed = self._verify_start[row] + 1 + accepted
        del s.tokens[s.computed:]
        self._register_full(s)

    @torch.inference_mode()
    def feed(self, fed: dict[int, Sequence[int]]) -> torch.Tensor:
        """Append ``fed[row]`` to each named started row, after its computed tokens (uncomputed ones are dropped),
        and compute them in one forward: a draft model's step. The tokens are not named in the prefix cache (they
        may be rejected drafts: :meth:`truncate` names what is kept). Returns the logits (len(fed), V), float32,
        after each row's last token, in the order of ``fed``."""
        states, counts = [], []
        for row, toks in fed.items():
            s = self.rows[row]
            del s.tokens[s.computed:]
            s.tokens.extend(int(t) for t in toks)
            self._grow(s, len(s.tokens))
            states.append(s)
            counts.append(len(toks))
        return self._forward_new(states, counts).float()

    def truncate(self, row: int, length: int):
        """Keep the row's first ``length`` computed tokens at most (the rest are drafts the target rejected: their
        keys are overwritten by the next tokens fed); its full blocks of kept tokens get their prefix-cache names."""
        s = self.rows[row]
        s.computed = min(s.computed, length)
        del s.tokens[s.computed:]
        self._register_full(s)

    def note_tokens(self, host: Sequence[int]):
        """The tokens of the last decode step as the host sees them (GPU: read after the step was queued), so that
        blocks filled by decoded tokens get their names for the prefix cache."""
        for r in self.decoding_rows():
            s = self.rows[r]
            if s.tokens[-1] == -1:
                s.tokens[-1] = int(host[r])
                if s.computed % self.block_size == 0:   # the token filled a block
                    self._register_full(s)

    # the column engine's calls, with nothing to do here
    def set_pad_lens(self, pad):
        pass

    def move_columns(self, lo, hi, shift):
        if shift and hi > lo:
            raise RuntimeError("paged session: nothing ever moves")


def ngram_draft(history: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt-lookup drafting: find the latest earlier occurrence of the last n tokens of ``history`` (n from
    ``max_n`` down to ``min_n``) and propose the (up to) ``k`` tokens that followed it; [] when none is found."""
    L = len(history)
    if k < 1:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = list(history[L - n:])
        for start in range(L - n - 1, -1, -1):   # latest first; the match must end before the tail itself
            if list(history[start:start + n]) == tail:
                return list(history[start + n:start + n + k])
    return []
