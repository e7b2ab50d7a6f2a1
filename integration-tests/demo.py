"""The toolkit's demo: train a relational GNN on a synthetic twin of a Hector evaluation graph, using all three
packages together, on the GPU when there is one and on the CPU otherwise.

- pytorch-direct: the node-feature table lives in host memory as a unified tensor; every mini-batch gathers its rows
  with the batch's own (CUDA) indices, zero-copy over PCIe, with no CPU gather.
- hector: the model is hector's RGAT layer (compiled IR, compact materialisation, generated backward).
- ssdtrain: each step's hidden activations go through the I/O engine to files in a temporary directory and come back
  checksummed, the path the activation-offload layer uses.
- shared-cuda: the NVRTC JIT loader compiles a kernel (and runs it where there is a GPU).

Run it with `python3 -m nox -s demo`, or `python integration-tests/demo.py` once the packages are installed.
`--tiny` shrinks every size (the tests use it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import hector
import hector.nn as hn
import pytorch_direct as pd
import ssdtrain
from hector import datasets

PACKAGES = (pd, hector, ssdtrain)


def step(title: str) -> float:
    print(f"\n=== {title}", flush=True)
    return time.perf_counter()


def done(start: float, what: str) -> None:
    print(f"    {what} ({time.perf_counter() - start:.2f} s)", flush=True)


def report_builds() -> None:
    start = step("builds and machine")
    for package in PACKAGES:
        print(package._shared_cuda.format_info(package.info()))
    done(start, "three packages imported and reported")


def jit_kernel(device: torch.device, n: int) -> None:
    """Compile a kernel with NVRTC through the shared JIT loader; on a GPU, load and run it and check the result."""
    start = step("shared-cuda: NVRTC JIT compile, cache, load, run")
    core, shared = hector._core, hector._shared_cuda
    if not shared.ensure_nvrtc(core):
        print("    NVRTC not found: skipped (pip install nvidia-cuda-nvrtc)")
        return
    source = r"""
extern "C" __global__ void scale_add(float a, const float* x, float* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""
    if device.type != "cuda":
        cubin = shared.compile_kernel_source(core, source, "scale_add.cu", arch=90)
        done(start, f"compiled for sm_90 on the CPU: {len(cubin)} byte cubin (no GPU to run it)")
        return
    kernel = shared.load_kernel(core, source, "scale_add", "f32, ptr, ptr, i64", name="scale_add.cu")
    x = torch.randn(n, device=device)
    y = torch.randn(n, device=device)
    expected = 3.0 * x + y
    kernel((n + 255) // 256, 256, 3.0, x, y, n)
    torch.cuda.synchronize()
    # NVRTC contracts a*x+y into one fused multiply-add; torch rounds twice: allow one rounding of difference.
    error = ((y - expected).abs() / expected.abs().clamp_min(1.0)).max().item()
    if error > 1e-6:
        raise SystemExit(f"JIT kernel result is wrong: max relative error {error:.3g}")
    done(start, f"ran on {torch.cuda.get_device_name()} over {n} elements, max relative error {error:.2g}")


class Student(nn.Module):
    """hector's RGAT (attention per relation) followed by a linear classifier."""

    def __init__(self, dim: int, hidden: int, heads: int, num_relations: int, classes: int) -> None:
        super().__init__()
        self.conv = hn.RGATConv(dim, hidden, num_relations, heads=heads)
        self.head = nn.Linear(hidden * heads, classes)

    def forward(self, x, edge_index, edge_type):
        hidden = F.elu(self.conv(x, edge_index, edge_type))
        return hidden, self.head(hidden)


def sample_in_edges(graph: datasets.SyntheticGraph, seeds: torch.Tensor):
    """The seeds' in-edges, relabelled to a compact subgraph: (nodes, local edge_index, edge_type, seed positions)."""
    dst = graph.edge_index[1]
    is_seed = torch.zeros(graph.num_nodes, dtype=torch.bool)
    is_seed[seeds] = True
    keep = is_seed[dst]
    src_kept, dst_kept = graph.edge_index[0][keep], dst[keep]
    nodes, local = torch.unique(torch.cat([seeds, src_kept, dst_kept]), return_inverse=True)
    seed_pos = local[: seeds.numel()]
    edge_index = local[seeds.numel():].view(2, -1)
    return nodes, edge_index, graph.edge_type[keep], seed_pos


def train(device: torch.device, args: argparse.Namespace) -> None:
    start = step(f"data: synthetic twin of {args.dataset} (scale {args.scale})")
    twin = datasets.load(args.dataset, scale=args.scale, seed=0)
    stats = twin.stats()
    print(f"    {stats['num_nodes']:,} nodes, {stats['num_edges']:,} edges, {stats['num_relations']} relations, "
          f"edges per unique (source, relation) pair {stats['pair_ratio']:.2f}")
    # The feature table lives in host memory as a unified tensor: the GPU gathers each batch's rows itself.
    table = pd.unified(twin.features(args.dim, seed=1), copy=True)
    # Labels from a fixed random teacher (hector's RGCN over the full graph), so there is something to learn.
    with torch.no_grad():
        teacher = hn.RGCNConv(args.dim, args.classes, twin.num_relations)
        labels = teacher(table.plain(), twin.edge_index, twin.edge_type).argmax(dim=1)
    done(start, f"feature table {tuple(table.shape)} {table.dtype} in host memory "
                f"({table.numel() * table.element_size() / 2**20:.1f} MiB), labels from a teacher RGCN")

    model = Student(args.dim, args.hidden, args.heads, twin.num_relations, args.classes).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(0)
    start = step(f"train: hector RGAT, {args.epochs} epochs of {args.batches} mini-batches of {args.batch_size} "
                 f"seeds on {device}")
    offload_dir = tempfile.TemporaryDirectory(prefix="ssdtrain-demo-")
    accuracy_first = accuracy_last = 0.0
    gathered_bytes = 0
    with ssdtrain.Engine([offload_dir.name], capacity_per_directory="1G", checksum=True) as engine:
        for epoch in range(args.epochs):
            correct = seen = 0
            total_loss = 0.0
            for _ in range(args.batches):
                seeds = torch.randperm(twin.num_nodes, generator=generator)[: args.batch_size]
                nodes, edge_index, edge_type, seed_pos = sample_in_edges(twin, seeds)
                # pytorch-direct: CUDA indices -> rows gathered by the GPU straight from host memory.
                x = table[nodes.to(device)]
                gathered_bytes += x.numel() * x.element_size()
                hidden, logits = model(x, edge_index.to(device), edge_type.to(device))
                # ssdtrain: the step's activations go to disk and come back checksummed.
                handle = engine.write(hidden.detach()).handle
                restored = engine.read(handle).result()
                if not torch.equal(restored, hidden.detach()):
                    raise SystemExit("ssdtrain returned different activations")
                engine.free(handle)
                target = labels[seeds].to(device)
                loss = F.cross_entropy(logits[seed_pos.to(device)], target)
                optimizer.zero_grad()
                loss.backward()  # hector's generated backward program
                optimizer.step()
                total_loss += loss.item()
                correct += int((logits[seed_pos.to(device)].argmax(1) == target).sum())
                seen += target.numel()
            accuracy = correct / seen
            accuracy_first = accuracy if epoch == 0 else accuracy_first
            accuracy_last = accuracy
            print(f"    epoch {epoch + 1}: loss {total_loss / args.batches:.3f}, accuracy {accuracy:.3f}", flush=True)
        io = engine.stats()
        backend = f"{engine.backend_name} ({engine.backend_detail})"
    offload_dir.cleanup()
    done(start, f"trained; gathered {gathered_bytes / 2**20:.1f} MiB of features from host memory")
    print(f"    ssdtrain: {io['bytes_written'] / 2**20:.1f} MiB written and read back through {backend}")
    if args.epochs > 1 and accuracy_last <= accuracy_first:
        raise SystemExit(f"the model did not learn: accuracy {accuracy_first:.3f} -> {accuracy_last:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (seconds on a CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dataset", default="aifb", choices=sorted(datasets.SPECS))
    parser.add_argument("--scale", type=float, default=None, help="graph size relative to the original")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None, help="mini-batches per epoch")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args(argv)
    defaults = {"scale": 0.2, "epochs": 3, "batches": 4, "batch_size": 256} if args.tiny else \
        {"scale": 1.0, "epochs": 5, "batches": 10, "batch_size": 1024}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"demo on {device} (torch {torch.__version__})")
    report_builds()
    jit_kernel(device, n=1 << (12 if args.tiny else 24))
    train(device, args)
    print("\ndemo finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
