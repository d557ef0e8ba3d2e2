"""mxcomm.bench.tools.kernel_report on the CPU (an ahead-of-time compile for sm_90, no GPU): the memory-width count of
PTX, and the report of the kernels whose rows are read through an address from memory."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter cannot compile PTX
    return subprocess.run([sys.executable, "-m", "mxcomm.bench.tools.kernel_report", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_memory_widths_count_bytes_a_thread_per_instruction():
    from mxcomm.bench.tools.kernel_report import memory_widths

    ptx = """
    ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];
    ld.global.L1::evict_last.v4.b32 {%r5, %r6, %r7, %r8}, [%rd2];
    ld.global.nc.v2.b32 {%r9, %r10}, [%rd3];
    ld.global.b16 %rs1, [%rd4];
    ld.global.acquire.sys.b64 %rd5, [%rd6];
    @p ld.global.u8 %r11, [%rd7];
    st.global.v2.b64 [%rd8], {%rd9, %rd10};
    st.global.u8 [%rd11], %r12;
    ld.shared.v4.b32 {%r13, %r14, %r15, %r16}, [%r17];
    """
    loads, stores = memory_widths(ptx)
    assert loads == {1: 1, 2: 1, 8: 2, 16: 2}
    assert stores == {1: 1, 16: 1}


def test_report_shows_the_row_loads_through_an_address_from_memory(tmp_path):
    """The pack reads x by address and the gather reads peers' rows through a table: both must load 16 bytes a
    thread (the alignment hints); without them the compiler gives every value its own 1- or 2-byte load."""
    import triton.backends

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("triton has no nvidia backend here")
    out = tmp_path / "report.json"
    r = _run("--kernels", "pack_rows,pack_ready,pull_rows", "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    reps = {x["name"]: x for x in json.loads(out.read_text())["reports"]}
    assert set(reps) == {"pack, x by address", "pack, gradient rows + weights, ready", "gather (pull)"}
    for name, rep in reps.items():
        loads = {int(w): n for w, n in rep["loads"].items()}
        assert loads.get(16, 0) > 0, (name, loads)
        assert rep["regs"] is None or rep["regs"] > 0
    pack = {int(w): n for w, n in reps["pack, x by address"]["loads"].items()}
    assert 2 not in pack and 1 not in pack, pack  # no bf16 value loaded alone
    assert reps["pack, x by address"]["bar"] == 0  # scale bytes stored where they are held
    for name in reps:
        assert name in r.stdout


def test_report_refuses_what_it_cannot_compile():
    r = _run("--kernels", "no_such_kernel")
    assert r.returncode != 0 and "matches no variant" in r.stdout + r.stderr
    env_run = subprocess.run([sys.executable, "-m", "mxcomm.bench.tools.kernel_report"], cwd=REPO,
                             env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert env_run.returncode != 0 and "without TRITON_INTERPRET" in env_run.stdout + env_run.stderr


def test_report_covers_the_plan_and_the_entry_kernel(tmp_path):
    """The routing plan's kernels are in the report; the plan kernel stays off the register cap (a [rows, experts]
    comparison for the row origins took all 255) and the entry kernel has no per-slot block reductions (49 barriers
    before)."""
    import triton.backends

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("triton has no nvidia backend here")
    out = tmp_path / "report.json"
    r = _run("--kernels", "plan_kernel,slot_check_hist,push_entries", "--world", "1", "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    reps = {x["name"]: x for x in json.loads(out.read_text())["reports"]}
    assert set(reps) == {"id check and counts", "routing plan", "pull-list entries"}
    plan = reps["routing plan"]
    assert plan["regs"] is None or plan["regs"] < 255, plan
    assert plan["spill"] in (None, 0), plan
    assert reps["pull-list entries"]["bar"] <= 8, reps["pull-list entries"]


def test_report_covers_the_pull_dispatch_middle(tmp_path):
    """The pull dispatch's three launches are in the report and compile without spills; the head, which packs rows
    too, keeps the pack's 16-byte row loads."""
    import triton.backends

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("triton has no nvidia backend here")
    out = tmp_path / "report.json"
    r = _run("--kernels", "pull_head,scan_and_wait,plan_entries", "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    reps = {x["name"]: x for x in json.loads(out.read_text())["reports"]}
    assert set(reps) == {"pull head: check, counts, publish, pack", "pull scan + wait for the counts",
                         "pull plan + entries + their wait"}
    for name, rep in reps.items():
        assert rep["spill"] in (None, 0), (name, rep)
        assert rep["regs"] is None or rep["regs"] < 255, (name, rep)
    head = {int(w): n for w, n in reps["pull head: check, counts, publish, pack"]["loads"].items()}
    assert head.get(16, 0) > 0 and 2 not in head, head
