import pytest
import torch
from standin_tokenizer import ByteTokenizer, tiny_model_config

from zero2all.infer.generate import (
    DecodeSession,
    Generator,
    SamplingParams,
    _RowText,
    apply_repetition_penalty,
    filter_top_k_top_p,
)
from zero2all.model.z2all import build_model

PROMPTS = [[5, 9, 200], list(range(30, 47)), [7], [100, 101, 102, 103, 104, 105, 106, 107, 108]]


@pytest.fixture(scope="module")
def model():
    # a large init std gives peaked logits, so greedy choices are not decided by rounding
    return build_model(tiny_model_config(initializer_range=0.3), seed=0).eval()


def greedy_full_recompute(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        logits, _ = model(torch.tensor([seq], device=model.embed_tokens.weight.device))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("window", [8, 256])
def test_greedy_with_cache_equals_full_recompute(model, window):
    gen = Generator(model, attention_window=window)
    outs = gen.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[]))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_full_recompute(model, prompt, 12)
        assert out.finish_reason == "length" and out.num_generated == 12


@torch.no_grad()
@pytest.mark.parametrize("window", [16, 256])
def test_session_logits_equal_full_forward(model, window):
    session = DecodeSession(model, batch_size=len(PROMPTS), max_len=64, cuda_graph=False, window=window)
    assert session.windows == ([16, 32, 48, 64] if window == 16 else [64])
    logits = session.prefill(PROMPTS, pad_id=3)
    seqs = [list(p) for p in PROMPTS]
    P = max(len(p) for p in PROMPTS)
    for step in range(20):  # slots 17..36: crosses from the 32- to the 48-slot window at step 16
        for r, seq in enumerate(seqs):
            if step in (0, 1, 15, 16, 17, 19):
                ref, _ = model(torch.tensor([seq]))
                torch.testing.assert_close(logits[r], ref[0, -1], atol=1e-4, rtol=1e-4)
        nxt = torch.tensor([(17 * step + 31 * r) % 256 for r in range(len(seqs))])
        for r, seq in enumerate(seqs):
            seq.append(int(nxt[r]))
        logits = session.decode(nxt, P + step)


def test_chunked_prefill_equals_one_chunk(model, monkeypatch):
    import zero2all.infer.generate as g

    whole = DecodeSession(model, 4, 64, cuda_graph=False).prefill(PROMPTS, 0)
    monkeypatch.setattr(g, "prefill_chunk_len", lambda b, v: 4)
    chunked = DecodeSession(model, 4, 64, cuda_graph=False).prefill(PROMPTS, 0)
    torch.testing.assert_close(whole, chunked, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    gen = Generator(model)
    p = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.95, stop_token_ids=[])
    a = gen.generate(PROMPTS[:2], p, seed=123)
    b = gen.generate(PROMPTS[:2], p, seed=123)
    c = gen.generate(PROMPTS[:2], p, seed=124)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_top_k_one_is_greedy(model):
    gen = Generator(model)
    greedy = gen.generate(PROMPTS, max_new_tokens=8, temperature=0, stop_token_ids=[])
    top1 = gen.generate(PROMPTS, max_new_tokens=8, temperature=0.7, top_k=1, seed=5, stop_token_ids=[])
    assert [x.token_ids for x in greedy] == [x.token_ids for x in top1]


def test_stop_token_ends_row_and_is_excluded(model):
    gen = Generator(model)
    free = gen.generate([PROMPTS[1]], max_new_tokens=10, temperature=0, stop_token_ids=[])[0].token_ids
    stop = free[4]
    out = gen.generate([PROMPTS[1]], max_new_tokens=10, temperature=0, stop_token_ids=[stop])[0]
    assert out.token_ids == free[:free.index(stop)]
    assert out.finish_reason == "stop" and out.num_generated == free.index(stop) + 1


def test_top_p_and_top_k_filter_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda out: (out > float("-inf")).tolist()[0]  # noqa: E731
    assert kept(filter_top_k_top_p(logits, top_p=0.8)) == [True, True, False, False]
    assert kept(filter_top_k_top_p(logits, top_p=0.81)) == [True, True, True, False]
    assert kept(filter_top_k_top_p(logits, top_p=0.1)) == [True, False, False, False]
    assert kept(filter_top_k_top_p(logits[:, [3, 1, 0, 2]], top_k=2)) == [False, True, True, False]


def test_repetition_penalty_by_hand():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -4.0, 1.0]]


def test_repetition_penalty_changes_greedy_output(model):
    gen = Generator(model)
    plain = gen.generate([[1, 2, 3]], max_new_tokens=20, temperature=0, stop_token_ids=[])[0].token_ids
    pen = gen.generate([[1, 2, 3]], max_new_tokens=20, temperature=0, stop_token_ids=[],
                       repetition_penalty=1e6)[0].token_ids
    assert len(set(pen)) == len(pen) and not set(pen) & {1, 2, 3}  # a huge penalty forbids any repeat
    assert len(set(plain)) < len(plain) or plain != pen


def test_stop_strings_and_multibyte_streaming():
    tok = ByteTokenizer()
    row = _RowText(tok, ["STOP"])
    pieces = []
    for t in tok.encode("héllo STand STOP world"):
        piece, hit = row.add(t)
        pieces.append(piece)
        if hit:
            break
    assert hit and "".join(pieces) == "héllo STand "
    assert "\ufffd" not in "".join(pieces)
    # 'ST' is held back until it is clear that it does not start "STOP"
    n = len("héllo ST".encode())
    assert pieces[n - 2] == pieces[n - 1] == "" and pieces[n] == "STa"
    assert pieces[1] == "" and pieces[2] == "é"  # the first byte of 'é' alone is not shown


def test_stream_events_match_generate_with_text(model):
    tok = ByteTokenizer()
    gen = Generator(model, tok)
    prompts = ["hi", "a longer prompt"]
    events = list(gen.stream(prompts, max_new_tokens=9, temperature=0, stop_token_ids=[]))
    outs = gen.generate(prompts, max_new_tokens=9, temperature=0, stop_token_ids=[])
    for i, out in enumerate(outs):
        mine = [e for e in events if e.index == i]
        assert "".join(e.text for e in mine) == out.text == tok.decode(out.token_ids, skip_special=True)
        assert [e.finish_reason for e in mine].count("length") == 1 and mine[-1].finish_reason == "length"


def test_generation_validates_inputs(model):
    gen = Generator(model)
    with pytest.raises(ValueError, match="exceed"):
        gen.generate([[1] * 120], max_new_tokens=20)
    with pytest.raises(ValueError, match="empty"):
        gen.generate([[]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        gen.generate([[1]], max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="tokenizer"):
        gen.generate(["text"], max_new_tokens=2)


@pytest.fixture(scope="module")
def real_ckpt(tmp_path_factory):
    """A tiny model with a real (trained) tokenizer attached, as the trainer writes checkpoints."""
    from zero2all.model.io import save_model
    from zero2all.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("real")
    corpus = d / "corpus.txt"
    corpus.write_text(open(__file__).read())
    tok = train_tokenizer([str(corpus)], vocab_size=400, out_dir=d / "tok")
    model = build_model(tiny_model_config(vocab_size=tok.vocab_size, initializer_range=0.3), seed=0)
    save_model(model, d / "ckpt", tokenizer_dir=d / "tok")
    return d / "ckpt"


def test_cli_generate_streams_the_greedy_continuation(real_ckpt, capsys):
    from zero2all.cli import main
    from zero2all.infer.generate import load_for_inference

    # on CPU in float32, so that the expectation below (computed the same way) is exact on any machine
    assert main(["generate", "--ckpt", str(real_ckpt), "--prompt", "def greedy", "--max-new-tokens", "7",
                 "--temperature", "0", "--device", "cpu", "--dtype", "float32"]) in (0, None)
    out = capsys.readouterr()
    model, tok = load_for_inference(str(real_ckpt), device="cpu")
    expected = Generator(model, tok).generate([[tok.eos_id] + tok.encode("def greedy")], max_new_tokens=7,
                                              temperature=0)[0]
    assert out.out == "def greedy" + expected.text + "\n"
    assert f"{expected.num_generated} tokens in" in out.err
    assert main(["generate", "--ckpt", str(real_ckpt), "--prompt", "x", "--max-new-tokens", "500"]) == 2
    assert "exceed the model's context" in capsys.readouterr().err


def test_chat_loop_keeps_history_and_handles_commands(model):
    from zero2all.infer.chat import ChatSession, chat_loop

    session = ChatSession(Generator(model, ByteTokenizer()), system="be brief",
                          params=SamplingParams(max_new_tokens=5, temperature=0))
    lines = iter(["hello", "again", "/reset", "/system you are terse", "hi", "/bogus", "/exit", "never read"])
    written = []
    assert chat_loop(session, read=lambda _: next(lines), write=written.append) == 3
    assert [t["role"] for t in session.turns] == ["user", "assistant"] and session.turns[0]["content"] == "hi"
    assert session.system == "you are terse"
    text = "".join(written)
    assert "(conversation cleared)" in text and "unknown command /bogus" in text
    # a second turn's prompt holds the first turn: the history is in the template
    s2 = ChatSession(Generator(model, ByteTokenizer()), params=SamplingParams(max_new_tokens=4, temperature=0))
    answer, _ = s2.reply("one")
    ids, dropped = s2.prompt_ids("two")
    assert dropped == 0 and ids == ByteTokenizer().apply_chat_template(
        [{"role": "user", "content": "one"}, {"role": "assistant", "content": answer},
         {"role": "user", "content": "two"}], add_generation_prompt=True)
    # a long history is cut from the oldest turn to fit the context (128 tokens, 4 for the reply)
    for i in range(6):
        s2.reply("x" * 20)
    ids, dropped = s2.prompt_ids("last")
    assert dropped > 0 and len(ids) <= 124
    # a reply budget as large as the context (the CLI's 256 on a small model) still leaves room for the prompt,
    # and the reply is cut to what the prompt leaves free
    ctx = model.cfg.max_seq_len
    s3 = ChatSession(Generator(model, ByteTokenizer()), params=SamplingParams(max_new_tokens=2 * ctx, temperature=0,
                                                                            stop_token_ids=[]))
    budgets, stream = [], s3.generator.stream
    s3.generator.stream = lambda ids, params: (budgets.append(params.max_new_tokens), stream(ids, params))[1]
    answer, _ = s3.reply("hello")
    prompt = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert answer and budgets == [ctx - len(prompt)]
    with pytest.raises(ValueError, match="reply budget of"):
        s3.reply("y" * ctx)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_per_row_rope_positions(impl):
    """Per-row position tables (B, T, d/2) rotate each row by its own positions, in both implementations."""
    pytest.importorskip("triton") if impl == "triton" else None
    from zero2all.model import ops

    g = torch.Generator().manual_seed(0)
    B, T, H, Hkv, D = 3, 5, 4, 2, 6
    # the Triton path runs on the GPU when there is one, else on CPU under TRITON_INTERPRET=1
    device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g).to(device)
    q = qkv[..., :H * D].view(B, T, H, D)                       # strided views, as in the model
    k = qkv[..., H * D:(H + Hkv) * D].view(B, T, Hkv, D)
    positions = torch.randint(0, 50, (B, T), generator=g).to(device)
    cos, sin = ops.rope_frequencies(D, 10000.0, positions.reshape(-1))
    q_out, k_out = ops.apply_rope(q, k, cos.view(B, T, -1), sin.view(B, T, -1), impl=impl)
    for b in range(B):
        c, s = ops.rope_frequencies(D, 10000.0, positions[b])
        q_ref, k_ref = ops.apply_rope_torch(q[b:b + 1], k[b:b + 1], c, s)
        torch.testing.assert_close(q_out[b:b + 1], q_ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(k_out[b:b + 1], k_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T, Tk, n_kv", [(1, 13, 2), (5, 9, 2), (6, 6, 1), (4, 7, 4)])
def test_masked_grouped_attention_equals_naive(T, Tk, n_kv):
    """An explicit mask with grouped-query heads (the generation path) matches the naive reference."""
    from zero2all.model import ops

    g = torch.Generator().manual_seed(T * 100 + Tk)
    B, H, D = 3, 4, 8
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)        # strided, as in the model
    k = torch.randn(B, n_kv, Tk, D, generator=g)
    v = torch.randn(B, n_kv, Tk, D, generator=g)
    mask = torch.rand(B, 1, T, Tk, generator=g) > 0.4
    mask[..., 0] = True                                              # every query sees a key
    out = ops.attention(q, k, v, impl="sdpa", mask=mask)
    torch.testing.assert_close(out, ops.attention_naive(q, k, v, mask), atol=1e-5, rtol=1e-5)
    if T == 1:  # a mask broadcast over the queries, as in a decode step
        out = ops.attention(q, k, v, impl="sdpa", mask=mask[:, :, :1])
        torch.testing.assert_close(out, ops.attention_naive(q, k, v, mask[:, :, :1]), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("ops_kind", ["plain", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager_and_recompute(ops_kind, dtype):
    from zero2all.config import OpsConfig

    ops_cfg = OpsConfig.plain() if ops_kind == "plain" else OpsConfig()
    model = build_model(tiny_model_config(initializer_range=0.3, ops=ops_cfg), device="cuda", seed=0)
    model = model.to(dtype).eval()
    params = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[])
    eager = Generator(model, cuda_graph=False, attention_window=16, fused=False).generate(PROMPTS, params)
    graphed_gen = Generator(model, cuda_graph=True, attention_window=16, fused=False)  # several windows, graphs
    graphed = graphed_gen.generate(PROMPTS, params)
    assert all(len(s.graphs) == len(s.windows) > 1 for s in graphed_gen._sessions.values())
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    if dtype == torch.float32:
        for prompt, out in zip(PROMPTS, graphed):
            assert out.token_ids == greedy_full_recompute(model, prompt, 20)
    # sampling on the GPU is seedable too
    a = graphed_gen.generate(PROMPTS, params, temperature=1.0, seed=3)
    b = graphed_gen.generate(PROMPTS, params, temperature=1.0, seed=3)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cuda_graph_decode(dtype):
    """On CUDA the Generator decodes with the fused kernels by default, one graph for every slot: greedy tokens
    equal full recomputation (float32) and the same fused step run eagerly (both dtypes)."""
    cfg = tiny_model_config(initializer_range=0.3, hidden_dim=128)   # head_dim 32: the fused step's smallest
    model = build_model(cfg, device="cuda", seed=0).to(dtype).eval()
    params = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[])
    gen = Generator(model)
    graphed = gen.generate(PROMPTS, params)
    session = next(iter(gen._sessions.values()))
    assert session.fused is not None and len(session.graphs) == 1
    eager = Generator(model, cuda_graph=False, fused=True).generate(PROMPTS, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    if dtype == torch.float32:  # batch 1 (the embedding row read inside the first product) as well
        one = Generator(model).generate(PROMPTS[1:2], params)
        assert one[0].token_ids == greedy_full_recompute(model, PROMPTS[1], 20)
    if dtype == torch.float32:
        for prompt, out in zip(PROMPTS, graphed):
            assert out.token_ids == greedy_full_recompute(model, prompt, 20)
    assert Generator(model, fused=False).use_fused(4) is False
    with pytest.raises(ValueError, match="batch 17"):
        Generator(model, fused=True).use_fused(17)


@pytest.mark.gpu
@pytest.mark.slow
def test_compiled_cuda_graph_decode_matches_eager():
    model = build_model(tiny_model_config(initializer_range=0.3), device="cuda", seed=0).eval()
    params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[])
    eager = Generator(model, cuda_graph=False).generate(PROMPTS, params)
    compiled = Generator(model, cuda_graph=True, compile=True).generate(PROMPTS, params)
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]


@pytest.mark.slow
def test_decode_benchmark_runs_on_cpu(tmp_path, capsys):
    """The decode benchmark's CPU smoke run: our generator and HF generate on the same exported weights."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "decode.json"
    assert bench.main(["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "8",
                       "--new-tokens", "4", "--batch-sizes", "2", "--repeats", "1",
                       "--variants", "ours-eager,hf-dynamic", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == ["ours-eager", "hf-dynamic"]
    assert all(r["new_tok_per_s"] > 0 and r["batch"] == 2 for r in rows)
    assert "| ours-eager | 2 |" in capsys.readouterr().out


def test_cli_generate_chat_renders_the_template(real_ckpt, capsys):
    from zero2all.cli import main
    from zero2all.infer.generate import load_for_inference

    assert main(["generate", "--ckpt", str(real_ckpt), "--chat", "--system", "Be brief.", "--prompt", "hello",
                 "--max-new-tokens", "5", "--temperature", "0"]) in (0, None)
    out = capsys.readouterr()
    model, tok = load_for_inference(str(real_ckpt), device="cpu")
    ids = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
                                  add_generation_prompt=True)
    expected = Generator(model, tok).generate([ids], max_new_tokens=5, temperature=0)[0]
    assert out.out == expected.text + "\n"


def test_two_pass_argmax_equals_argmax_including_ties():
    from zero2all.infer.generate import argmax_rows

    g = torch.Generator().manual_seed(0)
    for V in (64320, 16384, 300):
        x = torch.randn(5, V, generator=g).bfloat16().float()   # bf16 values: many exact ties
        x[1, 7] = x[1, V - 3] = 50.0                              # a tie across slices: the first one wins
        x[2] = 0.0                                                # all equal: index 0
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        assert argmax_rows(x)[1] == 7 and argmax_rows(x)[2] == 0


def test_chat_ctrl_c_stops_the_reply_and_keeps_the_session(model):
    """Ctrl-C during a reply stops it; the user's message and the part shown stay in the history, a note says so,
    the loop goes on (the next reply is generated from that history); Ctrl-C or Ctrl-D at the prompt leave."""
    from zero2all.infer.chat import ChatSession, chat_loop

    params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[])
    session = ChatSession(Generator(model, ByteTokenizer()), params=params)
    written, state = [], {"after": None}

    def write(s):
        if s == "assistant> " and state["after"] is None:
            state["after"] = 0                       # the first reply starts: interrupt its third piece
        elif state["after"] is not None and state["after"] >= 0:
            state["after"] += 1
            if state["after"] == 3:
                state["after"] = -1                  # once
                raise KeyboardInterrupt
        written.append(s)

    lines = iter(["hello", "again"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise KeyboardInterrupt from None       # Ctrl-C at the prompt: leave

    assert chat_loop(session, read=read, write=write) == 1  # the interrupted reply does not count
    text = "".join(written)
    assert "(reply interrupted" in text
    turns = session.turns
    assert [t["role"] for t in turns] == ["user", "assistant"] * 2 and turns[0]["content"] == "hello"
    shown = text.split("assistant> ")[1].split("\n(reply interrupted")[0]
    assert turns[1]["content"] == shown and shown  # exactly the two pieces shown before the interrupt
    full, _ = ChatSession(Generator(model, ByteTokenizer()), params=params).reply("hello")
    assert full.startswith(shown) and len(shown) < len(full)
    # the second reply continues from the kept history
    ref = ChatSession(Generator(model, ByteTokenizer()), params=params)
    ref.turns = turns[:2]
    assert turns[3]["content"] == ref.reply("again")[0]
    # Ctrl-D at the prompt leaves as well
    def eof(prompt):
        raise EOFError

    assert chat_loop(session, read=eof, write=lambda s: None) == 0


def test_cli_chat_leaves_cleanly_on_ctrl_c(real_ckpt, monkeypatch):
    from zero2all.cli import main

    def interrupted(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupted)
    assert main(["chat", "--ckpt", str(real_ckpt), "--device", "cpu"]) in (0, None)


@pytest.mark.parametrize("by_bytes", [True, False])
def test_row_text_windowed_decoding_equals_the_full_decode(real_ckpt, monkeypatch, by_bytes):
    """The row text decodes only its last tokens each step, or, for a tokenizer whose decoding concatenates bytes
    (a trained byte-level BPE), a token's bytes at a time through an incremental UTF-8 decoder; over long rows of
    random ids (broken multi-byte sequences, special tokens, ids past the vocabulary's pieces) its text equals
    decoding all the ids at once, for the byte stand-in and for a trained BPE tokenizer (both ways), with stop
    strings that cut the text."""
    from zero2all.tokenizer import load_tokenizer

    bpe = load_tokenizer(real_ckpt)
    assert bpe.byte_decoding() is not None
    if not by_bytes:
        monkeypatch.setattr(type(bpe), "byte_decoding", lambda self: None)
    g = torch.Generator().manual_seed(0)
    for tok in (ByteTokenizer(), bpe):
        for trial in range(4):
            ids = torch.randint(0, tok.vocab_size, (300,), generator=g).tolist()
            if trial >= 2:  # mostly plain text, as a model writes it
                ids = tok.encode(open(__file__).read()[:3000])[:300]
            full = tok.decode(ids, skip_special=True)
            stop = [full[200:204]] if trial == 3 else []
            row = _RowText(tok, stop)
            pieces = []
            for i in ids:
                piece, hit = row.add(i)
                pieces.append(piece)
                if hit:
                    break
            if not row.hit:
                pieces.append(row.finish())
            assert "".join(pieces) == (full[:full.find(stop[0])] if stop else full)
            assert (row._bytes is not None) == (by_bytes and tok is bpe)
            assert row.cut > 0 or row._bytes is not None or stop  # the window really moved
    # a row that ends inside a character: its first bytes come out as the full decode's replacement character
    table = bpe.token_bytes()
    lead = table.index(b"\xe2")                     # the first of the three bytes of e.g. "\u20ac"
    ids = bpe.encode("price: 5 ") + [lead]
    row = _RowText(bpe, [])
    text = "".join(row.add(i)[0] for i in ids)
    assert not text.endswith("\ufffd")               # held back while more bytes may come
    assert text + row.finish() == bpe.decode(ids, skip_special=True) and bpe.decode(ids).endswith("\ufffd")
