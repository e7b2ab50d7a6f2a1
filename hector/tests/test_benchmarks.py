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
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
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
                               "--cap-s", "0.5", "--compile-datasets", "aifb", "--compile-backend", "aot_eager",
                               "--configs", "rgcn:64:1,rgat:128:1,hgt:64:1,hgt:64:2",
                               "--csv", str(out), "--png", str(png)])
    assert out.exists() and png.exists() and (tmp_path / "b_extras.csv").exists()
    assert {(r["model"], r["hidden"], r["layers"]) for r in rows} >= {("rgcn", 64, 1), ("rgat", 128, 1), ("hgt", 64, 2)}
    assert all(isinstance(r["hector_train_ms"], float) and isinstance(r["hector_infer_ms"], float) for r in rows)
    one = [r for r in rows if r["layers"] == 1]
    for key in ("hector_newgraph_train_ms", "hector_compiled_train_ms", "hector_autocast_train_ms",
                "user_loop_fp32_train_ms"):
        assert all(isinstance(r[key], float) for r in one), key
    assert all(r["best_baseline_train"] for r in one)
    assert {e["kind"] for e in extras} == {"ablation", "minibatch"}
    assert {e["variant"] for e in extras if e["kind"] == "ablation"} >= {"compaction off", "fusion off"}


def test_bench_cuda_hector_only_reports_compiled_host_time(tmp_path, capsys, monkeypatch):
    """``--hector-only`` (the GPU run's compile step): hector eager and compiled, their host time per step and its
    ratio, in the rows and the summary; no baseline timed. (The GPU operation count, which the profiler gives on a
    GPU only, is faked: the rows print without the new-edge_index columns that mode does not measure.)"""
    bench = load("bench_cuda")
    monkeypatch.setattr(bench, "device_work", lambda fn, device: (7, 0.5))
    out = tmp_path / "c.csv"
    rows, extras = bench.main(["--scale", "0.002", "--datasets", "aifb", "--device", "cpu", "--hector-only",
                               "--no-reference", "--compile-datasets", "aifb", "--compile-backend", "aot_eager",
                               "--configs", "rgcn:64:1,hgt:64:1", "--csv", str(out)])
    assert out.exists() and len(rows) == 2 and extras == []
    for r in rows:
        assert all(isinstance(r[k], float) and r[k] > 0 for k in
                   ("hector_train_ms", "hector_compiled_train_ms", "hector_host_ms", "hector_compiled_host_ms")), r
        assert r["compiled_host_ratio"] == pytest.approx(r["hector_host_ms"] / r["hector_compiled_host_ms"])
        assert not [k for k in r if k.startswith(("user_", "RGCNConv", "HGTConv", "ref_", "hector_newgraph"))], r
    assert all(r["hector_launches"] == 7 for r in rows)
    text = capsys.readouterr().out
    assert "host ms per train step, eager/compiled" in text and "torch.compile vs eager" in text
    assert "GPU ops/step 7 (0.50 ms busy)" in text
    assert "over the best baseline" not in text


def test_bench_cuda_hector_only_with_new_edge_index(tmp_path, capsys, monkeypatch):
    """``--hector-only --new-edge-index``: hector with a new edge_index per call against the persistent graph, in
    the rows and the summary's target line, without any baseline (the cheap way to check that target on a GPU)."""
    bench = load("bench_cuda")
    monkeypatch.setattr(bench, "device_work", lambda fn, device: (7, 0.5))
    rows, _ = bench.main(["--scale", "0.002", "--datasets", "aifb", "--device", "cpu", "--hector-only",
                          "--new-edge-index", "--no-reference", "--compile-datasets", "none", "--configs",
                          "rgcn:64:1"])
    (r,) = rows
    assert isinstance(r["hector_newgraph_train_ms"], float) and r["hector_newgraph_train_ms"] > 0, r
    assert r["newgraph_ratio"] == pytest.approx(r["hector_newgraph_train_ms"] / r["hector_train_ms"])
    assert not [k for k in r if k.startswith(("user_", "RGCNConv", "ref_", "hector_compiled"))], r
    assert "new edge_index per call: worst" in capsys.readouterr().out


def test_relations_smoke(tmp_path):
    relations = load("relations")
    out = tmp_path / "r.csv"
    rows = relations.main(["--relations", "8,400", "--nodes", "300", "--edges", "600", "--batches", "1",
                           "--dim", "8", "--csv", str(out)])
    assert out.exists() and len(rows) == 6
    assert all(r["step_ms"] > 0 and r["ops_per_step"] > 0 for r in rows)
    # a graph prepared with its layer (loader thread) leaves the step fewer operations, never more
    assert all(r["prepared_step_ms"] > 0 and 0 < r["ops_prepared"] <= r["ops_per_step"] for r in rows)
    # a step on the same graph's tensors is timed too, and each mini-batch step is given against it
    assert all(r["persistent_step_ms"] > 0 for r in rows)
    assert all(r["new_vs_persistent"] == pytest.approx(r["step_ms"] / r["persistent_step_ms"]) for r in rows)
    # the copies a step makes are the batch's, smaller than the weights at 400 relations
    assert all(r["largest_copy_mb"] < r["per_relation_mb"] for r in rows if r["relations"] == 400), rows
    # the host time per new graph, split into preparing it, its launch plans and the step
    for r in rows:
        parts = [r[f"split_{part}_ms"] for part in ("prepare", "plans", "step_host")]
        assert all(v > 0 for v in parts) and r["split_host_ms"] == pytest.approx(sum(parts)), r
        assert r["split_step_ms"] >= r["split_step_host_ms"] and r["split_vs_persistent"] > 0
    gnn = relations.main(["--models", "gnn2", "--relations", "8", "--nodes", "200", "--edges", "400", "--batches",
                          "1", "--dim", "8"])
    assert gnn[0]["model"] == "gnn2" and gnn[0]["split_host_ms"] > 0


def test_relations_profile_names_the_steps_python(capsys):
    relations = load("relations")
    assert relations.main(["--models", "rgat", "--relations", "8", "--nodes", "200", "--edges", "400", "--dim", "8",
                           "--profile", "2"]) is None
    out = capsys.readouterr().out
    assert "rgat, 8 relations: 2 prepared steps under cProfile" in out and "run_backward" in out


@pytest.mark.parametrize("kind", ["rgcn", "rgat", "hgt"])
def test_user_baselines_compute_hectors_formulas(kind):
    """The plain-PyTorch baselines bench_cuda times (per-relation fp32 path) give hector's outputs and input
    gradients: the comparison is between two implementations of one model."""
    import torch
    from conftest import make_graph, rel_err

    import hector.nn as hn

    baselines = load("baselines")
    ei, et, nt = make_graph(num_nodes=30, num_edges=200, num_relations=4, seed=2, node_types=3)
    torch.manual_seed(0)
    layer = {"rgcn": lambda: hn.RGCNConv(8, 8, 4), "rgat": lambda: hn.RGATConv(8, 2, 4, heads=4, attention="shared"),
             "hgt": lambda: hn.HGTConv(8, 8, 3, 4, heads=2)}[kind]()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    g = baselines.prepare(ei, et, 30, 4, nt, 3)
    user = baselines.USER_MODELS[kind](layer, "loop")
    x1, x2 = torch.randn(30, 8).requires_grad_(), None
    x2 = x1.detach().clone().requires_grad_()
    a, b = layer(x1, ei, et, nt), user(x2, g)
    assert rel_err(b, a) < 1e-5
    w = torch.randn_like(a)
    assert rel_err(torch.autograd.grad((b * w).sum(), x2)[0], torch.autograd.grad((a * w).sum(), x1)[0]) < 1e-5


def test_bench_cuda_best_baseline_is_never_hector_itself():
    """The ratio against the best baseline skips hector's own columns (its atomic and sorted scatter variants,
    its reference backend): a row whose fastest non-hector column is the compiled grouped-GEMM layer reports that
    one, even where hector's sorted variant is faster."""
    bench = load("bench_cuda")
    row = {"hector_train_ms": 4.0, "atomic_train_ms": 4.0, "sorted_train_ms": 3.0, "ref_train_ms": 2.0,
           "user_grouped_bf16_compiled_train_ms": 3.2, "RGATConv_train_ms": 80.0, "RGATConv_compiled_train_ms": "OOM"}
    bench.add_ratios(row)
    assert row["best_baseline_train"] == "user_grouped_bf16_compiled"
    assert row["speedup_train"] == pytest.approx(3.2 / 4.0)


def test_prep_bench_smoke():
    """The preparation benchmark on two tiny twins, one per pairs path; its previous way of computing the pairs
    (the A of its A/B) gives the same tensors as the current one."""
    import torch

    from hector.runtime import prep

    prep_bench = load("prep_bench")
    rows = prep_bench.main(["--datasets", "aifb,fb15k", "--scale", "0.01", "--reps", "1", "--device", "cpu"])
    assert [r["path"] for r in rows] == ["marks", "sort"]
    assert all(isinstance(r[k], float) for r in rows for k in ("pairs", "pairs_previous", "counts", "graph"))
    key = torch.randint(0, 50, (300,))
    for a, b in zip(prep_bench.previous_pairs(key, 50), prep.pairs_by_sort(key, 50), strict=True):
        assert torch.equal(a, b)
