"""report.py on hand-made results with known answers: ratios, scaling, out-of-memory runs, partial files."""

from __future__ import annotations

import json

import report


def gnn_result(world: int, toolkit_s: list[float], baseline_s: list[float] | None, seeds: int = 1000,
               dim: int = 128) -> dict:
    def impl(times):
        return {"epochs": [{"epoch": i + 1, "time_s": t, "seeds_per_s": seeds / t, "edges_per_s": 1.0,
                            "loss": 1.0 / (i + 1), "val_acc": 0.5 + 0.1 * i, "batch_losses": [1.0, 0.9],
                            "sample_s": 0.1, "gather_s": 0.2, "compute_s": 0.3} for i, t in enumerate(times)],
                "peak_gpu_bytes": 2**30}

    impls = {"toolkit": impl(toolkit_s)}
    impls["baseline"] = impl(baseline_s) if baseline_s else {}  # {}: stopped before its first epoch
    return {"script": "gnn_train", "size": "large", "world_size": world, "device": "cuda", "chance_accuracy": 0.0625,
            "config": {"graph": {"num_nodes": 100, "feature_dim": dim}},
            "host_feature_copies": 1.0 if world > 1 else None, "impls": impls,
            "graph": {"nodes": 100, "edges": 1000, "feature_bytes": 2**30}}


def llm_result(world: int, runs: list[tuple[str, int, float | None]]) -> dict:
    out = []
    for policy, batch, step_s in runs:
        if step_s is None:
            out.append({"policy": policy, "batch": batch, "status": "out of memory"})
        else:
            out.append({"policy": policy, "batch": batch, "status": "ok", "step_s": step_s,
                        "tokens_per_s": batch * 2048 * world / step_s, "losses": [10.0, 9.0],
                        "peak_bytes": batch * 2**30, "activation_peak_bytes": batch * 2**29})
    return {"script": "llm_train", "size": "large", "world_size": world, "device": "cuda", "runs": out,
            "environment": {"gpu_memory_bytes": 140 * 2**30},
            "config": {"model": {"arch": "gpt2", "layers": 24, "hidden": 2048, "seq_len": 2048}}}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_ratios_scaling_and_files(tmp_path):
    g1 = write(tmp_path, "g1.json", gnn_result(1, [2.0, 2.0], [5.0, 5.0]))
    g2 = write(tmp_path, "g2.json", gnn_result(2, [1.05, 1.05], None))
    # another configuration with 1 process: not the reference for the 2-process run above
    big = write(tmp_path, "big.json", gnn_result(1, [9.0], None, dim=1024))
    l1 = write(tmp_path, "l1.json", llm_result(1, [("keep", 8, 0.4), ("keep", 16, 0.8), ("keep", 20, None),
                                                   ("ssdtrain", 24, 1.25)]))
    l2 = write(tmp_path, "l2.json", llm_result(2, [("ssdtrain", 24, 1.3)]))
    text = report.report([g1, g2, big, tmp_path / "missing.json"], [l1, l2], tmp_path / "out")
    assert "toolkit: 2.50x the speed of baseline" in text
    assert "scaling: 2 processes 952 seeds/s = 1.90x one process (500)" in text
    # keep's largest batch is 16 at 16*2048/0.8 tokens/s; ssdtrain at 24: (24/1.25)/(16/0.8) = 0.96
    assert "ssdtrain at batch 24 = 1.50x keep's largest (16): 0.96x keep's tokens/s; keep ran out of memory at " \
           "batch 20" in text
    assert "scaling: 2 processes" in text and "= 1.92x one process" in text
    for name in ("gnn.csv", "llm.csv", "loss_curves.png", "gnn_epoch_time.png", "llm_memory_vs_step_time.png",
                 "report.txt"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    rows = (tmp_path / "out" / "llm.csv").read_text().splitlines()
    assert len(rows) == 1 + 5 and "out of memory" in rows[3]
