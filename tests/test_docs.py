"""The documentation: the README stays a front door, its links land, and every shell example marked runnable in
docs/ runs (``<!-- runnable -->`` on the line before a ```` ```bash ```` block).

The examples run as written, one bash process per block (``set -euo pipefail``), in a scratch directory where
``runs/demo/final`` is a tiny trained model with its tokenizer (what ``make demo`` leaves, in miniature); ``z2all``
and ``python`` are this checkout's.
"""

import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_helpers import exported_tiny_model

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKER = "<!-- runnable -->"


def runnable_blocks() -> list[tuple[str, int, str]]:
    """(file name, line of the fence, script) for each marked block; a marker not followed by a bash fence fails."""
    blocks = []
    for page in sorted(DOCS.glob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARKER:
                continue
            fence = lines[i + 1] if i + 1 < len(lines) else ""
            assert fence.strip() == "```bash", f"{page.name}:{i + 2}: {MARKER} must be followed by ```bash"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            blocks.append((page.name, i + 2, "\n".join(lines[i + 2:end])))
    return blocks


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    assert "make demo" in readme and "make test" in readme
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        assert f": {page.name}" in nav, f"docs/{page.name} is not in mkdocs.yml's nav"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """A scratch directory with runs/demo/final and a bin/ holding ``z2all`` and ``python`` for this checkout."""
    work = tmp_path_factory.mktemp("docs")
    made = exported_tiny_model(tmp_path_factory.mktemp("model"), random.Random(0))
    (work / "runs" / "demo").mkdir(parents=True)
    (made / "ours").rename(work / "runs" / "demo" / "final")
    bin_dir = work / "bin"
    bin_dir.mkdir()
    # scripts rather than links: a link to a venv's python, outside the venv, would not find the venv
    for name, args in (("z2all", "-m zero2all.cli "), ("python", "")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" {args}"$@"\n')
        (bin_dir / name).chmod(0o755)
    return work


BLOCKS = runnable_blocks()


def test_there_are_runnable_examples():
    assert {name for name, _, _ in BLOCKS} >= {"inference-and-serving.md", "model-and-kernels.md",
                                               "evaluation.md", "accounting.md"}


@pytest.mark.parametrize("name,line,script", BLOCKS, ids=[f"{n}:{line}" for n, line, _ in BLOCKS])
def test_runnable_example(demo_dir, name, line, script):
    env = {**os.environ, "PATH": f"{demo_dir / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=demo_dir, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (f"docs/{name}:{line} failed ({time.perf_counter() - t0:.1f} s):\n{script}\n"
                               f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")


def _make_dry_run(target: str, venv: Path) -> str:
    """The commands `make TARGET` would run with VENV=venv (make -n: nothing is installed)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    r = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_demo_installs_the_runtime_only_and_make_test_the_extras(tmp_path):
    venv = tmp_path / "venv"
    demo = _make_dry_run("demo", venv)
    assert "pip install -q -e .\n" in demo and ".[test]" not in demo and "z2all demo --out runs/demo" in demo
    assert 'pip install -q -e ".[test]"' in _make_dry_run("test", venv)
    # after `make demo`: the runtime stamp is there, and `make test` still adds the test extras (only them)
    venv.mkdir()
    (venv / ".runtime").touch()
    after_demo = _make_dry_run("test", venv)
    assert 'pip install -q -e ".[test]"' in after_demo and "-m venv" not in after_demo
    assert "pytest" in after_demo
    (venv / ".installed").touch()
    assert "pip install" not in _make_dry_run("demo", venv)
