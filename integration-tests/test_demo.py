"""The demo and the GPU-machine script run end to end at the tiny size, on whatever device this machine has."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLOTS = ("loss_curves.png", "gnn_epoch_time.png", "llm_memory_vs_step_time.png")


def test_demo_runs_tiny(tmp_path):
    result = subprocess.run([sys.executable, str(HERE / "demo.py"), "--size", "tiny", "--no-progress",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    out = result.stdout
    for package in ("pytorch-direct", "hector", "ssdtrain"):
        assert f"{package} " in out  # each package reported its build
    assert "REPORT: the toolkit against the plain way" in out
    assert "toolkit: " in out and "x the speed of baseline" in out  # the GNN comparison
    assert "ssdtrain at batch" in out and "keep's tokens/s" in out  # the LLM comparison
    assert "demo finished" in out
    for name in (*PLOTS, "gnn.csv", "llm.csv", "report.txt", "gnn.json", "llm.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_run_script_at_tiny_size(tmp_path):
    # the same steps as on the GPU machine (1 and 2 processes, report, archive), in seconds on a CPU
    env = {**os.environ, "OUT": str(tmp_path), "E2E_SIZE": "tiny", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(["bash", str(HERE / "gpu_run.sh"), "--no-install"], capture_output=True, text=True,
                            timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    for step in ("gnn-1", "llm-1", "gnn-2", "llm-2"):
        assert f"{step:8s} ok" in result.stdout, step
    report = (tmp_path / "e2e-report.txt").read_text()
    assert "scaling: 2 processes" in report
    listing = subprocess.run(["tar", "-tzf", str(tmp_path / "e2e.tar.gz")], capture_output=True, text=True,
                             check=True).stdout
    for name in ("gnn-1.json", "llm-2.json", *PLOTS):
        assert f"e2e/{name}" in listing, name
