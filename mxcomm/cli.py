"""Command line entry point: ``mxcomm bench`` and ``mxcomm info`` (see README)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mxcomm", description="MXFP8 expert-parallel communication")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("selfcheck", help="quantize self-check against the spec's worked examples")
    args = p.parse_args(argv)
    if args.cmd == "selfcheck":
        return _selfcheck()
    return 2


def _selfcheck() -> int:
    import torch

    from .mx import quantize

    x = torch.full((1, 32), 480.0)
    ok = int(quantize(x, mode="rceil").scales[0, 0]) == 128 and int(quantize(x, mode="floor").scales[0, 0]) == 127
    print("mxcomm selfcheck:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
