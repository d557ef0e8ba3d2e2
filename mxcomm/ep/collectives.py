"""Small torch.distributed helpers of the EP layer: where a collective's tensors live, and the collective check
that every rank of a group holds the same valid :class:`~mxcomm.ep.config.EPConfig`."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..transport.bounded import BoundedGroup, CallTag
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


def agree_on_config(config, bounded: BoundedGroup) -> None:
    """Every rank checks its own ``config`` (an :class:`EPConfig` valid for the group's size), the ranks vote, and
    then compare fingerprints: a config that is invalid on some rank, or that differs between ranks, makes EVERY
    rank raise the same ValueError naming the ranks and fields, within the group's timeout (collective)."""
    world = bounded.world_size
    if not isinstance(config, EPConfig):
        err = f"config must be an EPConfig, got {type(config).__name__}"
    else:
        try:
            config.validate(world)
            err = None
        except ValueError as e:
            err = str(e)
    bounded.agree(err is None, err or "", CallTag("EPGroup", 0, "config check"), what="EPConfig")
    if world == 1:
        return
    mine = torch.tensor(config.fingerprint_codes(), dtype=torch.int64, device=bounded.device)
    allc = torch.stack(bounded.all_gather(mine, CallTag("EPGroup", 0, "config fingerprints"))).cpu()
    if bool((allc == allc[0:1]).all()):
        return
    # Mismatch (seen identically by every rank): gather readable values for the message.
    objs = bounded.all_gather_object(config.fingerprint(), CallTag("EPGroup", 0, "config values"))
    names = [n for n, _ in config.fingerprint()]
    parts = []
    for i, name in enumerate(names):
        col = allc[:, i]
        if bool((col == col[0]).all()):
            continue
        vals = ", ".join(f"rank {r}: {dict(objs[r])[name]!r}" for r in range(world))
        parts.append(f"{name!r} ({vals})")
    raise ValueError("EPConfig differs across ranks in " + "; ".join(parts))


__all__ = ["collective_device", "agree_on_config"]
