"""Transport exceptions and the device error word that bounded waits write.

A kernel that gives up waiting records one int64 *error word* in a small device tensor:
``word = (code << 32) | peer`` with ``code >= 1`` (``TIMEOUT_CODE`` for a wait that passed its
deadline) and ``peer`` the rank it waited for. ``0`` means no error. Several waits may share one
word (``atomic_max`` keeps the largest) or use one word each (an int64 tensor of any shape).
:func:`check_errors` reads the words back and raises :class:`PeerTimeout` naming the peer.

Pure Python + torch: importable on a CPU machine.
"""
from __future__ import annotations

import torch

__all__ = [
    "TransportError",
    "NvshmemUnavailable",
    "PeerTimeout",
    "TIMEOUT_CODE",
    "ERR_CODE_SHIFT",
    "error_word",
    "decode_error_word",
    "check_errors",
]

#: Error code of a bounded wait that passed its deadline.
TIMEOUT_CODE = 1
#: Bit position of the code inside the error word; the low 32 bits hold the peer rank.
ERR_CODE_SHIFT = 32
_PEER_MASK = (1 << ERR_CODE_SHIFT) - 1


class TransportError(RuntimeError):
    """A communication step failed (peer unreachable, protocol error recorded by a kernel, ...)."""


class NvshmemUnavailable(ImportError):
    """nvshmem4py / cuda-python are not installed (install the ``gpu`` extra)."""


class PeerTimeout(TransportError):
    """A bounded device-side wait passed its deadline before ``peer`` signalled.

    Attributes:
        peer: rank that was waited for (the largest one when several timed out).
        what: what was waited for (e.g. ``"dispatch: token rows"``).
        rank: the rank that waited, if known.
        peers: every peer rank found in the error words, sorted.
        missing: peers known not to have entered the operation at all (sleeping, dead, or stuck
            elsewhere), sorted; empty when unknown (device waits cannot tell).

    ``message`` (optional) replaces the generated text, for callers that know more (the census of
    :mod:`mxcomm.transport.bounded` names what every rank was doing).
    """

    def __init__(
        self, peer: int, what: str, *, rank: int | None = None, peers: tuple[int, ...] | None = None,
        missing: tuple[int, ...] = (), message: str | None = None,
    ):
        self.peer = int(peer)
        self.what = str(what)
        self.rank = rank
        self.peers = tuple(sorted(peers)) if peers else (self.peer,)
        self.missing = tuple(sorted(missing))
        self.message = message
        if message is None:
            who = f"rank {rank}" if rank is not None else "this rank"
            more = f" (all peers that timed out: {list(self.peers)})" if len(self.peers) > 1 else ""
            message = (
                f"{who} timed out waiting for peer {self.peer}: {self.what}{more}. The peer may have crashed, "
                "be stuck, or not have entered the matching operation; raise the timeout if it is only slow."
            )
        super().__init__(message)

    def __reduce__(self):  # picklable across processes (mpi4py / multiprocessing)
        return (_rebuild_peer_timeout, (self.peer, self.what, self.rank, self.peers, self.missing, self.message))


def _rebuild_peer_timeout(peer, what, rank, peers, missing=(), message=None):
    return PeerTimeout(peer, what, rank=rank, peers=peers, missing=missing, message=message)


def error_word(code: int, peer: int) -> int:
    """Host-side encoding of an error word (the same bits the Triton waits write).

    Raises:
        ValueError: ``code`` not in ``1..2**31-1`` or ``peer`` not in ``0..2**32-1``.
    """
    if not 1 <= int(code) < (1 << 31):
        raise ValueError(f"error code must be in 1..2**31-1, got {code}")
    if not 0 <= int(peer) <= _PEER_MASK:
        raise ValueError(f"peer must be in 0..2**32-1, got {peer}")
    return (int(code) << ERR_CODE_SHIFT) | int(peer)


def decode_error_word(word: int) -> tuple[int, int]:
    """``(code, peer)`` of an error word (``(0, 0)`` for no error)."""
    word = int(word)
    return word >> ERR_CODE_SHIFT, word & _PEER_MASK


def check_errors(err: torch.Tensor, *, what: str = "peer signal", rank: int | None = None) -> None:
    """Raise if any device error word in ``err`` is set.

    Reads ``err`` to the host (synchronises with the device when ``err`` is on a GPU); does not
    reset it: zero it (``err.zero_()``) before reusing it for the next call.

    Args:
        err: int64 tensor of error words, any shape, any device.
        what: what the kernel waited for, used in the message.
        rank: the calling rank, used in the message.

    Raises:
        TypeError: ``err`` is not an int64 tensor.
        PeerTimeout: a word carries ``TIMEOUT_CODE``; names the (largest) peer and lists all.
        TransportError: a word carries an unknown code.
    """
    if not isinstance(err, torch.Tensor) or err.dtype != torch.int64:
        raise TypeError(f"err must be an int64 torch.Tensor, got {getattr(err, 'dtype', type(err).__name__)}")
    raise_error_words(err.detach().reshape(-1).cpu().tolist(), what=what, rank=rank)


def raise_error_words(words, *, what: str = "peer signal", rank: int | None = None) -> None:
    """:func:`check_errors` for error words already on the host (Python ints): raise if any is set."""
    words = [int(w) for w in words if w != 0]
    if not words:
        return
    decoded = [decode_error_word(w) for w in words]
    timeouts = sorted({peer for code, peer in decoded if code == TIMEOUT_CODE})
    if timeouts:
        raise PeerTimeout(timeouts[-1], what, rank=rank, peers=tuple(timeouts))
    code, peer = max(decoded)
    raise TransportError(f"rank {rank}: device error code {code} (peer {peer}) while waiting for {what}")
