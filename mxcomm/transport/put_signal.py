"""Put-with-signal transfers for peers WITHOUT a peer pointer (other nodes), from Python.

Wraps the CUDA C++ kernels of ``csrc/put_signal.cu`` (built and loaded by
:mod:`mxcomm.transport.cubin`); everything runs on torch's current CUDA stream, no host sync.

Protocol of one transfer (every rank, same order):

1. the sender's own kernel writes the bytes for each remote destination into a local symmetric
   STAGING buffer (final layout, e.g. one contiguous block per (destination, local expert));
2. :func:`put_signal` with a :class:`PutBatch` of entries ``(dst_offset, src_offset, nbytes, pe)``:
   each entry's bytes go from ``src + src_offset`` (local) to ``dst + dst_offset`` on PE ``pe``
   (``nvshmemx_putmem_signal_nbi_block``), split into ``chunks`` pieces; after its bytes every piece
   adds 1 to signal word ``signals[signal_index]`` on ``pe`` (``NVSHMEM_SIGNAL_ADD``; an empty piece
   only signals). A call therefore adds ``entries_for_pe * chunks`` to ``pe``'s word. The pieces are
   dealt out over ``blocks`` CUDA blocks (default: one each), so a caller bounds the SMs a transfer
   occupies. :func:`put` moves the same pieces without signals (``nvshmemx_putmem_nbi_block``): many
   small entries then cost no remote atomics, and one signal after a :func:`quiet` says they arrived;
3. the receiver's :func:`wait_signals` waits (bounded by the GPU global timer) until each listed
   word is ``>= epoch * per_epoch`` with ``per_epoch`` = what one call adds (:func:`signals_per_call`),
   then may read the bytes. Signal words only grow (no reset), like mxcomm's Triton flags.
4. before the sender rewrites its staging buffer it must know the puts completed: :func:`quiet`,
   or a protocol step that implies it (the receivers answered after reading).

Errors land in an int64 error word (``(code << 32) | peer``, see :mod:`mxcomm.transport.errors`):
``TIMEOUT_CODE`` with the signal index waited for (= the source rank when ``signals[s]`` is written
by rank ``s``) -> :class:`~mxcomm.transport.errors.PeerTimeout`; :data:`BAD_ENTRY_CODE` with the
destination PE of an entry whose range is outside ``dst``/``src`` (that entry is neither put nor
signalled, so the receiver times out too) -> ``TransportError``. Read them with
:func:`~mxcomm.transport.errors.check_errors`.

Addresses: ``dst``, ``src`` and ``signals`` must lie in the NVSHMEM symmetric heap (checked; pass
this PE's view, which names the same buffer on every PE; remote transports need ``src`` registered).
The C++ error constants equal :data:`~mxcomm.transport.errors.TIMEOUT_CODE` / ``ERR_CODE_SHIFT``
and :data:`BAD_ENTRY_CODE` (checked by the CPU tests). ``force_remote`` in :func:`put_path_peers` routes every other PE through this path on one
node, to test it without a second node (NVSHMEM then copies over NVLink / within the GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BAD_ENTRY_CODE",
    "KERNEL_NAMES",
    "PutBatch",
    "put_path_peers",
    "signals_per_call",
    "put_args",
    "put_blocks",
    "wait_args",
    "put",
    "put_signal",
    "wait_signals",
    "quiet",
]

#: Error code (high 32 bits of an error word) of a put entry out of range; low bits: destination PE.
BAD_ENTRY_CODE = 2
#: Kernels of ``csrc/put_signal.cu``.
KERNEL_NAMES = ("mx_put_signal", "mx_wait_signals", "mx_quiet")
_MAX_CHUNKS = 65535
_MAX_ENTRIES = 2**31 - 1
_MAX_BLOCKS = 2**31 - 1  # grid.x limit
_WAIT_BLOCK = 128


def _int_arg(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _tensor_arg(name: str, t, dtype: torch.dtype | None = None, dim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


@dataclass(frozen=True)
class PutBatch:
    """The entries of one :func:`put_signal` call (device tensors of one length ``n``, one device).

    Attributes:
        dst_offsets: int64 ``[n]`` byte offset into ``dst`` on the destination PE.
        src_offsets: int64 ``[n]`` byte offset into the local ``src`` (staging) buffer.
        nbytes: int64 ``[n]`` bytes of each entry (``>= 0``; 0 = signal only).
        pes: int32 ``[n]`` destination PE of each entry.

    Values may be computed on the device (no host sync); ranges are checked by the kernel
    (:data:`BAD_ENTRY_CODE`). Build from Python lists with :meth:`from_lists`.

    Raises:
        TypeError / ValueError: wrong types, dtypes, shapes, devices, or non-contiguous tensors.
    """

    dst_offsets: torch.Tensor
    src_offsets: torch.Tensor
    nbytes: torch.Tensor
    pes: torch.Tensor

    def __post_init__(self):
        n = None
        for name, dt in (("dst_offsets", torch.int64), ("src_offsets", torch.int64), ("nbytes", torch.int64),
                         ("pes", torch.int32)):
            t = _tensor_arg(f"PutBatch.{name}", getattr(self, name), dt, 1)
            if n is None:
                n, dev = t.numel(), t.device
            elif t.numel() != n:
                raise ValueError(f"PutBatch.{name} has {t.numel()} entries, dst_offsets has {n}")
            elif t.device != dev:
                raise ValueError(f"PutBatch.{name} is on {t.device}, dst_offsets on {dev}")
        if n > _MAX_ENTRIES:
            raise ValueError(f"a PutBatch holds at most {_MAX_ENTRIES} entries, got {n}")

    @property
    def n(self) -> int:
        return self.pes.numel()

    @property
    def device(self) -> torch.device:
        return self.pes.device

    def entries(self, lo: int, hi: int) -> "PutBatch":
        """Entries ``[lo, hi)`` (clamped to ``[0, n]``) as a batch of views (no copy)."""
        lo, hi = max(0, min(lo, self.n)), max(0, min(hi, self.n))
        hi = max(lo, hi)
        return PutBatch(dst_offsets=self.dst_offsets[lo:hi], src_offsets=self.src_offsets[lo:hi],
                        nbytes=self.nbytes[lo:hi], pes=self.pes[lo:hi])

    @staticmethod
    def from_lists(dst_offsets, src_offsets, nbytes, pes, device) -> "PutBatch":
        """Build from Python ints (copied to ``device``); ValueError if lengths differ."""
        lens = {len(dst_offsets), len(src_offsets), len(nbytes), len(pes)}
        if len(lens) != 1:
            raise ValueError(f"entry lists differ in length: {sorted(lens)}")
        i64 = dict(dtype=torch.int64, device=device)
        return PutBatch(
            dst_offsets=torch.tensor(list(dst_offsets), **i64), src_offsets=torch.tensor(list(src_offsets), **i64),
            nbytes=torch.tensor(list(nbytes), **i64), pes=torch.tensor(list(pes), dtype=torch.int32, device=device),
        )


def put_path_peers(ctx, *, force_remote: bool = False) -> tuple[int, ...]:
    """PEs this rank must reach with :func:`put_signal` instead of peer-pointer stores.

    Args:
        ctx: :class:`~mxcomm.transport.bootstrap.NvshmemContext`.
        force_remote: True routes every PE except this one through the put path (tests on one node).

    Returns:
        Sorted PEs: ``ctx.remote_peers`` (no peer pointer, other nodes), or all others when forced.
    """
    if not isinstance(force_remote, bool):
        raise TypeError(f"force_remote must be a bool, got {type(force_remote).__name__}")
    if force_remote:
        return tuple(p for p in range(ctx.world) if p != ctx.rank)
    return tuple(ctx.remote_peers)


def signals_per_call(entries_for_pe: int, chunks: int) -> int:
    """What one :func:`put_signal` call adds to a destination's word: ``entries_for_pe * chunks``."""
    _int_arg("entries_for_pe", entries_for_pe, 0, _MAX_ENTRIES)
    _int_arg("chunks", chunks, 1, _MAX_CHUNKS)
    return entries_for_pe * chunks


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all arguments on the NVSHMEM device)")


def _check_symmetric(name: str, t: torch.Tensor, me: int) -> None:
    """ValueError unless ``t``'s bytes lie in this PE's NVSHMEM symmetric heap (nvshmem_ptr of self)."""
    from nvshmem import bindings

    lo = t.data_ptr()
    hi = lo + max(t.numel() * t.element_size(), 1) - 1
    if bindings.ptr(lo, me) != lo or bindings.ptr(hi, me) != hi:
        raise ValueError(
            f"{name} (address {lo:#x}, {t.numel() * t.element_size()} bytes) is not in the NVSHMEM symmetric "
            "heap: allocate it with mxcomm.transport.SymmetricHeap"
        )


class _StreamRef:
    """A torch CUDA stream as cuda.core's launch takes it (the ``__cuda_stream__`` protocol, version 0)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _stream_ref(stream: torch.cuda.Stream | None, device: torch.device) -> _StreamRef:
    """``stream``, or torch's current stream on ``device``, for cuda.core's launch."""
    s = torch.cuda.current_stream(device) if stream is None else stream
    return _StreamRef(int(s.cuda_stream))


def _module():
    from .cubin import nvshmem_module

    return nvshmem_module(KERNEL_NAMES)


def put_args(dst: torch.Tensor, src: torch.Tensor, batch: PutBatch, signals: torch.Tensor | None,
             signal_index: int | None, n_pes: int, err: torch.Tensor, chunks: int = 1) -> tuple:
    """Check the host-visible arguments of :func:`put_signal` (``signals`` None: :func:`put`, and
    ``signal_index`` must be None too) and return the kernel's argument tuple.

    Checks types, dtypes, shapes, contiguity and that everything is on one device (no sync, no
    symmetric-heap check). Exposed for tests; :func:`put_signal` and :func:`put` call it.
    """
    import numpy as np

    _tensor_arg("dst", dst)
    _tensor_arg("src", src)
    if not isinstance(batch, PutBatch):
        raise TypeError(f"batch must be a PutBatch, got {type(batch).__name__}")
    if signals is None:
        if signal_index is not None:
            raise ValueError("signal_index given without signal words")
    else:
        _tensor_arg("signals", signals, torch.int64, 1)
        _int_arg("signal_index", signal_index, 0, signals.numel() - 1)
    _int_arg("n_pes", n_pes, 1, 2**31 - 1)
    _int_arg("chunks", chunks, 1, _MAX_CHUNKS)
    _tensor_arg("err", err, torch.int64)
    if err.numel() != 1:
        raise ValueError(f"err must hold one int64 error word, got shape {tuple(err.shape)}")
    dev = dst.device
    for name, t in (("src", src), ("batch", batch), ("signals", signals), ("err", err)):
        if t is not None:
            _check_device(name, t, dev)
    sig = 0 if signals is None else signals.data_ptr() + 8 * signal_index
    return (
        np.uint64(dst.data_ptr()), np.uint64(dst.numel() * dst.element_size()),
        np.uint64(src.data_ptr()), np.uint64(src.numel() * src.element_size()),
        np.uint64(batch.dst_offsets.data_ptr()), np.uint64(batch.src_offsets.data_ptr()),
        np.uint64(batch.nbytes.data_ptr()), np.uint64(batch.pes.data_ptr()), np.int32(batch.n), np.int32(chunks),
        np.uint64(sig), np.int32(n_pes), np.uint64(err.data_ptr()),
    )


def put_blocks(n_entries: int, chunks: int, blocks: int | None) -> int:
    """CUDA blocks of one put launch: one per piece (``n_entries * chunks``), at most ``blocks`` (each
    block then takes every ``grid``-th piece)."""
    pieces = min(n_entries * chunks, _MAX_BLOCKS)
    return pieces if blocks is None else min(pieces, _int_arg("blocks", blocks, 1, _MAX_BLOCKS))


def put_signal(
    dst: torch.Tensor,
    src: torch.Tensor,
    batch: PutBatch,
    signals: torch.Tensor,
    signal_index: int,
    err: torch.Tensor,
    *,
    chunks: int = 1,
    threads: int = 256,
    blocks: int | None = None,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Put each entry's bytes into its destination PE's ``dst`` and signal it (non-blocking, on-stream).

    Args:
        dst: symmetric receive buffer, any dtype, contiguous (byte capacity = ``numel * itemsize``);
            this PE's view (the same buffer on every PE is addressed).
        src: this PE's staging buffer (symmetric), any dtype, contiguous.
        batch: :class:`PutBatch` of ``n`` entries (device tensors).
        signals: int64 ``[S]`` symmetric signal words; the word ``signals[signal_index]`` on each
            entry's PE gets ``+1`` per (entry, chunk) after that piece's bytes.
        signal_index: which word (conventionally this rank, so the receiver knows the source).
        err: int64 ``[1]`` error word (``BAD_ENTRY_CODE``; never reset here).
        chunks: pieces per entry (``1..65535``); more pieces = more blocks copying in parallel
            (NVLink) / more outstanding RDMA writes.
        threads: threads per block (multiple of 32, ``32..1024``).
        blocks: at most this many CUDA blocks (each takes every ``blocks``-th piece; default: one
            block per piece): bounds the SMs the copies occupy, e.g. beside a GEMM.
        stream: CUDA stream (default: torch's current stream on ``dst``'s device).

    The sender must not rewrite ``src`` before the puts completed (:func:`quiet` or protocol).

    Raises:
        TypeError / ValueError: bad arguments (before anything is launched), incl. ``dst`` /
            ``signals`` outside the symmetric heap.
        RuntimeError: NVSHMEM not initialised.
    """
    if signals is None:
        raise TypeError("put_signal needs signal words (mxcomm.transport.put_signal.put moves bytes without)")
    _launch_put(dst, src, batch, signals, signal_index, err, chunks, threads, blocks, stream)


def put(
    dst: torch.Tensor,
    src: torch.Tensor,
    batch: PutBatch,
    err: torch.Tensor,
    *,
    chunks: int = 1,
    threads: int = 256,
    blocks: int | None = None,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Put each entry's bytes into its destination PE's ``dst`` without a signal (non-blocking,
    on-stream; ``nvshmemx_putmem_nbi_block``): the bytes have arrived once a :func:`quiet` later on
    the stream has passed, which a signal put after it can tell the receiver. Arguments as
    :func:`put_signal` (an out-of-range entry records :data:`BAD_ENTRY_CODE` and is not put).

    Raises:
        TypeError / ValueError: bad arguments (before anything is launched), incl. ``dst`` / ``src``
            outside the symmetric heap.
    """
    _launch_put(dst, src, batch, None, None, err, chunks, threads, blocks, stream)


def _launch_put(dst, src, batch, signals, signal_index, err, chunks, threads, blocks, stream) -> None:
    """:func:`put_signal` (``signals`` given) or :func:`put` (None): check, then one launch."""
    from .bootstrap import current_context

    _int_arg("chunks", chunks, 1, _MAX_CHUNKS)
    _int_arg("threads", threads, 32, 1024)
    if threads % 32:
        raise ValueError(f"threads must be a multiple of 32, got {threads}")
    if not isinstance(batch, PutBatch):
        raise TypeError(f"batch must be a PutBatch, got {type(batch).__name__}")
    grid = put_blocks(batch.n, chunks, blocks)
    ctx = current_context()
    args = put_args(dst, src, batch, signals, signal_index, ctx.world, err, chunks)
    if dst.device != ctx.device:
        raise ValueError(f"dst is on {dst.device}, NVSHMEM runs on {ctx.device}")
    for name, t in (("dst", dst), ("src", src), ("signals", signals)):
        if t is not None:
            _check_symmetric(name, t, ctx.rank)
    if batch.n == 0:
        return
    from .cubin import _cuda_core

    cc = _cuda_core()
    mod = _module()
    cc.launch(_stream_ref(stream, ctx.device), cc.LaunchConfig(grid=grid, block=threads),
              mod.kernel("mx_put_signal"), *args)


def wait_args(signals: torch.Tensor, indices: torch.Tensor, epoch: torch.Tensor, per_epoch: int, err: torch.Tensor,
              timeout_ns: int) -> tuple:
    """Check the host-visible arguments of :func:`wait_signals`; return the kernel's argument tuple (for tests)."""
    import numpy as np

    _tensor_arg("signals", signals, torch.int64, 1)
    _tensor_arg("indices", indices, torch.int32, 1)
    _tensor_arg("epoch", epoch, torch.int64)
    _tensor_arg("err", err, torch.int64)
    if epoch.numel() != 1 or err.numel() != 1:
        raise ValueError(f"epoch and err must hold one int64 each, got {tuple(epoch.shape)} / {tuple(err.shape)}")
    _int_arg("per_epoch", per_epoch, 1, 2**62)
    _int_arg("timeout_ns", timeout_ns, 1, 2**62)
    for name, t in (("indices", indices), ("epoch", epoch), ("err", err)):
        _check_device(name, t, signals.device)
    if signals.numel() > 2**31 - 1:
        raise ValueError(f"at most 2**31-1 signal words, got {signals.numel()}")
    return (np.uint64(signals.data_ptr()), np.int32(signals.numel()), np.uint64(indices.data_ptr()),
            np.int32(indices.numel()),
            np.uint64(epoch.data_ptr()), np.int64(per_epoch), np.int64(timeout_ns), np.uint64(err.data_ptr()))


def wait_signals(
    signals: torch.Tensor,
    indices: torch.Tensor,
    epoch: torch.Tensor,
    per_epoch: int,
    err: torch.Tensor,
    *,
    timeout_ns: int,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Wait on the device until ``signals[indices[k]] >= epoch * per_epoch`` for every ``k`` (bounded).

    Args:
        signals: int64 ``[S]`` this PE's symmetric signal words (written by peers' :func:`put_signal`).
        indices: int32 ``[n]`` words to wait for (conventionally the source ranks); n may be 0.
            An index outside ``[0, S)`` is not waited for; it records ``BAD_ENTRY_CODE`` in ``err``.
        epoch: int64 ``[1]`` device tensor, the call number (1, 2, ...; graph-replayable).
        per_epoch: what one call adds to each listed word (:func:`signals_per_call`), ``>= 1``.
        err: int64 ``[1]`` error word; a word still short at the deadline records
            ``(TIMEOUT_CODE << 32) | indices[k]`` (atomic max). A wait gives up as soon as the word is
            non-zero (an earlier wait failed), recording nothing: a call fails after one timeout.
        timeout_ns: bound of each wait from the kernel's start (see ``flags.timeout_ns``).
        stream: CUDA stream (default: torch's current stream).

    Later work on the stream sees the bytes delivered before the signals. Check ``err`` with
    :func:`~mxcomm.transport.errors.check_errors` (raises PeerTimeout naming the source).

    Raises:
        TypeError / ValueError: bad arguments (before anything is launched).
    """
    from .bootstrap import current_context

    args = wait_args(signals, indices, epoch, per_epoch, err, timeout_ns)
    ctx = current_context()
    if signals.device != ctx.device:
        raise ValueError(f"signals is on {signals.device}, NVSHMEM runs on {ctx.device}")
    _check_symmetric("signals", signals, ctx.rank)
    n = indices.numel()
    if n == 0:
        return
    from .cubin import _cuda_core

    cc = _cuda_core()
    mod = _module()
    cc.launch(_stream_ref(stream, ctx.device),
              cc.LaunchConfig(grid=(n + _WAIT_BLOCK - 1) // _WAIT_BLOCK, block=_WAIT_BLOCK),
              mod.kernel("mx_wait_signals"), *args)


def quiet(stream: torch.cuda.Stream | None = None) -> None:
    """On-stream ``nvshmem_quiet``: every put this PE issued before is complete (source reusable,
    data delivered) once the stream passes this point."""
    from .bootstrap import current_context

    ctx = current_context()
    from .cubin import _cuda_core

    cc = _cuda_core()
    cc.launch(_stream_ref(stream, ctx.device), cc.LaunchConfig(grid=1, block=1), _module().kernel("mx_quiet"))
