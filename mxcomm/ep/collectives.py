"""Small torch.distributed helpers of the EP layer: where a collective's tensors live, and the check that every
rank of a group holds the same :class:`~mxcomm.ep.config.EPConfig`."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .config import EPConfig


def collective_device(group, data_device: Optional[torch.device] = None) -> torch.device:
    """Device on which small tensors for a collective on ``group`` must live.

    NCCL-only groups need the current CUDA device; anything else (gloo, mixed) uses the CPU unless
    ``data_device`` is a CUDA device and the group has a CUDA-capable backend.
    """
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        if data_device is not None and data_device.type == "cuda":
            return data_device
        if "gloo" not in backend and "cpu" not in backend:
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_config_agreement(config: EPConfig, group=None) -> None:
    """All-gather ``config``'s fingerprint; raise ValueError naming differing fields and ranks.

    Collective: every rank of ``group`` must call it (every rank raises on a mismatch).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    dev = collective_device(group)
    mine = torch.tensor(config.fingerprint_codes(), dtype=torch.int64, device=dev)
    bufs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(bufs, mine, group=group)
    allc = torch.stack(bufs).cpu()
    if bool((allc == allc[0:1]).all()):
        return
    # Mismatch (seen identically by every rank): gather readable values for the message.
    objs = [None] * world
    dist.all_gather_object(objs, config.fingerprint(), group=group)
    names = [n for n, _ in config.fingerprint()]
    parts = []
    for i, name in enumerate(names):
        col = allc[:, i]
        if bool((col == col[0]).all()):
            continue
        vals = ", ".join(f"rank {r}: {dict(objs[r])[name]!r}" for r in range(world))
        parts.append(f"{name!r} ({vals})")
    raise ValueError("EPConfig differs across ranks in " + "; ".join(parts))


__all__ = ["collective_device", "check_config_agreement"]
