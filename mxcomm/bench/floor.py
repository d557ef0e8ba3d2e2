"""The traffic floor of an op: the bytes any design must read and write in device memory, over the copy ceiling.

Per rank ``r`` with ``T`` tokens, hidden ``H`` and ``S_r`` (token, expert) selections routed to its experts:

* ``dispatch``: each source token row read once in BF16 (``T * 2H``) + every received row written once per
  selection in the output dtype (MXFP8 ``H + H/32``, BF16 ``2H``): ``S_r * bytes_per_row``;
* ``combine`` (the mirror): every expert row read once per selection in BF16 (``S_r * 2H``) + each token's output
  row written once in BF16 (``T * 2H``);
* ``combine_bwd`` like dispatch: ``grad_y`` rows read once (``T * 2H``) + per-selection gradient rows written in
  the transport dtype (``S_r * bytes_per_row``);
* ``dispatch_bwd`` like combine: per-selection gradient rows read in BF16 (``S_r * 2H``) + each token's gradient
  row written once in BF16 (``T * 2H``).

Ranks that share one memory (several ranks on one GPU, or CPU processes of one host) add up; ranks with memories
of their own do not, and the busiest memory sets the floor: ``floor bytes = max over memories of the sum over its
ranks``. ``floor_us = floor bytes / copy ceiling`` (the device copy of the same run, read + write bytes counted;
host copy on CPU), and ``time_over_floor = measured median / floor_us`` (1.0 = at the floor).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

FLOOR_OPS = ("dispatch", "combine", "combine_bwd", "dispatch_bwd")
TOWARDS_EXPERTS = ("dispatch", "combine_bwd")  # token rows in, per-selection rows out
TOWARDS_ORIGINS = ("combine", "dispatch_bwd")  # per-selection BF16 rows in, token rows out


def row_bytes(precision: str, hidden: int) -> int:
    """Bytes of one row in ``precision``: MXFP8 ``H + H/32`` (E4M3 payload + E8M0 scales), BF16 ``2H``."""
    if precision == "mxfp8":
        return hidden + hidden // 32
    if precision == "bf16":
        return 2 * hidden
    raise ValueError(f"unknown precision {precision!r} (mxfp8 or bf16)")


@dataclass(frozen=True)
class FloorBytes:
    """Bytes one rank must read and write in its memory for one op."""

    read: int
    written: int

    @property
    def total(self) -> int:
        return self.read + self.written


def rank_floor_bytes(op: str, *, precision: str, hidden: int, tokens: int, selections: int) -> FloorBytes:
    """The floor bytes of one rank: ``tokens`` token rows, ``selections`` (token, expert) rows at its experts."""
    if tokens < 0 or selections < 0:
        raise ValueError(f"tokens and selections must be >= 0, got {tokens}, {selections}")
    bf16 = row_bytes("bf16", hidden)
    if op in TOWARDS_EXPERTS:
        return FloorBytes(read=tokens * bf16, written=selections * row_bytes(precision, hidden))
    if op in TOWARDS_ORIGINS:
        return FloorBytes(read=selections * bf16, written=tokens * bf16)
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(FLOOR_OPS)}")


@dataclass(frozen=True)
class WorldFloor:
    """The floor of one op over the world: per memory (device) bytes and the busiest one."""

    bytes_read: int
    bytes_written: int
    per_memory: dict
    ranks_per_memory: dict

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def world_floor_bytes(op: str, *, precision: str, hidden: int, tokens: int, selections: Sequence[int],
                      memories: Optional[Sequence[str]] = None) -> WorldFloor:
    """Floor bytes of the busiest memory: ``selections[r]`` rows at rank ``r``'s experts, ``memories[r]`` the memory
    rank ``r`` uses (e.g. ``host:cuda:0``; equal names share one memory; default: one memory per rank)."""
    mem = list(memories) if memories is not None else [f"rank{r}" for r in range(len(selections))]
    if len(mem) != len(selections):
        raise ValueError(f"{len(selections)} ranks' selections but {len(mem)} memories")
    per: dict = {}
    for r, s in enumerate(selections):
        b = rank_floor_bytes(op, precision=precision, hidden=hidden, tokens=tokens, selections=s)
        rd, wr = per.get(mem[r], (0, 0))
        per[mem[r]] = (rd + b.read, wr + b.written)
    busiest = max(per, key=lambda m: (sum(per[m]), m))
    counts = {m: mem.count(m) for m in per}
    return WorldFloor(bytes_read=per[busiest][0], bytes_written=per[busiest][1],
                      per_memory={m: sum(v) for m, v in per.items()}, ranks_per_memory=counts)


def floor_us(nbytes: float, ceiling_gbps: float) -> float:
    """Microseconds to move ``nbytes`` (read + write) at ``ceiling_gbps`` (1e9 bytes/s, read + write counted)."""
    if ceiling_gbps <= 0:
        raise ValueError(f"the copy ceiling must be positive, got {ceiling_gbps}")
    return nbytes / (ceiling_gbps * 1e9) * 1e6


__all__ = ["FLOOR_OPS", "row_bytes", "FloorBytes", "rank_floor_bytes", "WorldFloor", "world_floor_bytes",
           "floor_us"]
