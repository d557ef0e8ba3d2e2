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
                                       (("--world", "4", "--transport", "push"), "push"), (("--replayed",), "local"),
                                       (("--world", "2", "--replayed"), "pull")])
def test_host_glue_times_every_call_of_a_path(args, path):
    r = _run(*args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert ("whole-call graphs stood in for" in r.stdout) == ("--replayed" in args)
    world = dict(zip(args[::2], args[1::2])).get("--world", "1")
    assert f"path {path}, rank 0 of {world}," in r.stdout
    for op in ("dispatch", "combine", "combine_bwd", "dispatch_bwd"):
        (line,) = [ln for ln in r.stdout.splitlines() if ln.split()[:1] == [op]]
        assert float(line.split()[1]) > 0, line


def test_host_glue_refuses_a_world_that_does_not_divide_the_experts():
    r = _run("--world", "3")
    assert r.returncode != 0 and "must be divisible by --world 3" in r.stdout + r.stderr


def test_stand_in_replays_runs_each_captured_body_once_per_key_then_undoes():
    """--replayed: a whole-call graph's body runs at its key's first call (as the capture does) and never again; the
    first run's layout is returned for the key; undo restores the backend's own methods."""
    from mxcomm.bench.tools.host_glue import stand_in_replays

    class Backend:
        def __init__(self):
            self.ran = []

        def run_call(self, key, addresses, body):
            self.ran.append(("call", key, addresses))
            return body(addresses)

        def run_ring_call(self, key, addresses, body, copies):
            self.ran.append(("ring", key, addresses))
            body(addresses)

    be = Backend()
    undo = stand_in_replays(be)
    bodies = []
    assert be.run_call("a", (1,), lambda t: bodies.append(t) or f"layout{t}") == "layout(1,)"
    assert be.run_call("a", (2,), lambda t: bodies.append(t) or f"layout{t}") == "layout(1,)"
    assert be.run_call("b", (3,), lambda t: bodies.append(t) or f"layout{t}") == "layout(3,)"
    for adr in ((4,), (5,)):
        be.run_ring_call("r", adr, bodies.append, 4)
    assert bodies == [(1,), (3,), (4,)]
    assert [r[1:] for r in be.ran] == [("a", (1,)), ("b", (3,)), ("r", (4,))]
    undo()
    be.run_ring_call("r", (6,), bodies.append, 4)  # the backend's own method again
    assert bodies[-1] == (6,) and be.ran[-1] == ("ring", "r", (6,))


def test_host_glue_refuses_replayed_on_the_gpu():
    r = subprocess.run([sys.executable, "-m", "mxcomm.bench.tools.host_glue", "--device", "cuda", "--replayed"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "--replayed" in r.stdout + r.stderr
