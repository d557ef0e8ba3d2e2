"""mxcomm.bench.tools.host_glue on the CPU: the four calls of the nvshmem backend's one-rank path and, as rank 0 of a
world whose peers are the process itself, of the pull and push paths, timed with the kernels stubbed out."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--tokens", "8", "--hidden", "64", "--experts", "8", "--topk", "2", "--calls", "2", "--rounds", "1"]


def _run(*args):
    env = dict(os.environ, TRITON_INTERPRET="1")  # Triton reads it when the kernels are defined: before the start
    return subprocess.run([sys.executable, "-m", "mxcomm.bench.tools.host_glue", *SMALL, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args,path", [((), "local"), (("--world", "2"), "pull"),
                                       (("--world", "4", "--transport", "push"), "push")])
def test_host_glue_times_every_call_of_a_path(args, path):
    r = _run(*args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    world = dict(zip(args[::2], args[1::2])).get("--world", "1")
    assert f"path {path}, rank 0 of {world}," in r.stdout
    for op in ("dispatch", "combine", "combine_bwd", "dispatch_bwd"):
        (line,) = [ln for ln in r.stdout.splitlines() if ln.split()[:1] == [op]]
        assert float(line.split()[1]) > 0, line


def test_host_glue_refuses_a_world_that_does_not_divide_the_experts():
    r = _run("--world", "3")
    assert r.returncode != 0 and "must be divisible by --world 3" in r.stdout + r.stderr
