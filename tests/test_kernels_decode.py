"""Decode-step kernels (zero2all/kernels/decode.py) and the fused decode step against the plain PyTorch paths.

On CPU these run through the Triton interpreter (TRITON_INTERPRET=1, as CI does); on a GPU at real shapes.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from kernel_check import assert_close_to_reference
from standin_tokenizer import tiny_model_config

from zero2all.model import ops

pytestmark = [pytest.mark.any_device, pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or TRITON_INTERPRET=1")]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# the same casts give the same bits on a GPU; the CPU interpreter rounds float32 -> bfloat16 its own way (1 ulp)
EXACT_BF16 = dict(atol=0, rtol=0) if DEVICE == "cuda" else dict(atol=1e-2, rtol=8e-3)


def _kernels():
    from zero2all.kernels import decode

    return decode


def _reference_gemv(x, w, bias, prologue, residual, norm_w, eps, res_dtype):
    """What the model's plain path computes: (normed | swiglu | x) @ w.T (+ bias), and the new residual."""
    new_res = None
    if prologue == 1:
        normed, new_res = ops.add_rmsnorm_torch(x, residual, norm_w, eps, residual_in_fp32=res_dtype ==
                                                torch.float32)
        inp = normed
    elif prologue == 2:
        inp = ops.swiglu_torch(x)
    else:
        inp = x
    return F.linear(inp, w, bias), new_res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 37, 96), (1, 50, 33), (1, 19, 200), (3, 100, 100), (16, 64, 200),
                                   (5, 257, 33)])
@pytest.mark.parametrize("prologue", [0, 1, 2])
def test_fused_gemv_matches_reference(dtype, M, N, K, prologue):
    K_ = _kernels()
    g = torch.Generator().manual_seed(M * 1000 + N + K + prologue)
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    w = rnd(N, K).to(dtype) * 0.1
    x = rnd(M, 2 * K if prologue == 2 else K).to(dtype)
    bias = rnd(N).to(dtype) if N % 2 else None
    for residual_given in ([False, True] if prologue == 1 else [False]):
        res_dtype = torch.float32
        residual = rnd(M, K).to(res_dtype) if residual_given else None
        norm_w = (1 + 0.1 * rnd(K)).to(dtype)
        out = torch.empty(M, N, dtype=dtype, device=DEVICE)
        res_out = torch.empty(M, K, dtype=res_dtype, device=DEVICE) if prologue == 1 else None
        K_.fused_gemv(x, w, out, bias=bias, prologue=prologue, residual=residual, norm_weight=norm_w,
                      residual_out=res_out, eps=1e-5)
        ref, ref_res = _reference_gemv(x, w, bias, prologue, residual, norm_w, 1e-5, res_dtype)
        assert_close_to_reference(out, ref, dtype, **TOL[dtype], what=f"fused_gemv prologue {prologue}")
        if prologue == 1:
            assert res_out.dtype == ref_res.dtype
            assert_close_to_reference(res_out, ref_res, atol=0, rtol=0, what="residual out")


@pytest.mark.parametrize("tiles", [(8, 32, 4), (4, 64, 2), (2, 128, 4)])
@pytest.mark.parametrize("prologue", [0, 1, 2])
def test_one_row_kernel_with_given_tiles(tiles, prologue):
    """Every tile the tuner may pick gives the reference's results: K not a multiple of BLOCK_K, N not one of
    BLOCK_N, bias, and the residual written once."""
    K_ = _kernels()
    g = torch.Generator().manual_seed(sum(tiles) + prologue)
    N, K = 1001, 150
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEVICE)
    x = torch.randn(1, 2 * K if prologue == 2 else K, generator=g).to(DEVICE)
    bias = torch.randn(N, generator=g).to(DEVICE)
    residual = torch.randn(1, K, generator=g).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE)
    out = torch.full((1, N), float("nan"), device=DEVICE)
    res_out = torch.full((1, K), float("nan"), device=DEVICE) if prologue == 1 else None
    K_.fused_gemv(x, w, out, bias=bias, prologue=prologue, residual=residual if prologue == 1 else None,
                  norm_weight=norm_w, residual_out=res_out, tiles=tiles)
    ref, ref_res = _reference_gemv(x, w, bias, prologue, residual, norm_w, 1e-5, torch.float32)
    assert_close_to_reference(out, ref, torch.float32, **TOL[torch.float32], what=f"tiles {tiles}")
    if prologue == 1:
        assert res_out.dtype == ref_res.dtype
        assert_close_to_reference(res_out, ref_res, atol=0, rtol=0, what="residual out")


def test_fused_gemv_bf16_residual_stream_and_errors():
    K_ = _kernels()
    x = torch.randn(2, 48, device=DEVICE).bfloat16()
    residual = torch.randn(2, 48, device=DEVICE).bfloat16()
    w = (torch.randn(40, 48, device=DEVICE) * 0.1).bfloat16()
    norm_w = torch.rand(48, device=DEVICE).bfloat16()
    out = torch.empty(2, 40, device=DEVICE, dtype=torch.bfloat16)
    res_out = torch.empty_like(residual)
    K_.fused_gemv(x, w, out, prologue=1, residual=residual, norm_weight=norm_w, residual_out=res_out, eps=1e-6)
    normed, new_res = ops.add_rmsnorm_torch(x, residual, norm_w, 1e-6, residual_in_fp32=False)
    assert res_out.dtype == new_res.dtype
    assert_close_to_reference(res_out, new_res, **EXACT_BF16, what="bf16 residual out")
    assert_close_to_reference(out, F.linear(normed, w), torch.bfloat16, **TOL[torch.bfloat16], what="out")
    with pytest.raises(ValueError, match="must not be the residual"):
        K_.fused_gemv(x, w, out, prologue=1, residual=residual, norm_weight=norm_w, residual_out=residual)
    with pytest.raises(ValueError, match="at most 16 rows"):
        K_.fused_gemv(torch.zeros(17, 48, device=DEVICE), w, torch.zeros(17, 40, device=DEVICE))
    with pytest.raises(ValueError, match="do not fit"):
        K_.fused_gemv(x, w, torch.empty(2, 41, device=DEVICE, dtype=torch.bfloat16))


@pytest.mark.parametrize("M", [1, 3])
def test_fused_gemv_takes_strided_vectors(M):
    """The residual, the norm weight and the bias may be views (a transposed residual, columns of wider
    tensors): both products read them as laid out (read as if contiguous, each would take its neighbours'
    values). Vectors of the wrong length are refused before any kernel reads past them."""
    K_ = _kernels()
    g = torch.Generator().manual_seed(M)
    N, K = 37, 48
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEVICE)
    x = torch.randn(M, K, generator=g).to(DEVICE)
    residual = torch.randn(K, M + 1, generator=g).to(DEVICE).t()[:M]          # (M, K), strides (1, M + 1)
    norm_w = (1 + 0.1 * torch.randn(K, 3, generator=g)).to(DEVICE)[:, 1]    # stride 3
    bias = torch.randn(N, 2, generator=g).to(DEVICE)[:, 0]                  # stride 2
    assert residual.stride(-1) != 1 and norm_w.stride(0) == 3 and bias.stride(0) == 2
    out = torch.empty(M, N, device=DEVICE)
    res_out = torch.empty(M, K, device=DEVICE)
    K_.fused_gemv(x, w, out, bias=bias, prologue=1, residual=residual, norm_weight=norm_w, residual_out=res_out)
    ref, ref_res = _reference_gemv(x, w, bias, 1, residual, norm_w, 1e-5, torch.float32)
    assert_close_to_reference(out, ref, atol=2e-5, rtol=2e-5, what=f"fused_gemv, {M} rows")  # measured 4e-7
    assert_close_to_reference(res_out, ref_res, atol=0, rtol=0, what=f"residual out, {M} rows")
    for bad, match in ((dict(residual=residual[:, 1:]), "residual"), (dict(norm_weight=norm_w[1:]), "norm_weight"),
                       (dict(bias=bias[1:]), "bias")):
        kw = dict(bias=bias, residual=residual, norm_weight=norm_w, residual_out=res_out) | bad
        with pytest.raises(ValueError, match=match):
            K_.fused_gemv(x, w, out, prologue=1, **kw)


def _check_weight_past_int32_offsets(M, K, dtype, tiles=None):
    """fused_gemv over a weight of more than 2**31 elements (an LM head of a large vocabulary and hidden size):
    the last rows start past element 2**31 and must be read at their own offsets (int32 offsets would wrap to
    before the weight). Rows of small integers (exact in any dtype); every other row is zero."""
    K_ = _kernels()
    N = 2 ** 31 // K + 8
    w = torch.zeros(N, K, dtype=dtype, device=DEVICE)
    g = torch.Generator().manual_seed(M)
    rows = torch.tensor([0, 1, N - 9, N - 8, N - 1])
    vals = torch.randint(-3, 4, (len(rows), K), generator=g)
    w[rows.to(DEVICE)] = vals.to(DEVICE, dtype)
    x = torch.randint(-4, 5, (M, K), generator=g).to(DEVICE, torch.bfloat16) / 4     # exact in bfloat16
    out = torch.full((M, N), float("nan"), device=DEVICE)
    K_.fused_gemv(x, w, out, tiles=tiles)
    assert_close_to_reference(out[:, rows.to(DEVICE)], x.double() @ vals.to(DEVICE).double().t(), rel_l2=1e-5,
                              what=f"rows past 2**31 elements, {M} rows")   # measured 2e-7 on the CPU (int8)
    others = torch.ones(N, dtype=torch.bool, device=DEVICE)
    others[rows.to(DEVICE)] = False
    assert torch.equal(out[:, others], torch.zeros_like(out[:, others]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a 4 GiB weight; the interpreter takes minutes over it")
@pytest.mark.parametrize("M", [1, 3])
def test_fused_gemv_reads_rows_past_int32_offsets(M):
    _check_weight_past_int32_offsets(M, 4096, torch.bfloat16)


def _reference_decode_attention(qkv, cos, sin, kc, vc, pad, slot):
    """(rotated k, v, attention output) as apply_rope_torch + attention_naive compute them, over a cache that
    already holds the new key and value at ``slot`` (left padding hidden)."""
    B, Hkv, L, D = kc.shape
    H = qkv.shape[1] // D - 2 * Hkv
    q, k, v = qkv.view(B, 1, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=2)
    pos = (slot - pad).clamp_min(0)
    rq, rk = ops.apply_rope_torch(q, k, cos[pos][:, None], sin[pos][:, None])
    j = torch.arange(L, device=kc.device)
    mask = ((j[None, :] >= pad[:, None]) & (j[None, :] <= slot))[:, None, None, :]   # (B, 1, 1, L)
    return rk, v, ops.attention_naive(rq.transpose(1, 2), kc, vc, mask)[:, :, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,L,slot", [(1, 4, 1, 200, 150), (2, 6, 2, 64, 63), (3, 4, 4, 40, 5),
                                             (1, 8, 2, 300, 0)])
def test_decode_attention_matches_reference(dtype, B, H, Hkv, L, slot):
    """RoPE of q and k at each row's position, the cache write at the slot, and attention over the visible slots
    (left padding hidden), against apply_rope_torch + a manual cache write + attention_naive."""
    K_ = _kernels()
    D = 32
    g = torch.Generator().manual_seed(B + L + slot)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g).to(DEVICE, dtype)
    kc = torch.randn(B, Hkv, L, D, generator=g).to(DEVICE, dtype)
    vc = torch.randn(B, Hkv, L, D, generator=g).to(DEVICE, dtype)
    kc_before, vc_before = kc.clone(), vc.clone()
    pad = torch.tensor([(3 * b) % (slot + 1) for b in range(B)], device=DEVICE)
    cos, sin = ops.rope_frequencies(D, 10000.0, torch.arange(L, device=DEVICE))
    scratch = K_.AttentionScratch(B, H, Hkv, D, L, DEVICE)
    out = torch.empty(B, H, D, device=DEVICE, dtype=dtype)
    for _ in range(2):  # the arrival counters re-arm themselves: a second call gives the same result
        K_.decode_attention(qkv, cos, sin, kc, vc, pad, torch.tensor([slot], device=DEVICE), out, scratch)
        assert scratch.counter.abs().sum() == 0
    rk, v, ref = _reference_decode_attention(qkv, cos, sin, kc, vc, pad, slot)
    exact = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else EXACT_BF16
    assert kc.dtype == rk.dtype and vc.dtype == v.dtype
    assert_close_to_reference(kc[:, :, slot], rk[:, 0], dtype, **exact, what="k written to the cache")
    assert_close_to_reference(vc[:, :, slot], v[:, 0], dtype, atol=0, rtol=0, what="v written to the cache")
    others = torch.arange(L, device=DEVICE) != slot
    assert torch.equal(kc[:, :, others], kc_before[:, :, others]) and torch.equal(vc[:, :, others],
                                                                                   vc_before[:, :, others])
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else TOL[dtype]
    assert_close_to_reference(out, ref, dtype, **tol, what="decode attention")
    if B == 1 and L >= 200:
        assert scratch.splits > 1  # the split-and-combine path is covered


def test_decode_attention_reads_padding_and_tables_at_their_strides():
    """A caller may keep each row's left padding as a column of a wider buffer and the RoPE tables as views of a
    wider table: the kernel reads them at their strides (read as if contiguous, row 1's padding would be the
    next column's entry and positions past 0 another row of the tables). A table shorter than the cache, or
    padding of the wrong length, is refused."""
    K_ = _kernels()
    B, H, Hkv, L, D, slot = 3, 4, 2, 40, 32, 20
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g).to(DEVICE)
    kc = torch.randn(B, Hkv, L, D, generator=g).to(DEVICE)
    vc = torch.randn(B, Hkv, L, D, generator=g).to(DEVICE)
    pad = torch.tensor([0, 3, 7], device=DEVICE)
    meta = torch.full((B, 3), 11, dtype=torch.long, device=DEVICE)     # (slot, padding, length) per row
    meta[:, 1] = pad
    cos, sin = ops.rope_frequencies(D, 10000.0, torch.arange(L, device=DEVICE))
    wide = torch.cat([cos, sin], dim=1)                                # cos and sin as views of row stride D
    tables = {"row-strided": (wide[:, :D // 2], wide[:, D // 2:]),
              "transposed": (cos.t().contiguous().t(), sin.t().contiguous().t())}
    slot_t = torch.tensor([slot], device=DEVICE)
    for name, (c, s) in tables.items():
        k2, v2 = kc.clone(), vc.clone()
        out = torch.empty(B, H, D, device=DEVICE)
        K_.decode_attention(qkv, c, s, k2, v2, meta[:, 1], slot_t, out, K_.AttentionScratch(B, H, Hkv, D, L, DEVICE))
        rk, _, ref = _reference_decode_attention(qkv, cos, sin, k2, v2, pad, slot)
        assert_close_to_reference(k2[:, :, slot], rk[:, 0], atol=1e-6, rtol=1e-6, what=f"k written, {name} tables")
        assert_close_to_reference(out, ref, atol=2e-5, rtol=2e-5, what=f"decode attention, {name} tables")
    scratch = K_.AttentionScratch(B, H, Hkv, D, L, DEVICE)
    out = torch.empty(B, H, D, device=DEVICE)
    with pytest.raises(ValueError, match="tables"):
        K_.decode_attention(qkv, cos[:L - 1], sin[:L - 1], kc, vc, pad, slot_t, out, scratch)
    with pytest.raises(ValueError, match="pad_len"):
        K_.decode_attention(qkv, cos, sin, kc, vc, pad[:2], slot_t, out, scratch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_step_equals_generic_step(dtype):
    """Same prompts, same cache slots: the fused step's logits equal the model's generic decode step's (float32),
    and in bfloat16 both stay as close to a float32 computation with the same weights."""
    from zero2all.infer.generate import DecodeSession
    from zero2all.model.z2all import build_model

    cfg = tiny_model_config(initializer_range=0.3, attention_bias=True, hidden_dim=128, intermediate_size=100)
    model = build_model(cfg, device=DEVICE, seed=0).to(dtype).eval()
    prompts = [[5, 9, 200], list(range(30, 41)), [7]]
    one = DecodeSession(model, 1, 32, cuda_graph=False, fused=True)   # batch 1: the embedding read in the product
    one_generic = DecodeSession(model, 1, 32, cuda_graph=False)
    for s in (one, one_generic):
        s.prefill(prompts[1:2], 0)
    for step in range(3):
        nxt = torch.tensor([(7 * step + 3) % 256], device=DEVICE)
        a1, b1 = one_generic.decode(nxt, 11 + step), one.decode(nxt, 11 + step)
        if dtype == torch.float32:
            assert b1.dtype == a1.dtype
            assert_close_to_reference(b1, a1, dtype, atol=2e-4, rtol=2e-4, what=f"batch-1 logits, step {step}")
    generic = DecodeSession(model, 3, 32, cuda_graph=False)
    fused = DecodeSession(model, 3, 32, cuda_graph=False, fused=True)
    reference = DecodeSession(build_model(cfg, device=DEVICE, seed=0).to(dtype).float().eval(), 3, 32,
                              cuda_graph=False)
    sessions = (generic, fused, reference)
    for s in sessions:
        s.prefill(prompts, 0)
    P = 11
    # the CPU interpreter rounds float32 -> bfloat16 toward zero, a bias that builds up over steps: fewer steps
    steps = 5 if dtype == torch.float32 or DEVICE == "cuda" else 2
    for step in range(steps):
        nxt = torch.tensor([(17 * step + 31 * r) % 256 for r in range(3)], device=DEVICE)
        a, b, ref = (s.decode(nxt, P + step) for s in sessions)
        if dtype == torch.float32:
            assert b.dtype == a.dtype
            assert_close_to_reference(b, a, dtype, atol=2e-4, rtol=2e-4, what=f"logits, step {step}")
        else:
            err_generic, err_fused = (a - ref).abs().max(), (b - ref).abs().max()
            assert err_fused <= 2 * err_generic + 0.01 * ref.abs().max(), (step, err_fused, err_generic)
    if dtype == torch.float32:
        for layer in range(cfg.n_layers):  # the fused step wrote the same keys and values
            for name, got, want in (("k", fused.cache.k[layer], generic.cache.k[layer]),
                                    ("v", fused.cache.v[layer], generic.cache.v[layer])):
                assert got.dtype == want.dtype
                assert_close_to_reference(got, want, dtype, atol=1e-4, rtol=1e-4, what=f"cache {name}, layer {layer}")


@pytest.mark.parametrize("fused", [True, False])
def test_lone_row_step_computes_its_row_alone_and_leaves_the_others(fused):
    """One stream running in a 3-row session: ``decode(..., lone_row=r)`` runs the fused one-row step over row r
    only: row r's logits and the keys and values it writes equal the full step's (float32), the other rows' caches
    are untouched, and full steps after lone ones carry on as if every step had been full. The session's own step
    fused, or generic (a session of more rows than the fused kernels take). Measured differences (Triton
    interpreter, float32): logits 1.1e-5, keys 8e-6; tolerance 1e-4."""
    from zero2all.infer.generate import DecodeSession
    from zero2all.model.z2all import build_model

    cfg = tiny_model_config(initializer_range=0.3, hidden_dim=128, intermediate_size=100)
    model = build_model(cfg, device=DEVICE, seed=0).float().eval()
    prompts = [[5, 9, 200], list(range(30, 41)), [7]]
    full = DecodeSession(model, 3, 32, cuda_graph=False, fused=fused)
    lone = DecodeSession(model, 3, 32, cuda_graph=False, fused=fused, lone_rows=True)
    assert not full.lone_rows and lone.lone_rows
    for s in (full, lone):
        s.prefill(prompts, 0)
    P, row = 11, 1
    for step in range(4):
        nxt = torch.tensor([(17 * step + 31 * r) % 256 for r in range(3)], device=DEVICE)
        others = [k[[0, 2]].clone() for k in lone.cache.k]
        want = full.decode(nxt, P + step)
        if step < 3:
            got = lone.decode(nxt, P + step, lone_row=row)
            for k, k0 in zip(lone.cache.k, others):
                assert torch.equal(k[[0, 2]], k0)
            assert_close_to_reference(got[row], want[row], torch.float32, atol=1e-4, rtol=1e-4,
                                      what=f"lone row logits, step {step}")
        else:  # back to the full step: row r reads the keys and values its lone steps wrote
            got = lone.decode(nxt, P + step)
            assert_close_to_reference(got[row], want[row], torch.float32, atol=1e-4, rtol=1e-4,
                                      what="full step after lone ones")
        for layer in range(cfg.n_layers):
            assert_close_to_reference(lone.cache.k[layer][row], full.cache.k[layer][row], torch.float32,
                                      atol=1e-4, rtol=1e-4, what=f"row {row} keys, layer {layer}")


def test_scheduler_runs_a_lone_stream_on_its_row_alone():
    """The column engine with the fused step: one request alone, then three at once; every request's greedy
    tokens equal the one-prompt Generator's, and the lone stretches took the one-row step."""
    from standin_tokenizer import ByteTokenizer

    from zero2all.infer.generate import Generator, SamplingParams
    from zero2all.infer.scheduler import Scheduler
    from zero2all.model.z2all import build_model

    cfg = tiny_model_config(initializer_range=0.3, hidden_dim=128, intermediate_size=100)
    model = build_model(cfg, device=DEVICE, seed=0).float().eval()
    sched = Scheduler(Generator(model, ByteTokenizer(), fused=True), max_batch=3, cache_len=64, engine="column")
    try:
        assert sched.session.fused is not None
        params = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=[])
        alone = Generator(model, fused=False, cuda_graph=False)
        jobs = [[5, 9, 200, 4], [30, 31, 32], [7], list(range(60, 70))]
        first = list(sched.generate([jobs[0]], params))
        assert sched.session._lone_steps  # the lone request ran the one-row step
        subs = [sched.submit([p], params) for p in jobs[1:]]
        results = [first] + [list(sub.events()) for sub in subs]
        for prompt, events in zip(jobs, results):
            got = [ev.token_id for ev in events if ev.token_id >= 0 and not ev.stop_token]
            assert got == alone.generate([prompt], params)[0].token_ids
    finally:
        sched.stop()


def test_fused_decode_support_reasons():
    from zero2all.infer.fused_decode import supported
    from zero2all.model.lora import LoRAConfig, apply_lora
    from zero2all.model.z2all import build_model

    model = build_model(tiny_model_config(hidden_dim=128), device=DEVICE, seed=0).eval()
    assert supported(model, 4) is None
    assert "batch 17" in supported(model, 17)
    small_heads = build_model(tiny_model_config(hidden_dim=64, n_heads=4, n_kv_heads=2), device=DEVICE)
    assert "head_dim" in supported(small_heads, 1)
    apply_lora(model, LoRAConfig(rank=2))
    assert "LoRA" in supported(model, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tuner times CUDA graphs")
def test_tune_picks_a_candidate_per_shape_and_keeps_the_step_exact(monkeypatch):
    """FusedDecodeStep.tune times the whole step per candidate tile and keeps one per product shape; the step's
    logits with the chosen tiles equal the untuned step's to bfloat16 rounding (only the summation order moves)."""
    from zero2all.infer.generate import DecodeSession
    from zero2all.model.z2all import build_model

    K_ = _kernels()
    monkeypatch.setattr(K_, "_TUNE", True)
    monkeypatch.setattr(K_, "ROW_TILES", {})
    cfg = tiny_model_config(initializer_range=0.3, hidden_dim=128, intermediate_size=200)
    model = build_model(cfg, device=DEVICE, seed=0).to(torch.bfloat16).eval()
    session = DecodeSession(model, 1, 64, cuda_graph=False, fused=True)
    session.prefill([[5, 9, 200, 7]], 0)
    session.tokens.fill_(11)
    session.slot.fill_(4)
    step = session.fused
    before = step(session.tokens, session.slot, session.pad_len).clone()
    chosen = step.tune(session.tokens, session.slot, session.pad_len, replays=2)
    shapes = {K_.row_tiles_key(w, p) for w, p in step.product_shapes()}
    assert set(chosen) == shapes and len(shapes) == 5
    assert all(t in K_.row_tile_candidates() for t in chosen.values())
    assert step.tune(session.tokens, session.slot, session.pad_len) == chosen  # kept, not tuned again
    after = step(session.tokens, session.slot, session.pad_len)
    assert after.dtype == before.dtype
    assert_close_to_reference(after, before, atol=3e-2, rtol=3e-2, what="tuned step logits")
