"""Command line entry point: ``mxcomm bench``, ``mxcomm info`` and ``mxcomm selfcheck``.

Imports are lazy: building the parser imports neither torch, triton, matplotlib nor :mod:`mxcomm.ep`, so
``mxcomm --help`` and argument errors answer at once.

``mxcomm bench`` started plainly launches its own rank processes (one per GPU with the nvshmem backend;
4 CPU processes over gloo with the torch reference backend when there is no GPU). Started under
torchrun or mpirun it joins that world instead. See :mod:`mxcomm.bench`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The ``mxcomm`` parser and its sub-parsers by name."""
    from .bench.info import add_info_arguments
    from .bench.options import add_bench_arguments

    p = argparse.ArgumentParser(prog="mxcomm", description="MXFP8 expert-parallel communication")
    sub = p.add_subparsers(dest="cmd", required=True)
    subs = {}
    subs["selfcheck"] = sub.add_parser("selfcheck", help="quantize self-check against the spec's worked examples")
    b = sub.add_parser(
        "bench", help="dispatch/combine benchmark (MXFP8 vs BF16 vs baselines): table, JSON, PNG plots",
        description="Benchmark EP dispatch/combine. Started plainly it launches one rank per GPU (nvshmem "
                    "backend), or 4 CPU ranks over gloo (torch backend) without a GPU; under torchrun/mpirun "
                    "it joins that world.",
    )
    add_bench_arguments(b)
    subs["bench"] = b
    i = sub.add_parser("info", help="GPUs, peer access, versions, symmetric buffer bytes of a config")
    add_info_arguments(i)
    subs["info"] = i
    return p, subs


def main(argv: list[str] | None = None) -> int:
    p, subs = build_parser()
    args = p.parse_args(argv)
    if args.cmd == "selfcheck":
        return _selfcheck()
    if args.cmd == "info":
        from .bench.info import check_info_args, run_info

        try:
            check_info_args(args)
        except ValueError as e:
            subs["info"].error(str(e))
        return run_info(args)
    if args.cmd == "bench":
        return _bench(args, subs["bench"], sys.argv[1:] if argv is None else list(argv))
    return 2


def _bench(args, parser: argparse.ArgumentParser, argv: list) -> int:
    from .bench.options import BenchOptions, OptionError, options_from_args
    from .bench.world import detect_launch

    info = detect_launch()
    if args._spec:  # a rank started by the launcher
        from .bench.launcher import rank_main

        with open(args._spec) as f:
            spec = json.load(f)
        if info is None:
            parser.error("--_spec is internal: only for ranks started by mxcomm bench (RANK/WORLD_SIZE unset)")
        rank_main(BenchOptions.from_dict(spec["options"]), info, phase=spec["phase"], impls=spec["impls"],
                  result_path=spec["result_path"])
        return 0
    try:
        opts = options_from_args(args, world_size=info.world if info else None,
                                 local_world_size=info.local_world if info else None)
        from .bench.launcher import BenchError, BenchTerminated, check_mps, launch, precheck, run_joined

        if info is None:
            precheck(opts)
        else:
            check_mps(opts, joined=True)
    except OptionError as e:
        parser.error(str(e))
    command = ["mxcomm", "bench"] + argv[1:] if argv and argv[0] == "bench" else ["mxcomm", "bench"] + argv
    try:
        got = run_joined(opts, info, command) if info is not None else launch(opts, command)
    except BenchError as e:
        print(str(e), file=sys.stderr)
        return 1
    except BenchTerminated as e:
        print(str(e), file=sys.stderr)
        return 143
    if got is None:  # not rank 0 of a joined world
        return 0
    report, paths = got
    from .bench.report import format_table

    print(format_table(report), end="")
    print("")
    print(f"table: {paths['table']}")
    print(f"JSON:  {paths['json']}")
    for pth in paths.get("plots", []):
        print(f"plot:  {pth}")
    print(f"results written to {os.path.abspath(opts.out)}")
    failed = [c["name"] for c in report["cases"] if c["impl"] == "mxcomm" and c.get("status") == "failed"]
    if failed:
        print(f"mxcomm bench: {len(failed)} mxcomm case(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _selfcheck() -> int:
    import torch

    from .mx import quantize

    x = torch.full((1, 32), 480.0)
    ok = int(quantize(x, mode="rceil").scales[0, 0]) == 128 and int(quantize(x, mode="floor").scales[0, 0]) == 127
    print("mxcomm selfcheck:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
