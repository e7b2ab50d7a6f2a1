"""The GPU cache of hot rows (``pd.cached``) against the uncached ``auto`` gather, on skewed and uniform streams.

    python3 pytorch-direct/benchmarks/cache.py                       # 16 GiB table of 256 B rows
    python3 pytorch-direct/benchmarks/cache.py --table-gib 32 --row-bytes 512 --csv cache.csv

Streams (each a list of --batches index tensors on the GPU):
  zipfS      --count rows per batch, rank r drawn with probability ~ 1/r**S, ranks spread over the table
  uniform    --count random rows per batch (a cache cannot help: it must not hurt)
  sampled    degree-skewed sampled mini-batches: node degrees follow a power law (rank-frequency exponent
             --degree-s); each batch is --seeds random seed nodes plus, for each fanout, that many neighbours per
             node of the previous hop, a neighbour drawn with probability proportional to its degree (as in a
             random graph with that degree sequence); the gathered rows are the batch's distinct nodes in no
             particular order. A stand-in for a GNN loader's batches, made without a graph in memory.

Cache sizes: --fractions of the table's rows (as WholeGraph's cache ratio), the budget given to pd.cached being
those rows plus what the cache needs beside them (its slot map: 4 bytes per table row, 8 when counting); with
--budget-of bytes, the fraction of the table's bytes instead, everything included. The device bytes used are
reported either way.

Frequency estimates the cache is filled from:
  degree     the true distribution (the Zipf probabilities; the sampled stream's node degrees)
  presample  pd.count_rows over --batches batches of the same stream drawn with another seed
  counts     count=True: the cache counts the rows of --batches batches drawn with a third seed (earlier training
             steps), then refill()
The rows seen by presample and counts fill a small part of the budget; the rest is topped up from the degree
estimate (--top-up degree, the default: a GNN user has the graph's degrees; --top-up none: the rows seen only).

Columns: useful GB/s (rows * row bytes / seconds for one pass over the batches, synchronised, best of --repeats
after a warm-up pass; auto's decisions forgotten before each configuration), the share of rows the cache held
(hit), and the rows equal to the uncached gather's (exact). Target: cached >= 2x uncached auto on zipf0.8/1.1/1.3
and sampled at 5% and 20%; uniform no slower. Prints a table, writes CSV.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

import torch

import pytorch_direct as pd
from pytorch_direct import _auto, _cache, _features, _memory


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table-gib", type=float, default=16.0, help='size of the unified table in GiB')
    p.add_argument("--row-bytes", type=int, default=256, help='bytes per row')
    p.add_argument("--streams", nargs="+", default=["zipf0.8", "zipf1.1", "zipf1.3", "sampled", "uniform"],
                   help='index streams to gather: zipfS (Zipf exponent S), sampled (degree-skewed neighbour batches),'
                        ' uniform')
    p.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.2],
                   help='cache sizes as fractions of the table rows')
    p.add_argument("--budget-of", choices=["rows", "bytes"], default="rows",
                   help="the fractions are of the table's rows (default) or of its bytes (slot map included)")
    p.add_argument("--estimates", nargs="+", default=["degree", "presample", "counts"],
                   choices=["degree", "presample", "counts"],
                   help="frequency estimates that fill the cache: node degree, a pre-sampling pass, counts gathered "
                        "while running")
    p.add_argument("--count", type=int, default=1 << 20, help="rows per batch of the zipf and uniform streams")
    p.add_argument("--batches", type=int, default=8, help='batches per stream')
    p.add_argument("--seeds", type=int, default=1024, help="seed nodes per sampled batch")
    p.add_argument("--fanouts", type=int, nargs="+", default=[15, 10], help='neighbours per hop for the sampled stream')
    p.add_argument("--top-up", choices=["degree", "none"], default="degree",
                   help="what fills the budget a pre-sampling pass or the counts leave: the degree estimate, or "
                        "nothing (the rows they saw only)")
    p.add_argument("--degree-s", type=float, default=0.9, help="rank-frequency exponent of the node degrees")
    p.add_argument("--repeats", type=int, default=3, help='timed repetitions per cell (best kept)')
    p.add_argument("--device", default="cuda", help='CUDA device to run on')
    p.add_argument("--csv", default=None, help='also write every row to this CSV file')
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------- streams


def zipf_probabilities(rows: int, s: float, device) -> torch.Tensor:
    """P(row) of the zipf stream (``_features.synthetic_indices``): rank r has mass ~ the integral of 1/x**s over
    [r + 1, r + 2), each rank at its row."""
    r = torch.arange(rows, device=device, dtype=torch.float64)
    if abs(s - 1.0) < 1e-9:
        mass = torch.log(r + 2) - torch.log(r + 1)
    else:
        mass = ((r + 2) ** (1 - s) - (r + 1) ** (1 - s)) / (1 - s)
    prob = torch.empty(rows, device=device, dtype=torch.float32)
    prob[_features.zipf_rows(torch.arange(rows, device=device), rows)] = (mass / mass.sum()).float()
    return prob


def node_degrees(rows: int, s: float, device) -> torch.Tensor:
    """A power-law degree sequence (degree of rank r ~ 1/(r+1)**s, mean about 10), spread over the rows."""
    r = torch.arange(rows, device=device, dtype=torch.float64)
    weight = 1.0 / (r + 1) ** s
    degree = torch.clamp(torch.round(weight * (10.0 * rows / weight.sum())), min=1).float()
    out = torch.empty(rows, device=device, dtype=torch.float32)
    out[_features.zipf_rows(torch.arange(rows, device=device), rows)] = degree
    return out


def sampled_batches(degree: torch.Tensor, args, seed: int) -> list[torch.Tensor]:
    """Distinct nodes of sampled mini-batches: seeds, then per fanout that many neighbours per node of the previous
    hop, each neighbour drawn with probability proportional to its degree (inverse CDF)."""
    g = torch.Generator(device=degree.device).manual_seed(seed)
    cdf = torch.cumsum(degree.double(), 0)
    total = float(cdf[-1])
    rows = degree.numel()
    out = []
    for _ in range(args.batches):
        frontier = torch.randint(0, rows, (args.seeds,), device=degree.device, generator=g)
        nodes = [frontier]
        for fanout in args.fanouts:
            u = torch.rand(frontier.numel() * fanout, device=degree.device, generator=g, dtype=torch.float64)
            frontier = torch.searchsorted(cdf, u * total).clamp_(max=rows - 1)
            nodes.append(frontier)
        distinct = torch.unique(torch.cat(nodes))
        out.append(distinct[torch.randperm(distinct.numel(), device=degree.device, generator=g)])
    return out


def stream(name: str, rows: int, args, seed: int, degree: torch.Tensor | None) -> list[torch.Tensor]:
    g = torch.Generator(device=args.device).manual_seed(seed)
    if name == "sampled":
        return sampled_batches(degree, args, seed)
    if name == "uniform":
        return [_features.synthetic_indices("uniform", args.count, rows, g) for _ in range(args.batches)]
    if name.startswith("zipf"):
        s = float(name[4:])
        return [_features.synthetic_indices("zipf", args.count, rows, g, zipf_s=s) for _ in range(args.batches)]
    raise SystemExit(f"unknown stream {name!r}: zipfS, uniform or sampled")


def true_frequency(name: str, rows: int, args, degree) -> torch.Tensor:
    if name == "sampled":
        return degree
    if name == "uniform":
        return torch.ones(rows, device=args.device)
    return zipf_probabilities(rows, float(name[4:]), args.device)


# ---------------------------------------------------------------------------------------------------- timing


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def pass_seconds(table, batches, repeats: int) -> float:
    """Best of `repeats` passes over the batches (after one warm-up pass), synchronised around each."""
    def one():
        sync(batches[0].device)
        t0 = time.perf_counter()
        for idx in batches:
            pd.gather(table, idx)
        sync(batches[0].device)
        return time.perf_counter() - t0

    one()
    return min(one() for _ in range(max(1, repeats)))


def run(args, results: list[dict]) -> None:
    if torch.device(args.device).type == "cuda" and not (torch.cuda.is_available() and pd.cuda_usable()):
        raise SystemExit("cache.py needs a CUDA GPU and pytorch_direct built with CUDA (--device cpu: a smoke run)")
    rb = args.row_bytes
    nbytes = int(args.table_gib * 2**30) // rb * rb
    rows = nbytes // rb
    torch.zeros(1, device=args.device)  # (CUDA's start-up is not the table's)
    t0 = time.perf_counter()
    dtype = torch.float32 if rb % 4 == 0 else torch.uint8
    table = pd.empty(rows, rb // dtype.itemsize if dtype == torch.float32 else rb, dtype=dtype)
    made_s = time.perf_counter() - t0
    with torch._C.DisableTorchFunctionSubclass():
        flat = table.view(-1).view(torch.uint8)
        flat[:: 1 << 12].copy_((torch.arange(flat[:: 1 << 12].numel()) % 251 + 1).to(torch.uint8))  # non-zero rows
    where = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"
    kind = _memory.host_kind(table.plain()) or "pageable"
    print(f"# device: {where} | table {nbytes / 2**30:.1f} GiB of {rb} B rows ({rows} rows, {kind} memory, made in "
          f"{made_s:.1f} s, a byte of each 4 KiB page written in {time.perf_counter() - t0 - made_s:.1f} s more)",
          flush=True)
    degree = node_degrees(rows, args.degree_s, args.device) if "sampled" in args.streams else None
    for name in args.streams:
        batches = stream(name, rows, args, seed=1, degree=degree)
        moved = sum(b.numel() for b in batches) * rb
        _auto.reset(delete_file=True)
        base = pass_seconds(table, batches, args.repeats)
        reference = [pd.gather(table, b) for b in batches[:2]]
        base_choice = _auto.last_decision().plan.strategy if _auto.last_decision() else "?"
        print(f"# {name}: {len(batches)} batches, {moved / len(batches) / 1e6:.1f} MB each; uncached auto "
              f"{moved / base / 1e9:.2f} GB/s ({base_choice})", flush=True)
        for fraction in args.fractions:
            for estimate in args.estimates:
                if name == "uniform" and estimate != "degree":
                    continue  # (every estimate of a uniform stream is noise)
                if args.budget_of == "bytes":
                    budget = int(fraction * nbytes)
                else:
                    beside = rows * 4 * (2 if estimate == "counts" else 1) + _cache.SLACK
                    budget = beside + int(fraction * rows) * (rb + 8)
                # The budget a pass or the counts leave (they see a small part of the table) is topped up from
                # the degree estimate (--top-up degree), as a GNN user has the graph's degrees at hand.
                top_up = true_frequency(name, rows, args, degree) if args.top_up == "degree" else None
                t1 = time.perf_counter()
                if estimate == "degree":
                    cache = pd.cached(table, budget, frequency=true_frequency(name, rows, args, degree),
                                      device=args.device)
                elif estimate == "presample":
                    cache = pd.cached(table, budget, frequency=pd.count_rows(stream(name, rows, args, 2, degree),
                                                                            rows), top_up=top_up, device=args.device)
                else:
                    cache = pd.cached(table, budget, count=True, top_up=top_up, device=args.device)
                    for b in stream(name, rows, args, 3, degree):  # earlier training steps' batches
                        pd.gather(table, b)
                    cache.refill()
                sync(args.device)
                fill_s = time.perf_counter() - t1
                _auto.reset(delete_file=True)
                seconds = pass_seconds(table, batches, args.repeats)
                pairs = zip(batches[:2], reference, strict=True)
                exact = all(torch.equal(pd.gather(table, b), ref) for b, ref in pairs)
                hit = sum(cache.hit_rate(b) * b.numel() for b in batches) / sum(b.numel() for b in batches)
                row = {"stream": name, "fraction": fraction, "estimate": estimate, "row_bytes": rb,
                       "table_gib": nbytes / 2**30, "uncached_gbps": moved / base / 1e9,
                       "cached_gbps": moved / seconds / 1e9, "speedup": base / seconds, "hit": hit,
                       "rows_cached": cache.cached_rows / rows, "device_bytes": cache.bytes,
                       "bytes_of_table": cache.bytes / nbytes, "exact": exact, "fill_s": fill_s,
                       "choice": _auto.last_decision().plan.strategy if _auto.last_decision() else "?",
                       "uncached_choice": base_choice, "from_frequency": cache.filled_from["frequency"] / rows,
                       "from_top_up": cache.filled_from["top_up"] / rows}
                results.append(row)
                print(f"  {name:9} {fraction:5.0%} {estimate:9} hit {hit:6.1%} ({row['rows_cached']:.1%} of rows "
                      f"cached in {row['bytes_of_table']:.1%} of the table's bytes; {row['from_frequency']:.1%} "
                      f"from the estimate, {row['from_top_up']:.1%} from the top-up) {row['cached_gbps']:7.2f} GB/s = "
                      f"{row['speedup']:5.2f}x uncached ({row['choice']}, exact {exact}, fill {fill_s:.1f} s)",
                      flush=True)
                cache.release()
                del cache
        del batches, reference


def summary(results: list[dict]) -> None:
    if not results:
        return
    print("\n## GPU cache vs uncached auto (useful GB/s; cache = the fraction asked for; rows, bytes = rows cached and "
          "device bytes used, as fractions of the table's;\n## hit = rows served by the cache; speedup = cached / "
          "uncached)")
    print(f"{'stream':9} {'cache':>5} {'estimate':9} {'rows':>6} {'bytes':>6} {'hit':>6} {'uncached':>8} {'cached':>8} "
          f"{'speedup':>7} exact")
    for r in results:
        print(f"{r['stream']:9} {r['fraction']:5.0%} {r['estimate']:9} {r['rows_cached']:6.1%} "
              f"{r['bytes_of_table']:6.1%} {r['hit']:6.1%} {r['uncached_gbps']:8.2f} {r['cached_gbps']:8.2f} "
              f"{r['speedup']:7.2f} {r['exact']}")
    skewed = [r for r in results if r["stream"] != "uniform"]
    best = {}
    for r in skewed:
        k = (r["stream"], r["fraction"])
        best[k] = max(best.get(k, 0.0), r["speedup"])
    met = sum(1 for v in best.values() if v >= 2.0)
    uniform = [r["speedup"] for r in results if r["stream"] == "uniform"]
    print(f"# skewed streams: best estimate >= 2x uncached in {met}/{len(best)} (stream, size) cells; "
          f"geomean {math.exp(sum(math.log(v) for v in best.values()) / max(len(best), 1)):.2f}x")
    for estimate in sorted({r["estimate"] for r in skewed}):
        vals = [r["speedup"] for r in skewed if r["estimate"] == estimate]
        print(f"#   {estimate}: geomean {math.exp(sum(math.log(v) for v in vals) / len(vals)):.2f}x "
              f"over {len(vals)} cells")
    if uniform:
        print(f"# uniform: cached / uncached {min(uniform):.2f}-{max(uniform):.2f}x (target: no slower, >= ~0.95)")
    print(f"# exact in {sum(r['exact'] for r in results)}/{len(results)}")


def main(argv=None) -> int:
    args = parse(argv)
    results: list[dict] = []
    status = 0
    try:
        run(args, results)
    except KeyboardInterrupt:
        print("# interrupted: reporting what was measured", flush=True)
        status = 1
    except Exception as e:  # noqa: BLE001 - report what was measured, then fail
        print(f"# stopped by {type(e).__name__}: {e}", flush=True)
        status = 1
    finally:
        summary(results)
        if args.csv and results:
            with open(args.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(results[0]))
                w.writeheader()
                w.writerows(results)
    return status


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
