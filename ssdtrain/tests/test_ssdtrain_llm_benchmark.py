"""Smoke test of the LLM benchmark at a tiny size on CPU (speed and memory are reported by it, never asserted).

The benchmark forks a process per policy, so it runs here as a fresh process: a pytest process that has used
torch's thread pools (or ssdtrain's I/O threads) is no safe parent for fork."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "llm.py"


def test_llm_benchmark_quick(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "llm.csv", tmp_path / "rok.png"
    policies = "keep,recompute,save_on_cpu,compile_budget_0.5,torchtune,ssdtrain@none,ssdtrain@keep*0.5,determinism"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--quick",
            "--device",
            "cpu",
            "--models",
            "gpt2",
            "--policies",
            policies,
            "--csv",
            str(out),
            "--png",
            str(png),
            "--child-timeout",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:] + proc.stderr[-3000:]
    rows = {r["policy"]: r for r in csv.DictReader(out.open())}
    for name in ("keep", "recompute", "save_on_cpu", "compile_budget_0.5", "ssdtrain@none"):
        assert rows[name]["status"] == "ok", rows[name]
        assert float(rows[name]["step_ms"]) > 0
    assert rows["ssdtrain@keep*0.5"]["status"] in ("ok", "budget")  # tiny models may not fit half
    assert rows["torchtune"]["status"] in ("ok", "unavailable")
    assert rows["determinism"]["status"] == "ok"
    assert "(5)" in text and "-> MET" in text  # bit-identical losses, gradients and weights
    assert png.stat().st_size > 1000
