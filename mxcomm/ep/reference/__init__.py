"""The reference EP backend and the single-process oracles, fenced off from the fast path.

* :class:`TorchBackend` (:mod:`.backend`): quantize, then torch.distributed all-to-all (combine: one row per
  (token, rank), the partial sum formed on the expert rank). The baseline every benchmark is compared to; runs on
  CPU (gloo) and GPU (NCCL).
* :mod:`.backward`: the reference math of combine and of the backward passes.
* :mod:`.oracle`: every rank's expected outputs computed in one process with plain loops from the contract, not
  from the routing plan; what the tests compare every backend against.

Nothing in the GPU backend imports from here (a test checks it).
"""
from .backend import TorchBackend, weighted_combine
from .oracle import (OracleRoutes, oracle_combine, oracle_combine_backward, oracle_dispatch,
                     oracle_dispatch_backward, routed_sum)

__all__ = ["TorchBackend", "weighted_combine", "OracleRoutes", "oracle_dispatch", "oracle_combine", "routed_sum",
           "oracle_combine_backward", "oracle_dispatch_backward"]
