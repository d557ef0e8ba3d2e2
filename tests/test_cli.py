"""The ``mxcomm`` command line: ``bench`` end to end on CPU (launcher, torchrun-style and mpirun worlds),
``info``, argument errors, and the report arithmetic. GPU runs of the same CLI are marked ``nvshmem``.

Every process is started with a timeout, so a hang fails the test instead of blocking CI.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxcomm.bench.launcher import BenchError, child_env, launch, symmetric_bytes
from mxcomm.bench.options import BenchOptions
from mxcomm.bench.report import finalize_cases
from mxcomm.bench.timing import percentile, summarize
from mxcomm.bench.world import detect_launch
from mxcomm.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--hidden", "64", "--experts", "8", "--topk", "2", "--iters", "3", "--warmup", "1",
        "--no-progress"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        env.pop(k, None)
    return env


def _run(args, timeout=120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mxcomm", *args], cwd=REPO, env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def _load(out: Path, label: str) -> dict:
    path = out / f"ep_bench_{label}.json"
    assert path.exists(), f"no {path}; folder holds {sorted(p.name for p in out.glob('*'))}"
    return json.loads(path.read_text())


def _rel(a, b) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


OPS = ("dispatch", "combine", "combine_bwd", "dispatch_bwd")
# a2a / vdev2d are timed for the forward ops only; a backward op is compared with the forward op moving the same rows.
TWIN = {"dispatch": "dispatch", "combine": "combine", "combine_bwd": "dispatch", "dispatch_bwd": "combine"}
BASELINE_KEYS = {"vs_reference": ("reference", "mxfp8"), "vs_a2a": ("a2a", "bf16"), "vs_vdev2d": ("vdev2d", "bf16"),
                 "vs_mxcomm_bf16": ("mxcomm", "bf16")}


def check_report(rep: dict, *, ranks: int, tokens: list, hidden: int, topk: int, iters: int,
                 precisions=("mxfp8", "bf16"), ops=OPS) -> None:
    """Everything a report must satisfy, whatever machine produced it."""
    assert rep["schema"] == "mxcomm.bench/1"
    assert rep["ep_size"] == ranks and rep["config"]["ranks"] == ranks
    assert rep["ranks_per_gpu"] >= 1
    assert rep["machine"]["hostname"] and rep["machine"]["cpu_count"] >= 1
    assert rep["versions"]["torch"] == torch.__version__ and rep["versions"]["mxcomm"]
    assert set(rep["byte_conventions"]) == {"dedup", "per_selection"}
    assert rep["timing"]["whole_call_measured"] is True
    assert rep["config"]["ops"] == list(ops)
    assert rep["conventions"]["backward_baselines"]["a2a"] == {"combine_bwd": "dispatch", "dispatch_bwd": "combine"}
    names = {c["name"] for c in rep["cases"]}
    impls = rep["config"]["impls"]
    # --backend torch: the mxcomm mxfp8 cases are the reference measurement, reported once
    merged = rep["mxcomm_is_reference"]
    assert merged == (rep["config"]["backend"] == "torch" and "reference" in impls and "mxcomm" in impls
                      and "mxfp8" in rep["config"]["precisions"])
    for T in tokens:
        for op in ops:
            for p in precisions:
                assert f"mxcomm/{p}/{op}/T{T}" in names
            if "reference" in impls and not merged:
                assert f"reference/mxfp8/{op}/T{T}" in names
            if "a2a" in impls:  # timed once per direction, backward ops included
                assert f"a2a/bf16/{TWIN[op]}/T{T}" in names
    assert {c["op"] for c in rep["cases"] if c["impl"] in ("a2a", "vdev2d")} <= {"dispatch", "combine"}
    assert {c["op"] for c in rep["cases"]} <= set(ops) | {TWIN[op] for op in ops}
    by = {(c["impl"], c["precision"], c["op"], c["tokens"]): c for c in rep["cases"]}
    one_host = len({d.rsplit(":", 2)[0] for d in rep["world"]["devices"]}) == 1
    auto = "clock" if one_host and ranks > 1 else "barrier"
    want_start = {"auto": auto}.get(rep["config"]["start"], rep["config"]["start"])
    for c in rep["cases"]:
        assert c["status"] == "ok", (c["name"], c.get("reason"))
        assert c["start"]["mode"] == want_start and 0 <= c["start"]["late_iterations"] <= iters
        skew = c["samples_us"]["start_skew"]
        if one_host:  # every rank's start instant on one clock: the spread is measured
            assert len(skew) == iters and all(v >= 0 for v in skew) and c["start_skew_us"]["n"] == iters
        else:
            assert skew is None and c["start_skew_us"] is None
        assert c["bytes_per_row"] == (hidden + hidden // 32 if c["precision"] == "mxfp8" else 2 * hidden)
        # Traffic: every (token, expert) slot lands on exactly one rank; each token reaches 1..k ranks.
        assert len(c["rows_sel"]) == ranks and sum(c["rows_sel"]) == ranks * c["tokens"] * topk
        assert ranks * c["tokens"] <= sum(c["rows_dedup"]) <= sum(c["rows_sel"])
        assert all(d <= s for d, s in zip(c["rows_dedup"], c["rows_sel"]))
        b = c["bytes"]
        assert b["dedup"] == pytest.approx(sum(c["rows_dedup"]) / ranks * c["bytes_per_row"])
        assert b["per_selection"] == pytest.approx(sum(c["rows_sel"]) / ranks * c["bytes_per_row"])
        for timing in ("whole_call", "kernel"):
            st = c["stats_us"][timing]
            if timing == "kernel" and not rep["timing"]["kernel_measured"]:
                assert st is None and c["samples_us"]["kernel"] is None
                continue
            samples = c["samples_us"][timing]
            assert len(samples) == iters and all(v > 0 for v in samples)
            # every rank's own times: their per-iteration max is the case's sample, their medians are reported
            own = c["samples_us"]["per_rank"][timing]
            assert len(own) == ranks and all(len(r) == iters for r in own)
            assert [max(r[i] for r in own) for i in range(iters)] == samples
            assert c["rank_medians_us"][timing] == [statistics.median(r) for r in own]
            assert st["n"] == iters and 0 < st["min"] <= st["p10"] <= st["median"] <= st["p90"] <= st["max"]
            for conv in ("dedup", "per_selection"):
                g = c["gbps"][conv][timing]
                assert g > 0 and _rel(g, b[conv] / (st["median"] * 1e-6) / 1e9) < 1e-9
        # the traffic floor (formulas: tests/bench/test_bench_floor.py) and the time over it
        assert c["floor_us"] > 0 and c["floor"]["bytes"] == c["floor"]["bytes_read"] + c["floor"]["bytes_written"]
        assert _rel(c["time_over_floor"]["whole_call"], c["stats_us"]["whole_call"]["median"] / c["floor_us"]) < 1e-9
        for name, r in c["ratios"].items():
            key = BASELINE_KEYS[name]
            base = by[(key[0], key[1], TWIN[c["op"]] if key[0] in ("a2a", "vdev2d") else c["op"], c["tokens"])]
            for timing, v in r.items():
                if v is None:
                    continue
                want = base["stats_us"][timing]["median"] / c["stats_us"][timing]["median"]
                assert _rel(v, want) < 1e-9
    # Every mxcomm case is compared to the baselines measured in the same run.
    want = {f"vs_{b}" for b in ("reference", "a2a") if b in impls and not (b == "reference" and merged)}
    for c in rep["cases"]:
        if c["impl"] == "mxcomm" and c["precision"] == "mxfp8":
            assert want <= set(c["ratios"]), (c["name"], c["ratios"])


# --------------------------------------------------------------------------------- end to end ----

def test_bench_cpu_launcher_end_to_end(tmp_path):
    """Plain start on CPU: 4 gloo processes (the CPU default), a token sweep, table + JSON + plots, written under
    $XDG_CACHE_HOME/mxcomm/bench/<label>-<timestamp> when no --out is given."""
    env = dict(_env(), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = _run(["bench", *TINY, "--tokens", "16,32", "--label", "e2e"], env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (out,) = (tmp_path / "cache" / "mxcomm" / "bench").glob("e2e-*")
    assert f"results written to {out}" in r.stdout
    rep = _load(out, "e2e")
    check_report(rep, ranks=4, tokens=[16, 32], hidden=64, topk=2, iters=3)
    assert rep["label"] == "e2e" and rep["world"]["launch"] == "launcher"
    assert rep["world"]["side_channel"] == "gloo" and rep["ranks_per_gpu"] == 1
    assert rep["config"]["backend"] == "torch" and rep["timing"]["kernel_measured"] is False
    assert any(s["impl"] == "vdev2d" and s["reason"] for s in rep["skipped"])
    assert rep["ceilings"]["host_copy"]["gbps"] > 0
    impl_ops = {(c["impl"], c["precision"], c["op"]) for c in rep["cases"]}
    # on CPU the library runs the reference backend: its mxfp8 cases are the reference ones, one row each
    assert impl_ops == ({(i, p, op) for i, p in (("mxcomm", "mxfp8"), ("mxcomm", "bf16")) for op in OPS}
                        | {("a2a", "bf16", "dispatch"), ("a2a", "bf16", "combine")})
    assert rep["mxcomm_is_reference"] and rep["merged"][0]["impl"] == "reference"
    for c in rep["cases"]:
        assert bool(c.get("is_reference")) == (c["impl"] == "mxcomm" and c["precision"] == "mxfp8"), c["name"]
    assert rep["floor_ceiling"] == "host_copy" and rep["mps"] is None
    # The backward ops against a2a: the forward case of the same direction (checked generally in check_report).
    by = {(c["impl"], c["precision"], c["op"], c["tokens"]): c for c in rep["cases"]}
    for T in (16, 32):
        for op, fwd in (("combine_bwd", "dispatch"), ("dispatch_bwd", "combine")):
            c, base = by[("mxcomm", "mxfp8", op, T)], by[("a2a", "bf16", fwd, T)]
            want = base["stats_us"]["whole_call"]["median"] / c["stats_us"]["whole_call"]["median"]
            assert c["ratios"]["vs_a2a"]["whole_call"] == pytest.approx(want, rel=1e-12)
            assert c["bytes"] == by[("mxcomm", "mxfp8", fwd, T)]["bytes"]  # same rows, same payload
    table = (out / "ep_bench_e2e.txt").read_text()
    assert "GB/s dedup" in table and "backward ops: x a2a" in table and "x floor" in table
    assert "on CPU the library runs the reference backend: one row" in table
    assert "x ref" not in table.splitlines()[[ln.startswith("op ") for ln in table.splitlines()].index(True)]
    ops_in_table = [ln.split()[0] for ln in table.splitlines() if ln.split() and ln.split()[0] in OPS]
    assert sorted(set(ops_in_table), key=ops_in_table.index) == list(OPS)  # table order
    assert "GB/s dedup" in r.stdout and str(out / "ep_bench_e2e.json") in r.stdout
    assert not list((REPO / "bench" / "results").glob("e2e-*"))  # nothing written into the source tree
    try:
        import matplotlib  # noqa: F401
        for png in rep["files"]["plots"]:
            assert (out / png).stat().st_size > 0
        assert len(rep["files"]["plots"]) == 2
    except ImportError:
        assert rep["files"]["plots"] == []


def test_bench_joins_torchrun_style_world(tmp_path):
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (as torchrun does): each process joins, rank 0 reports."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "tr"
    procs = []
    for rank in range(2):
        env = _env()
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mxcomm", "bench", *TINY, "--tokens", "24", "--precision", "mxfp8",
             "--ops", "dispatch", "--out", str(out), "--label", "joined", "--no-plot", "--start", "barrier"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    rep = _load(out, "joined")
    check_report(rep, ranks=2, tokens=[24], hidden=64, topk=2, iters=3, precisions=("mxfp8",), ops=("dispatch",))
    assert rep["world"]["launch"] == "torchrun" and rep["config"]["start"] == "barrier"
    assert {c["op"] for c in rep["cases"]} == {"dispatch"}  # --ops dispatch: nothing else timed
    assert "GB/s dedup" in outs[0] and "GB/s dedup" not in outs[1]


def _mpirun():
    return shutil.which("mpirun") or (shutil.which("mpirun", path=os.path.dirname(sys.executable)))


@pytest.mark.mpi
@pytest.mark.skipif(_mpirun() is None, reason="mpirun not found")
def test_bench_joins_mpirun_world(tmp_path):
    out = tmp_path / "mpi"
    cmd = [_mpirun(), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2",
           sys.executable, "-m", "mxcomm", "bench", *TINY, "--tokens", "8", "--precision", "bf16",
           "--impls", "mxcomm,a2a", "--out", str(out), "--label", "mpi", "--no-plot"]
    r = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = _load(out, "mpi")
    check_report(rep, ranks=2, tokens=[8], hidden=64, topk=2, iters=3, precisions=("bf16",))
    assert rep["world"]["launch"] == "mpirun"
    assert {c["impl"] for c in rep["cases"]} == {"mxcomm", "a2a"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="uses a CUDA-less machine to make the ranks fail")
def test_launcher_reports_failed_ranks_in_bounded_time(tmp_path):
    """Ranks that die make launch() raise BenchError naming the exit codes (no hang, no report)."""
    opts = BenchOptions(tokens=[8], hidden=64, topk=2, experts=4, precisions=["bf16"], mode="throughput",
                        backend="torch", device="cuda", ranks=2, ranks_per_gpu=1, side_channel="gloo", iters=1,
                        warmup=0, out=str(tmp_path / "x"), label="fail", impls=["a2a"], timeout_s=60, progress=False)
    with pytest.raises(BenchError, match="exit"):
        launch(opts, command=["test"])
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------- info ----

def test_info_reports_environment_and_buffer_sizes():
    from mxcomm.ep import EPConfig, buffer_sizes
    from mxcomm.ep.plan import call_output_rows

    r = _run(["info", "--world", "1,4", "--tokens", "128", "--json"], timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["versions"]["torch"] == torch.__version__
    assert d["machine"]["gpu_count"] == len(d["machine"]["gpus"])
    assert len(d["buffers"]) == 4  # 2 worlds x 2 precisions
    for b in d["buffers"]:
        assert b["total"] == sum(reg["bytes"] for reg in b["regions"]) == sum(b["by_purpose"].values())
        cfg = EPConfig(num_experts=256, hidden=7168, topk=8, max_tokens_per_rank=128, precision=b["precision"])
        assert b["total"] == buffer_sizes(cfg, b["world"]).total
        assert b["launcher_env"]["NVSHMEM_SYMMETRIC_SIZE"] == b["nvshmem_symmetric_size"]
        # 1 and 4 ranks of 128 tokens: the dispatch as one captured call, its output's storage (not symmetric)
        assert b["call_output_rows"] == call_output_rows(cfg, b["world"], 128) > 0
        per_row = 7168 + 7168 // 32 if b["precision"] == "mxfp8" else 2 * 7168
        assert b["call_output_bytes"] >= b["call_output_rows"] * per_row
    text = _run(["info", "--world", "2"], timeout=60)
    # world 2: the pull path (send copies and pull list, no receive buffer)
    assert text.returncode == 0 and "ep.send_q" in text.stdout and "NVSHMEM_SYMMETRIC_SIZE=" in text.stdout
    assert "ep.recv_q" not in text.stdout
    # 2 x 4096 tokens: one call from a token count's second call, its output sized from the call before
    assert "pull path: an exact-size dispatch of 4,096 tokens" not in text.stdout
    assert "the last call of its token count brought plus 12 %" in text.stdout
    if not d["machine"]["gpus"]:  # no GPU: nothing about NVLink multicast
        assert d["nvlink_multicast"] is None and "multicast" not in text.stdout.lower()
    else:
        assert d["nvlink_multicast"] and "NVLink multicast:" in text.stdout
    put = _run(["info", "--world", "4", "--tokens", "128", "--precision", "mxfp8", "--transport", "put", "--json"],
               timeout=60)
    assert put.returncode == 0, put.stderr[-2000:]
    (b,) = json.loads(put.stdout)["buffers"]
    cfg = EPConfig(num_experts=256, hidden=7168, topk=8, max_tokens_per_rank=128, transport="put")
    assert b["by_purpose"]["put_staging"] == buffer_sizes(cfg, 4).put_staging > 0
    assert b["total"] == sum(reg["bytes"] for reg in b["regions"]) == buffer_sizes(cfg, 4).total
    assert {"ep.stage_q", "ep.stage_s"} <= {reg["name"] for reg in b["regions"]}
    # the put path's rounds: its dispatch window (and the worst routing's rounds through it), and above W = k the
    # combine direction's rounds of T_max * k // W tokens
    from mxcomm.ep.plan import max_recv_rows, recv_window_rows

    assert b["path"] == "put" and b["recv_window_rows"] == recv_window_rows(cfg, 4, True)
    assert b["worst_dispatch_rounds"] == -(-max_recv_rows(cfg, 4) // b["recv_window_rows"]) > 1
    assert (b["round_tokens"], b["combine_rounds"]) == (128, 1)
    wide = _run(["info", "--world", "16", "--tokens", "128", "--precision", "mxfp8", "--transport", "put"], timeout=60)
    assert wide.returncode == 0 and "combine and combine backward in 2 round(s) of 64 tokens" in wide.stdout


# ------------------------------------------------------------------------------- lazy imports ----

_HEAVY = """
import runpy, sys
sys.argv = ["mxcomm", *sys.argv[1:]]
try:
    runpy.run_module("mxcomm", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "matplotlib")
               or m == "mxcomm.ep" or m.startswith("mxcomm.ep."))
print("HEAVY", code, ",".join(heavy[:8]), file=sys.stderr)
"""


@pytest.mark.parametrize("args, code", [
    (["--help"], 0), (["bench", "--help"], 0), (["info", "--help"], 0),
    (["bench", "--tokens", "abc"], 2),                      # argparse error
    (["bench", "--device", "cpu", "--hidden", "100"], 2),   # option check
])
def test_help_and_argument_errors_import_no_torch(args, code):
    """`python -m mxcomm --help` (and argument errors) answer without importing torch, triton, matplotlib or
    mxcomm.ep (checked in sys.modules of a fresh interpreter)."""
    r = subprocess.run([sys.executable, "-c", _HEAVY, *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=60)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("HEAVY ")]
    assert line, r.stderr[-2000:]
    _, got_code, heavy = (line[-1].split(" ", 2) + [""])[:3]
    assert got_code == str(code) and heavy == "", line[-1]


# --------------------------------------------------------------------------------- bad options ----

@pytest.mark.parametrize("args, message", [
    (["--experts", "10", "--ranks", "4"], "--experts 10 must be divisible by the number of ranks (4)"),
    (["--hidden", "100"], "--hidden 100 must be a positive multiple of 32"),
    (["--precision", "mxfp8,fp4"], "--precision 'fp4' is unknown"),
    (["--topk", "20", "--experts", "16"], "--topk 20 must not exceed --experts 16"),
    (["--tokens", "0"], "--tokens must be positive"),
    (["--tokens", "12,abc"], "argument --tokens: 'abc' is not an integer"),
    (["--backend", "nvshmem"], "--backend nvshmem needs a CUDA GPU"),
    (["--ranks-per-gpu", "2"], "--ranks-per-gpu needs a GPU"),
    (["--impls", "mxcomm,nccl"], "--impls 'nccl' is unknown"),
    (["--ops", "dispatch,backward"], "--ops 'backward' is unknown; choose from dispatch, combine, combine_bwd, "
                                     "dispatch_bwd"),
    (["--ops", "combine_bwd,dispatch,combine_bwd"], "--ops lists 'combine_bwd' more than once"),
    (["--ops", ","], "argument --ops: empty list"),
    (["--cuda-graph", "--device", "cpu"], "--cuda-graph needs the nvshmem backend on a GPU"),
    (["--transport", "put"], "--transport put needs the nvshmem backend on a GPU"),
    (["--transport", "ib"], "argument --transport: invalid choice"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--num-sms", "0"], "--num-sms must be a positive integer"),
    (["--side-channel", "nccl"], "--side-channel nccl needs a GPU"),
    (["--label", "a/b"], "argument --label"),
    (["--mode", "fast"], "argument --mode: invalid choice"),
])
def test_bench_bad_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", "--out", "/nonexistent/never-written", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: mxcomm bench" in err


@pytest.mark.parametrize("args, message", [
    (["--hidden", "100"], "--hidden 100 must be a multiple of 32"),
    (["--experts", "256", "--world", "3"], "--experts 256 must be divisible by the EP size --world 3"),
    (["--precision", "fp8"], "--precision 'fp8' is unknown"),
])
def test_info_bad_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["info", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_arguments_exit_nonzero_as_a_command():
    r = _run(["bench", "--device", "cpu", "--experts", "10", "--topk", "2", "--ranks", "4"], timeout=60)
    assert r.returncode == 2
    assert "--experts 10 must be divisible by the number of ranks (4)" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------- options, env, launch ----

def _args(*extra):
    from mxcomm.cli import build_parser

    p, _ = build_parser()
    return p.parse_args(["bench", "--device", "cpu", *extra])


def test_cpu_defaults_and_modes():
    from mxcomm.bench.options import options_from_args

    o = options_from_args(_args())
    assert (o.tokens, o.hidden, o.topk, o.experts, o.ranks, o.backend) == ([64], 512, 8, 16, 4, "torch")
    assert o.side_channel == "gloo" and o.precisions == ["mxfp8", "bf16"] and o.label == "cpu-ep4"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    assert o.out.startswith(os.path.join(cache, "mxcomm", "bench", "cpu-ep4-"))
    lat = options_from_args(_args("--mode", "latency"))
    assert lat.tokens == [16] and lat.iters > o.iters
    q = options_from_args(_args("--quick"))
    assert q.iters < o.iters and q.warmup <= o.warmup
    j = options_from_args(_args(), world_size=2, local_world_size=2)
    assert j.ranks == 2
    from mxcomm.bench.options import OptionError

    with pytest.raises(OptionError, match="--ranks 3 disagrees with the launcher's world size 2"):
        options_from_args(_args("--ranks", "3"), world_size=2)


def test_ops_option_and_steps():
    """--ops picks the timed ops (run in the fixed op order); a2a/vdev2d time the forward op of each direction."""
    from mxcomm.bench.harness import steps_for
    from mxcomm.bench.options import options_from_args

    assert options_from_args(_args()).ops == list(OPS)
    o = options_from_args(_args("--ops", "dispatch_bwd,combine_bwd", "--tokens", "8", "--precision", "mxfp8"))
    assert o.ops == ["dispatch_bwd", "combine_bwd"] and o.to_dict()["ops"] == o.ops
    steps = steps_for(o, ["mxcomm", "reference", "a2a", "vdev2d"])
    assert [(impl, op) for _, impl, _, op in steps] == [
        ("mxcomm", "combine_bwd"), ("mxcomm", "dispatch_bwd"), ("reference", "combine_bwd"),
        ("reference", "dispatch_bwd"), ("a2a", "dispatch"), ("a2a", "combine"), ("vdev2d", "dispatch"),
        ("vdev2d", "combine")]
    o.ops = ["dispatch"]
    assert [(impl, op) for _, impl, _, op in steps_for(o, ["mxcomm", "a2a"])] == [("mxcomm", "dispatch"),
                                                                                 ("a2a", "dispatch")]


def test_child_env_sets_rank_and_nvshmem_vars_without_touching_os_environ(monkeypatch):
    from mxcomm.ep import buffer_sizes
    from mxcomm.transport import symmetric_size_for

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    before = dict(os.environ)
    base = dict(tokens=[128, 256], hidden=1024, topk=4, experts=16, precisions=["mxfp8", "bf16"], mode="throughput",
                ranks=2, ranks_per_gpu=1, side_channel="gloo", iters=1, warmup=0, out="x", label="x")
    cpu = BenchOptions(backend="torch", device="cpu", **base)
    e = child_env(cpu, "main", 1, 12345)
    assert (e["RANK"], e["WORLD_SIZE"], e["MASTER_PORT"], e["MXCOMM_BENCH_LAUNCHED"]) == ("1", "2", "12345", "1")
    assert "NVSHMEM_SYMMETRIC_SIZE" not in e or e["NVSHMEM_SYMMETRIC_SIZE"] == before.get("NVSHMEM_SYMMETRIC_SIZE")
    gpu = BenchOptions(backend="nvshmem", device="cuda", **base)
    want = sum(buffer_sizes(gpu.ep_config(p), 2).total for p in ("mxfp8", "bf16"))
    assert symmetric_bytes(gpu, "main") == want
    e = child_env(gpu, "main", 0, 1)
    assert e["NVSHMEM_SYMMETRIC_SIZE"] == symmetric_size_for(want)
    assert e["NVSHMEM_DISABLE_NVLS"] == "1" and e["NCCL_NVLS_ENABLE"] == "0"
    assert "TRITON_INTERPRET" not in e  # GPU ranks compile real kernels
    assert symmetric_bytes(gpu, "symm") > 0
    assert dict(os.environ) == before


def test_detect_launch():
    assert detect_launch({}) is None
    t = detect_launch({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (t.kind, t.rank, t.world, t.local_rank, t.local_world) == ("torchrun", 1, 4, 1, 2)
    m = detect_launch({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"})
    assert (m.kind, m.rank, m.world, m.local_rank) == ("mpirun", 3, 4, 3)
    la = detect_launch({"RANK": "0", "WORLD_SIZE": "1", "MXCOMM_BENCH_LAUNCHED": "1"})
    assert la.kind == "launcher"


# ------------------------------------------------------------------------------- report maths ----

def test_statistics_match_numpy():
    import numpy as np

    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 7, 50):
        v = (torch.rand(n, generator=g) * 100 + 1).tolist()
        for q in (10, 50, 90):
            assert percentile(v, q) == pytest.approx(float(np.percentile(v, q)))
        s = summarize(v)
        assert s["median"] == pytest.approx(float(np.median(v))) and s["n"] == n


def test_finalize_cases_bandwidth_and_ratios():
    g = torch.Generator().manual_seed(5)

    def raw(impl, prec, op, bpr, scale):
        w = (torch.rand(9, generator=g) * scale + scale).tolist()
        return dict(impl=impl, precision=prec, op=op, tokens=64, status="ok", bytes_per_row=bpr,
                    rows_dedup=[100, 120], rows_sel=[300, 340], samples_us=dict(whole_call=w, kernel=None))

    cases = finalize_cases([raw("mxcomm", "mxfp8", "dispatch", 66, 10.0), raw("a2a", "bf16", "dispatch", 128, 30.0),
                            raw("reference", "mxfp8", "dispatch", 66, 50.0),
                            dict(raw("mxcomm", "bf16", "dispatch", 128, 1.0), status="failed", reason="boom")])
    mx = cases[0]
    med = mx["stats_us"]["whole_call"]["median"]
    assert mx["bytes"]["dedup"] == 110 * 66 and mx["bytes"]["per_selection"] == 320 * 66
    assert mx["gbps"]["dedup"]["whole_call"] == pytest.approx(110 * 66 / (med * 1e-6) / 1e9)
    assert mx["ratios"]["vs_a2a"]["whole_call"] == pytest.approx(cases[1]["stats_us"]["whole_call"]["median"] / med)
    assert mx["ratios"]["vs_reference"]["whole_call"] > 1  # the reference samples are ~5x slower
    assert "vs_mxcomm_bf16" not in mx["ratios"]  # a failed case is no baseline
    assert cases[3]["gbps"] is None and cases[3]["ratios"] == {}
    # one rank on one GPU: the loopback byte count against the device copy ceiling of the run
    from mxcomm.bench.report import add_loopback_traffic

    add_loopback_traffic(mx, 32, 1000.0)
    lt = mx["loopback_traffic"]
    assert lt["bytes"] == 64 * 2 * 32 + 320 * 66
    assert lt["gbps"]["whole_call"] == pytest.approx(lt["bytes"] / (med * 1e-6) / 1e9)
    assert lt["fraction_of_device_copy"]["whole_call"] == pytest.approx(lt["gbps"]["whole_call"] / 1000.0)
    assert "bytes_touched" not in lt  # dispatch: the loopback count is what it touches
    add_loopback_traffic(cases[3], 32, 1000.0)
    assert "loopback_traffic" not in cases[3]  # no timings, no figure
    comb = finalize_cases([raw("mxcomm", "mxfp8", "combine", 66, 10.0)])[0]  # reads BF16 expert rows: 2H per selection
    add_loopback_traffic(comb, 32, 1000.0)
    lt = comb["loopback_traffic"]
    assert lt["bytes"] == 64 * 2 * 32 + 320 * 66 and lt["bytes_touched"] == 64 * 2 * 32 + 320 * 2 * 32
    med = comb["stats_us"]["whole_call"]["median"]
    assert lt["fraction_touched_of_device_copy"]["whole_call"] == pytest.approx(
        lt["bytes_touched"] / (med * 1e-6) / 1e9 / 1000.0)


# ------------------------------------------------------------------------------------ GPU runs ----

@pytest.mark.nvshmem
@pytest.mark.parametrize("ranks, graph", [(1, False), (2, False), (2, True)])
def test_bench_gpu_small(tmp_path, ranks, graph):
    """The CLI on a GPU (nvshmem backend), small sizes: 1 rank, and 2 ranks (on two GPUs when there are two,
    else sharing one); with --cuda-graph the mxcomm calls are timed as graph replays."""
    out = tmp_path / "gpu"
    r = _run(["bench", "--ranks", str(ranks), "--tokens", "128,256", "--hidden", "1024", "--experts", "16",
              "--topk", "4", "--iters", "5", "--warmup", "2", "--out", str(out), "--label", f"gpu{ranks}",
              "--no-progress", "--timeout", "400", *(["--cuda-graph"] if graph else [])], timeout=500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rep = _load(out, f"gpu{ranks}")
    ok = [c for c in rep["cases"] if c["impl"] != "vdev2d" or c["status"] == "ok"]
    rep_ok = dict(rep, cases=ok)
    check_report(rep_ok, ranks=ranks, tokens=[128, 256], hidden=1024, topk=4, iters=5)
    assert rep["timing"]["kernel_measured"] is True and rep["config"]["backend"] == "nvshmem"
    assert rep["ceilings"]["device_copy"]["gbps"] > 0
    assert rep["checks"] and all(c["status"] == "ok" and c["dispatch_equal_all_ranks"] for c in rep["checks"])
    vd = [c for c in rep["cases"] if c["impl"] == "vdev2d"]
    assert vd or any(s["impl"] == "vdev2d" and s["reason"] for s in rep["skipped"])
    if rep["ranks_per_gpu"] > 1:
        assert rep["measures_nvlink"] is False and "share" in rep["world_note"]
    mine = [c for c in rep["cases"] if c["impl"] == "mxcomm"]
    assert mine and all(c["status"] == "ok" and c.get("cuda_graph") is graph for c in mine)


def test_mpirun_rendezvous_choices(monkeypatch):
    """TCP at MASTER_ADDR:MASTER_PORT when set; without them and without mpi4py, a file store named after the job."""
    from mxcomm.bench.world import LaunchInfo, _mpi_init_method

    info = LaunchInfo("mpirun", 0, 2, 0, 2)
    assert _mpi_init_method(info, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == "tcp://10.0.0.1:29500"
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py -> ImportError
    m = _mpi_init_method(info, {"PMIX_NAMESPACE": "prterun-vm-123@1"})
    assert m.startswith("file://") and m.endswith("mxcomm_bench_store_prterun_vm_123_1")
    with pytest.raises(RuntimeError, match="cannot rendezvous"):
        _mpi_init_method(info, {})


# ----------------------------------------------------------------- harness inside a gloo world ----

def _bench_world(rank, world):
    import torch.distributed as dist

    from mxcomm.bench.world import BenchWorld, LaunchInfo

    return BenchWorld(launch=LaunchInfo("torchrun", rank, world, rank, world), rank=rank, world=world,
                      device=torch.device("cpu"), side_channel="gloo", ctrl=dist.group.WORLD, ranks_per_gpu=1,
                      devices=["h:cpu"] * world)


def _check_worker(rank, world):
    """check_against_reference of two reference groups (the code path a GPU run uses against nvshmem)."""
    from mxcomm.bench.cases import check_against_reference
    from mxcomm.bench.routing import make_inputs
    from mxcomm.ep import EPConfig, EPGroup

    out = []
    for prec in ("mxfp8", "bf16"):
        cfg = EPConfig(num_experts=8, hidden=64, topk=3, max_tokens_per_rank=40, precision=prec)
        a, b = EPGroup(cfg), EPGroup(cfg)
        inp = make_inputs(seed=1, rank=rank, tokens=40, hidden=64, topk=3, experts=8, device=torch.device("cpu"))
        out.append(check_against_reference(a, b, inp, seed=2, rank=rank))
    return out


class _Poisoned:
    """An EPGroup whose dispatch output gets its rows past the last group (the no-sync tail, which no kernel writes)
    filled with garbage, and with ``row`` set also one row inside the groups (a wrong result)."""

    def __init__(self, group, row=None):
        self.group, self.config, self.row = group, group.config, row

    def dispatch(self, *args):
        d = self.group.dispatch(*args)
        n = int(d.offs[-1])
        rows = d.x.qdata.view(torch.uint8) if self.config.precision == "mxfp8" else d.x.view(torch.int16)
        rows[n:] = 77
        if self.row is not None:
            rows[self.row] = 77
        return d

    def combine(self, *args):
        return self.group.combine(*args)


def _no_sync_check_worker(rank, world):
    """check_against_reference in the no-sync mode (both groups): the unwritten tail is not compared, a wrong row is
    found."""
    from mxcomm.bench.cases import check_against_reference
    from mxcomm.bench.routing import make_inputs
    from mxcomm.ep import EPConfig, EPGroup

    out = []
    for prec in ("mxfp8", "bf16"):
        cfg = EPConfig(num_experts=8, hidden=64, topk=3, max_tokens_per_rank=40, precision=prec, exact_sizes=False)
        inp = make_inputs(seed=1, rank=rank, tokens=40, hidden=64, topk=3, experts=8, device=torch.device("cpu"))
        for row in (None, 0):
            a, b = _Poisoned(EPGroup(cfg), row), EPGroup(cfg)
            out.append(check_against_reference(a, b, inp, seed=2, rank=rank)["dispatch_equal"])
    return out


def _failing_backend_worker(rank, world, opts_dict):
    """run_phase when the mxcomm groups cannot be built and the reference backend lacks combine_backward: those
    cases fail with the reason, the others still run."""
    from mxcomm.bench.harness import run_phase
    from mxcomm.ep.reference import TorchBackend

    del TorchBackend.combine_backward  # this spawned rank only
    return run_phase(BenchOptions.from_dict(opts_dict), _bench_world(rank, world), ["mxcomm", "reference", "a2a"])


def test_check_against_reference_in_a_world():
    from _dist import run_world  # tests/ is on sys.path (pytest's rootdir conftest)

    for res in run_world(2, _check_worker, timeout=120):
        assert res == [dict(dispatch_equal=True, combine_max_abs_diff=0.0)] * 2


def test_check_against_reference_no_sync_compares_the_written_rows():
    from _dist import run_world

    for res in run_world(2, _no_sync_check_worker, timeout=120):
        assert res == [True, False, True, False]  # per precision: tail poisoned only, then a real row too


def test_phase_survives_a_backend_that_cannot_start(tmp_path):
    from _dist import run_world

    from mxcomm.bench.report import build_report, format_table

    opts = BenchOptions(tokens=[4, 8], hidden=64, topk=2, experts=4, precisions=["mxfp8"], mode="throughput",
                        backend="nvshmem", device="cpu", ranks=2, ranks_per_gpu=1, side_channel="gloo", iters=2,
                        warmup=0, out=str(tmp_path), label="x", progress=False)
    res = run_world(2, _failing_backend_worker, opts.to_dict(), timeout=120)[0]
    st = {(c["impl"], c["op"], c["tokens"]): c for c in res["cases"]}
    for T in (4, 8):
        for op in OPS:
            assert st[("mxcomm", op, T)]["status"] == "failed" and "nvshmem" in st[("mxcomm", op, T)]["reason"]
        for impl, op in [("a2a", "dispatch"), ("a2a", "combine"), ("reference", "dispatch"), ("reference", "combine"),
                         ("reference", "dispatch_bwd")]:
            assert st[(impl, op, T)]["status"] == "ok" and len(st[(impl, op, T)]["samples_us"]["whole_call"]) == 2
    bwd = st[("reference", "combine_bwd", 4)]
    assert bwd["status"] == "failed" and "combine_backward" in bwd["reason"]  # the backend's error, named
    later = st[("reference", "combine_bwd", 8)]  # later token counts of that op only are skipped
    assert later["status"] == "skipped" and "combine_backward" in later["reason"]
    res.update(world=dict(ranks_per_gpu=1, side_channel="gloo"))
    rep = build_report(options=opts.to_dict(), world=res["world"], meta={}, phases=[res], command=["t"])
    table = format_table(rep)
    assert "failed: EPGroup(backend='nvshmem'" in table and "a2a" in table
    assert "skipped: an earlier reference mxfp8 combine_bwd case failed" in table


def _ranks_of(parent_pid: int) -> set:
    """Pids of live processes started by the bench launcher ``parent_pid`` (their environment names it)."""
    tag = f"MXCOMM_BENCH_PARENT_PID={parent_pid}".encode()
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if tag in (d / "environ").read_bytes().split(b"\0"):
                stat = (d / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found.add(int(d.name))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_ranks_die_with_the_launcher(tmp_path, sig):
    """`timeout` (SIGTERM) or a hard kill of `mxcomm bench` must not leave rank processes behind."""
    import signal
    import time

    # (TMPDIR: a launcher killed hard cannot remove its working folder; it stays under tmp_path, not in /tmp)
    p = subprocess.Popen([sys.executable, "-m", "mxcomm", "bench", *TINY, "--ranks", "2", "--iters", "1000000",
                          "--out", str(tmp_path), "--label", "kill"], cwd=REPO, env=dict(_env(), TMPDIR=str(tmp_path)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(_ranks_of(p.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
        ranks = _ranks_of(p.pid)
        assert len(ranks) == 2, "the launcher did not start its ranks"
        time.sleep(1.0)
        p.send_signal(getattr(signal, sig))
        p.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _ranks_of(p.pid) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not _ranks_of(p.pid), f"rank processes survived {sig} of the launcher"
        if sig == "SIGTERM":
            assert p.returncode == 143
    finally:
        if p.poll() is None:
            p.kill()
        for pid in _ranks_of(p.pid):
            os.kill(pid, signal.SIGKILL)
