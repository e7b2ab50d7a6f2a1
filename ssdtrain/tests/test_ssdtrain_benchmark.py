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


def _fake_kvikio(threads: list):
    return types.SimpleNamespace(
        CuFile=_FakeFile,
        defaults=types.SimpleNamespace(get=lambda key: "stand-in", set=lambda d: threads.append(d["num_threads"])),
    )


def test_io_compare_quick(tmp_path, capsys):
    """The same-run comparison: engine, kvikio (a stand-in here) and the disk's own rate, in rounds."""
    bench = _bench()
    threads = []
    bench.KVIKIO["module"] = _fake_kvikio(threads)
    out = tmp_path / "compare.csv"
    argv = ["--compare", "--quick", "--dir", str(tmp_path), "--csv", str(out), "--kvikio-threads", "1,2"]
    assert bench.main(argv + ["--backends", "threads"]) == 0
    rows = list(csv.DictReader(out.open()))
    contenders = {r["contender"] for r in rows}
    ceiling = bench.ssdtrain._core.io_uring_status()["usable"]
    expected = {"engine threads", "engine threads (host)", "kvikio 1 thr", "kvikio 2 thr"}
    assert contenders == expected | ({"ceiling"} if ceiling else set())
    assert {r["memory"] for r in rows if r["contender"] == "engine threads (host)"} == {"host-huge"}
    assert {(r["op"], r["size"]) for r in rows} == {
        (op, str(n << 20)) for op in ("seqwrite", "seqread") for n in (1, 4)
    }
    for r in rows:
        assert r["rounds"] == "3" and len(r["samples_GBps"].split(";")) == 3
        assert float(r["GBps_min"]) <= float(r["GBps"]) <= float(r["GBps_max"])
        if r["contender"] == "engine threads":  # kvikio moved the same memory: compared
            assert float(r["vs_kvikio"]) > 0 and "-" in r["vs_kvikio_rounds"]
        if r["contender"] == "engine threads (host)":  # other memory than kvikio's: not compared with it
            assert r["vs_kvikio"] == ""
        if r["contender"].startswith("engine"):
            assert (r["vs_ceiling"] != "") == ceiling
    assert set(threads) == {1, 2}  # each thread count set before its own transfers
    text = capsys.readouterr().out
    assert "vs kvikio" in text and "# verdict" in text and ("MET" in text or "MISSED" in text)
    assert "posix_fadvise(DONTNEED)" in text  # says how reads are made cold
    assert list(tmp_path.glob("ssdtrain-bench*")) == []


def test_io_compare_summary_math():
    """Medians, spread, the best kvikio thread count and per-round (paired) ratios, from known samples."""
    bench = _bench()
    args = types.SimpleNamespace(block_size=1 << 20, queue_depth=32)
    rates = {
        "engine io_uring": [3.0, 2.0, 4.0],
        "kvikio 1 thr": [1.0, 1.0, 1.0],
        "kvikio 4 thr": [2.0, 1.0, 2.5],  # the best median (2.0)
        "ceiling": [4.0, 2.0, 5.0],
    }
    samples = [
        {
            "contender": name,
            "backend": name.split(" ", 1)[1] if " " in name else "io_uring",
            "memory": "gpu",
            "op": "seqread",
            "size": 1 << 30,
            "round": k + 1,
            "GBps": v,
            "device_bytes_ratio": 1.0,
            "detail": "",
        }
        for name, values in rates.items()
        for k, v in enumerate(values)
    ]
    rows = {r["contender"]: r for r in bench.summarize(samples, args)}
    engine = rows["engine io_uring"]
    assert engine["GBps"] == 3.0 and engine["GBps_min"] == 2.0 and engine["GBps_max"] == 4.0
    assert engine["spread"] == round(2.0 / 3.0, 3)
    assert engine["vs_kvikio"] == 1.5  # 3.0 / kvikio 4 thr's 2.0
    assert engine["vs_kvikio_rounds"] == "1.50-2.00"  # 3/2, 2/1, 4/2.5
    assert engine["vs_ceiling"] == 0.75 and engine["vs_ceiling_rounds"] == "0.75-1.00"
    assert rows["kvikio 1 thr"]["vs_ceiling"] == 0.25
    assert rows["ceiling"]["vs_kvikio"] == "" and rows["ceiling"]["vs_ceiling"] == ""
    assert [r["contender"] for r in bench.summarize(samples, args)] == [
        "engine io_uring",
        "kvikio 1 thr",
        "kvikio 4 thr",
        "ceiling",
    ]
