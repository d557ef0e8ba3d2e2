"""The combine SQNR tool (mxcomm.bench.tools.combine_sqnr) at tiny sizes on the CPU: its per-(token, rank) math is the
oracle's bit for bit, its per-selection math is the plain per-row formula, and its JSON has every field with finite
numbers."""
import json
import math

import pytest
import torch

from mxcomm.bench.tools import combine_sqnr as cs
from mxcomm.ep import EPConfig
from mxcomm.ep.reference.oracle import oracle_combine, oracle_dispatch, oracle_dispatch_backward
from mxcomm.mx import quantize


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("mx", [True, False])
def test_per_rank_math_is_the_oracle(world, mx):
    T, E, k, H = 12, 8, 4, 64
    inp = cs.inputs(7 + world, T, E, k, H)
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=T)
    empty = torch.zeros(0, k, dtype=torch.int64)
    for op, (idx, w), rows in (("combine", inp["softmax"], inp["out"]), ("combine", inp["uniform"], inp["out"]),
                               ("dispatch_backward", (inp["uniform"][0], torch.ones(T, k)), inp["grad"])):
        idxs = [idx] + [empty] * (world - 1)
        xs = [torch.zeros(i.shape[0], H, dtype=torch.bfloat16) for i in idxs]
        expected, routes = oracle_dispatch(cfg, xs, idxs)
        outs = [torch.full((e.num_rows, H), float("nan"), dtype=torch.bfloat16) for e in expected]
        for t in range(T):
            for j in range(k):
                r, row = routes.dest[0][t, j].tolist()
                outs[r][row] = rows[t, j]
        if op == "combine":
            want = oracle_combine(cfg, outs, routes, [w] + [torch.zeros(0, k)] * (world - 1), mx)[0]
        else:
            want = oracle_dispatch_backward(cfg, outs, routes, mx)[0]
        got = cs.per_rank(rows, w, idx // (E // world), mx, cfg.scale_mode)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (op, world, mx)


@pytest.mark.parametrize("mx", [True, False])
def test_per_selection_math(mx):
    T, E, k, H = 10, 8, 3, 64
    inp = cs.inputs(3, T, E, k, H)
    idx, w = inp["softmax"]
    got = cs.per_selection(inp["out"], w, mx, "floor")
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            row = inp["out"][t, j:j + 1].float()
            v = quantize(row, mode="floor").dequantize(torch.float32, saturate_to=torch.bfloat16) if mx else row
            want[t] = want[t] + w[t, j] * v[0]
    assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))


def test_tool_writes_every_field(tmp_path, capsys):
    out = tmp_path / "sqnr.json"
    argv = ["--out", str(out), "--tokens", "16", "--seeds", "2", "--hidden", "64", "96", "--worlds", "1", "2", "4",
            "--experts", "16", "--topk", "4"]
    res = cs.main(argv)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(res))
    assert data["schema"] == cs.SCHEMA
    assert data["command"].startswith("python -m mxcomm.bench.tools.combine_sqnr --out")
    assert data["versions"]["torch"] == torch.__version__
    cfg = data["config"]
    assert (cfg["tokens"], cfg["seeds"], cfg["hidden"], cfg["worlds"], cfg["experts"], cfg["topk"]) == \
        (16, 2, [64, 96], [1, 2, 4], 16, 4)
    assert cfg["required_delta_db"] == -0.5
    cases = data["cases"]
    keys = {(c["op"], c["weights"], c["transport"], c["hidden"], c["world"]) for c in cases}
    assert len(keys) == len(cases) == 3 * 2 * 2 * 3  # (softmax, uniform, dispatch backward) x transports x H x W
    for c in cases:
        for f in ("before_db", "after_db", "delta_db", "pairs_per_token"):
            assert isinstance(c[f], float) and math.isfinite(c[f]), (f, c)
        assert abs(c["delta_db"] - (c["after_db"] - c["before_db"])) < 2e-3, c
        assert 20.0 < c["before_db"] < 80.0 and 20.0 < c["after_db"] < 80.0, c  # MXFP8 ~31 dB, BF16 ~53-56 dB
        assert 1.0 <= c["pairs_per_token"] <= min(4, c["world"]), c
        assert len({s["seed"] for s in c["per_seed"]}) == len(c["per_seed"]) == 2, c
        if c["world"] == 1 and c["transport"] == "bf16":  # one partial, rounded to bf16 twice: the same value
            assert c["delta_db"] == 0.0, c
    worst = min(c["delta_db"] for c in cases)
    assert data["worst_delta_db"] == worst and data["meets_requirement"] == (worst >= -0.5)
    printed = capsys.readouterr().out
    assert "before dB" in printed and "worst delta" in printed
