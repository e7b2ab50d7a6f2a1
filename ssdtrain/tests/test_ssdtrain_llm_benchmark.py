"""Smoke test of the LLM benchmark at a tiny size on CPU (speed and memory are reported by it, never asserted)."""

import csv
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "llm.py"


def test_llm_benchmark_quick(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("ssdtrain_llm_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out, png = tmp_path / "llm.csv", tmp_path / "rok.png"
    policies = "keep,recompute,save_on_cpu,compile_budget_0.5,torchtune,ssdtrain@none,ssdtrain@keep*0.5,determinism"
    rc = bench.main(["--quick", "--device", "cpu", "--models", "gpt2", "--policies", policies, "--csv", str(out),
                     "--png", str(png)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = {r["policy"]: r for r in csv.DictReader(out.open())}
    for name in ("keep", "recompute", "save_on_cpu", "compile_budget_0.5", "ssdtrain@none"):
        assert rows[name]["status"] == "ok", rows[name]
        assert float(rows[name]["step_ms"]) > 0
    assert rows["ssdtrain@keep*0.5"]["status"] in ("ok", "budget")  # tiny models may not fit half
    assert rows["torchtune"]["status"] in ("ok", "unavailable")
    assert rows["determinism"]["status"] == "ok"
    assert "(5)" in text and "-> MET" in text  # bit-identical losses, gradients and weights
    assert png.stat().st_size > 1000
