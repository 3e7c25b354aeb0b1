import os

import pytest
import torch

# CPU tests run the Triton kernels through the interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
