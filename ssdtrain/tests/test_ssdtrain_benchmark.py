"""Smoke test of the I/O benchmark at a tiny size (speed is reported by the benchmark, never asserted here)."""

import csv
import importlib.util
import os
import types
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "io.py"


def _bench():
    spec = importlib.util.spec_from_file_location("ssdtrain_io_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_io_benchmark_quick(tmp_path, capsys):
    bench = _bench()
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


class _FakeFile:
    """kvikio's CuFile surface (pwrite/pread futures, fileno, close) over plain os calls: the benchmark's kvikio
    rows are exercised where kvikio cannot run (it needs the CUDA driver even for host buffers)."""

    def __init__(self, path, flags):
        self.fd = os.open(path, os.O_RDWR)

    def pwrite(self, buf):
        n = os.pwrite(self.fd, memoryview(buf), 0)
        return types.SimpleNamespace(get=lambda: n)

    def pread(self, buf):
        n = os.preadv(self.fd, [memoryview(buf)], 0)
        return types.SimpleNamespace(get=lambda: n)

    def fileno(self):
        return self.fd

    def close(self):
        os.close(self.fd)


def test_io_benchmark_kvikio_rows_and_comparison(tmp_path, capsys):
    bench = _bench()
    threads = []
    fake = types.SimpleNamespace(
        CuFile=_FakeFile,
        defaults=types.SimpleNamespace(get=lambda key: "stand-in", set=lambda d: threads.append(d["num_threads"])),
    )
    bench.KVIKIO["module"] = fake
    out = tmp_path / "io.csv"
    argv = ["--quick", "--dir", str(tmp_path), "--csv", str(out), "--memory", "host", "--kvikio-threads", "1,2"]
    assert bench.main(argv + ["--backends", "threads", "--random-count", "0"]) == 0
    rows = [r for r in csv.DictReader(out.open()) if r["tool"] == "kvikio"]
    assert {(r["backend"], r["op"]) for r in rows} == {
        (f"{t} thr", op) for t in (1, 2) for op in ("seqwrite", "seqread")
    }
    assert threads[:2] == [1, 2]
    text = capsys.readouterr().out
    assert "# kvikio (best thread count) against the engine" in text and "host seqread" in text
    assert list(tmp_path.glob("ssdtrain-bench*")) == []


def test_io_benchmark_without_kvikio_says_why(tmp_path, capsys):
    bench = _bench()
    bench.KVIKIO["reason"] = "not importable (ModuleNotFoundError: No module named 'kvikio')"
    argv = ["--quick", "--dir", str(tmp_path), "--memory", "host", "--backends", "threads", "--random-count", "0"]
    assert bench.main(argv) == 0
    assert "# kvikio: no rows (not importable" in capsys.readouterr().out
