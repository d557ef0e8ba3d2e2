"""Process environment that NVSHMEM-based transport needs, and the symmetric-heap size.

NVSHMEM reads its configuration from environment variables when it initialises, so they must
be set by whoever starts the rank processes (a launcher, the CLI, a test spawner): nothing in
mxcomm ever writes ``os.environ``. This module only builds the dictionaries and checks them.

NVLink multicast (NVLS / multimem) must stay disabled: on a shared host it can take GPUs out of
service. :func:`check_env` refuses to run when it is not disabled.

Pure Python: importable and testable on a CPU machine.
"""
from __future__ import annotations

import os
import re
from typing import Mapping

__all__ = [
    "MULTICAST_OFF",
    "SINGLE_NODE",
    "required_env",
    "check_env",
    "symmetric_size_for",
    "parse_size",
    "launcher_env",
]

#: Variables that keep NVLink multicast off (NVSHMEM, torch symmetric memory, NCCL). Always required.
MULTICAST_OFF: dict[str, str] = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
}

#: Single-node settings: no remote (IB/UCX) transport, no NCCL inside NVSHMEM.
SINGLE_NODE: dict[str, str] = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_DISABLE_NCCL": "1",
}

_TRUE = {"1", "true", "yes", "y", "on", "t"}
_FALSE = {"0", "false", "no", "n", "off", "f"}

# Heap headroom: NVSHMEM keeps its own internal objects (team sync arrays, signal words, ...) in the
# symmetric heap and rounds every allocation up; 25 % on top of the buffers plus a fixed reserve.
_HEADROOM_DIVISOR = 4
_HEADROOM_FIXED = 256 << 20
_MIB = 1 << 20
_GIB = 1 << 30


def required_env(multi_node: bool = False) -> dict[str, str]:
    """Variables that must be set in every rank process before NVSHMEM initialises.

    Args:
        multi_node: ``False`` (default) adds the single-node settings ``NVSHMEM_REMOTE_TRANSPORT=none``
            and ``NVSHMEM_DISABLE_NCCL=1``; ``True`` leaves NVSHMEM's remote transport to its defaults.

    Returns:
        A new ``dict`` name -> value (strings).
    """
    env = dict(MULTICAST_OFF)
    if not multi_node:
        env.update(SINGLE_NODE)
    return env


def _is_true(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUE


def _is_false(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _FALSE


def check_env(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``RuntimeError`` unless NVLink multicast is disabled in ``environ``.

    Checks ``NVSHMEM_DISABLE_NVLS`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` are true
    (``1``/``true``/``yes``/``on``) and ``NCCL_NVLS_ENABLE`` is false (``0``/``false``/...).
    Never changes the environment.

    Args:
        environ: mapping to check; defaults to ``os.environ``.

    Raises:
        RuntimeError: naming every variable that is missing or wrong, with the line to fix it.
    """
    env = os.environ if environ is None else environ
    bad = []
    for name, want in MULTICAST_OFF.items():
        have = env.get(name)
        ok = _is_true(have) if want == "1" else _is_false(have)
        if not ok:
            bad.append(f"{name}={have!r} (need {want})")
    if bad:
        fix = " ".join(f"{k}={v}" for k, v in MULTICAST_OFF.items())
        raise RuntimeError(
            "NVLink multicast must be disabled before NVSHMEM starts, but: " + "; ".join(bad)
            + f". Set them in the launching environment (export {fix}), e.g. from "
            "mxcomm.transport.launcher_env(...) or bench/gpu/env.sh; mxcomm never changes os.environ itself."
        )


def symmetric_size_for(nbytes: int) -> str:
    """Value for ``NVSHMEM_SYMMETRIC_SIZE`` that holds ``nbytes`` of mxcomm buffers with headroom.

    Size = ``nbytes * 1.25 + 256 MiB`` (NVSHMEM's own objects, per-allocation rounding), rounded
    up to whole MiB, written as ``"<n>G"`` when a whole number of GiB, else ``"<n>M"``
    (NVSHMEM reads the suffixes as powers of 1024).

    Args:
        nbytes: bytes of symmetric buffers the process will allocate (``int >= 0``).

    Returns:
        e.g. ``symmetric_size_for(0) == "256M"``.

    Raises:
        TypeError: ``nbytes`` is not an ``int`` (``bool`` refused).
        ValueError: ``nbytes < 0``.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    total = nbytes + -(-nbytes // _HEADROOM_DIVISOR) + _HEADROOM_FIXED
    mib = -(-total // _MIB)
    if mib % 1024 == 0:
        return f"{mib // 1024}G"
    return f"{mib}M"


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kKmMgGtT]?)[bB]?\s*$")
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of an ``NVSHMEM_SYMMETRIC_SIZE``-style string (``"1G"``, ``"1280M"``, ``"4096"``).

    Raises:
        ValueError: the text is not ``<digits>[K|M|G|T]``.
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. '1G', '1280M', '4096')")
    return int(m.group(1)) * _SUFFIX[m.group(2).lower()]


def launcher_env(buffer_bytes: int, multi_node: bool = False) -> dict[str, str]:
    """Variables a launcher passes to each rank process: :func:`required_env` plus the heap size.

    Args:
        buffer_bytes: bytes of symmetric buffers each rank allocates (see ``SymmetricHeap.plan_bytes``).
        multi_node: see :func:`required_env`.

    Returns:
        ``required_env(multi_node)`` with ``NVSHMEM_SYMMETRIC_SIZE=symmetric_size_for(buffer_bytes)``.
    """
    env = required_env(multi_node)
    env["NVSHMEM_SYMMETRIC_SIZE"] = symmetric_size_for(buffer_bytes)
    return env
