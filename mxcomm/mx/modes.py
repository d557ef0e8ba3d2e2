"""Names of the MX scale rules (no torch import: configs and the command line read them cheaply).

``rceil`` (default; cuBLAS, Transformer Engine, torchao's training default) and ``floor`` (the OCP MX v1.0
baseline); the rules themselves are in :mod:`mxcomm.mx.scales`.
"""

SCALE_MODES = ("rceil", "floor")

__all__ = ["SCALE_MODES"]
