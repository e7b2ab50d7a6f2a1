"""Mini-batch training of a 2-layer relational GNN (RGAT) on a large synthetic heterogeneous graph whose node
features live in host memory, the toolkit's way beside the plain PyTorch/PyG way, on the same data, seeds and
sampled mini-batches.

toolkit:  the feature table is a pytorch-direct unified tensor; each batch's rows are gathered by the GPU straight
          from host memory (zero-copy, indices never leave the GPU); the layers are hector's RGATConv (compiled).
baseline: the same host table read by the CPU (torch index_select into pinned memory, then an asynchronous copy
          to the GPU: the strongest plain-PyTorch path); the layers are PyG's RGATConv.

Both start from the same weights (hector's RGATConv with attention="shared" is PyG's formula with PyG's parameter
names) and see the same batches, so their losses and accuracies should agree and only the time differs. Both load
through pytorch_direct.sampling.NeighborLoader (PyG's NeighborLoader needs pyg-lib, which neither machine has): the
same sampler, on the GPU, with batches made ahead by a loader thread on its own CUDA stream by default
(--loading); the toolkit also prepares each batch's graph for hector there (hector.prepare_graph).

    python integration-tests/gnn_train.py --size tiny                     # CPU, seconds
    python integration-tests/gnn_train.py --size large --json out.json    # one GPU
    python integration-tests/gnn_train.py --size large --num-nodes 20000000 --relations 1000 --relation-skew 1.0
    torchrun --nproc-per-node=2 integration-tests/gnn_train.py --size large --impl toolkit   # DDP, one GPU each

With several processes, the host copy of the feature table is made once per machine (POSIX shared memory, through
pytorch-direct) and mapped by every process; each rank trains on its own share of the seeds (DDP).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import secrets
import shutil
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import harness
from gnn_data import GraphSpec, fill_features, generate

IMPLS = ("toolkit", "baseline")
# How batches are made (pytorch_direct.sampling.NeighborLoader): by a loader thread on its own CUDA stream, ahead by
# the training thread on that stream, or in turn when training asks for them; "thread-python": by the loader thread
# with the sampler's operations called from Python (holding the GIL for each), instead of its TorchScript function
# that runs without the GIL: what the GIL costs a loader thread. "thread-normal-priority": the loader's CUDA streams
# at the default priority instead of high; "thread-plans-step" / "thread-plans-loader": hector's launch plans built
# always in the training step / always in the loader thread (instead of --layer-plans); "thread-serial": one loader
# thread samples and gathers in turn (not pipelined through a sampler thread of its own); "preloaded": the epoch's
# batches all made by the loader thread before the clock starts (launch plans included), so the epoch times the
# training steps alone, without loader threads beside them: what sharing the host with the loader costs.
WAYS = {"thread": dict(thread=True), "ahead": dict(thread=False), "inturn": dict(prefetch=0, thread=False),
        "thread-python": dict(thread=True), "thread-normal-priority": dict(thread=True, high_priority=False),
        "thread-plans-step": dict(thread=True, plans="step"), "thread-plans-loader": dict(thread=True, plans="loader"),
        "thread-serial": dict(thread=True, pipeline=False), "preloaded": dict(thread=True, plans="loader")}
# where the toolkit builds hector's launch plans for each batch (--layer-plans)
PLANS = ("ahead", "loader", "step")
LOADING = ("thread", "ahead", "inturn")  # the three ways of --compare-loading


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    graph: GraphSpec
    batch_size: int
    fanout: tuple[int, ...]
    epochs: int
    hidden: int
    heads: int
    lr: float = 0.005
    warmup_batches: int = 4  # forward + backward without an optimizer step (kernel compilation, allocator)


# tiny: a CPU in seconds. small: the demo on one GPU (a CPU in minutes). large: the GPU machine -- 40M nodes,
# 400M edges, a 20 GiB feature table in host memory.
SIZES = {
    "tiny": TrainConfig(GraphSpec(num_nodes=8_000, avg_degree=8, num_node_types=3, num_relations=8, num_classes=6,
                                  feature_dim=32, num_train=2_048, num_val=512, signal=1.0),
                        batch_size=256, fanout=(8, 4), epochs=3, hidden=8, heads=2, lr=0.01),
    "small": TrainConfig(GraphSpec(num_nodes=1_000_000, avg_degree=10, num_node_types=4, num_relations=16,
                                   num_classes=16, feature_dim=128, num_train=49_152, num_val=8_192, signal=1.0),
                         batch_size=1024, fanout=(10, 10), epochs=3, hidden=16, heads=4),
    "large": TrainConfig(GraphSpec(num_nodes=40_000_000, avg_degree=10, num_node_types=4, num_relations=16,
                                   num_classes=16, feature_dim=128, num_train=131_072, num_val=16_384, signal=1.0),
                         batch_size=1024, fanout=(15, 10), epochs=3, hidden=16, heads=4),
}


class RGAT(nn.Module):
    """Two RGAT layers (attention across relations, PyG's formula), each with a linear root term, and a linear
    classifier. ``conv`` builds a layer: hector's or PyG's RGATConv."""

    def __init__(self, conv, in_dim: int, hidden: int, heads: int, num_relations: int, classes: int) -> None:
        super().__init__()
        width = hidden * heads
        self.conv1 = conv(in_dim, hidden, num_relations, heads)
        self.root1 = nn.Linear(in_dim, width)
        self.conv2 = conv(width, hidden, num_relations, heads)
        self.root2 = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x, edge_index, edge_type):
        x = F.elu(self.conv1(x, edge_index, edge_type) + self.root1(x))
        x = F.elu(self.conv2(x, edge_index, edge_type) + self.root2(x))
        return self.head(x)


def hector_conv(in_dim, out_dim, num_relations, heads):
    import hector.nn as hn

    return hn.RGATConv(in_dim, out_dim, num_relations, heads=heads, attention="shared")


def pyg_conv(in_dim, out_dim, num_relations, heads):
    from torch_geometric.nn import RGATConv

    conv = RGATConv(in_dim, out_dim, num_relations, heads=heads)
    return conv


def build_models(cfg: TrainConfig, seed: int) -> dict[str, nn.Module]:
    """The two models with identical initial weights (PyG's initialisation, copied into hector's layers)."""
    spec = cfg.graph
    torch.manual_seed(seed)
    baseline = RGAT(pyg_conv, spec.feature_dim, cfg.hidden, cfg.heads, spec.num_relations, spec.num_classes)
    toolkit = RGAT(hector_conv, spec.feature_dim, cfg.hidden, cfg.heads, spec.num_relations, spec.num_classes)
    ours = dict(toolkit.named_parameters())
    missing = set(ours) - set(dict(baseline.named_parameters()))
    if missing:
        raise RuntimeError(f"hector's RGATConv has parameters PyG's lacks: {sorted(missing)}")
    with torch.no_grad():
        for name, param in baseline.named_parameters():
            if name in ours:
                ours[name].copy_(param)
            else:
                # PyG's RGATConv holds parameters of its other attention modes (w, l1, b1, ...): unused by the
                # across-relation additive attention trained here. Frozen, so DDP does not wait for their gradients.
                param.requires_grad_(False)
    return {"toolkit": toolkit, "baseline": baseline}


def make_table(proc: harness.Process, graph, dtype=torch.float32, show_progress: bool = True):
    """The feature table in host memory as a unified tensor: one per process alone, or, under torchrun, one copy per
    machine in shared memory made by LOCAL_RANK 0 and mapped by the others. Returns (table, shared-memory bytes it
    added to the machine, seconds)."""
    import pytorch_direct as pd

    spec = graph.spec
    shape = (graph.num_nodes, spec.feature_dim)
    start = time.perf_counter()
    shm_before = harness.host_shared_memory_bytes()
    bar = harness.progress(graph.num_nodes, "features", proc.main and show_progress)
    fill = lambda table: fill_features(table, graph, on_chunk=lambda done: bar.update(done - bar.n))  # noqa: E731
    if not proc.distributed:
        table = pd.empty(shape, dtype=dtype)
        fill(table)
    else:
        name = proc.broadcast(f"gnn-train-{secrets.token_hex(6)}")
        creator = proc.local_rank == 0
        if creator:
            check_shared_memory_space(spec.num_nodes * spec.feature_dim * torch.empty((), dtype=dtype).element_size())
        try:
            if creator:
                table = pd.shared_memory(name, shape, dtype, create=True)
                fill(table)
            proc.barrier()
            if not creator:
                table = pd.shared_memory(name, shape, dtype, create=False)
            proc.barrier()
        finally:
            if creator:
                pd.unlink_shared_memory(name)  # every process has mapped it; the pages live while mapped
    bar.close()
    harness.synchronize(proc.device)
    shm_after = harness.host_shared_memory_bytes()
    added = None if shm_before is None or shm_after is None else max(0, shm_after - shm_before)
    return table, added, time.perf_counter() - start


def check_shared_memory_space(nbytes: int) -> None:
    """Fail with a clear message, not a SIGBUS on the first write past the end, when /dev/shm (where POSIX shared
    memory, and so pytorch_direct.shared_memory, lives) is too small."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        return
    if free < nbytes:
        raise SystemExit(f"/dev/shm has {harness.gib(free)} free but the shared feature table needs "
                         f"{harness.gib(nbytes)}: enlarge it (mount -o remount,size=... /dev/shm; docker run "
                         f"--shm-size=...) or make the table smaller (--num-nodes, --feature-dim)")


def rank_seeds(train_idx: torch.Tensor, batch_size: int, proc: harness.Process) -> torch.Tensor:
    """This rank's training seeds: every rank the same number of full batches (DDP steps together)."""
    per_rank = train_idx.numel() // (batch_size * proc.world_size) * batch_size
    if per_rank == 0:
        raise ValueError(f"{train_idx.numel()} training nodes cannot fill one batch of {batch_size} per process")
    return train_idx.cpu()[proc.rank::proc.world_size][:per_rank]


def make_loader(impl: str, topology, table, labels, cfg: TrainConfig, seeds: torch.Tensor, device: torch.device,
                way: str, prefetch: int, seed: int, shuffle: bool, model: nn.Module | None = None,
                plans: str = "ahead"):
    """The mini-batch loader of ``impl``: the toolkit reads the unified table zero-copy and prepares each batch's
    graph for hector where the batch is made, and the launch plans of ``model``'s hector layers where ``plans``
    says (PLANS: the loader thread while it is ahead of training, always the loader, or the training step; a way
    may say otherwise; without ``model`` the layers build them); the baseline gathers rows on the CPU into pinned
    memory and copies them (``unify=False``)."""

    from pytorch_direct.sampling import NeighborLoader

    options = {"prefetch": prefetch, **WAYS[way]}
    plans = options.pop("plans", plans)
    prepare = when_ahead = None
    if impl == "toolkit":
        import hector.nn

        num_relations = cfg.graph.num_relations

        def prepare(sub):
            # hector's preprocessing reads a few sizes on the host: done where the batch is made, while its
            # features are gathered on the loader's other stream (its host reads then wait for the sampling only)
            return {"hector_graph": hector.prepare_graph(sub.edge_index, sub.edge_type, sub.num_nodes,
                                                         num_relations,
                                                         layers=model if plans == "loader" and model is not None
                                                         else ())}

        if plans == "ahead" and model is not None and options.get("thread"):  # (only a loader thread is ahead)
            # The layers' launch plans cost the host a few ms per batch wherever they are built. In the loader
            # thread they help where the step is the slower side (many relations) and hurt where the loader is
            # (an H100, large preset: 1.20 s per epoch, 19% waiting, against 1.16 s with the plans in the step):
            # so only while the loader is ahead; the layers build them at their first call otherwise.
            convs = [m for m in model.modules() if isinstance(m, hector.nn.RelationalLayer)]

            def when_ahead(batch):
                for conv in convs:
                    conv.prepare(batch.hector_graph)

    features = {"x": table if impl == "toolkit" else table.plain(), "y": labels}
    loader = NeighborLoader((features, topology), list(cfg.fanout), input_nodes=seeds, batch_size=cfg.batch_size,
                            shuffle=shuffle, drop_last=shuffle, device=device, unify=impl == "toolkit",
                            prepare=prepare, prepare_when_ahead=when_ahead, seed=seed, **options)
    if way.endswith("-python"):
        loader.sampler.kernels = False  # (the torch path, whose operations then run from Python)
        loader.sampler.script = False
    return loader


def run_impl(impl: str, model: nn.Module, cfg: TrainConfig, graph, table, topology, proc: harness.Process, args,
             result: dict, save=lambda: None, way: str = "thread", name: str | None = None,
             cache: float = 0.0) -> None:
    """Train ``impl`` with batches made ``way`` (WAYS); fills ``result`` (epochs as they finish, then peak memory)
    and calls ``save`` after each epoch. ``name`` labels the progress output (default: ``impl``). ``cache``: the
    share of the feature table's rows pytorch-direct's GPU cache holds during the run (the toolkit only; 0: none)."""
    name = name or impl
    prefetch = max(1, args.prefetch)
    result["loader"] = way
    result["ahead"] = 0 if way == "inturn" else prefetch
    row_cache = None
    if cache > 0:
        if impl != "toolkit":
            raise ValueError("the feature cache is pytorch-direct's: only the toolkit can train with it")
        row_cache = make_cache(table, graph, cache, proc.device)
        result["cache"] = dict(row_cache.info)
    previous = sys.getswitchinterval()
    if args.switch_interval_ms:  # how long a thread waiting for the interpreter lock waits before asking for it
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    try:
        _train(impl, model, cfg, graph, table, topology, proc, args, result, save, way, name, prefetch, row_cache)
    finally:
        sys.setswitchinterval(previous)
        if row_cache is not None:
            row_cache.release()


def make_cache(table, graph, share: float, device: torch.device):
    """pytorch-direct's GPU cache of the feature table holding ``share`` of its rows, filled by a degree estimate:
    a node's row is gathered each time a sampled edge leaves it, so the nodes with the most out-edges first.
    Returns the cache with ``info`` (share, rows, bytes, fill seconds) attached."""
    import pytorch_direct as pd

    if not 0 < share <= 1:
        raise ValueError(f"the cache share must lie in (0, 1], got {share}")
    start = time.perf_counter()
    row = graph.row.plain() if pd.is_unified(graph.row) else graph.row
    out_degree = torch.bincount(row, minlength=graph.num_nodes).float()
    rows = max(1, int(share * graph.num_nodes))
    row_bytes = table.shape[1] * table.element_size()
    # the budget covers the rows (+ 8 bytes each: their table row) and the slot map (4 bytes per table row)
    row_cache = pd.cached(table, rows * (row_bytes + 8) + 4 * graph.num_nodes, frequency=out_degree, device=device)
    del out_degree
    harness.synchronize(device)
    stats = row_cache.stats()
    row_cache.info = {"share": share, "rows": stats["cached_rows"], "bytes": stats["bytes"],
                      "fill_s": time.perf_counter() - start}
    return row_cache


def _train(impl, model, cfg, graph, table, topology, proc, args, result, save, way, name, prefetch,
           row_cache) -> None:
    """The training of :func:`run_impl` (``row_cache``: the feature cache in use, or None)."""
    device = proc.device
    model = model.to(device)
    if proc.distributed:
        # static_graph: every step uses the same parameters, so DDP can skip re-tracing which ones took part
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        static_graph=True, gradient_as_bucket_view=True)
    params = [p for p in model.parameters() if p.requires_grad]
    # fused on a GPU (both implementations): one kernel for all parameters instead of the foreach implementation's
    # several, in a step bound by the host
    optimizer = torch.optim.Adam(params, lr=cfg.lr, fused=device.type == "cuda")
    labels = graph.labels
    seeds = rank_seeds(graph.train_idx, cfg.batch_size, proc)

    def loader(nodes, seed, shuffle=True):
        return make_loader(impl, topology, table, labels, cfg, nodes, device, way, prefetch, seed, shuffle,
                           model, args.layer_plans)

    def forward(batch) -> torch.Tensor:
        edges = batch.hector_graph if impl == "toolkit" else batch.edge_index
        return model(batch.x, edges, batch.edge_type)[: batch.batch_size]

    # Warm-up: kernel compilation, allocator, page mapping; gradients dropped, weights unchanged. Its own loader
    # (read to the end, so the training loader's random numbers do not depend on how far a thread ran ahead).
    model.train()
    for batch in loader(seeds[: cfg.warmup_batches * cfg.batch_size], args.seed + 29, shuffle=False):
        F.cross_entropy(forward(batch), batch.y[: batch.batch_size]).backward()
        optimizer.zero_grad(set_to_none=True)
        if row_cache is not None and "hit_rate" not in result["cache"]:
            result["cache"]["hit_rate"] = row_cache.hit_rate(batch.n_id)  # of the rows a batch gathers
    harness.reset_peak_memory(device)

    train_loader = loader(seeds, args.seed)
    val_loader = loader(graph.val_idx.cpu()[proc.rank::proc.world_size], args.seed + 17, shuffle=False)
    epochs = result.setdefault("epochs", [])
    for epoch in range(cfg.epochs):
        model.train()
        losses = []
        edges = 0
        bar = harness.progress(len(train_loader), f"{name} epoch {epoch + 1}/{cfg.epochs}",
                               proc.main and not args.no_progress)
        batches = train_loader
        if way == "preloaded":
            batches = list(train_loader)
            harness.synchronize(device)
        begin = harness.now(device)
        begin_cpu = time.thread_time()
        for batch in batches:
            edges += batch.num_edges
            loss = F.cross_entropy(forward(batch), batch.y[: batch.batch_size])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
            bar.update(1)
        issued = time.perf_counter() - begin  # the host's share: the steps' work queued, not yet done
        train_cpu = time.thread_time() - begin_cpu
        elapsed = harness.now(device) - begin
        bar.close()
        stats = train_loader.stats()
        if way == "preloaded":  # (its waits fell before the clock started)
            stats["wait_s"] = 0.0
        phases = {"wait": stats["wait_s"], "compute": max(0.0, elapsed - stats["wait_s"]),
                  "sample": stats["sample_s"], "gather": stats["gather_s"]}
        ahead = stats["ahead_batches"]  # batches whose launch plans the loader built (--layer-plans ahead)
        batch_losses = [v / proc.world_size for v in proc.sum(torch.stack(losses).tolist())]
        seeds_total, edges_total = proc.sum([len(losses) * cfg.batch_size, edges])
        elapsed, wait = proc.max([elapsed, stats["wait_s"]])
        val_acc = evaluate(model, val_loader, forward, proc, graph.val_idx.numel())
        record = {
            "epoch": epoch + 1, "time_s": elapsed, "seeds_per_s": seeds_total / elapsed,
            "edges_per_s": edges_total / elapsed, "loss": sum(batch_losses) / len(batch_losses),
            "val_acc": val_acc, **{f"{k}_s": v for k, v in phases.items()}, "wait_fraction": wait / elapsed,
            "batch_losses": batch_losses, "plans_in_loader": ahead, "issued_s": issued,
            "train_cpu_s": train_cpu, "sample_cpu_s": stats["sample_cpu_s"], "gather_cpu_s": stats["gather_cpu_s"],
        }
        auto = _gather_status(impl, device)
        if auto is not None:
            record["feature_gather"] = auto
        epochs.append(record)
        result["batches_per_epoch_per_rank"] = len(losses)
        save()
        cached = result.get("cache")
        proc.print(f"  {name:16s} epoch {epoch + 1}: {elapsed:7.2f} s  {record['seeds_per_s']:10,.0f} seeds/s  "
                   f"loss {record['loss']:.4f}  val acc {val_acc:.3f}  (waited for batches {wait:.2f} s = "
                   f"{wait / elapsed:.1%}; loader: sample {phases['sample']:.2f} s, gather {phases['gather']:.2f} s"
                   + (f", plans of {ahead} of {len(losses)} batches" if ahead else "")
                   + f"; steps queued in {issued:.2f} s; CPU s: training thread {train_cpu:.2f}, "
                     f"sampling {stats['sample_cpu_s']:.2f}, gathering {stats['gather_cpu_s']:.2f})"
                   + (f" [gather: {_status_text(auto)}]" if auto else "")
                   + (f" [cache: {cached['rows']:,} rows = {cached['share']:.0%}, {harness.gib(cached['bytes'])}, "
                      f"{cached.get('hit_rate', 0):.1%} of a batch's rows]" if cached else ""))
    peak = harness.peak_memory(device)
    if args.profile and name in IMPLS:  # (each implementation's default way)
        trace = f"{args.trace_dir}/{name}.json.gz" if args.trace_dir else None
        result["profile"], result["profile_threads"] = profile_batches(train_loader, forward, optimizer,
                                                                       args.profile, device, name, proc, trace)
    if args.profile_host and name in IMPLS:
        model.train()  # (the last evaluation left it in eval mode: its batches would get inference plans)
        result["host_profile"] = profile_host(
            lambda: make_loader(impl, topology, table, labels, cfg, seeds, device, "inturn", 1, args.seed + 41,
                                True, model, "loader"),
            forward, optimizer, args.profile_host, device, name, proc)
    result["peak_gpu_bytes"] = proc.max([peak])[0] if peak is not None else None
    save()


def profile_host(make_loader_in_turn, forward, optimizer, count: int, device: torch.device, name: str,
                 proc: harness.Process, top: int = 20) -> dict:
    """The host work of a batch, each side alone under cProfile in this thread: making ``count`` batches (the
    loader in turn: sampling, gathering, preparation and launch plans) and ``count`` training steps on them
    (backward on this thread too, so that the profile sees it). Prints the functions by own time per side;
    returns each side's host ms per batch. What each side asks of the interpreter lock, with no thread beside it."""
    import cProfile
    import pstats

    loader = iter(make_loader_in_turn())
    next(loader)  # (warm: first-call work)
    made = []

    def make(_: int) -> None:
        made.append(next(loader))

    def train(i: int) -> None:
        loss = F.cross_entropy(forward(made[i]), made[i].y[: made[i].batch_size])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    sides = {}
    for side, work in (("making a batch", make), ("a training step", train)):
        prof = cProfile.Profile()
        harness.synchronize(device)
        start = time.perf_counter()
        with torch.autograd.set_multithreading_enabled(False):
            for i in range(count):
                prof.enable()
                work(i)
                prof.disable()
        harness.synchronize(device)
        ms = (time.perf_counter() - start) / count * 1e3
        sides[side] = ms
        rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        proc.print(f"  {name}: {side}, {count} under cProfile: {ms:.2f} ms of host time each; functions by own time "
                   f"(ms per batch):")
        for (path, line, func), (_, calls, own, cumulative, _) in rows:
            proc.print(f"    {own / count * 1e3:7.3f} own {cumulative / count * 1e3:7.3f} cum {calls / count:7.1f} "
                       f"calls  {func} ({path.rsplit('/', 1)[-1]}:{line})")
    optimizer.zero_grad(set_to_none=True)
    return sides


def profile_batches(train_loader, forward, optimizer, count: int, device: torch.device, name: str,
                    proc: harness.Process, trace: str | None = None) -> tuple[list[dict], list[dict]]:
    """``count`` more training steps (after the measured epochs, so their times are not inflated) under the torch
    profiler: prints the operations that took the most device time (CPU time without a GPU), all threads
    included (the loader's thread too), then per thread its host time and kernel launches per step (which thread
    bounds a step bound by the host). ``trace``: also write the profile there as a Chrome trace (``.json.gz``: the
    timeline of every stream and thread, for what overlaps what). Returns (rows of name, calls and milliseconds per
    step; rows per thread)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps = 0
    prof = profile(activities=activities, **_all_threads())
    try:
        prof.start()
    except Exception as exc:  # (a profiler that refuses to record every thread: the profiling thread then)
        proc.print(f"  {name}: the profiler cannot record every thread here ({type(exc).__name__}: {exc}); "
                   f"profiling the training thread only")
        prof = profile(activities=activities)
        prof.start()
    begin = harness.now(device)
    try:
        for batch in train_loader:
            loss = F.cross_entropy(forward(batch), batch.y[: batch.batch_size])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            if steps == count:
                break
        harness.synchronize(device)
    finally:
        prof.stop()
    wall = time.perf_counter() - begin
    if trace:
        harness.export_trace(prof, trace)

    def device_us(e) -> float:  # (named self_cuda_time_total before torch 2.4)
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) or 0

    time_of = device_us if cuda else (lambda e: e.self_cpu_time_total)
    events = sorted(prof.key_averages(), key=time_of, reverse=True)[:20]
    per = max(steps, 1)
    rows = [{"op": e.key, "calls_per_step": e.count / per, "device_ms_per_step": device_us(e) / 1e3 / per,
             "cpu_ms_per_step": e.self_cpu_time_total / 1e3 / per} for e in events]
    proc.print(f"  {name}: profile of {steps} steps, per step (ops by {'device' if cuda else 'CPU'} time):")
    for r in rows:
        proc.print(f"    {r['op'][:60]:60s} {r['calls_per_step']:7.1f} calls {r['device_ms_per_step']:8.3f} ms device "
                   f"{r['cpu_ms_per_step']:8.3f} ms CPU")
    if cuda:  # (a step bound by the host: where its host time goes, by self CPU time, all threads)
        host = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
        proc.print(f"  {name}: ops by host (self CPU) time per step:")
        for e in host:
            ms = e.self_cpu_time_total / 1e3 / per
            proc.print(f"    {e.key[:60]:60s} {e.count / per:7.1f} calls {ms:8.3f} ms CPU")
    threads, kernel_ms = thread_profile(prof.events(), per)
    proc.print(f"  {name}: per step {wall / per * 1e3:.2f} ms of wall time, {kernel_ms:.2f} ms of kernels (all "
               f"streams); per thread: " + "; ".join(f"{t['thread']} {t['host_ms_per_step']:.2f} ms host, "
                                                    f"{t['launches_per_step']:.0f} launches" for t in threads))
    return rows, threads


def _all_threads() -> dict:
    """The profiler's option to record every thread's operations (the loader's thread, started inside the
    profile, included), where this torch has it; without it only the profiling thread is recorded."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def thread_profile(events, steps: int) -> tuple[list[dict], float]:
    """Per host thread of a profile: what it is (the training thread runs the optimizer, the autograd engine's
    thread the backward pass, the loader's thread the sampling), its host time (its outermost operations) and
    its kernel launches, per step, the busiest first; and the milliseconds of kernels per step (all streams)."""
    from torch.autograd import DeviceType

    threads: dict = {}
    kernel_us = 0.0
    for e in events:
        if e.device_type != DeviceType.CPU:
            if not e.name.startswith(("Memcpy", "Memset")):
                kernel_us += e.time_range.elapsed_us()
            continue
        t = threads.setdefault(e.thread, {"names": set(), "host_us": 0.0, "launches": 0})
        t["names"].add(e.name)
        t["launches"] += e.name in _LAUNCHES
        if e.cpu_parent is None:
            t["host_us"] += e.time_range.elapsed_us()
    rows = []
    for tid, t in threads.items():
        names = t["names"]
        if any(n.startswith("Optimizer.step") for n in names):
            what = "training"
        elif "aten::argsort" in names:  # (the sampler's draw)
            what = "loader"
        elif any(n.startswith("autograd::engine") for n in names):
            what = "backward"
        else:
            what = f"thread {tid}"
        rows.append({"thread": what, "host_ms_per_step": t["host_us"] / 1e3 / steps,
                     "launches_per_step": t["launches"] / steps})
    return sorted(rows, key=lambda r: -r["host_ms_per_step"]), kernel_us / 1e3 / steps


def _gather_status(impl: str, device: torch.device) -> dict | None:
    """pytorch-direct's ``auto`` so far in this process (the toolkit on a GPU only): the plan of its last feature
    gather and the seconds spent measuring, which the epoch times include."""
    if impl != "toolkit" or device.type != "cuda":
        return None
    import pytorch_direct as pd

    return pd.auto_status()


def _status_text(auto: dict) -> str:
    return (f"{auto['strategy']} ({auto['source']}, {auto['order']} indices), {auto['measuring_s']:.2f} s measuring "
            f"so far")


@torch.no_grad()
def evaluate(model, val_loader, forward, proc: harness.Process, total: int) -> float:
    """Accuracy on the held-out nodes (sharded over ranks, summed)."""
    model.eval()
    correct = torch.zeros((), device=proc.device)
    for batch in val_loader:
        correct += (forward(batch).argmax(dim=1) == batch.y[: batch.batch_size]).sum()
    return proc.sum([float(correct)])[0] / max(total, 1)


def configure(args) -> TrainConfig:
    cfg = SIZES[args.size]
    spec = cfg.graph
    overrides = {k: getattr(args, k) for k in ("num_nodes", "feature_dim", "num_train") if getattr(args, k)}
    if args.avg_degree:
        overrides["avg_degree"] = args.avg_degree
    if args.relations:
        overrides["num_relations"] = args.relations
    if args.relation_skew is not None:
        overrides["relation_skew"] = args.relation_skew
    spec = dataclasses.replace(spec, seed=args.seed, **overrides)
    train = {k: getattr(args, k) for k in ("batch_size", "epochs", "hidden", "heads", "lr") if getattr(args, k)}
    if args.fanout:
        train["fanout"] = tuple(int(k) for k in args.fanout.split(","))
    return dataclasses.replace(cfg, graph=spec, **train)


def _ways(text: str, parser, flag: str) -> list[str]:
    ways = [w for w in text.split(",") if w]
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        parser.error(f"{flag}: unknown way(s) {unknown}; choose from {', '.join(WAYS)}")
    return ways


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="preset (default: small with a GPU, tiny without)")
    parser.add_argument("--impl", choices=("both", *IMPLS), default="both",
                        help="which implementation to train: both (default), toolkit or baseline")
    parser.add_argument("--device", default="auto", help="auto (GPU if usable), cpu, cuda")
    parser.add_argument("--topology", choices=("device", "host"), default="device",
                        help="where the sampler reads the graph: device memory, or host memory as unified tensors "
                             "(zero-copy from the GPU), for graphs larger than GPU memory")
    parser.add_argument("--loading", choices=tuple(WAYS), default="thread",
                        help="how both implementations make their batches: by a loader thread on its own CUDA "
                             "stream (default), ahead by the training thread on that stream, in turn, or by the "
                             "loader thread with the sampler's operations called from Python (thread-python)")
    parser.add_argument("--prefetch", type=int, default=1, metavar="K",
                        help="batches made ahead of training by the 'thread' and 'ahead' ways (default 1)")
    parser.add_argument("--baseline-ways", default="", metavar="WAYS",
                        help="also train the baseline these other ways (comma-separated, e.g. inturn), reported as "
                             "baseline-WAY: the toolkit is compared with the fastest")
    parser.add_argument("--toolkit-ways", default="", metavar="WAYS",
                        help="also train the toolkit these other ways, reported as toolkit-WAY")
    parser.add_argument("--toolkit-cache", type=float, default=0.0, metavar="SHARE",
                        help="also train the toolkit with pytorch-direct's GPU cache holding this share of the "
                             "feature table's rows (e.g. 0.15; filled by out-degree), reported as toolkit-cache; "
                             "default 0: not trained")
    parser.add_argument("--compare-loading", "--compare-prefetch", action="store_true", dest="compare_loading",
                        help="also train both implementations the two other ways (-inturn, -ahead, -thread)")
    parser.add_argument("--layer-plans", choices=PLANS, default="ahead",
                        help="where the toolkit builds its hector layers' launch plans for each batch: 'ahead' "
                             "(default): in the loader thread while it is ahead of training, else at the layers' "
                             "first call in the training step; 'loader': always in the loader thread; 'step': "
                             "always in the training step")
    parser.add_argument("--rerun", action="store_true",
                        help="after every other run, train each implementation its default way once more, reported "
                             "as NAME-rerun (the first runs of a fresh process also warm the machine: page "
                             "mappings of the host table, clocks)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the measured epochs, profile this many more training steps of the toolkit's and "
                             "the baseline's default way (torch profiler, the loader's thread included) and print "
                             "the operations taking the most device time (default 0: none)")
    parser.add_argument("--switch-interval-ms", type=float, default=0.0, metavar="MS",
                        help="Python's thread switch interval during training (sys.setswitchinterval; default: "
                             "Python's, 5 ms): how long the training thread may wait for the interpreter lock "
                             "while a loader thread holds it")
    parser.add_argument("--trace-dir", default="", metavar="DIR",
                        help="with --profile: also write each profile's timeline there as a Chrome trace "
                             "(<implementation>.json.gz; open in Perfetto or chrome://tracing)")
    parser.add_argument("--profile-host", type=int, default=0, metavar="BATCHES",
                        help="after the measured epochs, make this many batches and then train on them in the main "
                             "thread under cProfile, each side alone, and print the Python functions taking each "
                             "side's host time (the toolkit's and the baseline's default way; default 0: none)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--seed", type=int, default=0, help='random seed for the graph, weights and batches')
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    group = parser.add_argument_group("overrides of the preset")
    group.add_argument("--num-nodes", type=int, help='nodes in the graph')
    group.add_argument("--avg-degree", type=float, help='average in-degree')
    group.add_argument("--relations", type=int, help="number of relations (edge types), e.g. 1000")
    group.add_argument("--relation-skew", type=float,
                       help="power-law exponent of the relations' edge counts (preset 1.1; 0: equal counts)")
    group.add_argument("--feature-dim", type=int, help='node feature width')
    group.add_argument("--num-train", type=int, help='labelled seed nodes per epoch')
    group.add_argument("--batch-size", type=int, help='seed nodes per mini-batch')
    group.add_argument("--fanout", help="neighbours per hop, e.g. 15,10")
    group.add_argument("--epochs", type=int, help='training epochs')
    group.add_argument("--hidden", type=int, help='hidden width per head')
    group.add_argument("--heads", type=int, help='attention heads')
    group.add_argument("--lr", type=float, help='learning rate (Adam)')
    args = parser.parse_args(argv)
    if args.prefetch < 1:
        parser.error(f"--prefetch must be >= 1 batch (--loading inturn makes them in turn), got {args.prefetch}")
    args.baseline_ways = _ways(args.baseline_ways, parser, "--baseline-ways")
    args.toolkit_ways = _ways(args.toolkit_ways, parser, "--toolkit-ways")
    if not 0 <= args.toolkit_cache <= 1:
        parser.error(f"--toolkit-cache must be a share of the table's rows in [0, 1], got {args.toolkit_cache}")
    if args.size is None:
        args.size = "small" if torch.cuda.is_available() and args.device != "cpu" else "tiny"
    return args


def planned_runs(args, impls) -> list[tuple[str, str, str, float]]:
    """(name in the report, implementation, way, cache share): each implementation the default way under its own
    name, then the other ways asked for as NAME-WAY, then the toolkit with the feature cache as toolkit-cache, then
    (``--rerun``) each implementation its default way again as NAME-rerun."""
    runs = [(impl, impl, args.loading, 0.0) for impl in impls]
    extra = {impl: [] for impl in impls}
    if args.compare_loading:
        for impl in impls:
            extra[impl] += [w for w in LOADING if w != args.loading]
    for impl, asked in (("toolkit", args.toolkit_ways), ("baseline", args.baseline_ways)):
        if impl in extra:
            extra[impl] += [w for w in asked if w != args.loading and w not in extra[impl]]
    runs += [(f"{impl}-{way}", impl, way, 0.0) for impl in impls for way in extra[impl]]
    if args.toolkit_cache and "toolkit" in impls:
        runs.append(("toolkit-cache", "toolkit", args.loading, args.toolkit_cache))
    if args.rerun:
        runs += [(f"{impl}-rerun", impl, args.loading, 0.0) for impl in impls]
    return runs


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = configure(args)
    proc = harness.start(args.device)
    spec = cfg.graph
    impls = IMPLS if args.impl == "both" else (args.impl,)
    runs = planned_runs(args, impls)
    env = harness.environment()
    proc.print(f"GNN training, size {args.size}: {spec.num_nodes:,} nodes, {spec.num_edges:,} edges, "
               f"{spec.num_relations} relations (skew {spec.relation_skew}), {spec.num_classes} classes, features "
               f"{spec.feature_dim} x fp32 ({harness.gib(spec.feature_bytes)} in host memory); {proc.world_size} "
               f"process(es) on {proc.device.type}; {', '.join(f'{n} ({w})' for n, _, w, _ in runs)}")
    proc.print(f"  {harness.describe_host(env)}")

    start = time.perf_counter()
    graph = generate(spec, proc.device)
    if proc.distributed:
        mine = graph.checksum()
        if proc.max(mine) != [-v for v in proc.max([-v for v in mine])]:
            raise SystemExit("the ranks built different graphs (non-deterministic generation on this device)")
    harness.synchronize(proc.device)
    graph_seconds = time.perf_counter() - start
    stats = graph.stats()
    proc.print(f"  graph built in {graph_seconds:.1f} s on {graph.device} (topology "
               f"{harness.gib(stats['topology_bytes'])}, {stats['in_degree_zero_fraction']:.1%} nodes without "
               f"in-edges, max in-degree {stats['in_degree_max']:,})")
    table, shm_added, table_seconds = make_table(proc, graph, show_progress=not args.no_progress)
    copies = None if not proc.distributed or shm_added is None else shm_added / spec.feature_bytes
    proc.print(f"  feature table {tuple(table.shape)} in host memory filled in {table_seconds:.1f} s"
               + (f"; shared memory grew by {harness.gib(shm_added)} = {copies:.2f} copies of the table for "
                  f"{proc.world_size} processes" if copies is not None else ""))
    topology = make_topology(graph, args.topology)

    models = build_models(cfg, args.seed)
    report = {
        "script": "gnn_train", "size": args.size, "world_size": proc.world_size, "device": str(proc.device.type),
        "topology": args.topology, "environment": env,
        "config": {**dataclasses.asdict(cfg), "graph": dataclasses.asdict(spec)}, "graph": stats,
        "graph_seconds": graph_seconds, "table_seconds": table_seconds,
        "shared_memory_added_bytes": shm_added, "host_feature_copies": copies,
        "chance_accuracy": 1.0 / spec.num_classes, "impls": {},
    }

    def save() -> None:  # after each epoch: a run stopped later still leaves its results
        if proc.main:
            harness.write_json(args.json, report)

    failed = []
    for name, impl, way, cache in runs:
        report["impls"][name] = {}
        # each run starts from an emptied device cache: what the run before left (the baseline's 9 GiB of cached
        # blocks) does not shape the next run's allocations
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        try:
            run_impl(impl, copy.deepcopy(models[impl]), cfg, graph, table, topology, proc, args,
                     report["impls"][name], save, way=way, name=name, cache=cache)
        except Exception as exc:
            if not cache or proc.distributed:
                raise
            # the cached run is an extra column: its failure is reported (and fails the script at the end), the
            # comparison of the others still stands
            report["impls"][name]["error"] = f"{type(exc).__name__}: {exc}"
            failed.append(name)
            proc.print(f"  {name} FAILED: {type(exc).__name__}: {exc}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    report["summary"] = summarize(report, proc)
    save()
    harness.finish(proc)
    if failed:
        raise SystemExit(f"gnn_train: {', '.join(failed)} failed (see above); the other runs' results are in the "
                         f"report")
    return report


def make_topology(graph, where: str):
    """The graph's CSC arrays as the sampler reads them: in device memory as built, or (``host``) as
    pytorch-direct unified tensors in host memory, read zero-copy (the device copies are dropped)."""
    from pytorch_direct.sampling import Topology

    if where == "host":
        import pytorch_direct as pd

        for name in ("colptr", "row", "edge_type", "node_type"):
            setattr(graph, name, pd.unified(getattr(graph, name).cpu(), copy=True))
    return Topology(graph.colptr, graph.row, edge_type=graph.edge_type, node_type=graph.node_type)


def mean_epoch(run: dict) -> float:
    return sum(e["time_s"] for e in run["epochs"]) / len(run["epochs"])


def summarize(report: dict, proc: harness.Process) -> dict:
    """Prints the table (mean epoch time, waiting for batches, accuracy) and returns the headline: the toolkit
    against the fastest of the baseline's ways."""
    impls = {k: v for k, v in report["impls"].items() if v.get("epochs")}
    proc.print(f"\n{'':20s} {'epoch s':>9s} {'wait s':>7s} {'wait %':>7s} {'seeds/s':>10s} {'final loss':>10s} "
               f"{'val acc':>8s} {'peak GPU':>10s}")
    for name, r in impls.items():
        last = r["epochs"][-1]
        wait = sum(e["wait_s"] for e in r["epochs"]) / len(r["epochs"])
        proc.print(f"{name:20s} {mean_epoch(r):9.2f} {wait:7.2f} {wait / mean_epoch(r):7.1%} "
                   f"{last['seeds_per_s']:10,.0f} {last['loss']:10.4f} {last['val_acc']:8.3f} "
                   f"{harness.gib(r.get('peak_gpu_bytes')):>10s}")
    # (the preloaded way times training alone, its batches made before the clock: not a way to train)
    baselines = {k: mean_epoch(r) for k, r in impls.items() if k.startswith("baseline") and r["loader"] != "preloaded"}
    if "toolkit" not in impls or not baselines:
        return {}
    best = min(baselines, key=baselines.get)
    toolkit = impls["toolkit"]
    summary = {
        "toolkit_epoch_s": mean_epoch(toolkit), "best_baseline": best, "best_baseline_epoch_s": baselines[best],
        "speedup": baselines[best] / mean_epoch(toolkit),
        "toolkit_wait_fraction": sum(e["wait_s"] for e in toolkit["epochs"]) / sum(e["time_s"] for e in
                                                                                    toolkit["epochs"]),
        "toolkit_val_acc": toolkit["epochs"][-1]["val_acc"], "baseline_val_acc": impls[best]["epochs"][-1]["val_acc"],
        "relations": report["config"]["graph"]["num_relations"],
    }
    proc.print(f"toolkit: {summary['speedup']:.2f}x the speed of the fastest baseline way ({best}), waited for "
               f"batches {summary['toolkit_wait_fraction']:.1%} of its epochs; val acc "
               f"{summary['toolkit_val_acc']:.3f} vs {summary['baseline_val_acc']:.3f} (chance "
               f"{report['chance_accuracy']:.3f})")
    cached = impls.get("toolkit-cache")
    if cached is not None:
        summary["cache_share"] = cached["cache"]["share"]
        summary["cache_epoch_s"] = mean_epoch(cached)
        summary["cache_speedup"] = summary["toolkit_epoch_s"] / summary["cache_epoch_s"]
        proc.print(f"toolkit with the GPU cache ({summary['cache_share']:.0%} of the rows, "
                   f"{cached['cache'].get('hit_rate', 0):.1%} of a batch's rows): {summary['cache_epoch_s']:.2f} s per "
                   f"epoch = {summary['cache_speedup']:.2f}x the toolkit without it")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
