"""Out of memory (zero2all/train/memory.py): one line with what was held, by category, against the estimate's
prediction and what to change; exit code 1; the categories are the real byte counts."""

from __future__ import annotations

import torch

from zero2all.train.memory import state_breakdown


def test_breakdown_counts_parameters_gradients_and_adamw_state():
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters())
    P = sum(p.numel() for p in model.parameters())
    assert state_breakdown(model, opt) == {"parameters": 4 * P, "gradients": 0, "optimizer": 0}
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    assert state_breakdown(model, opt) == {"parameters": 4 * P, "gradients": 4 * P, "optimizer": 8 * P}


def test_an_out_of_memory_update_ends_with_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    from zero2all import cli
    from zero2all.train.trainer import Trainer

    original = Trainer.forward_backward

    def forward_backward(self, *a, **k):
        if self.step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return original(self, *a, **k)

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)
    code = cli.main(["pretrain", "--config", "tiny", "--out", str(tmp_path / "run"), "--no-progress",
                     "--device", "cpu", "model.n_layers=2", "data.seq_len=32", "train.micro_batch_size=2",
                     "train.max_steps=3", "train.eval_every=0", "train.num_samples=0", "train.tensorboard=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith("z2all pretrain: error: out of memory in update 2"), err
    for part in ("parameters", "gradients", "optimizer", "z2all estimate predicted a peak of",
                 "train.micro_batch_size"):
        assert part in err[0], err[0]
    assert not (tmp_path / "run" / "final").exists()
