"""LM head fused with cross-entropy: the loss from hidden states and the head's weight, in chunks of tokens, never
materialising the full (tokens x vocab) logits.

For a chunk of C tokens, logits = h W^T (C x V, one GEMM in the compute dtype), then one Triton program per row::

    lse    = log(sum_j exp(logit_j))                     (online max / sum over blocks of the vocabulary)
    loss_i = lse - logit_target + z * lse^2              (z: PaLM's z-loss; rows whose target is ignore_index: 0)
    dlogit = (softmax * (1 + 2 z lse) - onehot(target)) / n_valid       written over the logits in place

and the chunk's gradients follow by two more GEMMs: dh = dlogit W, dW += dlogit^T h. The loss is
sum_i loss_i / n_valid, the mean over tokens whose target is not ignore_index (``ops.linear_cross_entropy_torch``).

Because the loss is a scalar, its gradients are computed during the forward (when autograd will need them) and
merely scaled by the incoming gradient in the backward: the peak extra memory is one chunk of logits plus the two
gradients, instead of (tokens x vocab) logits in float32 plus their gradient. The weight gradient is accumulated
in float32 over chunks and cast to the weight's dtype at the end. With step fusion (a weight marked in the model's
numerics context, ``kernels/numerics.py``) the op receives the weight as stored (float32 master weights) and casts
it itself (``step_fusion.cast``), each chunk's GEMM adds its product to the running float32 sum
(``step_fusion.addmm_to``), and the gradient reaches autograd in float32 without a bf16 round trip.
"""

import torch
import triton
import triton.language as tl

from zero2all.kernels import step_fusion
from zero2all.kernels.numerics import handle_of, lookup

# at most this many logits per chunk (2^28 = 512 MiB in bf16): 4096 tokens at a 64k vocabulary
CHUNK_ELEMENTS = 2 ** 28


@triton.jit
def _cross_entropy_rows_kernel(LOGITS, stride_row, TARGETS, LOSS, N_VALID, V, ignore_index, z_loss,
                               COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    # out-of-range targets are rejected by the wrapper where that costs no device sync; never read outside the row
    safe_target = tl.where(valid & (target >= 0) & (target < V), target, 0)
    cols = tl.arange(0, BLOCK)
    # pass 1: running max m and running sum s of exp(logit - m)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    x_target = tl.load(base + safe_target).to(tl.float32)
    loss = lse - x_target + z_loss * lse * lse
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    if COMPUTE_GRAD:
        # pass 2: gradient of loss_i / n_valid w.r.t. the logits, over the logits in place
        scale = tl.where(valid, 1.0 / tl.load(N_VALID).to(tl.float32), 0.0)
        softmax_scale = 1.0 + 2.0 * z_loss * lse
        for start in range(0, V, BLOCK):
            idx = start + cols
            mask = idx < V
            x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
            d = tl.exp(x - lse) * softmax_scale - tl.where(idx == safe_target, 1.0, 0.0)
            tl.store(base + idx, (d * scale).to(LOGITS.dtype.element_ty), mask=mask)


def _chunk_rows(n_tokens: int, vocab: int) -> int:
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    if rows >= 256:
        rows = rows // 256 * 256  # whole GEMM tiles
    return min(n_tokens, rows)


@torch.library.custom_op("z2all::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                          z_loss: float, compute_grad: bool, numerics: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (N, H), weight (V, H) (any float dtype: cast to hidden's for the GEMMs), targets (N,) -> (loss,
    d loss/d hidden, d loss/d weight in weight's dtype). ``numerics``: the handle of the model's numerics context
    (``kernels/numerics.py``; its step-fusion marks and casts), 0 for none."""
    N, H = hidden.shape
    V = weight.shape[0]
    hidden = hidden.contiguous()
    w = step_fusion.cast(weight.contiguous(), hidden.dtype, lookup(numerics))   # the compute-dtype weight (V, H)
    targets = targets.contiguous()
    n_valid = (targets != ignore_index).sum()
    row_loss = torch.empty(N, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if compute_grad else hidden.new_empty((0,))
    chunk = _chunk_rows(N, V)
    block = min(4096, triton.next_power_of_2(V))
    fused = w.dtype != weight.dtype          # step fusion: the stored weight came in, its gradient goes out float32
    with torch.autocast(hidden.device.type, enabled=False):  # GEMMs in the inputs' dtype, as the caller chose
        grad_weight = _chunks(hidden, w, targets, ignore_index, z_loss, compute_grad, n_valid, row_loss,
                              grad_hidden, chunk, block, fused)
    if not compute_grad:
        grad_weight = weight.new_empty((0,))
    elif grad_weight is None:                                          # no tokens
        grad_weight = torch.zeros_like(weight)
    else:
        grad_weight = grad_weight.to(weight.dtype)
    loss = row_loss.sum() / n_valid
    return loss, grad_hidden, grad_weight


def _chunks(hidden, w, targets, ignore_index, z_loss, compute_grad, n_valid, row_loss, grad_hidden, chunk, block,
            fused):
    """Loss rows and d hidden per chunk of tokens; returns d W summed over the chunks (None: no rows): in
    float32 with more than one chunk or ``fused``, else in w's dtype."""
    N, V = hidden.shape[0], w.shape[0]
    n_chunks = triton.cdiv(N, chunk) if N else 0
    grad_weight = None
    for start in range(0, N, chunk):
        h = hidden[start:start + chunk]
        logits = h @ w.t()                                               # (C, V), the only logits alive
        _cross_entropy_rows_kernel[(h.shape[0],)](logits, logits.stride(0), targets[start:start + chunk],
                                                  row_loss[start:start + chunk], n_valid, V, ignore_index,
                                                  float(z_loss), COMPUTE_GRAD=compute_grad, BLOCK=block,
                                                  num_warps=8 if block >= 2048 else 4)
        if not compute_grad:                                             # logits now hold d loss / d logits
            continue
        torch.mm(logits, w, out=grad_hidden[start:start + chunk])
        if fused:
            grad_weight = step_fusion.addmm_to(grad_weight, logits.t(), h)
        elif n_chunks == 1:
            grad_weight = logits.t() @ h
        else:
            if grad_weight is None:
                grad_weight = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            if w.dtype == torch.float32:
                grad_weight.addmm_(logits.t(), h)
            else:
                grad_weight += logits.t() @ h
    return grad_weight


@_linear_cross_entropy.register_fake
def _(hidden, weight, targets, ignore_index, z_loss, compute_grad, numerics=0):
    loss = hidden.new_empty((), dtype=torch.float32)
    if compute_grad:
        return loss, torch.empty_like(hidden), torch.empty_like(weight)
    return loss, hidden.new_empty((0,)), weight.new_empty((0,))


def _setup_context(ctx, inputs, output):
    _, grad_hidden, grad_weight = output
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.compute_grad = inputs[5]


def _backward(ctx, grad_loss, _grad_hidden, _grad_weight):
    if not ctx.compute_grad:
        raise RuntimeError("fused_linear_cross_entropy: called without gradients; cannot run backward")
    grad_hidden, grad_weight = ctx.saved_tensors
    g = grad_loss.to(torch.float32)
    return ((grad_hidden * g).to(grad_hidden.dtype), (grad_weight * g).to(grad_weight.dtype), None, None, None, None,
            None)


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               ignore_index: int = -100, z_loss: float = 0.0, numerics=None) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` over targets != ignore_index, plus ``z_loss * mean(lse^2)``.

    hidden (..., H); weight (V, H) (cast to hidden's dtype, as autocast's linear would); targets (...) int64.
    Equal to ``ops.linear_cross_entropy_torch``; gradients flow to hidden and weight. ``numerics``: the model's
    numerics context (``kernels/numerics.py``), whose step-fusion marks the LM head's weight may carry.
    """
    H = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"linear_cross_entropy: weight shape {tuple(weight.shape)} does not match hidden size {H}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: targets shape {tuple(targets.shape)} != hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if not targets.is_cuda and not torch.compiler.is_compiling():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"linear_cross_entropy: target {int(targets[bad][0])} outside the vocabulary "
                             f"[0, {weight.shape[0]}) (and not ignore_index={ignore_index})")
    h2 = hidden.reshape(-1, H)
    # a weight marked for step fusion enters as stored (the op casts it); otherwise autograd casts it here
    w = weight if step_fusion.grad_in_gemm(weight, numerics) else weight.to(hidden.dtype)
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, _, _ = _linear_cross_entropy(h2, w, targets.reshape(-1), int(ignore_index), float(z_loss), compute_grad,
                                       handle_of(numerics))
    return loss
