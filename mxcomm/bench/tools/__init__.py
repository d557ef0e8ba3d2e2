"""Developer tools for the GPU backend, each run as a module on a GPU machine (environment: ``bench/gpu/env.sh``):

* :mod:`.sweep` - launch-parameter sweep and kernel profile of the nvshmem EP backend (``torchrun ... -m
  mxcomm.bench.tools.sweep``);
* :mod:`.trace` - where the host time of one eager EP call goes (profiler timeline, cProfile);
* :mod:`.graph_profile` - kernel-by-kernel GPU time of dispatch / combine captured in CUDA graphs;
* :mod:`.host_costs` - host microseconds of a Triton launch, a graph replay, small tensor operations;
* :mod:`.combine_sqnr` - SQNR against float64 of combine and dispatch backward, per-selection vs per-(token, rank)
  transport rounding (CPU; no GPU needed);
* :mod:`.host_glue` - host microseconds of the four public EP calls over a loopback heap (no NVSHMEM; on CPU under
  the interpreter with the kernels stubbed out, also as rank 0 of a world of N whose peers are the process itself -
  the pull and push paths -, or on a GPU with one rank);
* :mod:`.kernel_report` - registers, spills, barriers and load / store widths of the EP data kernels compiled for
  sm_90 as the backend launches them (CPU; no GPU needed).
"""
