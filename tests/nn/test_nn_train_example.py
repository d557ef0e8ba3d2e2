"""examples/train_moe.py: the corpus is deterministic, a 5-step run of the example's model trains (loss goes down) in
both precisions, and the outputs (CSV, JSON, PNG) are written with what the report needs."""
import csv
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from nn_cases import world1_pg

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_moe.py"


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("train_moe_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module", autouse=True)
def world1():
    yield from world1_pg()


def test_corpus_is_deterministic_text(ex):
    a, b = ex.stdlib_corpus(50_000), ex.stdlib_corpus(50_000)
    assert a.numel() == 50_000 and bool((a == b).all())
    text = bytes(a.tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_five_step_training_smoke(ex, tmp_path):
    cfg = replace(ex.TrainConfig(**ex.PRESETS["tiny"]), lr=3e-3, control_jitter=1e-3)
    out = ex.run(cfg, tmp_path, "smoke", log_every=0)
    res = {r.label: r for r in out["results"]}
    assert set(res) == {"bf16", "mxfp8", "bf16_jitter"}
    for r in res.values():
        assert len(r.losses) == 5
        assert r.losses[0] == pytest.approx(5.55, abs=0.1)  # ~ln(256) at init
        assert sum(r.losses[-2:]) / 2 < r.losses[0] - 0.1, (r.label, r.losses)
        assert r.tokens_per_s > 0 and r.val_loss < r.losses[0]
    s = out["summary"]
    assert s["abs_final_loss_diff"] == pytest.approx(abs(res["mxfp8"].final_loss - res["bf16"].final_loss))
    assert "control_abs_final_loss_diff" in s
    rows = list(csv.DictReader(open(tmp_path / "smoke.csv")))
    assert len(rows) == 5 and {"step", "lr", "loss_bf16", "loss_mxfp8", "aux_bf16"} <= set(rows[0])
    doc = json.loads((tmp_path / "smoke.json").read_text())
    assert doc["config"]["steps"] == 5 and doc["versions"]["torch"] and doc["summary"]["mxfp8"]["tokens_per_s"] > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "smoke.png").stat().st_size > 1000


def test_cli_parses_presets(ex):
    cfg, out, label, log_every = ex.parse_args(["--preset", "tiny", "--steps", "7", "--precisions", "mxfp8",
                                                "--no-amp"])
    assert cfg.steps == 7 and cfg.precisions == ("mxfp8",) and cfg.amp is False and label == "train_moe_tiny"
    cfg, _, label, _ = ex.parse_args(["--device", "cuda"])
    assert cfg.device == "cuda" and cfg.d_model == ex.PRESETS["gpu"]["d_model"] and label == "train_moe_gpu"
    with pytest.raises(SystemExit):
        ex.parse_args(["--precisions", "fp4"])
