"""Builds and runs the engine's C++ tests (cpp/tests, a standalone CMake project) through ctest."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "cpp-tests"


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ctest") is None, reason="cmake/ctest not found")
def test_cpp_engine_tests():
    # Incremental: the first run compiles shared-cuda and the engine (~20 s on 2 cores), later runs only relink.
    subprocess.run(
        ["cmake", "-S", str(ROOT / "cpp" / "tests"), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release"],
        check=True,
        capture_output=True,
        text=True,
    )
    build = subprocess.run(["cmake", "--build", str(BUILD), "-j", "1"], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    run = subprocess.run(
        ["ctest", "--test-dir", str(BUILD), "--output-on-failure"], capture_output=True, text=True, env=dict(os.environ)
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
