import os
import re

import pytest
import torch

# Without a GPU the Triton kernels run through the interpreter; set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # The kernel tests that are not marked gpu feed CPU tensors to the Triton kernels, which only the
        # interpreter accepts; on a GPU machine without TRITON_INTERPRET=1 the gpu-marked tests cover the kernels.
        if os.environ.get("TRITON_INTERPRET") != "1":
            cpu_only = pytest.mark.skip(reason="CPU kernel test: needs TRITON_INTERPRET=1")
            for item in items:
                if item.fspath.basename.startswith("test_kernels_") and "gpu" not in item.keywords \
                        and "any_device" not in item.keywords:
                    item.add_marker(cpu_only)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A skip whose reason names the GPU / CUDA is a GPU-only test: it must carry the gpu mark, or `pytest -m gpu` (the
# GPU run) would never select it. Such a skip without the mark is reported as an error. ("needs a GPU or
# TRITON_INTERPRET=1" is not GPU-only: the CPU run has the interpreter.)
_GPU_REASON = re.compile(r"\b(CUDA|GPUs?)\b")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or "gpu" in item.keywords or not isinstance(report.longrepr, tuple):
        return
    reason = report.longrepr[2].removeprefix("Skipped: ")
    if _GPU_REASON.search(reason) and "TRITON_INTERPRET" not in reason:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} skips for lack of a GPU ({reason}) but has no gpu mark: add "
                           "@pytest.mark.gpu so that `pytest -m gpu` selects it")


@pytest.fixture
def config_only_init(tmp_path):
    """A directory that reads as our model directory for building a post-training config (its model section
    only: no weights are needed to build a config)."""
    import json

    from zero2all.config import ModelConfig, OpsConfig, to_dict

    d = tmp_path / "init"
    d.mkdir()
    cfg = ModelConfig(vocab_size=128, hidden_dim=64, intermediate_size=96, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=32, ops=OpsConfig.plain())
    (d / "z2all.json").write_text(json.dumps({"model": to_dict(cfg)}))
    return d
