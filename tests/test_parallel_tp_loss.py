"""The fused vocab-parallel LM head + cross-entropy (zero2all/distributed/tp_loss.py) on 2 gloo processes against
the plain float64 cross-entropy of the whole head: the loss, this rank's rows of the weight gradient and the sum
over ranks of the hidden-state gradient, on odd token counts, ignored targets, several chunks, and a batch whose
targets are all ignored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_distributed import free_port, gloo_worker

CASES = [(37, 12, 22, 0.3), (5, 8, 6, 0.0), (9, 4, 10, 1.0)]  # tokens, hidden, vocabulary, ignored fraction


def _check(env) -> dict:
    import torch.distributed as dist

    from zero2all.distributed import tp_loss

    tp_loss.CHUNK_ELEMENTS = 40  # several chunks of tokens even at these sizes
    errors = {}
    for n, h, v, ignored in CASES:
        g = torch.Generator().manual_seed(n * 1000 + v)
        hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
        weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
        targets = torch.randint(0, v, (n,), generator=g)
        targets[torch.rand(n, generator=g) < ignored] = -100
        ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ref = F.cross_entropy(ref_h @ ref_w.T, targets, ignore_index=-100) if (targets != -100).any() else \
            (ref_h.sum() + ref_w.sum()) * 0.0
        ref.backward()
        rows = v // env.world_size
        start = env.rank * rows
        loc_h = hidden.float().requires_grad_()
        loc_w = weight[start:start + rows].float().requires_grad_()
        loss = tp_loss.vocab_parallel_cross_entropy(loc_h, loc_w, targets, None, start)
        (loss * 2.0).backward()
        grad_h = loc_h.grad.double()
        dist.all_reduce(grad_h)  # each rank holds its partial sum
        errors[f"{n}x{h}x{v}"] = [abs(float(loss) - float(ref)),
                                  float((grad_h - 2 * ref_h.grad).abs().max()),
                                  float((loc_w.grad.double() - 2 * ref_w.grad[start:start + rows]).abs().max())]
    return errors


def _entry(rank: int, world: int, port: int, out: str):
    gloo_worker(rank, world, port, out, _check)


@pytest.mark.parametrize("world", [2])
def test_vocab_parallel_cross_entropy_matches_whole_head(tmp_path, world):
    import json

    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    errors = json.loads((tmp_path / "result.json").read_text())
    assert len(errors) == len(CASES)
    for case, (loss, grad_h, grad_w) in errors.items():
        assert loss < 1e-5 and grad_h < 1e-5 and grad_w < 1e-5, (case, loss, grad_h, grad_w)
