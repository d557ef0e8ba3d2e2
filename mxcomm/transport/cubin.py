"""CUDA C++ kernels that call NVSHMEM device functions: build to a CUBIN (cached), load, init.

NVSHMEM device code must be device-linked against ``libnvshmem_device.a`` and, in a process where
nvshmem4py initialised NVSHMEM, loaded as a *cubin* whose NVSHMEM device state nvshmem4py then
initialises (``nvshmem.core.library_init``); a shared library linked the same way fails with an
illegal memory access (see shared/GPU.md). The steps here:

1. :func:`find_toolchain`: ``nvcc`` (``$CUDA_HOME/bin``, ``PATH``, ``/usr/local/cuda/bin``) and an
   NVSHMEM install with ``include/nvshmem.h`` and ``lib/libnvshmem_device.a``: ``$MXCOMM_NVSHMEM_HOME``,
   else the ``nvidia-nvshmem-cu13`` wheel (``site-packages/nvidia/nvshmem``).
2. :func:`build_cubin`: ``nvcc -rdc=true -c`` each source, ``nvcc -dlink -cubin`` against
   ``libnvshmem_device``; cached in ``$MXCOMM_CACHE`` (default ``~/.cache/mxcomm``) under
   ``cubin/<name>-<key>.cubin`` with ``key`` = hash of the sources (and headers next to them), the
   arch, the NVSHMEM version, the nvcc version and the flags. Concurrent builders (several ranks)
   serialise on a lock file; the file appears atomically.
3. :func:`load_cubin` / :func:`nvshmem_module`: ``cuda.core.ObjectCode.from_cubin``, kernels by
   name, ``nvshmem.core.library_init(NvshmemKernelObject.from_obj(obj))``; after
   :func:`~mxcomm.transport.bootstrap.init_nvshmem`. :func:`nvshmem_module` keeps one loaded module
   per (name, device, NVSHMEM context) in a small registry.

Steps 1 and 2 need no GPU (CI can check that the sources compile); step 3 needs the GPU,
nvshmem4py and cuda-python (cuda.core).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

__all__ = [
    "CubinBuildError",
    "NvshmemToolchain",
    "CubinBuild",
    "LoadedCubin",
    "csrc_dir",
    "cache_dir",
    "find_nvshmem_home",
    "find_nvcc",
    "find_toolchain",
    "nvshmem_version",
    "arch_for",
    "build_cubin",
    "load_cubin",
    "nvshmem_module",
    "release_modules",
]

#: Bump when the build recipe changes (invalidates every cached cubin).
_RECIPE_VERSION = "1"
_NVCC_TIMEOUT_S = 600
_HEADER_SUFFIXES = (".cuh", ".h", ".hpp")


class CubinBuildError(RuntimeError):
    """nvcc or the NVSHMEM device library is missing, or compiling / device-linking failed."""


@dataclass(frozen=True)
class NvshmemToolchain:
    """What a cubin build uses.

    Attributes:
        nvcc: path of the ``nvcc`` executable.
        nvcc_version: its ``release X.Y, VX.Y.Z`` line.
        nvshmem_home: directory with ``include/nvshmem.h`` and ``lib/libnvshmem_device.a``.
        nvshmem_version: ``"major.minor.patch"`` from ``include/non_abi/nvshmem_version.h``.
    """

    nvcc: Path
    nvcc_version: str
    nvshmem_home: Path
    nvshmem_version: str


@dataclass(frozen=True)
class CubinBuild:
    """Result of :func:`build_cubin`: the cubin path, its cache key, and whether it came from the cache."""

    path: Path
    key: str
    cached: bool


@dataclass(eq=False)
class LoadedCubin:
    """A cubin loaded into the current CUDA context with NVSHMEM's device state initialised.

    Attributes:
        path: the cubin file.
        device: CUDA device it was loaded for.
        obj: the ``cuda.core.ObjectCode``.
        kernels: name -> ``cuda.core`` Kernel, for the names asked for.
        nvshmem_obj: the ``NvshmemKernelObject`` passed to ``library_init`` (for ``library_finalize``).
        ctx: the :class:`~mxcomm.transport.bootstrap.NvshmemContext` it was initialised under.
    """

    path: Path
    device: torch.device
    obj: Any
    kernels: dict
    nvshmem_obj: Any
    ctx: Any = field(repr=False, default=None)

    def kernel(self, name: str):
        """The kernel ``name``; ``KeyError`` naming the loaded ones if absent."""
        try:
            return self.kernels[name]
        except KeyError:
            raise KeyError(f"cubin {self.path.name} has no kernel {name!r} loaded; have {sorted(self.kernels)}") from None


# ------------------------------------------------------------------------------------ toolchain ----

def csrc_dir() -> Path:
    """Directory of mxcomm's CUDA C++ sources: ``mxcomm/csrc`` if present, else the repo's ``csrc``."""
    pkg = Path(__file__).resolve().parents[1]
    for cand in (pkg / "csrc", pkg.parent / "csrc"):
        if cand.is_dir():
            return cand
    raise CubinBuildError(f"mxcomm's CUDA sources (csrc/) not found next to {pkg}; install mxcomm from its repository")


def cache_dir() -> Path:
    """Cubin cache root: ``$MXCOMM_CACHE`` if set, else ``~/.cache/mxcomm`` (not created here)."""
    root = os.environ.get("MXCOMM_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "mxcomm"


def _is_nvshmem_home(p: Path) -> bool:
    return (p / "include" / "nvshmem.h").is_file() and (p / "lib" / "libnvshmem_device.a").is_file()


def find_nvshmem_home() -> Path | None:
    """NVSHMEM install with headers and the device library, or None.

    Looks at ``$MXCOMM_NVSHMEM_HOME``, ``$NVSHMEM_HOME``, then the ``nvidia.nvshmem`` package of the
    ``nvidia-nvshmem-cu13`` wheel (located without importing it).
    """
    for var in ("MXCOMM_NVSHMEM_HOME", "NVSHMEM_HOME"):
        v = os.environ.get(var)
        if v and _is_nvshmem_home(Path(v)):
            return Path(v)
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if _is_nvshmem_home(Path(loc)):
            return Path(loc)
    return None


def find_nvcc() -> Path | None:
    """``nvcc``: ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``PATH``, ``/usr/local/cuda/bin``; or None."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        v = os.environ.get(var)
        if v and (Path(v) / "bin" / "nvcc").is_file():
            return Path(v) / "bin" / "nvcc"
    w = shutil.which("nvcc")
    if w:
        return Path(w)
    p = Path("/usr/local/cuda/bin/nvcc")
    return p if p.is_file() else None


def nvshmem_version(home: Path) -> str:
    """``"major.minor.patch"`` of the NVSHMEM headers under ``home``; CubinBuildError if unreadable."""
    f = Path(home) / "include" / "non_abi" / "nvshmem_version.h"
    try:
        text = f.read_text()
    except OSError as exc:
        raise CubinBuildError(f"cannot read the NVSHMEM version header {f}: {exc}") from exc
    parts = [re.search(rf"#define\s+NVSHMEM_VENDOR_{w}_VERSION\s+(\d+)", text) for w in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise CubinBuildError(f"{f} does not define NVSHMEM_VENDOR_MAJOR/MINOR/PATCH_VERSION")
    return ".".join(m.group(1) for m in parts)


def _nvcc_version(nvcc: Path) -> str:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CubinBuildError(f"running {nvcc} --version failed: {exc}") from exc
    m = re.search(r"release [^\n]*", out.stdout)
    if out.returncode != 0 or not m:
        raise CubinBuildError(f"{nvcc} --version gave no release line: {out.stdout}{out.stderr}")
    return m.group(0).strip()


def find_toolchain(*, nvcc: str | Path | None = None, nvshmem_home: str | Path | None = None) -> NvshmemToolchain:
    """nvcc and NVSHMEM for a cubin build (arguments override the search).

    Raises:
        CubinBuildError: naming what is missing and how to get it.
    """
    nv = Path(nvcc) if nvcc is not None else find_nvcc()
    if nv is None or not nv.is_file():
        raise CubinBuildError(
            f"nvcc not found (looked at {nvcc or '$CUDA_HOME/bin, PATH, /usr/local/cuda/bin'}); install the CUDA toolkit"
        )
    home = Path(nvshmem_home) if nvshmem_home is not None else find_nvshmem_home()
    if home is None or not _is_nvshmem_home(home):
        looked = nvshmem_home or "$MXCOMM_NVSHMEM_HOME, $NVSHMEM_HOME, the nvidia-nvshmem-cu13 wheel"
        raise CubinBuildError(
            f"NVSHMEM headers + libnvshmem_device.a not found (looked at {looked}); pip install nvidia-nvshmem-cu13, "
            "or unpack its wheel and set MXCOMM_NVSHMEM_HOME=<dir>/nvidia/nvshmem"
        )
    return NvshmemToolchain(nvcc=nv, nvcc_version=_nvcc_version(nv), nvshmem_home=home,
                            nvshmem_version=nvshmem_version(home))


def arch_for(device: torch.device | int | None = None) -> str:
    """``"sm_XY"`` of a CUDA device (default: the current one)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _check_arch(arch: str) -> str:
    if not isinstance(arch, str) or not re.fullmatch(r"sm_\d{2,3}[af]?", arch):
        raise ValueError(f"arch must look like 'sm_90' or 'sm_100a', got {arch!r}")
    return arch


# ------------------------------------------------------------------------------------ build ----

def _cache_key(sources: Sequence[Path], arch: str, tc: NvshmemToolchain, flags: Sequence[str]) -> str:
    h = hashlib.sha256()
    h.update(f"recipe={_RECIPE_VERSION}\narch={arch}\nnvshmem={tc.nvshmem_version}\nnvcc={tc.nvcc_version}\n".encode())
    h.update(("flags=" + " ".join(flags) + "\n").encode())
    headers = sorted({p for s in sources for p in s.parent.iterdir() if p.suffix in _HEADER_SUFFIXES})
    for p in list(sources) + headers:
        h.update(f"file={p.name}\n".encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:24]


def _run(cmd: list[str], cwd: Path) -> None:
    try:
        r = subprocess.run(cmd, cwd=str(cwd), capture_output=True, text=True, timeout=_NVCC_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise CubinBuildError(f"{' '.join(cmd)} did not finish in {_NVCC_TIMEOUT_S} s") from exc
    except OSError as exc:
        raise CubinBuildError(f"could not run {cmd[0]}: {exc}") from exc
    if r.returncode != 0:
        raise CubinBuildError(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}{r.stderr}")


def build_cubin(
    sources: Iterable[str | Path] | None = None,
    *,
    arch: str,
    name: str = "mxcomm_nvshmem",
    toolchain: NvshmemToolchain | None = None,
    cache: str | Path | None = None,
    flags: Sequence[str] = ("-O3",),
) -> CubinBuild:
    """Compile CUDA sources that use NVSHMEM device functions into one cubin (or reuse the cached one).

    Args:
        sources: ``.cu`` files (default: every ``*.cu`` in :func:`csrc_dir`).
        arch: ``"sm_90"`` (H100/H200), ``"sm_100"``, ...; see :func:`arch_for`.
        name: file name prefix in the cache.
        toolchain: from :func:`find_toolchain` (default: found now).
        cache: cache root (default :func:`cache_dir`); cubins go to ``<cache>/cubin``.
        flags: extra nvcc flags for the compile step (part of the cache key).

    Returns:
        :class:`CubinBuild` (path, key, cached).

    Raises:
        ValueError: no sources / bad arch or name; CubinBuildError: toolchain missing or nvcc failed.
    """
    arch = _check_arch(arch)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"name must be a plain file name prefix, got {name!r}")
    srcs = sorted(csrc_dir().glob("*.cu")) if sources is None else [Path(s) for s in sources]
    if not srcs:
        raise ValueError("no CUDA sources to build")
    for s in srcs:
        if s.suffix != ".cu" or not s.is_file():
            raise ValueError(f"not a .cu file: {s}")
    tc = find_toolchain() if toolchain is None else toolchain
    flags = tuple(flags)
    key = _cache_key(srcs, arch, tc, flags)
    out_dir = Path(cache if cache is not None else cache_dir()).expanduser() / "cubin"
    out = out_dir / f"{name}-{arch}-{key}.cubin"
    if out.is_file():
        return CubinBuild(out, key, True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building the same cubin
        if out.is_file():
            return CubinBuild(out, key, True)
        gencode = f"-gencode=arch=compute_{arch[3:].rstrip('af')},code={arch}"
        inc, lib = tc.nvshmem_home / "include", tc.nvshmem_home / "lib"
        with tempfile.TemporaryDirectory(prefix="build-", dir=out_dir) as tmp:
            tmpd = Path(tmp)
            objs = []
            for i, s in enumerate(srcs):
                o = tmpd / f"{i}_{s.stem}.o"
                _run([str(tc.nvcc), *flags, gencode, "-rdc=true", f"-I{inc}", "-c", str(s.resolve()), "-o", str(o)], tmpd)
                objs.append(str(o))
            cub = tmpd / "out.cubin"
            _run([str(tc.nvcc), gencode, "-dlink", "-cubin", *objs, "-o", str(cub), f"-L{lib}", "-lnvshmem_device"], tmpd)
            os.replace(cub, out)
    return CubinBuild(out, key, False)


# ------------------------------------------------------------------------------------ load ----

def _cuda_core():
    from .bootstrap import _INSTALL_HINT
    from .errors import NvshmemUnavailable

    try:
        import cuda.core as cc

        cc.ObjectCode  # noqa: B018 - cuda.core >= 0.4 exports it at the top level
    except (ImportError, AttributeError):
        try:
            import cuda.core.experimental as cc
        except ImportError as exc:
            raise NvshmemUnavailable(f"{_INSTALL_HINT}; importing cuda.core failed: {exc}") from exc
    return cc


def load_cubin(path: str | Path, kernel_names: Sequence[str], *, device: torch.device | int | None = None) -> LoadedCubin:
    """Load ``path`` into ``device``'s primary context and initialise NVSHMEM's device state for it.

    Needs NVSHMEM initialised in this process (:func:`~mxcomm.transport.bootstrap.init_nvshmem`).

    Args:
        path: a cubin from :func:`build_cubin`.
        kernel_names: ``extern "C"`` kernels to look up (KeyError-free later use).
        device: CUDA device (default: the NVSHMEM context's).

    Raises:
        RuntimeError: NVSHMEM not initialised; NvshmemUnavailable: cuda.core / nvshmem4py missing;
        TransportError: library_init failed.
    """
    from .bootstrap import current_context, import_nvshmem
    from .errors import TransportError

    ctx = current_context()
    dev = ctx.device if device is None else torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    cc = _cuda_core()
    nvshmem_core = import_nvshmem()
    from nvshmem.core import NvshmemKernelObject

    cc.Device(dev.index).set_current()
    data = Path(path).read_bytes()
    obj = cc.ObjectCode.from_cubin(data, name=Path(path).name)
    kernels = {n: obj.get_kernel(n) for n in kernel_names}
    kobj = NvshmemKernelObject.from_obj(obj)
    try:
        nvshmem_core.library_init(kobj)
    except Exception as exc:  # noqa: BLE001 - NvshmemError / NvshmemInvalid
        raise TransportError(f"nvshmem library_init failed for {path}: {exc}") from exc
    return LoadedCubin(path=Path(path), device=dev, obj=obj, kernels=kernels, nvshmem_obj=kobj, ctx=ctx)


# One loaded module per (name, device index, arch); reloaded when the NVSHMEM context changes.
_MODULES: dict[tuple, LoadedCubin] = {}


def nvshmem_module(kernel_names: Sequence[str], *, name: str = "mxcomm_nvshmem",
                   sources: Iterable[str | Path] | None = None) -> LoadedCubin:
    """Build (cached) and load mxcomm's NVSHMEM cubin for the current NVSHMEM context's device, once.

    Args:
        kernel_names: kernels the caller will launch (looked up on first load).
        name / sources: see :func:`build_cubin` (default: every ``csrc/*.cu``).
    """
    from .bootstrap import current_context

    ctx = current_context()
    arch = arch_for(ctx.device)
    key = (name, ctx.device.index, arch)
    mod = _MODULES.get(key)
    if mod is not None and mod.ctx is ctx:
        for n in kernel_names:
            if n not in mod.kernels:
                mod.kernels[n] = mod.obj.get_kernel(n)
        return mod
    built = build_cubin(sources, arch=arch, name=name)
    mod = load_cubin(built.path, kernel_names, device=ctx.device)
    _MODULES[key] = mod
    return mod


def release_modules() -> None:
    """``library_finalize`` every module loaded under the current NVSHMEM context; forget all.

    Call before :func:`~mxcomm.transport.bootstrap.finalize` (optional: NVSHMEM finalisation also
    invalidates them; later :func:`nvshmem_module` calls load afresh).
    """
    from .bootstrap import current_context, import_nvshmem, is_initialized

    ctx = current_context() if is_initialized() else None
    live = [m for m in _MODULES.values() if ctx is not None and m.ctx is ctx]
    _MODULES.clear()
    if live:
        nvshmem_core = import_nvshmem()
        for m in live:
            nvshmem_core.library_finalize(m.nvshmem_obj)
