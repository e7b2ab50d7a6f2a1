"""The demo runs end to end at a tiny size, on whatever device this machine has."""

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).with_name("demo.py")


def test_demo_runs_tiny():
    result = subprocess.run([sys.executable, str(DEMO), "--tiny"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo finished" in result.stdout
    for package in ("pytorch-direct", "hector", "ssdtrain"):
        assert f"{package} " in result.stdout  # each package reported its build
    assert "written and read back through" in result.stdout  # the activations went through ssdtrain
    assert result.stdout.count("    epoch ") == 3  # and it trained (the demo itself fails if accuracy did not rise)
