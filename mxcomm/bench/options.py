"""Options of ``mxcomm bench``: the command-line parser, GPU/CPU defaults, and validation.

:class:`BenchOptions` is the fully resolved, JSON-serialisable description of one benchmark run
(every default filled in). Build it from a command line with :func:`options_from_args`, or
directly in Python and call :meth:`BenchOptions.validate`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

# The EP choices the command line offers, spelled out here so that ``mxcomm bench --help`` and argument errors do
# not import mxcomm.ep (and torch); tests/bench/test_options.py checks they equal mxcomm.ep.config's.
PRECISIONS = ("mxfp8", "bf16")
BACKENDS = ("torch", "nvshmem")
ALIGNS = (32, 128)
TRANSPORTS = ("auto", "local", "pull", "push", "put")
IMPLS = ("mxcomm", "reference", "a2a", "vdev2d")
OPS = ("dispatch", "combine", "combine_bwd", "dispatch_bwd")
# The BF16 all-to-all baselines (a2a, vdev2d) are direction-symmetric: they are timed for the forward ops only,
# and a backward op is compared with the forward op that moves the same rows the same way.
BACKWARD_TWIN = {"combine_bwd": "dispatch", "dispatch_bwd": "combine"}
FORWARD_ONLY_IMPLS = ("a2a", "vdev2d")
MODES = ("throughput", "latency")
SIDE_CHANNELS = ("auto", "nccl", "gloo")

# Defaults: DeepSeek-V3-like on a GPU; small sizes on CPU (4 gloo processes, about a minute on 2 cores).
GPU_DEFAULTS = dict(hidden=7168, topk=8, experts=256, tokens={"throughput": [4096], "latency": [128]},
                    iters={"throughput": 50, "latency": 200}, warmup=10, quick_iters=10, quick_warmup=3)
CPU_DEFAULTS = dict(hidden=512, topk=8, experts=16, tokens={"throughput": [64], "latency": [16]},
                    iters={"throughput": 10, "latency": 20}, warmup=2, quick_iters=3, quick_warmup=1)
CPU_RANKS = 4
MPS_MODES = ("check", "start")
START_MODES = ("auto", "barrier", "clock")  # how ranks start a timed call (mxcomm.bench.timing)


def default_out_dir(label: str, environ=None, now: Optional[datetime.datetime] = None) -> str:
    """``$XDG_CACHE_HOME/mxcomm/bench/<label>-<YYYYmmdd-HHMMSS>`` (``XDG_CACHE_HOME`` defaults to ``~/.cache``):
    outside any source tree, so a run never dirties a checkout. ``environ`` defaults to ``os.environ`` (read only)."""
    env = os.environ if environ is None else environ
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return os.path.join(cache, "mxcomm", "bench", f"{label}-{stamp}")


class OptionError(ValueError):
    """A bad benchmark option; the message names the option (e.g. ``--experts``)."""


def _int_list(text: str) -> list[int]:
    out = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        try:
            v = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not an integer (expected e.g. 128 or 1024,4096)") from None
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return out


def _settings(text: str) -> dict:
    """``FIELD=INT[,FIELD=INT...]`` (``--launch``) -> ``{field: int}``; the fields are checked by
    :meth:`BenchOptions.validate` (against :class:`mxcomm.ep.LaunchConfig`)."""
    out = {}
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        name, eq, value = part.partition("=")
        try:
            if not (eq and name):
                raise ValueError
            out[name] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not FIELD=INTEGER (e.g. partials_per_sm=16)") from None
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return out


def _str_list(text: str) -> list[str]:
    out = [p.strip().lower() for p in str(text).split(",") if p.strip()]
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return out


def _label(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,79}", text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: use letters, digits and _ . + - (at most 80 characters, starting with a letter or digit)"
        )
    return text


def _check_names(flag: str, names: list, allowed: tuple) -> None:
    """OptionError unless every value of a comma-list option is known and none is repeated."""
    for n in names:
        if n not in allowed:
            raise OptionError(f"{flag} {n!r} is unknown; choose from {', '.join(allowed)}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise OptionError(f"{flag} lists {', '.join(map(repr, dup))} more than once: {','.join(names)}")


def ops_for(opts: "BenchOptions", impl: str) -> list[str]:
    """The ops timed for ``impl``, in :data:`OPS` order.

    The EP groups (``mxcomm``, ``reference``) time ``opts.ops``; the direction-symmetric BF16 baselines
    (``a2a``, ``vdev2d``) time the forward op of every direction the selected ops use
    (``combine_bwd`` -> ``dispatch``, ``dispatch_bwd`` -> ``combine``; see :data:`BACKWARD_TWIN`).
    """
    if impl not in FORWARD_ONLY_IMPLS:
        return [op for op in OPS if op in opts.ops]
    need = {BACKWARD_TWIN.get(op, op) for op in opts.ops}
    return [op for op in OPS if op in need]


@dataclass
class BenchOptions:
    """One benchmark run, all defaults resolved.

    Sizes: ``tokens`` (per rank, a sweep when several), ``hidden``, ``topk``, ``experts``, ``align``.
    What runs: ``precisions`` (payloads of the library's dispatch/combine), ``impls`` (``mxcomm``:
    this library with ``backend``; ``reference``: EPConfig backend ``torch`` with MXFP8 payload;
    ``a2a``: plain BF16 ``all_to_all_single`` of the routed rows; ``vdev2d``: torch's NVSHMEM
    ``all_to_all_vdev_2d``), ``ops`` (subset of :data:`OPS`: forward ``dispatch``/``combine`` and
    backward ``combine_bwd``/``dispatch_bwd``; the a2a/vdev2d baselines time the forward op of each
    direction, see :func:`ops_for`), ``mode`` (only picks default token counts and iterations).
    World: ``device`` (``cpu``/``cuda``), ``ranks`` (EP size), ``ranks_per_gpu``, ``side_channel``
    (torch.distributed backend of the world group: ``nccl`` needs one rank per GPU).
    ``mps``: with several ranks per GPU, ``check`` (refuse without a running MPS daemon) or ``start`` (the launcher
    starts one for the run, see :mod:`mxcomm.bench.mps`).
    Timing: ``iters``, ``warmup``. Output: ``out`` folder (default :func:`default_out_dir`), ``label``, ``plot``.
    """

    tokens: list[int]
    hidden: int
    topk: int
    experts: int
    precisions: list[str]
    mode: str
    backend: str
    device: str
    ranks: int
    ranks_per_gpu: int
    side_channel: str
    iters: int
    warmup: int
    out: str
    label: str
    impls: list[str] = field(default_factory=lambda: list(IMPLS))
    ops: list[str] = field(default_factory=lambda: list(OPS))
    num_sms: Optional[int] = None
    align: int = 32
    seed: int = 0
    plot: bool = True
    quick: bool = False
    check: bool = True
    exact_sizes: bool = True
    cuda_graph: bool = False
    transport: str = "auto"
    timeout_s: float = 900.0
    pg_timeout_s: float = 300.0
    progress: bool = True
    mps: str = "check"
    start: str = "auto"
    l2_flush: bool = True
    launch: dict = field(default_factory=dict)

    @property
    def max_tokens(self) -> int:
        return max(self.tokens)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def launch_config(self):
        """The :class:`mxcomm.ep.LaunchConfig` of this run (its defaults with ``launch``'s fields set)."""
        from ..ep.nvshmem.launch_config import LaunchConfig

        return LaunchConfig(**self.launch)

    def ep_config(self, precision: str, backend: Optional[str] = None):
        """The :class:`mxcomm.ep.EPConfig` of this run for one payload precision."""
        from ..ep.config import EPConfig

        return EPConfig(
            num_experts=self.experts, hidden=self.hidden, topk=self.topk, max_tokens_per_rank=self.max_tokens,
            align=self.align, precision=precision, backend=backend or self.backend, num_sms=self.num_sms,
            # CUDA graphs need the no-host-sync mode (the reference backend is never captured)
            exact_sizes=self.exact_sizes and not (self.cuda_graph and (backend or self.backend) == "nvshmem"),
            transport=self.transport, launch=self.launch_config() if self.launch else None,
        )

    def validate(self) -> None:
        """Raise :class:`OptionError` (a ValueError) naming the first bad option."""
        def bad(msg):
            raise OptionError(msg)

        if not self.tokens or any((not isinstance(t, int)) or t < 1 for t in self.tokens):
            bad(f"--tokens must be positive integers (tokens per rank), got {self.tokens}")
        if self.hidden < 32 or self.hidden % 32:
            bad(f"--hidden {self.hidden} must be a positive multiple of 32 (the MX block size)")
        if self.experts < 1:
            bad(f"--experts must be positive, got {self.experts}")
        if self.topk < 1:
            bad(f"--topk must be positive, got {self.topk}")
        if self.topk > self.experts:
            bad(f"--topk {self.topk} must not exceed --experts {self.experts}")
        for flag, names, allowed in (("--precision", self.precisions, PRECISIONS), ("--impls", self.impls, IMPLS),
                                     ("--ops", self.ops, OPS)):
            _check_names(flag, names, allowed)
        if self.mode not in MODES:
            bad(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.backend not in BACKENDS:
            bad(f"--backend {self.backend!r} is unknown; choose from {', '.join(BACKENDS)}")
        if self.device not in ("cpu", "cuda"):
            bad(f"--device must be cpu or cuda, got {self.device!r}")
        if self.backend == "nvshmem" and self.device != "cuda":
            bad("--backend nvshmem needs a CUDA GPU (run on a GPU machine, or use --backend torch)")
        if self.ranks < 1:
            bad(f"--ranks must be >= 1, got {self.ranks}")
        if self.ranks_per_gpu < 1:
            bad(f"--ranks-per-gpu must be >= 1, got {self.ranks_per_gpu}")
        if self.experts % self.ranks:
            bad(f"--experts {self.experts} must be divisible by the number of ranks ({self.ranks})")
        if self.side_channel not in SIDE_CHANNELS:
            bad(f"--side-channel must be one of {', '.join(SIDE_CHANNELS)}, got {self.side_channel!r}")
        if self.side_channel == "nccl" and (self.device != "cuda" or self.ranks_per_gpu > 1):
            bad("--side-channel nccl needs a GPU and one rank per GPU (NCCL refuses two ranks on one GPU); use gloo")
        if self.cuda_graph and (self.backend != "nvshmem" or self.device != "cuda"):
            bad("--cuda-graph needs the nvshmem backend on a GPU (the reference backend syncs with the host)")
        if self.transport not in TRANSPORTS:
            bad(f"--transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.transport != "auto" and (self.backend != "nvshmem" or self.device != "cuda"):
            bad(f"--transport {self.transport} needs the nvshmem backend on a GPU (the reference backend has no "
                "transport choice)")
        if self.transport == "put" and self.cuda_graph:
            bad("--transport put cannot be combined with --cuda-graph (the put path refuses graph capture)")
        if self.start not in START_MODES:
            bad(f"--start must be one of {', '.join(START_MODES)}, got {self.start!r}")
        if self.mps not in MPS_MODES:
            bad(f"--mps must be one of {', '.join(MPS_MODES)}, got {self.mps!r}")
        if self.num_sms is not None and self.num_sms < 1:
            bad(f"--num-sms must be a positive integer, got {self.num_sms}")
        if self.align not in ALIGNS:
            bad(f"--align must be one of {ALIGNS}, got {self.align}")
        if self.launch:
            if self.backend != "nvshmem":
                bad("--launch sets the nvshmem backend's kernel launches; the reference backend launches none")
            from ..ep.nvshmem.launch_config import LaunchConfig

            names = [f.name for f in dataclasses.fields(LaunchConfig)]
            unknown = [k for k in self.launch if k not in names]
            if unknown:
                bad(f"--launch: no LaunchConfig field {', '.join(unknown)} (fields: {', '.join(names)})")
            try:
                self.launch_config()
            except ValueError as e:
                bad(f"--launch: {e}")
        if self.iters < 1:
            bad(f"--iters must be >= 1, got {self.iters}")
        if self.warmup < 0:
            bad(f"--warmup must be >= 0, got {self.warmup}")
        for name in ("timeout_s", "pg_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                bad(f"--{name[:-2].replace('_', '-')} must be a positive number of seconds, got {v}")
        for p in self.precisions:  # backstop: the library's own checks
            try:
                self.ep_config(p).validate(self.ranks)
            except ValueError as e:
                bad(f"options give an invalid EP config: {e}")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``mxcomm bench`` options to ``p`` (defaults None = resolved by :func:`options_from_args`)."""
    g = p.add_argument_group("sizes")
    g.add_argument("--tokens", type=_int_list, help="tokens per rank; a comma list sweeps (GPU default 4096 "
                   "throughput / 128 latency; CPU 64 / 16)")
    g.add_argument("--hidden", type=int, help="hidden size, a multiple of 32 (GPU 7168, CPU 512)")
    g.add_argument("--topk", type=int, help="experts per token (default 8)")
    g.add_argument("--experts", type=int, help="global experts, divisible by the rank count (GPU 256, CPU 16)")
    g.add_argument("--align", type=int, default=32, help="expert group padding, 32 or 128 (default 32)")
    g.add_argument("--mode", choices=MODES, default="throughput", help="picks default tokens/iterations")
    w = p.add_argument_group("what and where")
    w.add_argument("--precision", type=_str_list, default=["mxfp8", "bf16"],
                   help="payload precisions, comma list of mxfp8,bf16 (default both)")
    w.add_argument("--impls", type=_str_list, default=list(IMPLS),
                   help=f"what to measure, comma list of {','.join(IMPLS)} (default all; baselines skip with a "
                        "stated reason where they cannot run)")
    w.add_argument("--ops", type=_str_list, default=list(OPS),
                   help=f"ops to time, comma list of {','.join(OPS)} (default all; *_bwd are the backward passes: "
                        "combine_bwd moves rows like dispatch, dispatch_bwd like combine, and the a2a/vdev2d "
                        "baselines are timed once per direction)")
    w.add_argument("--backend", choices=BACKENDS, help="mxcomm backend (GPU default nvshmem, CPU torch)")
    w.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if visible")
    w.add_argument("--ranks", type=int, help="EP size (GPU default: GPUs x --ranks-per-gpu; CPU default 4)")
    w.add_argument("--ranks-per-gpu", type=int, help="ranks sharing one GPU (>1: gloo side channel; "
                   "4 ranks need MPS; such runs do not measure NVLink)")
    w.add_argument("--side-channel", choices=SIDE_CHANNELS, default="auto",
                   help="torch.distributed backend of the world (auto: nccl with one rank per GPU, else gloo)")
    w.add_argument("--mps", choices=MPS_MODES, default="check",
                   help="several ranks on one GPU must run under MPS (without it they time-slice the GPU and the "
                        "times measure nothing): check (default) refuses to start without a running MPS daemon; start "
                        "starts a daemon for this run and stops it at the end")
    w.add_argument("--num-sms", type=int, help="SMs the mxcomm GPU kernels may use (default: all)")
    w.add_argument("--launch", type=_settings, metavar="FIELD=N[,...]",
                   help="nvshmem kernel launch settings (mxcomm.ep.LaunchConfig fields, e.g. partials_per_sm=16)")
    w.add_argument("--no-exact-sizes", action="store_true",
                   help="EPConfig(exact_sizes=False): worst-case output sizes, no host sync in the GPU backend")
    w.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="nvshmem backend: auto (one node: dispatch pulls rows through peer pointers, combine pushes), "
                        "push (dispatch stores into the receivers' buffers too: the earlier design) or put (force "
                        "the put-with-signal path that peers on other nodes use)")
    w.add_argument("--cuda-graph", action="store_true",
                   help="capture each mxcomm call (nvshmem backend, no-host-sync mode) into a CUDA graph and time "
                        "its replays: the call without Python/launch overhead (baselines stay eager)")
    t = p.add_argument_group("timing")
    t.add_argument("--iters", type=int, help="timed iterations per case (GPU 50 / 200 latency; CPU 10 / 20)")
    t.add_argument("--warmup", type=int, help="untimed iterations per case (GPU 10, CPU 2)")
    t.add_argument("--quick", action="store_true", help="few iterations (a smoke run)")
    t.add_argument("--start", choices=START_MODES, default="auto",
                   help="how the ranks start each timed call: barrier (a gloo barrier; its release skew lands in the "
                        "first rank's time), clock (one instant of the host's monotonic clock; all ranks on one host), "
                        "auto (clock with several ranks on one host, else barrier)")
    t.add_argument("--no-l2-flush", action="store_true",
                   help="do not flush the L2 before each timed call (GPU; the JSON's l2_flush_bytes is then 0)")
    t.add_argument("--seed", type=int, default=0, help="routing/data seed")
    t.add_argument("--no-check", action="store_true", help="skip the one-off mxcomm vs reference output check")
    t.add_argument("--timeout", type=float, help="seconds before a launched phase is killed (default 900 GPU, "
                   "300 CPU)")
    t.add_argument("--pg-timeout", type=float, default=300.0, help="torch.distributed collective timeout (s)")
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="DIR", help="results folder (default $XDG_CACHE_HOME/mxcomm/bench/<label>-<timestamp>, "
                   "XDG_CACHE_HOME defaulting to ~/.cache)")
    o.add_argument("--label", type=_label, help="name in the JSON and the file names (default <device>-ep<N>)")
    o.add_argument("--no-plot", action="store_true", help="no PNG plots")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--_spec", help=argparse.SUPPRESS)  # internal: a launched rank's spec file


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def options_from_args(args: argparse.Namespace, *, world_size: Optional[int] = None,
                      local_world_size: Optional[int] = None) -> BenchOptions:
    """Resolve parsed arguments into validated :class:`BenchOptions`.

    ``world_size`` / ``local_world_size``: given when joining a world started by torchrun/mpirun
    (then ``--ranks`` must agree or be absent). Raises :class:`OptionError`.
    """
    ngpu = _cuda_count() if args.device != "cpu" else 0  # --device cpu: torch not imported yet
    device = args.device
    if device == "auto":
        device = "cuda" if ngpu else "cpu"
    if device == "cuda" and not ngpu:
        raise OptionError("--device cuda: no CUDA GPU is visible")
    d = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    if args.ranks_per_gpu is not None and device != "cuda":
        raise OptionError("--ranks-per-gpu needs a GPU (on CPU use --ranks)")
    if world_size is not None:
        if args.ranks is not None and args.ranks != world_size:
            raise OptionError(f"--ranks {args.ranks} disagrees with the launcher's world size {world_size}")
        ranks = world_size
        local = local_world_size or world_size
        rpg = max(1, math.ceil(local / ngpu)) if device == "cuda" else 1
        if args.ranks_per_gpu is not None and args.ranks_per_gpu != rpg:
            raise OptionError(f"--ranks-per-gpu {args.ranks_per_gpu} disagrees with {local} local ranks on {ngpu} GPUs")
    elif device == "cuda":
        if args.ranks is not None:
            ranks = args.ranks
            if ranks < 1:
                raise OptionError(f"--ranks must be >= 1, got {ranks}")
            rpg = args.ranks_per_gpu or max(1, math.ceil(ranks / ngpu))
            if ranks > rpg * ngpu:
                raise OptionError(f"--ranks {ranks} does not fit --ranks-per-gpu {rpg} on {ngpu} GPU(s)")
        else:
            rpg = args.ranks_per_gpu or 1
            ranks = rpg * ngpu
    else:
        ranks = args.ranks if args.ranks is not None else CPU_RANKS
        rpg = 1
    quick = bool(args.quick)
    iters = args.iters if args.iters is not None else (d["quick_iters"] if quick else d["iters"][args.mode])
    warmup = args.warmup if args.warmup is not None else (d["quick_warmup"] if quick else d["warmup"])
    label = args.label or f"{'gpu' if device == 'cuda' else 'cpu'}-ep{ranks}" + (f"-{rpg}pergpu" if rpg > 1 else "")
    out = args.out or default_out_dir(label)
    opts = BenchOptions(
        tokens=list(args.tokens) if args.tokens else list(d["tokens"][args.mode]),
        hidden=args.hidden if args.hidden is not None else d["hidden"],
        topk=args.topk if args.topk is not None else d["topk"],
        experts=args.experts if args.experts is not None else d["experts"],
        precisions=list(args.precision), mode=args.mode,
        backend=args.backend or ("nvshmem" if device == "cuda" else "torch"),
        device=device, ranks=ranks, ranks_per_gpu=rpg, side_channel=args.side_channel,
        iters=iters, warmup=warmup, out=out, label=label, impls=list(args.impls), ops=list(args.ops),
        num_sms=args.num_sms, align=args.align, seed=args.seed, plot=not args.no_plot, quick=quick,
        check=not args.no_check, exact_sizes=not args.no_exact_sizes, cuda_graph=args.cuda_graph,
        transport=args.transport, timeout_s=args.timeout if args.timeout is not None else (900.0 if device == "cuda" else 300.0),
        pg_timeout_s=args.pg_timeout, progress=not args.no_progress, mps=args.mps,
        start=args.start, l2_flush=not args.no_l2_flush, launch=dict(args.launch or {}),
    )
    if opts.side_channel == "auto":
        opts.side_channel = "nccl" if device == "cuda" and rpg == 1 else "gloo"
    opts.validate()
    return opts


__all__ = ["BenchOptions", "OptionError", "add_bench_arguments", "options_from_args", "ops_for", "default_out_dir",
           "IMPLS", "MODES", "OPS", "BACKWARD_TWIN", "FORWARD_ONLY_IMPLS", "MPS_MODES", "PRECISIONS", "BACKENDS",
           "ALIGNS", "TRANSPORTS", "START_MODES"]
