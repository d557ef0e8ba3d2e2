"""Options of ``mxcomm bench`` that do not need a run: the EP choices, the default results folder."""
from __future__ import annotations

import datetime
import os

from mxcomm.bench import options


def test_cli_choices_match_the_ep_config():
    """The CLI spells the EP choices out (so that --help does not import mxcomm.ep): they must stay equal."""
    from mxcomm.ep import config

    for name in ("PRECISIONS", "BACKENDS", "ALIGNS", "TRANSPORTS"):
        assert getattr(options, name) == getattr(config, name), name


def test_default_out_dir_is_under_the_xdg_cache():
    now = datetime.datetime(2025, 1, 2, 3, 4, 5)
    assert options.default_out_dir("cpu-ep4", {"XDG_CACHE_HOME": "/c"}, now) == "/c/mxcomm/bench/cpu-ep4-20250102-030405"
    home = options.default_out_dir("x", {}, now)
    assert home == os.path.join(os.path.expanduser("~"), ".cache", "mxcomm", "bench", "x-20250102-030405")
    assert options.default_out_dir("x", {"XDG_CACHE_HOME": ""}, now) == home  # empty = unset


def test_l2_flush_is_on_unless_switched_off():
    """``--no-l2-flush`` reaches the options (and their JSON form) as ``l2_flush=False``; the default flushes."""
    import argparse

    def parse(*argv):
        p = argparse.ArgumentParser()
        options.add_bench_arguments(p)
        return options.options_from_args(p.parse_args(["--ranks", "1", "--no-plot", *argv]))

    on, off = parse(), parse("--no-l2-flush")
    assert on.l2_flush is True and off.l2_flush is False
    assert options.BenchOptions.from_dict(off.to_dict()).l2_flush is False
