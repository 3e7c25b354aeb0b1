import subprocess
import sys

import torch

from zero2all.cli import main
from zero2all.config import ModelConfig, OpsConfig
from zero2all.model.io import load_model, save_model
from zero2all.model.z2all import build_model


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "zero2all.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for name in ("info", "export-hf", "import-hf"):
        assert name in out


def test_export_import_roundtrip_via_cli(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=128, hidden_dim=64, intermediate_size=96, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=16, ops=OpsConfig.plain())
    model = build_model(cfg, seed=0).eval()
    save_model(model, tmp_path / "ck")
    assert main(["export-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hf" / "generation_config.json").exists()
    assert main(["import-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back = load_model(tmp_path / "back")
    tokens = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens)[0], model(tokens)[0])


def test_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["export-hf", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")]) == 2
    assert "neither a Zero2all checkpoint" in capsys.readouterr().err
