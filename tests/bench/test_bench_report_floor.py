"""The report's traffic floor fields and table column, and one row where mxcomm is the reference backend."""
from __future__ import annotations

import pytest

from mxcomm.bench.report import build_report, format_table

OPTS = dict(tokens=[3], hidden=64, topk=2, experts=4, precisions=["mxfp8", "bf16"], mode="throughput",
            backend="torch", device="cpu", ranks=2, ranks_per_gpu=1, side_channel="gloo", iters=3, warmup=0,
            out="x", label="floor", impls=["mxcomm", "reference", "a2a"], ops=["dispatch", "combine"], plot=False,
            num_sms=None, cuda_graph=False)


def _raw(impl, prec, op, med, bpr):
    return dict(impl=impl, op=op, precision=prec, tokens=3, status="ok", reason=None, bytes_per_row=bpr,
                rows_dedup=[3, 4], rows_sel=[5, 7], samples_us=dict(whole_call=[med] * 3, kernel=None))


def _report():
    cases = [_raw("mxcomm", "mxfp8", "dispatch", 10.0, 66), _raw("mxcomm", "bf16", "dispatch", 20.0, 128),
             _raw("a2a", "bf16", "dispatch", 5.0, 128), _raw("mxcomm", "mxfp8", "combine", 12.0, 66)]
    phase = dict(phase="main", status="ok", cases=cases, checks=[], skipped=[],
                 ceilings={"host_copy": dict(gbps=1.0, convention="test")},
                 merged=[dict(impl="reference", precision="mxfp8", into="mxcomm", reason="same measurement")])
    world = dict(ranks_per_gpu=1, side_channel="gloo", devices=["h:cpu", "h:cpu"])
    return build_report(options=OPTS, world=world, meta={}, phases=[phase], command=["t"])


def test_floor_fields_sum_ranks_sharing_host_memory():
    rep = _report()
    by = {(c["impl"], c["precision"], c["op"]): c for c in rep["cases"]}
    d = by[("mxcomm", "mxfp8", "dispatch")]
    # both ranks share the host memory: (384 + 5 * 66) + (384 + 7 * 66) = 1560 bytes at 1 GB/s = 1.56 us
    assert d["floor"]["bytes"] == 1560 and d["floor"]["ranks_per_memory"] == 2
    assert d["floor_us"] == pytest.approx(1.56)
    assert d["time_over_floor"]["whole_call"] == pytest.approx(10.0 / 1.56)
    assert d["time_over_floor"]["kernel"] is None
    c = by[("mxcomm", "mxfp8", "combine")]  # (5 + 7) * 128 read + 2 * 384 written
    assert c["floor"]["bytes"] == 12 * 128 + 768 and c["floor_us"] == pytest.approx(2.304)
    assert by[("a2a", "bf16", "dispatch")]["floor"]["bytes"] == 768 + 12 * 128
    assert rep["floor_ceiling"] == "host_copy"


def test_table_has_the_floor_column_and_one_reference_row():
    rep = _report()
    assert rep["mxcomm_is_reference"] is True
    assert not [c for c in rep["cases"] if c["impl"] == "reference"]
    assert all(c.get("is_reference") for c in rep["cases"] if c["impl"] == "mxcomm" and c["precision"] == "mxfp8")
    table = format_table(rep)
    lines = table.splitlines()
    hdr = next(ln for ln in lines if ln.startswith("op "))
    assert "x floor" in hdr and "floor us" in hdr
    assert "x ref" not in hdr and "x vdev2d" not in hdr  # no value anywhere: no column
    assert "runs the reference backend: one row" in table
    rows = [ln.split() for ln in lines if ln.startswith("dispatch ")]
    assert [r[1] for r in rows] == ["mxcomm=ref", "mxcomm", "a2a"]
    x_floor = [r for r in rows if r[1] == "mxcomm=ref"][0]
    assert f"{10.0 / 1.56:.1f}" in x_floor


def test_floor_uses_the_shared_copy_when_ranks_share_a_gpu():
    """Several ranks on one GPU: the floor divides by what they copy together, not by rank 0's copy alone."""
    cases = [_raw("mxcomm", "mxfp8", "dispatch", 10.0, 66)]
    ceil = {"device_copy": dict(gbps=1.0, convention="one rank"),
            "shared_device_copy": dict(gbps=2.0, convention="both ranks at once")}
    phase = dict(phase="main", status="ok", cases=cases, checks=[], skipped=[], ceilings=ceil, merged=[])
    world = dict(ranks_per_gpu=2, side_channel="gloo", devices=["h:cuda:0", "h:cuda:0"])
    rep = build_report(options={**OPTS, "device": "cuda", "ranks_per_gpu": 2}, world=world, meta={}, phases=[phase],
                       command=["t"])
    d = rep["cases"][0]
    assert rep["floor_ceiling"] == "shared_device_copy"
    assert d["floor"]["bytes"] == 1560 and d["floor_us"] == pytest.approx(0.78)  # 1560 bytes at 2 GB/s
    assert "ceiling shared_device_copy: 2.0 GB/s (both ranks at once)" in format_table(rep)
