"""bench/bench_gemm.py --smoke runs end to end on CPU (interpreter) and writes its JSON with every case timed,
the honesty note about Hopper emulation, and the two emulated paths agreeing."""
import importlib.util
import json
import pathlib

import pytest

from gemm_cases import INTERP


@pytest.mark.skipif(not INTERP, reason="the bench smoke mode runs under the CPU interpreter")
def test_bench_gemm_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_gemm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "g.json"
    bench.main(["--smoke", "--out", str(out), "--no-config-sweep"])
    data = json.loads(out.read_text())
    recs = data["records"]
    cases = {r["case"] for r in recs}
    assert {"bf16", "mx_dequant", "mx_dequant_bf16w", "mx_triton", "mx_dequant+q", "mx_triton+q"} <= cases
    assert all("error" not in r and r["ms"] > 0 for r in recs)
    assert all(r["agree"] for r in recs if r["kind"] != "wgrad")
    assert {"wgrad_dequant_mxx", "wgrad_triton_mxx"} <= cases
    assert all(r["agree_with_dequant"] for r in recs if r["case"].endswith("mxx"))
    assert "EMULATED" in data["meta"]["honesty_note"] and data["meta"]["mxfp8_emulated"]
    assert data["summary"]["recommended_hopper_backend"] in ("dequant", "triton")
    assert data["summary"]["recommended_wgrad_backend"] in ("dequant", "triton")
