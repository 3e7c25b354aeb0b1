"""Vocab-parallel LM head + cross-entropy (Megatron's vocab-parallel loss), fused: never the (tokens x vocab)
logits, never a DTensor op.

Each of the t tensor-parallel ranks holds rows [v0, v0 + V/t) of the LM head W. For a token with hidden state h
and target y, the logits are split over the ranks, so the softmax normaliser needs one reduction across them::

    lse_r = log sum_{j in rank r} exp(h . w_j)                 (each rank, its own rows)
    M     = max_r lse_r                                        (all-reduce MAX over the tp group)
    lse   = M + log sum_r exp(lse_r - M)                       (all-reduce SUM)
    z_y   = h . w_y on the rank that holds row y, 0 elsewhere  (all-reduce SUM, in the same call)
    loss  = sum_{valid tokens} (lse - z_y) / n_valid

Two small all-reduces of per-token numbers, one per micro-step. The backward recomputes the logits chunk by chunk
(one more GEMM: cheaper than keeping them) and forms the local slice of the softmax gradient,
dz_j = (exp(z_j - lse) - [j == y]) / n_valid, whence this rank's dW = dz^T h (its own rows, complete) and its
share of dh = dz W (a partial sum over ranks: the caller's region edge reduces it, as for any Colwise output).
The collectives are ``torch.distributed.all_reduce`` on the tp process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# logits per chunk (tokens x local vocabulary) recomputed at once: 2^26 floats = 256 MiB in float32
CHUNK_ELEMENTS = 2 ** 26


def _chunks(n_tokens: int, vocab_rows: int):
    step = max(1, CHUNK_ELEMENTS // max(vocab_rows, 1))
    for start in range(0, n_tokens, step):
        yield start, min(start + step, n_tokens)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, group, vocab_start: int, ignore_index: int):
        kind = hidden.device.type  # GEMMs in autocast's dtype when it is on (as F.linear would), else hidden's
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype
        ctx.hidden_dtype = hidden.dtype
        with torch.autocast(kind, enabled=False):
            return _VocabParallelCrossEntropy._forward(ctx, hidden.to(dtype), weight, targets, group, vocab_start,
                                                       ignore_index)

    @staticmethod
    def _forward(ctx, hidden, weight, targets, group, vocab_start, ignore_index):
        w = weight.to(hidden.dtype)
        n, rows = hidden.size(0), w.size(0)
        local = targets - vocab_start
        mine = (local >= 0) & (local < rows) & (targets != ignore_index)
        safe = torch.where(mine, local, torch.zeros_like(local))
        lse_local = torch.empty(n, device=hidden.device, dtype=torch.float32)
        target_logit = torch.empty(n, device=hidden.device, dtype=torch.float32)
        for s, e in _chunks(n, rows):
            z = (hidden[s:e] @ w.T).float()
            lse_local[s:e] = torch.logsumexp(z, dim=-1)
            target_logit[s:e] = z.gather(1, safe[s:e, None]).squeeze(1) * mine[s:e]
        top = lse_local.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sums = torch.stack([torch.exp(lse_local - top), target_logit])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = top + sums[0].log()
        valid = targets != ignore_index
        n_valid = valid.sum().clamp(min=1).to(torch.float32)
        loss = torch.where(valid, lse - sums[1], torch.zeros_like(lse)).sum() / n_valid
        ctx.save_for_backward(hidden, weight, lse, safe, mine, valid, n_valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        with torch.autocast(grad_loss.device.type, enabled=False):
            return _VocabParallelCrossEntropy._backward(ctx, grad_loss)

    @staticmethod
    def _backward(ctx, grad_loss):
        hidden, weight, lse, safe, mine, valid, n_valid = ctx.saved_tensors
        w = weight.to(hidden.dtype)
        rows = w.size(0)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        scale = (valid.to(torch.float32) * (grad_loss.float() / n_valid))
        for s, e in _chunks(hidden.size(0), rows):
            dz = torch.exp((hidden[s:e] @ w.T).float() - lse[s:e, None])
            dz.scatter_add_(1, safe[s:e, None], -mine[s:e, None].to(dz.dtype))
            dz = (dz * scale[s:e, None]).to(hidden.dtype)
            grad_hidden[s:e] = dz @ w
            grad_weight += (dz.T @ hidden[s:e]).float()
        return grad_hidden.to(ctx.hidden_dtype), grad_weight.to(weight.dtype), None, None, None, None


def vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_start: int, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over targets != ignore_index of ``hidden @ W^T`` whose rows ``weight`` (the local
    (V/t, H) block starting at row ``vocab_start``) are this rank's share. ``hidden`` (N, H) holds every token
    (the same on all ranks of ``group``); its gradient is this rank's partial sum. The loss is the same on every
    rank (0 when no target is valid)."""
    return _VocabParallelCrossEntropy.apply(hidden, weight, targets.reshape(-1), group, vocab_start, ignore_index)
