"""CPU tests of the cubin build (csrc/*.cu -> cubin against libnvshmem_device) and its cache.

The build tests need ``nvcc`` and the NVSHMEM headers + ``libnvshmem_device.a`` (the
``nvidia-nvshmem-cu13`` wheel, installed or unpacked with ``MXCOMM_NVSHMEM_HOME=<dir>/nvidia/nvshmem``);
without them they are skipped with the reason. No GPU is needed.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mxcomm.transport import cubin
from mxcomm.transport.cubin import CubinBuildError
from mxcomm.transport.put_signal import KERNEL_NAMES


def _toolchain_or_skip():
    try:
        return cubin.find_toolchain()
    except CubinBuildError as exc:
        pytest.skip(f"cannot build cubins here: {exc}")


@pytest.fixture(scope="module")
def toolchain():
    return _toolchain_or_skip()


@pytest.fixture(scope="module")
def built_sm90(toolchain, tmp_path_factory):
    cache = tmp_path_factory.mktemp("mxcache")
    return cache, cubin.build_cubin(arch="sm_90", toolchain=toolchain, cache=cache)


def test_sources_compile_to_a_cubin_with_every_kernel(built_sm90, toolchain):
    cache, b = built_sm90
    assert not b.cached and b.path.is_file() and b.path.parent == cache / "cubin"
    assert "sm_90" in b.path.name and b.key in b.path.name
    data = b.path.read_bytes()
    assert data[:4] == b"\x7fELF", "a cubin is an ELF image"
    for name in KERNEL_NAMES:
        assert name.encode() + b"\x00" in data, f"kernel {name} missing from the cubin"
    # NVSHMEM's device state symbol comes from libnvshmem_device (the device link happened).
    assert b"nvshmemi_device_state_d" in data
    assert toolchain.nvshmem_version.count(".") == 2


def test_second_build_hits_the_cache(built_sm90, toolchain):
    cache, first = built_sm90
    mtime = first.path.stat().st_mtime_ns
    again = cubin.build_cubin(arch="sm_90", toolchain=toolchain, cache=cache)
    assert again.cached and again.path == first.path and again.key == first.key
    assert first.path.stat().st_mtime_ns == mtime


def test_cache_key_covers_source_arch_flags_and_versions(toolchain, tmp_path):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    srcs = sorted(cubin.csrc_dir().glob("*.cu"))
    assert srcs, "csrc/ has no .cu files"
    copies = [src_dir / s.name for s in srcs]
    for s, c in zip(srcs, copies):
        shutil.copy(s, c)
    key = cubin._cache_key(copies, "sm_90", toolchain, ("-O3",))
    assert key == cubin._cache_key(copies, "sm_90", toolchain, ("-O3",))
    others = {
        "arch": cubin._cache_key(copies, "sm_100", toolchain, ("-O3",)),
        "flags": cubin._cache_key(copies, "sm_90", toolchain, ("-O2",)),
        "nvshmem": cubin._cache_key(copies, "sm_90", cubin.NvshmemToolchain(
            toolchain.nvcc, toolchain.nvcc_version, toolchain.nvshmem_home, "9.9.9"), ("-O3",)),
        "nvcc": cubin._cache_key(copies, "sm_90", cubin.NvshmemToolchain(
            toolchain.nvcc, "release 99.0", toolchain.nvshmem_home, toolchain.nvshmem_version), ("-O3",)),
    }
    (src_dir / "extra.cuh").write_text("// a header next to the sources\n")
    others["header"] = cubin._cache_key(copies, "sm_90", toolchain, ("-O3",))
    copies[0].write_text(copies[0].read_text() + "\n// edited\n")
    others["source"] = cubin._cache_key(copies, "sm_90", toolchain, ("-O3",))
    assert len({key, *others.values()}) == 1 + len(others), others


def test_compile_error_is_reported_with_nvcc_output(toolchain, tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('#include <nvshmem.h>\nextern "C" __global__ void k() { this_is_not_defined(); }\n')
    with pytest.raises(CubinBuildError, match="this_is_not_defined"):
        cubin.build_cubin([bad], arch="sm_90", toolchain=toolchain, cache=tmp_path / "cache", name="bad")
    assert not list((tmp_path / "cache" / "cubin").glob("*.cubin"))


def test_bad_arguments_raise_before_building(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        cubin.build_cubin(arch="90", cache=tmp_path)
    with pytest.raises(ValueError, match="arch"):
        cubin.build_cubin(arch="compute_90", cache=tmp_path)
    with pytest.raises(ValueError, match="name"):
        cubin.build_cubin(arch="sm_90", name="../x", cache=tmp_path)
    with pytest.raises(ValueError, match="no CUDA sources"):
        cubin.build_cubin([], arch="sm_90", cache=tmp_path)
    with pytest.raises(ValueError, match="not a .cu file"):
        cubin.build_cubin([tmp_path / "missing.cu"], arch="sm_90", cache=tmp_path)


def test_missing_toolchain_parts_are_named(tmp_path):
    with pytest.raises(CubinBuildError, match="nvcc not found"):
        cubin.find_toolchain(nvcc=tmp_path / "no-nvcc")
    nvcc = cubin.find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc here to test the NVSHMEM lookup past it")
    with pytest.raises(CubinBuildError, match="MXCOMM_NVSHMEM_HOME"):
        cubin.find_toolchain(nvcc=nvcc, nvshmem_home=tmp_path)


def test_nvshmem_version_parsing(tmp_path):
    inc = tmp_path / "include" / "non_abi"
    inc.mkdir(parents=True)
    (inc / "nvshmem_version.h").write_text(
        "#define NVSHMEM_VENDOR_MAJOR_VERSION 3\n#define NVSHMEM_VENDOR_MINOR_VERSION 4\n"
        "#define NVSHMEM_VENDOR_PATCH_VERSION 5\n"
    )
    assert cubin.nvshmem_version(tmp_path) == "3.4.5"
    (inc / "nvshmem_version.h").write_text("#define NVSHMEM_VENDOR_MAJOR_VERSION 3\n")
    with pytest.raises(CubinBuildError, match="MINOR"):
        cubin.nvshmem_version(tmp_path)


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MXCOMM_CACHE", str(tmp_path / "c"))
    assert cubin.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MXCOMM_CACHE")
    assert cubin.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "mxcomm"
