"""Mini-batch training of a 2-layer relational GNN (RGAT) on a large synthetic heterogeneous graph whose node
features live in host memory, the toolkit's way beside the plain PyTorch/PyG way, on the same data, seeds and
sampled mini-batches.

toolkit:  the feature table is a pytorch-direct unified tensor; each batch's rows are gathered by the GPU straight
          from host memory (zero-copy, indices never leave the GPU); the layers are hector's RGATConv (compiled).
baseline: the same host table read by the CPU (torch index_select into a pinned buffer, then an asynchronous copy
          to the GPU: the strongest plain-PyTorch path); the layers are PyG's RGATConv.

Both start from the same weights (hector's RGATConv with attention="shared" is PyG's formula with PyG's parameter
names) and see the same batches, so their losses and accuracies should agree and only the time differs. Both load
the same way (loader.py): by default each batch is made one ahead on the loader's CUDA stream by the training
thread; the toolkit also prepares the batch graph for hector there (hector.prepare_graph).

    python integration-tests/gnn_train.py --size tiny                     # CPU, seconds
    python integration-tests/gnn_train.py --size large --json out.json    # one GPU
    torchrun --nproc-per-node=2 integration-tests/gnn_train.py --size large --impl toolkit   # DDP, one GPU each

With several processes, the host copy of the feature table is made once per machine (POSIX shared memory, through
pytorch-direct) and mapped by every process; each rank trains on its own share of the seeds (DDP).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
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
from loader import BatchLoader
from sampling import NeighborSampler, PygSampler, SampledSubgraph

IMPLS = ("toolkit", "baseline")


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


class FeatureSource:
    """Gathers a batch's feature rows onto the training device: the toolkit's zero-copy gather, or the CPU gather
    into a pinned buffer followed by a copy."""

    def __init__(self, table, impl: str, device: torch.device) -> None:
        self.table, self.impl, self.device = table, impl, device
        self.plain = table.plain()
        self._buffer: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def __call__(self, n_id: torch.Tensor) -> torch.Tensor:
        if self.impl == "toolkit":
            # CUDA indices: the GPU reads the rows from host memory itself. CPU indices: pytorch-direct's threads.
            return self.table[n_id]
        index = n_id.cpu()  # the CPU needs the indices: a device -> host copy and a wait
        if self.device.type != "cuda":
            return self.plain.index_select(0, index)
        rows = index.numel()
        if self._buffer is None or self._buffer.size(0) < rows:
            self._buffer = torch.empty(int(rows * 1.25) + 1, self.plain.size(1), dtype=self.plain.dtype,
                                       pin_memory=True)
        if self._copied is not None:
            self._copied.synchronize()  # the previous batch's copy has left the buffer
        staged = torch.index_select(self.plain, 0, index, out=self._buffer[:rows])
        x = staged.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return x


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


def epoch_batches(train_idx: torch.Tensor, batch_size: int, epoch: int, seed: int, proc: harness.Process):
    """This rank's seed batches for an epoch: one shuffled order shared by all ranks, dealt round robin; every rank
    gets the same number of full batches (DDP steps together). On the training device: one copy per epoch, not a
    copy from pageable host memory per batch (each of which waits for the GPU to finish the work queued before)."""
    gen = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = train_idx.cpu()[torch.randperm(train_idx.numel(), generator=gen)]
    per_rank = train_idx.numel() // (batch_size * proc.world_size)
    mine = order[: per_rank * batch_size * proc.world_size].view(-1, batch_size)[proc.rank::proc.world_size]
    return list(mine.to(proc.device))


def run_impl(impl: str, model: nn.Module, cfg: TrainConfig, graph, table, sampler_factory, proc: harness.Process,
             args, result: dict, save=lambda: None, ahead: int = 0, thread: bool = False,
             name: str | None = None) -> None:
    """Train ``impl`` with batches made ``ahead`` of training (0: in turn), by the training thread or a loader
    ``thread`` (loader.py); fills ``result`` (epochs as they finish, then peak memory) and calls ``save`` after each
    epoch. ``name`` labels the progress output (default: ``impl``)."""
    name = name or impl
    device = proc.device
    result["ahead"], result["loader"] = ahead, loader_mode(ahead, thread)
    model = model.to(device)
    if proc.distributed:
        # static_graph: every step uses the same parameters, so DDP can skip re-tracing which ones took part
        # (H200 probe E13, 2 ranks: 205-209K vs 179-211K seeds/s with the defaults)
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        static_graph=True, gradient_as_bucket_view=True)
    params = [p for p in model.parameters() if p.requires_grad]
    # fused on a GPU (both implementations): one kernel for all parameters instead of the foreach implementation's
    # several; its step took ~0.6 ms of the host's time (H200 profile E17) in a step bound by the host
    optimizer = torch.optim.Adam(params, lr=cfg.lr, fused=device.type == "cuda")
    features = FeatureSource(table, impl, device)
    labels = graph.labels
    sampler = sampler_factory()

    # The toolkit prepares each batch's graph for hector before queueing the gather: hector's preprocessing reads
    # a few sizes on the host, and done inside the first layer that read would wait for the gather to finish. The
    # graph is made on the loader's stream and used on the training stream (record_stream, as for the batch).
    prepare_graph = None
    if impl == "toolkit":
        import hector

        prepare_graph = hector.prepare_graph
    num_relations = cfg.graph.num_relations
    training_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def make_batch(seeds: torch.Tensor, timer: harness.PhaseTimes) -> tuple[SampledSubgraph, torch.Tensor]:
        timer.phase("sample")
        sub = sampler.sample(seeds)
        if prepare_graph is not None:
            graph = prepare_graph(sub.edge_index, sub.edge_type, sub.n_id.numel(), num_relations)
            if training_stream is not None:
                graph.record_stream(training_stream)
        timer.phase("gather")
        return sub, features(sub.n_id)

    def forward(sub: SampledSubgraph, x: torch.Tensor) -> torch.Tensor:
        return model(x, sub.edge_index, sub.edge_type)[: sub.batch_size]

    loader_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def loader(seed_batches, timer: harness.PhaseTimes) -> BatchLoader:
        return BatchLoader(make_batch, seed_batches, ahead=ahead, thread=thread, device=device, timer=timer,
                           stream=loader_stream)

    # Warm-up: kernel compilation, allocator, page mapping; gradients dropped, weights unchanged. Through the
    # loader, so its thread and stream are warm too.
    model.train()
    warmup = epoch_batches(graph.train_idx, cfg.batch_size, -1, args.seed, proc)[: cfg.warmup_batches]
    with loader(warmup, harness.PhaseTimes(device)) as batches:
        for sub, x in batches:
            F.cross_entropy(forward(sub, x), labels[sub.n_id[: sub.batch_size]]).backward()
            optimizer.zero_grad(set_to_none=True)
    harness.reset_peak_memory(device)

    epochs = result.setdefault("epochs", [])
    for epoch in range(cfg.epochs):
        model.train()
        batches = epoch_batches(graph.train_idx, cfg.batch_size, epoch, args.seed, proc)
        timer = harness.PhaseTimes(device)
        losses = []
        edges = 0
        bar = harness.progress(len(batches), f"{name} epoch {epoch + 1}/{cfg.epochs}",
                               proc.main and not args.no_progress)
        begin = harness.now(device)
        with loader(batches, timer) as made:
            for sub, x in made:
                timer.phase("compute")
                edges += sub.num_edges
                loss = F.cross_entropy(forward(sub, x), labels[sub.n_id[: sub.batch_size]])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
                bar.update(1)
            timer.stop()
            elapsed = harness.now(device) - begin
        bar.close()
        phases = timer.totals()
        if made.loader_timer is not timer:  # the loader's busy time, on its own stream or thread
            phases.update({f"loader_{k}": v for k, v in made.loader_timer.totals().items()})
        batch_losses = [v / proc.world_size for v in proc.sum(torch.stack(losses).tolist())]
        seeds_total, edges_total = proc.sum([len(batches) * cfg.batch_size, edges])
        elapsed = proc.max([elapsed])[0]
        val_acc = evaluate(model, graph, sampler, features, forward, cfg, proc)
        record = {
            "epoch": epoch + 1, "time_s": elapsed, "seeds_per_s": seeds_total / elapsed,
            "edges_per_s": edges_total / elapsed, "loss": sum(batch_losses) / len(batch_losses),
            "val_acc": val_acc, **{f"{k}_s": v for k, v in phases.items()}, "batch_losses": batch_losses,
        }
        auto = _gather_status(features)
        if auto is not None:
            record["feature_gather"] = auto
        epochs.append(record)
        result["batches_per_epoch_per_rank"] = len(batches)
        save()
        proc.print(f"  {name:8s} epoch {epoch + 1}: {elapsed:7.2f} s  {record['seeds_per_s']:10,.0f} seeds/s  "
                   f"loss {record['loss']:.4f}  val acc {val_acc:.3f}  "
                   f"({_phase_text(phases)})" + (f" [gather: {_status_text(auto)}]" if auto else ""))
    peak = harness.peak_memory(device)
    result["peak_gpu_bytes"] = proc.max([peak])[0] if peak is not None else None
    save()


def _gather_status(features: FeatureSource) -> dict | None:
    """pytorch-direct's ``auto`` so far in this process (the toolkit on a GPU only): the plan of its last feature
    gather and the seconds spent measuring, which the epoch times include."""
    if features.impl != "toolkit" or features.device.type != "cuda":
        return None
    import pytorch_direct as pd

    return pd.auto_status()


def _status_text(auto: dict) -> str:
    return (f"{auto['strategy']} ({auto['source']}, {auto['order']} indices), {auto['measuring_s']:.2f} s measuring "
            f"so far")


def _phase_text(phases: dict[str, float]) -> str:
    """'sample 0.74 s, gather 0.30 s, compute 1.36 s' (the CPU, in turn) or 'wait 0.02 s, compute 1.40 s; loader:
    sample 0.80 s, gather 0.33 s' (on a GPU, or with a loader thread: the loader's phases on its own stream)."""
    mine = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items() if not k.startswith("loader_"))
    theirs = ", ".join(f"{k[len('loader_'):]} {v:.2f} s" for k, v in phases.items() if k.startswith("loader_"))
    return mine + (f"; loader: {theirs}" if theirs else "")


@torch.no_grad()
def evaluate(model, graph, sampler, features, forward, cfg: TrainConfig, proc: harness.Process) -> float:
    """Accuracy on the held-out nodes (sharded over ranks, summed)."""
    model.eval()
    val = graph.val_idx[proc.rank::proc.world_size]
    correct = torch.zeros((), device=proc.device)
    for lo in range(0, val.numel(), cfg.batch_size):
        sub = sampler.sample(val[lo: lo + cfg.batch_size])
        pred = forward(sub, features(sub.n_id)).argmax(dim=1)
        correct += (pred == graph.labels[sub.n_id[: sub.batch_size]]).sum()
    total_correct, total = proc.sum([float(correct), val.numel()])
    return total_correct / max(total, 1)


def configure(args) -> TrainConfig:
    cfg = SIZES[args.size]
    spec = cfg.graph
    overrides = {k: getattr(args, k) for k in ("num_nodes", "feature_dim", "num_train") if getattr(args, k)}
    if args.avg_degree:
        overrides["avg_degree"] = args.avg_degree
    spec = dataclasses.replace(spec, seed=args.seed, **overrides)
    train = {k: getattr(args, k) for k in ("batch_size", "epochs", "hidden", "heads", "lr") if getattr(args, k)}
    if args.fanout:
        train["fanout"] = tuple(int(k) for k in args.fanout.split(","))
    return dataclasses.replace(cfg, graph=spec, **train)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="preset (default: small with a GPU, tiny without)")
    parser.add_argument("--impl", choices=("both", *IMPLS), default="both")
    parser.add_argument("--device", default="auto", help="auto (GPU if usable), cpu, cuda")
    parser.add_argument("--sampler", choices=("ours", "pyg"), default="ours",
                        help="ours: built-in, on the training device; pyg: PyG's neighbour sampler (needs pyg-lib)")
    parser.add_argument("--topology", choices=("device", "host"), default="device",
                        help="where the sampler reads the graph: device memory, or host memory as unified tensors "
                             "(zero-copy from the GPU), for graphs larger than GPU memory")
    parser.add_argument("--prefetch", type=int, default=1, metavar="K",
                        help="mini-batches sampled and gathered ahead of training, for both implementations, on "
                             "a GPU on the loader's own CUDA stream (default 1; 0: each batch made when training "
                             "asks for it). By the training thread itself unless --loader-thread (loader.py)")
    parser.add_argument("--loader-thread", action="store_true",
                        help="make the batches ahead in a background thread (competes with training for the "
                             "interpreter lock: RESULTS.md)")
    parser.add_argument("--compare-prefetch", action="store_true",
                        help="also train both implementations the two other ways of in turn (-inturn), ahead by "
                             "the training thread (-ahead) and ahead by a loader thread (-thread)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    group = parser.add_argument_group("overrides of the preset")
    group.add_argument("--num-nodes", type=int)
    group.add_argument("--avg-degree", type=float)
    group.add_argument("--feature-dim", type=int)
    group.add_argument("--num-train", type=int)
    group.add_argument("--batch-size", type=int)
    group.add_argument("--fanout", help="neighbours per hop, e.g. 15,10")
    group.add_argument("--epochs", type=int)
    group.add_argument("--hidden", type=int)
    group.add_argument("--heads", type=int)
    group.add_argument("--lr", type=float)
    args = parser.parse_args(argv)
    if args.prefetch < 0:
        parser.error(f"--prefetch must be >= 0 batches, got {args.prefetch}")
    if args.loader_thread and not args.prefetch:
        parser.error("--loader-thread needs --prefetch of at least 1 batch")
    if args.size is None:
        args.size = "small" if torch.cuda.is_available() and args.device != "cpu" else "tiny"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = configure(args)
    proc = harness.start(args.device)
    spec = cfg.graph
    impls = IMPLS if args.impl == "both" else (args.impl,)
    ahead, thread = args.prefetch, args.loader_thread
    # (name in the report, implementation, batches made ahead, by a loader thread)
    runs = [(impl, impl, ahead, thread) for impl in impls]
    if args.compare_prefetch:  # the two other ways too
        k = max(1, ahead)
        ways = {"inturn": (0, False), "ahead": (k, False), "thread": (k, True)}
        default = "inturn" if not ahead else "thread" if thread else "ahead"
        runs += [(f"{impl}-{way}", impl, *ways[way]) for way in ways if way != default for impl in impls]
    proc.print(f"GNN training, size {args.size}: {spec.num_nodes:,} nodes, {spec.num_edges:,} edges, "
               f"{spec.num_relations} relations, {spec.num_classes} classes, features {spec.feature_dim} x fp32 "
               f"({harness.gib(spec.feature_bytes)} in host memory); {proc.world_size} process(es) on "
               f"{proc.device.type}; {', '.join(name for name, *_ in runs)}; batches made "
               + loader_mode(ahead, thread))

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

    topology = _host_topology(graph) if args.topology == "host" else graph

    def sampler_factory():
        if args.sampler == "pyg":
            return PygSampler(topology.colptr, topology.row, topology.edge_type, list(cfg.fanout),
                              node_type=topology.node_type, device=proc.device, seed=args.seed)
        gen = torch.Generator(proc.device).manual_seed(args.seed + 7)
        return NeighborSampler(topology.colptr, topology.row, topology.edge_type, list(cfg.fanout),
                               node_type=topology.node_type, device=proc.device, generator=gen)

    models = build_models(cfg, args.seed)
    report = {
        "script": "gnn_train", "size": args.size, "world_size": proc.world_size, "device": str(proc.device.type),
        "sampler": args.sampler, "topology": args.topology, "environment": harness.environment(),
        "config": {**dataclasses.asdict(cfg), "graph": dataclasses.asdict(spec)}, "graph": stats,
        "graph_seconds": graph_seconds, "table_seconds": table_seconds,
        "shared_memory_added_bytes": shm_added, "host_feature_copies": copies,
        "chance_accuracy": 1.0 / spec.num_classes, "impls": {},
    }

    def save() -> None:  # after each epoch: a run stopped later still leaves its results
        if proc.main:
            harness.write_json(args.json, report)

    for name, impl, ahead, thread in runs:
        report["impls"][name] = {}
        run_impl(impl, copy.deepcopy(models[impl]), cfg, graph, table, sampler_factory, proc, args,
                 report["impls"][name], save, ahead=ahead, thread=thread, name=name)
    summarize(report, proc)
    harness.finish(proc)
    return report


def loader_mode(ahead: int, thread: bool) -> str:
    if not ahead:
        return "in turn"
    return f"{ahead} ahead by a loader thread" if thread else f"{ahead} ahead by the training thread"


def _host_topology(graph):
    """The CSC arrays as pytorch-direct unified tensors in host memory (read zero-copy by the sampler); the device
    copies are dropped."""
    import pytorch_direct as pd

    moved = {}
    for name in ("colptr", "row", "edge_type", "node_type"):
        moved[name] = pd.unified(getattr(graph, name).cpu(), copy=True)
        setattr(graph, name, moved[name])
    return graph


def summarize(report: dict, proc: harness.Process) -> None:
    impls = {k: v for k, v in report["impls"].items() if v.get("epochs")}
    proc.print(f"\n{'':20s} {'epoch s':>9s} {'seeds/s':>10s} {'final loss':>10s} {'val acc':>8s} {'peak GPU':>10s}")
    for impl, r in impls.items():
        last = r["epochs"][-1]
        mean = sum(e["time_s"] for e in r["epochs"]) / len(r["epochs"])
        proc.print(f"{impl:20s} {mean:9.2f} {last['seeds_per_s']:10,.0f} {last['loss']:10.4f} {last['val_acc']:8.3f} "
                   f"{harness.gib(r.get('peak_gpu_bytes')):>10s}")
    mean = {k: sum(e["time_s"] for e in r["epochs"]) / len(r["epochs"]) for k, r in impls.items()}
    for baseline in [k for k in mean if k.startswith("baseline")]:
        if "toolkit" in mean:
            proc.print(f"toolkit epoch time: {mean[baseline] / mean['toolkit']:.2f}x faster than {baseline} "
                       f"(chance accuracy {report['chance_accuracy']:.3f})")


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
