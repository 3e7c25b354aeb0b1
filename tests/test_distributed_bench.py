"""Smoke test of benchmarks/distributed_throughput.py (CPU, gloo, tiny preset)."""

import pytest


@pytest.mark.slow
def test_distributed_benchmark_smoke(tmp_path):
    """The multi-GPU benchmark's plumbing on CPU: torchrun jobs, DDP/FSDP and the HF peer, one table."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "distributed_throughput.py"), "--smoke",
                           "--gpus", "2", "--variants", "ours-fsdp,peer", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [(r["variant"], r["gpus"]) for r in results] == [("ours-fsdp", 2), ("peer-ddp", 2)]
    for r in results:
        assert r["tokens_per_s"] > 0 and len(r["mem_gib"]) == 2 and r["loss"] > 0
    assert "tok/s/GPU" in proc.stdout and "peer-ddp" in proc.stdout
