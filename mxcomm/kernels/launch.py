"""Triton kernel launches for less host time: :func:`fast_kernel`, the grid arithmetic on host ints
(:func:`cdiv`, :func:`next_pow2`: what ``triton.cdiv`` / ``triton.next_power_of_2`` compute, without the
constexpr-function wrapper those go through at every host call), and :func:`current_stream` (the current stream's
object without the device context ``torch.cuda.current_stream`` enters at every call).

    from mxcomm.kernels.launch import fast_kernel

    fast_kernel(my_kernel)[grid](*args, **kwargs)   # launches what my_kernel[grid](*args, **kwargs) launches

``fast_kernel(fn)`` returns one :class:`FastKernel` per ``@triton.jit`` function (made at the first call, kept), so
it can be written at the launch site; the module-level name stays the ``JITFunction`` (ahead-of-time compiles and
device-function calls use it as before).

What a launch through ``JITFunction.run`` (Triton 3.6) does, and what the fast path keeps:

* kept, as Triton does it: the binder of ``fn.device_caches[device]`` (Triton's native specialization of every
  argument: dtypes, 16-byte alignment, ints equal to 1, constexpr values) and :func:`triton.runtime.jit.
  compute_cache_key`, so the compiled kernel is the one Triton's launch would pick; the ``debug`` and
  ``instrumentation_mode`` options read from the knobs at every call (they are part of the cache key); the check that
  the globals a kernel read when it was compiled still have their values; callable grids (called with the bound
  arguments); the launch hooks (``knobs.runtime.launch_enter_hook`` / ``launch_exit_hook``, read at every call: a
  profiler may set them) with Triton's launch metadata when one is set;
* skipped: Triton's lookups of the device and the stream through its driver object (here ``torch._C._cuda_getDevice``
  and ``torch._C._cuda_getCurrentRawStream``, what Triton's CUDA driver calls: checked once per wrapper); when no
  launch hook is set (Triton 3.6 keeps an empty hook chain there), the launch-metadata object and the calls of the
  empty chains around every launch; and the Python layer of the CUDA launcher (``CudaLauncher.__call__``) for a
  kernel that needs no scratch memory: its compiled ``launch`` is called with the arguments ``__call__`` passes it
  (the launcher, the kernel's function handle and packed metadata are read once per compiled kernel).

Anything else takes Triton's own ``fn[grid](...)``: the first launch of a specialization (a cache miss: it
compiles), kernels with pre-run hooks, a kernel still compiling asynchronously, a changed global (Triton raises), and
every launch of a function that is not a plain ``JITFunction`` - in particular under ``TRITON_INTERPRET=1``, where
``@triton.jit`` makes an ``InterpretedFunction`` and every launch runs in the interpreter as before. Nothing is cached
across calls but the wrapper itself, the driver check and, per compiled kernel, how to call its launcher: Triton's
own caches stay the only source of compiled kernels, and the knobs are read at every launch. Inside CUDA graph
capture the launch is recorded as Triton's would be (the same compiled launch on the capturing stream).

Counters ``fast_launches`` / ``slow_launches`` say which path each launch took. ``python -m
mxcomm.bench.tools.host_costs`` times what is left (the binder and the launcher's own C launch; docs/benchmarks.md).
"""
from __future__ import annotations

import functools

import torch
from triton import knobs
from triton.compiler.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction, compute_cache_key

_MISSING = object()
_FAST: dict = {}  # JIT function -> its FastKernel


def fast_kernel(fn) -> "FastKernel":
    """The :class:`FastKernel` of ``fn`` (a ``@triton.jit`` function; one per function, made at the first call).
    ``fast_kernel(fn)[grid](*args, **kwargs)`` launches what ``fn[grid](*args, **kwargs)`` launches."""
    if isinstance(fn, FastKernel):
        return fn
    k = _FAST.get(fn)
    if k is None:
        k = _FAST[fn] = FastKernel(fn)
    return k


def _hook_set(hook) -> bool:
    """True when a launch hook would do something (Triton 3.6 keeps an empty ``HookChain`` when none is set)."""
    return hook is not None and (hook.__class__ is not HookChain or bool(hook.calls))


def _torch_driver() -> bool:
    """True when Triton's active driver gets the device and stream from torch as this module does."""
    from triton.runtime.driver import driver

    d = driver.active
    get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get_stream is not None and getattr(d, "get_current_stream", None) is get_stream


def _direct_launch(kernel: CompiledKernel):
    """``(launch, function, cooperative, pdl, packed_metadata)`` to launch ``kernel`` through its launcher's compiled
    ``launch`` (what ``CudaLauncher.__call__`` calls, with no scratch memory to allocate), or ``()`` when its ``run``
    must be called (another launcher, or scratch memory: ``run`` allocates it per launch). Loads the kernel if it is
    not loaded yet (as its first ``run`` does)."""
    run = kernel.run
    if (run.__class__.__name__ != "CudaLauncher" or getattr(run, "global_scratch_size", 1)
            or getattr(run, "profile_scratch_size", 1)):
        return ()
    return run.launch, kernel.function, run.launch_cooperative_grid, run.launch_pdl, kernel.packed_metadata


class FastKernel:
    """Launcher of one ``@triton.jit`` function ``fn`` (see the module doc): ``k[grid](*args, **kwargs)`` or
    ``k.launch(grid, *args, **kwargs)``, with ``grid`` a tuple of 1-3 ints or a callable of the bound arguments.
    Returns what Triton's launch returns (the ``CompiledKernel``)."""

    def __init__(self, fn):
        self.fn = fn
        # only a plain JITFunction takes the fast path (an InterpretedFunction, an autotuner, a subclass with its own
        # run: always Triton's launch); the driver is checked at the first launch that could take it
        self._fast = type(fn) is JITFunction
        self._driver_checked = False
        self._direct: dict = {}  # CompiledKernel -> what _direct_launch says of it
        self.fast_launches = 0
        self.slow_launches = 0

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs):
        """Launch ``fn`` on ``grid`` with ``args`` / ``kwargs`` on the current stream (see the module doc)."""
        if self._fast and self.fn.device_caches:  # (a binder exists: Triton has launched fn here before)
            kernel = self._launch_cached(grid, args, kwargs)
            if kernel is not None:
                self.fast_launches += 1
                return kernel
        self.slow_launches += 1
        return self.fn[grid](*args, **kwargs)

    def _launch_cached(self, grid, args, kwargs):
        """Launch the compiled kernel Triton's cache holds for these arguments; None (nothing launched) when Triton's
        own launch must run instead. ``kwargs`` gains the two options Triton adds (the same values Triton computes, so
        handing it on to Triton's launch changes nothing)."""
        fn = self.fn
        if not self._driver_checked:
            self._fast = _torch_driver()
            self._driver_checked = True
            if not self._fast:
                return None
        if fn.pre_run_hooks:
            return None
        device = torch._C._cuda_getDevice()
        caches = fn.device_caches.get(device)
        if caches is None:
            return None
        kernel_cache, key_cache, _, _, binder = caches
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound_args, specialization, options = binder(*args, **kwargs)
        kernel = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
        if kernel is None or kernel.__class__ is not CompiledKernel:  # not compiled yet, or compiling asynchronously
            return None
        for (name, _), (val, globals_dict) in fn.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != val:  # Triton's launch raises the error
                return None
        if callable(grid):
            grid = grid(bound_args)
        n = len(grid)
        g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        values = bound_args.values()
        if _hook_set(enter) or _hook_set(leave):
            meta = kernel.launch_metadata(grid, stream, *values)
        else:
            meta = enter = leave = None
        direct = self._direct.get(kernel)
        if direct is None:
            direct = self._direct[kernel] = _direct_launch(kernel)
        if direct:
            launch, function, coop, pdl, packed = direct
            launch(g0, g1, g2, stream, function, coop, pdl, None, None, packed, meta, enter, leave, *values)
        else:
            kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *values)
        return kernel

    def __repr__(self) -> str:
        return f"FastKernel({self.fn!r})"


_STREAMS: dict = {}  # (device index, raw stream handle) -> the torch.cuda.Stream torch made for that stream


def current_stream(device_index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device_index)`` for less host time (the events a call records, e.g.): the stream
    current now is found by its raw handle (``torch._C._cuda_getCurrentRawStream``, one C call, what Triton's launcher
    asks), and the ``Stream`` object torch makes for a handle is made once and kept (torch builds a new one, through a
    device context, at every ``current_stream`` call). A handle names one stream for good: torch's pool streams live
    as long as the process, and an external stream's id is its handle. ``device_index``: an int."""
    key = (device_index, torch._C._cuda_getCurrentRawStream(device_index))
    s = _STREAMS.get(key)
    if s is None:
        if len(_STREAMS) >= 256:  # (external streams come and go: keep the cache bounded)
            _STREAMS.clear()
        s = _STREAMS[key] = torch.cuda.current_stream(device_index)
    return s


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints, ``b > 0`` (grid sizes)."""
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``), host ints (tile and constexpr sizes)."""
    return 1 << max(0, int(n) - 1).bit_length()


__all__ = ["cdiv", "next_pow2", "fast_kernel", "FastKernel", "current_stream"]
