"""Stand-ins for mxcomm.transport's NVSHMEM context and symmetric buffers, for CPU runs of the nvshmem
backend's kernels under the Triton interpreter (tests/ep)."""
from dataclasses import dataclass

import torch


@dataclass
class FakeCtx:
    device: torch.device
    rank: int = 0
    world: int = 1


@dataclass
class FakeBuf:
    local: torch.Tensor
    peer_ptrs: torch.Tensor

    @property
    def nbytes(self):
        return self.local.numel() * self.local.element_size()
