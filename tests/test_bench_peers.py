"""The peer rows' plumbing that runs without the peers: missing-package reasons, failure lines, row names,
torchtitan variant parsing, the worker's command line and the tables."""

import importlib.util
import sys
from pathlib import Path

import pytest

from zero2all import bench
from zero2all.bench import peers as bench_peers

ROOT = Path(__file__).resolve().parent.parent


def _load_harness():
    spec = importlib.util.spec_from_file_location("torchtitan_peer", ROOT / "benchmarks" / "torchtitan_peer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _find_spec_without(*missing):
    return lambda name: None if name in missing else object()


def test_missing_reason_names_the_first_missing_package():
    assert bench_peers.missing_reason("tt_fp8", find_spec=_find_spec_without()) is None
    reason = bench_peers.missing_reason("tt_fp8", find_spec=_find_spec_without("torchao"))
    assert reason.startswith("torchao not installed") and "peer_wheels.sh" in reason
    assert bench_peers.missing_reason("tt_compile", find_spec=_find_spec_without("torchao")) is None
    assert "torchtitan" in bench_peers.missing_reason("tt_compile", find_spec=_find_spec_without("torchtitan"))
    assert "torchao" in bench_peers.missing_reason("hf_ao_fp8", find_spec=_find_spec_without("torchao"))
    with pytest.raises(ValueError, match="unknown peer row 'tt_nope'"):
        bench_peers.missing_reason("tt_nope")


def test_a_missing_peer_row_reports_its_reason_in_the_table(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("torchtitan"))
    r = bench_peers.run_row("tt_compile", None, 8, 2048, 4, 3, 2)
    assert r.tokens_per_s is None and r.error == "torchtitan not installed (carry the peer wheels: see " \
                                                  "benchmarks/peer_wheels.sh)"
    ok = bench.BenchResult("hf", "HF Llama (sdpa) eager", 8, 2048, 4, step_ms=500.0, tokens_per_s=65536.0,
                           mfu=0.5, peak_gb=40.0)
    table = bench.format_table([ok, r])
    assert "torchtitan + compile" in table and "torchtitan not installed" in table
    assert "best peer: HF Llama (sdpa) eager" in table


def test_peer_rows_are_bench_rows():
    assert set(bench_peers.ROWS) == set(bench.EXTERNAL_PEER_ROWS) <= set(bench.PEER_ROWS)
    assert all(row in bench.ROW_LABELS for row in bench_peers.ROWS)
    assert set(bench_peers.TT_FLOAT8) == {r for r in bench_peers.ROWS if r.startswith("tt_")}


def test_failure_reason_takes_the_exception_line():
    out = "W1123 some warning\n[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 3\n" \
          "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\nE1123 failed\n"
    assert bench_peers.failure_reason(out, 1) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate " \
                                                 "2.00 GiB"
    assert bench_peers.failure_reason("ModuleNotFoundError: No module named 'tyro'", 1) == \
        "ModuleNotFoundError: No module named 'tyro'"
    assert bench_peers.failure_reason("nothing useful\n", 9) == "exit code 9"


def test_worker_command_round_trips_through_the_worker_parser(tmp_path):
    cmd = bench_peers.titan_command(nproc=2, variant="cp2@65536x1", result=tmp_path / "r.json", config="tiny",
                                    micro_batch=1, seq=65536, accum=4, steps=3, warmup=2, cp=2, float8="rowwise",
                                    compile=False, overrides=["model.n_layers=2"])
    assert cmd[:5] == [cmd[0], "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = bench_peers.worker_parser().parse_args(cmd[cmd.index("zero2all.bench.peers") + 1:])
    assert (args.micro_batch, args.seq, args.accum, args.cp, args.tp, args.pp) == (1, 65536, 4, 2, 1, 1)
    assert args.float8 == "rowwise" and args.no_compile and args.override == ["model.n_layers=2"]
    assert args.result == str(tmp_path / "r.json") and args.amp == "autocast"


def test_harness_variants():
    h = _load_harness()
    v = h.parse_variant("fsdp", 2)
    assert (v.tp, v.pp, v.cp, v.seq, v.micro_batch) == (1, 1, 1, None, None)
    v = h.parse_variant("cp2@65536x1", 2)
    assert (v.cp, v.seq, v.micro_batch) == (2, 65536, 1)
    v = h.parse_variant("tp2pp2", 8)
    assert (v.tp, v.pp, v.cp) == (2, 2, 1)
    with pytest.raises(ValueError, match="bad variant 'dp2'"):
        h.parse_variant("dp2", 2)
    with pytest.raises(ValueError, match="tp\\*pp\\*cp = 4 to divide the 2 processes"):
        h.parse_variant("tp4", 2)
    assert [h.parse_variant(x, 2).name for x in h.DEFAULT_VARIANTS.split(",")][0] == "fsdp"


def test_harness_table():
    h = _load_harness()
    ok = {"variant": "tp2", "gpus": 2, "seq_len": 2048, "micro_batch": 8, "tokens_per_s": 90000.0, "mfu": 0.36,
          "peak_bytes": [28 * 2 ** 30, 27.5 * 2 ** 30], "device_name": "NVIDIA H200", "torch": "2.11",
          "torchtitan": "0.2.2", "torchao": "0.18.0", "accum": 4, "precision": "bf16 autocast"}
    table = h.format_table([ok, {"variant": "cp2@65536x1", "gpus": 2, "error": "exit code 1"}])
    lines = table.splitlines()
    assert lines[1].split() == ["tp2", "2", "2048", "8", "90,000", "45,000", "36.0%", "28.0", "27.5"]
    assert lines[2].split()[:3] == ["cp2@65536x1", "2", "FAILED:"] and "exit code 1" in lines[2]
    assert "torchtitan 0.2.2" in table and "tp2: bf16 autocast" in table


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan not installed")
def test_torchtitan_flavour_has_our_shape():
    import torch

    from zero2all.accounting import param_counts
    from zero2all.config import load_config

    bench_peers._stub_datasets()
    from torchtitan.models.llama3 import Transformer

    for preset in ("tiny", "z2all-1.1b"):
        cfg = load_config(preset, []).model
        with torch.device("meta"):
            model = Transformer(bench_peers.titan_model_args(cfg, 256))
        assert sum(p.numel() for p in model.parameters()) == param_counts(cfg).total
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    jc = bench_peers.titan_job_config(mb=8, seq=2048, accum=4, dp=1, float8="tensorwise")
    assert jc.model.converters == [bench_peers.FLOAT8_CONVERTER] and jc.quantize.linear.float8.recipe_name is None
    assert bench_peers.FLOAT8_CONVERTER in _registry_model_converter_cls


def test_run_titan_returns_the_result_the_failure_line_or_the_timeout(tmp_path):
    out = tmp_path / "r.json"
    write = f"import json; open({str(out)!r}, 'w').write(json.dumps({{'tokens_per_s': 1.5}}))"
    assert bench_peers.run_titan([sys.executable, "-c", write], out, 60, log=lambda s: None) == \
        ({"tokens_per_s": 1.5}, None)
    out.unlink()
    fail = "import sys; print('[rank0]: ValueError: bad mesh'); sys.exit(3)"
    logged = []
    assert bench_peers.run_titan([sys.executable, "-c", fail], out, 60, log=logged.append) == \
        (None, "ValueError: bad mesh")
    assert "bad mesh" in logged[0]
    hang = "import time; time.sleep(60)"
    assert bench_peers.run_titan([sys.executable, "-c", hang], out, 1, log=lambda s: None) == \
        (None, "timed out after 1 s")
