"""Probe P6 (benchmarks/RESULTS.md): does a table on 2 MiB pages read faster from the GPU than one from
cudaHostAlloc (4 KiB pages)? Run R: random 256 B rows read zero-copy at 27.9 GB/s (vector) from a 1 GiB table,
7.9 from 16 GiB and 7.1 from 48 GiB: address translation misses. Each table size is allocated both ways in turn
(one at a time: needs ~1x the largest table of host RAM), forced strategies timed on 1M uniform indices. Also
prints the machine's huge-page settings and how much of each allocation the kernel backed with huge pages.

    python3 pytorch-direct/benchmarks/probes/probe_hugepages.py [--gib 16 48]
"""

import argparse
import ctypes
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gather as G  # noqa: E402

import pytorch_direct as pd  # noqa: E402

HUGE = 2 << 20


def meminfo(key: str) -> int:
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    return -1


def thp_table(nbytes: int) -> torch.Tensor:
    """nbytes on 2 MiB-aligned memory advised MADV_HUGEPAGE, touched, registered with CUDA in place."""
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    rc = libc.madvise(raw.data_ptr() + start, nbytes, 14)  # MADV_HUGEPAGE
    view = raw[start:start + nbytes]
    view.zero_()
    print(f"#   madvise rc {rc} errno {ctypes.get_errno()}", flush=True)
    return pd.unified(view, copy=False).plain()


def alloc_table(nbytes: int) -> torch.Tensor:
    return pd.empty(nbytes, dtype=torch.uint8).plain()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, nargs="+", default=[16, 48], help='table sizes in GiB')
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024], help='row widths in bytes')
    p.add_argument("--strategies", nargs="+", default=["naive", "vector", "sorted", "staged"],
                   help='strategies to time on each table')
    args = p.parse_args(argv)
    for f in ("enabled", "defrag"):
        try:
            print(f"# THP {f}: {open('/sys/kernel/mm/transparent_hugepage/' + f).read().strip()}")
        except OSError as e:
            print(f"# THP {f}: {e}")
    print(f"# HugePages_Total {meminfo('HugePages_Total')} Hugepagesize {meminfo('Hugepagesize')} "
          f"MemTotal {meminfo('MemTotal') >> 30} GiB | {torch.cuda.get_device_name()}", flush=True)
    print("gib,alloc,row_bytes,pattern,strategy,gbps")
    for gib in args.gib:
        nbytes = int(gib * (1 << 30))
        for name, make in (("cudaHostAlloc", alloc_table), ("thp+register", thp_table)):
            huge0 = meminfo("AnonHugePages")
            t0 = time.perf_counter()
            flat = make(nbytes)
            G.mark(flat)
            made = time.perf_counter() - t0
            huge = meminfo("AnonHugePages") - huge0
            print(f"# {gib:g} GiB {name}: made in {made:.1f} s, AnonHugePages +{huge / (1 << 30):.1f} GiB",
                  flush=True)
            for rb in args.rows:
                tab = G.view_rows(flat, nbytes, rb)
                utab = tab.as_subclass(pd.UnifiedTensor)
                for pattern in ("uniform", "zipf0.8"):
                    count = G.count_for(1 << 20, rb, tab.shape[0], 1024)
                    idx = G.indices(pattern, count, tab.shape[0], G.cell_seed(gib, rb, pattern, count))
                    for s in args.strategies:
                        sec = G.best_of(lambda s=s, u=utab, i=idx: pd.gather(u, i, strategy=s), 2)
                        print(f"{gib:g},{name},{rb},{pattern},{s},{count * rb / sec / 1e9:.2f}", flush=True)
            del flat, tab, utab, idx
            gc.collect()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
