"""Paged decode attention (zero2all/kernels/paged_attention.py): the Triton kernel and the PyTorch path against a
float64 reference built row by row from the block tables. On CPU the kernel runs through TRITON_INTERPRET=1."""

import os

import pytest
import torch
from kernel_check import assert_close_to_reference

from zero2all.kernels import paged_attention as pa
from zero2all.model import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="needs a GPU or TRITON_INTERPRET=1")


def _case(B, H, Hkv, D, bs, lengths, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max(-(-n // bs) for n in lengths))
    n_blocks = B * max_blocks + 3
    k = torch.randn(n_blocks, bs, Hkv, D, generator=g)
    v = torch.randn(n_blocks, bs, Hkv, D, generator=g)
    q = torch.randn(B, H, D, generator=g)
    # each row's blocks scattered over the pool (a permutation), so the table's indirection is exercised
    perm = torch.randperm(n_blocks, generator=g)[:B * max_blocks].view(B, max_blocks)
    lens = torch.tensor(lengths)
    to = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    return to(q), to(k), to(v), perm.to(DEVICE, torch.int32), lens.to(DEVICE, torch.int32)


def _reference(q, k, v, tables, lens):
    """float64, one row at a time: the row's keys gathered token by token, then plain softmax attention."""
    B, H, D = q.shape
    bs = k.size(1)
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        idx = [(int(tables[b, t // bs]), t % bs) for t in range(n)]
        kb = torch.stack([k[i, j] for i, j in idx]).double().cpu().transpose(0, 1)[None]   # (1, Hkv, n, D)
        vb = torch.stack([v[i, j] for i, j in idx]).double().cpu().transpose(0, 1)[None]
        out[b] = ops.attention_naive(q[b].double().cpu()[None, :, None], kb, vb, None)[0, :, 0]
    return out


CASES = [  # (B, H, Hkv, D, block size, lengths)
    (3, 6, 2, 40, 16, [1, 17, 50]),          # GQA 3, odd head dim, lengths not multiples of the block
    (4, 8, 8, 32, 16, [33, 0, 16, 5]),        # MHA, a free row (length 0), an exact block
    (2, 12, 1, 24, 32, [70, 31]),             # MQA (12 query heads on one key/value head), block of 32
    (5, 10, 2, 64, 16, [3, 100, 47, 64, 1]),
    (1, 8, 2, 64, 16, [1000]),                # one long row: what the splits are for
]


@needs_triton
@pytest.mark.parametrize("splits", [1, 3, 8, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_paged_kernel_matches_float64_reference(case, dtype, splits):
    """Whole rows (1 split) and rows walked in pieces then combined (3: uneven pieces, and short rows whose last
    splits get no block; 8: more splits than some tables have blocks, clamped to the table's width; None: the
    default, on CUDA from the device's multiprocessors, 1 elsewhere)."""
    B, H, Hkv, D, bs, lengths = case
    q, k, v, tables, lens = _case(B, H, Hkv, D, bs, lengths, dtype, seed=B * 100 + D)
    want = _reference(q, k, v, tables, lens)
    got = pa.paged_decode_attention(q, k, v, tables, lens, impl="triton", splits=splits)
    assert got.dtype == dtype and got.shape == (B, H, D)
    assert_close_to_reference(got, want, rel_l2={torch.float32: 1e-5, torch.bfloat16: 1e-2}, dtype=dtype,
                              what=f"paged attention {case}, {splits} splits")
    free = [b for b in range(B) if lengths[b] == 0]
    assert all(got[b].abs().max().item() == 0 for b in free)


@needs_triton
def test_paged_kernel_takes_int64_lengths_as_they_are():
    """The paged session's step keeps its lengths as int64 beside positions and slots, one column of a (rows, 3)
    buffer: the kernel reads them at their stride without a conversion and gives the int32 lengths' result
    exactly (read as if contiguous, row 1's length would be row 0's slot: a wrong length, reads past the table)."""
    q, k, v, tables, lens = _case(3, 6, 2, 40, 16, [1, 17, 50], torch.float32, seed=3)
    want = pa.paged_decode_attention(q, k, v, tables, lens.to(torch.int32), impl="triton")
    got = pa.paged_decode_attention(q, k, v, tables, lens.to(torch.int64), impl="triton")
    assert torch.equal(got, want)
    meta = torch.zeros(3, 3, dtype=torch.int64, device=lens.device)     # position, slot, length per row
    meta[:, 0], meta[:, 1], meta[:, 2] = lens - 1, 7, lens              # slots small: a misread stays in bounds
    column = meta[:, 2]
    assert column.stride(0) == 3
    assert torch.equal(pa.paged_decode_attention(q, k, v, tables, column, impl="triton"), want)


@pytest.mark.parametrize("case", CASES)
def test_paged_torch_path_matches_float64_reference(case):
    B, H, Hkv, D, bs, lengths = case
    q, k, v, tables, lens = _case(B, H, Hkv, D, bs, lengths, torch.float64, seed=B * 7 + D)
    got = pa.paged_decode_attention(q, k, v, tables, lens, impl="torch")
    assert_close_to_reference(got, _reference(q, k, v, tables, lens), rel_l2=1e-14, what="paged torch path")


def test_paged_triton_refuses_a_block_size_it_cannot_tile():
    q, k, v, tables, lens = _case(1, 2, 1, 16, 12, [5], torch.float32, seed=1)
    with pytest.raises(ValueError, match="block size"):
        pa.paged_decode_attention_triton(q, k, v, tables, lens)
