"""bench/bench_overlap.py runs on the CPU (reference backend, no streams, tiny sizes) and writes a JSON with every
case timed, the ratios computed from the medians of the same run, and the bit-identity checks passed."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_overlap.py"
CASES = {"gemm", "combine", "combine_on_stream", "serial", "overlapped"}


def test_overlap_benchmark_runs_and_reports(tmp_path):
    out = tmp_path / "overlap.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--iters", "2", "--warmup", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["benchmark"] == "overlap" and rep["device"] == "cpu" and rep["streams"] is False
    assert set(rep["medians_us"]) == CASES == set(rep["samples_us"])
    for c in CASES:
        s = rep["samples_us"][c]
        assert len(s) == 2 and all(v > 0 for v in s), c
        assert abs(rep["medians_us"][c] - statistics.median(s)) < 1e-9, c
    m, ratios = rep["medians_us"], rep["ratios"]
    assert abs(ratios["sum_us"] - (m["gemm"] + m["combine"])) < 1e-6
    assert abs(ratios["speedup"] - m["serial"] / m["overlapped"]) < 1e-9
    assert abs(ratios["overlap_ratio"] - (m["serial"] - m["overlapped"]) / min(m["gemm"], m["combine"])) < 1e-9
    assert rep["checks"] and all(rep["checks"].values()), rep["checks"]
    cfg = rep["config"]
    assert (cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"], cfg["ep"]) == (32, 64, 2, 8, 1)
    assert cfg["backend"] == "torch" and cfg["gemm"]["rows"] == 64 and cfg["iters"] == 2
    assert rep["versions"]["torch"] and rep["machine"]["cpu_count"]


def test_overlap_benchmark_refuses_uneven_gemm_groups(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--gemm-rows", "63",
                        "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "multiple of --gemm-experts" in r.stderr, r.stderr
    assert not (tmp_path / "x.json").exists()
