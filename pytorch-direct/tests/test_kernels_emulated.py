"""Compiles the CUDA row kernels for the CPU with stand-ins for the CUDA built-ins (tests/cpp/emulate_kernels.cpp)
and runs every thread of each grid serially: their index math is checked on machines without a GPU."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_emulated_on_cpu(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    exe = tmp_path / "emulate_kernels"
    build = subprocess.run(
        [cxx, "-std=c++17", "-O2", "-Wall", "-Wno-unknown-pragmas", "-I", str(ROOT / "cpp" / "include"),
         "-I", str(ROOT / "shared-cuda" / "include"), str(ROOT / "tests" / "cpp" / "emulate_kernels.cpp"),
         "-o", str(exe)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "0 failures" in run.stdout, run.stdout[-4000:]
