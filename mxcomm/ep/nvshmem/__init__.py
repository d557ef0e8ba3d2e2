"""The ``nvshmem`` EP backend: GPU kernels that quantize in registers and move rows through NVSHMEM symmetric buffers.

* :mod:`.backend`: :class:`~.backend.NvshmemBackend`, the engine every path shares (epochs, flags, error words and
  bounded waits, the plan and its captured graphs, output formatting, the reduce at the origin);
* :mod:`.paths`: one module and class per path (local, pull, push, put), each owning its buffers and kernels;
* :mod:`.kernels`: the backend's Triton kernels, one module per job (signals, layout, pack, dispatch, pull, combine);
* :mod:`.state`: the backend's part of a handle (``NvshmemState``) and the row origins of a dispatch output;
* :mod:`.plan_kernels`: the routing plan in Triton kernels (the id check, counts and slot tables);
* :mod:`.plan_graph`: the plan's replay from a CUDA graph per token count, and the copies a handle keeps;
* :mod:`.call_graph`: a whole exact-size dispatch captured once and replayed with the call's tensors (one rank, and
  the pull path at small sizes);
* :mod:`.put_path`: the put-with-signal plumbing (block lists, the puts of ``csrc/put_signal.cu``);
* :mod:`.status_words`: ``StatusWords``, the words the host reads at an exact-size dispatch's one sync;
* :mod:`.launch_config`: ``LaunchConfig``, the kernels' launch settings (``EPConfig(launch=...)``).

This file imports nothing, so that :mod:`mxcomm.ep.config` imports :mod:`.launch_config` without loading Triton;
import a name from the module that defines it. Nothing here imports :mod:`mxcomm.ep.reference` (a test checks it).
"""
