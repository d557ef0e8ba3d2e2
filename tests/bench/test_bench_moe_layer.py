"""bench/bench_moe_layer.py runs on the CPU at a tiny size: at EP = 1 it writes a JSON with every implementation
timed (the BF16 layer with and without its weight cache among them) and the ratios against plain torch with BF16
weights of the same run; with ``--ranks 2`` it starts two rank processes (EP = 2, reference backend), reports the
slowest rank per step, mxcomm-only ratios and the plain-torch EP = 1 figure on the world's tokens as context;
several ranks on one GPU without MPS are refused before anything starts."""
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_moe_layer.py"
TINY = ["--device", "cpu", "--dim", "64", "--ffn", "32", "--experts", "4", "--topk", "2", "--tokens", "32",
        "--iters", "2", "--warmup", "1"]
MX = {"mxcomm_bf16", "mxcomm_bf16_cached", "mxcomm_mxfp8"}


def _run(args, timeout=120, env=None):
    return subprocess.run([sys.executable, str(SCRIPT)] + args, capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_moe_layer_benchmark_runs_and_reports(tmp_path):
    out = tmp_path / "moe_layer.json"
    r = _run(TINY + ["--out", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert set(rep["results"]) == {"torch_bf16", "torch_fp32"} | MX
    base = rep["results"]["torch_bf16"]["median_us"]
    for name, res in rep["results"].items():
        assert len(res["samples_us"]) == 2 and res["median_us"] > 0, name
        assert abs(res["x_torch_bf16"] - base / res["median_us"]) < 1e-9
        assert rep["medians_us"][name] == res["median_us"]
        assert rep["ratios"]["x_torch_bf16"][name] == res["x_torch_bf16"]
    bf = rep["results"]["mxcomm_bf16"]["median_us"]
    assert abs(rep["ratios"]["x_mxcomm_bf16"]["mxcomm_bf16_cached"]
               - bf / rep["results"]["mxcomm_bf16_cached"]["median_us"]) < 1e-9
    # the cached variants report their refresh and memory: BF16 2 bytes per expert weight, none without the cache
    weights = 4 * (2 * 32 * 64 + 64 * 32)
    assert rep["results"]["mxcomm_bf16_cached"]["cache_bytes"] == 2 * weights
    plain = rep["results"]["mxcomm_bf16"]
    assert plain["cache_bytes"] == 0 and "refresh_median_us" not in plain
    for name in ("mxcomm_bf16_cached", "mxcomm_mxfp8"):
        res = rep["results"][name]
        assert res["refresh_median_us"] > 0
        assert res["step_plus_refresh_us"] == res["median_us"] + res["refresh_median_us"]
        assert abs(rep["ratios"]["x_mxcomm_bf16_with_refresh"][name] - bf / res["step_plus_refresh_us"]) < 1e-9
    assert plain["step_plus_refresh_us"] == plain["median_us"]
    assert rep["config"] == dict(dim=64, ffn=32, experts=4, topk=2, tokens=32, iters=2, warmup=1, ep=1,
                                 ep_backend="torch")
    assert rep["versions"]["torch"] and rep["versions"]["mxcomm"] and rep["device"] == "cpu"
    assert rep["machine"]["cpu_count"] >= 1


def test_moe_layer_benchmark_two_ranks(tmp_path):
    out = tmp_path / "moe_layer_ranks2.json"
    r = _run(TINY + ["--ranks", "2", "--out", str(out)], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert set(rep["results"]) == MX
    cfg = rep["config"]
    assert cfg["ep"] == 2 and cfg["experts_per_rank"] == 2 and cfg["tokens_per_rank"] == 32
    assert rep["config"]["ep_backend"] == "torch" and rep["config"]["side_channel"] == "gloo"
    bf = rep["results"]["mxcomm_bf16"]["median_us"]
    for name, res in rep["results"].items():
        assert len(res["samples_us"]) == 2 and len(res["rank_medians_us"]) == 2, name
        # the step time is the slowest rank's: never below a rank's own median
        assert res["median_us"] >= min(res["rank_medians_us"]) > 0
        assert abs(res["x_mxcomm_bf16"] - bf / res["median_us"]) < 1e-9
    assert rep["results"]["mxcomm_bf16_cached"]["cache_bytes_per_rank"] == 2 * 2 * (2 * 32 * 64 + 64 * 32)
    cached = rep["results"]["mxcomm_bf16_cached"]
    assert cached["refresh_median_us"] > 0 and len(cached["refresh_rank_medians_us"]) == 2
    assert abs(rep["ratios"]["x_mxcomm_bf16_with_refresh"]["mxcomm_bf16_cached"]
               - bf / (cached["median_us"] + cached["refresh_median_us"])) < 1e-9
    assert "x_torch_bf16" not in rep["ratios"] and "not be the layer's math" in rep["baseline_note"]
    ctx = rep["context_ep1"]  # plain torch at EP = 1 on the world's 2 x 32 tokens, no ratios
    assert "context only" in ctx["note"] and set(ctx["medians_us"]) == {"torch_bf16", "torch_fp32"}
    assert ctx["config"]["ep"] == 1 and ctx["config"]["experts"] == 4 and ctx["config"]["tokens"] == 64


def test_several_ranks_on_one_gpu_need_mps(tmp_path):
    """Refused before any rank (or CUDA) starts when no MPS daemon answers (an empty pipe folder here)."""
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(tmp_path))
    r = _run(["--device", "cuda", "--ranks", "2", "--experts", "4", "--out", str(tmp_path / "x.json")], env=env)
    assert r.returncode == 2 and "MPS" in r.stderr and "mxcomm_mps_start 2" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "x.json").exists()
    r = _run(TINY + ["--ranks", "3", "--out", str(tmp_path / "y.json")])
    assert r.returncode == 2 and "multiple of --ranks" in r.stderr
