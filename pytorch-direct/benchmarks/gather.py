"""Gather/scatter bandwidth of unified tensors against the baselines, over row width x density x index order.

    python3 pytorch-direct/benchmarks/gather.py                       # full matrix, 16 GiB table
    python3 pytorch-direct/benchmarks/gather.py --row-bytes 128 1024 --densities 0.016 --no-scatter

One pinned table (--table-gib, default 16) is allocated once and viewed at each row width. Per cell, in one run:
  memcpy   pinned cudaMemcpy of the same number of bytes (the link's ceiling; host->device for gather,
           device->host for scatter)
  torch    gather: index_select on the CPU into a pinned buffer + non_blocking copy to the GPU;
           scatter: copy to a pinned buffer + index_copy_ on the CPU
  naive    one warp per row, 4-byte loads/stores (the PyTorch-Direct paper's baseline)
  auto     ours, strategy chosen by the calibration;  vector / sorted / staged / split: ours, forced
Reported number: useful GB/s = rows moved * row bytes / wall time (synchronised before and after each call).
Prints a table (ours/auto vs the best baseline and vs the ceiling), writes CSV and a PNG (GB/s vs row width).
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import signal
import sys
import time

import torch

import pytorch_direct as pd

GATHER_COLUMNS = ["memcpy", "torch", "naive", "auto", "vector", "sorted", "staged", "split"]
SCATTER_COLUMNS = ["memcpy", "torch", "naive", "auto", "vector", "sorted", "staged"]
BASELINES = ("torch", "naive")
# (label, dtype, row elements): float32 rows for every width, plus one bf16 and one odd width (47 B) row.
EXTRA_ROWS = [("bf16", torch.bfloat16, 128), ("f32x100", torch.float32, 100), ("u8x47", torch.uint8, 47)]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table-gib", type=float, default=16.0, help="size of the pinned table (default 16)")
    p.add_argument("--row-bytes", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--densities", type=float, nargs="+", default=[0.002, 0.016, 0.12],
                   help="batch rows / table rows (default 0.002 0.016 0.12)")
    p.add_argument("--orders", nargs="+", default=["random", "sorted"], choices=["random", "sorted"])
    p.add_argument("--no-extra", action="store_true", help="skip the bf16 and odd-width rows")
    p.add_argument("--no-scatter", action="store_true")
    p.add_argument("--columns", nargs="+", default=None, help="subset of columns (memcpy torch naive auto ...)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per column (after one warm-up)")
    p.add_argument("--min-time", type=float, default=0.25,
                   help="fewer repeats when one run takes longer than this (seconds)")
    p.add_argument("--calibration-repeats", type=int, default=3,
                   help="timed runs per calibration cell (best-of, default 3)")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting new cells after this many seconds")
    p.add_argument("--csv", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch and the staged strategy")
    return p.parse_args(argv)


def timed(fn, repeats: int, min_time: float) -> float:
    """Best-of wall time of fn with the device synchronised around each call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    runs = max(1, min(repeats, int(min_time * repeats / max(first, 1e-9))))
    best = math.inf
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def cells(args):
    out = []
    for rb in args.row_bytes:
        if rb % 4:
            raise SystemExit(f"--row-bytes {rb}: float32 rows need a multiple of 4; odd widths are in the extra rows")
        out.append(("f32", torch.float32, rb // 4))
    if not args.no_extra:
        out.extend(EXTRA_ROWS)
    return out


def column_functions(tab, utab, idx, idx_cpu, out, src, pin, flat_dev, flat_pin):
    """The timed function of every gather and scatter column of one cell."""

    def torch_gather():
        torch.index_select(tab, 0, idx_cpu, out=pin)
        out.copy_(pin, non_blocking=True)

    def torch_scatter():
        pin.copy_(src)  # synchronous D2H into the pinned buffer
        tab.index_copy_(0, idx_cpu, pin)

    gather_fns = {
        "memcpy": lambda: flat_dev.copy_(flat_pin, non_blocking=True),
        "torch": torch_gather,
        "naive": lambda: pd.gather(utab, idx, strategy="naive"),
    }
    for s in ("auto", "vector", "sorted", "staged", "split"):
        gather_fns[s] = functools.partial(pd.gather, utab, idx, strategy=s)
    scatter_fns = {
        "memcpy": lambda: flat_pin.copy_(flat_dev, non_blocking=True),
        "torch": torch_scatter,
        "naive": lambda: pd.scatter_(utab, idx, src, strategy="naive"),
    }
    for s in ("auto", "vector", "sorted", "staged"):
        scatter_fns[s] = functools.partial(pd.scatter_, utab, idx, src, strategy=s)
    return gather_fns, scatter_fns


def run(args, results: list[dict]) -> None:
    if not torch.cuda.is_available() or not pd.cuda_usable():
        raise SystemExit("gather.py needs a CUDA GPU and pytorch_direct built with CUDA")
    if args.threads:
        torch.set_num_threads(args.threads)
        pd.set_threads(args.threads)
    pd.set_bounds_check("async")  # measure the transfer, not a per-call host round trip; checked at the end
    device = torch.device("cuda")
    start = time.perf_counter()
    table_bytes = int(args.table_gib * (1 << 30))
    print(f"# device: {torch.cuda.get_device_name()} | table {args.table_gib} GiB pinned | torch threads "
          f"{torch.get_num_threads()}", flush=True)
    t0 = time.perf_counter()
    table = pd.empty(table_bytes, dtype=torch.uint8)  # pinned pages are zeroed and resident already
    print(f"# allocated the table in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    from pytorch_direct import _strategy

    # Measured on this table: at 16 GiB, GPU address translation slows small random rows in ways a small scratch
    # table would not show.
    if _strategy.load() is None:
        pd.calibrate(table=table, repeats=args.calibration_repeats)
    print(f"# calibration ready in {time.perf_counter() - t0:.1f} s ({_strategy.calibration_path()})", flush=True)
    data = _strategy.load() or {}
    for op in ("gather", "scatter"):
        for cell, bw in sorted(data.get(op, {}).items(), key=lambda kv: (int(kv[0].split(":")[0]),
                                                                         float(kv[0].split(":")[1]))):
            print(f"#   calibration {op:7} {cell:12} " + " ".join(f"{k}={v:.1f}" for k, v in bw.items()), flush=True)
    host = data.get("host_gather") or {}
    if host:
        print(f"#   calibration host gather (summed GB/s over 64/256/1024 B rows at 0.2 %): package threads "
              f"{host.get('native', 0.0):.1f}, torch index_select {host.get('torch', 0.0):.1f}: staged uses "
              f"{host.get('engine')}", flush=True)

    cpu_gather_check(table, table_bytes)

    max_density = max(args.densities)
    max_bytes = int(table_bytes * max_density) + (1 << 20)
    dev_buf = torch.empty(max_bytes, dtype=torch.uint8, device=device)
    src_buf = torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, device=device)
    pinned_buf = pd.empty(max_bytes, dtype=torch.uint8).as_subclass(torch.Tensor)
    plain_table = table.as_subclass(torch.Tensor)
    gen = torch.Generator(device=device).manual_seed(0)
    # Cheapest first (low density), so a time budget drops the most expensive cells, not whole row widths.
    specs = [(label, dtype, elems, o, d) for d in sorted(args.densities) for o in args.orders
             for (label, dtype, elems) in cells(args)]
    for k, (label, dtype, elems, order, density) in enumerate(specs):
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            print(f"# budget of {args.budget_s:.0f} s reached: {len(specs) - k} cells skipped", flush=True)
            break
        esize = torch.empty((), dtype=dtype).element_size()
        rb = elems * esize
        rows = table_bytes // rb
        n = max(1, int(rows * density))
        nbytes = n * rb
        tab = plain_table[: rows * rb].view(dtype).view(rows, elems)
        utab = tab.as_subclass(pd.UnifiedTensor)
        idx = torch.randint(0, rows, (n,), device=device, generator=gen)
        if order == "sorted":
            idx = torch.sort(idx).values
        idx_cpu = idx.cpu()
        out = dev_buf[:nbytes].view(dtype).view(n, elems)
        src = src_buf[:nbytes].view(dtype).view(n, elems)
        pin = pinned_buf[:nbytes].view(dtype).view(n, elems)
        flat_dev, flat_pin = dev_buf[:nbytes], pinned_buf[:nbytes]

        gather_fns, scatter_fns = column_functions(tab, utab, idx, idx_cpu, out, src, pin, flat_dev, flat_pin)
        ops = [("gather", GATHER_COLUMNS, gather_fns)]
        if not args.no_scatter:
            ops.append(("scatter", SCATTER_COLUMNS, scatter_fns))
        for op, columns, fns in ops:
            row = {"op": op, "dtype": label, "row_bytes": rb, "density": density, "order": order, "rows": n,
                   "mbytes": nbytes / 1e6}
            if op == "gather":
                row["auto_choice"] = _strategy.choose("gather", rb, n, rows)
            else:
                row["auto_choice"] = _strategy.choose("scatter", rb, n, rows)
            for col in columns:
                if args.columns and col not in args.columns:
                    continue
                try:
                    seconds = timed(fns[col], args.repeats, args.min_time)
                    row[col] = nbytes / seconds / 1e9
                except Exception as e:  # noqa: BLE001 - a failing column is reported, the run goes on
                    row[col] = float("nan")
                    print(f"# {op} {label} {rb} B {density} {order} {col}: {type(e).__name__}: {e}", flush=True)
                    if isinstance(e, pd.CudaError) or "CUDA error" in str(e):
                        # The context is probably lost (e.g. a memory fault): every later call would fail too.
                        results.append(row)
                        raise
            results.append(row)
        pd.check_errors()
        print(f"[{k + 1}/{len(specs)} {time.perf_counter() - start:5.0f} s] {label:7} {rb:5d} B "
              f"{density * 100:5.1f}% {order:6}  " + "  ".join(
                  f"{r['op'][0]}:{r.get('auto', float('nan')):.1f}" for r in results[-len(ops):]), flush=True)
    del table, pinned_buf


def cpu_gather_check(table, table_bytes: int) -> None:
    """Diagnostic line: the host-only gather (what the staged strategy does before its DMA) of ours against torch's
    index_select, both into pinned memory, at 0.2 % density. The staged column cannot beat the slower of this and
    the link."""
    print(f"# CPU: os.cpu_count() {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))} CPUs, torch threads "
          f"{torch.get_num_threads()}", flush=True)
    plain = table.as_subclass(torch.Tensor)
    for rb in (64, 256, 1024):
        ours, theirs = _cpu_gather_pair(plain, table_bytes, rb)
        print(f"# CPU gather {rb:5d} B rows, 0.2%: ours {ours:6.1f} GB/s, torch index_select {theirs:6.1f} GB/s",
              flush=True)


def _cpu_gather_pair(plain, table_bytes: int, rb: int) -> tuple[float, float]:
    from pytorch_direct import _core

    rows = table_bytes // rb
    n = max(1, int(rows * 0.002))
    tab = plain[: rows * rb].view(rows, rb)
    idx = torch.randint(0, rows, (n,))
    pin = pd.empty(n, rb, dtype=torch.uint8).as_subclass(torch.Tensor)

    def best(fn):
        fn()
        t = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            t = min(t, time.perf_counter() - t0)
        return n * rb / t / 1e9

    ours = best(lambda: _core.gather_host(tab.data_ptr(), rows, rb, idx.data_ptr(), 8, n, 0, pin.data_ptr(), 0))
    return ours, best(lambda: torch.index_select(tab, 0, idx, out=pin))


def _ratio(row):
    base = [row[c] for c in BASELINES if c in row and not math.isnan(row[c])]
    ours = row.get("auto", float("nan"))
    vs_base = ours / max(base) if base else float("nan")
    vs_ceiling = ours / row["memcpy"] if row.get("memcpy") else float("nan")
    return vs_base, vs_ceiling


def print_table(results):
    for op, columns in (("gather", GATHER_COLUMNS), ("scatter", SCATTER_COLUMNS)):
        rows = [r for r in results if r["op"] == op]
        if not rows:
            continue
        print(f"\n## {op}: useful GB/s (auto = ours; x base = auto / max(torch, naive); x ceil = auto / memcpy)")
        head = f"{'dtype':7} {'row B':>6} {'dens%':>5} {'order':6} " + " ".join(f"{c:>7}" for c in columns)
        head += f" {'choice':>7} {'x base':>6} {'x ceil':>6}"
        print(head)
        for r in rows:
            vb, vc = _ratio(r)
            print(f"{r['dtype']:7} {r['row_bytes']:6d} {r['density'] * 100:5.1f} {r['order']:6} "
                  + " ".join(f"{r.get(c, float('nan')):7.2f}" for c in columns)
                  + f" {r['auto_choice']:>7} {vb:6.2f} {vc:6.2f}")
        ok_base = sum(1 for r in rows if _ratio(r)[0] >= 1.1)
        print(f"# {op}: auto >= 1.1x best baseline in {ok_base}/{len(rows)} cells")
        big = [r for r in rows if r["row_bytes"] >= 1024]
        target = 0.9 if op == "gather" else 0.8
        ok_ceil = sum(1 for r in big if _ratio(r)[1] >= target)
        print(f"# {op}: auto >= {target}x memcpy for rows >= 1 KB in {ok_ceil}/{len(big)} cells")


def write_csv(results, path):
    keys = ["op", "dtype", "row_bytes", "density", "order", "rows", "mbytes", "auto_choice"] + [
        c for c in GATHER_COLUMNS]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow(r)


def write_png(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from _png import line_grid_png

        line_grid_png(results, path, GATHER_COLUMNS)
        print(f"# matplotlib missing: wrote an unlabelled plot to {path} (colours: {GATHER_COLUMNS})")
        return
    panels = sorted({(r["op"], r["density"], r["order"]) for r in results if r["dtype"] == "f32"})
    if not panels:
        return
    cols = 3
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, (op, density, order) in zip(axes.flat, panels, strict=False):  # more axes than panels
        rs = sorted((r for r in results if r["dtype"] == "f32" and (r["op"], r["density"], r["order"]) ==
                     (op, density, order)), key=lambda r: r["row_bytes"])
        for c in GATHER_COLUMNS:
            ys = [r.get(c, float("nan")) for r in rs]
            if all(math.isnan(y) for y in ys):
                continue
            ax.plot([r["row_bytes"] for r in rs], ys, marker="o", label=c, linewidth=2.5 if c == "auto" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op}, density {density * 100:g}%, {order} indices")
        ax.set_xlabel("row bytes")
        ax.set_ylabel("useful GB/s")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    args = parse(argv)
    results: list[dict] = []
    # A timeout (SIGTERM) still prints and saves what was measured.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    status = 0
    try:
        run(args, results)
    except KeyboardInterrupt:
        print("# interrupted: reporting the cells measured so far", flush=True)
        status = 1
    except Exception as e:  # noqa: BLE001 - report what was measured, then fail
        print(f"# stopped by {type(e).__name__}: {e}", flush=True)
        status = 1
    finally:
        print_table(results)
        if args.csv:
            write_csv(results, args.csv)
        if args.png and results:
            write_png(results, args.png)
    return status


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
