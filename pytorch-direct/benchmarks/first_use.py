"""What a new user waits for before the first gather: ``import pytorch_direct`` and making a large table.

    python3 pytorch-direct/benchmarks/first_use.py                    # import times, 64 GiB table vs memset
    python3 pytorch-direct/benchmarks/first_use.py --table-gib 8 --csv first_use.csv

Import: ``import torch`` and ``import pytorch_direct`` each in a fresh process (best of --repeats), and whether the
import loaded the CUDA driver or NVRTC (it must not: both wait for the first call that needs them).

Table: ``pd.empty`` and ``pd.zeros`` of --table-gib GiB (what ``memory="auto"`` gives: managed memory with a GPU)
against a parallel memset of the same bytes in new memory (``torch.empty`` + ``fill_`` on torch's threads: page
faults and one write per byte, the memory system's rate), one after the other in this process, each freed before
the next (the host needs the table's size free once, not twice; the time the free took is reported too). The
target: the table ready in <= 1.5x the memset's time.

Order: the memset, ``pd.empty``, the memset again, ``pd.empty`` again (each table's pages come from what the one
before freed, and the first of the run also from whatever the machine did before: the target compares the faster of
each pair), then the imports, then ``pd.zeros`` if --budget-s leaves time for it.
Each row is printed, and the CSV rewritten, as soon as it is measured: a run stopped by a time limit keeps what it
measured. Prints a table, writes CSV.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import subprocess
import sys
import time

IMPORT_PROBE = r"""
import sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import {module}
t2 = time.perf_counter()
maps = open("/proc/self/maps").read()
print(t2 - t0, t2 - t1, int("libcuda.so" in maps), int("libnvrtc" in maps))
"""


def import_time(module: str, repeats: int) -> tuple[float, float, bool, bool]:
    """(best seconds of `import module` in a fresh interpreter, best seconds of its own share: the time after
    `import torch` in the same interpreter, CUDA driver loaded, NVRTC loaded). The own share is timed in one
    process: the difference of two processes' totals swung by seconds with the state of the page cache."""
    best, own, cuda, nvrtc = float("inf"), float("inf"), False, False
    for _ in range(repeats):
        r = subprocess.run([sys.executable, "-c", IMPORT_PROBE.format(module=module)], capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"import {module} failed: {r.stderr[-2000:]}")
        seconds, after_torch, c, n = r.stdout.split()
        best, own = min(best, float(seconds)), min(own, float(after_torch))
        cuda, nvrtc = cuda or c == "1", nvrtc or n == "1"
    return best, own, cuda, nvrtc


def available_bytes() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    return 0


def memory_state() -> str:
    """The host memory a new table's pages come from: free, page cache, and free blocks of 2 MiB and more (what
    huge-page allocations need: where they are few, the kernel compacts memory first, which can make the same
    allocation several times slower)."""
    info = {}
    try:
        for line in open("/proc/meminfo"):
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) << 10
        large = 0
        for line in open("/proc/buddyinfo"):
            counts = [int(c) for c in line.split()[4:]]
            large += sum(c << (order + 12) for order, c in enumerate(counts) if order >= 9)
    except (OSError, ValueError):
        return "unknown"
    gib = 2**30
    return (f"free {info.get('MemFree', 0) / gib:.1f} GiB (in blocks of 2 MiB+: {large / gib:.1f}), page cache "
            f"{info.get('Cached', 0) / gib:.1f} GiB, available {info.get('MemAvailable', 0) / gib:.1f} GiB")


def huge_page_settings() -> str:
    out = []
    for name in ("enabled", "defrag"):
        try:
            text = open(f"/sys/kernel/mm/transparent_hugepage/{name}").read().split()
            out.append(f"{name} {next((w[1:-1] for w in text if w.startswith('[')), '?')}")
        except OSError:
            out.append(f"{name} unknown")
    return "transparent huge pages: " + ", ".join(out)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


TABLE_STEPS = ("parallel memset (torch.empty + fill_)", "pd.empty", "pd.zeros")
MEMSET_AGAIN = "parallel memset, again"
EMPTY_AGAIN = "pd.empty, again"


def against_memset(results: list[dict]) -> None:
    """x_memset of every table row: its time over the fastest memset's measured so far."""
    memsets = [r["seconds"] for r in results if r["what"] in (TABLE_STEPS[0], MEMSET_AGAIN)]
    for r in results:
        if "gbps" in r and memsets:
            r["x_memset"] = r["seconds"] / min(memsets)


def table_step(label: str, nbytes: int, what: str | None = None) -> dict:
    """Makes a table of `nbytes` the way `label` says, then frees it; both timed (the row is named `what`, default
    `label`). The first table of the process
    pays CUDA's start-up (~0.3-1 s) before anything is timed."""
    import torch

    import pytorch_direct as pd
    from pytorch_direct import _memory

    if not getattr(table_step, "started", False):
        pd.empty(1 << 20, dtype=torch.uint8)
        if pd.cuda_usable():
            torch.zeros(1, device="cuda")
        table_step.started = True

    def memset():
        t = torch.empty(nbytes, dtype=torch.uint8)
        t.fill_(0)
        return t

    make = {TABLE_STEPS[0]: memset, "pd.empty": lambda: pd.empty(nbytes, dtype=torch.uint8),
            "pd.zeros": lambda: pd.zeros(nbytes, dtype=torch.uint8)}[label]
    gc.collect()
    before = memory_state()
    seconds, t = timed(make)
    kind = "ordinary" if label == TABLE_STEPS[0] else (_memory.host_kind(t.plain()) or "pageable")
    t0 = time.perf_counter()
    del t
    gc.collect()
    return {"what": what or label, "gib": nbytes / 2**30, "seconds": seconds, "gbps": nbytes / seconds / 1e9,
            "memory": kind, "free_s": time.perf_counter() - t0, "host_before": before}


FIELDS = ["what", "gib", "seconds", "gbps", "x_memset", "free_s", "memory", "host_before"]


def write_csv(path: str | None, results: list[dict]) -> None:
    if path:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table-gib", type=float, default=64.0,
                   help='size of the table created with pd.empty / pd.zeros and the memset baseline')
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per import timing")
    p.add_argument("--budget-s", type=float, default=0,
                   help="seconds this run may take (0: no limit): pd.zeros, measured last, is skipped when what is "
                        "left would not cover its likely time")
    p.add_argument("--csv", default=None, help='also write the rows to this CSV file (after each row)')
    args = p.parse_args(argv)
    start = time.perf_counter()
    results: list[dict] = []

    def add(row: dict) -> None:
        """Each row printed and written as soon as it is measured: a run stopped by a time limit keeps them."""
        results.append(row)
        against_memset(results)
        if "gbps" in row:
            print(f"# [{time.perf_counter() - start:5.1f} s] {row['what']}: {row['gib']:.1f} GiB in "
                  f"{row['seconds']:.2f} s ({row['gbps']:.2f} GB/s, {row.get('x_memset', float('nan')):.2f}x the "
                  f"fastest memset so far), freed in {row['free_s']:.2f} s, {row['memory']} memory; host memory "
                  f"before: {row['host_before']}", flush=True)
        write_csv(args.csv, results)

    nbytes = int(args.table_gib * 2**30)
    room = int(available_bytes() * 0.85)
    if nbytes > room:
        print(f"# {args.table_gib:g} GiB does not fit in the {room / 2**30:.1f} GiB available: measuring "
              f"{room / 2**30:.1f} GiB", flush=True)
        nbytes = room // (1 << 20) << 20
    print(f"# {huge_page_settings()}", flush=True)
    # The table and its baseline first (the target that took longest), then the imports, then pd.zeros (new
    # managed memory is zero already: it should take what pd.empty took) if the time left allows.
    add(table_step(TABLE_STEPS[0], nbytes))
    add(table_step("pd.empty", nbytes))
    # The memset again: each table's pages come from what the one before it freed (the first one's from whatever
    # the machine did before), so the target compares with the faster of the two.
    add(table_step(TABLE_STEPS[0], nbytes, what=MEMSET_AGAIN))
    add(table_step("pd.empty", nbytes, what=EMPTY_AGAIN))
    torch_s, _, torch_cuda, torch_nvrtc = import_time("torch", args.repeats)
    pd_s, pd_own, cuda, nvrtc = import_time("pytorch_direct", args.repeats)
    # (torch's CUDA wheels preload NVRTC, and libraries that link the driver, in `import torch` itself: what
    # pytorch_direct adds is the difference)
    print(f"# import torch {torch_s:.2f} s, import pytorch_direct {pd_s:.2f} s (its own share, after import torch in "
          f"the same process: {pd_own:.2f} s);"
          f" the import loaded the CUDA driver: {'yes' if cuda else 'no'}, NVRTC: {'yes' if nvrtc else 'no'}; "
          f"import torch alone: {'yes' if torch_cuda else 'no'}, {'yes' if torch_nvrtc else 'no'}", flush=True)
    add({"what": "import torch", "seconds": torch_s, "memory": f"cuda={int(torch_cuda)} nvrtc={int(torch_nvrtc)}"})
    add({"what": "import pytorch_direct", "seconds": pd_s, "memory": f"cuda={int(cuda)} nvrtc={int(nvrtc)}"})
    add({"what": "import pytorch_direct after torch", "seconds": pd_own, "memory": "its own share"})
    made = min((r for r in results if r["what"] in ("pd.empty", EMPTY_AGAIN)), key=lambda r: r["seconds"])
    likely = 1.5 * (made["seconds"] + made["free_s"])
    left = args.budget_s - (time.perf_counter() - start)
    if args.budget_s and left < likely:
        print(f"# pd.zeros skipped: {left:.0f} s of the --budget-s {args.budget_s:g} left, it would likely take "
              f"{likely:.0f} s", flush=True)
    else:
        add(table_step("pd.zeros", nbytes))
    print("\n## first use")
    print(f"{'what':40} {'GiB':>6} {'seconds':>8} {'GB/s':>7} {'x memset':>8} {'free s':>6}  memory")
    for r in results:
        gib = f"{r['gib']:6.1f}" if "gib" in r else " " * 6
        extra = f"{r['gbps']:7.2f} {r['x_memset']:8.2f} {r['free_s']:6.2f}" if "gbps" in r else " " * 23
        print(f"{r['what']:40} {gib} {r['seconds']:8.2f} {extra}  {r.get('memory', '')}")
    print(f"# pd.empty (the faster of two): {made['x_memset']:.2f}x the faster memset's time (target <= 1.5x); "
          f"import pytorch_direct {pd_s:.2f} s (target < 1 s), of which import torch {pd_s - pd_own:.2f} s")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
