"""The paged KV cache (zero2all/infer/paged.py): block pool, prefix caching with LRU eviction, and the paged
session's greedy tokens against the contiguous-cache Generator on the tiny model."""

import os

import pytest
import torch
from standin_tokenizer import tiny_model_config

from zero2all.infer.generate import Generator, SamplingParams
from zero2all.infer.paged import BlockPool, PagedSession
from zero2all.model.z2all import build_model


@pytest.fixture(scope="module")
def model():
    # a large init std gives peaked logits, so greedy choices are not decided by rounding
    return build_model(tiny_model_config(initializer_range=0.3), seed=0).eval()


def prompt(seed, n, vocab=200):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, p, n_new):
    params = SamplingParams(max_new_tokens=n_new, temperature=0, stop_token_ids=[])
    return Generator(model).generate([p], params)[0].token_ids


def paged_greedy(session, rows, prompts, n_new):
    """Prefill each prompt into its row (all together), then greedy decode n_new - 1 steps for all rows."""
    logits = session.prefill_rows(rows, prompts)
    B = session.batch_size
    out = {r: [] for r in rows}
    tokens = torch.zeros(B, dtype=torch.long, device=session.device)
    tokens[rows] = logits.argmax(-1)
    for step in range(n_new):
        for r in rows:
            out[r].append(int(tokens[r]))
        if step + 1 < n_new:
            tokens = session.decode(tokens).argmax(-1)
    return [out[r] for r in rows]


def test_block_pool_reference_counts_and_lru_eviction():
    pool = BlockPool(n_blocks=4, block_size=2)          # blocks 1, 2, 3 (0 is the null block)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"A")
    pool.register(b, b"B")
    pool.take(a)                                         # a second sequence shares a
    pool.release(a)
    assert pool.refs[a] == 1 and pool.available() == 1   # still held once: not evictable
    pool.release(a)
    pool.release(b)
    assert list(pool.evictable) == [a, b] and pool.available() == 3 and pool.in_use() == 0
    c = pool.allocate()                                  # the free block first
    assert c not in (a, b) and pool.evictions == 0
    d = pool.allocate()                                  # then the least recently released cached block
    assert d == a and pool.evictions == 1 and b"A" not in pool.by_hash and pool.by_hash[b"B"] == b
    with pytest.raises(RuntimeError, match="out of blocks"):
        pool.allocate(), pool.allocate()


@pytest.mark.parametrize("block_size", [16, 4])
def test_paged_greedy_matches_the_contiguous_generator(model, block_size):
    prompts = [prompt(1, 21), prompt(2, 5), prompt(3, 37)]   # lengths not multiples of the block
    want = [reference(model, p, 12) for p in prompts]
    s = PagedSession(model, rows=4, max_len=64, block_size=block_size)
    got = paged_greedy(s, [0, 2, 3], prompts, 12)            # row 1 stays free
    assert got == want
    for r in (0, 2, 3):
        s.release(r)
    assert s.pool.in_use() == 0


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1")
def test_paged_greedy_through_the_triton_kernel_matches_the_contiguous_generator(model):
    """The session's decode step with the Triton kernel (what CUDA runs; interpreted on CPU): the kernel reads the
    step's lengths from the session's (position, slot, length) buffer, rows of different lengths, a free row."""
    prompts = [prompt(1, 21), prompt(2, 5), prompt(3, 37)]
    want = [reference(model, p, 6) for p in prompts]
    on = model.to("cuda") if torch.cuda.is_available() else model   # the kernel reads device memory on a GPU
    try:
        s = PagedSession(on, rows=4, max_len=64, block_size=16, impl="triton")
        assert paged_greedy(s, [0, 2, 3], prompts, 6) == want
    finally:
        model.to("cpu")


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1")
def test_short_prompt_chunks_through_the_decode_kernel_equal_the_masked_attention(model):
    """Prompt chunks of at most SHORT_CHUNK tokens attend through the decode kernel, one query per new token (what
    CUDA runs; interpreted on CPU): after a prefix-cache hit, two rows of different lengths in one left-padded
    chunk, and a chunk past SHORT_CHUNK (the masked attention on both sides). Logits and the cache's keys and
    values equal the PyTorch session's (measured in float32 through the interpreter: 6e-6; tolerance 1e-4)."""
    from zero2all.infer import paged

    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = build_model(tiny_model_config(initializer_range=0.3), seed=0, device=device).float().eval()
    system = prompt(7, 40)
    kernel = PagedSession(m, rows=3, max_len=160, block_size=16, impl="triton")
    plain = PagedSession(m, rows=3, max_len=160, block_size=16, impl="torch")
    steps = [([0], [system + prompt(8, 9)], 64), ([1, 2], [system + prompt(9, 3), prompt(10, 30)], 16),
             ([0], [prompt(11, 2 * paged.SHORT_CHUNK + 5)], 160)]
    for rows, prompts, chunk in steps:
        for s in (kernel, plain):
            for r in rows:
                if s.rows[r] is not None:
                    s.release(r)
            for r, p in zip(rows, prompts):
                s.start(r, p)
        while kernel.remaining(rows[0]) or kernel.remaining(rows[-1]):
            live = [r for r in rows if kernel.remaining(r)]
            got = kernel.prefill_step(live, [chunk] * len(live))
            want = plain.prefill_step(live, [chunk] * len(live))
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert kernel.cached_tokens[1] == plain.cached_tokens[1] == 32
    for kv_got, kv_want in zip((*kernel.cache.k, *kernel.cache.v), (*plain.cache.k, *plain.cache.v)):
        torch.testing.assert_close(kv_got, kv_want, atol=1e-4, rtol=1e-4)


def test_prefix_cache_reuses_blocks_and_gives_the_same_tokens(model):
    system = prompt(7, 40)
    p1, p2 = system + prompt(8, 9), system + prompt(9, 3)
    s = PagedSession(model, rows=2, max_len=80, block_size=16)
    first = paged_greedy(s, [0], [p1], 8)[0]
    assert s.cached_tokens[0] == 0
    shared = list(s.rows[0].blocks[:2])
    s.release(0)
    second = paged_greedy(s, [1], [p2], 8)[0]
    assert s.cached_tokens[1] == 32                          # the system prompt's two full blocks
    assert s.rows[1].blocks[:2] == shared
    assert s.pool.hits == 32 and s.pool.lookups == len(p1) + len(p2)
    assert first == reference(model, p1, 8) and second == reference(model, p2, 8)
    # and without prefix caching: the same tokens, nothing reused
    plain = PagedSession(model, rows=2, max_len=80, block_size=16, prefix_caching=False)
    assert paged_greedy(plain, [1], [p2], 8)[0] == second and plain.cached_tokens[1] == 0


def test_bucketed_prefill_equals_the_plain_prefill_in_float64():
    """One row's prompt tokens right-padded to a bucket, its table padded with the null block (the shapes a prefill
    CUDA graph needs; eager on CPU): in float64 the logits, the keys and values written into the row's blocks and
    the decode steps after it equal the plain forward's, with a prefix-cache hit, in chunks (the token budget)
    and past the largest bucket."""
    m = build_model(tiny_model_config(initializer_range=0.3), seed=0).double().eval()
    plain = PagedSession(m, rows=3, max_len=96, block_size=16)
    padded = PagedSession(m, rows=3, max_len=96, block_size=16, prefill_buckets=(8, 32, 500))
    assert padded.prefill_buckets == [8, 32] and plain.prefill_buckets == []
    system = prompt(7, 40)
    cases = [(0, system + prompt(8, 9), 64), (1, system + prompt(9, 3), 64), (2, prompt(10, 5), 4),
             (0, prompt(11, 50), 64)]
    for row, p, chunk in cases:
        got, want = [], []
        for s, out in ((padded, got), (plain, want)):
            if s.rows[row] is not None:
                s.release(row)
            s.start(row, p)
            while s.remaining(row):
                out.append(s.prefill_step([row], [chunk]))
        assert padded.cached_tokens[row] == plain.cached_tokens[row]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=5e-13, rtol=5e-13)
        blocks = padded.rows[row].blocks
        assert blocks == plain.rows[row].blocks
        for kv_got, kv_want in zip((*padded.cache.k, *padded.cache.v), (*plain.cache.k, *plain.cache.v)):
            torch.testing.assert_close(kv_got[blocks], kv_want[blocks], atol=5e-13, rtol=5e-13)
    assert padded.cached_tokens[1] == 32                      # the shared system prompt's two full blocks
    tokens = torch.tensor([3, 7, 9])
    for _ in range(3):
        torch.testing.assert_close(padded.decode(tokens), plain.decode(tokens), atol=5e-13, rtol=5e-13)


def test_shared_blocks_while_both_run_and_eviction_under_pressure(model):
    system = prompt(11, 32)
    s = PagedSession(model, rows=2, max_len=48, n_blocks=1 + 6, block_size=16)
    a = paged_greedy(s, [0], [system + [5]], 2)[0]
    b = paged_greedy(s, [1], [system + [6]], 2)[0]
    assert s.cached_tokens[1] == 32 and s.rows[0].blocks[:2] == s.rows[1].blocks[:2]
    assert s.pool.refs[s.rows[0].blocks[0]] == 2 and s.pool.in_use() == 4
    s.release(0)
    s.release(1)
    assert s.pool.in_use() == 0 and len(s.pool.evictable) == 2   # the shared prefix stays cached
    # other prompts fill the pool: 4 free blocks, then both cached blocks are evicted (least recently used first)
    paged_greedy(s, [0, 1], [prompt(12, 40), prompt(13, 40)], 1)
    assert s.pool.evictions == 2 and s.pool.available() == 0
    s.reset()
    assert paged_greedy(s, [0], [system + [5]], 2)[0] == a and s.cached_tokens[0] == 0   # computed again
    assert b == reference(model, system + [6], 2)


def test_can_admit_counts_the_running_rows_growth(model):
    s = PagedSession(model, rows=2, max_len=64, n_blocks=1 + 4, block_size=16)
    assert s.can_admit(64) and not s.fits_ever(65)
    s.prefill_rows([0], [prompt(1, 10)], spans=[40])          # holds 1 block, may grow to 3
    assert s.can_admit(16) and not s.can_admit(17)


def test_ngram_draft_takes_what_followed_the_latest_match():
    from zero2all.infer.paged import ngram_draft

    h = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_draft(h, 2) == [7, 8]              # the latest earlier "1 2 3" is followed by 7 8
    assert ngram_draft(h, 10) == [7, 8, 5, 1, 2, 3]  # up to the end of the history
    assert ngram_draft([4, 5, 6], 3) == [] and ngram_draft(h, 0) == []
    assert ngram_draft([5, 6, 1, 6], 2) == [1, 6]    # falls back to the last token alone


def test_decode_runs_over_the_smallest_bucket_holding_the_rows(model):
    s = PagedSession(model, rows=6, max_len=32, block_size=4)
    assert s.buckets == [1, 2, 4, 6] and s.bucket_for(3) == 4 and s.bucket_for(5) == 6
    want = [reference(model, p, 5) for p in (prompt(21, 6), prompt(22, 9))]
    assert paged_greedy(s, [0, 2], [prompt(21, 6), prompt(22, 9)], 5) == want   # bucket 4 of 6 rows


def test_decode_uploads_tables_only_when_they_change_and_a_reused_row_decodes_right(model):
    """The decode step's host inputs: the block tables go to the device only on steps after a row gained a block
    (or a row started), the rows' positions every step; a row freed and taken by a new prompt while another row
    keeps decoding gives the contiguous generator's tokens (its stale inputs are not read)."""
    s = PagedSession(model, rows=4, max_len=48, block_size=4, n_blocks=8)
    uploads = []
    upload = s._upload
    s._upload = lambda dst, host, n: (uploads.append("tables" if dst is s._tables_buf else "meta"),
                                      upload(dst, host, n))
    p0, p1, p2 = prompt(31, 6), prompt(32, 3), prompt(33, 9)
    logits = s.prefill_rows([0], [p0])
    got0 = [int(logits[0].argmax())]
    tables_per_step = []
    for _ in range(7):                                   # positions 6 .. 12: new blocks at 8 and 12
        uploads.clear()
        got0.append(int(s.decode(torch.tensor([got0[-1], 0, 0, 0])).argmax(-1)[0]))
        tables_per_step.append(uploads.count("tables"))
        assert uploads.count("meta") == 1
    assert tables_per_step == [1, 0, 1, 0, 0, 0, 1]       # the first: the prefill's tables
    assert got0 == reference(model, p0, 8)
    tokens = torch.zeros(4, dtype=torch.long)
    tokens[1] = s.prefill_rows([1], [p1])[0].argmax()
    s.release(0)          # row 0 leaves (its last block goes back to the pool), a new prompt takes row 2 and that block
    logits = s.prefill_rows([2], [p2])
    assert s.decoding_rows() == [1, 2] and 4 in s.rows[2].blocks
    got2 = [int(logits[0].argmax())]
    for _ in range(5):                                    # bucket 4: row 0 is free and must write nowhere that counts
        tokens[2] = got2[-1]
        out = s.decode(tokens).argmax(-1)
        tokens[1] = out[1]
        got2.append(int(out[2]))
    assert got2 == reference(model, p2, 6)


def test_decode_into_the_graphs_shared_logits_buffer_across_buckets(model):
    """CPU stand-in for the graphs' output (plumbing only; the graphs themselves are the GPU test below): every
    bucket's step writes one shared (rows, V) buffer; rows past the bucket read zeros after a larger bucket wrote
    them, and the tokens are the eager path's."""
    s = PagedSession(model, rows=6, max_len=32, block_size=4)
    s._logits_buf = torch.full((6, model.cfg.padded_vocab_size), 7.0)
    p0, p4 = prompt(41, 5), prompt(42, 7)
    tokens = torch.zeros(6, dtype=torch.long)
    tokens[0] = s.prefill_rows([0], [p0])[0].argmax()
    tokens[4] = s.prefill_rows([4], [p4])[0].argmax()
    got0, got4 = [int(tokens[0])], [int(tokens[4])]
    for _ in range(3):                                        # bucket 6 (rows 0 and 4)
        out = s.decode(tokens)
        assert out is s._logits_buf
        tokens = out.argmax(-1)
        got0.append(int(tokens[0]))
        got4.append(int(tokens[4]))
    s.release(4)
    for _ in range(3):                                        # bucket 1: rows 1-5 of the buffer are zeros again
        out = s.decode(tokens)
        assert torch.count_nonzero(out[1:]) == 0
        tokens = out.argmax(-1)
        got0.append(int(tokens[0]))
    assert got0 == reference(model, p0, 7) and got4 == reference(model, p4, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphed_paged_decode_equals_the_eager_step():
    """On CUDA: the paged decode step captured per batch bucket and replayed gives the eager step's logits, and
    the PyTorch path's greedy tokens (the kernel's reference), with rows joining (the bucket grows from 2 to 4 to
    8 rows) and leaving."""
    m = build_model(tiny_model_config(initializer_range=0.3, hidden_dim=128, intermediate_size=100),
                    device="cuda", seed=0).eval()
    graphed = PagedSession(m, rows=8, max_len=64, block_size=16, cuda_graph=True)
    eager = PagedSession(m, rows=8, max_len=64, block_size=16, cuda_graph=False)
    torch_path = PagedSession(m, rows=8, max_len=64, block_size=16, impl="torch")
    for rows, prompts in (([0, 1], [prompt(1, 5), prompt(2, 20)]), ([3], [prompt(3, 17)]), ([6], [prompt(4, 2)])):
        for sess in (graphed, eager, torch_path):
            sess.prefill_rows(rows, prompts)
        tokens = torch.arange(8, device="cuda") + 7
        for _ in range(6):
            a, b, c = graphed.decode(tokens), eager.decode(tokens), torch_path.decode(tokens)
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            occupied = [r for r, st in enumerate(eager.rows) if st is not None]
            assert torch.equal(b[occupied].argmax(-1), c[occupied].argmax(-1))   # greedy: the same tokens
            tokens = b.argmax(-1)
    assert graphed.graphs and all(g is not None for g in graphed.graphs.values()) and not eager.graphs
    graphed.release(1)
    eager.release(1)
    torch.testing.assert_close(graphed.decode(tokens), eager.decode(tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_cuda_graphed_bucketed_prefill_equals_the_eager_prefill():
    """On CUDA: one row's prompt chunks through the prefill graphs of their buckets (with a prefix-cache hit, in
    chunks of the token budget) give the eager prefill's logits, and the same greedy tokens after (float32)."""
    m = build_model(tiny_model_config(initializer_range=0.3, hidden_dim=128, intermediate_size=100),
                    device="cuda", seed=0).eval()
    graphed = PagedSession(m, rows=4, max_len=96, block_size=16, cuda_graph=True, prefill_buckets=(32, 64))
    eager = PagedSession(m, rows=4, max_len=96, block_size=16, cuda_graph=True)
    assert sorted(graphed.prefill_graphs) == [32, 64] and not eager.prefill_graphs
    system = prompt(7, 40)
    for row, p, chunk in ((0, system + prompt(8, 9), 64), (1, system + prompt(9, 3), 64), (2, prompt(10, 70), 24)):
        for s in (graphed, eager):
            s.start(row, p)
        while eager.remaining(row):
            a, b = graphed.prefill_step([row], [chunk]), eager.prefill_step([row], [chunk])
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert graphed.cached_tokens[1] == 32
    tokens = torch.arange(4, device="cuda") + 7
    for _ in range(5):
        a, b = graphed.decode(tokens), eager.decode(tokens)
        assert torch.equal(a[:3].argmax(-1), b[:3].argmax(-1))
        tokens = b.argmax(-1)


def test_auto_engine_and_default_rows_follow_the_device():
    """``auto`` is the column engine on CUDA (measured the faster there) and the paged one on CPU; default rows: 8 on
    CPU, 256 on CUDA, with the column engine fewer (128 / 64 / 32, at least 16) when 256 rows' cache at the model's
    context would take over half the free memory."""
    pytest.importorskip("starlette")
    from zero2all.infer.server import default_rows, resolve_engine

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_engine("auto", cuda) == "column" and resolve_engine("auto", cpu) == "paged"
    assert resolve_engine("paged", cuda) == "paged" and resolve_engine("column", cpu) == "column"
    assert [default_rows(e, d) for e in ("paged", "column") for d in (cpu, cuda)] == [8, 256, 8, 256]
    model = build_model(tiny_model_config(vocab_size=64)).to(torch.bfloat16)
    cfg = model.cfg
    per_row = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * cfg.max_seq_len  # bf16 keys + values
    rows = {free: default_rows("column", cuda, model, free_bytes=free)
            for free in (2 * 256 * per_row, 2 * 256 * per_row - 1, 2 * 64 * per_row + 1, 2 * 32 * per_row - 1, 0)}
    assert list(rows.values()) == [256, 128, 64, 16, 16]
    assert default_rows("paged", cuda, model, free_bytes=0) == 256  # the paged pool sizes itself
