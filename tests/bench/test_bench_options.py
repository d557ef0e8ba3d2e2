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


def test_launch_settings_reach_the_ep_config():
    """``--launch FIELD=N,...`` sets those LaunchConfig fields in the run's EPConfig (the rest keep their defaults)
    and survives the options' JSON form (the launched ranks read it); bad fields, values and backends are refused
    with the option named. (The nvshmem options are made by hand here: on a machine without a GPU the command line
    refuses that backend first.)"""
    import argparse
    import dataclasses

    import pytest

    from mxcomm.ep import LaunchConfig

    p = argparse.ArgumentParser()
    options.add_bench_arguments(p)
    assert p.parse_args(["--launch", "partials_per_sm=16, reduce_warps=8"]).launch == {"partials_per_sm": 16,
                                                                                     "reduce_warps": 8}
    with pytest.raises(SystemExit):  # not FIELD=N: argparse's own error
        p.parse_args(["--launch", "reduce_warps"])
    cpu = options.options_from_args(p.parse_args(["--ranks", "1", "--no-plot"]))
    assert cpu.launch == {} and cpu.ep_config("mxfp8").launch is None  # no --launch: the backend's defaults
    with pytest.raises(options.OptionError, match="reference backend"):
        options.options_from_args(p.parse_args(["--ranks", "1", "--no-plot", "--launch", "reduce_warps=8"]))

    def gpu(launch):
        return dataclasses.replace(cpu, backend="nvshmem", device="cuda", side_channel="gloo", launch=launch)

    opts = gpu({"partials_per_sm": 16, "reduce_warps": 8})
    opts.validate()
    want = LaunchConfig(partials_per_sm=16, reduce_warps=8)
    assert opts.ep_config("mxfp8").launch == want and want != LaunchConfig()
    assert options.BenchOptions.from_dict(opts.to_dict()).ep_config("bf16").launch == want
    for launch, match in (({"partial_per_sm": 16}, "no LaunchConfig field partial_per_sm"),
                          ({"reduce_warps": 3}, "reduce_warps must be a power of two")):
        with pytest.raises(options.OptionError, match=match):
            gpu(launch).validate()
