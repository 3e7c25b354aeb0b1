"""`z2all pretrain --dry-run --world N` (zero2all/distributed/dryrun.py): every rank of an N-rank mesh built in one
process on torch's fake process group with meta tensors; its shards are the real run's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from zero2all.config import ConfigError, load_config
from zero2all.distributed.dryrun import dry_run

TINY = ["model.n_layers=4", "data.seq_len=64", "train.micro_batch_size=4"]


def total_params(cfg) -> int:
    import torch

    from zero2all.model.z2all import Z2all

    with torch.device("meta"):
        return sum(p.numel() for p in Z2all(cfg.model).parameters())


def test_fsdp_shards_cover_the_model_once_and_ddp_holds_it_whole():
    cfg = load_config("tiny", [*TINY, "parallel.mode='fsdp'"])
    P = total_params(cfg)
    d = dry_run(cfg, 4, "h100")
    assert sum(r["params"] for r in d["ranks"]) == P
    assert all(r["params"] <= P // 4 + 4096 for r in d["ranks"])
    ddp = dry_run(load_config("tiny", TINY), 4, "h100")
    assert [r["params"] for r in ddp["ranks"]] == [P] * 4
    assert ddp["ranks"][0]["model_states_bytes"] == 16 * P           # AdamW, fp32 weights and gradients


def test_pipeline_and_tensor_parallel_ranks_hold_their_share():
    cfg = load_config("tiny", [*TINY, "parallel.pp=2", "parallel.tp=2", "parallel.pp_microbatches=2"])
    d = dry_run(cfg, 4, "h100")
    coords = [r["coords"] for r in d["ranks"]]
    assert coords == [{"pp": 0, "tp": 0}, {"pp": 0, "tp": 1}, {"pp": 1, "tp": 0}, {"pp": 1, "tp": 1}]
    blocks = [r["blocks"] for r in d["ranks"]]     # stages balanced by FLOPs (the last holds the LM head)
    assert blocks[0] == blocks[1] and blocks[2] == blocks[3] and blocks[0] + blocks[2] == 4
    P = total_params(cfg)
    # the two stages split the model; the tp ranks of a stage each hold half of it (norm gains replicated)
    stage = [d["ranks"][0]["params"] + d["ranks"][1]["params"], d["ranks"][2]["params"] + d["ranks"][3]["params"]]
    assert P <= sum(stage) <= P + 4 * 64 * 16


def test_a_mesh_the_plan_refuses_is_refused_before_anything_is_built():
    with pytest.raises(ConfigError, match="does not divide the 3 processes"):
        dry_run(load_config("tiny", [*TINY, "parallel.tp=2"]), 3, "h100")


def test_the_cli_prints_every_rank_and_the_verdict():
    out = subprocess.run([sys.executable, "-m", "zero2all.cli", "pretrain", "--config", "tiny", "--dry-run",
                          "--world", "2", "--gpu", "h100", *TINY, "parallel.mode='fsdp'"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "dry run: tiny on 2 ranks" in out.stdout and "every rank fits" in out.stdout
    assert out.stdout.count("dp ") >= 2
