"""EPConfig: the static description of one expert-parallel group (sizes, layout, precision, backend).

Every rank of a group must hold an identical config (``EPGroup`` checks it at construction);
buffers of the GPU backend are sized from it once (see :func:`mxcomm.ep.plan.buffer_sizes`).
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, fields
from typing import Optional

from ..mx.modes import SCALE_MODES
from .nvshmem.launch_config import LaunchConfig

PRECISIONS = ("mxfp8", "bf16")
BACKENDS = ("torch", "nvshmem")
ALIGNS = (32, 128)
#: How rows move, one vocabulary: ``EPGroup.path`` is one of these; ``EPConfig.transport`` is ``"auto"`` or one of
#: the nvshmem backend's paths (``"local"``, ``"pull"``, ``"push"``, ``"put"``).
PATHS = ("all_to_all", "local", "pull", "push", "put")
TRANSPORTS = ("auto", "local", "pull", "push", "put")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class EPConfig:
    """Configuration of an expert-parallel dispatch/combine group.

    Attributes:
        num_experts: E, global number of experts; expert ``e`` lives on rank ``e // (E / world)``.
        hidden: H, row width (elements); a multiple of 32 (one MX block = 32 values).
        topk: k, routed experts per token (columns of ``topk_idx``).
        max_tokens_per_rank: capacity: the most tokens ``T`` one rank may pass to ``dispatch``.
        align: 32 or 128: each local expert's group of rows is padded to a multiple of this with
            zero rows (and zero scale bytes).
        precision: dispatch payload: ``"mxfp8"`` (E4M3 + E8M0 scales) or ``"bf16"``.
        scale_mode: MX scale rule, ``"rceil"`` (default) or ``"floor"``; used for the dispatch
            payload and for the quantized combine transport.
        backend: ``"torch"`` (reference, torch.distributed all-to-all; CPU/gloo and GPU/NCCL) or
            ``"nvshmem"`` (GPU kernels over NVSHMEM symmetric buffers).
        num_sms: SMs the GPU backend's kernels may use (None = backend default). Unused by ``torch``.
        timeout_s: bound on every wait (seconds): the GPU backend's device-side waits, and the reference
            backend's collectives.
        exact_sizes: True: outputs sized exactly (needs a device-to-host sync). False: outputs sized
            to the worst case (:func:`mxcomm.ep.plan.max_recv_rows`); real sizes only in the
            device tensors ``offs`` / ``counts`` (the GPU backend then does no host sync; the
            reference backend still syncs internally because all-to-all split sizes live on the host).
        transport: how the ``nvshmem`` backend moves rows, one of :data:`TRANSPORTS` (the path names of
            :data:`PATHS`, which ``EPGroup.path`` reports, plus ``"auto"``). ``"auto"``: ``"local"`` on one rank,
            ``"pull"`` when every peer has a peer pointer (one node, NVLink), ``"put"`` otherwise.
            ``"local"`` (one rank only): nothing leaves the GPU; dispatch quantizes each token row once and
            stores it straight into its output rows. ``"pull"``: each rank quantizes its token rows once into its
            own symmetric send buffer, the sources tell each receiver which token fills each of its rows, and the
            receiver reads them through peer pointers straight into its fresh output; combine and combine backward
            store into the peers' buffers (forced on one rank, it runs through the rank's own buffers: a test of
            that path on one GPU or in the interpreter). ``"push"``: peer-pointer stores for
            dispatch too (quantized rows stored into the receivers' symmetric buffers, then copied out on the
            receiver). ``"put"``: NVSHMEM put-with-signal (``csrc/put_signal.cu``: kernels write into a local
            staging buffer, NVSHMEM puts one block per (destination, expert) and signals), what peers on other
            nodes need; forcing it on one node tests that path on a single GPU. Unused by ``torch``.
        recv_window_rows: the push and put paths' dispatch receive window, rows of their symmetric ``ep.recv_q``: a
            dispatch that brings some rank more rows moves them in rounds of this many (each round: the window's
            rows, the wait, the copy-out into the fresh output, a handshake), so no symmetric buffer depends on the
            routing. None: :func:`mxcomm.ep.plan.recv_window_rows` (the rows a balanced routing brings a rank; on
            the put path at least what its ``recv_q`` holds for combine backward). A window set here also bounds the
            put path's combine backward, whose gradient rows then move in rounds that fit it
            (:func:`mxcomm.ep.plan.put_round_tokens`). Unused by the other paths.
        launch: the ``nvshmem`` backend's kernel launch settings
            (:class:`~mxcomm.ep.nvshmem.launch_config.LaunchConfig`: programs per SM, warps, row chunks); None: its
            defaults. Identical on every rank (receivers count the senders' programs). Unused by ``torch``.
    """

    num_experts: int
    hidden: int
    topk: int
    max_tokens_per_rank: int
    align: int = 32
    precision: str = "mxfp8"
    scale_mode: str = "rceil"
    backend: str = "torch"
    num_sms: Optional[int] = None
    timeout_s: float = 30.0
    exact_sizes: bool = True
    transport: str = "auto"
    recv_window_rows: Optional[int] = None
    launch: Optional[LaunchConfig] = None

    def num_local_experts(self, world_size: int) -> int:
        """Experts per rank, ``E / world`` (call :meth:`validate` first)."""
        return self.num_experts // world_size

    def validate(self, world_size: int) -> None:
        """Raise ValueError listing every problem of this config for a group of ``world_size`` ranks."""
        errs = []
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        for name in ("num_experts", "hidden", "topk", "max_tokens_per_rank", "align"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                errs.append(f"{name} must be a positive int, got {v!r}")
        if not errs:
            if self.num_experts % world_size:
                errs.append(
                    f"num_experts ({self.num_experts}) must be a multiple of the world size ({world_size})"
                )
            if self.hidden % 32:
                errs.append(f"hidden ({self.hidden}) must be a multiple of 32 (the MX block size)")
            if self.topk > self.num_experts:
                errs.append(f"topk ({self.topk}) must not exceed num_experts ({self.num_experts})")
            if self.align not in ALIGNS:
                errs.append(f"align must be one of {ALIGNS}, got {self.align}")
        if self.precision not in PRECISIONS:
            errs.append(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.scale_mode not in SCALE_MODES:
            errs.append(f"scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")
        if self.backend not in BACKENDS:
            errs.append(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.num_sms is not None and (not _is_int(self.num_sms) or self.num_sms < 1):
            errs.append(f"num_sms must be None or a positive int, got {self.num_sms!r}")
        if self.recv_window_rows is not None and (not _is_int(self.recv_window_rows) or self.recv_window_rows < 1):
            errs.append(f"recv_window_rows must be None or a positive int, got {self.recv_window_rows!r}")
        if self.launch is not None and not isinstance(self.launch, LaunchConfig):
            errs.append(f"launch must be None or a LaunchConfig, got {type(self.launch).__name__}")
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or not math.isfinite(self.timeout_s)
            or self.timeout_s <= 0
        ):
            errs.append(f"timeout_s must be a positive finite number, got {self.timeout_s!r}")
        if not isinstance(self.exact_sizes, bool):
            errs.append(f"exact_sizes must be a bool, got {self.exact_sizes!r}")
        if self.transport not in TRANSPORTS:
            errs.append(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        elif self.transport == "local" and _is_int(world_size) and world_size != 1:
            errs.append(f"transport 'local' moves nothing between ranks: it needs a group of 1 rank, not {world_size}")
        if errs:
            raise ValueError("invalid EPConfig: " + "; ".join(errs))

    def fingerprint(self) -> tuple:
        """``((field_name, value), ...)`` over all fields, in declaration order; equal on all ranks of a group."""
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))

    def fingerprint_codes(self) -> list[int]:
        """The fingerprint encoded as one int64 per field (for an all_gather of a plain tensor).

        Ints map to themselves, floats to their IEEE-754 double bits, strings (and other values, such as a
        :class:`LaunchConfig`, by their ``repr``) to a CRC32 tagged so that it cannot collide with small ints, None to
        a fixed sentinel.
        """
        out = []
        for _, v in self.fingerprint():
            if v is None:
                out.append(-(2**62))
            elif isinstance(v, bool):
                out.append(int(v))
            elif isinstance(v, int):
                out.append(v)
            elif isinstance(v, float):
                out.append(struct.unpack("<q", struct.pack("<d", v))[0])
            else:
                out.append((1 << 40) | zlib.crc32(repr(v).encode()))
        return out


__all__ = ["EPConfig", "PRECISIONS", "SCALE_MODES", "BACKENDS", "ALIGNS", "TRANSPORTS", "PATHS"]
