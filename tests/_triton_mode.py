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
