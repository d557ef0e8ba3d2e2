"""Validation of expert ids (``topk_idx``) on the host: the detailed error of a bad routing."""
from __future__ import annotations

import torch


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    """ValueError if an id is outside ``[-1, num_experts)`` or a token lists one expert twice (one host sync)."""
    idx = topk_idx.to(torch.int64)
    bad = (idx < -1) | (idx >= num_experts)
    checks = [bad.any()]
    if idx.shape[1] > 1:
        s = torch.sort(idx, dim=1).values
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        checks.append(dup.any())
    flags = torch.stack(checks).tolist()  # the one host sync
    if flags[0]:
        pos = torch.nonzero(bad)[0].tolist()
        v = int(idx[pos[0], pos[1]])
        raise ValueError(
            f"topk_idx[{pos[0]}, {pos[1]}] = {v} is not a valid expert id (must be in [-1, {num_experts}), "
            "-1 = dropped)"
        )
    if len(flags) > 1 and flags[1]:
        t, j = torch.nonzero(dup)[0].tolist()
        raise ValueError(f"token {t} lists expert {int(s[t, j + 1])} more than once in topk_idx")


__all__ = ["check_expert_ids"]
