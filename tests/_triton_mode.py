"""Import mxcomm's Triton kernel modules in the right Triton mode, from any test module:

    from _triton_mode import load_kernels
    load_kernels("mxcomm.kernels", "mxcomm.gemm")

Without a GPU they are built for Triton's CPU interpreter (``TRITON_INTERPRET=1``; Triton decides when
a kernel is decorated, so this must precede the first import). With a GPU they are built for it even
if an earlier test module left ``TRITON_INTERPRET=1`` set (the variable is restored afterwards, for the
test modules that want it)."""
import importlib
import os
import sys

import torch


def load_kernels(*modules: str) -> None:
    """Import ``modules`` (default ``mxcomm.kernels``) once, in the mode described above."""
    modules = modules or ("mxcomm.kernels",)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        for m in modules:
            importlib.import_module(m)
        return
    if all(m in sys.modules for m in modules):
        return
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        for m in modules:
            importlib.import_module(m)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def run_aot(script: str, tmp_path) -> str:
    """Run ``script`` (Python text that compiles kernels ahead of time for a GPU target) in a fresh
    process without the interpreter and return its stdout; skips the calling test when this Triton
    has no NVIDIA backend, fails it (with stderr) when the script fails."""
    import pathlib
    import subprocess

    import pytest
    import triton.backends

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("triton has no nvidia backend here")
    repo = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    path = tmp_path / "aot.py"
    path.write_text(script)
    r = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
