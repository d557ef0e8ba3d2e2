"""Adapters to other training libraries (optional dependencies, imported on demand).

* :mod:`mxcomm.integrations.torchtitan`: ``MXCommTokenDispatcher``, a torchtitan 0.3 EP token dispatcher
  (``pip install mxcomm[torchtitan]``).
* :mod:`mxcomm.integrations.torchao`: zero-copy conversion between :class:`mxcomm.mx.MXTensor` and torchao's
  ``MXTensor`` (``pip install mxcomm[torchao]``).

This package sits above :mod:`mxcomm.ep`, :mod:`mxcomm.mx` and :mod:`mxcomm.nn`; nothing in mxcomm imports it,
and importing it imports neither torchtitan nor torchao (import the submodules for that).
"""
