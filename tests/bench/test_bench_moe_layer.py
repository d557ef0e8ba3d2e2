"""bench/bench_moe_layer.py runs on the CPU at a tiny size and writes a JSON with every implementation timed and
the ratios against plain torch with BF16 weights of the same run."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_moe_layer.py"


def test_moe_layer_benchmark_runs_and_reports(tmp_path):
    out = tmp_path / "moe_layer.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--dim", "64", "--ffn", "32", "--experts", "4",
                        "--topk", "2", "--tokens", "32", "--iters", "2", "--warmup", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert set(rep["results"]) == {"torch_bf16", "torch_fp32", "mxcomm_bf16", "mxcomm_mxfp8"}
    for name, res in rep["results"].items():
        assert len(res["samples_us"]) == 2 and res["median_us"] > 0, name
        assert abs(res["x_torch_bf16"] - rep["results"]["torch_bf16"]["median_us"] / res["median_us"]) < 1e-9
    assert rep["config"] == dict(dim=64, ffn=32, experts=4, topk=2, tokens=32, iters=2, warmup=1, ep=1)
    assert rep["versions"]["torch"] and rep["device"] == "cpu"
