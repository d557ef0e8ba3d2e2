"""bench/bench_ep_kernels.py runs end to end under the CPU interpreter (tiny sizes, dropped slots): every
kernel it times (push, pull and local dispatch paths, their receivers, reduce with and without own rows, the naive
baselines, the access-pattern ceilings) produced the reference output."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch


def _lab_results(tmp_path, *args) -> list:
    """Run the lab under the interpreter at tiny sizes (29 tokens, H 128, 8 experts, top-3, 20 % of the slots
    dropped, 1 program and one per token, 4 warps, 64-value chunks) with ``args``; its results."""
    root = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "k.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, str(root / "bench" / "bench_ep_kernels.py"), "--tokens", "29", "--hidden", "128",
         "--experts", "8", "--topk", "3", "--drop", "0.2", "--programs", "1,tokens", "--warps", "4",
         "--chunks", "64", *args, "--out", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())["results"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run uses the CPU interpreter")
def test_bench_ep_kernels_smoke(tmp_path):
    res = _lab_results(tmp_path, "--ops", "dispatch,naive,reduce,pattern")
    mod = "mxcomm.ep.nvshmem.kernels"
    ops = ("dispatch", "copyout", "swizzle", "pack", "gather", "push_path", "pull_path", "local_path", "reduce",
           "reduce_own")
    assert {(x["op"], x["impl"]) for x in res} == {(op, mod) for op in ops} | {("dispatch", "naive")} | {
        ("pattern", "scatter"), ("pattern", "write_only")}
    # dispatch, pack, gather, reduce and reduce_own: 2 grids; swizzle: byte and word columns (H/32 = 4); copyout
    # and the 3 paths: once; naive: 2 x 2; pattern (no TMA variants on the interpreter): 2 x 2
    assert len(res) == 2 + 2 + 2 + 2 + 2 + 2 + 4 + 4 + 4 and all(x["correct"] for x in res)
    assert sorted(x["word"] for x in res if x["op"] == "swizzle") == [False, True]
    assert all(x.get("scales", "row") in ("row", "blocked") for x in res)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run uses the CPU interpreter")
def test_bench_ep_kernels_world_ops_smoke(tmp_path):
    """The two sides of combine in a world of ranks: the expert side's partials (1 and 2 listed rows a step, checked
    bit for bit with every program's arrival), the origin's reduce of one partial per (token, rank), and combine
    backward's expert side (weighted quantized rows bit for bit, route-weight gradients against float64)."""
    res = _lab_results(tmp_path, "--rows", "1,2", "--world", "2", "--ops",
                       "partials_ranks,reduce_ranks,weighted_ranks")
    part = [x for x in res if x["op"] == "partials_ranks"]
    assert sorted((x["programs"], x["rows"]) for x in part) == [(1, 1), (1, 2), (29, 1), (29, 2)]
    weighted = [x for x in res if x["op"] == "weighted_ranks"]
    assert sorted(x["programs"] for x in weighted) == [1, 29]
    assert all(x["entries"] > 0 for x in part + weighted)
    assert len([x for x in res if x["op"] == "reduce_ranks"]) == 2 and len(res) == 8
    assert all(x["correct"] for x in res)
