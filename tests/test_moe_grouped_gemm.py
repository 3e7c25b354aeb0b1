"""The grouped SwiGLU GEMM (Triton, and torch._grouped_mm where it runs) against the per-expert loop in float64,
forward and backward: odd token counts, experts without tokens, no tokens at all."""

import os

import pytest
import torch
from kernel_check import assert_close_to_reference

import zero2all.kernels.grouped_gemm as gg
from zero2all.kernels.grouped_gemm import expert_tiles, grouped_swiglu_mlp

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
CPU_TRITON = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not CPU_TRITON, reason="CPU Triton test: needs TRITON_INTERPRET=1")


def make(counts, H, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, M = len(counts), sum(counts)
    x = torch.randn(M, H, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5
    dy = torch.randn(M, H, generator=g, dtype=torch.float64)
    return torch.tensor(counts), x, w1, w2, dy


def grads(impl, counts, x, w1, w2, dy, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w1, w2)]
    out = grouped_swiglu_mlp(leaves[0], counts, *leaves[1:], impl=impl)
    out.backward(dy.to(dtype))
    return [out] + [t.grad for t in leaves]


def check(impl, counts, H, I, dtype, seed=0):
    counts, x, w1, w2, dy = make(counts, H, I, dtype, seed)
    want = grads("loop", counts, x, w1, w2, dy, torch.float64)
    got = grads(impl, counts, x, w1, w2, dy, dtype)
    for name, a, b in zip(("out", "dx", "dw1", "dw2"), got, want):
        assert a.dtype == dtype and a.shape == b.shape
        assert_close_to_reference(a, b, dtype, rel_l2=TOL, what=f"{impl} {name}")


@needs_interpreter
@pytest.mark.parametrize("counts,H,I", [([5, 0, 13, 1], 24, 20), ([0, 0, 7], 16, 33), ([17, 9], 40, 16),
                                        ([1, 1, 1, 1, 1], 8, 8)])
def test_triton_grouped_equals_loop(counts, H, I):
    check("triton", counts, H, I, torch.float32, seed=sum(counts))


@needs_interpreter
@pytest.mark.parametrize("tma,persistent", [(True, 0), (False, 2), (True, 3)])
def test_triton_grouped_variants_equal_loop(monkeypatch, tma, persistent):
    """The TMA-descriptor kernel (tiles dividing the sizes) and the persistent grid, odd counts, an empty expert."""
    products = {k: (16, 16, 1, 1, tma) for k in ("gate_up", "down", "dh", "dx")}
    monkeypatch.setattr(gg, "INTERPRET_CONFIG", {**gg.INTERPRET_CONFIG, **products, "persistent": persistent})
    check("triton", [5, 0, 13, 1], 32, 16, torch.float32, seed=3)
    check("triton", [0, 17, 9], 24, 20, torch.float32, seed=4)  # sizes the tiles do not divide: pointer path


@needs_interpreter
def test_triton_grouped_empty_batch():
    # (bf16 runs in the GPU test: the interpreter's bf16 dot products are not meaningful)
    counts, x, w1, w2, dy = make([0, 0], 16, 8, torch.float32)
    out, dx, dw1, dw2 = grads("triton", counts, x, w1, w2, dy, torch.float32)
    assert out.shape == (0, 16) and dx.shape == (0, 16)
    assert torch.count_nonzero(dw1) == 0 and torch.count_nonzero(dw2) == 0


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (the last two dimensions stored transposed)."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


@needs_interpreter
@pytest.mark.parametrize("tma", [False, True])
def test_triton_grouped_takes_views_of_any_layout(monkeypatch, tma):
    """x, the expert weights and the incoming gradient stored transposed, the counts a column of a wider int32
    buffer: the float64 loop's outputs and gradients (the kernels take the weights' strides, x and dy are copied,
    and a view never reaches the TMA descriptors, which need contiguous tensors)."""
    if tma:
        products = {k: (16, 16, 1, 1, True) for k in ("gate_up", "down", "dh", "dx")}
        monkeypatch.setattr(gg, "INTERPRET_CONFIG", {**gg.INTERPRET_CONFIG, **products})
    counts, x, w1, w2, dy = make([5, 0, 13, 1], 32, 16, torch.float32, seed=7)
    want = grads("loop", counts, x, w1, w2, dy, torch.float64)
    leaves = [_strided(t.float()).requires_grad_() for t in (x, w1, w2)]
    assert not any(t.is_contiguous() for t in leaves)
    buf = torch.zeros(len(counts), 3, dtype=torch.int32)
    buf[:, 1] = counts
    out = grouped_swiglu_mlp(leaves[0], buf[:, 1], *leaves[1:], impl="triton")
    out.backward(_strided(dy.float()))
    for name, a, b in zip(("out", "dx", "dw1", "dw2"), [out] + [t.grad for t in leaves], want):
        # float32 against float64: measured relative L2 errors <= 2e-7
        assert_close_to_reference(a, b, rel_l2=5e-6, what=f"{name}, tma {tma}")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm needs torch >= 2.8")
def test_torch_grouped_mm_equals_loop():
    check("torch", [5, 0, 11], 16, 8, torch.float32)


def test_expert_tiles_cover_every_row_once():
    counts = torch.tensor([5, 0, 33, 16, 1])
    e, first, end, offs, n_tiles = expert_tiles(counts, 16, int(counts.sum()))
    assert offs.tolist() == [0, 5, 5, 38, 54, 55]
    assert n_tiles.tolist() == [1 + 3 + 1 + 1]
    assert (first[6:] == end[6:]).all()  # the surplus tiles are empty
    covered = torch.zeros(int(counts.sum()), dtype=torch.int64)
    for t in range(e.numel()):
        rows = torch.arange(int(first[t]), min(int(first[t]) + 16, int(end[t])))
        covered[rows] += 1
        assert all(offs[int(e[t])] <= r < offs[int(e[t]) + 1] for r in rows.tolist())
    assert covered.eq(1).all()


def test_unknown_impl_is_refused():
    counts, x, w1, w2, _ = make([2, 1], 8, 8, torch.float32)
    with pytest.raises(ValueError, match="grouped_gemm impl 'fast'"):
        grouped_swiglu_mlp(x, counts, w1, w2, impl="fast")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_grouped_gpu_preset_shapes(impl):
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, 16, (4099,), generator=g), minlength=16).tolist()
    counts[3] = 0
    counts_t, x, w1, w2, dy = make(counts, 1024, 1024, torch.bfloat16)
    want = grads("loop", counts_t, x, w1, w2, dy, torch.float64)
    got = grads(impl, counts_t.cuda(), x.cuda(), w1.cuda(), w2.cuda(), dy.cuda(), torch.bfloat16)
    for name, a, b in zip(("out", "dx", "dw1", "dw2"), got, want):
        assert_close_to_reference(a.cpu(), b, torch.bfloat16, rel_l2=TOL, what=f"{impl} {name}")
