"""Each benchmark runs at a tiny size (smoke test; speed is never asserted here)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import hector_bench_common


def load(name):
    """Import a benchmark script under a package-specific module name (other packages have benchmarks too)."""
    spec = importlib.util.spec_from_file_location(f"hector_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_memory_table_smoke(tmp_path):
    memory_table = load("memory_table")

    out = tmp_path / "m.csv"
    rows = memory_table.run(["aifb"], ["rgcn", "rgat"], 16, 2, 1500, "cpu", 1e9, str(out), full=False)
    assert out.exists() and len(rows) == 2
    for r in rows:
        assert r["scaled_hector_model_peak"] > 0 and r["scaled_hector_measured_peak"] > 0


def test_memory_table_full_stats_columns():
    memory_table = load("memory_table")

    rows = memory_table.run(["aifb"], ["rgat"], 16, 2, 1000, "cpu", 0, None, full=True)
    r = rows[0]
    assert r["hector_model_bytes"] < r["pyg_model_bytes"]
    assert r["scaled_pyg_measured_peak"].startswith("skipped") or r["scaled_pyg_measured_peak"] == "no PyG"
    assert "| aifb | rgat |" in memory_table.markdown(rows)


def test_speed_smoke(tmp_path):
    pytest.importorskip("torch_geometric")
    speed = load("speed")

    rows = speed.run(["mutag"], ["rgcn", "hgt"], 8, 2, 0.005, "cpu", 1, 60, str(tmp_path / "s.csv"))
    assert len(rows) == 2 and all(isinstance(r["hector_ms"], float) for r in rows)


def test_rgat_ir_dump(capsys):
    rgat_ir = load("rgat_ir")

    rgat_ir.main(["--dataset", "aifb", "--scale", "0.05", "--dim", "8", "--heads", "2"])
    text = capsys.readouterr().out
    assert "## before passes" in text and "## after passes" in text and "edge_softmax" in text
    assert "k0_" in text and "generated backward" in text


def test_bench_cuda_smoke(tmp_path):
    pytest.importorskip("torch_geometric")
    pytest.importorskip("matplotlib")
    bench = load("bench_cuda")

    out, png = tmp_path / "b.csv", tmp_path / "b.png"
    rows, extras = bench.main(["--scale", "0.002", "--datasets", "aifb", "--device", "cpu", "--extras-dataset", "aifb",
                               "--cap-s", "0.5", "--csv", str(out), "--png", str(png)])
    assert out.exists() and png.exists() and (tmp_path / "b_extras.csv").exists()
    assert {(r["model"], r["hidden"], r["layers"]) for r in rows} >= {("rgcn", 64, 1), ("rgat", 128, 1), ("hgt", 64, 2)}
    assert all(isinstance(r["hector_train_ms"], float) and isinstance(r["hector_infer_ms"], float) for r in rows)
    assert {e["kind"] for e in extras} == {"ablation", "minibatch"}
    assert {e["variant"] for e in extras if e["kind"] == "ablation"} >= {"compaction off", "fusion off"}


def test_relations_smoke(tmp_path):
    relations = load("relations")
    out = tmp_path / "r.csv"
    rows = relations.main(["--relations", "8,400", "--nodes", "300", "--edges", "600", "--batches", "1",
                           "--dim", "8", "--csv", str(out)])
    assert out.exists() and len(rows) == 6
    assert all(r["step_ms"] > 0 and r["ops_per_step"] > 0 for r in rows)
