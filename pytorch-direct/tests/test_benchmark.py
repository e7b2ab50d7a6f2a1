"""The benchmark's reporting on synthetic numbers (CPU), and one tiny real run (GPU)."""

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import gather  # noqa: E402


def fake_results():
    out = []
    for op in ("gather", "scatter"):
        for rb in (64, 1024, 4096):
            for d in (0.002, 0.12):
                r = {"op": op, "dtype": "f32", "row_bytes": rb, "density": d, "order": "random", "rows": 10,
                     "mbytes": 1.0, "auto_choice": "sorted"}
                for i, c in enumerate(gather.GATHER_COLUMNS):
                    r[c] = 10.0 + i + rb / 1000
                r["naive"] = float("nan")  # a failed column must not break the report
                out.append(r)
    return out


def test_report_table_csv_png(tmp_path, capsys):
    results = fake_results()
    gather.print_table(results)
    text = capsys.readouterr().out
    assert "## gather" in text and "## scatter" in text and "auto >= 1.1x best baseline" in text
    gather.write_csv(results, tmp_path / "r.csv")
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == len(results) and float(rows[0]["auto"]) == results[0]["auto"]
    from _png import line_grid_png

    line_grid_png(results, tmp_path / "p.png", gather.GATHER_COLUMNS)
    data = (tmp_path / "p.png").read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_ratio():
    r = {"torch": 10.0, "naive": 20.0, "auto": 30.0, "memcpy": 50.0}
    vb, vc = gather._ratio(r)
    assert math.isclose(vb, 1.5) and math.isclose(vc, 0.6)


@pytest.mark.gpu
def test_tiny_run(tmp_path):
    cmd = [sys.executable, str(BENCH / "gather.py"), "--table-gib", "0.0625", "--row-bytes", "64", "1024",
           "--densities", "0.016", "--orders", "random", "--repeats", "1", "--csv", str(tmp_path / "g.csv"),
           "--png", str(tmp_path / "g.png")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTORCH_DIRECT_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "## gather" in r.stdout and "## scatter" in r.stdout
    rows = list(csv.DictReader(open(tmp_path / "g.csv")))
    assert len(rows) == 2 * 5  # (2 f32 widths + 3 extra rows) x (gather, scatter)
    assert all(float(row["auto"]) > 0 for row in rows)
