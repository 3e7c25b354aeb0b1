"""Context parallel: each sequence split over the ``cp`` ranks, attention as ring attention over them.

torch's ``context_parallel`` (``torch.distributed.tensor.experimental``) shards the batch's tensors along the
sequence and, while it is active, routes ``F.scaled_dot_product_attention`` to ring attention: every rank keeps
its queries and sees every other rank's keys and values in turn (cp - 1 exchanges of K and V per attention call,
forward and backward), merging the partial softmaxes with their log-sum-exp.

Load balance: under a causal mask the last tokens attend to the most keys. The sequence is cut into 2 * cp chunks
and rank r takes chunks r and 2cp - 1 - r (head and tail), so every rank has the same attention work; hence the
rule seq_len % (2 * cp) == 0 (the plan, ``plan.resolve``).

Positions: the model computes RoPE from explicit ``position_ids``, sharded with the tokens, so each token keeps
its position in the full sequence. Document masks (packed documents with ``doc_ids``) are refused: the ring
kernels take the causal mask only. Everything outside attention is per token (norms, MLP, the loss mean over this
rank's tokens; FSDP2 averages the gradients over dp x cp).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def context_parallel_batch(cp_mesh, model, batch: dict):
    """Within the context: the batch's (B, T) tensors hold this rank's load-balanced chunks of each sequence (put
    back on exit), ``model`` (a :class:`~zero2all.distributed.mesh.MeshModel`) passes the matching positions, and
    SDPA runs as ring attention (forward and backward must both run inside)."""
    from torch.distributed.tensor.experimental import context_parallel

    if batch.get("doc_ids") is not None:
        raise ValueError("context parallel (parallel.cp > 1): document masks (data.document_mask, packed samples) "
                         "are not supported by ring attention; set data.document_mask = false or parallel.cp = 1")
    tokens = batch["input_ids"]
    shape = tokens.shape
    buffers = [v for v in batch.values() if torch.is_tensor(v) and v.shape == shape]
    positions = torch.arange(shape[1], device=tokens.device).expand(shape).contiguous()
    buffers.append(positions)
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                          no_restore_buffers={positions}):
        model.positions = positions
        try:
            yield
        finally:
            model.positions = None


def refusals(req) -> list[str]:
    """Context parallelism's declared rules (``plan.resolve``): ring attention replaces SDPA and takes the causal
    mask only, and each sequence is cut into 2 * cp chunks."""
    c, model, out = req.parallel.cp, req.model, []
    if c == 1:
        return out
    if model is not None and model.ops.attention != "sdpa":
        out.append(f"parallel.cp={c}: ring attention replaces torch's SDPA; model.ops.attention="
                   f"{model.ops.attention!r} would attend within each rank's chunks only: set it to 'sdpa'")
    seq_len = req.seq_len
    if seq_len and seq_len % (2 * c):
        out.append(f"parallel.cp={c}: seq_len={seq_len} is not divisible by 2 * cp = {2 * c} (each sequence is cut "
                   f"into 2 * cp chunks for load-balanced causal attention)")
    if req.data is not None and req.data.document_mask:
        out.append(f"parallel.cp={c} with data.document_mask = true: ring attention takes the causal mask only, not "
                   f"document masks; set one of them off")
    return out
