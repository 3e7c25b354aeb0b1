"""Stage costs measured on the devices: ``parallel.pp_balance = "time"``.

The FLOP model of ``pp.unit_costs`` weighs a block, the embedding and the LM head by their arithmetic. With one
sequence per pipeline microbatch that is not what the time follows: each kernel is small, so the host's cost of
issuing a block's ~50 launches and autograd nodes weighs in (a host-bound stage runs at the speed of its Python,
not of its GPU), and the fused LM head + cross-entropy, the embedding's gather and its scatter-add backward run
at other rates per FLOP than a block's GEMMs. A split balanced by FLOPs then leaves one rank waiting on the other.

So, before the stages are built, every rank times on its own device the forward + backward of one pipeline
microbatch (one sequence of ``seq_len`` tokens, under the run's autocast) through: the embedding, one block of
each kind (dense / MoE: every block of a kind costs the same), and the final norm + LM head + loss. Each
measurement is the median wall time of a few repetitions after a warm-up, synchronised with the device, so that
it is max(host time, device time) of that piece, the cost that adds up along a busy stage. The seconds are
averaged over all ranks (an all-reduce over the world group) so that every rank derives the same split, and the
split itself is ``pp.split_layers``' dynamic program on these costs.

The warm-up also compiles the Triton kernels before the first training step. Gradients left by the timing runs
are cleared. Not available with tensor parallelism (the blocks' collectives would be timed as well).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def _timed(fn, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of ``fn()`` after one warm-up call, each call closed by a device synchronisation."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measured_unit_costs(model: nn.Module, seq_len: int, device: torch.device, compute_dtype: torch.dtype,
                        repeats: int = 3) -> tuple[float, list[float], float]:
    """Seconds per pipeline microbatch of one sequence, forward + backward, of (embedding, each block, final
    norm + LM head + loss): the same triple as ``pp.unit_costs``, timed (see the module docstring)."""
    from zero2all.model.moe import statistics_kept
    from zero2all.model.z2all import Z2all

    cfg = model.cfg
    H, T = cfg.hidden_dim, seq_len
    low = compute_dtype in (torch.bfloat16, torch.float16)
    amp = torch.autocast(device.type, dtype=compute_dtype, enabled=low)
    res_dtype = torch.float32 if cfg.residual_in_fp32 and low else compute_dtype
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(dtype, grad=True):
        return torch.randn(1, T, H, generator=g).to(device, dtype).requires_grad_(grad)

    x, residual = rand(compute_dtype), rand(res_dtype)
    grad_x, grad_res = rand(compute_dtype, False), rand(res_dtype, False)
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=g).to(device)
    cos, sin = Z2all.rope_tables(model, 0, T, device)

    def embedding():
        with amp:
            out = Z2all.embed(model, tokens)
        out.backward(torch.ones_like(out))

    def block_run(block):
        def run():
            with amp:
                out = block(x, residual, cos, sin, None, 0, None, None)
            torch.autograd.backward(out, (grad_x, grad_res))
        return run

    def head():
        with amp:
            h = Z2all.final_norm(model, x, residual)
            # the last stage's work; its MoE terms are left out (the timed blocks' graphs are gone by now)
            _, loss = Z2all.token_loss(model, h, tokens, reduction="sum", counted=True)
        loss.backward()

    by_kind: dict[str, float] = {}
    blocks = []
    with statistics_kept(model):   # the timed MoE forwards do not count in the expert loads
        for block in model.layers:
            kind = type(block.mlp).__name__
            if kind not in by_kind:
                by_kind[kind] = _timed(block_run(block), device, repeats)
            blocks.append(by_kind[kind])
    costs = torch.tensor([_timed(embedding, device, repeats), *blocks, _timed(head, device, repeats)],
                         dtype=torch.float64, device=device)
    model.zero_grad(set_to_none=True)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(costs)
        costs /= dist.get_world_size()
    values = costs.tolist()
    return values[0], values[1:-1], values[-1]
