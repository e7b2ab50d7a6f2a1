"""Smoke test of the I/O benchmark at a tiny size (speed is reported by the benchmark, never asserted here)."""

import csv
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "io.py"


def test_io_benchmark_quick(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("ssdtrain_io_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "io.csv"
    assert bench.main(["--quick", "--dir", str(tmp_path), "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    tools = {r["tool"] for r in rows}
    assert {"ssdtrain", "dd", "pthreads"} <= tools
    ops = {(r["tool"], r["op"]) for r in rows}
    assert ("ssdtrain", "seqwrite") in ops and ("ssdtrain", "seqread") in ops and ("ssdtrain", "randread") in ops
    assert all(float(r["GBps"]) > 0 for r in rows)
    assert "GB/s" in capsys.readouterr().out
    assert list(tmp_path.glob("ssdtrain-bench*")) == []  # reference files cleaned up
