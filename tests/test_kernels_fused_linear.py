"""The lean fused projections (norm_linear, swiglu_linear, lean_linear) against the plain path they replace.

Each function is compared with ``ops.*_torch`` (add_rmsnorm / swiglu, then F.linear) in float32 and under bf16
autocast, forward and backward for every input (x, residual, norm weight, weight, bias), on odd sizes. Then the
whole tiny model with ``fused_linear="triton"`` vs ``"torch"``, and what autograd keeps with each.

Tolerances (relative L2 error against the plain path): float32 1e-5 (the same math, summed in another order);
bf16 autocast 2e-2 (both sides round to bf16; the backward rebuilds the projection input from the bf16 y, and on
CPU Triton's interpreter rounds float32 -> bf16 by truncation where torch rounds to nearest).
"""

import pytest
import torch
import torch.nn.functional as F
from kernel_check import assert_close_to_reference

from zero2all import accounting as acc
from zero2all.config import ModelConfig, OpsConfig, load_config
from zero2all.kernels.fused_linear import lean_linear, triton_norm_linear, triton_swiglu_linear
from zero2all.model import ops
from zero2all.model.z2all import build_model

TOL = {"fp32": 1e-5, "bf16": 2e-2}


def autocast(mode, device="cpu"):
    return torch.autocast(device, dtype=torch.bfloat16, enabled=mode == "bf16")


def compare(fused, reference, inputs, mode, n_out):
    """Run both functions on the same leaves with the same upstream gradients; compare outputs and grads."""
    g = torch.Generator().manual_seed(1)
    with autocast(mode, inputs[0].device.type):
        got = fused(*inputs)
        want = reference(*inputs)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == n_out
    leaves = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close_to_reference(a, b, mode, rel_l2=TOL, what=f"output {i}")
    grads = [torch.randn(b.shape, generator=g).to(b.device, b.dtype) for b in want]
    d_got = torch.autograd.grad(got, leaves, grads)
    d_want = torch.autograd.grad(want, leaves, grads)
    for i, (a, b) in enumerate(zip(d_got, d_want)):
        assert a.dtype == b.dtype == leaves[i].dtype, i
        assert_close_to_reference(a, b, mode, rel_l2=TOL, what=f"grad of input {i}")


def leaf(shape, g, dtype=torch.float32, scale=1.0, shift=0.0, device="cpu"):
    return (shift + scale * torch.randn(shape, generator=g)).to(device, dtype).requires_grad_()


# ---------------------------------------------------------------------------------------------------- functions


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("has_residual,residual_in_fp32,bias", [
    (True, True, False), (True, False, True), (False, True, True), (False, False, False)])
@pytest.mark.parametrize("hidden,out_features", [(100, 96), (96, 5 * 11 * 3)])
def test_norm_linear_matches_add_rmsnorm_then_linear(mode, has_residual, residual_in_fp32, bias, hidden,
                                                     out_features):
    g = torch.Generator().manual_seed(hidden + 2 * has_residual + residual_in_fp32)
    # under autocast x arrives in bf16 (a projection's output); the residual stream is fp32 or bf16
    x_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    res_dtype = torch.float32 if residual_in_fp32 or mode == "fp32" else torch.bfloat16
    x = leaf((3, 7, hidden), g, x_dtype)
    residual = leaf((3, 7, hidden), g, res_dtype) if has_residual else None
    norm_w = leaf((hidden,), g, scale=0.2, shift=1.0)
    w = leaf((out_features, hidden), g, scale=hidden ** -0.5)
    b = leaf((out_features,), g) if bias else None
    compare(triton_norm_linear, ops.norm_linear_torch, (x, residual, norm_w, 1e-5, residual_in_fp32, w, b), mode,
            n_out=2)


def test_norm_linear_fp32_input_under_autocast():
    """The first block's input is the fp32 embedding while autocast computes in bf16."""
    g = torch.Generator().manual_seed(5)
    x, norm_w, w = leaf((2, 9, 100), g), leaf((100,), g, scale=0.2, shift=1.0), leaf((60, 100), g, scale=0.1)
    compare(triton_norm_linear, ops.norm_linear_torch, (x, None, norm_w, 1e-5, True, w, None), "bf16", n_out=2)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("intermediate,out_features,bias", [(5 * 11 * 4, 100, False), (11 * 9, 96, True)])
def test_swiglu_linear_matches_swiglu_then_linear(mode, intermediate, out_features, bias):
    g = torch.Generator().manual_seed(intermediate)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    gate_up = leaf((3, 7, 2 * intermediate), g, dtype, scale=2.0)
    w = leaf((out_features, intermediate), g, scale=intermediate ** -0.5)
    b = leaf((out_features,), g) if bias else None
    compare(triton_swiglu_linear, ops.swiglu_linear_torch, (gate_up, w, b), mode, n_out=1)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_lean_linear_matches_linear(mode, bias):
    g = torch.Generator().manual_seed(3 + bias)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    x = leaf((5, 3, 96), g, dtype)
    w, b = leaf((100, 96), g, scale=0.1), (leaf((100,), g) if bias else None)
    compare(lean_linear, F.linear, (x, w, b), mode, n_out=1)


def test_frozen_parameters_get_no_gradient():
    """A parameter that does not require grad gets None and its weight-gradient GEMM is skipped."""
    g = torch.Generator().manual_seed(0)
    x, norm_w = leaf((11, 48), g), leaf((48,), g, shift=1.0)
    w = torch.randn(30, 48, generator=g)
    out, res = triton_norm_linear(x, None, norm_w, 1e-5, True, w)
    dx, dn = torch.autograd.grad((out.sum(), res.sum()), (x, norm_w))
    ref_out, ref_res = ops.norm_linear_torch(x, None, norm_w, 1e-5, True, w)
    rx, rn = torch.autograd.grad((ref_out.sum(), ref_res.sum()), (x, norm_w))
    assert_close_to_reference(dx, rx, rel_l2=1e-5, what="grad x")
    assert_close_to_reference(dn, rn, rel_l2=1e-5, what="grad norm weight")
    gu = leaf((11, 60), g)
    (dgu,) = torch.autograd.grad(triton_swiglu_linear(gu, w[:, :30]).sum(), gu)
    (rgu,) = torch.autograd.grad(ops.swiglu_linear_torch(gu, w[:, :30]).sum(), gu)
    assert_close_to_reference(dgu, rgu, rel_l2=1e-5, what="grad gate_up")
    wl = leaf((30, 48), g)
    (dwl,) = torch.autograd.grad(lean_linear(x.detach(), wl).sum(), wl)
    assert_close_to_reference(dwl, torch.autograd.grad(F.linear(x.detach(), wl).sum(), wl)[0], rel_l2=1e-5,
                              what="grad weight")


def test_inference_mode_and_shape_errors():
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(2, 5, 40, generator=g), torch.randn(2, 5, 40, generator=g)
    norm_w, w = torch.rand(40, generator=g) + 0.5, torch.randn(24, 40, generator=g)
    with torch.inference_mode():
        out, res = triton_norm_linear(x, r, norm_w, 1e-5, True, w)
        ref_out, ref_res = ops.norm_linear_torch(x, r, norm_w, 1e-5, True, w)
        assert_close_to_reference(out, ref_out, rel_l2=1e-5, what="norm_linear")
        assert torch.equal(res, ref_res)
        assert_close_to_reference(triton_swiglu_linear(x, w[:, :20]), ops.swiglu_linear_torch(x, w[:, :20]),
                                  rel_l2=1e-5, what="swiglu_linear")
        assert_close_to_reference(lean_linear(x, w), F.linear(x, w), rel_l2=1e-5, what="lean_linear")
        assert triton_norm_linear(x[:0], None, norm_w, 1e-5, True, w)[0].shape == (0, 5, 24)
    with pytest.raises(ValueError, match="weight shape"):
        triton_norm_linear(x, r, norm_w, 1e-5, True, w.t())
    with pytest.raises(ValueError, match="residual shape"):
        triton_norm_linear(x, r[:, :3], norm_w, 1e-5, True, w)
    with pytest.raises(ValueError, match="even"):
        triton_swiglu_linear(x[..., :39], w)
    with pytest.raises(ValueError, match="weight shape"):
        lean_linear(x, w[:, :30])


def _layout_cases(g):
    """(function, plain reference, inputs) of each lean projection, every tensor a view: transposed activations
    and weights, a norm weight and a bias of stride 2, gate|up as columns of a wider tensor."""
    M, N, O, I = 6, 40, 24, 20
    view = lambda t: t.requires_grad_()  # noqa: E731  (the leaves are the views themselves)
    x = view(torch.randn(N, M, generator=g).t())
    residual = view(torch.randn(N, M, generator=g).t())
    norm_w = view((1 + 0.2 * torch.randn(N, 2, generator=g))[:, 1])
    w = view((torch.randn(N, O, generator=g) * N ** -0.5).t())
    b = view(torch.randn(O, 2, generator=g)[:, 0])
    gate_up = view((2 * torch.randn(M, 2 * I + 5, generator=g))[:, 3:2 * I + 3])
    w_down = view((torch.randn(I, O, generator=g) * I ** -0.5).t())
    assert not any(t.is_contiguous() for t in (x, residual, norm_w, w, b, gate_up, w_down))
    return [(triton_norm_linear, ops.norm_linear_torch, (x, residual, norm_w, 1e-5, True, w, b), 2),
            (triton_swiglu_linear, ops.swiglu_linear_torch, (gate_up, w_down, b), 1),
            (lean_linear, F.linear, (x, w, b), 1)]


def test_fused_linears_take_views_of_any_layout():
    """In float32 the plain path's values and gradients for inputs of any layout (the norm and SwiGLU kernels
    read rows at stride N or at the rows' stride: the wrappers copy views first or pass the stride)."""
    g = torch.Generator().manual_seed(12)
    for fused, plain, inputs, n_out in _layout_cases(g):
        got, want = fused(*inputs), plain(*inputs)
        got, want = (got, want) if n_out == 2 else ((got,), (want,))
        leaves = [t for t in inputs if torch.is_tensor(t)]
        grads = [torch.randn(t.shape, generator=g) for t in want]
        for i, (a, b) in enumerate(zip(got, want)):
            # float32, same arithmetic in another order: measured relative L2 errors <= 1e-7
            assert_close_to_reference(a, b, rel_l2=5e-6, what=f"{fused.__name__} output {i}")
        for i, (a, b) in enumerate(zip(torch.autograd.grad(got, leaves, grads),
                                       torch.autograd.grad(want, leaves, grads))):
            assert_close_to_reference(a, b, rel_l2=5e-6, what=f"{fused.__name__} grad of input {i}")


@pytest.mark.parametrize("precision", ["fp8_rowwise", "fp8_tensorwise"])
def test_fp8_linears_take_views_of_any_layout(precision):
    """With FP8 GEMMs (emulated on the CPU, the casts by the Triton kernels) inputs of any layout give bit for bit
    the outputs and gradients of contiguous copies."""
    g = torch.Generator().manual_seed(13)
    for fused, _, inputs, n_out in _layout_cases(g):
        copies = tuple(t.detach().contiguous().requires_grad_() if torch.is_tensor(t) else t for t in inputs)
        grads = None
        results = []
        for args in (inputs, copies):
            out = fused(*args, precision=precision)
            out = out if n_out == 2 else (out,)
            grads = grads or [torch.randn(t.shape, generator=g) for t in out]
            leaves = [t for t in args if torch.is_tensor(t)]
            results.append(list(out) + list(torch.autograd.grad(out, leaves, grads)))
        for i, (a, b) in enumerate(zip(*results)):
            assert torch.equal(a, b), f"{fused.__name__} {precision}: result {i} differs from contiguous copies'"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_fused_linears_gpu_real_shapes(mode):
    """z2all-1.1b's projections at 2 x 2048 tokens: qkv (2048 -> 3072), gate|up (2048 -> 11264), down, o."""
    g, dev = torch.Generator().manual_seed(0), "cuda"
    x_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    x, r = leaf((2, 2048, 2048), g, x_dtype, device=dev), leaf((2, 2048, 2048), g, device=dev)
    norm_w = leaf((2048,), g, scale=0.2, shift=1.0, device=dev)
    for m in (3072, 2 * 5632):
        w = leaf((m, 2048), g, scale=2048 ** -0.5, device=dev)
        compare(triton_norm_linear, ops.norm_linear_torch, (x, r, norm_w, 1e-5, True, w, None), mode, n_out=2)
    gate_up = leaf((2, 2048, 2 * 5632), g, x_dtype, scale=2.0, device=dev)
    w = leaf((2048, 5632), g, scale=5632 ** -0.5, device=dev)
    compare(triton_swiglu_linear, ops.swiglu_linear_torch, (gate_up, w, None), mode, n_out=1)
    compare(lean_linear, F.linear, (x, leaf((2048, 2048), g, scale=0.02, device=dev), None), mode, n_out=1)


# ---------------------------------------------------------------------------------------------------- the model


def tiny(fused_linear, **kw):
    cfg = load_config("tiny").model
    cfg.ops = OpsConfig.plain()
    cfg.ops.fused_linear = fused_linear
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def loss_and_grads(cfg, tokens, mode, seed=0):
    model = build_model(cfg, seed=0)
    torch.manual_seed(seed)  # the same dropout masks on both paths
    with autocast(mode):
        _, loss = model(tokens, tokens.roll(-1, 1))
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode,tol", [("fp32", 1e-4), ("bf16", 3e-2)])
def test_tiny_model_loss_and_gradients_match_plain_path(mode, tol):
    torch.manual_seed(0)
    tokens = torch.randint(0, 8192, (2, 24))
    fused, loss, grads = loss_and_grads(tiny("triton"), tokens, mode)
    plain, ref_loss, ref_grads = loss_and_grads(tiny("torch"), tokens, mode)
    assert all(b.uses_fused_linear(tokens) for b in fused.layers)
    assert not any(b.uses_fused_linear(tokens) for b in plain.layers)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    assert_close_to_reference(loss, ref_loss, mode, rel_l2=tol / 10, what="loss")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        assert_close_to_reference(grad, ref_grads[name], mode, rel_l2=tol, what=f"grad {name}")


def test_model_with_dropout_bias_kv_cache_and_lora():
    kw = dict(dropout1=0.1, dropout2=0.1, attention_bias=True, n_layers=2)
    torch.manual_seed(1)
    tokens = torch.randint(0, 8192, (2, 16))
    fused, loss, grads = loss_and_grads(tiny("triton", **kw), tokens, "fp32", seed=3)
    _, ref_loss, ref_grads = loss_and_grads(tiny("torch", **kw), tokens, "fp32", seed=3)
    assert_close_to_reference(loss, ref_loss, atol=1e-5, what="loss")
    for name in ("layers.0.self_attn.qkv_proj.bias", "layers.1.self_attn.o_proj.bias",
                 "layers.1.post_attention_layernorm.weight", "layers.0.mlp.down_proj.weight"):
        assert_close_to_reference(grads[name], ref_grads[name], rel_l2=1e-4, what=f"grad {name}")
    # incremental decoding with a KV cache, under inference_mode
    fused.eval()
    with torch.inference_mode():
        full, _ = fused(tokens)
        cache = fused.new_kv_cache(2, 32)
        fused(tokens[:, :10], kv_cache=cache, start_pos=0)
        steps = [fused(tokens[:, t:t + 1], kv_cache=cache, start_pos=t)[0] for t in range(10, 16)]
    assert_close_to_reference(torch.cat(steps, 1), full[:, 10:], rel_l2=1e-5, what="cached decode vs full forward")
    # LoRA wraps the projections: the block keeps the plain path
    from zero2all.model.lora import LoRAConfig, apply_lora

    apply_lora(fused, LoRAConfig(rank=2))
    assert not any(b.uses_fused_linear(tokens) for b in fused.layers)
    _, lora_loss = fused(tokens, tokens.roll(-1, 1))
    lora_loss.backward()


# ---------------------------------------------------------------------------------------------------- memory


def test_saved_bytes_match_the_lean_prediction():
    """What autograd keeps for one forward under bf16 autocast: the fused path keeps at most what the design
    predicts (per token per layer: y in bf16 + 1/rms per norm, q/k/v and attention out as before, gate|up; no
    fp32 residual, no projection inputs, no down input, no bf16 weight copies), and less than the plain path by
    the predicted difference."""
    kw = dict(vocab_size=101, hidden_dim=48, intermediate_size=136, n_layers=3, n_heads=6, n_kv_heads=2,
              max_seq_len=32)
    B, T = 3, 29
    tokens = torch.randint(0, 101, (B, T))
    measured = {}
    for fused_linear in ("torch", "triton"):
        cfg = ModelConfig(**kw, ops=OpsConfig(rmsnorm="torch", rope="torch", swiglu="torch", cross_entropy="torch",
                                              attention="sdpa", fused_linear=fused_linear))
        measured[fused_linear] = acc.saved_activation_bytes(build_model(cfg, seed=0), tokens, tokens, torch.bfloat16)
    # CPU SDPA repeats K/V heads for grouped-query attention; the final norm and the loss stay on the torch path
    head = acc.head_activation_bytes_per_token(cfg, "bf16-amp", fused_cross_entropy=False,
                                               fused_kernels=False)["total"]

    def predicted(fused_linear):
        per_layer = acc.activation_bytes_per_token_per_layer(cfg, "bf16-amp", fused_kernels=False, kv_repeated=True,
                                                             fused_linear=fused_linear)["total"]
        return B * T * (cfg.n_layers * per_layer + head)

    lean, plain = measured["triton"], measured["torch"]
    # a little is left over on either path: the RoPE cos/sin tables and per-op scalars
    assert predicted(True) <= lean["activations"] <= predicted(True) * 1.02
    h, e, I = cfg.hidden_dim, 2, cfg.intermediate_size
    # per layer and norm, the plain path keeps the fp32 residual 4h, the fp32 normalised value 4h (torch RMSNorm)
    # and the projection input e*h, the lean one y in e*h; plus the down input e*I and silu(gate) e*I
    saved_per_token_layer = 2 * (4 * h + 4 * h) + 2 * e * I
    assert plain["activations"] - lean["activations"] == pytest.approx(
        B * T * cfg.n_layers * saved_per_token_layer, rel=0.02)
    assert predicted(False) - predicted(True) == B * T * cfg.n_layers * saved_per_token_layer
    # autocast's bf16 weight copies: only the LM head's is left
    assert lean["weight_copies"] == acc.autocast_weight_copy_bytes(cfg, "bf16-amp", fused_linear=True) \
        == 2 * cfg.padded_vocab_size * h
    assert plain["weight_copies"] == acc.autocast_weight_copy_bytes(cfg, "bf16-amp")
