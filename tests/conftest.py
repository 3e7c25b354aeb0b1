import os

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
