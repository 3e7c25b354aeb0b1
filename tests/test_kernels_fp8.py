"""The FP8 quantisation kernels (``zero2all/kernels/fp8.py``) against the PyTorch reference of the same rule.

The kernels round to the FP8 grid themselves and torch's float8 casts round to nearest even, so the two must agree
bit for bit: every code, every scale and both counters, for rowwise (one pass), axiswise with the transposed copy,
and tensorwise casts, in E4M3 and E5M2, on odd shapes, bf16 and float32 inputs, with 1e4-scaled outlier rows and
all-zero rows. Runs on CPU under TRITON_INTERPRET=1.
"""

import pytest
import torch
import triton

from zero2all.kernels.fp8 import quantize
from zero2all.kernels.fp8_ref import E4M3, E5M2, quantize_torch

SHAPES = [((1, 16), torch.float32), ((7, 33), torch.bfloat16), ((37, 130), torch.float32), ((3, 4100), torch.bfloat16)]


def operand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 2, shape[0])[:, None]
    x[0] *= 1e4                                       # an outlier row
    if shape[0] > 2:
        x[2] = 0.0                                    # an all-zero row (amax floor)
        x[1, : shape[1] // 2] *= 1e-6                 # tiny values next to normal ones (underflow)
    return x.to(dtype)


def assert_same(got, want, what):
    assert (got is None) == (want is None), what
    if got is not None:
        assert got.shape == want.shape and got.dtype == want.dtype, what
        assert torch.equal(got.float(), want.float()), \
            f"{what}: {(got.float() != want.float()).sum().item()} elements differ"


@pytest.mark.parametrize("shape,dtype", SHAPES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling,want_q,want_qt", [("axis", True, False), ("axis", True, True),
                                                    ("axis", False, True), ("tensor", True, True),
                                                    ("tensor", True, False)])
def test_kernels_match_reference_bit_for_bit(shape, dtype, fp8, scaling, want_q, want_qt):
    x = operand(shape, dtype, seed=shape[0] * 31 + shape[1])
    got = quantize(x, fp8, scaling, want_q, want_qt)
    want = quantize_torch(x, fp8, scaling, want_q, want_qt)
    for name in ("q", "q_scale", "qt", "qt_scale"):
        assert_same(getattr(got, name), getattr(want, name), f"{name} ({dtype}, {scaling})")
    assert torch.equal(got.counts, want.counts), (got.counts, want.counts)
    assert got.counts[0] > 0                          # the largest element of a row or tensor lands on FMAX


def test_strided_rows_and_empty_tensors():
    x = operand((9, 80), torch.bfloat16, seed=3)[:, 8:72]            # rows with a stride of 80
    got, want = quantize(x, E4M3, "axis"), quantize_torch(x, E4M3, "axis")
    assert_same(got.q, want.q, "q of a strided view")
    assert_same(got.q_scale, want.q_scale, "scales of a strided view")
    empty = quantize(torch.zeros(0, 32), E4M3, "axis", True, True)
    assert empty.q.shape == (0, 32) and empty.qt.shape == (32, 0) and empty.counts.tolist() == [0, 0]
    for shape in ((0, 32), (3, 0)):
        for scaling in ("axis", "tensor"):
            got, want = quantize(torch.zeros(shape), E4M3, scaling, True, True), \
                quantize_torch(torch.zeros(shape), E4M3, scaling, True, True)
            for name in ("q", "q_scale", "qt", "qt_scale"):
                assert_same(getattr(got, name), getattr(want, name), f"{name} of an empty {shape}")
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.zeros(2, 3, 4), E4M3, "axis")


def test_amax_is_exact_and_the_largest_element_lands_on_fmax():
    x = operand((37, 130), torch.float32, seed=5)
    for scaling in ("axis", "tensor"):
        qz = quantize(x, E4M3, scaling, want_q=True, want_qt=True)
        amax_rows = x.abs().amax(1).clamp_min(1e-12)
        amax_cols = x.abs().amax(0).clamp_min(1e-12)
        if scaling == "axis":
            assert torch.equal(qz.q_scale, amax_rows / 448.0)
            assert torch.equal(qz.qt_scale, amax_cols / 448.0)
            nonzero = x.abs().amax(1) > 0
            assert torch.equal(qz.q.float().abs().amax(1)[nonzero], torch.full((int(nonzero.sum()),), 448.0))
        else:
            assert torch.equal(qz.q_scale, x.abs().amax() / 448.0)
            assert qz.q.float().abs().max().item() == 448.0


@pytest.mark.parametrize("shape", [(20, 300), (75, 200)])
def test_small_tiles_split_bands_and_two_pass_rows(monkeypatch, shape):
    """Small tiles, so that a band of rows spans many column tiles shared by several programs (partial maxima
    reduced afterwards) and the rowwise kernel reads each row twice (K larger than its block)."""
    import zero2all.kernels.fp8 as fp8

    monkeypatch.setattr(fp8, "TILE", {"BM": 16, "BK": 32, "num_warps": 4})
    monkeypatch.setattr(fp8, "ROWWISE_TILE", 64)
    bands, tiles_k = -(-shape[0] // 16), -(-shape[1] // 32)
    assert shape != (20, 300) or fp8._split(torch.device("cpu"), bands, tiles_k) > 1
    x = operand(shape, torch.bfloat16, seed=11)
    for scaling, want_q, want_qt in [("axis", True, False), ("axis", True, True), ("axis", False, True),
                                     ("tensor", True, True)]:
        for fmt in (E4M3, E5M2):
            got = quantize(x, fmt, scaling, want_q, want_qt)
            want = quantize_torch(x, fmt, scaling, want_q, want_qt)
            for name in ("q", "q_scale", "qt", "qt_scale"):
                assert_same(getattr(got, name), getattr(want, name), f"{name} ({scaling}, {fmt})")
            assert torch.equal(got.counts, want.counts), (scaling, got.counts, want.counts)


@pytest.mark.parametrize("rows,I,tile", [(37, 70, {"BM": 16, "BK": 32, "num_warps": 4}),
                                         (5, 48, {"BM": 64, "BK": 128, "num_warps": 4})])
def test_swiglu_backward_writes_the_maxima_of_its_outputs(monkeypatch, rows, I, tile):
    """fp8.swiglu_backward against the SwiGLU backward kernel of kernels/swiglu.py (d gate_up and a bit for
    bit), and the casts of its outputs, which take its partial maxima instead of an amax pass, against the
    reference quantisation bit for bit; a hint is used once, and not after an in-place change."""
    import zero2all.kernels.fp8 as fp8
    from zero2all.kernels.swiglu import _swiglu_bwd_kernel

    monkeypatch.setattr(fp8, "TILE", tile)
    hints = fp8.AmaxHints()                                 # a model's hints (model.ops.fp8_fused_amax)
    hints.enabled = True
    amax_calls = []
    real_amax = fp8._amax_kernel
    monkeypatch.setattr(fp8, "_amax_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: (lambda *a, **k: (amax_calls.append(1), real_amax[grid](*a, **k)))})())
    g = torch.Generator().manual_seed(rows * I)
    gate_up = (torch.randn(rows, 2 * I, generator=g) * 3).to(torch.bfloat16)
    grad_a = (torch.randn(rows, I, generator=g) * torch.logspace(-3, 1, rows)[:, None]).to(torch.bfloat16)
    grad_a[2] = 0.0                                         # an all-zero row of d gate_up
    grad_a[0] *= 1e4                                        # an outlier row
    want_dgu = torch.empty_like(gate_up)
    want_a = torch.empty_like(grad_a)
    _swiglu_bwd_kernel[(rows, 1)](grad_a, gate_up, want_dgu, want_a, I, gate_up.stride(0),
                                  BLOCK=triton.next_power_of_2(I), WRITE_A=True, num_warps=4)
    for scaling, fmt in (("axis", E4M3), ("tensor", E5M2)):
        dgu, a = fp8.swiglu_backward(grad_a, gate_up, torch.bfloat16, torch.bfloat16, scaling, True, hints)
        assert torch.equal(dgu, want_dgu) and torch.equal(a, want_a)
        view = dgu.view(1, rows, 2 * I).reshape(rows, -1)   # as autograd hands it on: a view of the same base
        for x, want_q, f in ((view, True, fmt), (a, False, E4M3)):
            got = quantize(x, f, scaling, want_q, True, hints=hints)
            ref = quantize_torch(x, f, scaling, want_q, True)
            for name in ("q", "q_scale", "qt", "qt_scale"):
                assert_same(getattr(got, name), getattr(ref, name), f"{name} ({scaling})")
            assert torch.equal(got.counts, ref.counts)
        assert not amax_calls and not hints._entries      # both maxima handed over, each used once
    dgu, _ = fp8.swiglu_backward(grad_a, gate_up, torch.bfloat16, torch.bfloat16, "axis", False, hints)
    dgu.mul_(2.0)                                           # changed after the kernel: its maxima are stale
    got, ref = quantize(dgu, E4M3, "axis", True, True, hints=hints), quantize_torch(dgu, E4M3, "axis", True, True)
    assert amax_calls and torch.equal(got.qt_scale, ref.qt_scale) and torch.equal(got.q_scale, ref.q_scale)
    with pytest.raises(ValueError, match="swiglu_backward"):
        fp8.swiglu_backward(grad_a, gate_up[:, 1:], torch.bfloat16, torch.bfloat16, "axis", True)


@pytest.mark.parametrize("rows,I,dtype,tile", [(5, 48, torch.bfloat16, 8192), (9, 100, torch.float32, 64)])
def test_swiglu_rowwise_cast_matches_swiglu_then_cast(monkeypatch, rows, I, dtype, tile):
    """quantize_swiglu (a = silu(gate) * up made inside the cast) against the SwiGLU kernel followed by the
    rowwise cast, bit for bit; tile 64: rows longer than the block (two passes)."""
    import zero2all.kernels.fp8 as fp8
    from zero2all.kernels.swiglu import triton_swiglu

    hints = fp8.AmaxHints()                                 # a model's hints (model.ops.fp8_fused_amax)
    hints.enabled = True
    monkeypatch.setattr(fp8, "ROWWISE_TILE", tile)
    g = torch.Generator().manual_seed(rows + I)
    gate_up = (torch.randn(rows, 2 * I, generator=g) * 3).to(dtype)
    gate_up[1, :I] = 0.0                                    # a zero row of a
    a = triton_swiglu(gate_up)
    got = fp8.quantize_swiglu(gate_up, a.dtype)
    want = quantize_torch(a, E4M3, "axis")
    for name in ("q", "q_scale"):
        assert_same(getattr(got, name), getattr(want, name), name)
    assert torch.equal(got.counts, want.counts)
    with pytest.raises(ValueError, match="quantize_swiglu"):
        fp8.quantize_swiglu(gate_up[:, 1:], a.dtype)
    a2 = fp8.swiglu_amax(gate_up, a.dtype, hints)           # a itself, with its rows' amax handed over
    assert torch.equal(a2, a)
    got, want = quantize(a2, E5M2, "tensor", True, True, hints=hints), quantize_torch(a, E5M2, "tensor", True, True)
    for name in ("q", "q_scale", "qt", "qt_scale"):
        assert_same(getattr(got, name), getattr(want, name), f"tensorwise {name}")
    assert not hints._entries
    with pytest.raises(ValueError, match="swiglu_amax"):
        fp8.swiglu_amax(gate_up[:, 1:], a.dtype)


@pytest.mark.parametrize("rows,N,res", [(6, 40, True), (3, 130, False)])
def test_norm_rowwise_cast_matches_norm_then_cast(monkeypatch, rows, N, res):
    """norm_quantize (residual add + RMSNorm with the rowwise cast of its output in one pass) against the RMSNorm
    kernel followed by the rowwise cast: the same residual, rstd and y, and the same codes, scales and counters."""
    import triton

    import zero2all.kernels.fp8 as fp8
    from zero2all.kernels.fp8 import norm_quantize
    from zero2all.kernels.rmsnorm import _add_rmsnorm_fwd_kernel, _warps

    hints = fp8.AmaxHints()                                 # a model's hints (model.ops.fp8_fused_amax)
    hints.enabled = True
    g = torch.Generator().manual_seed(rows * N)
    x = (torch.randn(rows, N, generator=g) * 4).to(torch.bfloat16)
    residual = torch.randn(rows, N, generator=g) if res else None
    w = torch.rand(N, generator=g) + 0.5
    x[1] = 0.0
    if residual is not None:
        residual[1] = 0.0                                    # a zero row: rstd = 1 / sqrt(eps), normed = 0
    warps = _warps(triton.next_power_of_2(N))
    out = {}
    for fused in (False, True):
        res_out = torch.empty(rows, N, dtype=torch.float32)
        rstd, yhat = torch.empty(rows), torch.empty(rows, N, dtype=torch.bfloat16)
        if fused:
            qn = norm_quantize(x, residual, w, 1e-5, res_out, rstd, yhat, torch.bfloat16, warps)
        else:
            normed = torch.empty(rows, N, dtype=torch.bfloat16)
            _add_rmsnorm_fwd_kernel[(rows,)](x, residual if res else x, w, normed, res_out, rstd, yhat, N, 1e-5,
                                             HAS_RESIDUAL=res, BLOCK=triton.next_power_of_2(N), WRITE_Y=True,
                                             num_warps=warps)
            qn = quantize(normed, E4M3, "axis")
            assert_same(qn.q, quantize_torch(normed, E4M3, "axis").q, "the unfused reference")
        out[fused] = (qn, res_out, rstd, yhat)
        if not fused:                                        # store_normed: normed itself and its rows' amax
            res2, rstd2, yhat2 = torch.empty_like(res_out), torch.empty_like(rstd), torch.empty_like(yhat)
            got = norm_quantize(x, residual, w, 1e-5, res2, rstd2, yhat2, torch.bfloat16, warps, store_normed=True,
                                hints=hints)
            assert torch.equal(got.q, normed) and torch.equal(got.q_scale, normed.float().abs().amax(1))
            assert torch.equal(res2, res_out) and torch.equal(rstd2, rstd) and torch.equal(yhat2, yhat)
            want = quantize_torch(normed, E5M2, "tensor", True, True)
            tq = quantize(got.q.reshape(rows, N), E5M2, "tensor", True, True, hints=hints)   # the handed-over amax
            for name in ("q", "q_scale", "qt", "qt_scale"):
                assert_same(getattr(tq, name), getattr(want, name), f"tensorwise {name}")
    (q0, *t0), (q1, *t1) = out[False], out[True]
    for a, b in zip(t0, t1):
        assert torch.equal(a, b)
    assert_same(q1.q, q0.q, "q")
    assert_same(q1.q_scale, q0.q_scale, "scale")
    assert torch.equal(q1.counts, q0.counts)
    assert not hints._entries or all(e[0]() is None for e in hints._entries.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_on_gpu_bit_for_bit(monkeypatch):
    """The compiled kernels (the hardware FP8 conversion, split bands, transposed stores) on a GPU."""
    import zero2all.kernels.fp8 as fp8
    from zero2all.kernels.swiglu import triton_swiglu

    hints = fp8.AmaxHints()                                 # a model's hints (model.ops.fp8_fused_amax)
    hints.enabled = True
    for shape in [(1000, 1030), (4099, 300), (17, 5000)]:
        x = operand(shape, torch.bfloat16, seed=shape[0]).cuda()
        for fmt in (E4M3, E5M2):
            for scaling, want_q, want_qt in [("axis", True, False), ("axis", True, True), ("axis", False, True),
                                             ("tensor", True, True)]:
                got = quantize(x, fmt, scaling, want_q, want_qt)
                want = quantize_torch(x, fmt, scaling, want_q, want_qt)
                for name in ("q", "q_scale", "qt", "qt_scale"):
                    assert_same(getattr(got, name), getattr(want, name), f"{name} {shape} {scaling}")
                assert torch.equal(got.counts, want.counts)
    gate_up = torch.randn(333, 2 * 700, device="cuda", dtype=torch.bfloat16) * 3
    got, want = fp8.quantize_swiglu(gate_up, torch.bfloat16), quantize(triton_swiglu(gate_up), E4M3, "axis")
    assert_same(got.q, want.q, "swiglu q")
    assert_same(got.q_scale, want.q_scale, "swiglu scale")
    grad_a = torch.randn(333, 700, device="cuda", dtype=torch.bfloat16)
    for scaling in ("axis", "tensor"):
        dgu, a = fp8.swiglu_backward(grad_a, gate_up, torch.bfloat16, torch.bfloat16, scaling, True, hints)
        assert torch.equal(a, triton_swiglu(gate_up))
        for t, want_q in ((dgu, True), (a, False)):      # casts from the handed-over maxima
            got = quantize(t, E4M3, scaling, want_q, True, hints=hints)
            want = quantize_torch(t, E4M3, scaling, want_q, True)
            for name in ("q", "q_scale", "qt", "qt_scale"):
                assert_same(getattr(got, name), getattr(want, name), f"swiglu_backward {name} {scaling}")
        assert not hints._entries
    a = fp8.swiglu_amax(gate_up, torch.bfloat16, hints)
    assert torch.equal(a, triton_swiglu(gate_up))
    got, want = quantize(a, E5M2, "tensor", True, True, hints=hints), quantize_torch(a, E5M2, "tensor", True, True)
    for name in ("q", "q_scale", "qt", "qt_scale"):
        assert_same(getattr(got, name), getattr(want, name), f"swiglu_amax {name}")


def test_norm_rowwise_cast_takes_strided_inputs_and_refuses_strided_outputs():
    """norm_quantize reads x, the residual and the norm weight as laid out (rows of a wider tensor, a transposed
    residual, a column of the weight): the same residual, rstd, y, codes and scales as from contiguous copies
    (read as if contiguous, rows past the first would be another row's values). The tensors it writes must be
    contiguous: a view is refused, not written in the wrong places."""
    import triton

    from zero2all.kernels.fp8 import norm_quantize
    from zero2all.kernels.rmsnorm import _warps

    rows, N = 5, 40
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(rows, N + 8, generator=g) * 4).to(torch.bfloat16)[:, 3:N + 3]     # row stride N + 8
    residual = torch.randn(N, rows, generator=g).t()                                     # strides (1, rows)
    w = (torch.rand(N, 2, generator=g) + 0.5)[:, 1]                                      # stride 2
    warps = _warps(triton.next_power_of_2(N))
    out = []
    for args in ((x, residual, w), (x.contiguous(), residual.contiguous(), w.contiguous())):
        res_out, rstd = torch.empty(rows, N), torch.empty(rows)
        yhat = torch.empty(rows, N, dtype=torch.bfloat16)
        qn = norm_quantize(*args, 1e-5, res_out, rstd, yhat, torch.bfloat16, warps)
        out.append((qn.q.float(), qn.q_scale, qn.counts, res_out, rstd, yhat))
    for name, got, want in zip(("q", "scale", "counts", "residual", "rstd", "y"), *out):
        assert torch.equal(got, want), name
    res_out, rstd, yhat = torch.empty(rows, N), torch.empty(rows), torch.empty(rows, N, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        norm_quantize(x, residual, w, 1e-5, torch.empty(N, rows).t(), rstd, yhat, torch.bfloat16, warps)
    with pytest.raises(ValueError, match="contiguous"):
        norm_quantize(x, residual, w, 1e-5, res_out, rstd, torch.empty(rows, 2 * N, dtype=torch.bfloat16)[:, :N],
                      torch.bfloat16, warps)
