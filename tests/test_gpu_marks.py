"""The test suite's own rule: a test that skips for lack of a GPU carries the gpu mark (tests/conftest.py), so
that `pytest -m gpu` on a GPU machine selects every GPU-only test."""

import shutil
import subprocess
import sys
from pathlib import Path

SAMPLE = '''
import pytest

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_unmarked_gpu_only():
    pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs a GPU with FP8")
def test_marked_gpu_only():
    pass

@pytest.mark.skipif(True, reason="needs the optional package foo")
def test_other_skip():
    pass
'''


def test_a_gpu_only_skip_without_the_gpu_mark_fails(tmp_path):
    tests = Path(__file__).parent
    shutil.copy(tests / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(tests.parent / "pyproject.toml", tmp_path / "pyproject.toml")   # the gpu mark's registration
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_sample.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 error" in out and "2 skipped" in out, out     # reported at setup, where the skip is decided
    assert "test_unmarked_gpu_only skips for lack of a GPU (needs a CUDA GPU) but has no gpu mark" in out, out
