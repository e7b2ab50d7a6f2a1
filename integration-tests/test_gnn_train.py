"""gnn_train.py end to end at the tiny size: both paths train, learn, and agree batch by batch."""

from __future__ import annotations

import json

import pytest

import gnn_train


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gnn") / "gnn.json"
    report = gnn_train.main(["--size", "tiny", "--device", "cpu", "--no-progress", "--json", str(path)])
    return report, path


def test_both_paths_learn_the_labels(tiny):
    report, _ = tiny
    chance = report["chance_accuracy"]
    for impl in ("toolkit", "baseline"):
        epochs = report["impls"][impl]["epochs"]
        assert len(epochs) == gnn_train.SIZES["tiny"].epochs
        assert epochs[-1]["loss"] < epochs[0]["loss"] - 0.2, impl
        assert epochs[-1]["val_acc"] > 2.5 * chance, (impl, epochs[-1]["val_acc"], chance)
        for e in epochs:
            assert e["time_s"] > 0 and e["seeds_per_s"] > 0
            assert {"sample_s", "gather_s", "compute_s", "wait_s"} <= set(e)


def test_toolkit_and_baseline_agree_batch_by_batch(tiny):
    # same weights, same batches, same formula (hector's RGATConv(attention="shared") is PyG's RGATConv)
    report, _ = tiny
    ours = [v for e in report["impls"]["toolkit"]["epochs"] for v in e["batch_losses"]]
    theirs = [v for e in report["impls"]["baseline"]["epochs"] for v in e["batch_losses"]]
    assert len(ours) == len(theirs) > 10
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3
    accuracies = [(a["val_acc"], b["val_acc"]) for a, b in zip(report["impls"]["toolkit"]["epochs"],
                                                                report["impls"]["baseline"]["epochs"], strict=True)]
    assert all(abs(a - b) < 0.02 for a, b in accuracies), accuracies


def test_results_file(tiny):
    report, path = tiny
    data = json.loads(path.read_text())
    assert data["script"] == "gnn_train" and data["world_size"] == 1
    assert data["graph"]["nodes"] == gnn_train.SIZES["tiny"].graph.num_nodes
    assert set(data["impls"]) == {"toolkit", "baseline"}
    # the host a result was measured on: a host-bound epoch compares across machines only with these
    env = data["environment"]
    assert env["cpu_model"] and env["cpus"] >= 1
    assert 0 < env["python_probe_ms"] < 10_000


def test_topology_in_host_memory_trains_the_same(tiny):
    report, _ = tiny
    host = gnn_train.main(["--size", "tiny", "--device", "cpu", "--no-progress", "--impl", "toolkit",
                           "--topology", "host", "--epochs", "1"])
    first = lambda r: r["impls"]["toolkit"]["epochs"][0]["batch_losses"]  # noqa: E731
    assert first(host) == pytest.approx(first(report), abs=1e-5)


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        gnn_train.main(["--size", "huge"])
    with pytest.raises(ValueError, match="labelled type"):
        gnn_train.main(["--size", "tiny", "--device", "cpu", "--num-train", "100000"])


@pytest.mark.gpu
def test_tiny_on_the_gpu():
    # the GPU paths: sampler on the device, zero-copy gather, hector's CUDA backend, CUDA-event phase timers
    report = gnn_train.main(["--size", "tiny", "--device", "cuda", "--no-progress"])
    chance = report["chance_accuracy"]
    for impl in ("toolkit", "baseline"):
        assert report["impls"][impl]["epochs"][-1]["val_acc"] > 2.5 * chance, impl
        assert report["impls"][impl]["peak_gpu_bytes"] > 0
    ours = [v for e in report["impls"]["toolkit"]["epochs"] for v in e["batch_losses"]]
    theirs = [v for e in report["impls"]["baseline"]["epochs"] for v in e["batch_losses"]]
    # TF32 / summation order differ between hector's kernels and PyG's: close, not equal
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 2e-2


@pytest.mark.gpu
def test_topology_in_host_memory_on_the_gpu():
    device = gnn_train.main(["--size", "tiny", "--device", "cuda", "--no-progress", "--impl", "toolkit",
                             "--epochs", "1"])
    host = gnn_train.main(["--size", "tiny", "--device", "cuda", "--no-progress", "--impl", "toolkit",
                           "--epochs", "1", "--topology", "host"])
    first = lambda r: r["impls"]["toolkit"]["epochs"][0]["batch_losses"]  # noqa: E731
    assert first(host) == pytest.approx(first(device), abs=1e-4)


def test_too_small_shared_memory_is_named():
    with pytest.raises(SystemExit, match="/dev/shm has .* free but the shared feature table needs"):
        gnn_train.check_shared_memory_space(1 << 60)
    gnn_train.check_shared_memory_space(1)


def test_every_way_of_loading_trains_the_same(tiny):
    # by a loader thread (the default), ahead by the training thread, in turn: the very same batches, so the same
    # losses, bit for bit on the CPU
    report, _ = tiny
    ways = gnn_train.main(["--size", "tiny", "--device", "cpu", "--no-progress", "--epochs", "1",
                           "--compare-loading"])
    assert set(ways["impls"]) == {f"{impl}{way}" for impl in ("toolkit", "baseline")
                                  for way in ("", "-inturn", "-ahead")}
    assert ways["impls"]["toolkit"]["loader"] == "thread" and ways["impls"]["toolkit-inturn"]["ahead"] == 0
    first = lambda r, impl: r["impls"][impl]["epochs"][0]["batch_losses"]  # noqa: E731
    for impl in ("toolkit", "baseline"):
        assert first(ways, impl) == first(ways, f"{impl}-inturn") == first(ways, f"{impl}-ahead") == \
            first(report, impl), impl
        epoch = ways["impls"][impl]["epochs"][0]
        assert {"wait_s", "compute_s", "sample_s", "gather_s", "wait_fraction"} <= set(epoch), impl
        assert 0 <= epoch["wait_fraction"] < 1 and epoch["sample_s"] > 0
    two = gnn_train.main(["--size", "tiny", "--device", "cpu", "--no-progress", "--epochs", "1", "--impl", "both",
                          "--prefetch", "2", "--baseline-ways", "inturn,thread", "--toolkit-ways",
                          "ahead,thread-python"])
    assert set(two["impls"]) == {"toolkit", "toolkit-ahead", "toolkit-thread-python", "baseline", "baseline-inturn"}
    assert two["impls"]["toolkit"]["ahead"] == 2 and two["impls"]["toolkit-ahead"]["loader"] == "ahead"
    # the sampler's TorchScript function and its operations called from Python: the same batches
    assert first(two, "toolkit") == first(two, "toolkit-ahead") == first(two, "toolkit-thread-python") == \
        first(report, "toolkit")
    assert first(two, "baseline") == first(two, "baseline-inturn") == first(report, "baseline")
    summary = two["summary"]
    assert summary["best_baseline"] in ("baseline", "baseline-inturn") and summary["speedup"] > 0
    assert summary["toolkit_val_acc"] == summary["baseline_val_acc"]
    with pytest.raises(SystemExit):
        gnn_train.main(["--size", "tiny", "--device", "cpu", "--prefetch", "0"])
    with pytest.raises(SystemExit):
        gnn_train.main(["--size", "tiny", "--device", "cpu", "--baseline-ways", "sideways"])


def test_relation_flags_train_many_relations():
    report = gnn_train.main(["--size", "tiny", "--device", "cpu", "--no-progress", "--epochs", "1",
                             "--relations", "200", "--relation-skew", "1.0", "--profile", "2", "--profile-host", "2"])
    assert report["config"]["graph"]["num_relations"] == 200 and report["config"]["graph"]["relation_skew"] == 1.0
    for impl in ("toolkit", "baseline"):  # the profiled steps: the costliest operations, each step's matmuls among them
        rows = report["impls"][impl]["profile"]
        assert 0 < len(rows) <= 20 and all(r["cpu_ms_per_step"] >= 0 for r in rows)
        assert any("mm" in r["op"] and r["calls_per_step"] >= 1 for r in rows), [r["op"] for r in rows]
        threads = {t["thread"]: t for t in report["impls"][impl]["profile_threads"]}
        assert {"training", "loader"} <= set(threads), threads  # (the loader's thread makes the batches)
        assert threads["training"]["host_ms_per_step"] > 0
        sides = report["impls"][impl]["host_profile"]  # each side's host time alone
        assert set(sides) == {"making a batch", "a training step"} and min(sides.values()) > 0, sides
    ours = report["impls"]["toolkit"]["epochs"][0]["batch_losses"]
    theirs = report["impls"]["baseline"]["epochs"][0]["batch_losses"]
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3


def test_toolkit_with_the_feature_cache_trains_the_same():
    report = gnn_train.main(["--size", "tiny", "--device", "cpu", "--no-progress", "--epochs", "1", "--impl",
                             "toolkit", "--toolkit-cache", "0.2"])
    cached, plain = report["impls"]["toolkit-cache"], report["impls"]["toolkit"]
    assert cached["cache"]["share"] == 0.2 and abs(cached["cache"]["rows"] - 0.2 * 8_000) <= 1
    assert 0.2 < cached["cache"]["hit_rate"] < 1  # the high-degree rows are gathered more often than the others
    assert cached["epochs"][0]["batch_losses"] == pytest.approx(plain["epochs"][0]["batch_losses"], abs=1e-6)
    with pytest.raises(SystemExit):
        gnn_train.main(["--size", "tiny", "--device", "cpu", "--toolkit-cache", "1.5"])


def test_rerun_trains_each_implementation_again_last():
    """--rerun adds each implementation's default way at the end (the same batches, the same losses); where
    hector's launch plans are built (--layer-plans, and the ways that force a place) changes nothing in the
    results."""
    report = gnn_train.main(["--size", "tiny", "--device", "cpu", "--no-progress", "--epochs", "1", "--rerun",
                             "--layer-plans", "loader", "--switch-interval-ms", "1",
                             "--toolkit-ways", "thread-plans-step,thread-normal-priority,thread-serial,preloaded"])
    assert list(report["impls"])[-2:] == ["toolkit-rerun", "baseline-rerun"]
    first = report["impls"]["toolkit"]["epochs"][0]["batch_losses"]
    for name in ("toolkit-rerun", "toolkit-thread-plans-step", "toolkit-thread-normal-priority",
                 "toolkit-thread-serial", "toolkit-preloaded"):
        assert report["impls"][name]["epochs"][0]["batch_losses"] == pytest.approx(first, abs=1e-6), name


def test_a_failed_cache_run_leaves_the_others_and_fails_the_script(tmp_path, monkeypatch):
    import json

    def no_memory(*args, **kwargs):
        raise MemoryError("no room for the cache")

    monkeypatch.setattr(gnn_train, "make_cache", no_memory)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit, match="toolkit-cache failed"):
        gnn_train.main(["--size", "tiny", "--device", "cpu", "--no-progress", "--epochs", "1", "--toolkit-cache",
                        "0.1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert "no room for the cache" in report["impls"]["toolkit-cache"]["error"]
    assert report["summary"]["speedup"] > 0 and report["impls"]["toolkit"]["epochs"]


@pytest.mark.gpu
def test_batches_made_ahead_on_the_gpu():
    # batches made on the loader's stream (ahead, in turn, or by a thread) reach the training stream intact: the
    # same training every way
    report = gnn_train.main(["--size", "tiny", "--device", "cuda", "--no-progress", "--epochs", "1",
                             "--compare-loading"])
    first = lambda impl: report["impls"][impl]["epochs"][0]["batch_losses"]  # noqa: E731
    for impl in ("toolkit", "baseline"):
        assert report["impls"][impl]["ahead"] == 1 and report["impls"][f"{impl}-inturn"]["ahead"] == 0
        assert report["impls"][impl]["epochs"][0]["wait_s"] >= 0
        for way in ("-inturn", "-ahead"):
            # hector's kernels add with atomics: the order of additions, not the batches, may differ
            assert first(f"{impl}{way}") == pytest.approx(first(impl), abs=1e-4), (impl, way)


def _toolkit_batch_ops(relations: int) -> tuple[int, int]:
    """Torch operations dispatched to make one toolkit batch (sample, gather, hector.prepare_graph) and to train on
    it (forward, backward, optimizer step), on the CPU, with a model of ``relations`` relations."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import harness
    from gnn_data import generate

    class Count(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    args = gnn_train.parse_args(["--size", "tiny", "--device", "cpu", "--relations", str(relations),
                                 "--relation-skew", "1.0"])
    cfg = gnn_train.configure(args)
    proc = harness.start("cpu")
    graph = generate(cfg.graph, proc.device)
    table, _, _ = gnn_train.make_table(proc, graph, show_progress=False)
    topology = gnn_train.make_topology(graph, "device")
    model = gnn_train.build_models(cfg, 0)["toolkit"]
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    seeds = gnn_train.rank_seeds(graph.train_idx, cfg.batch_size, proc)
    loader = iter(gnn_train.make_loader("toolkit", topology, table, graph.labels, cfg, seeds, proc.device,
                                        "inturn", 1, 0, False))

    def step(batch):
        out = model(batch.x, batch.hector_graph, batch.edge_type)[: batch.batch_size]
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(out, batch.y[: batch.batch_size]).backward()
        optimizer.step()

    step(next(loader))  # tracing, the cost model's choice, the optimizer's state
    with Count() as making:
        batch = next(loader)
    with Count() as training:
        step(batch)
    return making.count, training.count


def test_toolkit_batch_work_does_not_grow_with_relations():
    # a tiny batch holds a few hundred of the 5,000 relations: a per-relation loop anywhere in making a batch or
    # training on it would add thousands of operations
    few, many = _toolkit_batch_ops(16), _toolkit_batch_ops(5000)
    assert many[0] <= 1.2 * few[0] + 20, ("making a batch", few[0], many[0])
    assert many[1] <= 1.2 * few[1] + 20, ("training on it", few[1], many[1])


def _toolkit_batch_work(relations: int) -> tuple[int, int]:
    """(operations that make a tensor, host round trips) of one toolkit batch made by its loader (sampling, feature
    gathers, hector's graph preparation), on the CPU; round trips counted with the sampler's Python path (the
    TorchScript interpreter reads sizes without dispatching an operation)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import harness
    from gnn_data import generate

    args = gnn_train.parse_args(["--size", "tiny", "--device", "cpu", "--relations", str(relations)])
    cfg = gnn_train.configure(args)
    graph = generate(cfg.graph, "cpu")
    table = torch.randn(graph.num_nodes, cfg.graph.feature_dim)
    seeds = gnn_train.rank_seeds(graph.train_idx, cfg.batch_size, harness.start("cpu"))
    loader = gnn_train.make_loader("toolkit", gnn_train.make_topology(graph, "device"), table, graph.labels, cfg,
                                   seeds, torch.device("cpu"), "inturn", 1, 0, False)
    aten = torch.ops.aten
    sized = (aten._unique2, aten.unique_dim, aten._local_scalar_dense, aten.nonzero, aten.bincount)

    class Count(TorchDispatchMode):
        ops = reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.ops += not func.is_view
            self.reads += func.overloadpacket in sized or (
                func.overloadpacket is aten.repeat_interleave and kwargs.get("output_size") is None)
            return func(*args, **kwargs)

    positions = torch.arange(cfg.batch_size)
    loader.make(positions)
    with Count() as count:
        loader.make(positions + cfg.batch_size)
    tolist, lists = torch.Tensor.tolist, []
    try:
        torch.Tensor.tolist = lambda t: lists.append(1) or tolist(t)
        loader.sampler.kernels = False
        loader.sampler.script = False
        with Count() as python:
            loader.make(positions)
    finally:
        torch.Tensor.tolist = tolist
    return count.ops, python.reads + len(lists)


def test_a_toolkit_batchs_host_work_is_fixed_and_does_not_grow_with_relations():
    # the loader thread's host work competes with training (the GIL, and round trips that wait for a GPU busy with
    # training): a batch is a fixed number of operations, whatever the relations, with one host round trip per hop
    # and one more for sampling, and one for hector's graph preparation (ids checked, order checked and unique
    # pairs counted in one read; its pair count is a dozen small operations instead of torch.unique's one call).
    # hector finds the unique (source, relation) pairs by marks in a table of every key where that table is small
    # (8 relations here) and by one sort otherwise (200 and 5,000): each way a fixed number of operations.
    few, many, most = _toolkit_batch_work(8), _toolkit_batch_work(200), _toolkit_batch_work(5000)
    assert many == most, (many, most)
    assert abs(few[0] - many[0]) <= 3 and few[1] == many[1], (few, many)
    for ops, reads in (few, many):
        assert ops <= 125 and reads <= 2 + 1 + 1, (ops, reads)
