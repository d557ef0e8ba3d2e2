"""The host-cost tool's CUDA C++ twin of its Triton no-op kernel builds to a cubin (no GPU needed; nvcc must be there)."""
import shutil
from pathlib import Path

import pytest

from mxcomm.bench.tools.host_costs import build_noop_cubin


@pytest.mark.skipif(not (shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()), reason="nvcc not installed")
def test_noop_cubin_builds_for_sm90(tmp_path):
    path = build_noop_cubin("sm_90", tmp_path)
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF"  # a cubin is an ELF image
    assert b"noop12" in data  # the kernel cuda.core looks up by name
