"""Continuous batching (zero2all/infer/scheduler.py): rows joining and leaving a running batch compute what each
prompt computes alone; per-row sampling; cancellation, errors and the queue bound."""

import os
import threading
import time

import pytest
import torch
from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.infer.generate import DecodeSession, Generator, SamplingParams, sample_rows, smallest_bucket
from zero2all.infer.scheduler import CANCELLED, QueueFull, Scheduler, ShuttingDown
from zero2all.model.z2all import build_model


@pytest.fixture(scope="module")
def model():
    # a large init std gives peaked logits, so greedy choices are not decided by rounding
    return build_model(tiny_model_config(initializer_range=0.3), seed=0).eval()


def greedy(**kw):
    return SamplingParams(temperature=0, stop_token_ids=[], **kw)


def tokens_of(events):
    """Token ids per sequence index (stop tokens and cancellation markers excluded)."""
    out = {}
    for ev in events:
        out.setdefault(ev.index, [])
        if ev.token_id >= 0 and not ev.stop_token:
            out[ev.index].append(ev.token_id)
    return [out[i] for i in sorted(out)]


def reference(model, prompt, params):
    return Generator(model).generate([prompt], params)[0].token_ids


@pytest.fixture
def make_scheduler(model):
    made = []

    def make(**kw):
        kw.setdefault("max_queue", 64)
        s = Scheduler(Generator(model, ByteTokenizer()), **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def run_all(sched, jobs):
    """Submit every (prompt, params) at once (they queue and join as rows free up); events per job, in order."""
    subs = [sched.submit([p], params) for p, params in jobs]
    return [list(sub.events()) for sub in subs]


@pytest.mark.parametrize("engine", ["column", "paged"])
def test_staggered_joins_and_moves_match_each_prompt_alone(model, make_scheduler, engine):
    """Ten sequences of different lengths and budgets through three rows of a 64-slot cache: rows join while
    others run, the occupied span moves (column engine: right for a long prompt, left when the common padding
    grows; the paged engine never moves anything), and every sequence's greedy tokens equal those of its prompt
    generated alone."""
    sched = make_scheduler(max_batch=3, cache_len=64, compact_min=4, engine=engine)
    lengths = [3, 17, 1, 9, 30, 5, 12, 40, 2, 20]
    budgets = [20, 5, 30, 12, 8, 25, 3, 10, 40, 15]
    jobs = [([(7 * i + 3 * j) % 250 for j in range(n)], greedy(max_new_tokens=m))
            for i, (n, m) in enumerate(zip(lengths, budgets))]
    results = run_all(sched, jobs)
    for (prompt, params), events in zip(jobs, results):
        assert tokens_of(events) == [reference(model, prompt, params)]
        assert events[-1].finish_reason == "length" and len(events) == params.max_new_tokens
    stats = sched.stats()
    assert (stats["moves"] > 0) == (engine == "column") and stats["running"] == stats["waiting"] == 0
    assert stats["finished"] == {"length": len(jobs)}
    if engine == "paged":
        assert stats["kv_blocks_in_use"] == 0 and stats["prefix_cache_lookups"] == sum(lengths)


def test_rows_keep_their_own_parameters_in_one_batch(model, make_scheduler):
    """Greedy rows with and without a repetition penalty, and seeded sampled rows, in one batch: the greedy ones
    equal the one-prompt Generator, a seeded one gives the same tokens alone and among others."""
    sched = make_scheduler(max_batch=4)
    p1, p2, p3 = [5, 9, 200], list(range(30, 47)), [100, 101, 102]
    penalised = greedy(max_new_tokens=16, repetition_penalty=1.5)
    sampled = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=11, stop_token_ids=[])
    alone = tokens_of(sched.generate([p3], sampled))
    with sched.paused():  # all four join in the same iteration
        subs = [sched.submit([p1], greedy(max_new_tokens=12)), sched.submit([p2], penalised),
                sched.submit([p3], sampled), sched.submit([p3], SamplingParams(max_new_tokens=16, temperature=1.0,
                                                                                seed=12, stop_token_ids=[]))]
    got = [tokens_of(list(s.events())) for s in subs]
    assert got[0] == [reference(model, p1, greedy(max_new_tokens=12))]
    assert got[1] == [reference(model, p2, penalised)]
    assert got[2] == alone
    assert got[3] != alone  # another seed


def test_prompt_list_seeds_each_prompt(model, make_scheduler):
    """Prompt i of a seeded request draws from seed + i: the same prompt twice gives two different samples, and
    the second equals the prompt alone with seed + 1."""
    sched = make_scheduler(max_batch=4)
    p = [5, 9, 200]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, stop_token_ids=[])
    both = tokens_of(sched.generate([p, p], params))
    assert both[0] != both[1]
    assert both[1] == tokens_of(sched.generate([p], SamplingParams(**{**params.__dict__, "seed": 4})))[0]


def test_sample_rows_follows_each_rows_distribution():
    """Inverse-CDF draws over a grid of uniforms reproduce each row's filtered softmax; top-k 1 / a tiny top-p
    are the argmax."""
    V, N = 6, 6000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0, 0.3, 3.0, 0.1, 0.2, 1.0]])
    u = (torch.arange(N) + 0.5) / N
    for row, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 3, 1.0)]):
        x = logits[row].expand(N, V)
        draws = sample_rows(x, torch.full((N,), t), torch.full((N,), k), torch.full((N,), p), u)
        expected = torch.softmax(logits[row] / t, -1)
        if k:
            expected = torch.where(logits[row] >= logits[row].topk(k).values[-1], expected, 0.0)
            expected /= expected.sum()
        freq = torch.bincount(draws, minlength=V).float() / N
        torch.testing.assert_close(freq, expected, atol=2e-3, rtol=0)
    # top-p: the smallest most likely set reaching p (here the first two tokens: 0.5 + 0.3 >= 0.8)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    x = probs.log().expand(N, 4)
    draws = sample_rows(x, torch.ones(N), torch.zeros(N, dtype=torch.long), torch.full((N,), 0.8), u)
    assert set(draws.tolist()) == {0, 1}
    one = sample_rows(logits, torch.ones(2), torch.tensor([1, 0]), torch.tensor([1.0, 1e-6]), torch.tensor([.9, .9]))
    assert one.tolist() == logits.argmax(-1).tolist()


def test_prefill_row_touches_only_its_row(model):
    """A row prefilled at any slot gives the one-row session's logits and leaves the other rows' caches alone;
    move_columns keeps a row's logits when the padding and the slot move with it."""
    s = DecodeSession(model, 3, 48, cuda_graph=False)
    s.prefill([[1, 2, 3], [4, 5, 6], [7, 8, 9]], 0)
    before = [k.clone() for k in s.cache.k]
    prompt = list(range(40, 52))
    logits = s.prefill_row(1, prompt, end=30)
    alone = DecodeSession(model, 1, 48, cuda_graph=False).prefill([prompt], 0)[0]
    torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)
    for k, k0 in zip(s.cache.k, before):
        assert torch.equal(k[[0, 2]], k0[[0, 2]]) and torch.equal(k[1, :, :18], k0[1, :, :18])
    assert s.pad_len.tolist()[1] == 18
    tok = torch.tensor([3, 7, 3])
    s.set_pad_lens([30, 18, 30])
    ref = s.decode(tok, 30)[1]
    s.move_columns(18, 30, -10)  # the prompt's span (the step above wrote slot 30, rewritten below at 20)
    s.set_pad_lens([20, 8, 20])
    torch.testing.assert_close(s.decode(tok, 20)[1], ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        s.prefill_row(0, prompt, end=5)


def test_row_bucket_steps_compute_the_first_rows_alone_in_float64():
    """A generic session of 20 rows with row buckets (8, 16): a step over the first b rows gives those rows the
    full step's logits and cache writes (float64) and leaves the rows past b untouched; rows that join later (a
    prefill into a free row, as the scheduler does) and full steps after bucket steps carry on as if every step
    had been full; decode(rows=n) takes the smallest bucket holding n rows."""
    m = build_model(tiny_model_config(initializer_range=0.3), seed=0).double().eval()
    full = DecodeSession(m, 20, 64, cuda_graph=False)
    rows = DecodeSession(m, 20, 64, cuda_graph=False, row_buckets=True)
    assert rows.row_buckets == [8, 16] and full.row_buckets == []
    prompts = [[(5 * r + j) % 250 + 3 for j in range(1 + r % 7)] for r in range(20)]
    for s in (full, rows):
        s.prefill(prompts, 0)
    P = max(len(p) for p in prompts)
    used = []
    real = rows._rows_step
    rows._rows_step = lambda key: used.append(key[1]) or real(key)
    n_before = 5
    for step, n in enumerate([5, 8, 9, 16, 20, 3]):
        if n > n_before:  # rows [n_before, n) join at this slot: free rows until now, prefilled in both
            joining = list(range(n_before, n))
            for s in (full, rows):
                s.prefill_rows(joining, [prompts[r] for r in joining], P + step)
        n_before = max(n_before, n)
        nxt = torch.tensor([(17 * step + 31 * r) % 250 for r in range(20)])
        past = 8 if n <= 8 else 16
        untouched = [k[past:].clone() for k in rows.cache.k]
        want = full.decode(nxt, P + step)
        got = rows.decode(nxt, P + step, rows=n)
        torch.testing.assert_close(got[:n], want[:n], atol=1e-12, rtol=1e-12)
        if n <= 16:
            for k, k0 in zip(rows.cache.k, untouched):
                assert torch.equal(k[past:], k0)
        for layer in range(len(rows.cache.k)):
            torch.testing.assert_close(rows.cache.k[layer][:n], full.cache.k[layer][:n], atol=1e-12, rtol=1e-12)
    assert used == [8, 8, 16, 16, 8]                      # 20 rows: the full step


def test_column_engine_with_more_rows_than_a_bucket_gives_each_prompt_its_tokens(model, make_scheduler):
    """The column engine's generic step over 20 rows, with row buckets: ten sequences joining and leaving (rows
    are handed out lowest first, so the running ones fit the smaller buckets) get the one-prompt tokens, and the
    steps ran over buckets smaller than the session."""
    sched = make_scheduler(max_batch=20, cache_len=96, engine="column")
    assert sched.session.row_buckets == [8, 16]
    used = []
    real = sched.session._rows_step
    sched.session._rows_step = lambda key: used.append(key[1]) or real(key)
    lengths, budgets = [3, 17, 1, 9, 30, 5, 12, 40, 2, 20], [20, 5, 30, 12, 8, 25, 3, 10, 40, 15]
    jobs = [([(7 * i + 3 * j) % 250 for j in range(n)], greedy(max_new_tokens=m))
            for i, (n, m) in enumerate(zip(lengths, budgets))]
    for (prompt, params), events in zip(jobs, run_all(sched, jobs)):
        assert tokens_of(events) == [reference(model, prompt, params)]
    assert used and set(used) == {16}                     # ten rows at first: the 16-row bucket
    eight = [([(11 * i + 5 * j) % 250 for j in range(2 + i)], greedy(max_new_tokens=6 + i)) for i in range(8)]
    for (prompt, params), events in zip(eight, run_all(sched, eight)):
        assert tokens_of(events) == [reference(model, prompt, params)]
    assert 8 in used                                      # then rows 0-7: the 8-row bucket, row 7 in use


def test_bucketed_prefill_equals_the_plain_prefill_in_float64():
    """One prompt right-padded to its bucket and run from a scratch cache (the shape a prefill CUDA graph needs):
    the logits at its last token, the keys and values it leaves in its row, the row's padding and the decode steps
    after it equal the plain prefill's, in float64, for lengths at, below and past the buckets; other rows keep
    their caches."""
    m = build_model(tiny_model_config(initializer_range=0.3), seed=0).double().eval()
    plain = DecodeSession(m, 3, 96, cuda_graph=False)
    padded = DecodeSession(m, 3, 96, cuda_graph=False, prefill_buckets=(8, 16, 32, 200))
    assert padded.prefill_buckets == [8, 16, 32] and plain.prefill_buckets == []  # 200 > the cache: dropped
    for s in (plain, padded):
        s.prefill([[1, 2, 3]] * 3, 0)
    for n, row, end in [(1, 0, 40), (5, 2, 20), (8, 1, 8), (9, 1, 60), (32, 0, 90), (33, 2, 70)]:
        prompt = [(11 * i + n) % 250 for i in range(n)]
        before = [k[[r for r in range(3) if r != row]].clone() for k in padded.cache.k]
        got, want = padded.prefill_rows([row], [prompt], end), plain.prefill_rows([row], [prompt], end)
        assert smallest_bucket(padded.prefill_buckets, n) == next((b for b in (8, 16, 32) if n <= b), None)
        torch.testing.assert_close(got, want, atol=4e-13, rtol=4e-13)
        for kv_got, kv_want in zip((*padded.cache.k, *padded.cache.v), (*plain.cache.k, *plain.cache.v)):
            torch.testing.assert_close(kv_got[row, :, end - n:end], kv_want[row, :, end - n:end], atol=4e-13,
                                       rtol=4e-13)
        for k, k0 in zip(padded.cache.k, before):
            assert torch.equal(k[[r for r in range(3) if r != row]], k0)
        assert padded.pad_len.tolist() == plain.pad_len.tolist()
        tok = torch.tensor([3, 7, 9])
        for step in range(3):
            padded.set_pad_lens(plain.pad_len.tolist())
            torch.testing.assert_close(padded.decode(tok, end + step)[row], plain.decode(tok, end + step)[row],
                                       atol=4e-13, rtol=4e-13)


@pytest.mark.parametrize("engine", ["column", "paged"])
def test_scheduler_with_prefill_graphs_gives_each_prompt_its_own_tokens(make_scheduler, model, engine):
    """Either engine with bucketed one-prompt prefills (eager on CPU, graphed on CUDA): greedy tokens equal the
    one-prompt Generator's."""
    sched = make_scheduler(max_batch=3, cache_len=96, engine=engine, prefill_graphs=True)
    assert sched.session.prefill_buckets == [32, 64]
    jobs = [([(5 * i + 3 * j) % 250 for j in range(n)], greedy(max_new_tokens=k))
            for i, (n, k) in enumerate(zip([3, 31, 40, 1, 70], [9, 4, 12, 6, 5]))]
    for (prompt, params), events in zip(jobs, run_all(sched, jobs)):
        assert tokens_of(events) == [reference(model, prompt, params)]
    from zero2all.infer.server import InferenceApp

    app = InferenceApp(Generator(model, ByteTokenizer()), "m", engine_options={"engine": engine,
                                                                              "prefill_graphs": True})
    try:  # the server passes it through
        assert app.scheduler.engine == engine and app.scheduler.session.prefill_buckets
    finally:
        app.scheduler.stop()


@pytest.mark.parametrize("rows", [[1, 2, 3], [3, 0, 2]])
def test_prefill_rows_together_equal_each_prompt_alone(model, rows):
    """Prompts of different lengths prefilled in one forward, into consecutive rows (a view of the cache) or
    scattered ones (a scratch cache copied in): each row's logits and decode steps are its prompt's alone, each row
    keeps its padding, and a row not named keeps its cache."""
    s = DecodeSession(model, 4, 48, cuda_graph=False)
    s.prefill([[1, 2, 3]] * 4, 0)
    other = ({0, 1, 2, 3} - set(rows)).pop()
    before = [k[other].clone() for k in s.cache.k]
    prompts = [list(range(40, 52)), [7, 9], list(range(100, 120))[:5]]
    logits = s.prefill_rows(rows, prompts, end=30)
    assert logits.shape == (3, model.cfg.padded_vocab_size)
    for r, p, got in zip(rows, prompts, logits):
        alone = DecodeSession(model, 1, 48, cuda_graph=False)
        ref = alone.prefill([p], 0)[0]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert s.pad_len.tolist()[r] == 30 - len(p)
    for k, k0 in zip(s.cache.k, before):
        assert torch.equal(k[other], k0)
    # a decode step after the joint prefill: every joined row continues as its prompt alone
    tok = torch.tensor([5, 6, 7, 8])
    step = s.decode(tok, 30)
    for r, p in zip(rows, prompts):
        alone = DecodeSession(model, 1, 48, cuda_graph=False)
        alone.prefill([p], 0)
        torch.testing.assert_close(step[r], alone.decode(tok[r:r + 1], len(p))[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        s.prefill_rows([0, 1], [[1] * 31, [2]], end=30)


def test_sequences_admitted_together_are_prefilled_together(model, make_scheduler, monkeypatch):
    """Sequences that join in the same iteration share one forward per group of similar prompt lengths (a long
    prompt is not padded to with short ones), and each still generates what its prompt generates alone."""
    sched = make_scheduler(max_batch=6, cache_len=128, engine="column")
    calls = []
    prefill_rows = sched.session.prefill_rows

    def counted(rows, prompts, end):
        calls.append(sorted(len(p) for p in prompts))
        return prefill_rows(rows, prompts, end)

    monkeypatch.setattr(sched.session, "prefill_rows", counted)
    lengths = [70, 40, 5, 66, 3, 9]
    jobs = [([(5 * i + 11 * j) % 250 for j in range(n)], greedy(max_new_tokens=6)) for i, n in enumerate(lengths)]
    with sched.paused():
        subs = [sched.submit([p], params) for p, params in jobs]
    for (prompt, params), sub in zip(jobs, subs):
        assert tokens_of(list(sub.events())) == [reference(model, prompt, params)]
    assert sorted(calls) == [[3, 5, 9], [40, 66, 70]]


def test_a_consumer_that_fell_behind_gets_the_queued_events_at_once(model, make_scheduler):
    """``Submission.batches`` hands over every event already queued in one list (a streaming handler writes them
    together); ``events`` gives the same events one by one."""
    sched = make_scheduler(max_batch=2)
    params = greedy(max_new_tokens=7)
    sub = sched.submit([[4, 5, 6], [7, 8]], params)
    assert sched.wait_idle(20)
    batches = list(sub.batches())
    assert len(batches) == 1 and len(batches[0]) == 14
    assert tokens_of(batches[0]) == tokens_of(sched.generate([[4, 5, 6], [7, 8]], params))


@pytest.mark.parametrize("engine", ["column", "paged"])
def test_time_to_first_token_is_split_into_waiting_prefill_and_first_draw(model, make_scheduler, engine):
    """``stats()["ttft_parts"]``: per sequence, the time waiting for a row, its prefill and its first draw, summed
    (one entry per sequence, each part > 0). One row and two sequences (the second waits for the first to finish):
    together the parts fit inside the two sequences' times to their first token as their consumer saw them."""
    sched = make_scheduler(max_batch=1, engine=engine)
    params = greedy(max_new_tokens=12)
    t0 = time.perf_counter()
    subs = [sched.submit([[4, 5, 6, 7]], params), sched.submit([[9, 8]], params)]
    firsts = []
    for sub in subs:
        next(iter(sub.events()))
        firsts.append(time.perf_counter())
    assert sched.wait_idle(20)
    parts = sched.stats()["ttft_parts"]
    assert parts["n"] == 2 and min(parts["queue"], parts["prefill"], parts["first_draw"]) >= 0
    assert parts["queue"] + parts["prefill"] + parts["first_draw"] <= (firsts[0] - t0) + (firsts[1] - t0)
    assert parts["queue"] > 0 and parts["prefill"] > 0 and parts["first_draw"] > 0   # each part was timed


def test_cancel_frees_rows_and_queue_bound(model, make_scheduler):
    """Cancelled sequences (running or waiting) end with "cancelled" and free their rows; the queue holds
    max_queue sequences beyond the free rows; after drain nothing is accepted."""
    sched = make_scheduler(max_batch=2, max_queue=1)
    long = greedy(max_new_tokens=100)
    with sched.paused():
        a = sched.submit([[1, 2, 3]], long)
        b = sched.submit([[4, 5]], long)
        c = sched.submit([[6]], greedy(max_new_tokens=5))   # waits: both rows taken
        with pytest.raises(QueueFull):
            sched.submit([[7]], long)
        a.cancel()
        b.cancel()
    assert [e.finish_reason for e in a.events()][-1] == CANCELLED
    assert list(b.events())[-1].finish_reason == CANCELLED
    assert tokens_of(list(c.events())) == [reference(model, [6], greedy(max_new_tokens=5))]
    assert sched.wait_idle(10)
    # a long request stopped by the drain
    d = sched.submit([[8, 9]], long)
    assert sched.drain(0.0) == 1
    assert list(d.events())[-1].finish_reason == CANCELLED
    with pytest.raises(ShuttingDown):
        sched.submit([[1]], greedy(max_new_tokens=2))


def test_a_failing_step_fails_its_requests_and_the_scheduler_goes_on(model, make_scheduler, monkeypatch):
    sched = make_scheduler(max_batch=2)
    calls = {"n": 0}
    decode = sched.session.decode

    def flaky(tokens, slot):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return decode(tokens, slot)

    monkeypatch.setattr(sched.session, "decode", flaky)
    monkeypatch.setattr("traceback.print_exc", lambda **kw: None)
    sub = sched.submit([[1, 2]], greedy(max_new_tokens=10))
    with pytest.raises(RuntimeError, match="fell over"):
        list(sub.events())
    again = sched.generate([[1, 2]], greedy(max_new_tokens=10))
    assert tokens_of(again) == [reference(model, [1, 2], greedy(max_new_tokens=10))]


def test_requests_from_many_threads(model, make_scheduler):
    """Submissions from several threads at once, some while others run: each gets exactly its own tokens."""
    sched = make_scheduler(max_batch=4)
    prompts = [[(11 * i + j) % 256 for j in range(1 + i % 7)] for i in range(12)]
    out = [None] * len(prompts)

    def client(i):
        out[i] = tokens_of(sched.generate([prompts[i]], greedy(max_new_tokens=4 + i % 5)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        assert out[i] == [reference(model, p, greedy(max_new_tokens=4 + i % 5))]


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_fused_step_with_rows_joining(make_scheduler):
    """The fused decode step (one slot for every row, each row's padding from the device) under joins and moves:
    greedy tokens equal the generic step's one-prompt generation."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_model_config(initializer_range=0.3, hidden_dim=128, intermediate_size=100)  # head_dim 32
    m = build_model(cfg, device=device, seed=0).eval()
    sched = Scheduler(Generator(m, ByteTokenizer(), fused=True, cuda_graph=False), max_batch=2, max_queue=8,
                      cache_len=24, compact_min=2, engine="column")
    try:
        assert sched.session.fused is not None
        # the second prompt is longer than the slot the first one left: the first row moves right for it
        jobs = [([5, 9, 200], greedy(max_new_tokens=3)), (list(range(30, 44)), greedy(max_new_tokens=3))]
        results = run_all(sched, jobs)
        generic = Generator(m, fused=False, cuda_graph=False)
        for (prompt, params), events in zip(jobs, results):
            assert tokens_of(events) == [generic.generate([prompt], params)[0].token_ids]
        assert sched.stats()["moves"] > 0
    finally:
        sched.stop()


@pytest.mark.parametrize("pipelined", [False, True])
def test_rows_stopping_early_with_and_without_a_step_in_flight(model, make_scheduler, pipelined):
    """Rows that end on a stop token, a stop string or their budget, while others go on and new ones join; with
    ``pipelined`` (as on CUDA) the next step is already queued when the host sees that a row has ended."""
    tok = ByteTokenizer()
    gen = Generator(model, tok)
    sched = make_scheduler(max_batch=3, cache_len=96, compact_min=4, pipelined=pipelined)
    jobs = []
    for i in range(8):
        prompt = [(13 * i + 5 * j) % 250 for j in range(2 + 3 * i)]
        free = gen.generate([prompt], greedy(max_new_tokens=16))[0]
        if i % 3 == 0:    # a stop token drawn mid-way
            params = SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[free.token_ids[3 + i % 4]])
        elif i % 3 == 1:  # a stop string
            window = next((free.text[k:k + 2] for k in range(2, len(free.text) - 2)
                           if "\ufffd" not in free.text[k:k + 2]), None)
            params = SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[],
                                    stop=(window,) if window else ())
        else:
            params = greedy(max_new_tokens=5 + i)
        jobs.append((prompt, params))
    results = run_all(sched, jobs)
    for (prompt, params), events in zip(jobs, results):
        ref = gen.generate([prompt], params)[0]
        assert tokens_of(events) == [ref.token_ids]
        assert "".join(e.text for e in events) == ref.text and events[-1].finish_reason == ref.finish_reason
        assert len(events) == ref.num_generated
    assert sched.stats()["running"] == 0


@pytest.mark.parametrize("engine", ["column", "paged"])
def test_a_cache_of_twice_the_context_never_makes_a_sequence_wait(model, make_scheduler, engine):
    """Sequences that each fill the whole context, started at different times: with the default cache (column:
    twice the context; paged: a pool that holds every row at the full context) each joins as soon as a row is free,
    so three of them share every step once all have joined."""
    ctx = model.cfg.max_seq_len
    sched = make_scheduler(max_batch=3, engine=engine)
    assert sched.cache_len == (2 * ctx if engine == "column" else ctx) and sched.context == ctx
    jobs = [([(3 * i + j) % 250 for j in range(ctx // 2)], greedy(max_new_tokens=ctx // 2)) for i in range(3)]
    subs = [sched.submit([jobs[0][0]], jobs[0][1])]
    for prompt, params in jobs[1:]:  # each joins while the ones before it are running
        before = sched.stats()["steps"]
        wait_until(lambda: sched.stats()["steps"] >= before + 5)
        subs.append(sched.submit([prompt], params))
        wait_until(lambda: sched.stats()["waiting"] == 0)  # admitted at the next iteration, not after the others
        assert sched.stats()["running"] == len(subs)
    for (prompt, params), sub in zip(jobs, subs):
        assert tokens_of(list(sub.events())) == [reference(model, prompt, params)]


def wait_until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.002)


@pytest.mark.gpu
@pytest.mark.parametrize("fused,prefill_graphs,rows", [(True, False, 4), (False, False, 4), (True, True, 4),
                                                       (None, True, 20)])
def test_cuda_graphed_scheduler_matches_each_prompt_alone(fused, prefill_graphs, rows):
    """On CUDA: the decode step as a CUDA graph (fused kernels or the model's own step), pipelined, with rows
    joining, leaving and moving, and with one-prompt prefills as CUDA graphs of their buckets; 20 rows: the
    generic step with graphs of its row buckets, and a lone stream on the fused one-row step; float32, so greedy
    tokens equal the one-prompt Generator's."""
    cfg = tiny_model_config(initializer_range=0.3, hidden_dim=128, intermediate_size=100)  # head_dim 32
    m = build_model(cfg, device="cuda", seed=0).eval()
    sched = Scheduler(Generator(m, ByteTokenizer(), fused=fused), max_batch=rows, max_queue=32, cache_len=96,
                      compact_min=4, engine="column", prefill_graphs=prefill_graphs)
    try:
        assert sched.pipelined and sched.session.graphs and (sched.session.fused is not None) == bool(fused)
        if rows == 20:
            assert sched.session.row_buckets == [8, 16] and sched.session._row_graphs
            assert sched.session.lone_rows and sched.session._lone_graphs
        assert sorted(sched.session.prefill_graphs) == ([32, 64] if prefill_graphs else [])
        lengths, budgets = [3, 17, 1, 9, 30, 5, 12, 40, 2, 20], [20, 5, 30, 12, 8, 25, 3, 10, 40, 15]
        jobs = [([(7 * i + 3 * j) % 250 for j in range(n)], greedy(max_new_tokens=m_))
                for i, (n, m_) in enumerate(zip(lengths, budgets))]
        jobs.append(([5, 9, 200], SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.4,
                                                 stop_token_ids=[])))
        results = run_all(sched, jobs)
        alone = Generator(m, fused=False, cuda_graph=False)
        for (prompt, params), events in zip(jobs, results):
            assert tokens_of(events) == [alone.generate([prompt], params)[0].token_ids]
        assert sched.stats()["moves"] > 0
        seeded = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, stop_token_ids=[])
        one = tokens_of(sched.generate([[1, 2, 3]], seeded))
        busy = run_all(sched, [([1, 2, 3], seeded)] + jobs[:3])
        assert tokens_of(busy[0]) == one
    finally:
        sched.stop()


def test_async_batches_match_the_threaded_events_and_leaving_early_cancels(make_scheduler):
    """``Submission.abatches`` (the server's event loop): the same events as ``events()``, woken by the scheduler's
    thread; closing it before the end cancels the request and frees its row."""
    import asyncio

    sched = make_scheduler(max_batch=2)
    params = greedy(max_new_tokens=12)
    expected = list(sched.submit([[5, 6, 7], [9]], params).events())

    async def consume(limit=None):
        sub = sched.submit([[5, 6, 7], [9]], params)
        got = []
        agen = sub.abatches()
        async for batch in agen:
            got.extend(batch)
            if limit is not None and len(got) >= limit:
                break
        await agen.aclose()
        return sub, got

    _, got = asyncio.run(consume())
    assert [(e.index, e.token_id, e.text, e.finish_reason) for e in got] == \
        [(e.index, e.token_id, e.text, e.finish_reason) for e in expected]
    sub, got = asyncio.run(consume(limit=3))
    assert sub.cancelled and len(got) >= 3
    assert sched.wait_idle(10) and sched.stats()["finished"].get(CANCELLED, 0) == 2


def test_chunked_prefill_keeps_running_streams_going_and_gives_the_same_tokens(model, make_scheduler, monkeypatch):
    """Paged engine, a budget of 8 tokens a step: a 70-token prompt is computed a chunk per step while a running
    sequence draws a token at every one of those steps; each sequence's greedy tokens equal its prompt's alone
    (one-shot prefill), and the prompt took about 70 / (8 - 1) prefill forwards."""
    sched = make_scheduler(max_batch=3, max_num_batched_tokens=8)
    order = []
    advance = sched._advance

    def logged(seq, tok):
        order.append((seq.prompt[0], sched.steps))
        return advance(seq, tok)

    monkeypatch.setattr(sched, "_advance", logged)
    short = ([1, 2, 3], greedy(max_new_tokens=30))
    long = ([(9 * j + 4) % 250 for j in range(70)], greedy(max_new_tokens=4))
    first = sched.submit([short[0]], short[1])
    wait_until(lambda: len(order) >= 2)
    with sched.paused():
        second = sched.submit([long[0]], long[1])
        mark = len(order)
    assert tokens_of(list(first.events())) == [reference(model, *short)]
    assert tokens_of(list(second.events())) == [reference(model, *long)]
    start = next(i for i, (who, _) in enumerate(order) if who == long[0][0])
    during = [step for who, step in order[mark:start] if who == short[0][0]]
    # while the long prompt was being computed (>= 10 chunks of at most 7 tokens), the short one drew every step
    assert sched.prefill_chunks >= 70 // 7 and len(during) >= 9
    assert during == list(range(during[0], during[0] + len(during)))


def test_a_shared_prefix_through_the_scheduler_is_computed_once(model, make_scheduler):
    """Paged engine: three sequences with a 40-token common prefix, one after the other: the later ones take its
    two full blocks from the cache (cached_tokens on their final event) and generate what they generate alone."""
    sched = make_scheduler(max_batch=2)
    system = [(5 * j + 1) % 250 for j in range(40)]
    jobs = [(system + [7 + i, 9], greedy(max_new_tokens=5)) for i in range(3)]
    cached = []
    for prompt, params in jobs:
        events = sched.generate([prompt], params)
        assert tokens_of(events) == [reference(model, prompt, params)]
        cached.append(events[-1].cached_tokens)
    assert cached == [0, 32, 32]
    stats = sched.stats()
    assert stats["prefix_cache_hits"] == 64 and stats["kv_blocks_in_use"] == 0


def test_prompt_lookup_speculative_decoding_gives_the_plain_greedy_tokens(model, make_scheduler):
    """Paged engine with prompt-lookup drafts of up to 4 tokens: greedy sequences (with a stop token mid-way)
    give exactly the tokens of plain greedy decoding, a seeded sampled sequence beside them its tokens without
    speculation. On the random tiny model drafts are found but mostly rejected (the rollback path); on a copy whose
    attention output is zeroed (a Markov chain over tokens: its greedy text cycles) most are accepted."""
    markov = build_model(tiny_model_config(initializer_range=0.3), seed=0).eval()
    with torch.no_grad():
        for block in markov.layers:
            block.self_attn.o_proj.weight.zero_()
    for m in (model, markov):
        gen = Generator(m, ByteTokenizer())
        spec = Scheduler(gen, max_batch=4, speculative_ngram=4)
        plain = Scheduler(gen, max_batch=4)
        try:
            loop = [40, 41, 42, 43, 44] * 3
            free = gen.generate([loop], greedy(max_new_tokens=24))[0]
            jobs = [(loop, greedy(max_new_tokens=24)),
                    ([(3 * j) % 50 + 60 for j in range(30)], greedy(max_new_tokens=20)),
                    ([1, 2, 3], SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=[free.token_ids[9]])),
                    ([7, 8, 9, 7, 8, 9], SamplingParams(max_new_tokens=16, temperature=0.8, seed=3,
                                                        stop_token_ids=[]))]
            got, want = run_all(spec, jobs), run_all(plain, jobs)
            for (prompt, params), g, w in zip(jobs, got, want):
                assert tokens_of(g) == tokens_of(w)
                assert "".join(e.text for e in g) == "".join(e.text for e in w)
                assert g[-1].finish_reason == w[-1].finish_reason
                if params.temperature == 0:
                    assert tokens_of(g) == [gen.generate([prompt], params)[0].token_ids]
            stats = spec.stats()
            assert stats["spec_drafted"] > 0 and stats["kv_blocks_in_use"] == 0
            if m is markov:
                assert stats["spec_accepted"] > stats["spec_drafted"] // 2
                assert stats["steps"] < plain.stats()["steps"]   # the sampled row (16 tokens) bounds it
        finally:
            spec.stop()
            plain.stop()


def test_a_small_kv_pool_makes_sequences_wait_and_cancelling_a_prefill_frees_its_blocks(model, make_scheduler):
    """Paged engine with 6 blocks of 16 tokens: a sequence is admitted only when its prompt and budget fit next to
    the running ones' (so three 40-token sequences run one or two at a time, each with its tokens alone); one that
    can never fit is refused at once; a request cancelled while its prompt is computed in chunks gives its blocks
    back."""
    sched = make_scheduler(max_batch=3, kv_blocks=1 + 6, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="KV cache"):
        sched.submit([[1] * 90], greedy(max_new_tokens=8))
    per_step = {}
    advance = sched._advance

    def logged(seq, tok):
        per_step.setdefault(sched.steps, set()).add(seq.prompt[0])
        return advance(seq, tok)

    sched._advance = logged
    jobs = [([(11 * i + j) % 250 for j in range(30)], greedy(max_new_tokens=10)) for i in range(3)]
    for (prompt, params), events in zip(jobs, run_all(sched, jobs)):
        assert tokens_of(events) == [reference(model, prompt, params)]
    assert max(len(v) for v in per_step.values()) == 2   # 3 blocks each (40 tokens): two fit in 6 blocks
    with sched.paused():
        sub = sched.submit([[(3 * j) % 250 for j in range(60)]], greedy(max_new_tokens=4))
    wait_until(lambda: sched.prefill_chunks > 0 and sched.stats()["kv_blocks_in_use"] > 0)
    sub.cancel()
    assert [e.finish_reason for e in sub.events()][-1] == CANCELLED
    wait_until(lambda: sched.stats()["kv_blocks_in_use"] == 0 and sched.stats()["running"] == 0)


def test_a_graph_capture_that_fails_warns_and_leaves_no_graphs_when_asked():
    """capture_graphs with a fallback: a step that cannot be captured gives a warning naming what was captured,
    why it failed and what runs instead, and no graphs (the caller then runs eagerly); without one it raises."""
    from zero2all.infer.generate import capture_graphs

    def run(key):
        raise RuntimeError(f"step {key} cannot be captured")

    with pytest.warns(UserWarning, match=r"decode: prefill: CUDA graph capture failed \(RuntimeError: .*\); "
                                         r"prefilling eagerly"):
        assert capture_graphs([32, 64], run, fallback=("decode: prefill", "prefilling eagerly")) == ({}, {})
    with pytest.raises(Exception):
        capture_graphs([32], run)
