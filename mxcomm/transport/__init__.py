"""Transport layer: NVSHMEM bootstrap, symmetric heap, peer pointers, flags with bounded waits,
and bounded named collectives over a torch.distributed group (:mod:`.bounded`).

``import mxcomm.transport`` needs only torch: nvshmem4py / cuda-python load when NVSHMEM is
initialised, and the Triton flag functions (``flags``) load on first use of their names, so that
``TRITON_INTERPRET`` set by a test before that use still takes effect.

Typical use (every rank)::

    from mxcomm import transport as tp
    ctx = tp.init_nvshmem(mpi_comm=MPI.COMM_WORLD)          # or group=..., or uid=/rank=/nranks=
    heap = tp.SymmetricHeap(ctx)
    buf = heap.alloc("recv", (ctx.world, 1024), torch.bfloat16)
    # Triton: base = tl.load(buf.peer_ptrs + p).to(tl.pointer_type(tl.bfloat16)); store; signal_peer(...)
    tp.finalize()

Rank processes must be started with :func:`launcher_env` (NVLink multicast off, heap size).
"""
from .bounded import BoundedGroup, CallTag
from .bootstrap import NvshmemContext, current_context, finalize, init_nvshmem, is_initialized, new_unique_id
from .env import check_env, launcher_env, parse_size, required_env, symmetric_size_for
from .errors import (
    ERR_CODE_SHIFT,
    TIMEOUT_CODE,
    NvshmemUnavailable,
    PeerTimeout,
    TransportError,
    check_errors,
    raise_error_words,
    decode_error_word,
    error_word,
)
from .heap import BufferSpec, SymmetricBuffer, SymmetricHeap

_FLAG_NAMES = ("signal_peer", "wait_flag_geq", "load_acquire", "globaltimer", "deadline_after", "timeout_ns")

__all__ = [
    "required_env", "check_env", "symmetric_size_for", "parse_size", "launcher_env",
    "NvshmemContext", "init_nvshmem", "finalize", "current_context", "is_initialized", "new_unique_id",
    "BufferSpec", "SymmetricBuffer", "SymmetricHeap",
    "BoundedGroup", "CallTag",
    "TransportError", "NvshmemUnavailable", "PeerTimeout", "check_errors", "raise_error_words", "error_word", "decode_error_word",
    "TIMEOUT_CODE", "ERR_CODE_SHIFT",
    *_FLAG_NAMES,
]


def __getattr__(name):
    if name in _FLAG_NAMES:
        from . import flags

        return getattr(flags, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
