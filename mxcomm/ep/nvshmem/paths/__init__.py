"""The ways the ``nvshmem`` backend moves rows, one class per path (:func:`mxcomm.ep.plan.dispatch_path`):

* :class:`LocalPath` (one rank): nothing leaves the GPU; dispatch and combine backward write the output directly,
  combine reduces the expert rows in place;
* :class:`PullPath` (several ranks with peer pointers, the default): senders pack each token row once into their send
  copy; receivers read each listed row once per (token, rank) through the peer pointer into fresh tensors;
* :class:`PushPath` (``transport="push"``): senders store the rows into the receivers' symmetric buffer at their
  expert-major rows; receivers copy them out (through a window of rows, in rounds when a rank receives more);
* :class:`PutPath` (``transport="put"``, or peers on other nodes): the push path's kernels write into a staging
  buffer and NVSHMEM puts one block per (destination, expert) with a signal (``csrc/put_signal.cu``), through the
  same window.

Every path with several ranks answers a dispatch one row per (token, rank) in both directions, through the
dispatch's table (one entry per (source token, this rank), kept in the handle): combine and dispatch backward send
the partial sum of a token's rows on this rank (:meth:`EnginePath.send_partials`), combine backward brings each
BF16 gradient row once per (token, rank) to the expert rank, which weights and quantizes it per slot where it lands
and forms the route-weight gradient there (:meth:`EnginePath.combine_backward`).

Each path owns its buffers (taken by name from the symmetric heap's allocation of
:func:`mxcomm.ep.plan.buffer_regions`) and launches its own kernels; the engine (:class:`NvshmemBackend
<mxcomm.ep.nvshmem.backend.NvshmemBackend>`) holds what every path shares: the epochs, flags and counts, the error
words and bounded waits, the routing plan and its captured graphs, the output formatting and the reduce at the
origin. What a path does per call:

* :meth:`EnginePath.dispatch` -> :class:`DispatchRows` (the received rows and their scale rows, the plan the handle
  keeps, the row origins, the table);
* :meth:`EnginePath.combine_backward` -> :class:`BackwardRows` (the weighted gradient rows at the expert ranks, the
  route-weight gradient at the origin);
* :meth:`EnginePath.combine_weights` and :meth:`EnginePath.send_partials`: the route weights combine weights the
  partial sums with (those that came with the dispatch's entries on the pull and push paths, else exchanged: every
  rank's to every rank),
  and the partials of combine / dispatch backward to their origins' ``comb_q`` (then wait for every rank's);
* :meth:`EnginePath.exchange`: the counts exchange or the "ready" handshake.
"""
from .base import BackwardRows, DispatchRows, EnginePath, PUSH_BLOCK, fp32_weights
from .local import LocalPath
from .pull import PullPath
from .push import PushPath
from .put import PutPath

PATHS = {"local": LocalPath, "pull": PullPath, "push": PushPath, "put": PutPath}

__all__ = ["EnginePath", "LocalPath", "PullPath", "PushPath", "PutPath", "DispatchRows", "BackwardRows", "PATHS",
           "PUSH_BLOCK", "fp32_weights"]
