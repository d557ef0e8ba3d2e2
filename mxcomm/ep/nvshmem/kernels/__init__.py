"""Triton kernels of the ``nvshmem`` EP backend: they quantize in registers and store straight into
peers' symmetric buffers through NVSHMEM peer pointers, then signal with release/acquire flags at
system scope. Every wait is bounded (``mxcomm.transport.flags.wait_flag_geq``). Buffers: see
:func:`mxcomm.ep.plan.buffer_regions` (the single source of their shapes) and docs/design.md.

Modules by job (each imports only from those listed before it):

* :mod:`.signals`: flags, publishing and bounded waits - ``publish_kernel`` (counts + refusal word, "ready", route
  weights), ``wait_published_kernel``, ``wait_arrivals_kernel``, ``first_refusal_kernel`` and the device helpers the
  other modules' kernels signal and wait with; the flags' arrival protocol;
* :mod:`.layout`: the expert-major output at the receiver - ``copy_out_rows_kernel``,
  ``scale_rows_to_grouped_kernel`` and the zeroing of padding rows that three other modules share;
* :mod:`.pack`: a token's row and route weights into this rank's send copy (the pull dispatch's and combine
  backward's packs);
* :mod:`.dispatch`: the sending dispatch, one kernel per path over one loop - ``local_rows_kernel``,
  ``push_rows_kernel``, ``stage_rows_kernel``;
* :mod:`.pull`: the pull dispatch - ``pull_head_kernel``, ``scan_and_wait_kernel``, ``pack_rows_kernel``,
  ``pull_rows_kernel`` - and the pull list every multi-rank path writes (``plan_entries_kernel``,
  ``push_entries_kernel``, ``entries_table_kernel``); why the send copies come in two;
* :mod:`.combine`: the combine direction (``combine_partials_kernel``, ``stage_partials_kernel``,
  ``combine_reduce_kernel``, ``local_reduce_kernel``) and the slot and row helpers both directions share; why
  ``comb_q`` comes in two;
* :mod:`.combine_backward`: combine backward (``pack_ready_kernel``, ``pull_weighted_kernel``,
  ``round_weighted_kernel``, ``gather_route_grad_kernel``);
* :mod:`.call_io`: a captured call's tensors at addresses given per replay (``copy_in_kernel``, ``copy_out_kernel``;
  the one-rank dispatch's ``local_rows_at_kernel`` in :mod:`.dispatch` and reduce's ``local_reduce_at_kernel`` in
  :mod:`.combine`, the pull dispatch's ``pull_rows_at_kernel``
  in :mod:`.pull` and ``scale_rows_to_grouped_at_kernel`` in :mod:`.layout` read their outputs' addresses the same
  way).

The kernels are re-exported here; the device helpers (``@triton.jit`` functions that are not launched) stay in their
modules.
"""
from __future__ import annotations

from .call_io import copy_in_kernel, copy_out_kernel
from .combine import (combine_partials_kernel, combine_reduce_kernel, local_reduce_at_kernel, local_reduce_kernel,
                      stage_partials_kernel)
from .combine_backward import gather_route_grad_kernel, pack_ready_kernel, pull_weighted_kernel, round_weighted_kernel
from .dispatch import local_rows_at_kernel, local_rows_kernel, push_rows_kernel, stage_rows_kernel
from .layout import copy_out_rows_kernel, scale_rows_to_grouped_at_kernel, scale_rows_to_grouped_kernel
from .pull import (entries_table_kernel, pack_rows_kernel, plan_entries_kernel, pull_head_kernel,
                   pull_rows_at_kernel, pull_rows_kernel, push_entries_kernel, scan_and_wait_kernel)
from .signals import first_refusal_kernel, publish_kernel, wait_arrivals_kernel, wait_published_kernel

__all__ = [
    # signals
    "publish_kernel", "wait_published_kernel", "wait_arrivals_kernel", "first_refusal_kernel",
    # layout
    "copy_out_rows_kernel", "scale_rows_to_grouped_kernel", "scale_rows_to_grouped_at_kernel",
    # dispatch
    "local_rows_kernel", "local_rows_at_kernel", "push_rows_kernel", "stage_rows_kernel",
    # pull
    "pull_head_kernel", "scan_and_wait_kernel", "pack_rows_kernel", "push_entries_kernel", "plan_entries_kernel",
    "entries_table_kernel", "pull_rows_kernel", "pull_rows_at_kernel",
    # combine
    "combine_partials_kernel", "stage_partials_kernel", "combine_reduce_kernel", "local_reduce_kernel",
    "local_reduce_at_kernel",
    # combine backward
    "pack_ready_kernel", "pull_weighted_kernel", "round_weighted_kernel", "gather_route_grad_kernel",
    # call_io
    "copy_in_kernel", "copy_out_kernel",
]
