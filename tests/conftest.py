"""Shared pytest setup: GPU/NVSHMEM tests are skipped cleanly (with a reason) where there is no GPU."""
import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Without a GPU, Triton kernels run in Triton's CPU interpreter. Set before any kernel module is
    # imported (Triton decides at decoration time); never set on a GPU machine, where child processes
    # inherit the environment and must compile real kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")
HAS_NVSHMEM = HAS_CUDA and importlib.util.find_spec("nvshmem") is not None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_nvshmem = pytest.mark.skip(reason="needs a CUDA GPU and nvshmem4py")
    for item in items:
        if "nvshmem" in item.keywords and not HAS_NVSHMEM:
            item.add_marker(skip_nvshmem)
        elif "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
