"""Draft-model speculative decoding (zero2all/infer/speculative.py through the paged scheduler): greedy tokens equal
plain decoding whatever the draft; the draft's own cache follows the target's (acceptance counts equal those of a
cache-free reference); refusals of drafts that cannot work; the acceptance rate in stats and /metrics."""

import copy

import pytest
import torch
from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.infer.generate import Generator, SamplingParams
from zero2all.infer.scheduler import Scheduler
from zero2all.model.io import save_model
from zero2all.model.z2all import build_model


@pytest.fixture(scope="module")
def model():
    # a large init std gives peaked logits, so greedy choices are not decided by rounding
    return build_model(tiny_model_config(initializer_range=0.3), seed=0).eval()


@pytest.fixture(scope="module")
def near_draft(model):
    """The target with small noise on every weight: it agrees with the target on some tokens, not all (about a
    quarter of its drafts are accepted), so steps see all drafts kept, some, and none."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return draft


def greedy(m, **kw):
    return SamplingParams(temperature=0, stop_token_ids=[], max_new_tokens=m, **kw)


def tokens_of(events):
    return [ev.token_id for ev in events if ev.token_id >= 0 and not ev.stop_token]


def run(sched, jobs):
    subs = [sched.submit([p], params) for p, params in jobs]
    return [list(sub.events()) for sub in subs]


def scheduler(model, **kw):
    return Scheduler(Generator(model, ByteTokenizer()), **kw)


def reference_counts(target, draft, prompt, k_max, m):
    """(drafted, accepted) of speculative greedy decoding of one sequence computed without any cache: every draft
    token from the draft's full forward over the whole text so far, every check from the target's."""
    def argmax_last(net, toks):
        with torch.no_grad():
            return net(torch.tensor([toks]))[0][0].argmax(-1).tolist()

    toks, drawn, drafted, accepted = list(prompt), 0, 0, 0
    nxt = argmax_last(target, toks)[-1]
    while True:
        toks.append(nxt)
        drawn += 1
        k = min(k_max, m - drawn - 1)
        if k <= 0:
            if drawn >= m:
                return drafted, accepted
            nxt = argmax_last(target, toks)[-1]
            continue
        draft_toks = []
        for _ in range(k):
            draft_toks.append(argmax_last(draft, toks + draft_toks)[-1])
        checks = argmax_last(target, toks + draft_toks)[len(toks) - 1:]
        a = 0
        while a < k and checks[a] == draft_toks[a]:
            a += 1
        drafted, accepted = drafted + k, accepted + a
        toks += draft_toks[:a]
        drawn += a
        nxt = checks[a]


def test_the_target_as_its_own_draft_accepts_every_draft(model):
    """Draft = target: every draft token is accepted (acceptance rate 1.0) and a step yields up to K + 1 tokens;
    the tokens are those of plain greedy decoding, rows joining and leaving as others finish."""
    sched = scheduler(model, max_batch=2, draft_model=model, speculative_tokens=4)
    try:
        jobs = [([(7 * i + 3 * j) % 250 for j in range(n)], greedy(m)) for i, (n, m) in enumerate([(3, 20), (17, 9),
                                                                                                  (30, 16)])]
        for (prompt, params), events in zip(jobs, run(sched, jobs)):
            assert tokens_of(events) == Generator(model).generate([prompt], params)[0].token_ids
        stats = sched.stats()
        assert stats["spec_method"] == "draft_model" and stats["spec_drafted"] > 30
        assert stats["spec_accepted"] == stats["spec_drafted"] and stats["spec_acceptance_rate"] == 1.0
        assert stats["steps"] <= 20 // 5 + 9 // 5 + 16 // 5 + 3   # K + 1 = 5 tokens a step, 2 rows at a time
        assert stats["kv_blocks_in_use"] == 0 and stats["draft_kv_blocks_in_use"] == 0
    finally:
        sched.stop()


@pytest.mark.parametrize("which", ["other", "near"])
def test_any_draft_gives_the_plain_greedy_tokens(model, near_draft, which):
    """A different random draft (smaller: one layer, half the width; its drafts are nearly all rejected) or a noisy
    copy (some accepted): greedy sequences give exactly the tokens of plain greedy decoding with three rows for
    nine sequences (rows join and leave mid-run), long prompts computed in chunks of 8 tokens, a 40-token prefix
    shared by three prompts (prefix-cache hits in both caches), a stop token mid-way; a sampled sequence beside
    them (speculative sampling: its distribution is tested below) runs to its length."""
    draft = near_draft if which == "near" else build_model(
        tiny_model_config(initializer_range=0.3, n_layers=1, hidden_dim=32, intermediate_size=48), seed=1).eval()
    spec = scheduler(model, max_batch=3, draft_model=draft, speculative_tokens=3, max_num_batched_tokens=8)
    plain = scheduler(model, max_batch=3, max_num_batched_tokens=8)
    gen = Generator(model, ByteTokenizer())
    try:
        shared = [(5 * j + 1) % 250 for j in range(40)]
        stop = gen.generate([[1, 2, 3]], greedy(24))[0].token_ids[9]
        jobs = [([(7 * i + 3 * j) % 250 for j in range(n)], greedy(m)) for i, (n, m) in enumerate([(3, 20), (17, 5),
                                                                                                  (50, 12), (9, 25)])]
        jobs += [(shared + [7 + i, 9], greedy(8 + 3 * i)) for i in range(3)]
        jobs += [([1, 2, 3], SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=[stop])),
                 ([7, 8, 9, 7, 8, 9], SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, stop_token_ids=[]))]
        got, want = run(spec, jobs), run(plain, jobs)
        for (prompt, params), g, w in zip(jobs, got, want):
            assert g[-1].finish_reason == w[-1].finish_reason
            if params.temperature == 0:
                assert tokens_of(g) == tokens_of(w) == gen.generate([prompt], params)[0].token_ids
            else:
                assert len(tokens_of(g)) == params.max_new_tokens
        assert got[7][-1].finish_reason == "stop"
        stats = spec.stats()
        assert stats["spec_drafted"] > 50 and stats["prefix_cache_hits"] > 0
        assert stats["draft_prefix_cache_hits"] > 0
        assert stats["kv_blocks_in_use"] == 0 and stats["draft_kv_blocks_in_use"] == 0
        if which == "near":
            assert 0.1 < stats["spec_acceptance_rate"] < 0.9
    finally:
        spec.stop()
        plain.stop()


def test_the_draft_cache_follows_the_target(model, near_draft):
    """One sequence with the noisy draft: the drafted and accepted counts equal those of a reference that
    recomputes every forward from the whole text (no cache), so the draft's cache held exactly the kept tokens
    after every rollback (a kept rejected token, or an accepted last draft token never fed, would change its
    proposals; the greedy text alone cannot tell)."""
    prompt, m, k = [(11 * j + 5) % 250 for j in range(21)], 28, 3
    sched = scheduler(model, max_batch=2, draft_model=near_draft, speculative_tokens=k)
    try:
        sched.generate([prompt], greedy(m))
        stats = sched.stats()
    finally:
        sched.stop()
    drafted, accepted = reference_counts(model, near_draft, prompt, k, m)
    assert 0 < accepted < drafted
    assert (stats["spec_drafted"], stats["spec_accepted"]) == (drafted, accepted)


def test_a_sequence_longer_than_the_drafts_context_decodes_without_drafts(model):
    """A draft of a shorter context (32 tokens; the same weights as the target): a sequence that may grow past it
    is not drafted for (and gives its plain tokens); a short one beside it is, with every draft accepted."""
    draft = build_model(tiny_model_config(initializer_range=0.3, max_seq_len=32), seed=0).eval()
    sched = scheduler(model, max_batch=2, draft_model=draft, speculative_tokens=3)
    try:
        long = [(3 * j + 2) % 250 for j in range(30)]
        plain = Generator(model)
        assert tokens_of(sched.generate([long], greedy(12))) == plain.generate([long], greedy(12))[0].token_ids
        assert sched.stats()["spec_drafted"] == 0
        short = [4, 5, 6]
        assert tokens_of(sched.generate([short], greedy(12))) == plain.generate([short], greedy(12))[0].token_ids
        stats = sched.stats()
        assert stats["spec_drafted"] > 0 and stats["spec_acceptance_rate"] == 1.0
    finally:
        sched.stop()


def test_draft_models_that_cannot_work_are_refused(model):
    other_vocab = build_model(tiny_model_config(vocab_size=320), seed=0).eval()
    gen = Generator(model, ByteTokenizer())
    with pytest.raises(ValueError, match="vocabulary has 320 ids"):
        Scheduler(gen, draft_model=other_vocab, speculative_tokens=2, start=False)
    with pytest.raises(ValueError, match="exclusive"):
        Scheduler(gen, draft_model=model, speculative_tokens=2, speculative_ngram=2, start=False)
    with pytest.raises(ValueError, match="paged engine"):
        Scheduler(gen, draft_model=model, speculative_tokens=2, engine="column", start=False)
    with pytest.raises(ValueError, match="speculative_tokens >= 1"):
        Scheduler(gen, draft_model=model, start=False)
    with pytest.raises(ValueError, match="needs a draft_model"):
        Scheduler(gen, speculative_tokens=2, start=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    cfg = dict(initializer_range=0.3, max_seq_len=96)
    target = save_model(build_model(tiny_model_config(**cfg), seed=0), root / "target",
                        extra={"tokenizer_hash": "a" * 64})
    draft = save_model(build_model(tiny_model_config(n_layers=1, **cfg), seed=1), root / "draft",
                       extra={"tokenizer_hash": "a" * 64})
    other_vocab = save_model(build_model(tiny_model_config(vocab_size=320, **cfg), seed=1), root / "vocab")
    other_tok = save_model(build_model(tiny_model_config(n_layers=1, **cfg), seed=1), root / "tok",
                           extra={"tokenizer_hash": "b" * 64})
    return root, target, draft, other_vocab, other_tok


@pytest.mark.parametrize("case, args, expected", [
    ("missing", ["--draft-model", "{root}/nothing-here"], "no such checkpoint directory"),
    ("vocab", ["--draft-model", "{root}/vocab"], "its vocabulary has 320 ids"),
    ("tokenizer", ["--draft-model", "{root}/tok"], "trained with tokenizer bbbbbbbbbbbbbbbb"),
    ("both", ["--draft-model", "{root}/draft", "--speculative-ngram", "3"], "exclusive"),
    ("tokens alone", ["--speculative-tokens", "3"], "--speculative-tokens needs --draft-model"),
    ("zero tokens", ["--draft-model", "{root}/draft", "--speculative-tokens", "0"], "must be >= 1"),
    ("column", ["--draft-model", "{root}/draft", "--engine", "column"], "--engine paged"),
])
def test_serve_refuses_a_draft_that_cannot_work_before_loading(checkpoints, monkeypatch, capsys, case, args,
                                                                expected):
    import zero2all.infer.generate as generate
    from zero2all.cli import main

    root, target = checkpoints[0], checkpoints[1]
    monkeypatch.setattr(generate, "load_for_inference", lambda *a, **k: pytest.fail("loaded a model"))
    args = [a.format(root=root) for a in args]
    assert main(["serve", "--ckpt", str(target), "--port", "0", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("z2all serve: error: ") and expected in err, err


def test_a_server_with_a_draft_model_reports_its_acceptance_rate(checkpoints):
    """``create_server(..., draft_model=DIR)`` (what ``z2all serve --draft-model DIR`` runs): greedy completions
    equal plain decoding, and /metrics gives the acceptance rate under the label method="draft_model"."""
    from zero2all.infer.server import create_server

    _, target, draft = checkpoints[:3]
    httpd, app = create_server(target, port=0, tokenizer=ByteTokenizer(), device="cpu", quiet=True,
                               draft_model=str(draft), engine_options={"speculative_tokens": 3})
    try:
        prompt = [5, 6, 7, 8]
        events = app.scheduler.generate([prompt], greedy(12))
        assert tokens_of(events) == Generator(app.generator.model).generate([prompt], greedy(12))[0].token_ids
        s = app.scheduler.stats()
        metrics = app.metrics.render(app)
        assert s["spec_drafted"] > 0
        assert f'z2all_spec_draft_tokens_total{{method="draft_model"}} {s["spec_drafted"]}' in metrics
        assert f'z2all_spec_acceptance_rate{{method="draft_model"}} {s["spec_acceptance_rate"]:.4f}' in metrics
    finally:
        httpd.server_close()
        app.close()


def chi_square(counts: dict, probs: dict) -> float:
    n = sum(counts.values())
    assert set(counts) <= set(probs)
    return sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in probs.items())


def test_speculative_sampling_emits_the_targets_distribution():
    """accept_sampled with a draft distribution q far from the target's p (and drafts outside p's support): with p
    the same at every position, every emitted token (kept drafts, then the replacement or a token drawn from p)
    must be an independent draw from p. 3,000 pairs of consecutive tokens over the 4 ids of p's support (a token
    outside it fails at once), chi-square with 15 degrees of freedom: 37.7 is its 0.1 % tail."""
    import random

    from zero2all.infer.speculative import accept_sampled, draw

    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.1, 0.3, 0.3], dtype=torch.float64)
    rng = random.Random(0)
    out = []
    while len(out) < 6000:
        draft = [int(draw(q[None], [rng.random()])[0]) for _ in range(3)]
        a, replacement = accept_sampled(p.expand(3, 5), q.expand(3, 5), draft, rng)
        out += draft[:a] + [replacement if replacement is not None else int(draw(p[None], [rng.random()])[0])]
    pairs = {}
    for x, y in zip(out[0::2], out[1::2]):
        pairs[(x, y)] = pairs.get((x, y), 0) + 1
    expected = {(x, y): float(p[x] * p[y]) for x in range(4) for y in range(4)}
    assert chi_square(pairs, expected) < 37.7


def test_sampled_rows_through_the_scheduler_follow_the_models_distribution(model, near_draft):
    """Sampled rows (temperature 0.7, top-k 2) with the noisy draft model and 2 draft tokens a step: the first
    four tokens of 480 sequences from one prompt (the first drawn as usual, the next ones through speculative
    sampling: kept drafts, replacements, and the token after all-kept drafts) against the exact probabilities of
    plain sampling, computed from the model in float64 (16 outcomes; chi-square with 15 degrees of freedom: 37.7
    is its 0.1 % tail)."""
    prompt, params = [4, 5, 6], SamplingParams(max_new_tokens=4, temperature=0.7, top_k=2, stop_token_ids=[])
    exact, f64 = {}, copy.deepcopy(model).double()

    def expand(prefix, prob):
        if len(prefix) == len(prompt) + 4:
            exact[tuple(prefix[len(prompt):])] = prob
            return
        with torch.no_grad():
            logits = f64(torch.tensor([prefix]))[0][0, -1] / params.temperature
        top = torch.topk(logits, 2)
        for tok, pr in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
            expand(prefix + [tok], prob * pr)

    expand(prompt, 1.0)
    sched = scheduler(model, max_batch=16, max_queue=1024, draft_model=near_draft, speculative_tokens=2)
    try:
        subs = [sched.submit([prompt] * 16, SamplingParams(**{**params.__dict__, "seed": 16 * i})) for i in range(30)]
        counts = {}
        for sub in subs:
            per = {}
            for ev in sub.events():
                per.setdefault(ev.index, []).append(ev.token_id)
            for toks in per.values():
                counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
        stats = sched.stats()
    finally:
        sched.stop()
    assert 0.1 < stats["spec_acceptance_rate"] < 0.95
    assert chi_square(counts, exact) < 37.7


def test_generate_with_a_draft_model_prints_the_plain_greedy_text(checkpoints, monkeypatch, capsys):
    """``z2all generate --draft-model``: a batch of two greedy prompts prints what it prints without the draft, and
    the closing line gives the acceptance; the draft's refusals are the serve command's."""
    import zero2all.infer.generate as generate
    from zero2all.cli import main
    from zero2all.model.io import load_model

    root, target, draft = checkpoints[:3]
    monkeypatch.setattr(generate, "load_for_inference",
                        lambda ckpt, device="auto", dtype="auto", tokenizer=None: (load_model(ckpt),
                                                                                    tokenizer or ByteTokenizer()))
    base = ["generate", "--ckpt", str(target), "--prompt", "def f(x):", "--prompt", "import", "--temperature", "0",
            "--max-new-tokens", "12"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--draft-model", str(draft), "--speculative-tokens", "3"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "draft tokens accepted" in out.err
    assert main(base + ["--draft-model", str(root / "vocab")]) == 2
    assert "its vocabulary has 320 ids" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_draft_model_greedy_tokens_equal_plain_decoding(model, near_draft):
    """On the GPU (paged engine, graphed decode steps, the Triton paged kernel; verify forwards eager): greedy
    sequences with a draft model give the plain scheduler's tokens, rows joining and leaving, a shared prefix."""
    target, draft = copy.deepcopy(model).cuda(), copy.deepcopy(near_draft).cuda()
    spec = Scheduler(Generator(target, ByteTokenizer(), cuda_graph=True), max_batch=3, draft_model=draft,
                     speculative_tokens=3, max_num_batched_tokens=8)
    plain = Scheduler(Generator(target, ByteTokenizer(), cuda_graph=True), max_batch=3, max_num_batched_tokens=8)
    try:
        shared = [(5 * j + 1) % 250 for j in range(40)]
        jobs = [([(7 * i + 3 * j) % 250 for j in range(n)], greedy(m)) for i, (n, m) in enumerate([(3, 20), (17, 5),
                                                                                                  (50, 12), (9, 25)])]
        jobs += [(shared + [7 + i, 9], greedy(8 + 3 * i)) for i in range(3)]
        got, want = run(spec, jobs), run(plain, jobs)
        assert [tokens_of(g) for g in got] == [tokens_of(w) for w in want]
        assert all(len(tokens_of(w)) == params.max_new_tokens for (_, params), w in zip(jobs, want))
        stats = spec.stats()
        assert stats["spec_drafted"] > 20 and 0.0 < stats["spec_acceptance_rate"] < 1.0
        assert stats["kv_blocks_in_use"] == 0 and stats["draft_kv_blocks_in_use"] == 0
    finally:
        spec.stop()
        plain.stop()
