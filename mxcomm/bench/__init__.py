"""``mxcomm bench``: dispatch/combine benchmark harness (reusable from Python).

* :class:`BenchOptions` (:mod:`.options`): one run, every default resolved; ``options_from_args``.
* :func:`launch` (:mod:`.launcher`): start rank processes (phases ``main`` and ``symm``), merge, write the
  report; :func:`run_joined` under torchrun/mpirun; :func:`rank_main` is one rank's body.
* :func:`run_phase` (:mod:`.harness`): the cases of one phase inside an initialised world.
* :mod:`.report`: statistics, both byte conventions, ratios, table, JSON; :mod:`.plots`: PNGs.
* :mod:`.info`: ``mxcomm info``.

Example (Python, plain start)::

    from mxcomm.bench import BenchOptions, launch
    opts = BenchOptions(tokens=[8192], hidden=7168, topk=8, experts=256, precisions=["mxfp8", "bf16"],
                        mode="throughput", backend="nvshmem", device="cuda", ranks=1, ranks_per_gpu=1,
                        side_channel="nccl", iters=50, warmup=10, out=default_out_dir("loopback"), label="loopback")
    opts.validate()
    report, paths = launch(opts, command=["python"])

The names are loaded on first use, so importing a submodule (``mxcomm.bench.options``, as ``mxcomm --help`` does)
does not import torch.
"""
from __future__ import annotations

import importlib

__all__ = ["BenchOptions", "OptionError", "options_from_args", "default_out_dir", "launch", "run_joined",
           "rank_main", "BenchError"]

_LAZY = {"BenchOptions": ".options", "OptionError": ".options", "options_from_args": ".options",
         "default_out_dir": ".options", "launch": ".launcher", "run_joined": ".launcher", "rank_main": ".launcher",
         "BenchError": ".launcher"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
