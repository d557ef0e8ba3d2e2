"""Baseline 4 of BENCH.md: torch's NVSHMEM ``all_to_all_vdev_2d`` (dispatch) and
``all_to_all_vdev_2d_offset`` (combine), BF16 rows, splits on the device.

It needs torch symmetric memory with the NVSHMEM backend, one rank per GPU, and is never run in a
process where nvshmem4py initialised NVSHMEM (``mxcomm bench`` runs it in a separate phase: fresh
rank processes). Input rows are packed by destination expert once, outside the timed region
(``all_to_all_vdev_2d`` takes them that way); the output is expert-major, each expert's group padded
to ``align`` rows (``major_align``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .cases import CaseCall, random_rows
from .routing import BenchInputs, RoutingInfo

TRANSPORT = "torch symmetric memory (NVSHMEM backend), torch.ops.symm_mem.all_to_all_vdev_2d[_offset]"


def unavailable_reason(*, device: str, ranks_per_gpu: int) -> Optional[str]:
    """None if ``all_to_all_vdev_2d`` can be tried here, else why not (no side effects beyond imports)."""
    if device != "cuda" or not torch.cuda.is_available():
        return "needs a CUDA GPU (torch symmetric memory with the NVSHMEM backend)"
    if ranks_per_gpu > 1:
        return (f"{ranks_per_gpu} ranks share a GPU; torch's NVSHMEM symmetric memory is only tried with one rank "
                "per GPU")
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as e:  # noqa: BLE001
        return f"torch.distributed._symmetric_memory does not import: {e}"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d") or not hasattr(torch.ops.symm_mem,
                                                                           "all_to_all_vdev_2d_offset"):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.all_to_all_vdev_2d[_offset]"
    try:
        if not symm_mem.is_nvshmem_available():
            return "torch reports NVSHMEM unavailable (symm_mem.is_nvshmem_available() is False)"
    except Exception as e:  # noqa: BLE001
        return f"symm_mem.is_nvshmem_available() failed: {e}"
    return None


def buffer_rows(*, max_tokens: int, topk: int, experts: int, world: int, align: int) -> tuple:
    """``(max_in_rows, max_out_rows)`` of the symmetric buffers: a rank sends at most ``T*k`` rows and
    receives at most ``W*T*min(k, El)`` rows plus up to ``align`` padding rows per local expert."""
    el = experts // world
    max_in = max_tokens * topk
    max_out = world * max_tokens * min(topk, el) + el * align
    return max_in, max_out


def symmetric_bytes(*, max_tokens: int, topk: int, hidden: int, experts: int, world: int, align: int) -> int:
    """Bytes of symmetric memory this baseline allocates per rank (for NVSHMEM_SYMMETRIC_SIZE)."""
    max_in, max_out = buffer_rows(max_tokens=max_tokens, topk=topk, experts=experts, world=world, align=align)
    return (2 * max_in + max_out) * hidden * 2 + 3 * 2 * experts * 8


@dataclass
class Vdev2dBuffers:
    """The symmetric tensors (allocated once per run for the largest token count)."""

    group_name: str
    inp: torch.Tensor
    out: torch.Tensor
    in_splits: torch.Tensor
    out_so: torch.Tensor
    comb_out: torch.Tensor
    comb_so: torch.Tensor


def allocate(world, *, max_tokens: int, topk: int, hidden: int, experts: int, align: int) -> Vdev2dBuffers:
    """Switch torch symmetric memory to NVSHMEM and allocate + rendezvous the buffers (collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.set_backend("NVSHMEM")
    group_name = dist.group.WORLD.group_name
    try:
        with warnings.catch_warnings():  # deprecated (a no-op need) in newer torch, required in older
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
    except Exception:  # noqa: BLE001
        pass
    dev = world.device
    max_in, max_out = buffer_rows(max_tokens=max_tokens, topk=topk, experts=experts, world=world.world, align=align)

    def sym(shape, dtype):
        t = symm_mem.empty(shape, dtype=dtype, device=dev)
        symm_mem.rendezvous(t, group=group_name)
        return t

    b = Vdev2dBuffers(
        group_name=group_name,
        inp=sym((max_in, hidden), torch.bfloat16), out=sym((max_out, hidden), torch.bfloat16),
        in_splits=sym((experts,), torch.int64), out_so=sym((2, experts), torch.int64),
        comb_out=sym((max_in, hidden), torch.bfloat16), comb_so=sym((2, experts), torch.int64),
    )
    b.out.zero_()
    return b


def prepare(bufs: Vdev2dBuffers, inputs: BenchInputs, routing: RoutingInfo) -> None:
    """Pack this token count's rows by destination expert into ``inp`` and set ``in_splits`` (untimed)."""
    n = sum(routing.send_splits)
    dev = inputs.x.device
    bufs.inp[:n].copy_(inputs.x[routing.send_tok.to(dev)])
    bufs.in_splits.copy_(routing.plan.counts[routing.plan.rank].to(torch.int64))


def dispatch_case(bufs: Vdev2dBuffers, routing: RoutingInfo, *, align: int) -> CaseCall:
    """``all_to_all_vdev_2d(inp, out, in_splits, out_splits_offsets, group, major_align=align)``; one untimed
    call first checks the received row count against the routing."""
    def fn():
        torch.ops.symm_mem.all_to_all_vdev_2d(bufs.inp, bufs.out, bufs.in_splits, bufs.out_so, bufs.group_name,
                                              major_align=align)

    fn()
    got = int(bufs.out_so[0].sum())
    want = sum(routing.recv_splits)
    if got != want:
        raise RuntimeError(f"all_to_all_vdev_2d received {got} rows, the routing says {want}")
    return CaseCall(fn=fn, transport=TRANSPORT,
                    notes=("input packed by destination expert once outside the timed region",
                           f"output expert-major, groups padded to major_align={align}"))


def combine_case(bufs: Vdev2dBuffers, routing: RoutingInfo, *, seed: int, rank: int) -> CaseCall:
    """``all_to_all_vdev_2d_offset(out, comb_out, out_splits_offsets, comb_splits_offsets, group)``: the rows of
    the last dispatch (overwritten with random expert outputs) go back to their origin, no reduction."""
    n_rows = int(bufs.out_so[1, -1] + bufs.out_so[0, -1])
    if n_rows:
        bufs.out[:n_rows].copy_(random_rows(n_rows, bufs.out.shape[1], bufs.out.device, seed, rank))

    def fn():
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(bufs.out, bufs.comb_out, bufs.out_so, bufs.comb_so,
                                                     bufs.group_name)

    fn()
    got = int(bufs.comb_so[0].sum())
    want = sum(routing.send_splits)
    if got != want:
        raise RuntimeError(f"all_to_all_vdev_2d_offset returned {got} rows, the routing says {want}")
    return CaseCall(fn=fn, transport=TRANSPORT, notes=("rows returned rank-major to their origin; no reduction",))


__all__ = ["unavailable_reason", "symmetric_bytes", "buffer_rows", "allocate", "prepare", "dispatch_case",
           "combine_case", "Vdev2dBuffers", "TRANSPORT"]
