"""The benchmark: its reporting on synthetic numbers and its index helpers (CPU), and one tiny real run (GPU)."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import gather  # noqa: E402


def fake_results():
    out = []
    for gib in (1, 16):
        for rb in (47, 1024):
            for pattern in ("uniform", "zipf1.2"):
                for count in (1000, 4000):
                    r = {"table_gib": gib, "row_bytes": rb, "pattern": pattern, "count": count, "mbytes": 1.0,
                         "label": "x", "choice": "sorted", "source": "measured now", "first_ms": 9.0,
                         "steady_ms": 1.0, "calib_s": 2.0, "choice_cal": "sorted",
                         "auto_measured": "vector=12.00 sorted=14.50"}
                    for i, c in enumerate(gather.COLUMNS):
                        r[c] = 10.0 + i + rb / 1000
                    r["naive"] = float("nan")  # a failed column must not break the report
                    out.append(r)
    return out


def test_report_table_csv_png(tmp_path, capsys):
    results = fake_results()
    gather.print_table(results)
    text = capsys.readouterr().out
    assert "## gather" in text and ">= 0.95x best forced in 16/16 cells" in text
    assert "first-call overhead" in text and "calibrate(table=...) seconds" in text
    gather.write_csv(results, tmp_path / "r.csv")
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == len(results) and float(rows[0]["auto"]) == results[0]["auto"]
    assert rows[0]["auto_measured"] == "vector=12.00 sorted=14.50"  # what auto's first call measured
    gather.write_png(results, tmp_path / "m.png")  # matplotlib, where installed
    from _png import line_grid_png

    panels = [("a", [64, 1024], {"auto": [1.0, 2.0], "memcpy": [3.0, float("nan")]})]
    line_grid_png(panels, tmp_path / "p.png")
    for name in ("p.png",) + (("m.png",) if (tmp_path / "m.png").exists() else ()):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_cells_below_the_best_forced_column_say_whether_the_decision_missed(capsys):
    results = fake_results()[:3]
    best = max(gather.FORCED, key=results[0].get)  # the fastest forced column of the fake cells
    for row, choice in zip(results, (best, "vector", best), strict=True):
        row["choice"] = choice
    results[0]["auto"] = 0.9 * results[0][best]  # its own plan, slower
    results[1]["auto"] = 0.5 * results[1][best]  # another plan
    results[0]["label"], results[1]["label"] = "cell A", "cell B"
    gather.summary(results)
    text = capsys.readouterr().out
    assert "# auto: >= 0.95x best forced in 1/3 cells" in text
    assert (f"#   auto below 0.95x: 1 cells ran the best forced column's plan; cell A 0.90 | 1 ran another plan (a "
            f"decision miss); cell B vector instead of {best} 0.50") in text


def test_ceiling_shares_and_where_2x_is_impossible(capsys):
    # The link's ceiling is memcpy x count / distinct rows; a baseline above half of it leaves no room for 2x.
    capped = {"memcpy": 50.0, "wholegraph": 33.0, "torch": 15.0, "auto": 30.0, "vector": 30.0, "ceiling": 50.0,
              "row_bytes": 64}
    room = {"memcpy": 50.0, "wholegraph": 8.0, "torch": 5.0, "auto": 22.0, "vector": 22.0, "ceiling": 100.0,
            "row_bytes": 64}
    r = gather.ratios(capped)
    assert math.isclose(r["auto_x_ceiling"], 0.6) and math.isclose(r["base_x_ceiling"], 0.66)
    gather.report_ceiling([(row, gather.ratios(row)) for row in (capped, room)])
    text = capsys.readouterr().out
    assert "2x the best baseline exceeds it in 1/2 cells" in text
    assert "in those 1 cells: auto 0.60, best baseline 0.66" in text


def test_interleaved_rounds_time_every_column_alike(monkeypatch):
    # Each round runs every column once, alternate rounds reversed; a failing column is left out as NaN.
    ran = []
    monkeypatch.setattr(gather, "sync_time", lambda fn: (fn(), 0.1)[1])

    def col(name, fail=False):
        def fn():
            ran.append(name)
            if fail:
                raise RuntimeError("broken")
        return fn

    best = gather.interleaved_best({"a": col("a"), "b": col("b"), "c": col("c", fail=True)}, 3, "cell")
    # Warm-up calls, then rounds (each timed call after an untimed one of the same column); short rounds (here all
    # of them) go on to 8.
    assert ran == ["a", "b", "c"] + ["a", "a", "b", "b", "b", "b", "a", "a"] * 4
    assert best["a"] == best["b"] == 0.1 and math.isnan(best["c"])


def test_a_column_is_timed_after_its_own_call_not_after_another_columns(monkeypatch):
    # Columns in the benchmark's order, some reading our table, others other memory. A call is fast when the call
    # before it read the same memory (its rows are in the GPU's L2), slow otherwise. Timed after whatever ran before
    # them, "vector" (after "sorted" in reversed rounds) came out fast and "auto" (after "wholegraph" or
    # "auto_pinned") slow; timed after their own calls, all are fast.
    last = {"memory": None}

    def column(memory):
        def fn():
            fn.seconds = 1.0 if last["memory"] == memory else 2.0
            last["memory"] = memory
        return fn

    def sync_time(fn):
        fn()
        return fn.seconds

    monkeypatch.setattr(gather, "sync_time", sync_time)
    fns = {"vector": column("ours"), "sorted": column("ours"), "wholegraph": column("its copy"),
           "auto": column("ours"), "auto_pinned": column("pinned copy")}
    best = gather.interleaved_best(fns, 2, "cell")
    assert best == dict.fromkeys(fns, 1.0)


def test_ratios():
    r = {"torch": 10.0, "torch_dedupe": 12.0, "naive": 20.0, "auto": 30.0, "memcpy": 50.0, "vector": 25.0,
         "sorted": 40.0, "auto_cal": 36.0}
    got = gather.ratios(r)
    assert math.isclose(got["auto_x_base"], 1.5) and math.isclose(got["auto_x_link"], 0.6)
    assert math.isclose(got["auto_x_forced"], 0.75) and math.isclose(got["auto_cal_x_forced"], 0.9)
    assert math.isclose(gather.geomean([1.0, 4.0, float("nan")]), 2.0)


@pytest.mark.parametrize("pattern", ["uniform", "sorted", "clustered", "zipf0.8", "zipf1.2"])
def test_indices_and_views_on_cpu(pattern):
    idx = gather.indices(pattern, 5000, 10_000, gather.cell_seed(1, 64, pattern, 5000), device="cpu")
    assert idx.shape == (5000,) and int(idx.min()) >= 0 and int(idx.max()) < 10_000
    again = gather.indices(pattern, 5000, 10_000, gather.cell_seed(1, 64, pattern, 5000), device="cpu")
    assert torch.equal(idx, again)  # a new process re-creates the same cell
    flat = torch.zeros(4096 * 3, dtype=torch.uint8)
    assert gather.view_rows(flat, 4096, 47).shape == (87, 47)
    assert gather.view_rows(flat, 4096, 400).dtype == torch.float32
    assert gather.count_for(1 << 20, 4096, 10**9, 1024) == 1 << 18


@pytest.mark.gpu
def test_tiny_run(tmp_path):
    # 0.25 GiB: pd.empty gives managed memory where supported, so the baselines get their own pinned copy.
    cmd = [sys.executable, str(BENCH / "gather.py"), "--table-gib", "0.0625", "0.25", "--row-bytes", "47", "1024",
           "--patterns", "uniform", "zipf1.2", "--counts", "2000", "20000", "--repeats", "1", "--fresh-check", "1",
           "--csv", str(tmp_path / "g.csv"), "--png", str(tmp_path / "g.png")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTORCH_DIRECT_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "## gather" in r.stdout and "fresh-process check" in r.stdout
    rows = list(csv.DictReader(open(tmp_path / "g.csv")))
    assert len(rows) == 2 * 2 * 2 * 2
    assert all(float(row["auto"]) > 0 and float(row["auto_cal"]) > 0 for row in rows)
    if gather._memory.managed_supported():
        assert "baselines: a pinned copy" in r.stdout
        assert all(float(row["auto_pinned"]) > 0 for row in rows)


def test_cache_benchmark_runs_on_the_cpu(tmp_path):
    # The whole benchmark with a cache on the CPU (it exists there for testing): streams, the three frequency
    # estimates, exactness, the report.
    cmd = [sys.executable, str(BENCH / "cache.py"), "--device", "cpu", "--table-gib", "0.005", "--count", "3000",
           "--batches", "2", "--seeds", "16", "--repeats", "1", "--streams", "zipf1.1", "sampled", "uniform",
           "--csv", str(tmp_path / "c.csv")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTORCH_DIRECT_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "## GPU cache vs uncached auto" in r.stdout and "exact in 14/14" in r.stdout
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    assert len(rows) == 2 * 3 * 2 + 2 and all(row["exact"] == "True" for row in rows)
    hits = {(row["stream"], row["fraction"], row["estimate"]): float(row["hit"]) for row in rows}
    assert hits[("zipf1.1", "0.2", "degree")] > hits[("uniform", "0.2", "degree")] + 0.3  # skew pays


def test_cache_benchmark_streams():
    sys.path.insert(0, str(BENCH))
    import cache

    args = cache.parse(["--device", "cpu", "--batches", "2", "--seeds", "32", "--fanouts", "5", "3"])
    degree = cache.node_degrees(10_000, 0.9, "cpu")
    assert degree.min() >= 1 and 5 < float(degree.mean()) < 20 and float(degree.max()) > 100 * float(degree.median())
    batches = cache.sampled_batches(degree, args, seed=1)
    assert len(batches) == 2 and all(b.numel() == torch.unique(b).numel() > 32 for b in batches)
    prob = cache.zipf_probabilities(10_000, 1.1, "cpu")
    assert abs(float(prob.sum()) - 1) < 1e-4
    idx = torch.cat(cache.stream("zipf1.1", 10_000, cache.parse(["--device", "cpu", "--count", "50000"]), 1, None))
    hot = torch.topk(prob, 100).indices
    share = float(torch.isin(idx, hot).float().mean())
    assert abs(share - float(prob[hot].sum())) < 0.03  # the stream follows the stated probabilities


def test_first_use_benchmark_runs(tmp_path):
    cmd = [sys.executable, str(BENCH / "first_use.py"), "--table-gib", "0.01", "--repeats", "1",
           "--csv", str(tmp_path / "f.csv")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "the import loaded the CUDA driver: no, NVRTC: no" in r.stdout and "## first use" in r.stdout
    rows = {row["what"]: row for row in csv.DictReader(open(tmp_path / "f.csv"))}
    assert float(rows["pd.empty"]["seconds"]) > 0 and rows["import pytorch_direct"]["memory"] == "cuda=0 nvrtc=0"
    assert float(rows["pd.empty"]["free_s"]) >= 0 and "pd.zeros" in rows and "parallel memset, again" in rows
    assert float(rows["pd.empty, again"]["seconds"]) > 0  # (each of the pair measured twice, interleaved)
    # the package's own share, timed after import torch in the same interpreter
    own = float(rows["import pytorch_direct after torch"]["seconds"])
    assert 0 < own < float(rows["import pytorch_direct"]["seconds"])
    # The table rows come first, each printed as measured; pd.zeros is left out when the budget is spent.
    assert r.stdout.index("pd.empty: 0.0 GiB in") < r.stdout.index("# import torch")
    r = subprocess.run(cmd + ["--budget-s", "0.001"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "# pd.zeros skipped" in r.stdout
    assert "pd.zeros" not in {row["what"] for row in csv.DictReader(open(tmp_path / "f.csv"))}


def test_wholegraph_baseline_fails_soft_without_pylibwholegraph():
    import _wholegraph

    wg = _wholegraph.WholeGraph()
    try:
        import pylibwholegraph  # noqa: F401
    except Exception:  # noqa: BLE001
        assert wg.reason is not None and "pylibwholegraph" in wg.reason
        wg.load(torch.zeros(4, 4))  # nothing to do, no error
        with pytest.raises(RuntimeError, match="pylibwholegraph"):
            wg.gather(torch.tensor([0]))
        assert "wholegraph" in gather.BASELINES and "wholegraph_cache" in gather.COLUMNS
