"""FlexAttention with causal and document masks against the naive reference attention."""

import pytest
import torch
from kernel_check import assert_close_to_reference

from zero2all.model.ops import attention_naive, causal_mask

pytest.importorskip("torch.nn.attention.flex_attention")
from zero2all.kernels.attention import flex_causal_attention  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def doc_ids_for(B, T, g):
    """Random document boundaries: each row split into 1-4 documents."""
    ids = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        cuts = torch.randint(1, T, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)
        for c in cuts.tolist():
            ids[b, c:] += 1
    return ids


def run_case(B, H, Hkv, T, D, dtype, with_docs, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    backward = device != "cpu"  # FlexAttention has no CPU backward: gradients are checked on the GPU
    q = torch.randn(B, H, T, D, generator=g).to(device, dtype).requires_grad_(backward)
    k = torch.randn(B, Hkv, T, D, generator=g).to(device, dtype).requires_grad_(backward)
    v = torch.randn(B, Hkv, T, D, generator=g).to(device, dtype).requires_grad_(backward)
    doc_ids = doc_ids_for(B, T, g).to(device) if with_docs else None
    out = flex_causal_attention(q, k, v, doc_ids=doc_ids)
    mask = causal_mask(T, T, device)
    if with_docs:
        mask = (mask & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]
    leaves = [q, k, v]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    want = attention_naive(*ref_leaves, mask)
    tol = TOL[dtype]
    assert out.shape == (B, H, T, D) and out.dtype == dtype
    assert_close_to_reference(out, want, dtype, rel_l2=tol, what="attention")
    if not backward:
        return
    grad = torch.randn(out.shape, generator=g).to(device, dtype)
    got = torch.autograd.grad(out, leaves, grad)
    want_g = torch.autograd.grad(want, ref_leaves, grad.double())
    for name, a, b in zip("qkv", got, want_g):
        assert_close_to_reference(a, b, dtype, rel_l2=tol * 2, what=f"grad {name}")


@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.parametrize("H,Hkv,T,D", [(4, 2, 37, 16), (2, 2, 16, 8)])
def test_flex_attention_cpu(H, Hkv, T, D, with_docs):
    run_case(2, H, Hkv, T, D, torch.float32, with_docs, seed=T)


def test_flex_attention_bad_doc_ids():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="doc_ids shape"):
        flex_causal_attention(q, q, q, doc_ids=torch.zeros(1, 7, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("with_docs", [False, True])
def test_flex_attention_gpu_real_shapes(with_docs):
    run_case(2, 32, 8, 2048, 64, torch.bfloat16, with_docs, device="cuda")
