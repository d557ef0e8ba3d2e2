"""What machine and software a benchmark ran on (shared by ``mxcomm bench`` and ``mxcomm info``).

Every function here only reads: it never initialises NVSHMEM or a process group, and never
changes the environment.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform
import socket
from typing import Optional

# Distribution names that may provide a module (first installed one wins).
_DISTS = {
    "nvshmem4py": ("nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py"),
    "nvidia-nvshmem": ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
    "cuda-python": ("cuda-python", "cuda-bindings"),
    "cuda-core": ("cuda-core",),
    "mpi4py": ("mpi4py",),
    "numpy": ("numpy",),
    "matplotlib": ("matplotlib",),
    "tqdm": ("tqdm",),
}

#: Environment variables worth recording (NVSHMEM / NCCL / symmetric memory / MPS / Triton).
ENV_PREFIXES = ("NVSHMEM_", "NCCL_", "TORCH_SYMM_MEM", "CUDA_VISIBLE_DEVICES", "CUDA_MPS_", "TRITON_INTERPRET")


def _dist_version(names) -> Optional[str]:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def versions() -> dict:
    """Versions of torch, triton, mxcomm, CUDA, NVSHMEM pieces and helpers (None where absent)."""
    out: dict = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        try:
            out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version()) if torch.cuda.is_available() else None
        except Exception:  # noqa: BLE001 - a CPU build has no NCCL
            out["nccl"] = None
    except ImportError:
        out["torch"] = None
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    from .. import __version__ as mxv

    out["mxcomm"] = mxv
    for key, names in _DISTS.items():
        out[key] = _dist_version(names)
    return out


def nvshmem_importable() -> Optional[str]:
    """None if ``nvshmem.core`` imports, else the reason it does not (no import side effects beyond loading)."""
    try:
        importlib.import_module("nvshmem.core")
        return None
    except Exception as e:  # noqa: BLE001 - any load failure is a reason
        return f"{type(e).__name__}: {e}"


def gpus() -> list[dict]:
    """One dict per visible CUDA device: index, name, memory_gib, capability, sm_count, l2_bytes."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(dict(
            index=i, name=p.name, memory_gib=round(p.total_memory / 2**30, 2),
            capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
            l2_bytes=getattr(p, "L2_cache_size", None), uuid=str(getattr(p, "uuid", "")) or None,
        ))
    return out


def peer_matrix() -> list[list[Optional[bool]]]:
    """``m[i][j]``: ``torch.cuda.can_device_access_peer(i, j)`` (None on the diagonal); [] without GPUs."""
    import torch

    if not torch.cuda.is_available():
        return []
    n = torch.cuda.device_count()
    return [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]


def machine() -> dict:
    """Hostname, platform, CPU count, GPU list and count."""
    g = gpus()
    return dict(
        hostname=socket.gethostname(), platform=platform.platform(), cpu_count=os.cpu_count(),
        gpu_count=len(g), gpu_names=sorted({d["name"] for d in g}), gpus=g,
    )


def relevant_env(environ=None) -> dict:
    """The NVSHMEM/NCCL/symmetric-memory/MPS variables of ``environ`` (default os.environ)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)}


__all__ = ["versions", "gpus", "peer_matrix", "machine", "relevant_env", "nvshmem_importable"]
