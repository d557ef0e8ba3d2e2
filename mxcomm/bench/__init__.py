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
                        side_channel="nccl", iters=50, warmup=10, out="bench/results/loopback", label="loopback")
    opts.validate()
    report, paths = launch(opts, command=["python"])
"""
from .launcher import BenchError, launch, rank_main, run_joined
from .options import BenchOptions, OptionError, options_from_args

__all__ = ["BenchOptions", "OptionError", "options_from_args", "launch", "run_joined", "rank_main", "BenchError"]
