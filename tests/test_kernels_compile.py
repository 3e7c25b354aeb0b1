"""The kernels as torch custom ops: registration checks (opcheck) and a full model under torch.compile(fullgraph)."""

import pytest
import torch
from kernel_check import assert_close_to_reference

from zero2all.config import ModelConfig, OpsConfig
from zero2all.kernels.cross_entropy import _linear_cross_entropy
from zero2all.kernels.fused_linear import _lean_linear_fwd, _norm_linear_fwd, _swiglu_linear_fwd
from zero2all.kernels.rmsnorm import _add_rmsnorm_fwd
from zero2all.kernels.rope import _rope
from zero2all.kernels.swiglu import _swiglu_fwd
from zero2all.model.ops import rope_frequencies
from zero2all.model.z2all import build_model


def test_opcheck_custom_ops():
    """Fake (meta) implementations, schemas and autograd registrations agree with the real kernels."""
    opcheck = torch.library.opcheck
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    x = torch.randn(3, 40, requires_grad=True)
    r = torch.randn(3, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    opcheck(_add_rmsnorm_fwd, (x, r, w, 1e-5, True), test_utils=tests)
    opcheck(_add_rmsnorm_fwd, (x, None, w, 1e-5, False), test_utils=tests)
    q, k = torch.randn(1, 5, 2, 8, requires_grad=True), torch.randn(1, 5, 1, 8, requires_grad=True)
    cos, sin = rope_frequencies(8, 1e4, torch.arange(5))
    opcheck(_rope, (q, k, cos, sin, False), test_utils=tests)
    opcheck(_swiglu_fwd, (torch.randn(4, 30, requires_grad=True),), test_utils=tests)
    h, W = torch.randn(6, 16, requires_grad=True), torch.randn(33, 16, requires_grad=True)
    t = torch.tensor([1, 2, -100, 4, 5, 32])
    opcheck(_linear_cross_entropy, (h, W, t, -100, 0.0, True), test_utils=("test_schema", "test_faketensor"))
    Wq, b = torch.randn(24, 40, requires_grad=True), torch.randn(24, requires_grad=True)
    Wd = torch.randn(16, 15, requires_grad=True)
    for precision in ("bf16", "fp8_rowwise", "fp8_tensorwise"):  # bf16 = the compute dtype; FP8 GEMMs
        opcheck(_norm_linear_fwd, (x, r, w, 1e-5, True, Wq, b, torch.float32, precision, "qkv"), test_utils=tests)
        opcheck(_norm_linear_fwd, (x, None, w, 1e-5, False, Wq, None, torch.float32, precision, ""),
                test_utils=tests)
        opcheck(_swiglu_linear_fwd, (torch.randn(4, 30, requires_grad=True), Wd, None, torch.float32, precision,
                                     "down"), test_utils=tests)
        opcheck(_lean_linear_fwd, (x, Wq, b, torch.float32, precision, "o"), test_utils=tests)


@pytest.mark.parametrize("fused_linear,amp", [("torch", False), ("triton", False), ("triton", True)])
def test_model_compiles_fullgraph_with_all_kernels(fused_linear, amp):
    """fullgraph=True fails on any graph break; the compiled loss and gradients equal eager ones (with the lean
    fused linears also under bf16 autocast, where they pick the compute dtype themselves)."""
    cfg = ModelConfig(vocab_size=97, hidden_dim=32, intermediate_size=40, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_seq_len=8, ops=OpsConfig(rmsnorm="triton", rope="triton", swiglu="triton",
                                                   cross_entropy="fused", attention="sdpa",
                                                   fused_linear=fused_linear))
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 97, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        _, loss = model(tokens, tokens)
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        _, closs = compiled(tokens, tokens)
    closs.backward()
    assert_close_to_reference(closs, loss, atol=1e-6, rtol=1e-5, what="compiled loss")  # torch.allclose's rtol
    for n, p in model.named_parameters():
        assert_close_to_reference(p.grad, eager[n], atol=1e-6, rtol=1e-5, what=f"compiled grad {n}")


@pytest.mark.gpu
def test_model_compiles_with_inductor_gpu():
    cfg = ModelConfig(vocab_size=1000, hidden_dim=256, intermediate_size=688, n_layers=2, n_heads=8, n_kv_heads=4,
                      max_seq_len=128, ops=OpsConfig(rmsnorm="triton", rope="triton", swiglu="triton",
                                                     cross_entropy="fused", attention="sdpa", fused_linear="triton"))
    model = build_model(cfg, device="cuda", seed=0)
    tokens = torch.randint(0, 1000, (4, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(tokens, tokens)
        _, closs = torch.compile(model, fullgraph=True)(tokens, tokens)
    closs.backward()
    assert_close_to_reference(closs, loss, atol=2e-2, what="compiled loss")
